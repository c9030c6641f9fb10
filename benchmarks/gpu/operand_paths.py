"""Where should x be converted (bf16) or rounded (tf32)? The triton variants' forward with each operand path.

    python3 benchmarks/gpu/operand_paths.py [--precision bf16|tf32|fp32] [--rounds 20]

For each triton key at its default shapes (22, 99, gemm_bn eval and train), the configuration the
shipped table recorded for triton (else the default) is run with each operand path of the
precision, with and without TMA, timed interleaved (``autofuse.tuning.timing``, L2 flushed), under
no_grad: the forward a tune times. cuBLAS's GEMM alone at the precision (bf16: on pre-cast
operands) is the floor. The float16 paths also run at BLOCK_K 64 and (scaled_fp16) at bf16's
tabled tiles. Prints one JSON line per key. Rerun it when an operand path is added to
``autofuse.kernels.triton.variant.OPERANDS`` or the Triton version changes: it is how that
space was chosen (bf16's in-kernel ``convert`` lost to ``cast_pass`` and left it; tf32's
``round_kernel`` against ``round_host``; the float16 paths, split_fp16 under fp32 and
scaled_fp16 under tf32).
"""

import argparse
import json

import torch
from ncu_gemm import tabled_params

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.kernels.triton.variant import OPERANDS
from autofuse.tuning import timing
from autofuse.tuning.gate import CheckCase, build_case

KEYS = [("matmul_clamp_lse_mish", "train"), ("matmul_gelu_softmax", "train"), ("gemm_bn", "eval"),
        ("gemm_bn", "train")]


TILE_KEYS = ("block_m", "block_n", "block_k", "stages", "warps")


def tile_choices(problem, shape, mode, base, kernel_mode):
    """The tabled tiles ({}), and for the float16 modes (2 bytes an element, twice TF32's rate)
    also BLOCK_K 64 and, for one product, the tiles the table gave bf16."""
    choices = [{}]
    if kernel_mode in ("fp16", "3xfp16"):
        choices.append({"block_k": 64})
        choices.append({"block_k": 64, "stages": 4})
    if kernel_mode == "fp16":
        bf16 = tabled_params(problem, dict(shape), "bf16", mode)
        if bf16:
            choices.append({k: bf16[k] for k in TILE_KEYS})
    return [c for c in choices if any(base.get(k) != v for k, v in c.items()) or not c]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    paths = [name for name, (served, *_) in OPERANDS.items() if served == args.precision]
    print(torch.cuda.get_device_name(), args.precision, paths, flush=True)
    for problem, mode in KEYS:
        prob = registry.get_problem(problem)
        cls = registry.get_variant(problem, "triton")
        for shape in prob.default_shapes:
            valid = cls.configs_for(shape, "cuda", args.precision)
            base = tabled_params(problem, dict(shape), args.precision, mode) or valid[0]
            model, x = build_case(prob, CheckCase(dict(shape), "rand", 0, False), "cuda", torch.float32, mode)
            fns = {}
            for operands in paths:
                for tma in (True, False):
                    for tiles in tile_choices(problem, shape, mode, base, OPERANDS[operands][1]):
                        params = {**base, **tiles, "operands": operands, "tma": tma}
                        if params not in valid:
                            continue
                        variant = cls(args.precision, **params)
                        label = f"{operands} tma={tma}" + ("".join(f" {k}={v}" for k, v in tiles.items()))
                        fns[label] = lambda v=variant: v(model, x)
            w = next(m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)).detach()
            if args.precision == "bf16":
                xb, wb = x.bfloat16(), w.bfloat16()
                fns["floor"] = lambda: torch.mm(xb, wb.t())
            else:
                fns["floor"] = lambda: torch.mm(x, w.t())  # under math_mode: TF32 for tf32
                xb, wb = x.bfloat16(), w.bfloat16()
                fns["bf16 GEMM (pre-cast)"] = lambda: torch.mm(xb, wb.t())  # the float16 paths' own floor
            with torch.no_grad(), math_mode(args.precision):
                times = timing.time_interleaved(fns, "cuda", rounds=args.rounds)
            print(json.dumps({"key": f"{problem} {mode} {shape}", "base": base,
                              "ms": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                                     for k, t in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
