"""The fp32 backward's GEMMs on wide and skewed inputs, by path: the range check as shipped, the
float16 split alone, and every tile exact. Run from the repository root on a GPU:

    python3 benchmarks/gpu/gradient_paths.py

``Fp16Gemms`` (dx = dy·W, dW = dyᵀ·x) at the tuner's first fp32 configuration, on the wide
families of ``tests/test_triton_gpu.py`` (``autofuse.testing.wide_gradient_inputs``: batch 1, 37
and 512, K 768-1000, M = 1e4, 1e8, 1e30, partners zeroed or not) and on a softmax-like dy, ReLU x
and x with 16 outlier features 1e8 at batches 1-256. One line per case and gradient: cuBLAS fp32's
relative error against float64, each path's as a multiple of it, and the flagged rows and
columns (dy's rows, W's, dy's and x's columns); the last line the worst "check" multiple (issue
32's target: 2x). The split alone shows what the range check must catch (dW at batch 1 was 2.4-6.5x
cuBLAS's), the exact path what it costs in accuracy where it does (3-5x until its k-slices were
summed apart: gemm.exact_tile). Measured on an H100: worst check 1.53x (dx), 1.48x (dW).
"""

import itertools

import torch

from autofuse.core.precision import math_mode
from autofuse.kernels.autograd import GemmGrad
from autofuse.kernels.triton import backward
from autofuse.kernels.triton.variant import DEFAULTS
from autofuse.testing import wide_gradient_inputs


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def with_scales(make, sign: int):
    """``dx_operands`` or ``dw_operands`` with every scale made positive (1: the split alone, no tile
    flagged) or negative (-1: every tile exact)."""
    def operands(*args):
        return tuple((op[0], op[1], sign * op[2].abs(), op[3]) for op in make(*args))
    return operands


def cases():
    for (m, n, k), side, span, ratio, zeroed in itertools.product(
            ((1, 1024, 768), (37, 1000, 777), (512, 1024, 768)), ("x", "W", "dy"), ("two", "all"),
            (1e4, 1e8, 1e30), (True, False)):
        if m == 1 and span == "two":
            continue
        generator = torch.Generator().manual_seed(m + n)
        yield (f"{m}x{n}x{k} {side} rows ({span}) x{ratio:.0e}{' zeroed' if zeroed else ''}",
               wide_gradient_inputs(m, n, k, side, span, ratio, zeroed, generator))
    generator = torch.Generator().manual_seed(5)

    def randn(*size):
        return torch.randn(*size, generator=generator)

    for m in (1, 8, 37, 256):
        yield f"{m}x1024x1024 softmax-like dy", (torch.softmax(4 * randn(m, 1024), 1) * randn(m, 1024),
                                                 randn(m, 1024), randn(1024, 1024) / 32)
        yield f"{m}x1024x1024 ReLU x", (randn(m, 1024), randn(m, 1024).clamp_min(0), randn(1024, 1024) / 32)
        outliers = randn(m, 1024)
        outliers[:, :16] *= 1e8
        yield f"{m}x1024x1024 outlier x", (randn(m, 1024), outliers, randn(1024, 1024) / 32)


def main() -> None:
    dx_operands, dw_operands = backward.dx_operands, backward.dw_operands
    paths = {"check": (dx_operands, dw_operands), "split": (with_scales(dx_operands, 1), with_scales(dw_operands, 1)),
             "exact": (with_scales(dx_operands, -1), with_scales(dw_operands, -1))}
    worst = {}
    for label, tensors in cases():
        dy, x, w = (t.cuda() for t in tensors)
        errors = {}
        for path, (make_dx, make_dw) in paths.items():
            backward.dx_operands, backward.dw_operands = make_dx, make_dw
            gemms = backward.Fp16Gemms(DEFAULTS["fp32"])
            dx, dw = gemms(GemmGrad(dy, None, None), x, w, "fp32", True, True, torch.float32)
            for name, got, a, b in (("dx", dx, dy, w), ("dW", dw, dy.t(), x)):
                exact = a.double() @ b.double()
                if exact.norm() == 0:
                    continue
                if name not in errors:
                    with math_mode("ieee"):
                        errors[name] = {"cuBLAS": relative_error(a @ b, exact)}
                errors[name][path] = relative_error(got, exact)
        backward.dx_operands, backward.dw_operands = dx_operands, dw_operands
        operands = (*dx_operands(dy, backward.weight_columns(w)), *dw_operands(dy, x))
        flagged = [int((op[2] < 0).sum()) for op in operands]
        for name, e in errors.items():
            floor = e["cuBLAS"]
            worst[name] = max(worst.get(name, 0.0), e["check"] / floor)
            print(f"{label} {name}: cuBLAS fp32 {floor:.2e}, check {e['check'] / floor:.2f}x, split "
                  f"{e['split'] / floor:.2f}x, exact {e['exact'] / floor:.2f}x; flagged {flagged}", flush=True)
    print("worst check / cuBLAS fp32:", {name: round(v, 2) for name, v in worst.items()})


if __name__ == "__main__":
    main()
