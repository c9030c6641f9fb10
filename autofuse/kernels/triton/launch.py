"""Launching a Triton kernel without Triton's per-call binding (imported only where Triton is).

``kernel[grid](...)`` on a ``JITFunction`` binds the arguments, specializes each one (dtype and
16-byte alignment of a tensor, an int's value class, every constexpr) and looks the result up in
its kernel cache, every call: 19 µs for a small kernel and 49 µs for the TMA GEMM of
``matmul_clamp_lse_mish`` on an H100's host, where calling the ``CompiledKernel`` that lookup
returned took 7 and 21 (benchmarks/gpu/launch_overhead.py). Three such launches were 40% of a
call's host time, and in KernelBench's harness, which synchronizes around every call, host time
before the GEMM's launch is time the GPU waits.

``Launcher`` keeps that ``CompiledKernel`` under its own key and calls it directly. The key is
stricter than Triton's: a tensor's dtype and alignment, as Triton's, but the value itself of
every other argument (ints, floats, constexprs, launch options) and a descriptor's dtype
and block shape (its shape and strides are launch arguments); a tuple's items are keyed so, one
by one, as Triton specializes them. So a hit always has the
kernel Triton would have picked, and a miss goes through ``JITFunction`` (compiling if Triton
must) and remembers what it returned. It steps aside for launch hooks (profilers), pre-run hooks,
a callable grid, and Triton's interpreter (whose kernels are not ``JITFunction``s). Triton's
process-wide debug and instrumentation settings are read at a key's first launch only.

Measured on an H100 (benchmarks/gpu/launch_overhead.py): a GEMM launch 24-34 µs through it, 35-37
through ``JITFunction``; with the autograd node recorded after the launches (``autograd.fused_call``),
22's call 227 -> 130-142 µs of host time.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_KEYS = 256  # keys per kernel before the cache starts over (a float that changes each call)


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
        hooked = self.fn.pre_run_hooks or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
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
    """A kernel module whose ``@triton.jit`` functions launch through ``Launcher``; its other
    attributes (helpers, constants) are the module's own."""

    def __init__(self, module_name: str, package: str | None = None):
        self._module = importlib.import_module(module_name, package)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if isinstance(value, JITFunction):
            value = Launcher(value)
        setattr(self, name, value)  # found once: later lookups skip __getattr__
        return value

    def epilogue(self, name: str) -> Any:
        """The module's ``@triton.jit`` function ``name`` itself, not a launcher: an epilogue, which
        ``gemm.persistent_gemm`` takes as a constant argument."""
        return getattr(self._module, name)
