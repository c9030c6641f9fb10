"""Is x rounded in the main loop right at every configuration of the space, not only the probed ones?

    python3 benchmarks/gpu/round_kernel_sweep.py [--part I/N] [--shape 1024,1000,8192] [--control]

round_kernel multiplies exactly the products round_host does (x rounded to TF32 to nearest), in
the same order, so each configuration's output and x's gradient must equal round_host's at the
same configuration bit for bit, on every run. With x's tile loaded through a tensor
descriptor (TMA) Triton 3.6 broke both: at 128×256×32 (8 warps) and 128×128×64 (4 warps) the
result changed from run to run, 1e-5 to 5e-4 off (a race between the copy engine's next stage and
the reads of this one, by all appearances), while the same kernels by pointer loads were exact.
So the space offers round_kernel with pointer loads only, and this sweeps every such
configuration (every tile, BLOCK_K, warp count, stage count, schedule) of each problem's triton
variant, three runs each, at a shape where persistent programs take several tiles: in training
mode with x requiring grad, comparing the output and x's gradient, so the kernels that also store
a tile (22's logits for the backward, gemm_bn's z) are the ones run. A first version ran under
no_grad (gemm_bn in eval) and missed those: W by TMA beside x by pointers passed it and then
failed the tuner's gradient gate (x's gradient 0.8 off at 1024×8192² on an H100). ``--control``
adds the two TMA configurations above: the sweep must call them wrong, or it proves nothing.
``--part`` splits the configurations across processes (compiling is most of the time).
"""

import argparse
import json

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.tuning.gate import CheckCase, build_case

CONTROLS = [{"block_m": 128, "block_n": 256, "block_k": 32, "stages": 3, "warps": 8, "group_m": 8,
             "persistent": True, "tma": True, "operands": "round_kernel"},
            {"block_m": 128, "block_n": 128, "block_k": 64, "stages": 3, "warps": 4, "group_m": 8,
             "persistent": True, "tma": True, "operands": "round_kernel"}]
PROBLEMS = ("matmul_clamp_lse_mish", "matmul_gelu_softmax", "gemm_bn")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="0/1")
    ap.add_argument("--shape", default="1024,1000,8192")
    ap.add_argument("--control", action="store_true")
    args = ap.parse_args()
    part, parts = map(int, args.part.split("/"))
    sizes = tuple(map(int, args.shape.split(",")))
    jobs = []
    for problem in PROBLEMS:
        prob = registry.get_problem(problem)
        shape = dict(zip(prob.dims, sizes))
        configs = [c for c in registry.get_variant(problem, "triton").configs_for(shape, "cuda", "tf32")
                   if c["operands"] == "round_kernel"]
        jobs += [(problem, shape, c, False) for c in configs]
        if args.control:
            jobs += [(problem, shape, c, True) for c in CONTROLS]
    for i, (problem, shape, config, control) in enumerate(jobs):
        if i % parts != part:
            continue
        prob = registry.get_problem(problem)
        model, x = build_case(prob, CheckCase(shape, "rand", 3, False), "cuda", torch.float32, "train")

        def output_and_grad(variant):
            xv = x.clone().requires_grad_()
            out = variant(model, xv)
            g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
            (grad,) = torch.autograd.grad(out, [xv], g)
            return torch.cat([out.detach().flatten(), grad.flatten()])

        try:
            with math_mode("tf32"):
                cls = registry.get_variant(problem, "triton")
                want = output_and_grad(cls("tf32", **{**config, "operands": "round_host"}))
                runs = [output_and_grad(cls("tf32", **config)) for _ in range(3)]
            torch.cuda.synchronize()
            error = max(((got - want).norm() / want.norm()).item() for got in runs)
            same = all(torch.equal(runs[0], got) for got in runs)
            outcome = "ok" if all(torch.equal(want, got) for got in runs) else "WRONG"
        except Exception as exc:  # noqa: BLE001 - a sweep records what fails and goes on
            error, same, outcome = None, None, f"error {type(exc).__name__}: {exc}"[:200]
        print(json.dumps({"problem": problem, "config": config, "control": control, "rel_diff": error,
                          "deterministic": same, "outcome": outcome}), flush=True)


if __name__ == "__main__":
    main()
