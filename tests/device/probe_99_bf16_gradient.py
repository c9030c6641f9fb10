"""Why 99's cublas_epilogue bf16 gradient misses at (5, 33, 1000), large inputs (one-off probe).

    python3 tests/device/probe_99_bf16_gradient.py

Prints, against float64: the forward's error and the input gradient's, for the variant, for
eager under bf16 (the floor), and for the variant's backward with its Triton row kernel off
(the torch formula), plus how one-hot the rows are.
"""

import copy

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.core.variant import EagerVariant
from autofuse.testing import conformance_cases
from autofuse.tuning.gate import prepare_case

prob = registry.get_problem("matmul_gelu_softmax")
cls = registry.get_variant("matmul_gelu_softmax", "cublas_epilogue")
case = [c for c in conformance_cases("matmul_gelu_softmax", 0, ((5, 33, 1000),)) if c.distribution == "large"][0]
prepared = prepare_case(prob, case, "cuda", torch.float32, "train", "bf16")
generator = torch.Generator().manual_seed(case.seed + 7)
cot = torch.randn(prepared.ref.shape, generator=generator, dtype=torch.float64).cuda()


def run(fn, model, dtype):
    with math_mode("bf16"):
        x = prepared.x.detach().to(dtype).requires_grad_(True)
        out = fn(model, x)
        out.backward(cot.to(out.dtype))
    return out.detach().double(), x.grad.double(), {n: p.grad.double() for n, p in model.named_parameters()}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


ref_out, ref_dx, ref_p = run(lambda m, x: m(x), prob.reference_model(prepared.model), torch.float64)
print("ref out max per row", ref_out.max(dim=1).values.tolist(), "|dx|", ref_dx.norm().item())
print("logits range", (prepared.x.double() @ prepared.model.linear.weight.double().t()).abs().max().item())
variant = cls("bf16", block=128, items=8)
variant.build("cuda")
for name, fn in (("variant", variant), ("eager bf16", EagerVariant("bf16"))):
    out, dx, p = run(fn, copy.deepcopy(prepared.model), torch.float32)
    print(f"{name:12s} out {rel(out, ref_out):.3g} dx {rel(dx, ref_dx):.3g} dW {rel(p['linear.weight'], ref_p['linear.weight']):.3g} "
          f"db {rel(p['linear.bias'], ref_p['linear.bias']):.3g} |dx| {dx.norm().item():.3g} top {out.argmax(1).tolist()} ref top {ref_out.argmax(1).tolist()}")
from autofuse.variants.matmul_gelu_softmax import gradients as g99  # noqa: E402

g99.fused_kernels_apply = lambda *t: False
out, dx, p = run(variant, copy.deepcopy(prepared.model), torch.float32)
print(f"variant, torch backward formula: dx {rel(dx, ref_dx):.3g} dW {rel(p['linear.weight'], ref_p['linear.weight']):.3g}")
