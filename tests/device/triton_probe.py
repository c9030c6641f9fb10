"""One device command: are the Triton variants right, and how fast are a few configurations?

    python3 tests/device/triton_probe.py [--out DIR] [--problems 99,22,bn] [--precisions fp32,tf32,bf16]
                                         [--configs N] [--budget-s S] [--skip-gate]

1. Gate (the tuner's, gradients included) of every ``triton`` variant and every other fused
   variant at odd shapes (batch 1, sizes that are multiples of no tile) at each precision.
2. At the default shapes, for each precision: the first N candidate configurations below, each
   gated on the default shape (KernelBench's rand input and the overflow-prone large one), then
   timed interleaved with the cuBLAS GEMM alone (the floor), cublas_epilogue and eager; the
   first call's time (the Triton compile) is reported too. Under bf16 the candidates convert x
   in the kernel (cast_kernel) or take it cast by a separate pass (cast_pass).
A short table goes to stdout last; everything to DIR/triton_probe.json. Stops starting new work
after --budget-s seconds, so a 10-minute command always returns its numbers.
"""

import argparse
import json
import pathlib
import sys
import time
import traceback

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.core.variant import EagerVariant
from autofuse.tuning.gate import CheckCase, build_case, check_variant
from autofuse.tuning.timing import time_interleaved

PROBLEMS = {"99": ("matmul_gelu_softmax", [None]), "22": ("matmul_clamp_lse_mish", [None]),
            "bn": ("gemm_bn", ["train", "eval"])}
CANDIDATES = {  # (block_m, block_n, block_k, stages, warps, persistent, tma, operands)
    "fp32": [(128, 128, 32, 3, 8, True, True, "split_host"), (128, 128, 32, 3, 8, True, True, "split_trunc"),
             (128, 128, 32, 4, 8, True, True, "split_trunc"), (128, 128, 32, 3, 8, False, True, "split_trunc"),
             (128, 128, 32, 3, 8, False, False, "split_host"), (128, 256, 32, 2, 8, True, True, "split_host"),
             (128, 64, 32, 4, 4, True, True, "split_host"), (128, 128, 32, 4, 8, False, False, "split_host")],
    "tf32": [(128, 256, 32, 3, 8, True, True, "round_host"), (128, 256, 32, 3, 8, False, True, "round_host"),
             (128, 256, 32, 4, 8, True, True, "round_host")],
    "bf16": [(128, 256, 64, 3, 8, True, True, "cast_pass"), (128, 256, 64, 4, 8, True, True, "cast_pass"),
             (128, 256, 64, 3, 8, False, True, "cast_pass"), (128, 128, 64, 4, 8, True, True, "cast_pass")],
}
ODD = ((1, 37, 53), (37, 1000, 777))


def params_of(c):
    bm, bn, bk, stages, warps, persistent, tma, operands = c
    return {"block_m": bm, "block_n": bn, "block_k": bk, "stages": stages, "warps": warps, "group_m": 8,
            "persistent": persistent, "tma": tma, "operands": operands}


def gate_odd(problem, precisions, log, kinds=("triton",)):
    prob = registry.get_problem(problem)
    for name, cls in sorted(registry.variants(problem).items()):
        if cls.kind not in kinds:
            continue
        for precision in precisions:
            if cls.admits("cuda", torch.float32, precision, True) is not None:
                continue
            for sizes in ODD:
                shape = dict(zip(prob.dims, sizes))
                configs = cls.configs_for(shape, "cuda", precision)
                if not configs:
                    continue
                variant = cls(precision, **configs[0])
                cases = [CheckCase(shape, d, 5, r) for d, r in (("rand", False), ("randn", True), ("large", True))]
                for mode in ("train", "eval") if prob.mode_sensitive else ("train",):
                    start = time.time()
                    try:
                        variant.build("cuda")
                        result = check_variant(variant, prob, cases, "cuda", mode=mode, autograd=True)
                        ok, reason, error = result.ok, result.reason, result.error
                    except Exception:  # noqa: BLE001 - a candidate that cannot run is a recorded outcome
                        ok, reason, error = False, traceback.format_exc(limit=3)[-600:], None
                    log("gate", {"problem": problem, "variant": name, "precision": precision, "shape": sizes,
                                 "mode": mode, "ok": ok, "error": error, "reason": reason,
                                 "seconds": round(time.time() - start, 1)})


def floor_call(x, weight, precision):
    if precision == "bf16":
        xb, wb = x.bfloat16(), weight.detach().bfloat16()
        return lambda: xb @ wb.t()
    w = weight.detach()

    def gemm():
        with math_mode(precision):
            return x @ w.t()
    return gemm


def probe_shape(problem, shape, mode, precision, n_configs, deadline, log):
    prob = registry.get_problem(problem)
    cls = registry.get_variant(problem, "triton")
    model, x = build_case(prob, CheckCase(shape, "rand", 0, False), "cuda", torch.float32, mode or "train")
    cases = [CheckCase(shape, "rand", 1, False), CheckCase(shape, "large", 2, True)]
    calls = {"floor": floor_call(x, prob.linear_of(model).weight, precision)}
    cublas = registry.get_variant(problem, "cublas_epilogue")
    cublas_variant = cublas(precision, **cublas.configs(shape, "cuda")[0])
    calls["cublas_epilogue"] = lambda: cublas_variant(model, x)
    eager = EagerVariant(precision)
    calls["eager"] = lambda: eager(model, x)
    compile_s, errors = {}, {}
    for c in CANDIDATES[precision][:n_configs]:
        if time.time() > deadline:
            break
        params = params_of(c)
        if params not in cls.configs(shape, "cuda"):
            continue
        label = "triton " + ",".join(map(str, c))
        variant = cls(precision, **params)
        try:
            start = time.time()
            with torch.no_grad():
                variant(model, x)
            torch.cuda.synchronize()
            compile_s[label] = round(time.time() - start, 2)
            result = check_variant(variant, prob, cases, "cuda", mode=mode or "train")
        except Exception as exc:  # noqa: BLE001
            log("config", {"problem": problem, "precision": precision, "mode": mode, "config": label,
                           "ok": False, "reason": f"{type(exc).__name__}: {exc}"[-600:]})
            continue
        errors[label] = result.error
        if not result.ok:
            log("config", {"problem": problem, "precision": precision, "mode": mode, "config": label, "ok": False,
                           "reason": result.reason})
            continue
        calls[label] = (lambda v: (lambda: v(model, x)))(variant)
    with torch.no_grad():
        timings = time_interleaved(calls, "cuda", rounds=8)
    floor = timings["floor"].median_ms
    for name, t in timings.items():
        log("time", {"problem": problem, "shape": list(shape.values()), "mode": mode, "precision": precision,
                     "candidate": name, "median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms,
                     "x_floor": t.median_ms / floor, "compile_s": compile_s.get(name), "error": errors.get(name)})


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe-out")
    parser.add_argument("--problems", default="99,22,bn")
    parser.add_argument("--precisions", default="fp32,tf32,bf16")
    parser.add_argument("--configs", type=int, default=9)
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--skip-gate", action="store_true")
    parser.add_argument("--bn-shapes", default="1024")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    records = []

    def log(kind, record):
        records.append({"kind": kind, **record})
        print(kind, json.dumps(record, default=str), flush=True)
        (out / "triton_probe.json").write_text(json.dumps(records, indent=1, default=str))

    precisions = args.precisions.split(",")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for key in args.problems.split(","):
        problem, modes = PROBLEMS[key]
        if not args.skip_gate:
            gate_odd(problem, precisions, log)
        prob = registry.get_problem(problem)
        shapes = [s for s in prob.default_shapes if key != "bn" or str(s["batch_size"]) in args.bn_shapes.split(",")]
        for shape in shapes:
            for mode in modes:
                for precision in precisions:
                    if time.time() > deadline:
                        print("budget spent: stopping", flush=True)
                        break
                    try:
                        probe_shape(problem, dict(shape), mode, precision, args.configs, deadline, log)
                    except Exception:  # noqa: BLE001
                        log("error", {"problem": problem, "mode": mode, "precision": precision,
                                      "trace": traceback.format_exc()[-1500:]})
    print("\n== summary ==")
    for r in records:
        if r["kind"] == "gate" and not r["ok"]:
            print("GATE FAIL", r["problem"], r["variant"], r["precision"], r["shape"], r["mode"], (r["reason"] or "")[:300])
        if r["kind"] == "config" and not r["ok"]:
            print("CONFIG FAIL", r["problem"], r["precision"], r["mode"], r["config"], (r["reason"] or "")[:300])
        if r["kind"] == "error":
            print("ERROR", r["problem"], r["mode"], r["precision"], r["trace"][-400:])
    print(f"gates: {sum(r['kind'] == 'gate' and r['ok'] for r in records)} ok of {sum(r['kind'] == 'gate' for r in records)}")
    for r in records:
        if r["kind"] == "time":
            print(f"{r['problem'][:10]:10} {r['mode'] or '':5} {r['precision']:5} {r['candidate'][:40]:40} "
                  f"{r['median_ms']:.4f} [{r['p20_ms']:.4f}-{r['p80_ms']:.4f}] x{r['x_floor']:.3f} "
                  f"compile {r['compile_s']} err {r['error']}")


if __name__ == "__main__":
    sys.exit(main())
