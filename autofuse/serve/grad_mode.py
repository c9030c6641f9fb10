"""Grad-mode calls that no backward follows: inference without ``no_grad`` at the no-grad speed.

A call in grad mode, with parameters that require grad, looks the same whether a backward will
come (training) or not (an evaluation loop that forgot ``no_grad``, KernelBench's harness). The
autograd entry's forward saves what its backward needs, which only a backward repays: 22's kernel
stores its logits (a forward of 0.7245 against 0.7013 ms at fp32 on an H100), gemm_bn eval's its
pre-BatchNorm values (1.1182 against 0.9657 at tf32), and 51's autograd entry is a slower kernel
than its no-grad one (benchmarks/gpu/grad_without_backward.py measures each key both ways).

So the dispatcher binds each grad-mode key to a ``GradModeCall``. While backwards come, it runs
the autograd entry. Once ``SWITCH_AFTER`` calls in a row have had no backward through their
output, it runs the no-grad entry and records a node that saves only the input and the
parameters. Such a node's backward, if one does come, runs the autograd entry's forward again and
differentiates that (activation checkpointing's recipe). So the gradients are the autograd
entry's, bit for bit; the price is one more forward, paid once. The backward also switches the
key back. That second forward runs in the first one's train/eval mode, and the model's buffers
are put back after it, so a training-mode BatchNorm updates its running statistics once per call,
as the reference does.

The second forward differentiates the call that was made, as eager's graph would: the node holds
the submodules, parameters and buffers the first forward read, and puts them back into the model
for the recompute (a parameter replaced in between, ``model.gemm.weight = nn.Parameter(...)``,
gets its gradient; its replacement gets none). The variants' cached weight copies (``FoldCache``)
key on a tensor's data pointer and version, so they serve the forward's tensors, never the
replacement's. An in-place change of a parameter in between raises, as eager's does.

Under a functorch transform (``torch.func.grad``, ``vmap``, ``jacrev``...) a call runs the
reference forward, which the transform differentiates or batches like any PyTorch code. Neither
the node nor a fused entry could take part: an autograd Function needs ``setup_context`` and a
vmap rule there, and the fused kernels and the cached weight copies read data pointers, which
functorch's wrapped tensors do not have.

Where a key has no autograd entry (only the no-grad key was tuned), the first calls run the
reference and the rest the no-grad entry.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING

import torch

from autofuse.core.variant import EagerVariant

if TYPE_CHECKING:
    from autofuse.serve.dispatch import CallKey

SWITCH_AFTER = 3  # grad-mode calls in a row without a backward before the no-grad entry serves
_functorch_transforms_active = torch._C._are_functorch_transforms_active


class GradModeCall:
    """The callable bound to one grad-mode call key (``runtime.Dispatcher``): ``saving`` (the
    autograd entry's variant) while backwards come, the no-grad key's once they stop."""

    def __init__(self, dispatcher, saving, key: CallKey):
        # Weakly: the dispatcher holds this call in its ready dict, and a cycle would keep a
        # deleted module's variants (and their cached weight copies on the GPU) until a collection.
        self._dispatcher, self.saving = weakref.ref(dispatcher), saving
        self.no_grad_key = key._replace(autograd=False)
        self.since_backward = 0  # calls since the last backward through an output of this key
        self.reference = None  # what serves under a functorch transform, made at the first such call

    @property
    def dispatcher(self):
        return self._dispatcher()

    def __call__(self, model, x):
        if _functorch_transforms_active():  # 92 ns a call on a CPU; module docstring: why
            return self._under_functorch(model, x)
        if self.since_backward < SWITCH_AFTER:
            self.since_backward += 1
            out = self.saving(model, x)
            if out.requires_grad:
                out.register_hook(self._backward_came)
            return out
        return self._without_saving(model, x)

    def _under_functorch(self, model, x):
        if self.reference is None:
            self.reference = EagerVariant(self.dispatcher.precision)
        return self.reference(model, x)

    def _backward_came(self, grad):
        self.since_backward = 0  # returns None: the gradient passes unchanged

    def no_grad_call(self, model, x):
        return self.dispatcher.call_for(model, x, self.no_grad_key)

    def _without_saving(self, model, x):
        # The host's time counts here: KernelBench's harness synchronizes around each call, and at
        # tf32 and bf16 a call's kernels take less time than its Python. So grad mode is switched
        # off directly (torch.no_grad()'s object cost 1.3 µs more on a CPU), the kernels are queued
        # before the node is recorded (as autograd.fused_call does), and the node is applied without
        # Function.apply's functorch unwrapping (no functorch transform is active here: __call__).
        # What the model holds is read after the call, which replaces none of it (a training-mode
        # call updates buffers in place), so the GEMM is launched that much sooner.
        dispatcher = self._dispatcher()
        call = dispatcher.call_for(model, x, self.no_grad_key)
        torch._C._set_grad_enabled(False)
        try:
            out = call(model, x)
        finally:
            torch._C._set_grad_enabled(True)
        slots, parameters = dispatcher.state_slots(model)
        held = [d.get(name) for d, name in slots]
        return _apply_recompute(self, model, (out,), (slots, held, parameters), x, *held[parameters])


class Recompute(torch.autograd.Function):
    """The node of a forward that saved nothing: its backward runs ``call.saving`` again, on the
    input, submodules, parameters and buffers the forward read. ``held`` is (slots, values,
    parameters): the model's ``(dict, name)`` slots, what each held at the forward, and which of
    them hold parameters (``Dispatcher.state_slots``); ``params`` are those slots' values (None
    where a slot held None)."""

    @staticmethod
    def forward(ctx, call: GradModeCall, model, result: tuple, held: tuple, x, *params):
        ctx.call, ctx.model, ctx.training, ctx.held = call, model, model.training, held
        # Every parameter, not only those needing a gradient: an in-place change raises, as eager's.
        # The buffers are held, not saved: a training-mode call updates them in place, and that
        # must not fail an earlier call's backward (eager's BatchNorm does not bump their versions).
        ctx.save_for_backward(x, *params)
        return result[0]

    @staticmethod
    def backward(ctx, grad):
        call, model = ctx.call, ctx.model
        call.since_backward = 0
        x, *params = ctx.saved_tensors
        slots, values, parameters = ctx.held
        values = list(values)
        values[parameters] = params  # the saved tensors: the ones differentiated are the ones read
        needs = _first_of_each(params, ctx.needs_input_grad[4:])
        create_graph = torch.is_grad_enabled()  # on here only under backward(create_graph=True)
        # The forward's submodules first, so the train/eval mode and the buffers kept are theirs.
        with (torch.enable_grad(), _put_back(slots, values), _as_in_the_forward(model, ctx.training),
              _buffers_kept(model)):
            x_again = x.detach().requires_grad_(needs[0])
            out = call.saving(model, x_again)
            wanted = [t for t, need in zip((x_again, *params), needs) if need]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True, create_graph=create_graph))
        return (None, None, None, None, *(next(grads) if need else None for need in needs))


# torch._C._FunctionBase.apply, which Function.apply calls after its functorch unwrapping.
_apply_recompute = super(torch.autograd.Function, Recompute).apply


_ABSENT = object()


def _first_of_each(params: list, needs: tuple) -> list[bool]:
    """``needs`` with a tensor's later occurrences in ``params`` off: a parameter held by two
    modules (tied weights) is one input twice, and its whole gradient goes to the first."""
    needs, seen = list(needs), set()
    for i, p in enumerate(params, 1):
        if needs[i]:
            needs[i] = id(p) not in seen
            seen.add(id(p))
    return needs


@contextlib.contextmanager
def _put_back(slots: tuple, values: list):
    """Each slot's value at the forward in it for the block, what is there now after: the
    recompute reads the submodules, parameters and buffers the forward read."""
    now = [d.get(name, _ABSENT) for d, name in slots]
    for (d, name), value in zip(slots, values):
        d[name] = value
    try:
        yield
    finally:
        for (d, name), value in zip(slots, now):
            if value is _ABSENT:
                d.pop(name, None)
            else:
                d[name] = value


@contextlib.contextmanager
def _as_in_the_forward(model, training: bool):
    """The model in the forward's train/eval mode for the block: the backward differentiates the
    call that was made, even after a ``model.eval()`` in between (eager's graph would)."""
    if model.training == training:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


@contextlib.contextmanager
def _buffers_kept(model):
    """The model's buffers as they were, after the block: a training-mode forward run again for a
    backward must not update BatchNorm's running statistics a second time."""
    kept = [(b, b.clone()) for b in model.buffers()] if model.training else []
    try:
        yield
    finally:
        # Through .data, so the version counters do not move: BatchNorm's nodes save the running
        # statistics (version-checked, though training mode's gradient does not read them), and
        # BatchNorm's own update leaves the counter alone. A bumped counter failed every earlier
        # call's backward with "modified by an inplace operation".
        for buffer, value in kept:
            buffer.data.copy_(value)
