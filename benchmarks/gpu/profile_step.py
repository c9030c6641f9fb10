"""Where a training step's time goes, variant beside variant: each kernel's device time per step.

    python3 benchmarks/gpu/profile_step.py matmul_clamp_lse_mish --precision tf32 \
        [--mode train] [--variants triton,compiled,cublas_epilogue] [--table benchmarks/table.json] [--shape-index 1]
        [--batch 64] [--dtype bfloat16] [--variants compiled:mode=max-autotune-no-cudagraphs,compiled]

At one of the problem's default shapes (KernelBench's inputs; ``--batch``: at another batch, with
that shape's recorded parameters), each variant runs the training step
the tuner and ``autofuse bench --step backward`` time (``autofuse.tuning.timed_call.training_call``) with the
parameters its table record has for the autograd key (the entry's own if it won, else its
``candidates`` record), or its default configuration. Printed per variant: the kernels' device
time per step (L2 flushed before each step, the flush excluded), the host's time to issue one
step (no synchronisation: what a caller waits before the GPU has the work), with ``--cprofile N``
where that host time goes, and then all of them timed interleaved with CUDA events. For "the
parts add to less than the whole" and "which kernel does torch.compile not have".
"""

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from profile_variant import kernel_times, without_flush  # this folder: the script's own path

from autofuse.core import registry
from autofuse.core.precision import parse_dtype
from autofuse.serve.table import DispatchKey, shape_key
from autofuse.tuning import timing
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.timed_call import training_call


def recorded_params(table: str | None, problem: str, shape: dict, mode: str, precision: str, variant: str,
                    dtype: str = "float32"):
    """The variant's parameters in the table's autograd entry for this key, or None."""
    if not table:
        return None
    dkey = DispatchKey(dtype, precision, mode, autograd=True).to_str()
    for device in json.load(open(table)).get("devices", {}).values():
        entry = device.get("problems", {}).get(problem, {}).get(shape_key(shape), {}).get(dkey)
        if entry is None:
            continue
        if entry.get("variant") == variant:
            return entry.get("params", {})
        if variant in entry.get("candidates", {}):
            return entry["candidates"][variant].get("params", {})
    return None


def _override(item: str):
    """``key=value`` as (key, value), the value read as JSON where it parses (numbers, booleans)."""
    key, _, value = item.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def host_ms(step, steps=20) -> float:
    """Median host time to issue one step, each started on an idle GPU."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000.0)
    return sorted(times)[len(times) // 2]


def host_profile(step, steps: int, top: int = 25) -> str:
    """cProfile over ``steps`` steps, the GPU synchronized before each (as ``host_ms``): the
    functions with the most own time, per step."""
    profile = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        profile.enable()
        step()
        profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return f"  host profile, {steps} steps (times are totals):\n" + text.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--mode", default="train")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the model's dtype (bfloat16: model.bfloat16() on bfloat16 inputs, under bf16)")
    ap.add_argument("--variants", default="triton,compiled,cublas_epilogue",
                    help="comma-separated; NAME:key=value:key=value overrides the recorded parameters")
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--shape-index", type=int, default=0, help="which of the problem's default shapes")
    ap.add_argument("--batch", type=int, default=None,
                    help="run at this batch instead (parameters still from the default shape's entry)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also profile the host over N steps per variant (cProfile, top functions by own time)")
    args = ap.parse_args()
    prob = registry.get_problem(args.problem)
    tuned = dict(prob.default_shapes[args.shape_index])
    shape = tuned if args.batch is None else {**tuned, prob.batch_dim: args.batch}
    device = torch.device("cuda")
    mode = args.mode if prob.mode_sensitive else "any"
    steps = {}
    for spec in args.variants.split(","):
        name, *overrides = spec.split(":")
        model, x = build_case(prob, CheckCase(shape, "rand", 0, False), device, parse_dtype(args.dtype), args.mode)
        cls = registry.get_variant(args.problem, name)
        params = recorded_params(args.table, args.problem, tuned, mode, args.precision, name, args.dtype)
        params = cls.configs(shape, "cuda")[0] if params is None else params
        params = {**params, **dict(_override(item) for item in overrides)}
        variant = cls(args.precision, **params)
        variant.build("cuda")
        steps[f"{name} {params}"] = training_call(variant, model, x, precision=args.precision)
    flush = dict(kernel_times(lambda: None, device, calls=20))
    for label, step in steps.items():
        kernels = kernel_times(step, device, calls=20)
        print(f"== {label}: {without_flush(kernels, flush):.4f} ms of kernels a step (L2 flush excluded), "
              f"host issues a step in {host_ms(step):.3f} ms", flush=True)
        for key, t in kernels:
            print(f"  {t:8.4f} ms  {key[:170]}")
        if args.cprofile:
            print(host_profile(step, args.cprofile), flush=True)
    for label, t in timing.time_interleaved(steps, device, rounds=10).items():
        print(f"timed (events, interleaved): {label}: {t.median_ms:.4f} [{t.p20_ms:.4f}-{t.p80_ms:.4f}]")


if __name__ == "__main__":
    main()
