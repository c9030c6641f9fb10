"""The fp32 backward's two GEMMs on float16 parts (``triton_backward.Fp16Gemms``) against cuBLAS.

    python3 tests/device/fp16_backward.py [--json PATH] [--rounds 10]

At 1024×8192×8192 and 16384×4096×4096 (batch × in × out), with dy (batch × out) randn and x
rand and randn: dx = dy·W and dW = dyᵀ·x through cuBLAS fp32 (TF32 off), cuBLAS TF32 (dW from a
K-major dyᵀ, as the tf32 backward gets it) and Fp16Gemms in the default fp32 triton
configuration, W's column parts cached as in a training step whose optimizer did not run. (The
first version also ran a tf32 Fp16Gemms on hi parts alone: log 2026-11-24d-3.) Timed by
``autofuse.tuning.timing.time_interleaved`` (L2 flushed): median and p20-p80, ms (logs 2026-11-24d-3 and
d-5 give the median, min and max of per-round medians, from the script's own first timer); each
result's relative L2 error against float64; the passes' share.
"""

from __future__ import annotations

import argparse
import json

import torch

from autofuse.kernels.autograd import GemmGrad
from autofuse.kernels.triton import backward as triton_backward
from autofuse.kernels.triton.host import fp16_parts
from autofuse.kernels.triton.variant import DEFAULTS
from autofuse.tuning.timing import time_interleaved


def timed(fns: dict, rounds: int) -> dict:
    """``autofuse.tuning.timing.time_interleaved`` (L2 flushed, round-robin), as [median, p20, p80] ms."""
    return {name: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
            for name, t in time_interleaved(fns, "cuda", rounds=rounds).items()}


def rel(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def cublas(dy, dy_t, x, w, tf32: bool):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    dx = dy @ w
    dw = (dy_t if tf32 else dy.t()) @ x
    torch.backends.cuda.matmul.allow_tf32 = False
    return dx, dw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for batch, n_in, n_out in ((1024, 8192, 8192), (16384, 4096, 4096)):
        for dist in ("rand", "randn"):
            torch.manual_seed(0)
            x = torch.rand(batch, n_in, device="cuda") if dist == "rand" else torch.randn(batch, n_in, device="cuda")
            w = torch.randn(n_out, n_in, device="cuda") / n_in ** 0.5
            dy = torch.randn(batch, n_out, device="cuda")
            dy_t = dy.t().contiguous()
            split = triton_backward.Fp16Gemms(DEFAULTS["fp32"])
            grad = GemmGrad(dy, None, None)
            fns = {
                "cublas fp32": lambda: cublas(dy, dy_t, x, w, False),
                "cublas tf32": lambda: cublas(dy, dy_t, x, w, True),
                "fp16 split (fp32)": lambda: split(grad, x, w, "fp32", True, True),
            }
            exact_dx, exact_dw = dy.double() @ w.double(), dy.double().t() @ x.double()
            errors = {}
            for name, fn in fns.items():
                dx, dw = fn()
                errors[name] = {"dx": rel(dx, exact_dx), "dW": rel(dw, exact_dw)}
            row = {"shape": [batch, n_in, n_out], "x": dist, "errors": errors}
            if dist == "randn":  # the times do not depend on the values
                parts = {
                    "dy row parts (split)": lambda: fp16_parts(dy, True),
                    "dy column parts (split)": lambda: triton_backward.column_parts(dy, True),
                    "x column parts (split)": lambda: triton_backward.column_parts(x, True),
                    "W column parts (split; cached in a step)": lambda: triton_backward.column_parts(w, True),
                }
                a, b = fp16_parts(dy, True), split._weight_columns(w)
                c, d = triton_backward.column_parts(dy, True), triton_backward.column_parts(x, True)
                gemms = {"dx GEMM alone (split)": lambda: split.matmul(a, b),
                         "dW GEMM alone (split)": lambda: split.matmul(c, d)}
                row["ms [median, p20, p80]"] = timed({**fns, **parts, **gemms}, args.rounds)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
