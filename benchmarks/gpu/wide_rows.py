"""Wide rows on the triton variants' float16 paths (issue 32 item 1): accuracy against cuBLAS, and
what the range check costs on ordinary inputs. Run from the repository root on a GPU:

    python benchmarks/gpu/wide_rows.py [--shape-index 0] [--rounds 20]

Per triton key (22, 99, gemm_bn eval and train) at its default shape, for fp32 (split_fp16) and
tf32 (scaled_fp16) in the precision's default configuration:

- accuracy: rows of x, or of W, whose 16 largest entries are M = 1e4 ... 1e30 times the rest, with
  and without the other operand's matching columns zero; the output's ‖y − r‖/‖r‖ against float64
  for autofuse and for eager at the precision (cuBLAS fp32 or TF32), over the rows a problem's
  ``rows_on_a_kink`` leaves (22 at fp32: a logit within float32's rounding of a clamp bound, where
  either side is float32's answer; the error over all rows is printed too). One JSON line per case with
  ``ratio`` = autofuse / eager. Success: fp32 ratio ≤ 2 and tf32 error within the tf32 tolerance
  (or 4x eager's, the gate's floor), on every line. Cases float32 cannot represent (eager's own
  error over 1e-3 or not finite, BatchNorm training's variance at 1e30) are marked ``skipped``.
- time on ordinary (rand) inputs, interleaved, L2 flushed: the variant's forward and (fp32) its
  training step, each with and without the range check (``range_check_off``: the parts without
  flags, one launch of the main loop), cuBLAS's GEMM alone, and x's parts pass alone
  (``fp16_parts``) and with the check (``fp16_input_parts``; W's flags are made once with its parts).
"""

import argparse
import contextlib
import copy
import json

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.core.variant import EagerVariant
from autofuse.kernels.triton import backward, host
from autofuse.kernels.triton import variant as triton_variant
from autofuse.kernels.triton.variant import DEFAULTS
from autofuse.tuning import timing
from autofuse.tuning.gate import FLOOR_FACTOR, CheckCase, build_case

KEYS = [("matmul_clamp_lse_mish", "train"), ("matmul_gelu_softmax", "train"), ("gemm_bn", "eval"),
        ("gemm_bn", "train")]
RATIOS = (1e4, 1e6, 1e8, 1e12, 1e30)
WIDE = 16
DEVICE = "cuda"  # a CPU smoke run under TRITON_INTERPRET=1 sets "cpu"


def widen(prob, model, x, side, ratio, zeroed, seed):
    """``side``'s rows ("x" or "W") wide at WIDE random columns; the other operand zero there if ``zeroed``."""
    w = getattr(model, prob.linear_attr).weight.data
    cols = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(seed))[:WIDE].to(x.device)
    big, other = (x, w) if side == "x" else (w, x)
    big[:, cols] *= ratio
    if zeroed:
        other[:, cols] = 0.0


def rel_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def accuracy(prob, shape, mode, precision, variant):
    for side in ("x", "W"):
        for ratio in RATIOS:
            for zeroed in (True, False):
                model, x = build_case(prob, CheckCase(dict(shape), "randn", 5, True), DEVICE, torch.float32, mode)
                widen(prob, model, x, side, ratio, zeroed, 7)
                ref = prob.reference(model, x)[0]
                with torch.no_grad():
                    eager = EagerVariant(precision)(copy.deepcopy(model), x)
                    out = variant(copy.deepcopy(model), x)
                line = {"problem": prob.name, "mode": mode, "precision": precision, "wide": side, "M": ratio,
                        "zeroed": zeroed, "autofuse (all rows)": rel_error(out, ref),
                        "eager (all rows)": rel_error(eager, ref)}
                kinked = prob.rows_on_a_kink(model, x, precision)
                if kinked is not None and kinked.any():  # either side is float32's answer there
                    line["rows on a kink, left out"] = int(kinked.sum())
                    out, eager, ref = out[~kinked], eager[~kinked], ref[~kinked]
                e_eager, e_out = rel_error(eager, ref), rel_error(out, ref)
                line.update({"autofuse": e_out, "eager": e_eager, "ratio": e_out / e_eager if e_eager > 0 else None})
                if not (torch.isfinite(eager).all() and e_eager <= 1e-3):
                    line["skipped"] = "float32 cannot represent it"
                elif precision == "fp32":
                    line["ok"] = e_out <= 2 * e_eager
                else:
                    line["ok"] = e_out <= max(prob.tolerance("tf32").rel_l2, FLOOR_FACTOR * e_eager)
                print(json.dumps(line), flush=True)


@contextlib.contextmanager
def range_check_off():
    """The float16 paths as they were before the range check: parts without flags or sources, so
    one launch of the main loop without the exact path, forward and backward. For timing only."""
    saved = (triton_variant.fp16_input_parts, backward.dx_operands, backward.dw_operands)
    triton_variant.fp16_input_parts = lambda x, split, weights, check, tma_rows=None: (
        host.fp16_parts(x, split, tma_rows), weights[:3])
    backward.dx_operands = lambda dy, columns: (host.fp16_parts(dy, True), columns[0][:3])
    backward.dw_operands = lambda dy, x: (backward.column_parts(dy, True), backward.column_parts(x, True))
    try:
        yield
    finally:
        triton_variant.fp16_input_parts, backward.dx_operands, backward.dw_operands = saved


def speed(prob, shape, mode, precision, variant, rounds):
    model, x = build_case(prob, CheckCase(dict(shape), "rand", 0, False), "cuda", torch.float32, mode)
    w = getattr(model, prob.linear_attr).weight.detach().contiguous()
    xg = x.clone().requires_grad_(True)
    split = precision == "fp32"

    def forward():
        with torch.no_grad(), math_mode(precision):
            variant(model, x)

    def step():  # fp32's backward multiplies on float16 parts with the check too (``Fp16Gemms``)
        variant(model, xg).sum().backward()

    def unchecked(fn):
        def call():
            with range_check_off():
                fn()
        return call

    with torch.no_grad(), math_mode(precision):
        parts, check = host.fp16_weight_parts(w, split)
        xs, ws = host.fp16_input_parts(x, split, parts, check)
    fns = {"forward": forward, "forward without the range check": unchecked(forward),
           "cuBLAS GEMM": lambda: torch.mm(x, w.t()), "x parts pass": lambda: host.fp16_parts(x, split),
           "x parts pass + range check": lambda: host.fp16_input_parts(x, split, parts, check)}
    if split:
        fns.update({"training step": step, "training step without the range check": unchecked(step)})
    times = timing.time_interleaved(fns, "cuda", rounds=rounds)
    print(json.dumps({"problem": prob.name, "mode": mode, "precision": precision, "shape": dict(shape),
                      "flagged rows of x, W (rand; want 0, 0)": (int((xs[2] < 0).sum()), int((ws[2] < 0).sum())),
                      "ms [median, p20, p80]": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                                                for k, t in times.items()}}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape-index", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for problem, mode in KEYS:
        prob = registry.get_problem(problem)
        shape = prob.default_shapes[min(args.shape_index, len(prob.default_shapes) - 1)]
        for precision in ("fp32", "tf32"):
            variant = registry.get_variant(problem, "triton")(precision, **DEFAULTS[precision])
            if not args.skip_accuracy:
                accuracy(prob, shape, mode, precision, variant)
            if not args.skip_speed:
                speed(prob, shape, mode, precision, variant, args.rounds)


if __name__ == "__main__":
    main()
