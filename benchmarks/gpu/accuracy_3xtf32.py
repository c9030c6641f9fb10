"""How accurate are the triton kind's compensated and 11-bit GEMMs, by k-slice, against cuBLAS?

    python3 benchmarks/gpu/accuracy_3xtf32.py [--sizes 37,1004,777] [--block-ks 16,32,64]
        [--operands split_host,split_trunc,split_fp16,round_host,scaled_fp16] [--dists rand,randn,large,wide]

matmul_gelu_softmax's kernel stores its logits y = x·Wᵀ + b when a gradient needs them; this
compares them with float64 (relative L2 and max relative error) at each BLOCK_K (a fresh
tensor-core accumulator per k-slice: the hardware's truncating accumulation spans one slice),
for each operand path: fp32's x split on the host into two rounded TF32 parts (split_host), into
x itself plus the low part of its truncation (split_trunc), or into two float16 parts of its
rows scaled by powers of two (split_fp16); tf32's x rounded to TF32 (round_host) or to 11 bits in
float16 (scaled_fp16). Beside them cuBLAS fp32 and tf32 and, as the lower bound of the TF32
split itself, its three products summed exactly in float64. ``wide`` scales x's columns from
1e-4 to 1e4 (rows spanning 2^27), where float16's range (the row's max to 2^-39 of it) shows.
"""

import argparse
import json

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.kernels.triton.variant import OPERANDS, split_tf32
from autofuse.tuning.gate import CheckCase, build_case


def errors(got, exact):
    d = (got.double() - exact)
    return {"rel_l2": round((d.norm() / exact.norm()).item(), 10), "max_rel": round((d.abs().max() / exact.abs().max()).item(), 10)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="37,1004,777;1024,8192,8192")
    ap.add_argument("--block-ks", default="16,32,64")
    ap.add_argument("--operands", default="split_host,split_trunc,split_fp16,round_host,scaled_fp16")
    ap.add_argument("--dists", default="rand,randn,large,wide")
    args = ap.parse_args()
    prob = registry.get_problem("matmul_gelu_softmax")
    cls = registry.get_variant("matmul_gelu_softmax", "triton")
    for sizes in args.sizes.split(";"):
        shape = dict(zip(prob.dims, map(int, sizes.split(","))))
        for dist in args.dists.split(","):
            model, x = build_case(prob, CheckCase(shape, "randn" if dist == "wide" else dist, 39, True), "cuda",
                                  torch.float32, "train")
            if dist == "wide":
                x = x * torch.logspace(-4, 4, x.shape[1], device=x.device)
            lin = prob.linear_of(model)
            w, b = lin.weight.detach(), lin.bias.detach()
            exact = x.double() @ w.double().T + b.double()
            row = {"sizes": sizes, "dist": dist}
            for precision in ("fp32", "tf32"):
                with math_mode(precision):
                    row[f"cublas_{precision}"] = errors(x @ w.T + b, exact)
            xh, xl = split_tf32(x)
            wh, wl = split_tf32(w)
            three = xh.double() @ wh.double().T + xh.double() @ wl.double().T + xl.double() @ wh.double().T + b.double()
            row["split_exact_sum"] = errors(three, exact)
            xt = (x.view(torch.int32) & -0x2000).view(torch.float32)  # x as the tensor cores truncate it
            xl = x - xt
            xl = ((xl.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)
            three = xt.double() @ wh.double().T + xt.double() @ wl.double().T + xl.double() @ wh.double().T + b.double()
            row["split_trunc_exact_sum"] = errors(three, exact)
            for operands in args.operands.split(","):
                precision = OPERANDS[operands][0]
                for bk in map(int, args.block_ks.split(",")):
                    params = {"block_m": 128, "block_n": 128, "block_k": bk, "stages": 3, "warps": 8, "group_m": 8,
                              "persistent": True, "tma": shape["in_features"] % 8 == 0, "operands": operands}
                    variant = cls(precision, **params)
                    try:
                        with torch.no_grad(), math_mode(precision):
                            _, saved = variant._fused(x, lin.weight, lin.bias, save=True)
                        row[f"{operands}_bk{bk}"] = errors(saved[3], exact)
                    except Exception as exc:  # noqa: BLE001
                        row[f"{operands}_bk{bk}"] = str(exc)[:120]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
