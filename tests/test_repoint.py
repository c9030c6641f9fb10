"""Finding a graph's input and output addresses among its kernels' arguments
(``autofuse.serve.repoint.pointer_slots``): what counts as a pointer, and what does not. The driver
side runs on the GPU (tests/test_graphs_gpu.py)."""

import ctypes
import struct

import pytest
import torch

from autofuse.serve import repoint

X, OUT = (0x7F00_0000_0000, 4096), (0x7F00_0001_0000, 512)  # (start, bytes) of two storages


def _u64(*values):
    return struct.pack(f"<{len(values)}Q", *values)


def test_a_pointer_argument_and_one_inside_a_by_value_struct_are_found_with_their_offsets():
    values = [_u64(X[0]), struct.pack("<i", 7), _u64(3, OUT[0] + 64, 5)]
    offsets = [0, 8, 16]  # the struct starts on an 8-byte boundary, after 4 bytes of padding
    assert repoint.pointer_slots(values, offsets, [X, OUT]) == [(0, 0, 0, 0), (2, 8, 1, 64)]


def test_values_outside_the_storages_or_off_an_8_byte_boundary_are_not_pointers():
    end = X[0] + X[1]  # one past the end: another storage's, or none
    misaligned = b"\0" * 4 + _u64(X[0] + 8) + b"\0" * 4
    values = [_u64(end), _u64(X[0] - 8), misaligned, struct.pack("<d", 1.5)]
    assert repoint.pointer_slots(values, [0, 8, 16, 32], [X, OUT]) == []


def test_the_parameter_space_sets_the_boundary_not_the_argument():
    # A 12-byte argument at offset 12: its bytes 4-11 are the space's 16-23, an 8-byte boundary.
    value = b"\0" * 4 + _u64(OUT[0] + 8)
    assert repoint.pointer_slots([value], [12], [X, OUT]) == [(0, 4, 1, 8)]


def test_pointing_writes_each_tensors_first_element_plus_the_slots_offset_and_updates_each_node():
    buffer = (ctypes.c_char * 16)()
    slots = [(ctypes.c_uint64.from_buffer(buffer, 0), 0, 0), (ctypes.c_uint64.from_buffer(buffer, 8), 1, 64)]
    updated = []
    node = ("node", repoint._KernelNodeParams(), [buffer])
    repointer = repoint.Repointer(7, [node], slots,
                                  lambda exec_handle, node, params: updated.append((exec_handle, node)) or 0)
    storage, out = torch.zeros(4096), torch.zeros(256)
    x = storage[512:1024]  # a view: its first element, not its storage's, is what the graph reads
    repointer.point((x, out))
    assert struct.unpack("<2Q", bytes(buffer)) == (x.data_ptr(), out.data_ptr() + 64)
    assert updated == [(7, "node")]
    failing = repoint.Repointer(7, [node], slots, lambda *args: 1)
    with pytest.raises(repoint.RepointError, match="CUresult 1"):
        failing.point((x, out))


def test_only_a_contiguous_x_on_the_allocators_alignment_is_read_where_it_is():
    x = torch.empty(4 * repoint.ALIGNMENT, dtype=torch.uint8)
    start = (-x.data_ptr()) % repoint.ALIGNMENT
    assert repoint.fits(x[start:start + 64]) and not repoint.fits(x[start + 16:start + 80])
    assert not repoint.fits(x[start:start + 128].view(8, 16).t())


def test_without_a_cuda_driver_or_a_kept_graph_nothing_is_repointed():
    class NotAGraph:  # no raw_cuda_graph_exec: a torch before 2.9, or a stand-in
        pass

    assert repoint.Repointer.of(NotAGraph(), [torch.zeros(4)]) is None


def test_a_guarded_output_is_nan_laid_out_as_asked_and_any_write_past_either_end_shows():
    like = torch.empty(3, 5, dtype=torch.bfloat16)
    guarded = repoint.Guarded(like, 100, 64)  # the front guard rounds up to 512: the output stays aligned
    fresh = guarded.tensor
    assert fresh.shape == like.shape and fresh.dtype == like.dtype and fresh.is_contiguous()
    assert fresh.isnan().all() and fresh.untyped_storage().data_ptr() + 512 == fresh.data_ptr()
    fresh.fill_(1.0)  # everything inside is the output's to write
    assert guarded.intact()
    for offset in (-1, fresh.numel()):  # one element before its first, one past its last
        guarded = repoint.Guarded(like, 512, 64)
        torch.as_strided(guarded.tensor, (1,), (1,), guarded.tensor.storage_offset() + offset).fill_(0.0)
        assert not guarded.intact(), offset
    assert repoint.Guarded(like, 0, 0).intact()  # no room either side: nothing to write there
