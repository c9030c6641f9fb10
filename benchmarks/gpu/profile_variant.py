"""Where a variant's time goes on the GPU: each kernel's device time per call, and the floor's.

    python3 benchmarks/gpu/profile_variant.py matmul_clamp_lse_mish cublas_epilogue --precision bf16 [--params block=128]
        [--dtype bfloat16] [--batch 1]

Runs the variant at the problem's default shape (KernelBench's inputs; ``--batch``: at another
batch) under torch.profiler, the L2 flushed before each call as in `autofuse.tuning.timing`
(whose kernels, profiled alone, are subtracted), and prints the kernels' average
device time per call next to cuBLAS alone at that precision (the bench's floor) and the input
cast. For the question "the parts add to less than the whole: where is the rest?". With
``--dtype bfloat16``, a bfloat16 model: beside the floor, linear with its bias (the reference's own
GEMM, which the cublas_epilogue variants start from) and the eager bfloat16 model.
"""

import argparse

import torch

from autofuse.core import registry
from autofuse.tuning import timing
from autofuse.tuning.gate import CheckCase, build_case


def kernel_times(fn, device, calls=30) -> list[tuple[str, float]]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            timing._flush_l2(device)
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / calls / 1000.0) for e in prof.key_averages()]
    return sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])


def without_flush(kernels: list[tuple[str, float]], flush: dict[str, float]) -> float:
    """The kernels' total per call, less the L2 flush's (``flush``: its kernels' times a call, from
    ``kernel_times`` of the flush alone; a variant's own use of the same kernel stays counted)."""
    return sum(t for _, t in kernels) - sum(flush.values())


def _value(text: str):
    """A --params value as the table writes it: an int, true or false, else the string."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("variant")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--mode", default="train")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--params", default="",
                    help="k=v,... (ints, true/false, strings; default: the variant's default configuration)")
    ap.add_argument("--batch", type=int, help="the batch (default: the default shape's)")
    args = ap.parse_args()
    prob = registry.get_problem(args.problem)
    shape = dict(prob.default_shapes[0])
    if args.batch:
        shape[prob.batch_dim] = args.batch
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    model, x = build_case(prob, CheckCase(shape, "rand", 0, False), device, dtype, args.mode)
    cls = registry.get_variant(args.problem, args.variant)
    params = (dict((k, _value(v)) for k, v in (p.split("=") for p in args.params.split(",") if p))
              or cls.configs_for(shape, "cuda", args.precision)[0])
    variant = cls(args.precision, **params)
    variant.build("cuda")
    weight = prob.linear_of(model).weight.detach() if prob.floor == "gemm" else None
    with torch.no_grad():
        parts = {f"{args.variant} {params}": lambda: variant(model, x)}
        if weight is not None and dtype == torch.bfloat16:
            linear = prob.linear_of(model)
            parts["floor: bf16 GEMM alone"] = lambda: x @ weight.t()
            parts["linear with its bias (the reference's GEMM)"] = lambda: linear(x)
            parts["eager bfloat16 model"] = lambda: model(x)
        elif weight is not None and args.precision == "bf16":
            xb, wb = x.bfloat16(), weight.bfloat16()
            parts["floor: bf16 GEMM alone"] = lambda: xb @ wb.t()
            parts["cast x to bf16"] = x.bfloat16
        elif weight is not None:
            torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
            parts[f"floor: GEMM alone ({args.precision})"] = lambda: x @ weight.t()
        flush = dict(kernel_times(lambda: None, device))
        for name, fn in parts.items():
            kernels = kernel_times(fn, device)
            print(f"== {name}: {without_flush(kernels, flush):.4f} ms of kernels a call (L2 flush excluded)")
            for key, t in kernels:
                print(f"  {t:8.4f} ms  {key[:110]}")
        timed = timing.time_interleaved(parts, device, rounds=10)
        for name, t in timed.items():
            print(f"timed (events, interleaved): {name}: {t.median_ms:.4f} [{t.p20_ms:.4f}-{t.p80_ms:.4f}]")


if __name__ == "__main__":
    main()
