"""``compiled``, for every problem: the reference forward through ``torch.compile``.

Algebra: none of its own. Dynamo traces the reference forward; inductor fuses its epilogue
(elementwise ops, reductions) into generated kernels (Triton on CUDA, C++/OpenMP on the CPU)
and under max-autotune times cuBLAS against its own GEMM templates. Whatever it rewrites is
judged by the gate like any variant: a compile that moves numerics past the tolerance loses.

Searched: ``mode`` (``default``, ``max-autotune-no-cudagraphs``; on CUDA also ``max-autotune``
and ``reduce-overhead``, which replay CUDA graphs) and ``dynamic`` (specialised to the shape, or
symbolic sizes); under the quick budget ``default`` and static only. Precision: each call runs
inside ``math_mode``, so the TF32 flags are set when inductor compiles as well as when it runs;
dynamo guards on them and inductor's cache keys on them, and each instance (one per dispatch key,
hence per precision) compiles its own.
Under bf16 with float32 input the forward runs under autocast, as ``eager`` does, with the
weights and biases of its ``nn.Linear`` and ``nn.Conv*`` modules swapped, for the call, for
bfloat16 copies kept while the parameters are unchanged (autocast casts exactly those, every
call: 0.138 ms for an 8192² weight on an H100, against 0.173 ms for the bf16 GEMM).

Preconditions: the reference forward traces (a graph break still runs, slower); under bf16
those weights and biases feed only their own modules. The first call at each input
signature compiles (said once on the ``autofuse`` logger, at INFO); ``compile_seconds``
holds the first compile's time for the tune table. So the tuner's gate checks a
``dynamic=False`` configuration at the shapes it is tuned for, not at the odd small shape, whose
compile would check other code (``Variant.compiles_per_shape``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import time
import types

import torch
from torch import nn

from autofuse.core.problem import Problem, reference_identity
from autofuse.core.variant import FoldCache, Variant
from autofuse.errors import BuildError
from autofuse.hookspecs import hookimpl

log = logging.getLogger("autofuse")

MODES = {
    "cpu": ("default", "max-autotune-no-cudagraphs"),  # the other two differ only by CUDA graphs
    "cuda": ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"),
}
# Modes whose outputs live in a CUDA-graph pool that the next replay overwrites: copied out.
CUDAGRAPH_MODES = frozenset({"max-autotune", "reduce-overhead"})
# Modules whose weight and bias autocast casts to bfloat16 at every call.
CAST_MODULES = (nn.Linear, nn.modules.conv._ConvNd)
_copies = itertools.count()


class CompiledVariant(Variant):
    """The generic variant; ``compiled_variant(problem)`` makes the class of one problem."""

    name = "compiled"
    kind = "compiled"
    description = "torch.compile of the reference forward (mode and dynamic searched)"
    supports_autograd = True
    reference_problem: Problem | None = None
    # The dispatcher builds one instance per call key, not one per configuration: an instance
    # compiles each input shape it sees into its own code object's cache, and past dynamo's
    # recompile limit (8) it runs eager, so one instance serving every batch size would.
    instance_per_key = True

    @classmethod
    def configs(cls, shape, device):
        return [{"mode": mode, "dynamic": dynamic} for mode in MODES.get(device, ()) for dynamic in (False, True)]

    @classmethod
    def quick_configs(cls, configs):
        # mode=default with sizes specialised only. The other modes compile for far longer and have
        # not won: on an H100 they took 49 s of kb2-99's 160 s bfloat16-model tune and 104 s of
        # kb2-22's search (reduce-overhead, dynamic: 82 s), each slower than default; the shipped
        # table's 37 compiled entries were all default, static. Symbolic sizes run the same kernels
        # at the tuned shape, but a training step so compiled took 73 s (kb2-22's autograd entry,
        # bfloat16 model, H100) where a static one takes 4-5, and a caller pays that at its first
        # call too. ``--budget full`` still searches them all.
        return [c for c in configs if c["mode"] == "default" and not c["dynamic"]]

    @classmethod
    def bounded_by_gemm(cls, params):
        # Inductor's default and reduce-overhead modes call cuBLAS for the GEMM (extern mm);
        # max-autotune races its own GEMM templates against it.
        return params.get("mode") in ("default", "reduce-overhead")

    @classmethod
    def compiles_per_shape(cls, params):
        return not params.get("dynamic", False)

    @classmethod
    def unavailable_reason(cls, device):
        if device == "cuda" and not _has_triton():
            return "torch.compile's inductor needs Triton on CUDA (pip install triton)"
        return super().unavailable_reason(device)

    @classmethod
    def source_hash(cls):
        return _class_hash(cls)

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self.compile_seconds: float | None = None  # the first compile's, for the tune table
        self._compiled = None
        self._bf16: dict[str, FoldCache] = {}  # module path -> its bfloat16 weight and bias

    def build(self, device):
        """Wrap (compilation waits for the first call, which has an input to specialise on)."""
        options = {"mode": self.params.get("mode", "default"), "dynamic": self.params.get("dynamic", False)}
        try:
            # A code object of this instance's own: dynamo keeps compiled graphs on the code
            # object it enters, so instances (other modes, other dispatch keys) neither share
            # graphs nor use up each other's recompile limit (8, past which it runs eager).
            self._compiled = torch.compile(_own_copy(_reference_call), **options)
        except Exception as exc:  # noqa: BLE001 - e.g. a Python version torch.compile refuses
            raise BuildError(f"torch.compile({options}) failed: {exc}") from exc

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._compiled is None:
            self.build(x.device.type)
        autocast = self.precision == "bf16" and x.dtype == torch.float32
        cudagraphs = self.params.get("mode") in CUDAGRAPH_MODES and x.is_cuda
        if cudagraphs and not torch.is_grad_enabled():
            torch.compiler.cudagraph_mark_step_begin()  # the previous call's outputs were copied out
        before, start = _graphs_compiled(), time.perf_counter()
        try:
            if autocast:
                with _swapped(self._bf16_weights(model)):
                    out = self._compiled(model, x, True)
            else:  # no context manager on the plain path: a small problem's call is tens of microseconds
                out = self._compiled(model, x, False)
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise BuildError(f"torch.compile({self.params}) failed on a {tuple(x.shape)} input: "
                             f"{type(exc).__name__}: {str(exc)[:1500]}") from exc
        if _graphs_compiled() != before:
            self._compiled_once(time.perf_counter() - start, model, x)
        return out.clone() if cudagraphs and isinstance(out, torch.Tensor) else out

    def _bf16_weights(self, model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """(module, parameter name, its bfloat16 copy) for every weight and bias autocast would cast;
        under autograd each copy is made afresh (FoldCache), so gradients reach the parameters."""
        swaps = []
        for path, module in model.named_modules():
            if not isinstance(module, CAST_MODULES):
                continue
            names = [n for n in ("weight", "bias") if isinstance(module._parameters.get(n), torch.Tensor)
                     and module._parameters[n].dtype == torch.float32]
            tensors = [module._parameters[n] for n in names]
            copies = self._bf16.setdefault(path, FoldCache()).get(tensors, lambda: [t.bfloat16() for t in tensors])
            swaps += zip([module] * len(names), names, copies)
        return swaps

    def _compiled_once(self, seconds: float, model: nn.Module, x: torch.Tensor) -> None:
        if self.compile_seconds is None:
            self.compile_seconds = seconds
        grad = " with autograd" if torch.is_grad_enabled() else ""
        log.info("autofuse: torch.compile(%s) compiled %s for a %s %s input at %s (%s%s) in %.1f s",
                 ", ".join(f"{k}={v}" for k, v in self.params.items()), self.problem, tuple(x.shape),
                 str(x.dtype).removeprefix("torch."), self.precision, "train" if model.training else "eval", grad, seconds)


def _reference_call(model: nn.Module, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    """What is compiled: the reference forward as ``EagerVariant`` runs it. A module from
    get_module dispatches in its forward; its reference forward is kept aside."""
    reference = getattr(type(model), "_autofuse_reference_forward", None)
    if autocast:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return (model(x) if reference is None else reference(model, x)).to(x.dtype)
    return model(x) if reference is None else reference(model, x)


def _own_copy(fn: types.FunctionType) -> types.FunctionType:
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


@contextlib.contextmanager
def _swapped(swaps):
    """Each (module, name, tensor) in place of the parameter for the body, then the parameter back."""
    saved = [(module, name, module._parameters[name]) for module, name, _ in swaps]
    for module, name, tensor in swaps:
        module._parameters[name] = tensor
    try:
        yield
    finally:
        for module, name, parameter in saved:
            module._parameters[name] = parameter


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process: a call that moves it compiled."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@functools.cache
def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


@functools.cache
def _class_hash(cls: type[CompiledVariant]) -> str:
    """This module's source and the reference's: a changed reference compiles to other code."""
    digest = Variant.source_hash.__func__(cls) + reference_identity(cls.reference_problem)
    return hashlib.sha256(digest.encode()).hexdigest()[:16]


_classes: dict[str, tuple[Problem, type[CompiledVariant]]] = {}


def compiled_variant(problem: Problem) -> type[CompiledVariant]:
    """The ``compiled`` variant class of ``problem`` (the same class while the problem is the same)."""
    known = _classes.get(problem.name)
    if known is None or known[0] is not problem:
        cls = type(f"Compiled_{problem.name}", (CompiledVariant,),
                   {"problem": problem.name, "reference_problem": problem, "__module__": __name__})
        _classes[problem.name] = known = (problem, cls)
    return known[1]


@hookimpl
def autofuse_register_generic_variants(problem):
    return [compiled_variant(problem)]
