"""Launching a Triton kernel without Triton's per-call binding (imported only where Triton is).

``kernel[grid](...)`` on a ``JITFunction`` binds the arguments, specializes each one (dtype and
16-byte alignment of a tensor, an int's value class, every constexpr) and looks the result up in
its kernel cache, every call: 19 µs for a small kernel and 49 µs for the TMA GEMM of
``matmul_clamp_lse_mish`` on an H100's host, where calling the ``CompiledKernel`` that lookup
returned took 7 and 21 (benchmarks/gpu/launch_overhead.py, Triton 3.6). Three such launches were
40% of a call's host time, and in KernelBench's harness, which synchronizes around every call, host
time before the GEMM's launch is time the GPU waits.

``Launcher`` keeps that ``CompiledKernel`` under its own key and calls it directly. The key is
stricter than Triton's: a tensor's dtype and alignment, as Triton's, but the value itself of
every other argument (ints, floats, constexprs, launch options) and a descriptor's dtype, block
shape and padding (its shape and strides are launch arguments); a tuple's items are keyed so, one
by one, as Triton specializes them. So a hit always has the
kernel Triton would have picked, and a miss goes through ``JITFunction`` (compiling if Triton
must) and remembers what it returned. It steps aside for launch hooks (profilers), pre-run hooks,
a stages-inspection hook, a callable grid, and Triton's interpreter (whose kernels are not
``JITFunction``s). Triton's process-wide debug and instrumentation settings are read at a key's
first launch only. A GEMM launch took 24-34 µs through it on the H100, 35-37 through ``JITFunction``
(benchmarks/gpu/launch_overhead.py).

Measured on an H100 (benchmarks/gpu/launch_overhead.py): with the autograd node recorded after the
launches (``autograd.fused_call``), 22's call 227 -> 130-142 µs of host time.

Triton's internals it relies on, none of them public API:
- ``JITFunction.params`` (``name``, ``has_default``, ``default``) and ``pre_run_hooks``; a launch
  ``fn[grid](...)`` returns the ``CompiledKernel`` it ran (or a future of it, ``result()``);
- ``CompiledKernel.run(g0, g1, g2, stream, function, packed_metadata, launch_metadata,
  enter_hook, exit_hook, *arguments in parameter order, constexprs included)``, with None for the
  hooks and the metadata (the driver's launcher skips a None hook);
- ``triton.knobs.runtime``: ``launch_enter_hook`` and ``launch_exit_hook`` with their ``calls``,
  and (3.7 on) ``add_stages_inspection_hook``; ``triton.runtime.driver.driver.active``'s
  ``get_current_device`` and ``get_current_stream``; ``TensorDescriptor``'s ``base``,
  ``block_shape`` and ``padding``;
- the specialization above: the binder (``create_function_from_signature``,
  ``native_specialize_impl``) reads a tensor's dtype and 16-byte alignment, an int's range, ==1
  and divisibility by 16, a descriptor's dtype and block shape, a constexpr's value. A descriptor's
  padding and ``round_f32_to_tf32`` (3.7 on) are read at launch, from the object passed.
Read against the sources of Triton 3.6, 3.7, 3.8 and 3.9 (``KNOWN``), and the binder's keys of
each checked (tests/test_triton_launch.py); the launch itself ran on the GPU under 3.6. Under any
other release, or where one of these is missing, ``Kernels`` hands out the ``JITFunction`` itself
(Triton's own launcher) and says why once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import operator
import re
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

try:  # the internals below; a Triton without one of them launches through its own path
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError as exc:
    knobs = driver = TensorDescriptor = None
    _IMPORT_ERROR: str | None = str(exc)
else:
    _IMPORT_ERROR = None

log = logging.getLogger("autofuse")

MAX_KEYS = 256  # keys per kernel before the cache starts over (a float that changes each call)
_compile_only = False  # see ``compiling_only``
KNOWN = ((3, 6), (3, 7), (3, 8), (3, 9))  # Triton releases whose internals were read against this module
_said: set[str] = set()


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '3.7.1' or '3.8.0+git1a2b3c', or None."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


@functools.cache
def unsupported() -> str | None:
    """Why ``Launcher`` cannot be used with the Triton in this process, or None."""
    version = getattr(triton, "__version__", "unknown")
    if _release(version) not in KNOWN:
        known = ", ".join(f"{major}.{minor}" for major, minor in KNOWN)
        return f"Triton {version} is not a release whose launch internals autofuse was checked against ({known})"
    if _IMPORT_ERROR is not None:
        return f"Triton {version} lacks an internal the launcher uses ({_IMPORT_ERROR})"
    missing = [name for name, present in (
        ("knobs.runtime.launch_enter_hook.calls", hasattr(getattr(knobs.runtime, "launch_enter_hook", None), "calls")),
        ("knobs.runtime.launch_exit_hook.calls", hasattr(getattr(knobs.runtime, "launch_exit_hook", None), "calls")),
        ("driver.active", hasattr(type(driver), "active")),  # on the class: the instance's starts a GPU driver
        ("TensorDescriptor.block_shape", "block_shape" in getattr(TensorDescriptor, "__dataclass_fields__", ())),
    ) if not present]
    if missing:
        return f"Triton {version} lacks what the launcher uses: {', '.join(missing)}"
    return None


@contextlib.contextmanager
def compiling_only():
    """Within it, every ``Launcher`` compiles what a launch would run (``JITFunction.warmup``: the
    same arguments, so the same specialization, into Triton's on-disk cache) and launches nothing:
    a process can compile a candidate's kernels beside one that times others on the same GPU
    (``autofuse.tuning.prewarm``). What the kernels would have written stays unwritten, a
    variant's cached weight parts included: the variant run so is thrown away."""
    global _compile_only
    before, _compile_only = _compile_only, True
    try:
        yield
    finally:
        _compile_only = before


def _load(kernel) -> None:
    """Load a kernel ``compiling_only`` compiled, as its first launch would: Triton then builds its
    C launcher (a gcc run, 0.28 s on an H100's host, cached on disk by the launcher's source) here
    and not in the worker. kb2-99's tune, profiled, built 28 launchers in its worker, 7.8 of its
    143 s. Whatever fails (a kernel past the shared memory, a Triton without ``_init_handles``) is
    the worker's to meet and record at its launch."""
    try:
        kernel._init_handles()
    except Exception:  # noqa: BLE001 - see above: nothing depends on it
        pass


def launcher_for(fn: JITFunction):
    """A ``Launcher`` of ``fn``, or ``fn`` itself (Triton's own launcher) where ``unsupported``,
    said once per process."""
    reason = unsupported()
    if reason is None and hasattr(fn, "params") and hasattr(fn, "pre_run_hooks"):
        return Launcher(fn)
    reason = reason or f"Triton {triton.__version__}'s JITFunction lacks params or pre_run_hooks"
    if reason not in _said:
        _said.add(reason)
        log.warning("autofuse: Triton kernels launch through Triton's own launcher (slower on the host): %s", reason)
    return fn


class _Layout:
    """Where an argument list of one sequence of types holds tensors, descriptors and tuples: the
    rest (ints, floats, strings, None, constexprs) goes into the key by value, in one C-level step.
    A tuple's items are keyed as arguments are, by a layout of their own types, as Triton
    specializes them one by one (``gemm.persistent_gemm``'s epilogue arguments): the tuple's value
    would hold this call's tensors, a key no later call has."""

    def __init__(self, types: tuple[type, ...]):
        tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
        descriptors = [i for i, t in enumerate(types) if issubclass(t, TensorDescriptor)]
        tuples = [i for i, t in enumerate(types) if issubclass(t, tuple)]
        plain = [i for i in range(len(types)) if i not in tensors + descriptors + tuples]
        self.tensors, self.descriptors, self.tuples, self.plain = (
            _getter(i) for i in (tensors, descriptors, tuples, plain))
        self.nested = bool(tuples)
        self._items: dict[tuple[type, ...], _Layout] = {}

    def key(self, values) -> tuple:
        key = (self.plain(values),
               tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in self.tensors(values)]),
               tuple([(d.base.dtype, tuple(d.block_shape), d.padding) for d in self.descriptors(values)]))
        if self.nested:
            for items in self.tuples(values):
                types = tuple(map(type, items))
                layout = self._items.get(types) or self._items.setdefault(types, _Layout(types))
                key += (types, layout.key(items))
        return key


def _getter(indices: list[int]):
    """values -> tuple of values[i] for i in indices (operator.itemgetter, whatever the count)."""
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        get = operator.itemgetter(indices[0])
        return lambda values: (get(values),)
    return operator.itemgetter(*indices)


class Launcher:
    """``launcher[grid](*args, **kwargs)`` launches ``fn`` as ``fn[grid](*args, **kwargs)`` does."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self._names = tuple(p.name for p in fn.params)
        self._params = frozenset(self._names)
        self._defaults = {p.name: p.default for p in fn.params if p.has_default}
        self._kernels: dict[tuple, Any] = {}
        self._layouts: dict[tuple[type, ...], _Layout] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _values(self, args: tuple, kwargs: dict) -> list | None:
        """The arguments in parameter order, defaults filled in; None if one is missing."""
        if not args:
            try:
                return list(map(kwargs.__getitem__, self._names))  # all by keyword: the variants' way
            except KeyError:
                pass
        values = list(args)
        for name in self._names[len(args):]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self._defaults:
                values.append(self._defaults[name])
            else:
                return None
        return values

    def run(self, grid, args: tuple, kwargs: dict) -> None:
        if _compile_only:
            _load(self.fn.warmup(*args, grid=grid, **kwargs))
            return
        runtime = knobs.runtime
        hooked = (self.fn.pre_run_hooks or runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
                  or getattr(runtime, "add_stages_inspection_hook", None) is not None)  # 3.7 on: part of the key
        values = None if hooked or callable(grid) else self._values(args, kwargs)
        if values is None:  # Triton's own path (a missing argument: its error says which)
            self.fn[grid](*args, **kwargs)
            return
        options = kwargs.keys() - self._params
        options = tuple(sorted((k, kwargs[k]) for k in options)) if options else ()
        types = tuple(map(type, values))  # with the plain values' own, this tells 1, 1.0 and True apart
        layout = self._layouts.get(types) or self._layouts.setdefault(types, _Layout(types))
        device = driver.active.get_current_device()
        try:
            key = (device, options, types, layout.key(values))
            kernel = self._kernels.get(key)
        except TypeError:  # an unhashable argument: Triton's own path
            self.fn[grid](*args, **kwargs)
            return
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)  # launches, compiling first if Triton must
            kernel = kernel.result() if hasattr(kernel, "result") else kernel  # an asynchronous compile
            if kernel is not None:
                if len(self._kernels) >= MAX_KEYS:
                    self._kernels.clear()
                self._kernels[key] = kernel
            return
        stream = driver.active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)


class Kernels:
    """A kernel module whose ``@triton.jit`` functions launch through ``Launcher`` (``launcher_for``);
    its other attributes (helpers, constants) are the module's own."""

    def __init__(self, module_name: str, package: str | None = None):
        self._module = importlib.import_module(module_name, package)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if isinstance(value, JITFunction):
            value = launcher_for(value)
        setattr(self, name, value)  # found once: later lookups skip __getattr__
        return value

    def epilogue(self, name: str) -> Any:
        """The module's ``@triton.jit`` function ``name`` itself, not a launcher: an epilogue, which
        ``gemm.persistent_gemm`` takes as a constant argument."""
        return getattr(self._module, name)
