"""The Triton launcher that skips Triton's per-call binding: same kernel, same arguments, or the
JIT path. On the CPU, with the compiled kernel and the driver replaced by recorders; the GPU
tests (test_triton_gpu.py) run every variant through it for real."""

import importlib
import sys

import pytest
import torch

from autofuse.kernels.triton.variant import triton_missing

pytestmark = pytest.mark.skipif(triton_missing() is not None, reason=f"needs triton: {triton_missing()}")


class FakeKernel:
    """A CompiledKernel that records its launches."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert (function, metadata, launch_metadata, enter, exit_) == ("function", "metadata", None, None, None)
        self.launches.append(((g0, g1, g2), stream, args))


class FakeDriver:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.active
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 77)


def compiled_module(monkeypatch, name: str):
    """``name`` imported anew with Triton's interpreter off, so its kernels are ``JITFunction``s
    (another test of this session may have imported it under TRITON_INTERPRET=1); the modules
    imported before are put back after the test."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for module in {"autofuse.kernels.triton.gemm", name}:
        monkeypatch.delitem(sys.modules, module, raising=False)
    return importlib.import_module(name)


@pytest.fixture
def launcher(monkeypatch):
    """(a Launcher of the real ``tf32_parts`` whose JIT path is recorded, the JIT calls, the kernel)."""
    from triton.runtime.jit import JITFunction

    from autofuse.kernels.triton import launch as triton_launch

    gemm = compiled_module(monkeypatch, "autofuse.kernels.triton.gemm")
    assert isinstance(gemm.tf32_parts, JITFunction)
    monkeypatch.setattr(triton_launch, "driver", FakeDriver)
    kernel, jit_calls = FakeKernel(), []

    def jit_run(*args, grid, warmup, **kwargs):
        jit_calls.append((grid, args, kwargs))
        return kernel

    fn = gemm.tf32_parts  # (src_ptr, hi_ptr, lo_ptr, n, SPLIT: constexpr, BLOCK: constexpr)
    monkeypatch.setattr(fn, "run", jit_run)
    return triton_launch.Launcher(fn), jit_calls, kernel


def test_a_repeated_call_launches_the_kept_kernel_with_arguments_in_parameter_order(launcher):
    launch, jit_calls, kernel = launcher
    src, hi, lo = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    launch[(3,)](src, hi, lo, 64, SPLIT=True, BLOCK=32, num_warps=4)
    assert len(jit_calls) == 1 and kernel.launches == []
    new_src = torch.ones(64)  # another tensor, same dtype and alignment: the same compiled kernel
    launch[(3,)](new_src, hi, lo, 64, BLOCK=32, SPLIT=True, num_warps=4)
    assert len(jit_calls) == 1
    (grid, stream, args), = kernel.launches
    assert grid == (3, 1, 1) and stream == 77
    assert args[0] is new_src and args[1] is hi and args[2] is lo and args[3:] == (64, True, 32)


@pytest.mark.parametrize("change", ["int value", "constexpr", "option", "dtype", "alignment", "int vs bool"])
def test_anything_triton_specializes_on_goes_back_to_the_jit_path(launcher, change):
    launch, jit_calls, kernel = launcher
    base = torch.zeros(65)
    args, kwargs = [base[:64], torch.zeros(64), torch.zeros(64), 64], {"SPLIT": True, "BLOCK": 32, "num_warps": 4}
    launch[(1,)](*args, **kwargs)
    if change == "int value":
        args[3] = 63  # 64 % 16 == 0 is compiled in; 63's is not
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    elif change == "option":
        kwargs["num_warps"] = 8
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float64)
    elif change == "alignment":
        args[0] = base[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int vs bool":
        kwargs["SPLIT"] = 1
    launch[(1,)](*args, **kwargs)
    assert len(jit_calls) == 2 and kernel.launches == []


def test_launch_hooks_and_callable_grids_take_the_jit_path(launcher):
    from triton import knobs

    launch, jit_calls, kernel = launcher
    args = (torch.zeros(8), torch.zeros(8), torch.zeros(8), 8)
    launch[(1,)](*args, SPLIT=False, BLOCK=8)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch[(1,)](*args, SPLIT=False, BLOCK=8)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launch[lambda meta: (1,)](*args, SPLIT=False, BLOCK=8)
    assert len(jit_calls) == 3 and kernel.launches == []
    launch[(1,)](*args, SPLIT=False, BLOCK=8)
    assert len(kernel.launches) == 1


def test_a_missing_argument_is_triton_s_own_error(launcher):
    launch, jit_calls, _ = launcher
    launch[(1,)](torch.zeros(8), torch.zeros(8), torch.zeros(8), 8, SPLIT=False)  # BLOCK missing
    assert len(jit_calls) == 1  # the JIT path got it, and raises there for a real kernel


def test_kernels_wraps_jit_functions_and_passes_everything_else_through(monkeypatch):
    from autofuse.kernels.triton.launch import Kernels, Launcher

    module = compiled_module(monkeypatch, "autofuse.kernels.triton.gemm")
    kernels = Kernels("autofuse.kernels.triton.gemm")
    assert isinstance(kernels.tf32_parts, Launcher)
    assert kernels.row_block is module.row_block
    assert kernels.tf32_parts is kernels.tf32_parts  # wrapped once
    assert kernels.epilogue("store_tile") is module.store_tile  # an epilogue, passed as a constant: not wrapped


def recorded_gemm(monkeypatch):
    """(a Launcher of the real ``persistent_gemm`` whose JIT path is recorded, the JIT calls, the
    kernel, the gemm module), compiled mode."""
    from triton.runtime.jit import JITFunction

    from autofuse.kernels.triton import launch as triton_launch

    gemm = compiled_module(monkeypatch, "autofuse.kernels.triton.gemm")
    fn = gemm.persistent_gemm
    assert isinstance(fn, JITFunction)
    monkeypatch.setattr(triton_launch, "driver", FakeDriver)
    kernel, jit_calls = FakeKernel(), []
    monkeypatch.setattr(fn, "run", lambda *args, grid, warmup, **kwargs: jit_calls.append(kwargs) or kernel)
    return triton_launch.Launcher(fn), jit_calls, kernel, gemm


def gemm_arguments(gemm, x_desc=None, w_desc=None, epilogue_args=(), epilogue="store_tile"):
    """Keyword arguments of ``persistent_gemm`` at M, N, K = 40, 48, 64 (TMA with descriptors, else
    pointer loads), with ``epilogue`` and its ``epilogue_args``."""
    tma = x_desc is not None
    return dict(x_ptr=None if tma else torch.zeros(40, 64), x_lo_ptr=None, w_ptr=None if tma else torch.zeros(48, 64),
                w_lo_ptr=None, x_desc=x_desc, x_lo_desc=None, w_desc=w_desc, w_lo_desc=None, x_scale_ptr=None,
                w_scale_ptr=None, M=40, N=48, K=64, epilogue_args=epilogue_args, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16,
                GROUP_M=2, MODE="tf32", TMA=tma, EVEN_K=True, INTERPRET=False, EPILOGUE=getattr(gemm, epilogue),
                num_warps=4, num_stages=2)


def test_a_tuple_argument_is_keyed_by_its_items(monkeypatch):
    """Triton specializes each item of a tuple argument (``persistent_gemm``'s epilogue arguments)
    as it would an argument: another tensor of the same dtype and alignment in it launches the kept
    kernel; another dtype or alignment, None, an int for a float or another length goes back to the
    JIT path. (A tuple keyed by its tensors' identity would miss at every call.)"""
    launch, jit_calls, kernel, gemm = recorded_gemm(monkeypatch)
    first, other = torch.zeros(40, 48), torch.ones(40, 48)
    launch[(4,)](**gemm_arguments(gemm, epilogue_args=(first, 1.0)))
    launch[(4,)](**gemm_arguments(gemm, epilogue_args=(other, 1.0)))  # a float is keyed by value
    assert len(jit_calls) == 1 and len(kernel.launches) == 1
    args = kernel.launches[0][2]
    assert args[gemm.persistent_gemm.arg_names.index("epilogue_args")] == (other, 1.0)  # the tuple as it was
    changes = [(first.double(), 1.0), (torch.zeros(40 * 48 + 1)[1:].view(40, 48), 1.0), (None, 1.0), (first, 1),
               (first, 1.0, None), ((first, 1.0),)]
    for i, changed in enumerate(changes):
        launch[(4,)](**gemm_arguments(gemm, epilogue_args=changed))
        assert len(jit_calls) == 2 + i, changed
    assert len(kernel.launches) == 1


def test_the_epilogue_is_keyed_by_which_function_it_is(monkeypatch):
    launch, jit_calls, kernel, gemm = recorded_gemm(monkeypatch)
    out = torch.zeros(40, 48)
    launch[(4,)](**gemm_arguments(gemm, epilogue_args=(out,)))
    launch[(4,)](**gemm_arguments(gemm, epilogue_args=(out,), epilogue="tile_coords"))  # another function
    assert len(jit_calls) == 2 and kernel.launches == []


def test_a_descriptor_s_block_shape_is_keyed_and_its_shape_is_an_argument(monkeypatch):
    """Triton compiles a descriptor's dtype and block shape in, and takes its base, shape and
    strides at launch: another block shape goes back to the JIT path, another tensor does not.
    (M stays 40 here: an int is keyed by its value, stricter than Triton.)"""
    from triton.tools.tensor_descriptor import TensorDescriptor

    launch, jit_calls, kernel, gemm = recorded_gemm(monkeypatch)
    out = torch.zeros(40, 48)

    def call(x, w, block_k):
        launch[(4,)](**gemm_arguments(gemm, TensorDescriptor.from_tensor(x, [16, block_k]),
                                      TensorDescriptor.from_tensor(w, [16, block_k]), (out,)))

    call(torch.zeros(40, 64), torch.zeros(48, 64), 16)
    call(torch.ones(24, 64), torch.ones(48, 64), 16)  # other tensors, another descriptor shape: launch arguments
    assert len(jit_calls) == 1 and len(kernel.launches) == 1
    args = kernel.launches[0][2]
    assert args[gemm.persistent_gemm.arg_names.index("x_desc")].base.shape == (24, 64)
    call(torch.zeros(40, 64), torch.zeros(48, 64), 32)  # another block shape: compiled in
    assert len(jit_calls) == 2
