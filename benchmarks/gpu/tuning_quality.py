"""Tuning quality on the GPU: an exhaustive sweep of one variant's space, then repeated tunes.

    python3 benchmarks/gpu/tuning_quality.py matmul_gelu_softmax --out DIR [--skip-sweep]

1. Sweep: every valid configuration of ``cuda_templated`` is built (in parallel), gated and
   timed in the tuning worker, exactly as a trial is; the results are written to
   DIR/sweep-<problem>.json, which tests/data keeps so the CPU tests can replay the search.
2. Repeats: three tunes of that variant alone (40 trials, seeds 1-3) and three of every
   variant, each in a fresh study; each choice is compared with the sweep's best.
"""

import argparse
import json
import pathlib
import time

import optuna
import torch

from autofuse import tune
from autofuse.core import registry
from autofuse.kernels.build import build_many
from autofuse.tuning.worker import Candidate, Job, Worker

VARIANT = "cuda_templated"


def sweep(problem, shape, out: pathlib.Path, resume: pathlib.Path | None = None) -> dict:
    configs = registry.get_variant(problem, VARIANT).configs(shape, "cuda")
    rows = json.loads(resume.read_text())["configs"] if resume and resume.exists() else []
    done = [r["params"] for r in rows]
    configs = [c for c in configs if c not in done]  # a sweep cut short goes on where it stopped
    start = time.perf_counter()
    build_many([b for c in configs for b in registry.get_variant(problem, VARIANT)("fp32", **c).kernel_builds("cuda")])
    built = time.perf_counter() - start
    job = Job(problem, shape, "cuda", "float32", "fp32", "any", seed=0, budget_ms=150.0)
    with Worker() as worker:
        for i, config in enumerate(configs):
            result = worker.call("evaluate", (job, Candidate(VARIANT, config)), 120.0)
            rows.append({"params": config, **result.to_dict()})
            if i % 50 == 0:  # partial results survive a run cut short
                _write(out, problem, shape, rows, built)
                print(f"  {i}/{len(configs)} {config} {result.outcome.value} "
                      f"{result.timing.median_ms if result.timing else ''}", flush=True)
    return _write(out, problem, shape, rows, built)


def _write(out, problem, shape, rows, built) -> dict:
    data = {"problem": problem, "shape": shape, "variant": VARIANT, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "build_s": round(built, 1), "configs": rows}
    (out / f"sweep-{problem}.json").write_text(json.dumps(data, indent=0) + "\n")
    return data


def best_of(data) -> tuple[dict, float]:
    ok = [r for r in data["configs"] if r["outcome"] == "ok"]
    best = min(ok, key=lambda r: r["timing"]["median_ms"])
    return best["params"], best["timing"]["median_ms"]


def repeats(problem, shape, out, data, variants, label):
    times = {json.dumps(r["params"], sort_keys=True): r["timing"]["median_ms"]
             for r in data["configs"] if r["outcome"] == "ok"} if data else {}
    best = best_of(data)[1] if data else None
    lines = []
    for seed in (1, 2, 3):
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(out / f"study-{label}-{seed}.journal")))
        start = time.perf_counter()
        result = tune(problem, shape, n_trials=40, seed=seed, variants=variants, storage=storage,
                      table=str(out / f"table-{label}.json"), autograd_entry=False, progress=False)[0]
        winner = result.winner
        swept = times.get(json.dumps(winner["params"], sort_keys=True))
        ratio = f"{swept / best:.3f}x sweep best" if swept and best else "-"
        lines.append(f"{label} seed={seed}: {winner['variant']} {winner['params']} {winner['median_ms']:.4f} ms "
                     f"(sweep: {swept}) {ratio}; {time.perf_counter() - start:.0f} s")
        print(lines[-1], flush=True)
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--out", default="gpu-out")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--resume", type=pathlib.Path, help="an earlier, partial sweep JSON to complete")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prob = registry.get_problem(args.problem)
    shape = dict(prob.default_shapes[-1])
    data = None
    if not args.skip_sweep:
        start = time.perf_counter()
        data = sweep(prob.name, shape, out, args.resume)
        params, ms = best_of(data)
        n_ok = sum(r["outcome"] == "ok" for r in data["configs"])
        print(f"sweep: {n_ok}/{len(data['configs'])} ok, best {params} {ms:.4f} ms, {time.perf_counter() - start:.0f} s")
    summary = repeats(prob.name, shape, out, data, [VARIANT], "templated")
    summary += repeats(prob.name, shape, out, data, None, "all")
    (out / "tuning_quality.txt").write_text("\n".join(summary) + "\n")


if __name__ == "__main__":
    main()
