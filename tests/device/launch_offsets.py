"""When does the host launch 22's Triton GEMM in a harness call, with grad on and under no_grad?

    python3 tests/device/launch_offsets.py [--precision bf16] [--calls 60]

No profiler (it adds host time of its own): the kernels' ``Launcher.run`` is wrapped to read the
wall clock as each launch starts, and each call is made as KernelBench's harness makes it
(synchronize, fill 256 MB, call; ``kernelbench_harness``). Per mode, the medians (p20-p80) of: each
launch's offset from the call's start, the call's length, and the harness's own event time. The
difference between the modes before the GEMM's launch is host time the GPU may wait for.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from autofuse.kernels.triton import launch as triton_launch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import kernelbench_harness as harness  # noqa: E402


def spread(values):
    q = statistics.quantiles(values, n=5)
    return [round(statistics.median(values), 1), round(q[0], 1), round(q[3], 1)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--problem", default="kb2-22")
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    out = pathlib.Path("/tmp/launch_offsets")
    out.mkdir(exist_ok=True)
    custom = harness.export(args.problem, args.precision, args.table, out, small=False)
    model, model_new, get_inputs = harness.build(custom.split(harness.MARKER)[0], custom, 0, "cuda", torch.float32)
    harness.set_seed(0, "cuda")
    inputs = harness.inputs_of(get_inputs, "cuda", torch.float32)
    stamps: list[tuple[str, float]] = []
    original = triton_launch.Launcher.run

    def run(self, grid, a, kw):
        stamps.append((self.fn.__name__, time.perf_counter()))
        return original(self, grid, a, kw)

    triton_launch.Launcher.run = run
    print(torch.cuda.get_device_name(), args.problem, args.precision, flush=True)
    for grad in (True, False, True, False):
        with torch.set_grad_enabled(grad):
            harness.time_calls(model_new, inputs, 5, "cuda")
            offsets: dict[str, list[float]] = {}
            lengths, events = [], []
            for _ in range(args.calls):
                torch.cuda.synchronize()
                torch.empty(harness.L2_THRASH, dtype=torch.int64, device="cuda").fill_(42)
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                stamps.clear()
                start_event.record()
                t0 = time.perf_counter()
                model_new(*inputs)
                t1 = time.perf_counter()
                end_event.record()
                torch.cuda.synchronize()
                for name, t in stamps:
                    offsets.setdefault(name, []).append((t - t0) * 1e6)
                lengths.append((t1 - t0) * 1e6)
                events.append(start_event.elapsed_time(end_event) * 1e3)
        print(json.dumps({"grad": grad, "launch_us": {k: spread(v) for k, v in offsets.items()},
                          "call_us": spread(lengths), "harness_us": spread(events)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
