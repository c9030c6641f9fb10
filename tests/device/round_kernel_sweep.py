"""Is x rounded in the main loop right at every configuration of the space, not only the probed ones?

    python3 tests/device/round_kernel_sweep.py [--part I/N] [--shape 1024,1000,8192]

round_kernel multiplies exactly the products round_host does (x rounded to TF32 to nearest), so
each configuration's output must equal, to float32 accumulation order (~1e-7), that of round_host
at one fixed configuration, and be the same on every call. When x's own tile came through a
tensor descriptor (TMA) and was rounded in registers, Triton 3.6 broke both: at 128×256×32
(8 warps) and 128×128×64 (4 warps) the result changed from call to call, 1e-5 to 1e-1 off, while
the same kernels by pointer loads were exact. This sweep called 4 of those 6 cases wrong (log
2026-11-24b-4). Since then x always comes by pointers under round_kernel, and "tma" means W
alone through its descriptor. The sweep runs every round_kernel configuration (every tile,
BLOCK_K, warp count, stage count, schedule, W's load) of each problem's triton variant, three
calls each, at a shape where persistent programs take several tiles. ``--part`` splits the
configurations across processes (compiling is most of the time).
"""

import argparse
import json

import torch

from autofuse import registry
from autofuse.precision import math_mode
from autofuse.verify import CheckCase, build_case

BOUND = 2e-6  # relative L2 difference from round_host at the reference configuration
REFERENCE = {"block_m": 128, "block_n": 128, "block_k": 32, "stages": 3, "warps": 4, "group_m": 8,
             "persistent": True, "tma": False, "operands": "round_host"}
PROBLEMS = ("matmul_clamp_lse_mish", "matmul_gelu_softmax", "gemm_bn")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="0/1")
    ap.add_argument("--shape", default="1024,1000,8192")
    args = ap.parse_args()
    part, parts = map(int, args.part.split("/"))
    sizes = tuple(map(int, args.shape.split(",")))
    jobs = []
    for problem in PROBLEMS:
        prob = registry.get_problem(problem)
        shape = dict(zip(prob.dims, sizes))
        configs = [c for c in registry.get_variant(problem, "triton").configs_for(shape, "cuda", "tf32")
                   if c["operands"] == "round_kernel"]
        jobs += [(problem, shape, c) for c in configs]
    references = {}
    for i, (problem, shape, config) in enumerate(jobs):
        if i % parts != part:
            continue
        prob = registry.get_problem(problem)
        model, x = build_case(prob, CheckCase(shape, "rand", 3, False), "cuda", torch.float32, "eval")
        try:
            with torch.no_grad(), math_mode("tf32"):
                if problem not in references:
                    references[problem] = registry.get_variant(problem, "triton")("tf32", **REFERENCE)(model, x)
                want = references[problem]
                variant = registry.get_variant(problem, "triton")("tf32", **config)
                runs = [variant(model, x).clone() for _ in range(3)]
            torch.cuda.synchronize()
            error = max(((got - want).norm() / want.norm()).item() for got in runs)
            same = all(torch.equal(runs[0], got) for got in runs)
            outcome = "ok" if error <= BOUND and same else "WRONG"
        except Exception as exc:  # noqa: BLE001 - a sweep records what fails and goes on
            error, same, outcome = None, None, f"error {type(exc).__name__}: {exc}"[:200]
        print(json.dumps({"problem": problem, "config": config, "rel_diff": error,
                          "deterministic": same, "outcome": outcome}), flush=True)


if __name__ == "__main__":
    main()
