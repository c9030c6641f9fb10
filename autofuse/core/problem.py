"""What a problem is: a reference model, its shapes, inputs, tolerances and a float64 reference.

A problem module (``problems/<name>.py``) defines one ``Problem`` instance and
returns it from its ``autofuse_register_problems`` hook. Everything else (tests,
tuner, benchmarks, runtime) imports the problem from the registry; nothing is copied.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from autofuse.core.precision import TOLERANCE_PRECISIONS, dtype_name, tolerance_precision
from autofuse.errors import InputError

Shape = dict[str, int]

# Input distributions every check draws from: KernelBench's own torch.rand, a
# zero-mean one, one large enough that exp() overflows float32 unless the row
# maximum is subtracted first (|x| ~ 100 gives linear outputs in the hundreds), and
# "wide": rows of x and of W whose largest entries are WIDE_RATIO times the rest
# (outlier features), the other operand zero at those columns (``wide_columns``), so
# the result rests on the ordinary entries alone. A GEMM that scales rows into a
# narrower range (float16 parts) loses those unless it detects them (docs/precision.md).
# Every other row is wide (``wide_rows``), so the columns of x and W, which the backward's
# GEMMs split, are wide too; the gate's cotangent is zero where their outliers would
# otherwise carry the gradient (``Problem.quiet_wide_cotangent``).
DISTRIBUTIONS = ("rand", "randn", "large", "wide")
WIDE_RATIO = 1e12  # past float16's 2⁴⁰ span: split and single float16 parts both lose the rest
# (batch, in, out) the conformance kit checks: batch 1, sizes of 1, odd sizes that are
# multiples of no tile (37 × 1000 × 777 crosses several tiles in every dimension), and a
# moderate power-of-two one.
CONFORMANCE_SIZES = ((1, 37, 53), (2, 1, 1), (37, 1000, 777), (64, 256, 192))
# Odd sizes, a multiple of no tile, for the extra case every check runs.
ODD_SIZES = (7, 37, 53)


def wide_columns(n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The "wide" distribution's columns (fixed by the size, so the input and the weights agree):
    up to 16 where x's rows are wide and W's columns zero, and as many others where W's rows are
    wide and x's columns zero. None under 4 columns."""
    if n_in < 4:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    count = min(16, n_in // 4)
    step = n_in // count
    x_wide = torch.arange(count) * step
    return x_wide, x_wide + step // 2


def wide_rows(rows: int) -> torch.Tensor:
    """The rows the "wide" distribution widens, of x (the batch) or of W (its out features): every
    other one from the first, so a column of either holds outliers and ordinary entries, and
    batch 1 keeps its wide row."""
    return torch.arange(0, rows, 2)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass iff ‖out−ref‖/‖ref‖ ≤ rel_l2 and |out−ref| ≤ atol + rtol·|ref| everywhere."""

    rel_l2: float
    atol: float
    rtol: float

    def __post_init__(self):
        for field in ("rel_l2", "atol", "rtol"):
            value = getattr(self, field)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"`{field} >= 0` must hold and be finite, got {field}={value!r}")


@dataclasses.dataclass(frozen=True)
class Problem:
    """A small PyTorch block to tune. Subclass it to override the per-problem hooks below.

    ``model`` builds the reference ``nn.Module`` from ``init_args(shape)``; its forward is
    the ground truth. ``linear_attr`` names the model's ``nn.Linear`` (the GEMM), from which
    the output dimension of a shape is read. ``dims`` are the shape parameters by name
    (batch first, then in, then out) and ``dim_aliases`` maps extra accepted names to them.
    """

    name: str
    description: str
    model: Callable[..., nn.Module]
    dims: tuple[str, str, str]
    default_shapes: tuple[Mapping[str, int], ...]
    tolerances: Mapping[str, Tolerance]
    linear_attr: str
    aliases: tuple[str, ...] = ()
    dim_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # True where train() and eval() compute different things (BatchNorm): the mode
    # is then part of the dispatch key.
    mode_sensitive: bool = False
    min_train_batch: int = 1
    # The buffers a training-mode forward writes, by state_dict name (BatchNorm's running
    # statistics): declaring them lets a small training-mode call be replayed as a CUDA graph,
    # which writes them where they are (autofuse.serve.graphs). None: never replayed in training.
    training_updates: tuple[str, ...] | None = None
    # What no implementation can beat: "gemm" (cuBLAS's GEMM alone at the same precision) or
    # "memory" (moving memory_floor_bytes at the measured copy bandwidth), where the algebra
    # removes the GEMM.
    floor: str = "gemm"
    # The smallest value a shape parameter may take (a KernelBench file's `padding = 0` is one).
    MIN_SIZE: ClassVar[int] = 1

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"a problem name must be an identifier, got {self.name!r}")
        missing = set(TOLERANCE_PRECISIONS) - set(self.tolerances)
        if missing:
            raise ValueError(f"problem {self.name!r} needs a tolerance for every precision, missing {sorted(missing)}")
        if self.floor not in ("gemm", "memory"):
            raise ValueError(f"problem {self.name!r}: floor must be 'gemm' or 'memory', got {self.floor!r}")
        if not self.default_shapes:
            raise ValueError(f"problem {self.name!r} needs at least one default shape")
        for shape in self.default_shapes:
            self.normalize_shape(shape)

    def tolerance(self, precision: str) -> Tolerance:
        """The tolerance results at ``precision`` are held to (``ieee``: fp32's)."""
        return self.tolerances[tolerance_precision(precision)]

    # -- shapes --------------------------------------------------------------
    def normalize_shape(self, shape: Mapping[str, Any]) -> Shape:
        """Map accepted names to ``dims``, check every dim is a positive int, return in ``dims`` order."""
        named: dict[str, int] = {}
        for key, value in shape.items():
            dim = self.dim_aliases.get(key, key)
            if dim not in self.dims:
                known = ", ".join(self.dims + tuple(self.dim_aliases))
                raise InputError(f"problem {self.name!r} has no shape parameter {key!r}; known: {known}")
            try:
                number = int(value)
            except (TypeError, ValueError):
                raise InputError(f"shape parameter {key} must be an integer, got {value!r}") from None
            if number < self.MIN_SIZE or number != float(value):
                raise InputError(f"shape parameter {key} must be an integer >= {self.MIN_SIZE}, got {value!r}")
            named[dim] = number
        missing = [dim for dim in self.dims if dim not in named]
        if missing:
            raise InputError(f"problem {self.name!r} shape is missing {missing}; expected all of {list(self.dims)}")
        return {dim: named[dim] for dim in self.dims}

    def init_args(self, shape: Mapping[str, int]) -> tuple[tuple, dict]:
        """Positional and keyword arguments building the reference model for ``shape``."""
        _, n_in, n_out = (shape[d] for d in self.dims)
        return (n_in, n_out), {}

    def build_model(self, shape: Mapping[str, int]) -> nn.Module:
        args, kwargs = self.init_args(shape)
        return self.model(*args, **kwargs)

    def linear_of(self, model: nn.Module) -> nn.Linear:
        return getattr(model, self.linear_attr)

    @property
    def command_name(self) -> str:
        """How the ``autofuse`` command names this problem (a file problem: its path)."""
        return self.name

    @property
    def batch_dim(self) -> str | None:
        """The shape parameter that is the batch size (None if none is): the runtime serves an
        untuned batch size from the nearest tuned one, and checks run an odd one."""
        return self.dims[0]

    def odd_shape(self, shape: Mapping[str, int]) -> Shape | None:
        """A small shape of odd sizes that every check also runs (None: no such case)."""
        return dict(zip(self.dims, ODD_SIZES))

    def conformance_shapes(self) -> list[Shape]:
        """The shapes the conformance kit checks every variant at."""
        return [dict(zip(self.dims, sizes)) for sizes in CONFORMANCE_SIZES]

    def shape_of(self, model: nn.Module, x: torch.Tensor) -> Shape | None:
        """The shape of a call (None: no shape of this problem describes it, so it runs the reference)."""
        batch, n_in, n_out = self.dims
        return {batch: x.shape[0], n_in: x.shape[1], n_out: self.linear_of(model).out_features}

    def check_input(self, model: nn.Module, x: torch.Tensor) -> None:
        """Raise InputError naming expected and got for an input the model cannot take."""
        linear = self.linear_of(model)
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise InputError(f"{self.name}: expected a 2-D input (batch, {linear.in_features}), got shape {tuple(x.shape)}")
        if x.shape[1] != linear.in_features:
            raise InputError(f"{self.name}: expected input features {linear.in_features}, got shape {tuple(x.shape)}")
        if x.shape[0] < 1:
            raise InputError(f"{self.name}: expected batch >= 1, got shape {tuple(x.shape)}")
        weight = linear.weight
        if x.dtype != weight.dtype:
            raise InputError(
                f"{self.name}: input dtype {dtype_name(x.dtype)} does not match the parameters' "
                f"{dtype_name(weight.dtype)}; convert one with .to()"
            )
        if x.device != weight.device:
            raise InputError(f"{self.name}: input is on {x.device}, the parameters on {weight.device}")

    def mode_of(self, model: nn.Module) -> str:
        if not self.mode_sensitive:
            return "any"
        return "train" if model.training else "eval"

    # -- inputs and parameters for checks -----------------------------------
    def make_input(self, shape: Mapping[str, int], distribution: str, generator: torch.Generator,
                   device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A check's input under ``distribution``, drawn from ``generator`` alone (the gate draws
        inputs ahead on threads: ``autofuse.tuning.gate.draw_ahead``)."""
        batch, n_in, _ = (shape[d] for d in self.dims)
        size = (batch, n_in)
        if distribution == "rand":
            x = torch.rand(size, generator=generator)
        elif distribution == "randn":
            x = torch.randn(size, generator=generator)
        elif distribution == "large":
            x = 100.0 * torch.randn(size, generator=generator)
        elif distribution == "wide":
            x = torch.randn(size, generator=generator)
            x_wide, w_wide = wide_columns(n_in)
            x[wide_rows(batch)[:, None], x_wide[None, :]] *= WIDE_RATIO
            x[:, w_wide] = 0.0
        else:
            raise InputError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        return x.to(device=device, dtype=dtype)

    def check_init_args(self, shape: Mapping[str, int], distribution: str) -> tuple[tuple, dict]:
        """Init arguments of the models that checks with ``distribution`` build (default: ``init_args``)."""
        return self.init_args(shape)

    @torch.no_grad()
    def randomize_parameters(self, model: nn.Module, generator: torch.Generator, distribution: str = "randn") -> None:
        """Redraw every parameter and buffer, so a check does not rest on default init.

        Weights (2-D and up) get variance 1/fan-in (outputs on the input's scale), everything
        else a standard normal; subclasses adjust what needs a particular range, drawing from
        ``generator`` alone (the gate redraws on threads: ``autofuse.tuning.gate.draw_ahead``).
        """
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point():
                continue
            fresh = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
            if tensor.dim() >= 2:
                fresh /= math.sqrt(max(1, math.prod(tensor.shape[1:])))
            tensor.copy_(fresh.to(tensor.dtype))
        linear = getattr(model, self.linear_attr, None) if self.linear_attr else None
        if distribution == "wide" and isinstance(getattr(linear, "weight", None), torch.Tensor):
            x_wide, w_wide = wide_columns(linear.weight.shape[1])
            linear.weight[wide_rows(linear.weight.shape[0])[:, None], w_wide[None, :]] *= WIDE_RATIO
            linear.weight[:, x_wide] = 0.0

    # -- the float64 reference ----------------------------------------------
    def reference_model(self, model: nn.Module) -> nn.Module:
        """A float64 copy of ``model`` in the same state and mode."""
        return copy.deepcopy(model).to(torch.float64)

    def reference(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, nn.Module]:
        """(float64 output, the float64 model after the call: BN running stats included)."""
        ref_model = self.reference_model(model)
        with torch.no_grad():
            out = ref_model(x.detach().to(torch.float64))
        return out, ref_model

    def memory_floor_bytes(self, shape: Mapping[str, int]) -> int:
        """Bytes any implementation must move: read the input, write the output (float32)."""
        batch, n_in, n_out = (shape[d] for d in self.dims)
        return 4 * (batch * n_in + batch * n_out)

    def gradients_well_conditioned(self, shape: Mapping[str, int], mode: str) -> bool:
        """False where the exact gradient is pure rounding noise, so no float32 method can match it."""
        return True

    def gradient_check_applies(self, case, mode: str, precision: str) -> bool:
        """Whether the gate compares gradients on ``case`` (a ``verify.CheckCase``) at ``precision``:
        ``gradients_well_conditioned`` unless a problem knows a distribution that makes them
        rounding noise at a reduced precision."""
        return self.gradients_well_conditioned(case.shape, mode)

    def rows_on_a_kink(self, model: nn.Module, x: torch.Tensor, precision: str) -> torch.Tensor | None:
        """Rows of ``x`` (a bool each) whose exact gradient jumps within ``precision``'s rounding of
        the forward: an element at a clamp's bound, where any implementation accurate to
        ``precision`` may land on either side, or where the float64 reference's own gradient is
        rounding (matmul_gelu_softmax's saturated rows). The gradient check gives those rows a zero
        cotangent, so it compares what is defined; None (the default): no such row."""
        return None

    def quiet_wide_cotangent(self, cotangent: torch.Tensor) -> None:
        """Zero, in place, the gate's cotangent of a "wide" case (output-shaped) where the wide
        rows' outliers would carry the gradient: its rows at x's wide rows (``wide_rows``), so
        the weight gradient's columns at x's outliers rest on the ordinary rows, through
        epilogues that keep rows apart. A problem whose output columns are the GEMM's
        (one per out feature, kept apart) zeroes those at W's wide rows too, for dx's sake.
        At batch 1 nothing: there is no ordinary row to rest on."""
        if cotangent.shape[0] > 1:
            cotangent[wide_rows(cotangent.shape[0])] = 0.0

    def invariant_parameters(self, mode: str) -> frozenset[str]:
        """Parameters the output does not depend on (up to rounding) in ``mode``: their exact
        gradient is ~0, so its relative error is noise; gradient checks only require it finite."""
        return frozenset()

    def state_to_compare(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Buffers a forward may update (BN running stats), compared after each check."""
        return {name: buf for name, buf in model.named_buffers()}

    def shape_str(self, shape: Mapping[str, int]) -> str:
        return ",".join(f"{d}={shape[d]}" for d in self.dims)


def reference_identity(problem: Problem) -> str:
    """What identifies ``problem``'s reference forward, for the source hash of the generic
    variants that run it (``eager``, ``compiled``): a KernelBench file's digest, else the source of
    its model class, else (no source to read) its name."""
    file = getattr(problem, "file", None)
    try:
        return file.digest if file is not None else inspect.getsource(problem.model)
    except (OSError, TypeError):
        return problem.name
