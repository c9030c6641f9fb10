"""The host's time up to a call's GEMM, timed as KernelBench's harness times a call.

    python3 benchmarks/gpu/host_before_gemm.py matmul_gelu_softmax --table benchmarks/table.json
    python3 benchmarks/gpu/host_before_gemm.py gemm_bn --dtype float32 --precision fp32 --rounds 100
    python3 benchmarks/gpu/host_before_gemm.py matmul_gelu_softmax --device cpu --shape 8,32,24   (seconds)

KernelBench's harness fills a 256 MB tensor before each timed call (about 58 µs of an H200's
time) and records CUDA events around the one call, so the GPU waits for whatever host time the
call spends before its first kernel beyond that fill: a call whose kernels are faster can still
read slower (99 for a bfloat16 model read 1.00x with 0.186 ms of GPU work against the reference's
0.2145, until its host path before the GEMM was cut from 56 to 17.5 µs).

For one problem, the reference model and the module from ``get_module`` (the same parameters),
each round in alternating order: synchronize, the fill, then the host's clock around the start
event's record, the call and the end event's record, with ``F.linear`` and ``torch.addmm`` (the
GEMMs of the reference and of the cuBLAS-based variants) wrapped to stamp their entry and exit.
Under ``--grad`` as the harness runs it (grad mode on, parameters requiring grad), else under
no_grad. Prints per model the median and p10-p90 µs of: the event record, the host up to the
GEMM's entry, the GEMM's own host time, the rest of the call, the call's whole host time, and the
events' time (mean too: the harness averages). A call whose GEMM is not one of those two (a
triton variant's) shows no stamps. On the CPU the events are the host's clock and there is no fill.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import autofuse
from autofuse.core import registry

FILL = (32, 1024, 1024)  # int64: 256 MB, the harness's clear_l2_cache
PIECES = ("record", "to_gemm", "gemm", "after_gemm", "host", "events")


class GemmStamps:
    """F.linear and torch.addmm wrapped to stamp the first GEMM's entry and exit of each call."""

    def __init__(self):
        self.entry = self.exit = None
        self._saved = F.linear, torch.addmm

    def _wrap(self, fn):
        def stamped(*args, **kwargs):
            first = self.entry is None
            if first:
                self.entry = time.perf_counter()
            out = fn(*args, **kwargs)
            if first:
                self.exit = time.perf_counter()
            return out
        return stamped

    def __enter__(self):
        F.linear, torch.addmm = self._wrap(F.linear), self._wrap(torch.addmm)
        return self

    def __exit__(self, *exc):
        F.linear, torch.addmm = self._saved

    def clear(self):
        self.entry = self.exit = None


def one_call(model, x, stamps: GemmStamps, device: str) -> dict:
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.empty(FILL, dtype=torch.int64, device=device).fill_(42)
    stamps.clear()
    t0 = time.perf_counter()
    if cuda:
        start.record()
    t1 = time.perf_counter()
    model(x)
    t2 = time.perf_counter()
    if cuda:
        end.record()
        torch.cuda.synchronize()
    row = {"record": t1 - t0, "host": t2 - t0,
           "events": start.elapsed_time(end) / 1e3 if cuda else t2 - t1}
    if stamps.entry is not None:
        row.update(to_gemm=stamps.entry - t1, gemm=stamps.exit - stamps.entry, after_gemm=t2 - stamps.exit)
    return row


def summary(rows: list[dict]) -> list[str]:
    cells = []
    for piece in PIECES:
        values = sorted(r[piece] * 1e6 for r in rows if piece in r)
        if not values:
            cells.append("-")
            continue
        cell = f"{statistics.median(values):.1f} ({values[len(values) // 10]:.1f}-{values[9 * len(values) // 10]:.1f})"
        if piece == "events":
            cell += f", mean {statistics.fmean(values):.1f}"
        cells.append(cell)
    return cells


def measure(args) -> list[list[str]]:
    prob = registry.get_problem(args.problem)
    shape = dict(zip(prob.dims, args.shape))
    init_args, init_kwargs = prob.init_args(shape)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    reference = prob.build_model(shape).to(args.device, dtype)
    module = autofuse.get_module(args.problem, *init_args, table=args.table, precision=args.precision, **init_kwargs)
    module.load_state_dict(reference.state_dict())
    module = module.to(args.device, dtype).train(reference.training)
    x = torch.rand(shape[prob.batch_dim], args.shape[1], device=args.device).to(dtype)
    models = {"reference": reference, "dispatch": module}
    rows = {name: [] for name in models}
    with torch.set_grad_enabled(args.grad), GemmStamps() as stamps:
        for model in models.values():
            for _ in range(5):  # warm: builds, caches, and a grad-mode key's switch to its no-grad entry
                model(x)
        for r in range(args.rounds):
            for name in (list(models) if r % 2 else list(models)[::-1]):
                rows[name].append(one_call(models[name], x, stamps, args.device))
        served = module.dispatch_info(x)
    table = [[name, *summary(rows[name])] for name in models]
    free = served.get("without_backward")  # grad mode: the no-grad entry serves once no backward came
    if free and free["switched"]:
        served = free
    table[1][0] += f" ({served['variant']}, {served['source']})"
    return table


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("problem")
    ap.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")), default=(1024, 8192, 8192),
                    help="batch,in,out (default 1024,8192,8192)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's dtype")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--table", default=None, help="the dispatch table (default: $AUTOFUSE_HOME/table.json)")
    ap.add_argument("--grad", action="store_true", help="grad mode on, as KernelBench's harness leaves it")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--device", default="cuda")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    table = measure(args)
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"{args.problem} {args.shape}, a {args.dtype} model at {args.precision}, "
          f"{'grad mode on' if args.grad else 'no_grad'}, {args.rounds} rounds, {where}; µs: median (p10-p90)")
    print(tabulate(table, headers=["model", *PIECES]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
