"""Grad-mode calls that no backward follows run the no-grad entry (autofuse.serve.grad_mode, issue 13.4).

The autograd entry is ``simplified`` and the no-grad entry ``eager`` here, so a count of each
one's forwards says which served a call. The gradients after the switch must be the autograd
entry's bit for bit, and BatchNorm's running statistics must move once per call. They must be
PyTorch's (within the problem's fp32 tolerance) where the model changed between the forward and
its backward, a parameter, submodule or buffer replaced (issue 32.2), and under
``torch.func.functional_call``, ``torch.func.grad`` and ``vmap``.
"""

import copy
import gc
import weakref

import pytest
import torch
from helpers import PROBLEMS, SMALL, assert_close, kernelbench_model, module_for, record, twin

from autofuse.core import registry
from autofuse.serve.dispatch import CallKey
from autofuse.serve.grad_mode import SWITCH_AFTER, GradModeCall

B, IN, OUT = SMALL


def mode_of(problem, mode):
    return mode if problem == "gemm_bn" else "any"


@pytest.fixture
def counted(monkeypatch):
    """{problem: {"simplified": n, "eager": n}}: forwards of each variant class, counted."""
    counts = {}

    def counting(problem, name):
        cls = registry.get_variant(problem, name)
        forward = cls.forward

        def forward_counted(self, model, x):
            counts[problem][name] += 1
            return forward(self, model, x)
        monkeypatch.setattr(cls, "forward", forward_counted)

    for problem in PROBLEMS:
        counts[problem] = {"simplified": 0, "eager": 0}
        counting(problem, "simplified")
        counting(problem, "eager")
    return counts


def tuned_pair(problem, mode="train", autograd_entry="simplified", device="cpu"):
    """A module whose grad-mode key is tuned to ``autograd_entry`` (None: not tuned, so the
    reference serves it) and no-grad key to ``eager``, in ``mode``, holding a randomized
    KernelBench model's state; and that model; both on ``device``."""
    if autograd_entry is not None:
        record(problem, B, IN, OUT, mode=mode_of(problem, mode), autograd=True, variant=autograd_entry, device=device)
    record(problem, B, IN, OUT, mode=mode_of(problem, mode), autograd=False, variant="eager", device=device)
    reference = kernelbench_model(problem, B, IN, OUT, mode=mode).to(device)
    module = module_for(problem).train(mode == "train").to(device)
    module.load_state_dict(reference.state_dict())
    return reference, module


@pytest.mark.parametrize("problem", PROBLEMS)
def test_calls_without_a_backward_switch_to_the_no_grad_entry(problem, counted):
    reference, module = tuned_pair(problem, "eval")
    x = torch.randn(B, IN)
    for call in range(SWITCH_AFTER + 3):
        out = module(x)
        assert out.requires_grad and out.grad_fn is not None
        assert_close(out, reference(x), registry.get_problem(problem).tolerances["fp32"])
        saving = min(call + 1, SWITCH_AFTER)
        assert counted[problem] == {"simplified": saving, "eager": call + 1 - saving}, (call, counted[problem])
    info = module.dispatch_info(x)
    assert info["variant"] == "simplified"
    assert info["without_backward"] == {"since_backward": SWITCH_AFTER, "switch_after": SWITCH_AFTER,
                                        "switched": True, "variant": "eager", "source": "tuned"}


@pytest.mark.parametrize("autograd_entry", ["simplified", None])
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("problem, mode", [(p, "train") for p in PROBLEMS] + [("gemm_bn", "eval")])
def test_a_backward_after_the_switch_gives_the_autograd_entrys_gradients_bit_for_bit(problem, mode, x_grad,
                                                                                       autograd_entry):
    _, module = tuned_pair(problem, mode, autograd_entry)
    fresh = twin(module)  # its first call saves: the autograd entry's own backward
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER):
        module(x)
    x_lazy, x_saved = x.clone().requires_grad_(x_grad), x.clone().requires_grad_(x_grad)
    out = module(x_lazy)
    assert type(out.grad_fn).__name__ == "RecomputeBackward"
    g = torch.randn_like(out)
    out.backward(g)
    fresh(x_saved).backward(g)
    grads = {n: p.grad for n, p in module.named_parameters()}
    for name, p in fresh.named_parameters():
        assert_close(grads[name], p.grad, atol=0, rtol=0, what=f"{name}'s gradient")
    if x_grad:
        assert_close(x_lazy.grad, x_saved.grad, atol=0, rtol=0, what="x's gradient")


@pytest.mark.parametrize("problem", PROBLEMS)
def test_training_never_leaves_the_autograd_entry_and_a_backward_switches_back(problem, counted):
    _, module = tuned_pair(problem, "train")
    x = torch.randn(B, IN)
    for _ in range(2 * SWITCH_AFTER):  # a training loop: a backward after every forward
        module(x).sum().backward()
    assert counted[problem] == {"simplified": 2 * SWITCH_AFTER, "eager": 0}
    for _ in range(SWITCH_AFTER + 1):  # an evaluation without no_grad: the last call runs eager
        out = module(x)
    assert counted[problem] == {"simplified": 3 * SWITCH_AFTER, "eager": 1}
    out.sum().backward()  # its backward runs simplified again, and switches back
    assert counted[problem] == {"simplified": 3 * SWITCH_AFTER + 1, "eager": 1}
    module(x).sum().backward()
    assert counted[problem] == {"simplified": 3 * SWITCH_AFTER + 2, "eager": 1}
    free = module.dispatch_info(x)["without_backward"]
    assert (free["since_backward"], free["switched"]) == (0, False)


@pytest.mark.parametrize("autograd_entry", ["simplified", None])
def test_running_statistics_move_once_per_call_whatever_serves_it(autograd_entry):
    # None: the reference serves grad mode, and its BatchNorm node saves the running statistics
    reference, module = tuned_pair("gemm_bn", "train", autograd_entry)
    calls = [torch.randn(B, IN) * (i + 1) + i for i in range(SWITCH_AFTER + 2)]
    outs = [module(x) for x in calls]  # the last two run eager, and record a node that recomputes
    for x in calls:
        reference(x)
    torch.stack([o.sum() for o in outs]).sum().backward()  # recomputes the two, restoring the statistics
    for name, buf in reference.named_buffers():
        assert_close(module.get_buffer(name), buf, atol=1e-6, rtol=1e-5, what=name)


@pytest.mark.parametrize("autograd_entry", ["simplified", None])  # None: the reference, which reads model.training
def test_a_backward_after_eval_differentiates_the_training_mode_call_that_was_made(autograd_entry):
    _, module = tuned_pair("gemm_bn", "train", autograd_entry)
    fresh = twin(module)
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER):
        module(x)
    out, want = module(x), fresh(x)  # the switched call, and the autograd entry's, in training mode
    module.eval()  # BatchNorm now normalizes by its running statistics: not the call that was made
    module.gemm.train(True)  # and a mixed state, which the backward must leave as it was
    fresh.eval()
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    for (name, p), q in zip(module.named_parameters(), fresh.parameters()):
        if q.grad is not None:
            assert_close(p.grad, q.grad, atol=0, rtol=0, what=f"{name}'s gradient")
    assert [m.training for m in module.modules()] == [False, True, False]


def test_a_parameter_changed_in_place_before_the_backward_raises_as_in_eager():
    _, module = tuned_pair("matmul_gelu_softmax", "train")
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER):
        module(x)
    out = module(x)
    with torch.no_grad():
        module.linear.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_grad_mode_key_without_an_autograd_entry_gets_the_no_grad_one_after_the_switch(counted):
    record("matmul_clamp_lse_mish", B, IN, OUT, autograd=False, variant="simplified")
    module, x = module_for("matmul_clamp_lse_mish"), torch.randn(B, IN)
    for _ in range(SWITCH_AFTER + 2):
        module(x)
    info = module.dispatch_info(x)
    assert (info["source"], info["without_backward"]["variant"]) == ("no entry: reference", "simplified")
    assert counted["matmul_clamp_lse_mish"]["simplified"] == 2


def test_the_no_grad_key_is_the_call_key_with_autograd_off():
    _, module = tuned_pair("gemm_bn")
    x = torch.randn(B, IN)
    module(x)
    key = module._autofuse.call_key(module, x)
    call = module._autofuse.ready[key]
    assert isinstance(call, GradModeCall) and key.autograd
    assert type(call.no_grad_key) is CallKey and call.no_grad_key == key._replace(autograd=False)


def test_a_deleted_module_frees_its_dispatcher_without_a_garbage_collection():
    # The dispatcher's variants may hold cached weight copies on the GPU (a bfloat16 W, W's float16
    # parts): they must go with the module, not at the next cyclic collection.
    _, module = tuned_pair("matmul_gelu_softmax", "train")
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER + 1):
        module(x)  # both keys resolved: the grad-mode call and the no-grad one
    dispatcher = weakref.ref(module._autofuse)
    gc.disable()
    try:
        del module
        assert dispatcher() is None
    finally:
        gc.enable()


def _replace(model, name, value):
    """``model.<name> = nn.Parameter(value)``, as a user replaces a parameter."""
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(value))


SWITCHED = [(p, "train") for p in PROBLEMS] + [("gemm_bn", "eval")]


def assert_replaced_parameters_get_pytorchs_gradients(problem, mode, entry="simplified", device="cpu"):
    """Each parameter in turn replaced between the switched call and its backward: the replaced
    one gets its gradient, its replacement none, and every gradient is PyTorch's within the
    problem's fp32 tolerance (on the GPU, parameters the output does not depend on: finite only,
    as the gate checks them)."""
    prob = registry.get_problem(problem)
    tol, invariant = prob.tolerances["fp32"], prob.invariant_parameters(mode) if device != "cpu" else ()
    names = [n for n, _ in kernelbench_model(problem, B, IN, OUT).named_parameters()]
    for name in names:
        reference, module = tuned_pair(problem, mode, entry, device)
        x = torch.randn(B, IN, device=device)
        for _ in range(SWITCH_AFTER):
            module(x), reference(x)
        x_got, x_want = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out, want = module(x_got), reference(x_want)
        assert type(out.grad_fn).__name__ == "RecomputeBackward"
        used = {n: p for n, p in module.named_parameters()}, {n: p for n, p in reference.named_parameters()}
        value = torch.randn_like(used[1][name])
        _replace(module, name, value.clone())
        _replace(reference, name, value.clone())
        g = torch.randn_like(out)
        out.backward(g)
        want.backward(g)
        assert module.get_parameter(name).grad is None, f"{name}'s replacement was not in the forward"
        assert_close(x_got.grad, x_want.grad, atol=tol.atol, rtol=tol.rtol, what=f"x's gradient ({name} replaced)")
        for n, p in used[1].items():
            got = used[0][n].grad
            assert got is not None, f"{n} has no gradient ({name} replaced); PyTorch's is {p.grad}"
            assert torch.isfinite(got).all(), f"{n}'s gradient is not finite ({name} replaced)"
            if n not in invariant:
                assert_close(got, p.grad, atol=tol.atol, rtol=tol.rtol, what=f"{n}'s gradient ({name} replaced)")


@pytest.mark.parametrize("problem, mode", SWITCHED)
def test_a_parameter_replaced_before_the_backward_gets_pytorchs_gradients(problem, mode):
    """The recompute differentiates the tensors the forward used, not the model's current ones."""
    assert_replaced_parameters_get_pytorchs_gradients(problem, mode)


# The fused autograd entries on the GPU (their FusedFunction nodes, their cached weight copies).
GPU_ENTRIES = [(p, m, v) for p, m in SWITCHED for v, cls in sorted(registry.variants(p).items())
               if cls.supports_autograd and "cuda" in cls.devices
               and cls.kind not in ("eager", "simplified", "compiled")]


@pytest.mark.gpu
@pytest.mark.parametrize("problem, mode, entry", GPU_ENTRIES, ids=[f"{p}-{m}-{v}" for p, m, v in GPU_ENTRIES])
def test_on_the_gpu_a_parameter_replaced_before_the_backward_gets_pytorchs_gradients(problem, mode, entry):
    reason = registry.get_variant(problem, entry).admits("cuda", torch.float32, "fp32", autograd=True)
    if reason is not None:
        pytest.skip(f"{problem}/{entry} cannot run here: {reason}")
    assert_replaced_parameters_get_pytorchs_gradients(problem, mode, entry, "cuda")


def assert_torch_func_gives_pytorchs_results(problem, mode, entry="simplified", device="cpu"):
    """torch.func.grad over functional_call, and vmap, give PyTorch's results before the switch and after."""
    tol = registry.get_problem(problem).tolerances["fp32"]
    reference, module = tuned_pair(problem, mode, entry, device)
    x, xs = torch.randn(B, IN, device=device), torch.randn(3, B, IN, device=device)
    params = {n: p.detach() for n, p in module.named_parameters()}

    def loss(model):
        return lambda ps: torch.func.functional_call(model, ps, (x,)).square().sum()
    want = torch.func.grad(loss(reference))(params)
    for calls in (0, SWITCH_AFTER):
        for _ in range(calls):
            module(x)
        got = torch.func.grad(loss(module))(params)
        for name in params:
            assert_close(got[name], want[name], atol=tol.atol, rtol=tol.rtol,
                         what=f"torch.func.grad's {name} after {calls} calls")
        assert_close(torch.func.vmap(module)(xs), torch.stack([reference(row) for row in xs]), tol,
                     what=f"vmap's output after {calls} calls")


# gemm_bn in training mode updates its running statistics in place: neither transform takes it,
# in PyTorch either.
FUNCTORCH = [(p, "train") for p in PROBLEMS[1:]] + [("gemm_bn", "eval")]


@pytest.mark.parametrize("problem, mode", FUNCTORCH)
def test_torch_func_grad_and_vmap_after_the_switch_give_pytorchs_results(problem, mode):
    assert_torch_func_gives_pytorchs_results(problem, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("problem, mode, entry", [e for e in GPU_ENTRIES if e[:2] in FUNCTORCH],
                         ids=[f"{p}-{m}-{v}" for p, m, v in GPU_ENTRIES if (p, m) in FUNCTORCH])
def test_on_the_gpu_torch_func_grad_and_vmap_give_pytorchs_results(problem, mode, entry):
    """The fused entries read data pointers that functorch's tensors lack: the reference serves."""
    reason = registry.get_variant(problem, entry).admits("cuda", torch.float32, "fp32", autograd=True)
    if reason is not None:
        pytest.skip(f"{problem}/{entry} cannot run here: {reason}")
    assert_torch_func_gives_pytorchs_results(problem, mode, entry, "cuda")


def _replace_state(model, name):
    """``model.<name>`` replaced: a submodule by a frozen copy, a buffer by other statistics."""
    owner, _, leaf = name.rpartition(".")
    old = getattr(model.get_submodule(owner), leaf)
    new = torch.full_like(old, 100.0) if isinstance(old, torch.Tensor) else copy.deepcopy(old).requires_grad_(False)
    setattr(model.get_submodule(owner), leaf, new)


@pytest.mark.parametrize("mode, replaced",
                         [("train", "bn"), ("eval", "bn"), ("eval", "gemm"), ("eval", "bn.running_var")])
def test_a_submodule_or_buffer_replaced_before_the_backward_leaves_pytorchs_gradients(mode, replaced):
    tol = registry.get_problem("gemm_bn").tolerances["fp32"]
    reference, module = tuned_pair("gemm_bn", mode)
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER):
        module(x), reference(x)
    out, want = module(x), reference(x)
    used = list(module.parameters()), list(reference.parameters())
    _replace_state(module, replaced)
    _replace_state(reference, replaced)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    for (name, _), p, q in zip(module.named_parameters(), *used):
        assert_close(p.grad, q.grad, atol=tol.atol, rtol=tol.rtol, what=f"{name}'s gradient ({replaced} replaced)")


def test_frozen_parameters_replaced_before_the_backward_leave_pytorchs_input_gradient():
    """The simplified eval fold is cached for frozen parameters: the recompute must use the copy of
    the weight the forward used, not one of its replacement."""
    tol = registry.get_problem("gemm_bn").tolerances["fp32"]
    reference, module = tuned_pair("gemm_bn", "eval")
    for model in (module, reference):
        model.requires_grad_(False)
    x = torch.randn(B, IN, requires_grad=True)
    for _ in range(SWITCH_AFTER):
        module(x)
    x_got, x_want = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    out, want = module(x_got), reference(x_want)
    assert type(out.grad_fn).__name__ == "RecomputeBackward"
    weight = torch.randn(OUT, IN)
    for model in (module, reference):
        model.gemm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    assert_close(x_got.grad, x_want.grad, atol=tol.atol, rtol=tol.rtol, what="x's gradient")


@pytest.mark.parametrize("problem, mode", [("matmul_gelu_softmax", "train"), ("gemm_bn", "eval")])
def test_functional_call_after_the_switch_differentiates_the_tensors_it_was_given(problem, mode):
    # functional_call puts its tensors into the modules' dicts directly, past the registration hooks.
    tol = registry.get_problem(problem).tolerances["fp32"]
    reference, module = tuned_pair(problem, mode)
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER):
        module(x)
    given = [{n: torch.randn_like(p).requires_grad_(True) for n, p in module.named_parameters()} for _ in range(2)]
    with torch.no_grad():
        for name, p in given[1].items():
            p.copy_(given[0][name])
    out = torch.func.functional_call(module, given[0], (x,))
    assert type(out.grad_fn).__name__ == "RecomputeBackward"
    g = torch.randn_like(out)
    out.backward(g)
    torch.func.functional_call(reference, given[1], (x,)).backward(g)
    for name, p in given[0].items():
        assert_close(p.grad, given[1][name].grad, atol=tol.atol, rtol=tol.rtol, what=f"{name}'s gradient")


def test_a_parameter_two_modules_hold_gets_its_gradient_once():
    tol = registry.get_problem("gemm_bn").tolerances["fp32"]
    reference, module = tuned_pair("gemm_bn", "train")
    for model in (module, reference):
        model.bn.weight = model.scale  # tied: one tensor in two slots
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER):
        module(x)
    out = module(x)
    assert type(out.grad_fn).__name__ == "RecomputeBackward"
    g = torch.randn_like(out)
    out.backward(g)
    reference(x).backward(g)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, atol=tol.atol, rtol=tol.rtol, what=f"{name}'s gradient")


def test_a_submodule_replaced_after_eval_is_differentiated_in_the_forwards_training_mode():
    tol = registry.get_problem("gemm_bn").tolerances["fp32"]
    reference, module = tuned_pair("gemm_bn", "train")
    x = torch.randn(B, IN)
    for _ in range(SWITCH_AFTER):
        module(x), reference(x)
    out, want = module(x), reference(x)
    used, bn = (list(module.parameters()), list(reference.parameters())), module.bn
    for model in (module, reference):
        model.eval()  # the forward's BatchNorm too, before it leaves the model
        _replace_state(model, "bn")
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    for (name, _), p, q in zip(module.named_parameters(), *used):
        assert_close(p.grad, q.grad, atol=tol.atol, rtol=tol.rtol, what=f"{name}'s gradient")
    assert not bn.training, "the forward's BatchNorm is left in the mode it was in"
