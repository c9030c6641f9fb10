"""KernelBench files as problems: ``autofuse tune path/to/file.py`` and everything after it.

A file in KernelBench's format (``Model``, ``get_inputs``, ``get_init_inputs``, module-level
int sizes; see ``kbfile``) becomes a problem named ``kb_<file stem>`` (characters that
cannot be in an identifier become ``_``), so a plugin registers variants for it by that
name. Its shape parameters are the file's sizes, its default shape their values, its
inputs ``get_inputs()`` at the requested sizes, and its ``eager`` variant the file's own
forward. Files whose ``get_inputs()`` returns more than one tensor are refused.

Naming a file by its path wherever a problem name goes loads it and adds the path to
``AUTOFUSE_KERNELBENCH`` (os.pathsep-separated), which worker subprocesses inherit and
the registry reads, so they find the problem too. ``register_source`` adds one from
source text: an exported ModelNew file carries its reference that way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import math
import os
import pathlib
import re
import threading
from typing import ClassVar

import torch
from torch import nn

from autofuse.core.precision import dtype_name
from autofuse.core.problem import DISTRIBUTIONS, Problem, Tolerance
from autofuse.errors import InputError, PluginError, UnknownNameError
from autofuse.kernelbench.file import KernelBenchFile

ENV = "AUTOFUSE_KERNELBENCH"
# Those of the built-in problems: a generic file computes with the same float32 rounding,
# and an ill-conditioned one is judged against plain PyTorch's own error (4x that floor).
TOLERANCES = {
    "fp32": Tolerance(rel_l2=1e-5, atol=1e-4, rtol=1e-4),
    "tf32": Tolerance(rel_l2=2e-3, atol=2e-2, rtol=1e-2),
    "bf16": Tolerance(rel_l2=1.5e-2, atol=1e-1, rtol=5e-2),
}
ODD_BATCH = 7


@dataclasses.dataclass(frozen=True)
class KernelBenchProblem(Problem):
    """A problem read from a KernelBench file; ``file`` runs it at any setting of its sizes."""

    file: KernelBenchFile | None = None
    MIN_SIZE: ClassVar[int] = 0

    def normalize_shape(self, shape):
        """Sizes not given keep the file's values, so ``--shape batch_size=16`` is a whole shape."""
        return super().normalize_shape({**self.file.sizes, **dict(shape)})

    def init_args(self, shape):
        return tuple(self.file.init_inputs(self.normalize_shape(shape))), {}

    @property
    def command_name(self):
        return self.file.origin

    @property
    def batch_dim(self):
        return next((name for name, where in self.file.positions.items() if where == ("input", 0)), None)

    def odd_shape(self, shape):
        batch = self.batch_dim
        if batch is None:
            return None
        return {**shape, batch: ODD_BATCH if shape[batch] != ODD_BATCH else ODD_BATCH - 2}

    def conformance_shapes(self):
        default = dict(self.default_shapes[0])
        if self.batch_dim is None:
            return [default]
        return [{**default, self.batch_dim: b} for b in (1, 2, ODD_BATCH)] + [default]

    def shape_of(self, model, x):
        """The sizes at which the file builds this model and this input: read from the init args a
        module of get_module (or an exported ModelNew) was built from, and the input's shape."""
        init_args = getattr(getattr(model, "_autofuse", None), "init_args", None)
        if init_args is None or not isinstance(x, torch.Tensor):
            return None
        args, kwargs = init_args
        try:
            bound = inspect.signature(self.file.Model).bind(*args, **kwargs)
        except TypeError:
            return None
        return self.file.sizes_of(list(bound.args), tuple(x.shape))

    def check_input(self, model, x):
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        axes = self.file.axis_names()
        if x.dim() != len(axes):
            raise InputError(f"{self.name}: expected a {len(axes)}-D input ({', '.join(axes)}), got shape {tuple(x.shape)}")
        weight = next((t for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()), None)
        if weight is None:
            return
        if x.is_floating_point() and x.dtype != weight.dtype:
            raise InputError(f"{self.name}: input dtype {dtype_name(x.dtype)} does not match the parameters' "
                             f"{dtype_name(weight.dtype)}; convert one with .to()")
        if x.device != weight.device:
            raise InputError(f"{self.name}: input is on {x.device}, the parameters on {weight.device}")

    def make_input(self, shape, distribution, generator, device="cpu", dtype=torch.float32):
        """``get_inputs()`` at ``shape`` (seeded from ``generator``): KernelBench's own draw for
        "rand"; for "randn" and "large" a floating input is redrawn with the same shape."""
        if distribution not in DISTRIBUTIONS:
            raise InputError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        x = self.file.inputs(self.normalize_shape(shape), int(torch.randint(0, 2**62, (1,), generator=generator)))
        if not x.is_floating_point():
            return x.to(device=device)
        if distribution != "rand":
            x = torch.randn(x.shape, generator=generator) * (100.0 if distribution == "large" else 1.0)
        return x.to(device=device, dtype=dtype)

    @torch.no_grad()
    def randomize_parameters(self, model, generator, distribution="randn"):
        super().randomize_parameters(model, generator, distribution)
        for module in model.modules():  # running variances must stay positive, as real statistics are
            var = getattr(module, "running_var", None)
            if isinstance(var, torch.Tensor) and var.is_floating_point():
                var.copy_((0.5 + torch.rand(var.shape, generator=generator)).to(var.dtype))

    def memory_floor_bytes(self, shape):
        """Read the input and write the output once (float32), sizes taken on the meta device."""
        shape = self.normalize_shape(shape)
        n_in = math.prod(self.file.signature(shape)[1])
        try:
            with torch.device("meta"):
                args, kwargs = self.init_args(shape)
                out = self.model(*args, **kwargs)(torch.empty(self.file.signature(shape)[1]))
            n_out = out.numel()
        except Exception:  # noqa: BLE001 - an op without a meta kernel: assume the input's size
            n_out = n_in
        return 4 * (n_in + n_out)


def build_problem(source: str, name: str, origin: str) -> KernelBenchProblem:
    """The problem a KernelBench file's ``source`` describes (InputError naming what is wrong)."""
    file = KernelBenchFile(source, origin, module_name=f"_autofuse_{name}")
    sensitive, min_batch = _mode_sensitivity(file)
    summary = (inspect.getdoc(file.Model) or "").strip().splitlines()
    return KernelBenchProblem(
        name=name, description=f"{summary[0] + ' ' if summary else ''}(KernelBench file {origin})",
        model=file.Model, dims=tuple(file.sizes), default_shapes=(dict(file.sizes),), tolerances=TOLERANCES,
        linear_attr="", mode_sensitive=sensitive, min_train_batch=min_batch, floor="memory", file=file,
    )


def _mode_sensitivity(file: KernelBenchFile) -> tuple[bool, int]:
    """(whether train and eval compute different things, the smallest batch training takes)."""
    try:
        with torch.device("meta"):
            modules = list(file.Model(*file.init_inputs(file.sizes)).modules())
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: assume plain
        return False, 1
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)
    sensitive = batchnorm or any(
        (isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats)
        or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) for m in modules
    )
    return sensitive, 2 if batchnorm else 1


# -- which files are problems in this process ----------------------------------------
_lock = threading.RLock()
_by_name: dict[str, KernelBenchProblem] = {}
_generation = 0  # moves whenever the set changes, so the registry knows to rebuild


def is_path(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name


def problem_name(path: str | os.PathLike) -> str:
    return "kb_" + re.sub(r"\W", "_", pathlib.Path(path).stem)


def load(path: str | os.PathLike, *, remember: bool = True) -> KernelBenchProblem:
    """The problem of the KernelBench file at ``path``; ``remember`` adds it to AUTOFUSE_KERNELBENCH."""
    resolved = pathlib.Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise UnknownNameError(f"no problem or KernelBench file {str(path)!r}: {resolved} is not a file")
    problem = register_source(resolved.read_text(encoding="utf-8"), name=problem_name(resolved), origin=str(resolved))
    if remember and str(resolved) not in _env_paths():
        os.environ[ENV] = os.pathsep.join(_env_paths() + [str(resolved)])
    return problem


def register_source(source: str, *, name: str, origin: str = "<string>") -> KernelBenchProblem:
    """Register a KernelBench file's ``source`` as problem ``name`` (the same source twice is one
    problem; two different files under one name fail, naming both)."""
    global _generation
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    with _lock:
        existing = _by_name.get(name)
        if existing is not None and existing.file.digest == digest:
            return existing
        if existing is not None and existing.file.origin != origin:
            raise PluginError(f"two different KernelBench files are both problem {name!r}: "
                              f"{existing.file.origin} and {origin}; rename one of them")
        _by_name[name] = build_problem(source, name, origin)
        _generation += 1
        return _by_name[name]


def registered() -> list[KernelBenchProblem]:
    """Every file problem of this process, AUTOFUSE_KERNELBENCH's files loaded first."""
    with _lock:
        for path in _env_paths():
            try:
                load(path, remember=False)
            except (InputError, UnknownNameError) as exc:
                raise PluginError(f"{ENV} names {path}, which is not a usable KernelBench file: {exc}") from exc
        return list(_by_name.values())


def generation() -> int:
    return _generation


def forget() -> None:
    """Drop every file problem (tests); AUTOFUSE_KERNELBENCH is left to the caller."""
    global _generation
    with _lock:
        _by_name.clear()
        _generation += 1


def _env_paths() -> list[str]:
    return [p for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]
