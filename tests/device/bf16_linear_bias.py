"""A bf16 linear layer with a float32 result and bias: what does adding the bias cost, each way?

    python3 tests/device/bf16_linear_bias.py [--shapes 1024,8192,8192 16384,4096,4096]

``precision.linear`` under bf16 (gemm_bn's folded eval, the simplified variants) is x's cast,
cuBLAS's product with a float32 result (``out_dtype``), then the bias added in a pass over the
(batch × out) result. Timed interleaved here (``autofuse.tuning.timing``, L2 flushed), on operands cast
before the clock unless the row says "cast":
- ``mm bf16``: the floor, a bfloat16 result;  ``mm f32``: the float32 result, no bias;
- ``mm f32 + add``: today's way;  ``addmm out_dtype``: ``torch.addmm(b, xb, wbᵀ, out_dtype=float32)``
  (cuBLASLt can add the bias in its epilogue);
- ``K+8``: the bias as two more columns of the product, x' = [x, 1, 1, 0…] and
  W' = [W, b_hi, b_lo, 0…] (b = b_hi + b_lo in bfloat16 to 2⁻¹⁷), K padded to a multiple of 8;
- the casts: x.bfloat16(), and x cast into the first K columns of the (M, K+8) buffer.
Prints each row's error against float64 (on the rounded operands) and the times, as JSON lines.
"""

import argparse
import json

import torch

from autofuse.tuning import timing


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1024,8192,8192", "16384,4096,4096"])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for shape in args.shapes:
        m, n, k = map(int, shape.split(","))
        torch.manual_seed(0)
        x, w, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / k ** 0.5, torch.randn(n, device="cuda")
        xb, wb = x.bfloat16(), w.bfloat16()
        b_hi = b.bfloat16()
        b_lo = (b - b_hi.float()).bfloat16()
        kp = k + 8
        wp = torch.zeros(n, kp, device="cuda", dtype=torch.bfloat16)
        wp[:, :k], wp[:, k], wp[:, k + 1] = wb, b_hi, b_lo
        xp = torch.zeros(m, kp, device="cuda", dtype=torch.bfloat16)
        xp[:, :k], xp[:, k:k + 2] = xb, 1.0
        want = (xb.double() @ wb.double().t()) + b.double()
        fns = {
            "mm bf16 (floor)": lambda: torch.mm(xb, wb.t()),
            "mm f32": lambda: torch.mm(xb, wb.t(), out_dtype=torch.float32),
            "mm f32 + add": lambda: torch.mm(xb, wb.t(), out_dtype=torch.float32).add_(b),
            "addmm out_dtype": lambda: torch.addmm(b, xb, wb.t(), out_dtype=torch.float32),
            "K+8 mm f32": lambda: torch.mm(xp, wp.t(), out_dtype=torch.float32),
            "cast x": lambda: x.bfloat16(),
            "cast x into K+8": lambda: xp[:, :k].copy_(x),
        }
        errors = {}
        for name in ("mm f32 + add", "addmm out_dtype", "K+8 mm f32"):
            try:
                got = fns[name]()
                errors[name] = ((got.double() - want).norm() / want.norm()).item()
            except Exception as e:  # noqa: BLE001 - a probe records what fails
                errors[name] = f"{type(e).__name__}: {e}"[:200]
                del fns[name]
        times = timing.time_interleaved(fns, "cuda", rounds=args.rounds)
        print(json.dumps({"shape": shape, "errors": errors,
                          "ms": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                                 for k, t in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
