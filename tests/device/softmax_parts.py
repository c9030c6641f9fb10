"""matmul_clamp_lse_mish at bf16: does saving the softmax factors (bfloat16) instead of the logits
(float32) pay? The Triton variant's forward with a gradient needed, and its training step, both ways.

    python3 tests/device/softmax_parts.py [--table benchmarks/table.json] [--rounds 20]

The configuration is the shipped table's triton entry for the bf16 autograd key (else the first).
Timed interleaved (``autofuse.tuning.timing``, L2 flushed): the forward under no_grad (nothing saved),
the forward with grad on (the output's graph dropped), and forward + backward with an upstream
gradient of ones; ``saves_softmax_parts`` on and off. Kernel times per call from torch.profiler
for the grad-on forward. One JSON line per measurement.
"""

import argparse
import json

import torch
from ncu_gemm import tabled_params

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.tuning import timing
from autofuse.tuning.gate import CheckCase, build_case

PROBLEM = "matmul_clamp_lse_mish"


def kernels(fn, calls=10):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:50], round(e.device_time_total / calls / 1000.0, 4)) for e in prof.key_averages()]
    return sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])[:6]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    prob = registry.get_problem(PROBLEM)
    cls = registry.get_variant(PROBLEM, "triton")
    shape = prob.default_shapes[0]
    params = tabled_params(PROBLEM, dict(shape), "bf16", "train") or cls.configs_for(shape, "cuda", "bf16")[0]
    model, x = build_case(prob, CheckCase(dict(shape), "rand", 0, False), "cuda", torch.float32, "train")
    print(torch.cuda.get_device_name(), PROBLEM, dict(shape), params, flush=True)
    fns = {}
    for parts in (True, False):
        variant = cls("bf16", **params)
        variant.saves_softmax_parts = parts
        name = "softmax parts" if parts else "logits"

        def forward(v=variant):
            with math_mode("bf16"):
                return v(model, x)

        def no_grad(f=forward):
            with torch.no_grad():
                return f()

        def step(f=forward):
            for p in model.parameters():
                p.grad = None  # each step writes fresh gradients, as after optimizer.zero_grad()
            f().sum().backward()

        fns[f"forward no_grad ({name})"] = no_grad
        fns[f"forward grad ({name})"] = forward
        fns[f"step ({name})"] = step
        print(json.dumps({"kernels, forward grad": name, "ms": kernels(forward)}), flush=True)
        print(json.dumps({"kernels, step": name, "ms": kernels(step)}), flush=True)
    times = timing.time_interleaved(fns, "cuda", rounds=args.rounds)
    print(json.dumps({"ms": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                             for k, t in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
