"""The Triton launcher that skips Triton's per-call binding: same kernel, same arguments, or the
JIT path. On the CPU, with the compiled kernel and the driver replaced by recorders; the GPU
tests (test_triton_gpu.py) run every variant through it for real."""

import importlib
import sys

import pytest
import torch

from autofuse.kernels.triton.variant import triton_missing

pytestmark = pytest.mark.skipif(triton_missing() is not None, reason=f"needs triton: {triton_missing()}")




def _launch_module():
    from autofuse.kernels.triton import launch as triton_launch

    return triton_launch


# The launcher's own tests skip under a Triton it does not know (its kernels then launch through
# Triton's path: test_a_triton_the_launcher_does_not_know_...).
STEPS_ASIDE = None if triton_missing() is not None else _launch_module().unsupported()
needs_launcher = pytest.mark.skipif(STEPS_ASIDE is not None, reason=f"the launcher steps aside here: {STEPS_ASIDE}")


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
    for module in {"autofuse.kernels.triton.gemm", "autofuse.kernels.triton.epilogue", name}:
        monkeypatch.delitem(sys.modules, module, raising=False)
    return importlib.import_module(name)


@pytest.fixture
def launcher(monkeypatch):
    if STEPS_ASIDE is not None:
        pytest.skip(f"the launcher steps aside here: {STEPS_ASIDE}")
    # tf32_parts(src_ptr, hi_ptr, lo_ptr, n, SPLIT: constexpr, BLOCK: constexpr)
    return make_launcher(monkeypatch, "autofuse.kernels.triton.gemm", "tf32_parts")


def make_launcher(monkeypatch, module, name):
    """(a Launcher of the real kernel ``name`` of ``module`` whose JIT path is recorded, the JIT
    calls, the kernel)."""
    from triton.runtime.jit import JITFunction

    from autofuse.kernels.triton import launch as triton_launch

    fn = getattr(compiled_module(monkeypatch, module), name)
    assert isinstance(fn, JITFunction)
    monkeypatch.setattr(triton_launch, "driver", FakeDriver)
    kernel, jit_calls = FakeKernel(), []

    def jit_run(*args, grid, warmup, **kwargs):
        jit_calls.append((grid, args, kwargs))
        return kernel

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


def test_a_stages_inspection_hook_takes_the_jit_path(launcher, monkeypatch):
    """Triton 3.7 on appends the hook's hash to the specialization it keys kernels on."""
    from triton import knobs

    launch, jit_calls, kernel = launcher
    args = (torch.zeros(8), torch.zeros(8), torch.zeros(8), 8)
    launch[(1,)](*args, SPLIT=False, BLOCK=8)
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", lambda: ("key", "hash"), raising=False)
    launch[(1,)](*args, SPLIT=False, BLOCK=8)
    assert len(jit_calls) == 2 and kernel.launches == []


def test_a_missing_argument_is_triton_s_own_error(launcher):
    launch, jit_calls, _ = launcher
    launch[(1,)](torch.zeros(8), torch.zeros(8), torch.zeros(8), 8, SPLIT=False)  # BLOCK missing
    assert len(jit_calls) == 1  # the JIT path got it, and raises there for a real kernel


@needs_launcher
def test_kernels_wraps_jit_functions_and_passes_everything_else_through(monkeypatch):
    from autofuse.kernels.triton.launch import Kernels, Launcher

    module = compiled_module(monkeypatch, "autofuse.kernels.triton.gemm")
    kernels = Kernels("autofuse.kernels.triton.gemm")
    assert isinstance(kernels.tf32_parts, Launcher)
    assert kernels.tf32_parts is kernels.tf32_parts  # wrapped once
    assert kernels.epilogue("store_tile") is module.store_tile  # an epilogue, passed as a constant: not wrapped
    shared = compiled_module(monkeypatch, "autofuse.kernels.triton.epilogue")
    assert Kernels("autofuse.kernels.triton.epilogue").row_block is shared.row_block  # a host function


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


@needs_launcher
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


@pytest.fixture
def fresh_verdict(monkeypatch):
    """The launcher's verdict on this process's Triton worked out anew, and nothing said yet; both
    back as they were after the test."""
    triton_launch = _launch_module()
    triton_launch.unsupported.cache_clear()
    monkeypatch.setattr(triton_launch, "_said", set())
    yield triton_launch
    triton_launch.unsupported.cache_clear()


@pytest.mark.parametrize("fake", ["3.99.0", "2.3.1+git1a2b3c", "no knobs.runtime.launch_enter_hook"])
def test_a_triton_the_launcher_does_not_know_launches_through_triton_s_own_path_said_once(
        monkeypatch, caplog, fresh_verdict, fake):
    """An unknown release, or a known one without an internal the launcher calls: the kernels are
    the ``JITFunction``s themselves, every launch goes through ``kernel[grid]``, and the reason is
    logged once for the process, however many kernels and modules are handed out."""
    import types

    import triton

    triton_launch = fresh_verdict
    if fake.startswith("no "):  # a release it knows, without the hook chains
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        monkeypatch.setattr(triton_launch, "_IMPORT_ERROR", None)
        monkeypatch.setattr(triton_launch, "knobs", types.SimpleNamespace(runtime=types.SimpleNamespace()))
        expected = "launch_enter_hook"
    else:
        monkeypatch.setattr(triton, "__version__", fake)
        expected = fake
    gemm = compiled_module(monkeypatch, "autofuse.kernels.triton.gemm")
    jit_calls = []
    monkeypatch.setattr(gemm.tf32_parts, "run", lambda *args, grid, warmup, **kwargs: jit_calls.append(grid))
    with caplog.at_level("WARNING", logger="autofuse"):
        kernels = triton_launch.Kernels("autofuse.kernels.triton.gemm")
        assert kernels.tf32_parts is gemm.tf32_parts  # Triton's own launcher
        for _ in range(2):
            kernels.tf32_parts[(1,)](torch.zeros(8), torch.zeros(8), torch.zeros(8), 8, SPLIT=False, BLOCK=8)
        assert kernels.fp16_row_parts is gemm.fp16_row_parts
        assert triton_launch.Kernels("autofuse.kernels.triton.gemm").transpose is gemm.transpose
    assert jit_calls == [(1,), (1,)]
    said = [r.getMessage() for r in caplog.records if "own launcher" in r.getMessage()]
    assert len(said) == 1 and expected in said[0], said


@pytest.mark.parametrize("version,release", [("3.6.0", (3, 6)), ("3.7.1", (3, 7)), ("3.10.0+git1a2b", (3, 10)),
                                             ("nightly", None)])
def test_a_release_is_its_major_and_minor_version(version, release):
    assert _launch_module()._release(version) == release


def triton_key(fn, args, kwargs):
    """The specialization and options Triton's binder gives a launch on an H100 (sm_90): what its
    kernel cache is keyed on (``JITFunction.run``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    bind = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    _, specialization, options = bind(*args, **kwargs)
    return str(specialization), sorted(options.items())


def probe_kernel():
    """A kernel with an argument of each kind the variants pass (its body is never compiled here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(t_ptr, desc, n, scale, flag, BLOCK: tl.constexpr):
        pass

    return probe


def probe_call(t, x):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (t, TensorDescriptor.from_tensor(x, [16, 16]), 64, 2.0, True), {"BLOCK": 16, "num_warps": 4}


# Pairs of launches the launcher serves from one kept kernel: other values of what it leaves out of
# its key. Made in the test (a Triton without TensorDescriptor must still collect this module).
SAME_KERNEL = {
    "another tensor": lambda: (probe_call(torch.zeros(64), torch.zeros(40, 64)),
                               probe_call(torch.ones(64), torch.zeros(40, 64))),
    "another length": lambda: (probe_call(torch.zeros(64), torch.zeros(40, 64)),
                               probe_call(torch.zeros(1000), torch.zeros(40, 64))),
    "16 bytes in": lambda: (probe_call(torch.zeros(64), torch.zeros(40, 64)),
                            probe_call(torch.zeros(68)[4:], torch.zeros(40, 64))),
    "descriptor's tensor and shape": lambda: (probe_call(torch.zeros(64), torch.zeros(40, 64)),
                                              probe_call(torch.zeros(64), torch.ones(24, 64))),
    "descriptor's strides": lambda: (probe_call(torch.zeros(64), torch.zeros(40, 64)),
                                     probe_call(torch.zeros(64), torch.zeros(40, 128)[:, :64])),
}


@needs_launcher
@pytest.mark.parametrize("case", list(SAME_KERNEL))
def test_what_the_launcher_serves_from_one_kernel_the_installed_triton_specializes_alike(monkeypatch, case):
    """The key's soundness against the binder of the Triton installed, whichever release of
    ``KNOWN`` that is: a launch the launcher serves from a kept kernel, Triton would have served
    from the same one."""
    from autofuse.kernels.triton import launch as triton_launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = probe_kernel()
    monkeypatch.setattr(triton_launch, "driver", FakeDriver)
    kernel, jit_calls = FakeKernel(), []
    monkeypatch.setattr(fn, "run", lambda *args, grid, warmup, **kwargs: jit_calls.append(grid) or kernel)
    launch = triton_launch.Launcher(fn)
    (args, kwargs), (other_args, other_kwargs) = SAME_KERNEL[case]()
    launch[(1,)](*args, **kwargs)
    launch[(1,)](*other_args, **other_kwargs)
    assert len(jit_calls) == 1 and len(kernel.launches) == 1, f"{case}: the launcher did not keep the kernel"
    assert triton_key(fn, args, kwargs) == triton_key(fn, other_args, other_kwargs)


@pytest.mark.gpu
@needs_launcher
def test_the_kept_kernel_launches_for_real_on_the_gpu(monkeypatch):
    """Under the Triton installed: the first launch goes through ``JITFunction``, the next two call
    the kept ``CompiledKernel`` on other tensors, and each writes what the kernel is for (the torch
    rounding ``round_tf32``, bit for bit). test_triton_gpu.py runs every variant, TMA descriptors
    included, through the launcher."""
    import triton

    from autofuse.kernels.triton import launch as triton_launch
    from autofuse.kernels.triton.host import round_tf32

    gemm = compiled_module(monkeypatch, "autofuse.kernels.triton.gemm")
    fn, jit_runs = gemm.tf32_parts, []
    jit_run = fn.run
    monkeypatch.setattr(fn, "run", lambda *args, **kwargs: jit_runs.append(1) or jit_run(*args, **kwargs))
    launch = triton_launch.Launcher(fn)
    n = 1000
    for _ in range(3):
        src = torch.randn(n, device="cuda") * 1e3
        hi, lo = torch.full_like(src, float("nan")), torch.full_like(src, float("nan"))
        launch[(-(-n // 256),)](src, hi, lo, n, SPLIT=True, BLOCK=256, num_warps=4)
        torch.cuda.synchronize()
        assert torch.equal(hi, round_tf32(src)) and torch.equal(lo, round_tf32(src - hi))
    assert len(jit_runs) == 1, f"Triton {triton.__version__}: the launcher went back to the JIT path"


def test_compiling_only_compiles_what_a_launch_would_and_launches_nothing(launcher, monkeypatch):
    """``compiling_only`` (the tuner's parallel compiles, ``autofuse.tuning.prewarm``) hands the
    launch's own arguments to Triton's warmup and launches nothing, a kept kernel included."""
    from autofuse.kernels.triton import launch as triton_launch

    launch, jit_calls, kernel = launcher
    warmups, jit_run = [], launch.fn.run
    monkeypatch.setattr(launch.fn, "run", lambda *args, grid, warmup, **kwargs: warmups.append(warmup)
                        or jit_run(*args, grid=grid, warmup=warmup, **kwargs))
    args = (torch.zeros(8), torch.zeros(8), torch.zeros(8), 8)
    launch[(1,)](*args, SPLIT=False, BLOCK=8)  # kept
    with triton_launch.compiling_only():
        launch[(2,)](*args, SPLIT=False, BLOCK=8)
        launch[(2,)](*args, SPLIT=True, BLOCK=8)
    assert warmups == [False, True, True] and kernel.launches == []
    assert [c[2] for c in jit_calls[1:]] == [{"SPLIT": False, "BLOCK": 8}, {"SPLIT": True, "BLOCK": 8}]
    launch[(1,)](*args, SPLIT=False, BLOCK=8)
    assert len(kernel.launches) == 1  # outside it, the kept kernel launches again


def test_a_compile_only_launch_loads_the_kernel_and_leaves_its_failures_to_the_worker():
    """``compiling_only`` loads what it compiled, so the pool builds the kernel's C launcher; a
    kernel that cannot be loaded (past the shared memory, say) is the worker's to meet at launch."""
    from autofuse.kernels.triton import launch as triton_launch

    class Kernel:
        def __init__(self, error=None):
            self.loads, self.error = 0, error

        def _init_handles(self):
            self.loads += 1
            if self.error:
                raise self.error

    loaded, failing = Kernel(), Kernel(RuntimeError("out of resources: shared memory"))
    triton_launch._load(loaded)
    triton_launch._load(failing)  # raises nothing
    triton_launch._load(None)  # a warmup that returned nothing: nothing to load
    assert loaded.loads == 1 and failing.loads == 1
