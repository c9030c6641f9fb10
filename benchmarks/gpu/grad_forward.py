"""Why a grad-mode forward of the exported ModelNew is slower than its no-grad forward.

    python3 benchmarks/gpu/grad_forward.py --table benchmarks/table.json [--precision fp32] [--problems kb2-22,...]

For each problem, the ModelNew that `autofuse export --kernelbench` writes (built as KernelBench's
harness builds it, ``kernelbench_harness.build``), called with grad mode on and under no_grad:
- the harness's time per call (CUDA events around one call, L2 thrashed before it);
- which variant serves: with grad on, the autograd entry for the first calls and, once
  ``autofuse.serve.grad_mode.SWITCH_AFTER`` calls have had no backward (the harness never runs one),
  the no-grad entry ("without_backward");
- the host's time per call: from the call until it returns, the GPU idle before it (a
  synchronize), so the Python and launch overhead a synchronised harness sees on top of the kernels;
- each kernel's device time per call (torch.profiler), so an extra kernel or a slower one shows;
- with ``--rounds N``: the harness's speedup in both modes over N alternating rounds, and the
  ratio grad / no_grad per round (one harness run per mode swings ±8% between runs; this pairs them).
One JSON line per problem and mode on stdout (and in --json).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import kernelbench_harness as harness  # noqa: E402


def host_ms(fn, inputs, calls=20) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*inputs)
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernels(fn, inputs, calls=10) -> list[tuple[str, float]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    rows = [(e.key[:70], round(e.device_time_total / calls / 1000.0, 4)) for e in prof.key_averages()]
    return sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])[:8]


def paired_rounds(model, model_new, inputs, rounds: int, trials: int = 20) -> dict:
    """The harness's speedup with grad on and under no_grad, measured in alternating rounds (each
    round: ModelNew then Model, ``trials`` harness calls each, per mode), so drift of the host or the
    clocks hits both modes alike. Medians and p20-p80 over rounds of each speedup and of their
    ratio grad / no_grad (issue 13's target: ≥ 1 within the noise)."""
    speedup, calls = {True: [], False: []}, {True: [], False: []}
    for r in range(rounds):
        for grad in ((True, False) if r % 2 == 0 else (False, True)):
            with torch.set_grad_enabled(grad):
                times = harness.time_calls(model_new, inputs, trials, "cuda")
                ref = statistics.fmean(harness.time_calls(model, inputs, trials, "cuda"))
            speedup[grad].append(ref / statistics.fmean(times))
            calls[grad] += times
    ratio = [g / n for g, n in zip(speedup[True], speedup[False])]

    def trials_ms(values):
        # The harness averages: a few slow calls move its number more than the typical one.
        q = statistics.quantiles(values, n=10)
        return {"mean": round(statistics.fmean(values), 4), "p10": round(q[0], 4), "median": round(statistics.median(values), 4),
                "p90": round(q[8], 4), "max": round(max(values), 4)}

    def spread(values):
        q = statistics.quantiles(values, n=5)
        return {"median": round(statistics.median(values), 4), "p20": round(q[0], 4), "p80": round(q[3], 4)}
    return {"rounds": rounds, "speedup_grad": spread(speedup[True]), "speedup_no_grad": spread(speedup[False]),
            "grad_over_no_grad": spread(ratio), "model_new_ms_grad": trials_ms(calls[True]),
            "model_new_ms_no_grad": trials_ms(calls[False])}


def host_profile(fn, inputs, calls=50, top=14) -> str:
    """cProfile of ``calls`` calls, each after a synchronize: where the host's time goes."""
    profile = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        profile.enable()
        fn(*inputs)
        profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--problems", default="kb2-22,kb2-99,kb2-39,kb2-51")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/grad_forward"))
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--cprofile", action="store_true", help="also print a cProfile of each mode's calls")
    ap.add_argument("--rounds", type=int, default=0, help="also the harness's speedups in alternating rounds")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for problem in args.problems.split(","):
        custom = harness.export(problem, args.precision, args.table, args.out, small=False)
        model, model_new, get_inputs = harness.build(custom.split(harness.MARKER)[0], custom, 0, "cuda", torch.float32)
        harness.set_seed(0, "cuda")
        inputs = harness.inputs_of(get_inputs, "cuda", torch.float32)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                events = harness.time_calls(model_new, inputs, 20, "cuda")
                info = model_new.dispatch_info(inputs[0])
                line = {"problem": problem, "grad": grad, "precision": args.precision, "dispatch": info["variant"],
                        # grad mode, after grad_mode.SWITCH_AFTER calls without a backward: the no-grad entry
                        "without_backward": info.get("without_backward", {}).get("variant"),
                        "harness_ms": round(statistics.median(events), 4), "host_ms": round(host_ms(model_new, inputs), 4),
                        "reference_host_ms": round(host_ms(model, inputs), 4), "kernels": kernels(model_new, inputs)}
            print(json.dumps(line), flush=True)
            if args.cprofile:
                with torch.set_grad_enabled(grad):
                    print(f"-- cProfile, {problem}, grad={grad}\n" + host_profile(model_new, inputs), flush=True)
            lines.append(line)
        if args.rounds:
            line = {"problem": problem, "precision": args.precision, **paired_rounds(model, model_new, inputs, args.rounds)}
            print(json.dumps(line), flush=True)
            lines.append(line)
    if args.json:
        args.json.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
