"""What a dispatching module costs per call over the variant it chose (issue 12.5: target ≤ 3 µs).

    python3 benchmarks/gpu/hot_path.py                        # cuda if present, every problem
    python3 benchmarks/gpu/hot_path.py --device cpu --problem gemm_bn --rounds 30 --calls 300
    autofuse tune matmul_gelu_softmax --shape batch_size=8,in_features=64,out_features=64 --table /tmp/t.json
    python3 benchmarks/gpu/hot_path.py --problem matmul_gelu_softmax --table /tmp/t.json --json out.json

At a tiny shape, where the host's work is the whole cost, times three ways of making one call,
interleaved round by round (each round: ``--calls`` calls of each, in rotating order, then a
device synchronize): ``plain``, the problem's reference ``nn.Module``; ``variant``, the variant
the dispatcher chose called directly (``variant(model, x)``: its math mode included);
``dispatch``, the module from ``get_module`` (``nn.Module.__call__``, the call key, one dict
lookup, the variant). Under ``no_grad``, ``inference_mode`` and grad mode with parameters that
require grad (the autograd key; the reference builds a graph there). On the CPU it counts this
thread's CPU time (``--clock``), so other processes on a shared machine do not. Prints the median and
p20-p80 of µs per call over rounds, and the median (p20-p80) of each round's paired difference
dispatch − variant (the target) and dispatch − plain. Last, rows with the chosen variant
replaced by a stub returning x: the dispatch machinery alone, free of the kernels' noise
(``plain`` there is still the reference). With an empty table (the default: a
fresh ``$AUTOFUSE_HOME``) the chosen variant is the reference, the path the issue measured;
a table tuned at the tiny shape (second command above) times the tuned variants instead.

CPU, 2 cores, torch 2.13, thread clock, 40 rounds × 200 calls: dispatch − variant 4.4-7.1 µs
(median per problem and grad mode) on the reference path, 1.9-2.3 µs with the stub, of which
nn.Module.__call__ is about 1.35; dispatch − plain 8.2-12.0 µs (the variant's own layer:
Variant.__call__, math_mode, EagerVariant.forward). The µs target is for the GPU's host.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from tabulate import tabulate

import autofuse
from autofuse.core import registry

PROBLEMS = ("gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish")
TINY = (8, 64, 64)
MODES = ("no_grad", "inference_mode", "grad")


def _context(mode):
    return {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}[mode]()


def _build(problem, device, precision, table):
    prob = registry.get_problem(problem)
    shape = dict(zip(prob.dims, TINY))
    args, kwargs = prob.init_args(shape)
    plain = prob.model(*args, **kwargs).to(device)
    module = autofuse.get_module(problem, *args, table=table, precision=precision, tune_on_miss=False, **kwargs)
    module.load_state_dict(plain.state_dict())
    module.to(device)
    x = prob.make_input(shape, "rand", torch.Generator().manual_seed(0), device)
    return plain, module, x


def _round(calls, n, sync, clock):
    """µs per call of each callable: ``n`` calls of one, then the next, each ended by ``sync``."""
    out = {}
    for name, fn in calls:
        start = clock()
        for _ in range(n):
            fn()
        sync()
        out[name] = (clock() - start) / n * 1e6
    return out


def _stub(model, x):
    return x


def measure(problem, device, precision, table, mode, rounds, n, clock=time.perf_counter, stub=False):
    """(dispatch_info, per-round µs per call); ``stub``: the chosen variant replaced by one that
    returns x, so ``dispatch - variant`` is the dispatch machinery alone, free of kernel noise."""
    plain, module, x = _build(problem, device, precision, table)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    with _context(mode):
        module(x)
        info = module.dispatch_info(x)
        key = module._autofuse.call_key(module, x)
        if stub:
            module._autofuse.ready[key] = _stub
            info = {**info, "variant": "stub", "source": "returns x"}
        variant = module._autofuse.ready[key]
        calls = [("plain", lambda: plain(x)), ("variant", lambda: variant(module, x)), ("dispatch", lambda: module(x))]
        _round(calls, n, sync, clock)  # warm-up
        samples = []
        for r in range(rounds):
            order = calls[r % 3:] + calls[:r % 3]
            samples.append(_round(order, n, sync, clock))
    return info, samples


def _stats(values):
    values = sorted(values)
    return statistics.median(values), values[len(values) // 5], values[(4 * len(values)) // 5]


def summarize(problem, mode, info, samples):
    row = {"problem": problem, "grad": mode, "served by": f"{info['variant']} ({info['source']})"}
    for name in ("plain", "variant", "dispatch"):
        row[name] = _stats([s[name] for s in samples])
    row["dispatch - variant"] = _stats([s["dispatch"] - s["variant"] for s in samples])
    row["dispatch - plain"] = _stats([s["dispatch"] - s["plain"] for s in samples])
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--problem", action="append", help=f"default: all of {', '.join(PROBLEMS)}")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--table", help="dispatch table (default: an empty one, so the reference path)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=500, help="calls per callable per round")
    parser.add_argument("--clock", choices=["wall", "thread"], help="wall: perf_counter (default on cuda, where "
                        "the device's work is waited for); thread: this thread's CPU time (default on cpu: "
                        "time other processes take from a shared machine is not counted)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        # One thread: at this size intra-op threads only add wake-up jitter (on a shared
        # 2-core machine, 250-2,000 µs per call with 2 threads).
        torch.set_num_threads(1)
    clock_name = args.clock or ("wall" if args.device.startswith("cuda") else "thread")
    clock = time.perf_counter if clock_name == "wall" else time.thread_time
    table = args.table or os.path.join(tempfile.mkdtemp(), "empty-table.json")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    logging.getLogger("autofuse").setLevel(logging.ERROR)  # the reference path is the point here
    print(f"{name}, torch {torch.__version__}, {args.precision}, shape {TINY}, {args.rounds} rounds x {args.calls} calls, "
          f"{clock_name} clock")
    rows = []
    for problem in args.problem or PROBLEMS:
        for mode in MODES:
            info, samples = measure(problem, args.device, args.precision, table, mode, args.rounds, args.calls, clock)
            rows.append(summarize(problem, mode, info, samples))
    for mode in MODES:  # the machinery alone: the key, the lookup, nn.Module.__call__
        info, samples = measure((args.problem or PROBLEMS)[0], args.device, args.precision, table, mode,
                                args.rounds, args.calls, clock, stub=True)
        rows.append(summarize((args.problem or PROBLEMS)[0], mode, info, samples))
    cell = lambda s: f"{s[0]:.2f} ({s[1]:.2f}-{s[2]:.2f})"  # noqa: E731
    headers = ["problem", "grad", "served by", "plain", "variant", "dispatch", "dispatch - variant", "dispatch - plain"]
    print(tabulate([[r[h] if isinstance(r[h], str) else cell(r[h]) for h in headers] for r in rows],
                   headers=[h if h in ("problem", "grad", "served by") else f"{h} µs" for h in headers]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "shape": TINY, "clock": clock_name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
