"""Where 22's triton input gradient goes 0.00282 off at "randn randomized seed=8" (1024×8192×8192, fp32).

    python3 tests/device/lse_gradient_case.py

fp16_backward_case.py showed the backward's GEMMs exact on the dy they were given, and the same
error with cuBLAS multiplying: so dy, or what the forward saved for it. Per operand path, the
saved logits y and z against float64, the clamp mask's flips, and dy recomputed in float64 from
the saved y and z against dy from float64 y and z.
"""

from __future__ import annotations

import json

import torch
from autofuse.variants.matmul_clamp_lse_mish import gradients
from autofuse.variants.matmul_clamp_lse_mish.cuda_fused import clamp_lse_scalars
from autofuse.variants.matmul_clamp_lse_mish.gradients import output_grad

from autofuse.core import registry
from autofuse.kernels.triton.variant import DEFAULTS
from autofuse.tuning.gate import CheckCase, build_case

prob = registry.get_problem("matmul_clamp_lse_mish")
shape = dict(zip(prob.dims, (1024, 8192, 8192)))
saved = {}
original = gradients.backward


def spy(stored, grad, needs, *args, **kwargs):
    saved.update(stored=[None if t is None else t.detach().clone() for t in stored], grad=grad.clone())
    return original(stored, grad, needs, *args, **kwargs)


gradients.backward = spy
for seed, randomize, dist in ((8, True, "randn"), (7, False, "rand")):
    for operands in ("split_fp16", "split_host"):
        model, x = build_case(prob, CheckCase(shape, dist, seed, randomize), "cuda", torch.float32, "train")
        params = {**DEFAULTS["fp32"], "operands": operands}
        if operands == "split_host":
            params["block_k"] = 32
        variant = registry.get_variant(prob.name, "triton")("fp32", **params)
        x.requires_grad_(True)
        out = variant(model, x)
        g = torch.randn_like(out)
        out.backward(g)
        _, w, b, y, _, z = saved["stored"]
        t, lo, hi = clamp_lse_scalars(model)
        x64, w64, b64 = x.detach().double(), model.matmul.weight.detach().double(), model.matmul.bias.detach().double()
        y64 = x64 @ w64.t() + b64
        v64 = y64 * t
        z64 = torch.logsumexp(v64.clamp(lo, hi), dim=1, keepdim=True)
        inside64 = (v64 >= lo) & (v64 <= hi)
        v = y.double() * t
        inside = (v >= lo) & (v <= hi)

        def dy_of(v, z, inside):
            gz = saved["grad"].double() * output_grad(z.double())
            return torch.where(inside, torch.exp(v.clamp(lo, hi) - z) * gz * t, 0.0)

        dy64 = dy_of(v64, z64, inside64)
        dy_saved = dy_of(v, z.double(), inside)
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        rows = ((dy_saved - dy64).norm(dim=1) / dy64.norm(dim=1).clamp_min(1e-300))
        print(json.dumps({"seed": seed, "operands": operands, "t, lo, hi": [t, lo, hi],
                          "y rel L2": rel(y.double(), y64), "y max abs err": float((y.double() - y64).abs().max()),
                          "z max abs err": float((z.double() - z64).abs().max()), "mask flips": int((inside != inside64).sum()),
                          "dy (float64 from saved y, z) rel L2": rel(dy_saved, dy64),
                          "worst rows": rows.topk(3).values.tolist(), "worst row ids": rows.topk(3).indices.tolist(),
                          "z at worst": z64[rows.topk(3).indices].flatten().tolist(),
                          "h'(z) at worst": output_grad(z64[rows.topk(3).indices]).flatten().tolist(),
                          "x.grad vs float64 dy·W": rel(x.grad.double(), dy64 @ w64)}), flush=True)
