"""The fp32 training step of each tabled triton autograd entry, against eager, interleaved.

    python3 benchmarks/gpu/training_step.py LABEL [benchmarks/table.json]

Prints one line per key: the step's median [p20-p80] ms, eager's, and their ratio. Run it in two
trees on one warm GPU (e.g. `git archive OLD | tar -x -C /tmp/old`, installed with
`pip install --no-deps --target /tmp/old-site /tmp/old`, then `PYTHONPATH=/tmp/old-site`) to see
what a change to the backward costs: the ratio to eager cancels most of the machine's drift.
Measured so for the fp32 backward's range check (issue 32, H100): 99 1.690 → 1.776 ms, gemm_bn
train 1024 1.641 → 1.715, 16384 7.007 → 7.102.
"""

import json
import sys

import torch

from autofuse.core import registry
from autofuse.core.variant import EagerVariant
from autofuse.tuning import timing
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.timed_call import training_call

KEYS = (("matmul_gelu_softmax", "batch_size=1024,in_features=8192,out_features=8192", "any"),
        ("gemm_bn", "batch_size=1024,in_features=8192,out_features=8192", "train"),
        ("gemm_bn", "batch_size=16384,in_features=4096,out_features=4096", "train"))


def main(label: str, path: str = "benchmarks/table.json") -> None:
    device = torch.device("cuda")
    table = json.load(open(path))
    by_problem = next(iter(table["devices"].values()))["problems"]  # the table's first (H100) device
    for problem, shape_key, mode in KEYS:
        entry = by_problem[problem][shape_key][f"dtype=float32,precision=fp32,mode={mode},autograd=true"]
        shape = {k: int(v) for k, v in (kv.split("=") for kv in shape_key.split(","))}
        prob = registry.get_problem(problem)
        model, x = build_case(prob, CheckCase(shape, "rand", 0, False), device, torch.float32,
                              "train" if mode == "any" else mode)
        variant = registry.get_variant(problem, entry["variant"])("fp32", **entry["params"])
        variant.build("cuda")
        t = timing.time_interleaved({"step": training_call(variant, model, x),
                                     "eager": training_call(EagerVariant("fp32"), model, x)}, device, rounds=15)
        step, eager = t["step"], t["eager"]
        print(f"{label} {problem} {mode} {shape['batch_size']}: step {step.median_ms:.4f} [{step.p20_ms:.4f}-"
              f"{step.p80_ms:.4f}] eager {eager.median_ms:.4f} ratio {step.median_ms / eager.median_ms:.4f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
