"""Grad-mode calls that no backward follows (``autofuse.serve.grad_mode``), on the GPU: what the switch to
the no-grad entry gives, and that a backward after it still gets the autograd entry's gradients.

    python3 benchmarks/gpu/grad_without_backward.py [--table benchmarks/table.json] [--precisions fp32,tf32,bf16]
        [--problems kb2-22,kb2-99,gemm_bn,kb2-51] [--batches default,37] [--rounds 15] [--json F]

For each problem (gemm_bn in train and eval mode), precision and batch (the first default shape,
then others at its sizes: the dispatch's nearest-batch entry), through ``get_module`` and the table:
- which variants serve: the autograd entry, and the no-grad entry once the calls had no backward;
- at the default batch, the forward timed interleaved (``autofuse.tuning.timing``, L2 flushed): under
  no_grad; with grad on before the switch (the autograd entry, its graph dropped); after it;
- a late backward: module A is called ``SWITCH_AFTER`` times without a backward, then once more
  (the no-grad entry) and backward from a random upstream gradient; its twin B, built from the same
  state, is called once (the autograd entry) and backward from the same gradient. Each gradient's
  largest |A − B| (0 expected: A's backward runs B's forward again), and A's output against B's
  (two variants, relative L2), and the running statistics of A (four calls) against a copy of the
  reference that ran the same four calls (gemm_bn train: relative L2, exact only up to the variant's
  own statistics' rounding).
One JSON line per case on stdout (and in --json).
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib

import torch

import autofuse
from autofuse.core import registry
from autofuse.serve.grad_mode import SWITCH_AFTER
from autofuse.tuning import timing


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def cases(problems):
    for name in problems:
        prob = registry.get_problem(name)
        for mode in (("train", "eval") if prob.mode_sensitive else ("train",)):
            yield prob, mode


def build(prob, shape, mode, precision, table):
    args, kwargs = prob.init_args(shape)
    module = autofuse.get_module(prob.name, *args, table=table, precision=precision, **kwargs)
    reference = prob.model(*args, **kwargs)
    prob.randomize_parameters(reference, torch.Generator().manual_seed(0))
    module.load_state_dict(reference.state_dict())
    return module.cuda().train(mode == "train"), reference.cuda().train(mode == "train")


def late_backward(prob, shape, mode, precision, table) -> dict:
    a, reference = build(prob, shape, mode, precision, table)
    b = copy.deepcopy(a)
    gen = torch.Generator().manual_seed(1)
    x = prob.make_input(shape, "randn", gen, "cuda")
    for _ in range(SWITCH_AFTER):
        a(x)
    for _ in range(SWITCH_AFTER + 1):
        reference(x)
    out_a = a(x)
    info = a.dispatch_info(x)
    g = torch.randn(out_a.shape, generator=gen).cuda()
    out_a.backward(g)
    out_b = b(x)
    out_b.backward(g)
    grads = {}
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if pb.grad is None or pa.grad is None:
            grads[name] = None if pa.grad is None and pb.grad is None else "one side None"
        else:
            grads[name] = float((pa.grad - pb.grad).abs().max())
    stats = {n: rel_l2(a.get_buffer(n), buf) for n, buf in reference.named_buffers() if buf.is_floating_point()}
    return {"grad_fn": type(out_a.grad_fn).__name__, "autograd_entry": info["variant"],
            "without_backward": info["without_backward"]["variant"], "output_rel_l2_vs_autograd_entry": rel_l2(out_a, out_b),
            "max_abs_grad_difference": grads, "running_stats_rel_l2_vs_reference": stats}


def forward_times(prob, shape, mode, precision, table, rounds) -> dict:
    module, _ = build(prob, shape, mode, precision, table)
    saving = copy.deepcopy(module)
    x = prob.make_input(shape, "randn", torch.Generator().manual_seed(2), "cuda")
    for _ in range(SWITCH_AFTER):
        module(x)  # past the switch: its grad-mode calls now run the no-grad entry
    saving(x)
    saving_call = saving._autofuse.ready[saving._autofuse.call_key(saving, x)]

    def no_grad():
        with torch.no_grad():
            module(x)

    def autograd_entry():
        saving_call.since_backward = 0  # as after a backward: the autograd entry serves the call
        saving(x)

    fns = {"no_grad": no_grad, "grad, autograd entry": autograd_entry, "grad, after the switch": lambda: module(x)}
    times = timing.time_interleaved(fns, "cuda", rounds=rounds)
    return {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)] for k, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--precisions", default="fp32,tf32,bf16")
    ap.add_argument("--problems", default="kb2-22,kb2-99,gemm_bn,kb2-51")
    ap.add_argument("--batches", default="default,37")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    lines = []
    print(torch.cuda.get_device_name(), flush=True)
    for prob, mode in cases(args.problems.split(",")):
        default = dict(prob.normalize_shape(prob.default_shapes[0]))
        for precision in args.precisions.split(","):
            for batch in args.batches.split(","):
                shape = dict(default) if batch == "default" else {**default, prob.batch_dim: int(batch)}
                line = {"problem": prob.name, "mode": mode, "precision": precision, "shape": shape}
                try:
                    line.update(late_backward(prob, shape, mode, precision, args.table))
                    if batch == "default":
                        line["forward_ms"] = forward_times(prob, shape, mode, precision, args.table, args.rounds)
                except Exception as exc:  # noqa: BLE001 - a failing case is a result; go on
                    line["error"] = f"{type(exc).__name__}: {exc}"
                print(json.dumps(line), flush=True)
                lines.append(line)
    if args.json:
        args.json.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
