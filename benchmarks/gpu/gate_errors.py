"""Each variant's error against float64, case by case, beside the floor's (plain PyTorch at the precision).

    python3 benchmarks/gpu/gate_errors.py gemm_bn --mode train --precision bf16 --variants triton,cublas_epilogue

The gate says pass or fail; this says by how much, per input distribution, at the default shapes
(--shape-index) with default and randomized parameters, each variant in its first configuration. Beside the gate's distributions, "offset"
adds 8 to a randn input: columns whose common offset is far larger than their spread, where a
variant that rounds z before subtracting the batch mean loses digits the floor keeps.
The output's relative L2 error is printed, and with --grad each gradient's (a gradient that is
zero in exact arithmetic, gemm_bn's bias in training, reads 1 where it is exactly zero).
"""

import argparse
import copy
import json

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.tuning.gate import CheckCase, build_case, floor_output


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return round(((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item(), 7)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--mode", default="train")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--shape-index", type=int, default=0)
    ap.add_argument("--shape", help="k=v,... instead of a default shape (a CPU check of the script: small)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--grad", action="store_true", help="also the gradients of x and the parameters")
    args = ap.parse_args()
    prob = registry.get_problem(args.problem)
    shape = prob.default_shapes[args.shape_index]
    if args.shape:
        shape = {k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(","))}
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(device, args.problem, args.mode, args.precision, dict(shape), flush=True)
    cases = [(d, r) for d in ("rand", "randn", "large") for r in (False, True)] + [("offset", True)]
    for distribution, randomize in cases:
        case = CheckCase(dict(shape), "randn" if distribution == "offset" else distribution, 7, randomize)
        model, x = build_case(prob, case, args.device, torch.float32, args.mode)
        if distribution == "offset":
            x = x + 8.0
        x64, model64 = x.double().requires_grad_(args.grad), copy.deepcopy(model).double()
        ref = model64(x64)
        upstream = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, [x64, *model64.parameters()], upstream) if args.grad else ()
        row = {"case": f"{distribution} {'randomized' if randomize else 'default-init'}",
               "floor": relative(floor_output(model, x, args.precision), ref)}
        for name in args.variants.split(","):
            cls = registry.get_variant(args.problem, name)
            variant = cls(args.precision, **(cls.configs_for(shape, args.device, args.precision) or [{}])[0])
            mine, xv = copy.deepcopy(model), x.clone().requires_grad_(args.grad)
            with torch.set_grad_enabled(args.grad), math_mode(args.precision):
                out = variant(mine, xv)
                row[name] = relative(out, ref)
                if args.grad:
                    grads = torch.autograd.grad(out, [xv, *mine.parameters()], upstream.float(), allow_unused=True)
                    names = ["x"] + [n for n, _ in mine.named_parameters()]
                    row[f"{name} grads"] = {n: None if g is None else relative(g, r)
                                            for n, g, r in zip(names, grads, ref_grads)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
