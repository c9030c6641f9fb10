"""A captured CUDA graph re-pointed at each call's own input and output, instead of copying them.

A graph's kernels read and write the addresses they were captured with, so a replay of a call
copies x into the graph's input before and clones the graph's output after: two more launches,
each a torch call on the host, and two more kernels and their gaps on the device (the dispatch's
interval at 1×8192² bf16 was 8.6-9.4 µs longer than its kernels' sum, benchmarks/analysis.md).
CUDA lets an instantiated graph's kernel node take new arguments
(``cuGraphExecKernelNodeSetParams``): a host-side update, no launch. ``Repointer.of`` finds, once
per graph, every kernel argument holding an address inside the graph's input or output storage:
an 8-byte value at an 8-byte boundary of the parameter space (the ABI aligns pointers naturally,
inside by-value structs too) that lies within the storage. Before each replay, ``point`` writes
the caller's addresses, at the same offsets, into those arguments. A node whose arguments come
packed (cuBLAS's Hopper kernels: one 1,720-byte blob on an H100, in which x's address does not
show as such, inside TMA descriptors it seems) is left as it was captured.

What it cannot see it must not trust: an address held elsewhere (a memcpy node, a pointer in
device memory, a TMA descriptor's encoded address, an end pointer one past the storage) would go
on reading the graph's own input or writing its own output. So ``GraphedCall`` uses a Repointer
only after a replay pointed at the caller's x and a NaN-filled fresh output, with the graph's
input filled with NaN, reproduced the plain call bit for bit.

An address inside the output's storage need not be the output's. The call's scratch lives in
the graph's pool, and the output may be allocated where a scratch tensor freed earlier in the
call was: 22's ``simplified`` frees its (B, 8192) clamp before its (B, 1) result takes the same
block. Re-pointed, the kernel writing that scratch wrote B×8192 values from the caller's fresh
(B, 1) output on, over whatever the allocator had put after it (an H200 tune's kept models, seen
as "parameter matmul.bias was modified" at every replayed batch class). Nothing in the
arguments tells the two apart, so the check replay writes into an output set between guards
(``Guarded``) that span what such a kernel could reach, the rest of the allocator segment the
graph's output lies in, and a graph that wrote a guard is not re-pointed.

The driver is reached through ctypes (``libcuda.so.1``, CUDA 12.4 or later for the parameter
layout): no dependency, and on a machine without it ``Repointer.of`` returns None.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

ALIGNMENT = 256  # a caller's x must start on this: the allocator's blocks do (512), odd views copy
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PAST_LAST_PARAMETER = 1  # CUDA_ERROR_INVALID_VALUE from cu*GetParamInfo


# Guards larger than this (an expandable segment can span gigabytes) cost more than re-pointing
# saves: such a graph copies instead.
GUARD_LIMIT = 256 * 2**20
CANARY = 0xA5  # a guard byte: no float kernel here writes a whole run of them


class RepointError(RuntimeError):
    """The driver refused a re-pointing: the graph's arguments may be half rewritten."""


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)."""

    _fields_ = [("func", ctypes.c_void_p),
                ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("kernel_params", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _driver():
    """libcuda's entry points this module calls, or None where it or one of them is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        entry = {name: getattr(lib, symbol) for name, symbol in (
            ("nodes", "cuGraphGetNodes"), ("node_type", "cuGraphNodeGetType"),
            ("get", "cuGraphKernelNodeGetParams_v2"), ("set", "cuGraphExecKernelNodeSetParams_v2"),
            ("func_param", "cuFuncGetParamInfo"), ("kernel_param", "cuKernelGetParamInfo"))}
    except (OSError, AttributeError):
        return None
    size_p, void_p = ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p
    entry["nodes"].argtypes = [void_p, ctypes.POINTER(void_p), size_p]
    entry["node_type"].argtypes = [void_p, ctypes.POINTER(ctypes.c_int)]
    entry["get"].argtypes = [void_p, ctypes.POINTER(_KernelNodeParams)]
    entry["set"].argtypes = [void_p, void_p, ctypes.POINTER(_KernelNodeParams)]
    entry["func_param"].argtypes = entry["kernel_param"].argtypes = [void_p, ctypes.c_size_t, size_p, size_p]
    return entry


def fits(x: torch.Tensor) -> bool:
    """Whether a replay may read ``x`` where it is: laid out as the graph's input (contiguous; the
    key fixed shape and dtype) and aligned as the allocator aligns it, which the captured kernels
    may have assumed (Triton specializes on 16-byte alignment, cuBLAS picks kernels by it)."""
    return x.is_contiguous() and x.data_ptr() % ALIGNMENT == 0


def pointer_slots(values: Sequence[bytes], offsets: Sequence[int],
                  ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Where a kernel's arguments hold an address inside one of ``ranges`` ((start, bytes) each):
    (argument, byte offset in it, range, offset from the range's start) for each 8-byte value at
    an 8-byte boundary of the parameter space (argument ``i`` starts at ``offsets[i]``)."""
    found = []
    for i, (value, at) in enumerate(zip(values, offsets)):
        for o in range((-at) % 8, len(value) - 7, 8):
            address = int.from_bytes(value[o:o + 8], "little")
            found += [(i, o, r, address - start) for r, (start, size) in enumerate(ranges)
                      if start <= address < start + size]
    return found


class Repointer:
    """Kernel nodes of one instantiated graph whose arguments hold its input's or output's
    addresses, with the argument buffers ``point`` rewrites (module docstring)."""

    def __init__(self, exec_handle: int, nodes: list, slots: list, set_params):
        self._exec, self._set = exec_handle, set_params  # cuGraphExecKernelNodeSetParams
        self._nodes = nodes  # (node handle, its _KernelNodeParams pointing at our buffers, the buffers)
        self._slots = slots  # (a c_uint64 inside one of those buffers, tensor index, byte offset from its start)

    @classmethod
    def of(cls, graph: torch.cuda.CUDAGraph, tensors: Sequence[torch.Tensor]) -> Repointer | None:
        """``graph``'s Repointer for ``tensors`` (each the whole of its storage, as ``empty_like``
        makes them), or None if the driver or torch cannot say, or no kernel argument holds one
        of their addresses."""
        driver = _driver()
        if driver is None or not hasattr(graph, "raw_cuda_graph_exec"):
            return None
        ranges = [(t.data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
        try:
            raw, exec_handle = graph.raw_cuda_graph(), graph.raw_cuda_graph_exec()
        except RuntimeError:  # captured without keep_graph=True, or not instantiated
            return None
        nodes, slots = [], []
        try:
            for node in _graph_nodes(driver, raw):
                found = _kernel_node(driver, node, ranges)
                if found is None:
                    return None
                if found is not False:
                    params, buffers, node_slots = found
                    nodes.append((node, params, buffers))
                    slots += [(ctypes.c_uint64.from_buffer(buffers[i], o), r, delta) for i, o, r, delta in node_slots]
        except RuntimeError:  # a driver call failed: nothing to re-point with
            return None
        return cls(exec_handle, nodes, slots, driver["set"]) if slots else None

    def point(self, tensors: Sequence[torch.Tensor]) -> None:
        """The next replays read and write ``tensors``, each laid out as the one it replaces from
        its first element on (a view's ``data_ptr``, not its storage's)."""
        bases = [t.data_ptr() for t in tensors]
        for view, r, delta in self._slots:
            view.value = bases[r] + delta
        for node, params, _ in self._nodes:
            if status := self._set(self._exec, node, ctypes.byref(params)):
                raise RepointError(f"cuGraphExecKernelNodeSetParams failed (CUresult {status})")


def _graph_nodes(driver, raw: int) -> list[int]:
    count = ctypes.c_size_t(0)
    _check(driver["nodes"](raw, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(driver["nodes"](raw, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    return list(nodes[:count.value])


def _kernel_node(driver, node: int, ranges):
    """(params, argument buffers, slots) for a kernel node whose arguments hold an address in
    ``ranges``; False for another node, one that holds none, or one whose arguments come packed
    (left as it is: if it reads x or writes the output, the check shows); None where the driver
    cannot say."""
    kind = ctypes.c_int(-1)
    _check(driver["node_type"](node, ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _KERNEL_NODE:
        return False
    params = _KernelNodeParams()
    _check(driver["get"](node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
    if params.extra:  # cuBLAS's kernels: arguments packed (operand addresses not shown as such)
        return False
    layout = _parameter_layout(driver, params)
    if layout is None or (layout and not params.kernel_params):
        return None
    if any(params.kernel_params[i] is None for i in range(len(layout))):
        return None
    values = [ctypes.string_at(params.kernel_params[i], size) for i, (_, size) in enumerate(layout)]
    slots = pointer_slots(values, [offset for offset, _ in layout], ranges)
    if not slots:
        return False
    buffers = [ctypes.create_string_buffer(v, len(v)) for v in values]
    pointers = (ctypes.c_void_p * len(buffers))(*[ctypes.addressof(b) for b in buffers])
    mine = _KernelNodeParams.from_buffer_copy(params)
    mine.kernel_params, mine.extra = ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p)), None
    return mine, buffers + [pointers], slots


def _parameter_layout(driver, params: _KernelNodeParams) -> list[tuple[int, int]] | None:
    """(offset, bytes) of each of the node's kernel's parameters, or None if the driver cannot say."""
    info, handle = (driver["func_param"], params.func) if params.func else (driver["kernel_param"], params.kern)
    layout = []
    while True:
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        status = info(handle, len(layout), ctypes.byref(offset), ctypes.byref(size))
        if status == _PAST_LAST_PARAMETER:
            return layout
        if status:
            return None
        layout.append((offset.value, size.value))


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed (CUresult {status})")


def segment_reach(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes before, bytes after) ``t``'s storage up to the ends of the allocator segment that
    holds it: as far as a kernel writing a tensor that shared ``t``'s addresses could reach (no
    block spans two segments). None where no segment holds it (not the caching allocator's)."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    for segment in torch.cuda.memory_snapshot():
        first = segment["address"]
        if first <= start < first + segment["total_size"]:
            return start - first, first + segment["total_size"] - end
    return None


class Guarded:
    """A fresh NaN-filled tensor laid out as ``like``, between guards of ``before`` and ``after``
    bytes filled with ``CANARY``: ``intact`` says whether anything wrote outside the tensor."""

    def __init__(self, like: torch.Tensor, before: int, after: int):
        nbytes = like.numel() * like.element_size()
        before = -(-before // 512) * 512  # the tensor as aligned as an allocation of its own
        self._block = torch.full((before + nbytes + after,), CANARY, dtype=torch.uint8, device=like.device)
        self._before, self._nbytes = before, nbytes
        self.tensor = self._block[before:before + nbytes].view(like.dtype).view(like.shape)
        self.tensor.fill_(float("nan"))

    def intact(self) -> bool:
        return bool((self._block[:self._before] == CANARY).all()
                    and (self._block[self._before + self._nbytes:] == CANARY).all())
