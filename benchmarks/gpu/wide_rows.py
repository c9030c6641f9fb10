"""Wide rows on the triton variants' float16 paths (issue 32 item 1): accuracy against cuBLAS, and
what the range check costs on ordinary inputs. Run from the repository root on a GPU:

    python benchmarks/gpu/wide_rows.py [--shape-index 0] [--rounds 20]

Per triton key (22, 99, gemm_bn eval and train) at its default shape, for fp32 (split_fp16) and
tf32 (scaled_fp16) in the precision's default configuration:

- accuracy: rows of x, or of W, whose 16 largest entries are M = 1e4 ... 1e30 times the rest, with
  and without the other operand's matching columns zero; the output's ‖y − r‖/‖r‖ against float64
  for autofuse and for eager at the precision (cuBLAS fp32 or TF32). One JSON line per case with
  ``ratio`` = autofuse / eager. Success: fp32 ratio ≤ 2 and tf32 error within the tf32 tolerance
  (or 4x eager's, the gate's floor), on every line. Cases float32 cannot represent (eager's own
  error over 1e-3 or not finite, BatchNorm training's variance at 1e30) are marked ``skipped``.
- time on ordinary (rand) inputs, interleaved, L2 flushed: the variant's forward, cuBLAS's GEMM
  alone, x's parts pass alone (``fp16_parts``) and with the range check (``fp16_input_parts``:
  x's checked pass; W's flags are made once with its parts). For the main loop's cost, run this file at the commit
  before the range check too (``git show fp32range:benchmarks/gpu/wide_rows.py > /tmp/wide_rows.py``
  there; it then times what exists) and compare "forward" on the same machine.
"""

import argparse
import copy
import json

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.core.variant import EagerVariant
from autofuse.kernels.triton import host
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
                e_eager, e_out = rel_error(eager, ref), rel_error(out, ref)
                line = {"problem": prob.name, "mode": mode, "precision": precision, "wide": side, "M": ratio,
                        "zeroed": zeroed, "autofuse": e_out, "eager": e_eager,
                        "ratio": e_out / e_eager if e_eager > 0 else None}
                if not (torch.isfinite(eager).all() and e_eager <= 1e-3):
                    line["skipped"] = "float32 cannot represent it"
                elif precision == "fp32":
                    line["ok"] = e_out <= 2 * e_eager
                else:
                    line["ok"] = e_out <= max(prob.tolerance("tf32").rel_l2, FLOOR_FACTOR * e_eager)
                print(json.dumps(line), flush=True)


def speed(prob, shape, mode, precision, variant, rounds):
    model, x = build_case(prob, CheckCase(dict(shape), "rand", 0, False), "cuda", torch.float32, mode)
    w = getattr(model, prob.linear_attr).weight.detach().contiguous()
    split = precision == "fp32"
    fns = {"forward": lambda: variant(model, x), "cuBLAS GEMM": lambda: torch.mm(x, w.t()),
           "x parts pass": lambda: host.fp16_parts(x, split)}
    flagged = None
    with torch.no_grad(), math_mode(precision):
        if hasattr(host, "fp16_input_parts"):  # absent before the range check: the same script times both
            parts, check = host.fp16_weight_parts(w, split)
            fns["x parts pass + range check"] = lambda: host.fp16_input_parts(x, split, parts, check)
            xs, ws = host.fp16_input_parts(x, split, parts, check)
            flagged = (int((xs[2] < 0).sum()), int((ws[2] < 0).sum()))
        times = timing.time_interleaved(fns, "cuda", rounds=rounds)
    print(json.dumps({"problem": prob.name, "mode": mode, "precision": precision, "shape": dict(shape),
                      "flagged rows of x, W (rand; want 0, 0)": flagged,
                      "ms [median, p20, p80]": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                                                for k, t in times.items()}}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape-index", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for problem, mode in KEYS:
        prob = registry.get_problem(problem)
        shape = prob.default_shapes[min(args.shape_index, len(prob.default_shapes) - 1)]
        for precision in ("fp32", "tf32"):
            variant = registry.get_variant(problem, "triton")(precision, **DEFAULTS[precision])
            accuracy(prob, shape, mode, precision, variant)
            if not args.skip_speed:
                speed(prob, shape, mode, precision, variant, args.rounds)


if __name__ == "__main__":
    main()
