"""What a variant is: one implementation of a problem, with the configurations it can take.

A variant module (``variants/<problem>/<kind>.py``) opens with a docstring naming its
algebra and preconditions, defines one ``Variant`` subclass per variant, and ends with
its ``autofuse_register_variants`` hook.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from autofuse.core.precision import PRECISIONS, check_precision, math_mode
from autofuse.core.source_hash import code_digest
from autofuse.errors import InputError, PluginError

# The built-in kinds, simplest first: the tuner keeps a simpler variant unless a more
# complex one beats it by more than the timing noise.
KIND_COMPLEXITY = {
    "eager": 0,
    "simplified": 1,
    "cublas_epilogue": 2,
    "cuda_naive": 3,
    "cuda_tiled": 4,
    "cuda_templated": 5,
    "triton": 6,  # a JIT toolchain beside the GEMM: kept only where it beats the simpler kinds
    # torch.compile: its first call in every process traces (dynamo) and compiles every kernel
    # of the graph (seconds with inductor's cache warm, a minute or more cold), more than a
    # hand-written Triton kernel's JIT, so at equal speed any other kind is kept over it.
    "compiled": 7,
}
DEVICES = ("cpu", "cuda")


class Variant:
    """Base class of every variant. Subclasses set the class attributes and ``forward``.

    An instance is one configuration (``params``) at one precision; it is built once per
    dispatch key and called many times, so it may cache derived weights (``FoldCache``).
    """

    name: ClassVar[str]
    problem: ClassVar[str]
    kind: ClassVar[str]
    description: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = DEVICES
    # Requested precisions under which this variant may run: an fp32-FMA kernel runs under
    # all three; a TF32 tensor-core kernel only under ("tf32", "bf16"); a bf16 one under ("bf16",).
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    supports_autograd: ClassVar[bool] = False
    complexity: ClassVar[int | None] = None  # defaults to KIND_COMPLEXITY[kind]
    # Extra files (kernel sources) whose content is part of the variant's source hash.
    sources: ClassVar[Sequence[str]] = ()
    # Whether a call may be captured as a CUDA graph and replayed (``autofuse.serve.graphs``, small
    # batches): it synchronizes nothing with the host, and reads the model only through its
    # parameters, buffers and plain attributes. The dispatcher checks a capture once against a
    # plain call; a variant that cannot promise this keeps False.
    capturable: ClassVar[bool] = False

    def __init__(self, precision: str = "fp32", **params: Any):
        self.precision = check_precision(precision)
        self.params = dict(params)

    # -- search space ---------------------------------------------------------
    @classmethod
    def configs(cls, shape: Mapping[str, int], device: str) -> list[dict[str, Any]]:
        """Every valid configuration at ``shape`` on ``device``, the default first.

        Only valid configurations are listed, so the tuner never spends a trial on an
        impossible one. A variant without parameters has the single configuration {}.
        """
        return [{}]

    @classmethod
    def configs_for(cls, shape: Mapping[str, int], device: str, precision: str) -> list[dict[str, Any]]:
        """The configurations worth searching at ``precision``, the default first: ``configs``
        unless some only make sense at some precisions (a Triton kernel's bf16 casts)."""
        return cls.configs(shape, device)

    @classmethod
    def quick_configs(cls, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The part of ``configs`` (``configs_for``'s) a ``quick`` tune searches: all of them,
        unless some cost far more to try than they have ever won (``compiled``'s modes)."""
        return configs

    @classmethod
    def small_batch_seeds(cls, shape: Mapping[str, int], device: str, precision: str,
                          like: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Configurations built for a small, memory-bound batch at ``shape`` (smaller tiles, more
        programs), most promising first, resembling ``like`` (the winner at the tuned batch) where
        they can: what a batch class below the tuned batch races beside ``like`` (none by default)."""
        return []

    @classmethod
    def params_elsewhere(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """The configuration to run where ``params`` were not gated (the dispatcher's nearest-batch
        fallback): ``params`` themselves, unless a configuration passes the gate only at some
        shapes and has a neighbour that passes everywhere (the triton kind's split_trunc)."""
        return dict(params)

    @classmethod
    def rows_per_tile(cls, params: Mapping[str, Any]) -> int | None:
        """How many rows of the batch one tile of configuration ``params`` takes (None: not known,
        or not a tiled kernel). A call with more rows than that in the memory-bound regime reads the
        weight once per row tile, so the dispatcher prefers a neighbouring batch's configuration
        that takes the call in one (``autofuse.serve.dispatch``)."""
        return None

    @classmethod
    def only_where_gated(cls, params: Mapping[str, Any]) -> str | None:
        """Why ``params`` may serve only the exact shape the gate passed it at (None: it may serve
        a neighbouring batch, as the dispatcher's nearest-batch fallback does)."""
        return None

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """Why this variant cannot run on ``device`` here (no nvcc, ...), or None."""
        if device not in cls.devices:
            return f"runs on {cls.devices}, not {device}"
        return None

    @classmethod
    def admits(cls, device: str, dtype: torch.dtype, precision: str, autograd: bool) -> str | None:
        """None if this variant may serve the key, else the reason it may not."""
        if precision not in cls.precisions:
            return f"precision {precision} not in {cls.precisions}"
        if dtype not in cls.dtypes:
            return f"dtype {dtype} not supported"
        if autograd and not cls.supports_autograd:
            return "no autograd support"
        return cls.unavailable_reason(device)

    @classmethod
    def bounded_by_gemm(cls, params: Mapping[str, Any]) -> bool:
        """Whether a call in ``params`` multiplies through cuBLAS's GEMM at the precision, so it can
        run no faster than that GEMM alone: where that alone is out of reach, a tuner need not
        build it (``autofuse.tuning.search``; torch.compile's first call takes 15-20 s)."""
        return False

    @classmethod
    def compiles_per_shape(cls, params: Mapping[str, Any]) -> bool:
        """Whether each input shape gets code of its own, generated at its first call
        (torch.compile with ``dynamic=False``). The tuner's gate then checks such a configuration
        at the shapes it is tuned for and not at the odd small one: there a check would compile
        other code (fifteen seconds and more under max-autotune, forward and backward) and say
        nothing about the code the entry runs. The conformance kit still checks every shape."""
        return False

    @classmethod
    def rank(cls) -> int:
        return cls.complexity if cls.complexity is not None else KIND_COMPLEXITY[cls.kind]

    @classmethod
    def source_hash(cls) -> str:
        return _source_hash(cls)

    # -- running --------------------------------------------------------------
    def kernel_builds(self, device: str) -> list:
        """The ``autofuse.kernels.build.KernelBuild``s ``build`` will need, so a tuner can compile
        many candidates in parallel ahead of time (none for pure-PyTorch variants)."""
        return []

    def build(self, device: str) -> None:
        """Compile or load what the variant needs on ``device`` (BuildError on failure)."""

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gemm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as this precision's GEMM operand: under bf16 a bfloat16 copy made once and
        reused while the parameter is unchanged (casting an 8192² weight took 0.138 ms on an H100,
        against 0.173 ms for the bf16 GEMM itself); otherwise ``weight`` itself."""
        if self.precision != "bf16" or weight.dtype != torch.float32:
            return weight
        cache = self.__dict__.setdefault("_gemm_weight_cache", FoldCache())
        return cache.get([weight], weight.bfloat16)

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with math_mode(self.precision):
            return self.forward(model, x)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        # The bare EagerVariant (the tuner's baseline) belongs to no problem and has no name.
        where = f"{getattr(self, 'problem', '-')}/{getattr(self, 'name', type(self).__name__)}"
        return f"<{where} {self.precision} {params}>".replace(" >", ">")


@functools.cache
def _source_hash(cls: type[Variant]) -> str:
    """The code of the variant's module and of what it imports (``autofuse.core.source_hash``),
    and its ``sources``' bytes."""
    digest = hashlib.sha256(code_digest(cls.__module__).encode())
    module_file = pathlib.Path(inspect.getfile(cls))
    for source in cls.sources:
        digest.update((module_file.parent / source).read_bytes())
    return digest.hexdigest()[:16]


def validate_variant_class(cls: Any, plugin: str) -> None:
    """Raise PluginError naming the plugin if ``cls`` is not a well-formed Variant subclass."""
    if not (isinstance(cls, type) and issubclass(cls, Variant)):
        raise PluginError(f"plugin {plugin!r} registered {cls!r}, which is not a Variant subclass")
    for attr in ("name", "problem", "kind", "description"):
        value = getattr(cls, attr, None)
        if not isinstance(value, str) or not value:
            raise PluginError(f"plugin {plugin!r}: {cls.__name__}.{attr} must be a non-empty string, got {value!r}")
    if not cls.name.replace("-", "_").isidentifier():
        raise PluginError(f"plugin {plugin!r}: variant name must be an identifier, got {cls.name!r}")
    if cls.complexity is None and cls.kind not in KIND_COMPLEXITY:
        raise PluginError(
            f"plugin {plugin!r}: variant {cls.name!r} has kind {cls.kind!r}, not one of "
            f"{sorted(KIND_COMPLEXITY)}, so it must set `complexity` (an int)"
        )
    unknown = set(cls.devices) - set(DEVICES) or set(cls.precisions) - set(PRECISIONS)
    if unknown:
        raise PluginError(f"plugin {plugin!r}: variant {cls.name!r} names unknown devices/precisions {sorted(unknown)}")


class FoldCache:
    """A value derived from parameters (folded weights), recomputed when any of them changes.

    A tensor's ``_version`` counter moves on every in-place update (optimizer steps,
    ``load_state_dict``, ``p.add_``) and its data pointer on reassignment, so the pair
    detects every change without comparing contents. The key names the data, not the Python
    object: a view or ``detach()`` of a parameter (which shares its version counter) finds
    the parameter's value. Under autograd the value is computed fresh each call so gradients
    flow to the parameters.
    """

    def __init__(self):
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._key: tuple | None = None
        self._value: Any = None

    def get(self, tensors: Sequence[torch.Tensor], compute: Callable[[], Any], extra: tuple = ()) -> Any:
        """``compute()``, reused while ``tensors`` are unchanged and ``extra`` (plain values) is equal."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return compute()
        key = extra + tuple((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device) for t in tensors)
        if key != self._key:
            with torch.no_grad():
                self._value = compute()
            # Holding the tensors keeps their memory, so no other tensor's data can take its address.
            self._tensors, self._key = tuple(tensors), key
        return self._value


def check_params(variant: type[Variant], params: Mapping[str, Any], shape: Mapping[str, int], device: str) -> None:
    """Raise InputError if ``params`` is not one of the variant's valid configurations."""
    valid = variant.configs(shape, device)
    if dict(params) not in valid:
        raise InputError(
            f"{variant.problem}/{variant.name}: {dict(params)} is not a valid configuration at {dict(shape)} "
            f"on {device}; {len(valid)} valid, e.g. {valid[:3]}"
        )


class EagerVariant(Variant):
    """The reference forward, verbatim. Under bf16 it runs under autocast, as a PyTorch user would."""

    kind = "eager"
    supports_autograd = True
    # Replayed as a graph at small batches like any variant: a reference that synchronizes, draws
    # random numbers or runs nondeterministic kernels fails the capture's check and stays plain.
    capturable = True

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # A module from get_module dispatches in its forward; the reference forward is kept aside.
        reference = getattr(type(model), "_autofuse_reference_forward", None)
        run = model if reference is None else (lambda inp: reference(model, inp))
        if self.precision == "bf16" and x.dtype == torch.float32:
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                return run(x).to(x.dtype)
        return run(x)
