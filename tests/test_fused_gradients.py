"""The fused variants' backward rules (variants/<problem>/gradients.py), checked on the CPU.

Each rule runs through ``autofuse.kernels.autograd.fused_call`` (its ``FusedFunction``) behind the
problem's forward written in torch (``torch_forward``): ``torch.autograd.gradcheck`` in float64
checks the rule against finite differences, and a comparison with the reference model's own
autograd checks the cases finite differences cannot see (clamped logits, a recomputed
intermediate, BatchNorm's bias). The CUDA and Triton forwards save the same tensors; the gate
checks their gradients on the GPU.
"""

import pytest
import torch
import torch.nn.functional as F
from autofuse.variants.gemm_avgpool_gelu_residual import gradients as g51
from autofuse.variants.gemm_bn import gradients as gbn
from autofuse.variants.matmul_clamp_lse_mish import gradients as g22
from autofuse.variants.matmul_gelu_softmax import gradients as g99
from helpers import assert_close, relative_error

from autofuse.core import registry
from autofuse.kernels.autograd import (
    FusedOp,
    GemmGrad,
    GradLayouts,
    backward_gemms,
    fused_call,
    grad_layouts,
    needs_grad,
)

F64 = torch.float64
SHAPES = [(1, 5, 3), (7, 6, 5)]  # batch 1 and odd sizes
BN_SHAPES = [(2, 5, 3), (7, 6, 5)]  # training-mode BN needs two rows
ROWS_ONLY = GradLayouts(rows=True, cols=False, sums=False)  # ∂L/∂y as dy alone


def _leaf(*shape, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator, dtype=F64)).requires_grad_(True)


def _gradcheck(op, *inputs):
    assert torch.autograd.gradcheck(lambda *a: fused_call(op, *a), inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_softmax_rule_matches_finite_differences(shape):
    batch, n_in, n_out = shape
    op = g99.fused_op(g99.torch_forward("fp32"), "fp32")
    _gradcheck(op, _leaf(batch, n_in), _leaf(n_out, n_in, seed=1), _leaf(n_out, seed=2))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("scalars", [(4.0, -10.0, 10.0), (4.0, -0.5, 0.7)], ids=["wide", "clamping"])
def test_clamp_lse_mish_rule_matches_finite_differences(shape, scalars):
    batch, n_in, n_out = shape
    op = g22.fused_op(g22.torch_forward("fp32", scalars), "fp32", scalars)
    _gradcheck(op, _leaf(batch, n_in), _leaf(n_out, n_in, seed=1), _leaf(n_out, seed=2))


@pytest.mark.parametrize("tile_n", [2, 3])
@pytest.mark.parametrize("scalars", [(4.0, -10.0, 10.0), (4.0, -0.5, 0.7)], ids=["wide", "clamping"])
def test_clamp_lse_mish_rule_from_softmax_parts(tile_n, scalars):
    """The bf16 Triton forward saves q = exp(c − tile max)·[inside] and the tile maxima in place of
    the logits (5 columns: a partial tile); float64 here, so finite differences can check it."""
    parts = g22.SoftmaxParts(tile_n)
    op = g22.fused_op(g22.torch_forward("fp32", scalars, parts), "fp32", scalars, parts)
    _gradcheck(op, _leaf(7, 6), _leaf(5, 6, seed=1), _leaf(5, seed=2))


@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
def test_batchnorm_training_rule_matches_finite_differences(shape):
    batch, n_in, n_out = shape
    op = gbn.train_op(gbn.torch_train_forward("fp32", 1e-5), "fp32", 1e-5)
    inputs = (_leaf(batch, n_in), _leaf(n_out, n_in, seed=1), _leaf(n_out, seed=2), _leaf(n_out, seed=3),
              _leaf(n_out, seed=4), _leaf(n_out, seed=5))
    _gradcheck(op, *inputs)


@pytest.mark.parametrize("tile_rows", [2, 3])
def test_batchnorm_training_rule_from_z_saved_less_each_row_tiles_mean(tile_rows):
    """The Triton forward saves z − its row tile's mean and a shift per tile (7 rows: a partial tile)."""
    op = gbn.train_op(gbn.torch_train_forward("fp32", 1e-5, tile_rows), "fp32", 1e-5, tile_rows)
    inputs = (_leaf(7, 5), _leaf(4, 5, seed=1), _leaf(4, seed=2), _leaf(4, seed=3), _leaf(4, seed=4), _leaf(4, seed=5))
    _gradcheck(op, *inputs)


def test_batchnorm_training_rule_with_a_large_eps_where_the_scale_gradient_is_not_negligible():
    op = gbn.train_op(gbn.torch_train_forward("fp32", 0.5), "fp32", 0.5)
    inputs = (_leaf(6, 4), _leaf(3, 4, seed=1), _leaf(3, seed=2), _leaf(3, scale=0.3, seed=3), _leaf(3, seed=4),
              _leaf(3, seed=5))
    _gradcheck(op, *inputs)


@pytest.mark.parametrize("affine", [True, False], ids=["bias and affine BatchNorm", "neither"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_batchnorm_eval_rule_matches_finite_differences(shape, affine):
    """Eval mode's rule from the parameters themselves (x, W, b, s, γ, β; b, γ and β may be absent),
    the running statistics constants, a large eps so it counts."""
    batch, n_in, n_out = shape
    mean, var = _leaf(n_out, seed=6).detach(), _leaf(n_out, seed=7).detach().abs() + 0.5
    op = gbn.eval_op(gbn.torch_eval_forward("fp32"), "fp32", mean, var, 0.3)
    params = [_leaf(n_out, seed=s) if affine or s == 3 else None for s in (2, 3, 4, 5)]
    _gradcheck(op, _leaf(batch, n_in), _leaf(n_out, n_in, seed=1), *params)


def test_batchnorm_eval_rule_gives_the_references_gradients():
    """The same op on the problem's own eval-mode model: every parameter's gradient and x's as
    autograd through the reference gives them."""
    prob = registry.get_problem("gemm_bn")
    shape = {"batch_size": 5, "in_features": 6, "out_features": 4}
    model = prob.build_model(shape).double().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
    x, cotangent = _leaf(5, 6), torch.randn(5, 4, dtype=F64)
    model(x).backward(cotangent)
    want = [x.grad, *(p.grad for p in model.parameters())]
    x.grad = None
    model.zero_grad()
    gbn.eval_call(gbn.torch_eval_forward("fp32"), "fp32", model, x).backward(cotangent)
    for got, expected in zip([x.grad, *(p.grad for p in model.parameters())], want, strict=True):
        assert_close(got, expected, rtol=1e-12, atol=1e-12)


def _avgpool_forward(save_r: bool):
    """51's fused forward in torch, saving r = x·w̄ + c as the row kernels do, or None (recomputed)."""
    def forward(x, weight, bias, subtract, save):
        w_mean, offset = weight.mean(0), bias.mean() - subtract.mean()
        r = torch.addmv(offset, x, w_mean)
        return x + F.gelu(r)[:, None], (x, w_mean, offset, r.detach() if save_r else None)
    return forward


@pytest.mark.parametrize("save_r", [True, False], ids=["r saved", "r recomputed"])
def test_gemm_avgpool_rule_matches_finite_differences_in_the_parameters(save_r):
    # x's gradient skips the detached residual, which finite differences would see: checked below.
    n_out = 5
    x = _leaf(7, 6).detach()
    forward = _avgpool_forward(save_r)

    op = g51.fused_op(forward, "fp32", n_out)
    assert torch.autograd.gradcheck(lambda *p: fused_call(op, x, *p),
                                    (_leaf(n_out, 6, seed=1), _leaf(n_out, seed=2), _leaf(n_out, seed=3)))


@pytest.mark.parametrize("save_r", [True, False], ids=["r saved", "r recomputed"])
def test_gemm_avgpool_rule_gives_the_references_input_gradient(save_r):
    from autofuse.problems.gemm_avgpool_gelu_residual import Model

    torch.manual_seed(0)
    model = Model(6, 5).double()
    x = _leaf(7, 6)
    cotangent = torch.randn(7, 6, dtype=F64)
    model(x).backward(cotangent)
    want = x.grad.clone()
    x.grad = None
    gemm = model.gemm
    fused_call(g51.fused_op(_avgpool_forward(save_r), "fp32", 5), x, gemm.weight, gemm.bias, model.subtract).backward(cotangent)
    assert_close(x.grad, want, atol=1e-12, rtol=1e-10, what="x.grad")


def test_a_recomputed_intermediate_gives_the_same_gradients():
    """Kernels that never store the logits save None; the backward recomputes them."""
    x, w, b = _leaf(7, 6), _leaf(5, 6, seed=1), _leaf(5, seed=2)
    grad = torch.randn(7, 5, dtype=F64)
    saved_y = g99.torch_forward("fp32")(x.detach(), w.detach(), b.detach(), save=True)[1]
    recompute = saved_y[:3] + (None, None) + saved_y[5:]
    needs = (True, True, True)
    for got, want in zip(g99.backward(recompute, grad, needs, "fp32"), g99.backward(saved_y, grad, needs, "fp32")):
        assert_close(got, want, atol=1e-12, rtol=1e-12)


def _naive_softmax_backward(out, grad):
    return out * (grad - (grad * out).sum(dim=1, keepdim=True))


def test_the_softmax_backward_keeps_float32_accuracy_on_nearly_one_hot_rows():
    """Rows of logits in the hundreds (the gate's large inputs) are nearly one-hot: the top entry's
    ∂L/∂a is ε-small and g_top − Σ g·out in float32 leaves |g|·2⁻²⁴ of noise there. The rule sums
    out_k·(g_top − g_k) instead. Worst of five seeds, relative to float64: measured 1.4e-7 for the
    rule and 1.4e-5 for the textbook formula in float32."""
    worst, worst_naive = 0.0, 0.0
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        a = torch.randn(6, 300, generator=generator, dtype=F64) * 8.0
        a[:, 0] += 30.0  # the top entry leads: out_top = 1 − ε with ε under float32's resolution
        out, grad = torch.softmax(a, dim=1), torch.randn(6, 300, generator=generator, dtype=F64)
        want = _naive_softmax_backward(out, grad)  # float64
        y = torch.zeros(6, 300)  # gelu'(0) = 1/2 everywhere: the softmax part alone is compared
        got = g99.epilogue_backward(y, out.float(), grad.float(), ROWS_ONLY).dy.double() * 2.0
        naive = _naive_softmax_backward(out.float(), grad.float()).double()
        worst = max(worst, ((got - want).norm() / want.norm()).item())
        worst_naive = max(worst_naive, ((naive - want).norm() / want.norm()).item())
    assert worst < 3e-7 and worst_naive > 3e-6, (worst, worst_naive)  # the textbook formula fails it


def test_clamp_lse_mish_rule_recomputes_z_and_matches_eager_where_values_clamp():
    t, lo, hi = 8.0, -0.5, 0.5  # most logits land outside [lo, hi]: their gradient is zero
    x, w, b = _leaf(6, 5), _leaf(4, 5, seed=1), _leaf(4, seed=2)
    y = F.linear(x, w, b)
    z = torch.logsumexp(((y * (t / 2)) + (y * (t / 2))).clamp(lo, hi), dim=1, keepdim=True)
    cotangent = torch.randn(6, 1, dtype=F64)
    want = torch.autograd.grad(z * F.mish(z), (x, w, b), cotangent)
    saved = (x.detach(), w.detach(), b.detach(), y.detach(), None, None)  # z taken again from y
    got = g22.backward(saved, cotangent, (True, True, True), "fp32", (t, lo, hi))
    for g, e, name in zip(got, want, ("x", "weight", "bias")):
        assert_close(g, e, atol=1e-12, rtol=1e-10, what=name)


def test_batchnorm_bias_gradient_is_exactly_zero_in_training_mode():
    op = gbn.train_op(gbn.torch_train_forward("fp32", 1e-5), "fp32", 1e-5)
    bias = _leaf(3, seed=2)
    out = fused_call(op, _leaf(4, 5), _leaf(3, 5, seed=1), bias, _leaf(3, seed=3), None, None)
    out.backward(torch.randn_like(out))
    assert torch.equal(bias.grad, torch.zeros_like(bias))


def test_no_autograd_node_and_nothing_saved_without_a_gradient():
    calls = []

    def forward(x, save):
        calls.append(save)
        return x * 2, (x,) if save else ()

    op = FusedOp(forward, lambda saved, grad, needs: (grad * 2,), "fp32")
    x = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        assert fused_call(op, x).grad_fn is None
    assert fused_call(op, x.detach()).grad_fn is None
    assert fused_call(op, x).grad_fn is not None
    assert calls == [False, False, True]
    assert not needs_grad(None, x.detach()) and needs_grad(None, x)


def test_with_a_gradient_the_forward_runs_untracked_before_its_node_is_recorded():
    """fused_call queues the kernels first, then records the node: the forward must not build a
    graph of its own (grad mode off inside it) and the output's node must be FusedFunction's."""
    seen = []

    def forward(x, w, save):
        seen.append((torch.is_grad_enabled(), save))
        out = x * w
        return out, (x, w)

    op = FusedOp(forward, lambda saved, grad, needs: (grad * saved[1], grad * saved[0]), "fp32")
    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    out = fused_call(op, x, w)
    assert seen == [(False, True)]
    assert type(out.grad_fn).__name__ == "FusedFunctionBackward"
    out.sum().backward()
    assert torch.equal(x.grad, w.detach()) and torch.equal(w.grad, x.detach())


def test_the_backward_runs_at_the_forward_precision():
    """loss.backward() runs outside the variant's math mode: the op re-enters it."""
    seen = []
    # Not monkeypatch: allow_tf32 is served by cuBLASModule.__getattr__, so pytest's undo deletes it.
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        op = FusedOp(lambda x, save: (x * 2, ()),
                     lambda saved, grad, needs: (seen.append(torch.backends.cuda.matmul.allow_tf32) or grad * 2,), "tf32")
        fused_call(op, torch.ones(2, requires_grad=True)).sum().backward()
        assert seen == [True] and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x", "x's bfloat16 copy"])
def test_bf16_backward_gemms_round_their_operands_like_the_forward(x_dtype):
    """A float32 model's dx and dW under bf16: float32 sums of the bfloat16 operands, not rounded
    to bfloat16 after, whichever x the forward kept (the triton variants keep its bfloat16 copy)."""
    generator = torch.Generator().manual_seed(0)
    dy, x, w = (torch.randn(*s, generator=generator) for s in ((9, 7), (9, 5), (7, 5)))
    grad = GemmGrad.of(dy, grad_layouts("bf16", True, True, False))
    dx, dw = backward_gemms(grad, x.to(x_dtype), w.bfloat16(), "bf16", True, True, torch.float32)
    assert dx.dtype == dw.dtype == torch.float32
    assert_close(dx, dy.bfloat16().double() @ w.bfloat16().double(), atol=1e-5, rtol=1e-5)
    assert_close(dw, dy.bfloat16().double().t() @ x.bfloat16().double(), atol=1e-5, rtol=1e-5)
    assert not torch.equal(dw, dw.bfloat16().float()) and not torch.equal(dx, dx.bfloat16().float())


def test_a_bfloat16_models_backward_gemms_write_bfloat16_rounded_once_from_float32_sums():
    """A bfloat16 x (a bfloat16 model's): dx and dW in bfloat16, as autograd wants them, each the
    float32 product of the bfloat16 operands rounded once (no float32 result to convert after)."""
    generator = torch.Generator().manual_seed(1)
    dy, x, w = (torch.randn(*s, generator=generator) for s in ((9, 7), (9, 5), (7, 5)))
    layouts = grad_layouts("bf16", True, True, False)
    dx, dw = backward_gemms(GemmGrad.of(dy, layouts), x.bfloat16(), w.bfloat16(), "bf16", True, True, torch.bfloat16)
    assert dx.dtype == dw.dtype == torch.bfloat16
    dyb = dy.bfloat16().float()
    assert torch.equal(dx, (dyb @ w.bfloat16().float()).bfloat16())
    assert torch.equal(dw, (dyb.t() @ x.bfloat16().float()).bfloat16())


def test_the_epilogue_backward_writes_dy_transposed_for_tf32_weight_gradients_only():
    """dyᵀ only where dW is wanted under tf32 (K-major for the tensor cores); dy where dx is wanted
    or dW at another precision; bfloat16 under bf16; the bias's sums only where asked for."""
    assert grad_layouts("tf32", False, True, True) == GradLayouts(rows=False, cols=True, sums=True)
    assert grad_layouts("tf32", True, True, False) == GradLayouts(rows=True, cols=True, sums=False)
    assert grad_layouts("tf32", True, False, False) == GradLayouts(rows=True, cols=False, sums=False)
    for precision in ("fp32", "ieee"):
        assert grad_layouts(precision, False, True, True) == GradLayouts(rows=True, cols=False, sums=True)
    assert grad_layouts("bf16", False, True, False) == GradLayouts(True, False, False, torch.bfloat16)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_backward_gemms_give_the_same_gradients_from_dy_or_its_transpose(precision):
    generator = torch.Generator().manual_seed(1)
    dy, x, w = (torch.randn(*s, generator=generator) for s in ((9, 7), (9, 5), (7, 5)))
    from_rows = backward_gemms(GemmGrad(dy, None, None), x, w, precision, True, True, x.dtype)
    cols = GemmGrad(None, dy.t().contiguous(), None) if precision == "tf32" else GemmGrad(dy, None, None)
    _, dw = backward_gemms(cols, x, w, precision, False, True, x.dtype)
    assert_close(dw, from_rows[1], atol=1e-6, rtol=1e-6)
    if precision != "bf16":
        assert_close(from_rows[0].double(), dy.double() @ w.double(), atol=1e-5, rtol=1e-5)
        assert_close(dw.double(), dy.double().t() @ x.double(), atol=1e-5, rtol=1e-5)
    assert backward_gemms(GemmGrad(None, None, None), x, w, precision, False, False, x.dtype) == (None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32 model", "bfloat16 model"])
def test_a_one_row_bf16_weight_gradient_is_each_product_rounded_once(dtype):
    """At batch 1 under bf16, dW = dyᵀ·x contracts two rows, the second zero (``_bf16_weight_gradient``: cuBLAS's
    GEMM for a contraction of one is slow): each element the float64 product of the bfloat16
    operands rounded once to the model's dtype, the bits the one-row GEMM writes. Wide values
    check that nothing rounds through a narrower type; a transposed result fails on its shape."""
    generator = torch.Generator().manual_seed(3)
    dy = torch.randn(1, 7, generator=generator) * torch.logspace(-30, 30, 7)
    x = (torch.randn(1, 5, generator=generator) * torch.logspace(-8, 8, 5)).to(dtype)
    w = torch.randn(7, 5, generator=generator).bfloat16()
    grad = GemmGrad.of(dy, grad_layouts("bf16", True, True, False))
    dx, dw = backward_gemms(grad, x, w, "bf16", True, True, dtype)
    assert dw.shape == (7, 5) and dw.dtype == dtype and dx.shape == (1, 5)
    assert torch.equal(dw, (dy.bfloat16().double().t() @ x.bfloat16().double()).to(dtype))


def _reference_gradients(problem, leaves, cotangent, scalars):
    """Gradients of the reference formula at ``leaves`` (x, W, b) in their dtype, by autograd."""
    y = F.linear(*leaves)
    if problem == "matmul_gelu_softmax":
        out = torch.softmax(F.gelu(y), dim=1)
    else:
        z = torch.logsumexp((y * scalars[0]).clamp(*scalars[1:]), dim=1, keepdim=True)
        out = z * F.mish(z)
    return torch.autograd.grad(out, leaves, cotangent.to(out.dtype))


@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish"])
def test_a_bfloat16_models_backward_from_its_cublas_logits(problem):
    """cublas_epilogue on a bfloat16 model keeps cuBLAS's bfloat16 y (22: no z, taken from y in
    float32); the backward runs in float32 from them and gives bfloat16 dx and dW no farther from
    float64's than the eager bfloat16 model's (measured: 2-7e-3 against eager's 4-18e-3), at batch
    1 and odd sizes."""
    scalars = (2.0, -10.0, 10.0)
    for batch, n_in, n_out in ((1, 37, 53), (7, 40, 33)):
        generator = torch.Generator().manual_seed(batch)
        x, w, b = (torch.randn(*s, generator=generator, dtype=F64) for s in ((batch, n_in), (n_out, n_in), (n_out,)))
        xb, wb, bb = x.bfloat16(), (w / n_in ** 0.5).bfloat16(), (b * 0.1).bfloat16()
        cotangent = torch.randn(batch, n_out if problem == "matmul_gelu_softmax" else 1, generator=generator,
                                dtype=F64).bfloat16()
        want = _reference_gradients(problem, [t.double().requires_grad_(True) for t in (xb, wb, bb)], cotangent,
                                    scalars)
        eager = _reference_gradients(problem, [t.clone().requires_grad_(True) for t in (xb, wb, bb)], cotangent,
                                     scalars)
        y = F.linear(xb, wb, bb)  # bfloat16, as cuBLAS gives it
        if problem == "matmul_gelu_softmax":
            saved = (xb, wb, bb, y, None, torch.softmax(F.gelu(y), dim=1))
            got = g99.backward(saved, cotangent, (True, True, True), "bf16")
        else:
            got = g22.backward((xb, wb, bb, y, None, None), cotangent, (True, True, True), "bf16", scalars)
        for g, e, ours, name in zip(got, want, eager, ("x", "weight", "bias")):
            assert g.shape == e.shape and (name == "bias" or g.dtype == torch.bfloat16), (name, g.shape, g.dtype)
            error, eager_error = relative_error(g, e), relative_error(ours, e)
            assert error <= max(eager_error, 2**-8), (problem, batch, name, error, eager_error)


def _batchnorm_training(x, w, b, s, gamma, beta, eps):
    """gemm_bn's training forward (batch statistics) in the tensors' own dtype."""
    return F.batch_norm(F.linear(x, w, b) * s, None, None, gamma, beta, training=True, eps=eps)


def test_a_bfloat16_models_batchnorm_backward_from_its_cublas_logits():
    """gemm_bn's cublas_epilogue trains a bfloat16 model keeping cuBLAS's y = x·Wᵀ + b (bfloat16)
    as z: the bias cancels in z − μ, and the statistics come from y again in float32. Its
    gradients of x, W, s, γ and β against float64 autograd are no farther than the eager
    bfloat16 model's (plus bfloat16's step); the bias's is exactly zero."""
    eps = 1e-5
    for batch, n_in, n_out in ((2, 37, 53), (7, 40, 33)):
        generator = torch.Generator().manual_seed(batch)
        x, w = torch.randn(batch, n_in, generator=generator), torch.randn(n_out, n_in, generator=generator) / n_in**0.5
        b, s = torch.randn(n_out, generator=generator) + 4.0, torch.rand(n_out, generator=generator) + 0.5
        gamma, beta = torch.rand(n_out, generator=generator) + 0.5, torch.randn(n_out, generator=generator)
        tensors = [t.bfloat16() for t in (x, w, b, s, gamma, beta)]
        cotangent = torch.randn(batch, n_out, generator=generator).bfloat16()

        def autograd(dtype):
            leaves = [t.to(dtype).requires_grad_(True) for t in tensors]
            return torch.autograd.grad(_batchnorm_training(*leaves, eps), leaves, cotangent.to(dtype))

        want, eager = autograd(F64), autograd(torch.bfloat16)
        xb, wb, bb, sb, gb, _ = tensors
        saved = (xb, wb, F.linear(xb, wb, bb), None, None, sb, gb)
        got = gbn.train_backward(saved, cotangent, (True,) * 6, "bf16", eps, None)
        for g, e, ours, name in zip(got, want, eager, ("x", "weight", "bias", "scale", "gamma", "beta")):
            if name == "bias":
                assert torch.equal(g, torch.zeros_like(g)), g
                continue
            assert g.shape == e.shape, name
            error, eager_error = relative_error(g, e), relative_error(ours, e)
            assert error <= max(eager_error, 2**-8), (batch, name, error, eager_error)
