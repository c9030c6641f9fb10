"""matmul_gelu_softmax: the gradient check leaves out rows whose softmax saturates past float64.

Softmax's backward forms its largest weight's term from g_k − ⟨y, g⟩, two numbers equal to 2⁻⁵²
of g_k where the rest of the row weighs t ≪ 1, while the exact term is t-sized: below
``SATURATED_TAIL`` the float64 reference's own gradient is rounding, and a variant that computes
it exactly (triton's fp32 backward did, interpreted: 1.7e-5 off the exact gradient where the
reference was 40% off) would fail against it. ``rows_on_a_kink`` flags those rows, and only those.
"""

import torch

from autofuse.core import registry

PROBLEM = registry.get_problem("matmul_gelu_softmax")


def model_and_rows():
    """A model whose first row's logits are far apart (saturated), its second's close (ordinary)."""
    torch.manual_seed(0)
    model = PROBLEM.build_model({"batch_size": 2, "in_features": 6, "out_features": 5}).double()
    x = torch.randn(2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[0] *= 400.0 / model.linear(x[:1]).detach().std()  # logits hundreds apart: t ~ e^-100s
    x[1] *= 0.5 / model.linear(x[1:]).detach().std()
    return model, x


def exact_input_gradient(model, x, g):
    """dx in float64 with softmax's backward formed without the cancellation: ⟨y, g⟩ − g_k from
    the tail's weights."""
    h = model.linear(x).detach().requires_grad_()
    a = torch.nn.functional.gelu(h)
    y = torch.softmax(a, dim=1).detach()
    k = y.argmax(dim=1, keepdim=True)
    tail = y.scatter(1, k, 0.0)
    dot_less_gk = (tail * g).sum(1, keepdim=True) - tail.sum(1, keepdim=True) * g.gather(1, k)
    a.backward(y * (g - g.gather(1, k) - dot_less_gk))
    return h.grad @ model.linear.weight.detach()


def test_a_row_saturated_past_float64_is_flagged_and_an_ordinary_row_is_not():
    model, x = model_and_rows()
    for precision in ("fp32", "tf32", "bf16", "ieee"):
        assert PROBLEM.rows_on_a_kink(model, x.float(), precision).tolist() == [True, False]


def test_the_flagged_rows_reference_gradient_is_rounding_and_the_others_is_exact():
    model, x = model_and_rows()
    g = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_()
    model(xr).backward(g)
    exact = exact_input_gradient(model, x, g)
    off = ((xr.grad - exact).norm(dim=1) / exact.norm(dim=1)).tolist()
    assert off[0] > 1e-3, off  # the reference's dx on the saturated row: not the gradient
    assert off[1] < 1e-12, off  # on the ordinary row the two formulas agree
