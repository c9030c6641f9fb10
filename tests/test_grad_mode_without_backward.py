"""Grad-mode calls that no backward follows run the no-grad entry (autofuse.serve.grad_mode, issue 13.4).

The autograd entry is ``simplified`` and the no-grad entry ``eager`` here, so a count of each
one's forwards says which served a call. The gradients after the switch must be the autograd
entry's bit for bit, and BatchNorm's running statistics must move once per call.
"""

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


def tuned_pair(problem, mode="train", autograd_entry="simplified"):
    """A module whose grad-mode key is tuned to ``autograd_entry`` (None: not tuned, so the
    reference serves it) and no-grad key to ``eager``, in ``mode``, holding a randomized
    KernelBench model's state; and that model."""
    if autograd_entry is not None:
        record(problem, B, IN, OUT, mode=mode_of(problem, mode), autograd=True, variant=autograd_entry)
    record(problem, B, IN, OUT, mode=mode_of(problem, mode), autograd=False, variant="eager")
    reference = kernelbench_model(problem, B, IN, OUT, mode=mode)
    module = module_for(problem).train(mode == "train")
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
                                        "variant": "eager", "source": "tuned"}


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
        if p.grad is None:  # gemm_bn's GEMM bias in training mode: BatchNorm subtracts it again
            assert grads[name] is None, name
        else:
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
    assert module.dispatch_info(x)["without_backward"]["since_backward"] == 0


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
