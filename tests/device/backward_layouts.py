"""How fast are the backward's GEMMs as laid out, against the same products from K-major copies?

    python3 tests/device/backward_layouts.py [--shapes 1024,8192,8192;16384,4096,4096]

For y = x·Wᵀ (x: batch × K, W: N × K) the backward computes dW = dyᵀ·x, contracting over the
batch, which is the slow dimension of both dy and x, and dx = dy·W, contracting over N, W's
slow dimension. Hopper's tensor cores take TF32 operands K-major only, so cuBLAS may need
another kernel for those layouts. Timed interleaved per precision (fp32 = TF32 off, tf32, bf16
on operands already cast), beside the forward's own GEMM: each product as laid out, and through
contiguous transposes (their copies included in the time), torch's and autofuse's Triton one;
and dW's product alone from copies made before the clock, of dy, of x, or of both (does one
K-major operand suffice?).
"""

import argparse

import torch

from autofuse.core.precision import math_mode
from autofuse.kernels.triton.host import transposed
from autofuse.tuning.timing import time_interleaved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1024,8192,8192;16384,4096,4096")
    args = ap.parse_args()
    device = torch.device("cuda")
    for sizes in args.shapes.split(";"):
        batch, k, n = map(int, sizes.split(","))
        x, w = torch.rand(batch, k, device=device), torch.rand(n, k, device=device) / k
        dy = torch.randn(batch, n, device=device)
        for precision in ("fp32", "tf32", "bf16"):
            a, b, g = (x, w, dy) if precision != "bf16" else (x.bfloat16(), w.bfloat16(), dy.bfloat16())
            fns = {
                "forward x·Wᵀ": lambda: a @ b.t(),
                "dW = dyᵀ·x as laid out": lambda: g.t() @ a,
                "dW via dyᵀ, xᵀ copies": lambda: g.t().contiguous() @ a.t().contiguous().t(),
                "dx = dy·W as laid out": lambda: g @ b,
                "dx via a Wᵀ copy": lambda: g @ b.t().contiguous().t(),
                "transpose dy": lambda: g.t().contiguous(),
            }
            if precision != "bf16":  # the Triton transpose takes float32
                fns["dW via Triton transposes"] = lambda: transposed(g) @ transposed(a).t()
                fns["transpose dy (Triton)"] = lambda: transposed(g)
                # The products alone, from copies made before the clock: what a backward kernel
                # that writes dyᵀ itself (no transpose pass) would leave, with x as laid out or copied.
                gt, at = transposed(g), transposed(a)
                fns["dW, dyᵀ given, x as laid out"] = lambda: gt @ a
                fns["dW, xᵀ given, dy as laid out"] = lambda: g.t() @ at.t()
                fns["dW, dyᵀ and xᵀ given"] = lambda: gt @ at.t()
            with math_mode(precision if precision != "bf16" else "fp32"):
                timed = time_interleaved(fns, device, rounds=10)
            for name, t in timed.items():
                print(f"{sizes} {precision:5s} {name:26s} {t.median_ms:8.4f} [{t.p20_ms:.4f}-{t.p80_ms:.4f}]", flush=True)


if __name__ == "__main__":
    main()
