"""51's backward: the Triton passes' block sizes, and the training step they give.

    python3 tests/device/probe_51_backward.py [--batch 2048 --in-features 8192 --out-features 8192]

1. Each block configuration of ``gradients.fused_backward`` (the first pass's, then the second's
   with the best first) checked against the torch formulas and timed, as the training step asks
   (dW, db and dsubtract; x needs none; r saved by the forward), then the best without r; the
   memory traffic's floor beside it: read x and g, write dW, at the copy bandwidth measured here.
2. The training step (``autofuse.tuning.timed_call.training_call``) of single_pass with the Triton backward,
   with the torch formulas, and eager's, interleaved; then torch.profiler's kernels of one step.
One JSON line per result on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from autofuse.variants.gemm_avgpool_gelu_residual import gradients as g51

from autofuse.core import registry
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.timed_call import training_call
from autofuse.tuning.timing import time_callable, time_interleaved

PROBLEM = "gemm_avgpool_gelu_residual"
STEP_NEEDS = (False, True, True, True)


def emit(**record):
    print(json.dumps(record), flush=True)


def relative_errors(got, want) -> list[float]:
    return [((a - b).norm() / b.norm()).item() for a, b in zip(got, want) if b is not None]


def sweep(x, w_mean, offset, grad, n_out):
    r = torch.addmv(offset, x, w_mean)  # as the forward's kernel saves it
    saved = (x, w_mean, offset, r)
    want = g51.torch_backward(saved, grad, STEP_NEEDS, n_out)
    emit(what="torch formulas", **time_callable(lambda: g51.torch_backward(saved, grad, STEP_NEEDS, n_out), "cuda").to_dict())

    def measure(blocks, saved_r=r):
        run = lambda: g51.fused_backward(x, w_mean, offset, saved_r, grad, STEP_NEEDS, n_out, **blocks)  # noqa: E731
        errors = relative_errors(run(), want)
        timing = time_callable(run, "cuda")
        emit(what="fused", blocks=blocks, r_saved=saved_r is not None, max_error=max(errors), **timing.to_dict())
        return timing.median_ms if max(errors) < 1e-5 else float("inf")

    second = {"w_block_k": 64, "w_block_o": 16, "out_split": 4}
    tried = {}
    for rows, block_k in itertools.product((4, 8, 16, 32), (256, 512, 1024)):
        if rows * block_k <= 16384:
            tried[(rows, block_k)] = measure({"rows": rows, "row_block_k": block_k, **second})
    rows, block_k = min(tried, key=tried.get)
    first = {"rows": rows, "row_block_k": block_k}
    tried = {}
    for block_k, block_o, split in itertools.product((64, 128), (16, 32), (4, 8)):
        if block_k * block_o <= 8192:
            tried[(block_k, block_o, split)] = measure({**first, "w_block_k": block_k, "w_block_o": block_o,
                                                        "out_split": split})
    best = min(tried, key=tried.get)
    blocks = {**first, "w_block_k": best[0], "w_block_o": best[1], "out_split": best[2]}
    emit(what="best", blocks=blocks, median_ms=tried[best])
    measure(blocks, saved_r=None)  # what saving r saves: x read twice, the second time past L2


def floor(x, grad, n_out):
    """Read x and g, write dW: at the bandwidth of one large copy (read + write) measured here."""
    src = torch.empty(n_out * x.shape[1] // 2, device="cuda")
    copy = time_callable(lambda: src.clone(), "cuda")
    bandwidth = 2 * src.numel() * 4 / (copy.median_ms * 1e-3)
    traffic = (x.numel() + grad.numel() + n_out * x.shape[1]) * 4
    emit(what="floor", copy_tb_s=round(bandwidth / 1e12, 3), traffic_mb=traffic / 1e6,
         floor_ms=round(traffic / bandwidth * 1e3, 4))


def steps(shape):
    problem = registry.get_problem(PROBLEM)
    model, x = build_case(problem, CheckCase(shape, "rand", 0, False), "cuda", torch.float32, "train")
    eager = registry.get_variant(PROBLEM, "eager")("fp32")
    single_cls = registry.get_variant(PROBLEM, "single_pass")
    single = single_cls("fp32", **single_cls.configs(shape, "cuda")[0])
    fused_step = training_call(single, model, x)
    plain_step = training_call(single, model, x)

    def torch_step():  # the backward runs inside the step (out.backward), so the flag holds for it
        g51.fused_kernels_apply, kept = (lambda *t: False), g51.fused_kernels_apply
        try:
            return plain_step()
        finally:
            g51.fused_kernels_apply = kept

    calls = {"single_pass, Triton backward": fused_step, "single_pass, torch backward": torch_step,
             "eager": training_call(eager, model, x)}
    timings = time_interleaved(calls, "cuda", rounds=10)
    for name, t in timings.items():
        emit(what="step", name=name, **t.to_dict())
    emit(what="step speedup over eager",
         x=round(timings["eager"].median_ms / timings["single_pass, Triton backward"].median_ms, 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fused_step()
        torch.cuda.synchronize()
    rows = [(e.key[:60], round(e.device_time_total / 10 / 1000.0, 4)) for e in prof.key_averages()]
    emit(what="step kernels (ms per step)", kernels=sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])[:10])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--in-features", type=int, default=8192)
    parser.add_argument("--out-features", type=int, default=8192)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    m, k, n_out = args.batch, args.in_features, args.out_features
    x = torch.rand(m, k, generator=generator).cuda()
    w_mean = (torch.randn(k, generator=generator) * 0.01).cuda()
    offset = torch.tensor(0.05, device="cuda")
    grad = torch.randn(m, k, generator=generator).cuda()
    emit(device=torch.cuda.get_device_name(), shape=[m, k, n_out])
    floor(x, grad, n_out)
    sweep(x, w_mean, offset, grad, n_out)
    steps({"batch_size": m, "in_features": k, "out_features": n_out})


if __name__ == "__main__":
    main()
