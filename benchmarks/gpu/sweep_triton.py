"""An exhaustive sweep of the ``triton`` variant's space at one key, against what a tune chose.

    python3 benchmarks/gpu/sweep_triton.py matmul_gelu_softmax --precision fp32 --table TABLE [--out DIR]

Issue 33's quality check: the quick search's choice must be within 3% of the best configuration
of the whole space. Every configuration the tuner may try (``configs_for``: 616 at fp32 for 99 at
1024×8192²) is first compiled in parallel processes (``--jobs``; ``prewarm.compile_candidate``,
the tuner's own: into Triton's cache, nothing launched), then timed in this process one by one exactly as a trial times it
(``autofuse.tuning.evaluate``, not gated: the tune gated its choice). The sweep's ten fastest and
the table's forward entry for the key are then re-timed side by side (interleaved rounds) and
compared there. Prints the summary; DIR/sweep-triton-<problem>-<precision>.json keeps every time.
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import pathlib
import sys
import time

import torch

from autofuse.core import registry
from autofuse.tuning import evaluate, prewarm
from autofuse.tuning.outcome import Candidate, Job

VARIANT = "triton"


def table_choice(path: str, problem: str, shape: dict, precision: str) -> dict | None:
    """The forward entry's configuration for the key in the table at ``path`` (any device)."""
    skey = ",".join(f"{k}={v}" for k, v in shape.items())
    dkey = f"dtype=float32,precision={precision},mode=any,autograd=false"
    for device in json.loads(pathlib.Path(path).read_text()).get("devices", {}).values():
        entry = device.get("problems", {}).get(problem, {}).get(skey, {}).get(dkey)
        if entry is not None and entry.get("variant") == VARIANT:
            return dict(entry["params"])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--table", required=True, help="the tune's table: its forward entry for the key is compared")
    ap.add_argument("--jobs", type=int, default=16, help="processes compiling at once")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    prob = registry.get_problem(args.problem)
    shape = dict(prob.default_shapes[0])
    configs = registry.get_variant(prob.name, VARIANT).configs_for(shape, "cuda", args.precision)
    chosen = table_choice(args.table, prob.name, shape, args.precision)
    if chosen is None:
        sys.exit(f"{args.table} has no triton forward entry for {prob.name} {shape} at {args.precision}")
    print(f"{torch.cuda.get_device_name()}: {len(configs)} configurations of {prob.name} {shape} {args.precision}",
          flush=True)

    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        compiled = list(pool.map(prewarm.compile_candidate, *zip(*[
            (prob.name, "cuda", "float32", "any", args.precision, VARIANT, c, shape) for c in configs])))
    compile_s = time.perf_counter() - start
    print(f"compiled in {compile_s:.0f} s ({compiled.count(False)} failed to compile)", flush=True)

    job = Job(prob.name, shape, "cuda", "float32", args.precision, "any", seed=0, budget_ms=100.0)
    state, rows = {}, []
    for i, config in enumerate(configs):
        result = evaluate.evaluate(state, job, Candidate(VARIANT, config), None, False)
        rows.append({"params": config, "outcome": result.outcome.value, "reason": result.reason,
                     "median_ms": result.timing.median_ms if result.timing else None})
        if i % 100 == 0:
            print(f"  {i}/{len(configs)} timed, {time.perf_counter() - start:.0f} s", flush=True)
    timed = sorted((r for r in rows if r["median_ms"] is not None), key=lambda r: r["median_ms"])

    top = [Candidate(VARIANT, r["params"]) for r in timed[:10]]
    mine = Candidate(VARIANT, chosen)
    side = evaluate.retime(state, job, top + ([] if mine.label() in {c.label() for c in top} else [mine]), rounds=30)
    best_label = min((c.label() for c in top), key=lambda label: side[label].median_ms)
    best, ours = side[best_label], side[mine.label()]
    rank = next((i for i, r in enumerate(timed) if r["params"] == chosen), None)
    summary = {
        "device": torch.cuda.get_device_name(), "problem": prob.name, "shape": shape, "precision": args.precision,
        "configs": len(configs), "timed": len(timed), "compile_s": round(compile_s, 1),
        "wall_s": round(time.perf_counter() - start, 1), "sweep_best": best_label, "sweep_best_ms": best.median_ms,
        "sweep_best_p20_p80": [best.p20_ms, best.p80_ms], "chosen": mine.label(), "chosen_ms": ours.median_ms,
        "chosen_p20_p80": [ours.p20_ms, ours.p80_ms], "chosen_over_best": ours.median_ms / best.median_ms,
        "chosen_rank_in_sweep": rank,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sweep-triton-{prob.name}-{args.precision}.json").write_text(
        json.dumps({**summary, "rows": rows}, indent=0) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
