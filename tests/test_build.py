"""Building kernel libraries: cache keys, the nvcc cache, parallel builds, locks, the header."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import filelock
import pytest

from autofuse.errors import BuildError, InputError
from autofuse.kernels import build as build_mod
from autofuse.kernels.build import KernelBuild, build, build_many, cache_dir, check_status, load_library

SCALE_CU = textwrap.dedent("""\
    #include "autofuse.cuh"

    #ifndef FACTOR
    #define FACTOR 2
    #endif
    #if defined(BROKEN) && BROKEN
    #error broken on purpose
    #endif

    __global__ void scale_kernel(float* x, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] *= FACTOR;
    }

    AF_EXPORT int scale(float* x, int n, cudaStream_t stream) {
        scale_kernel<<<af_ceil_div(n, 256), 256, 0, stream>>>(x, n);
        AF_CHECK_LAUNCH();
    }
    """)

REDUCE_CU = textwrap.dedent("""\
    #include "autofuse.cuh"

    // Every thread stores what it got, so a test sees whether the result reached all of them;
    // the max reuses smem right after the sum, as a softmax does.
    template <int THREADS>
    __global__ void reduce_kernel(const float* x, float* sums, float* maxes, float* warp_sums, float* warp_maxes) {
        __shared__ float smem[THREADS / 32];
        const int i = blockIdx.x * THREADS + threadIdx.x;
        const float v = x[i];
        sums[i] = af_block_sum<THREADS>(v, smem);
        maxes[i] = af_block_max<THREADS>(v, smem);
        warp_sums[i] = af_warp_sum(v);
        warp_maxes[i] = af_warp_max(v);
    }

    template <int THREADS>
    static int launch(const float* x, float* s, float* m, float* ws, float* wm, int rows, cudaStream_t stream) {
        reduce_kernel<THREADS><<<rows, THREADS, 0, stream>>>(x, s, m, ws, wm);
        AF_CHECK_LAUNCH();
    }

    AF_EXPORT int reduce(const float* x, float* s, float* m, float* ws, float* wm, int rows, int threads,
                         cudaStream_t stream) {
        switch (threads) {
            case 32: return launch<32>(x, s, m, ws, wm, rows, stream);
            case 96: return launch<96>(x, s, m, ws, wm, rows, stream);
            case 256: return launch<256>(x, s, m, ws, wm, rows, stream);
            case 1024: return launch<1024>(x, s, m, ws, wm, rows, stream);
        }
        return (int)cudaErrorInvalidValue;
    }
    """)


@pytest.fixture(autouse=True)
def _arch(monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CUDA_ARCH", "sm_90")


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src" / "scale.cu"
    path.parent.mkdir()
    path.write_text(SCALE_CU)
    return path


@pytest.fixture
def fake_nvcc(monkeypatch):
    """Keys without a compiler: the key tests run on machines with no CUDA toolkit."""
    monkeypatch.setattr(build_mod, "find_nvcc", lambda: "/fake/nvcc")
    monkeypatch.setattr(build_mod, "nvcc_version", lambda nvcc: "release 13.0, V13.0.88")


def built_files(directory):
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock"))


# --- keys and commands ------------------------------------------------------------------


def test_key_ignores_define_order_and_source_path(source, tmp_path, fake_nvcc):
    copy = tmp_path / "elsewhere" / "other_name.cu"
    copy.parent.mkdir()
    shutil.copy(source, copy)
    a = KernelBuild.create(source, {"BM": 128, "BN": 64})
    b = KernelBuild.create(copy, {"BN": "64", "BM": "128"})
    assert a.defines == (("BM", "128"), ("BN", "64")) and a.arch == "sm_90"
    assert a.key() == b.key() and len(a.key()) == 24


def test_key_changes_with_everything_that_changes_the_binary(source, tmp_path, fake_nvcc, monkeypatch):
    base = KernelBuild.create(source, {"FACTOR": 2})
    keys = {"base": base.key()}
    keys["define"] = KernelBuild.create(source, {"FACTOR": 3}).key()
    keys["arch"] = KernelBuild.create(source, {"FACTOR": 2}, arch="sm_90a").key()
    keys["flag"] = KernelBuild.create(source, {"FACTOR": 2}, flags=["-G"]).key()
    (source.parent / "local.cuh").write_text("#define LOCAL 1\n")
    keys["source-dir header"] = base.key()
    csrc = tmp_path / "csrc"
    shutil.copytree(build_mod.CSRC_DIR, csrc)
    monkeypatch.setattr(build_mod, "CSRC_DIR", csrc)
    assert base.key() == keys["source-dir header"]  # a copy of CSRC_DIR changes nothing
    (csrc / "autofuse.cuh").write_text((csrc / "autofuse.cuh").read_text() + "// edited\n")
    keys["csrc header"] = base.key()
    monkeypatch.setattr(build_mod, "nvcc_version", lambda nvcc: "release 13.1, V13.1.0")
    keys["nvcc"] = base.key()
    source.write_text(SCALE_CU + "// edited\n")
    keys["source"] = base.key()
    assert len(set(keys.values())) == len(keys), keys


def test_create_and_init_validate(source):
    with pytest.raises(ValueError, match="sm_90"):
        KernelBuild.create(source, arch="hopper")
    with pytest.raises(ValueError, match="C identifier"):
        KernelBuild.create(source, {"not a name": 1})
    assert KernelBuild.create(source).arch == "sm_90"  # from AUTOFUSE_CUDA_ARCH


def test_command_shape(source):
    kb = KernelBuild.create(source, {"BM": 128}, arch="sm_90a", flags=["-G"])
    out = source.parent / "x.so"
    cmd = kb.command("nvcc", out)
    assert cmd[: 1 + len(build_mod.BASE_FLAGS)] == ["nvcc", *build_mod.BASE_FLAGS]
    assert "--use_fast_math" not in cmd
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert cmd[-5:] == ["-DBM=128", "-G", "-o", str(out), str(source)]
    assert ["-I", str(build_mod.CSRC_DIR)] == cmd[cmd.index("-I") : cmd.index("-I") + 2]


def test_find_nvcc_order(tmp_path, monkeypatch):
    fake = tmp_path / "cuda" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.delenv("AUTOFUSE_NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert build_mod.find_nvcc() == str(fake)
    monkeypatch.setenv("AUTOFUSE_NVCC", str(tmp_path / "missing"))
    with pytest.raises(BuildError, match="AUTOFUSE_NVCC"):
        build_mod.find_nvcc()


def test_missing_nvcc_says_how_to_point_to_it(source, monkeypatch):
    monkeypatch.setattr(build_mod, "find_nvcc", lambda: None)
    with pytest.raises(BuildError, match="AUTOFUSE_NVCC.*CUDA_HOME"):
        build(KernelBuild.create(source))


def test_missing_source_is_a_build_error(tmp_path, fake_nvcc):
    result = build_many([KernelBuild.create(tmp_path / "nope.cu")])
    assert isinstance(next(iter(result.values())), BuildError)


# --- building with nvcc -----------------------------------------------------------------


@pytest.mark.nvcc
def test_build_exports_launcher_and_caches(source, monkeypatch):
    kb = KernelBuild.create(source, {"FACTOR": 3})
    path = build(kb)
    assert path == cache_dir() / f"{kb.key()}.so" and path.is_file()
    assert built_files(cache_dir()) == [path.name]
    lib = load_library(path)  # nvcc links cudart statically: this loads with no GPU or driver
    assert hasattr(lib, "scale") and hasattr(lib, "af_error_string")
    assert load_library(str(path)) is lib
    check_status(lib, 0, "scale")
    with pytest.raises(RuntimeError, match=r"scale: CUDA error 2 \(out of memory\)"):
        check_status(lib, 2, "scale")

    def no_nvcc(*args, **kwargs):
        raise AssertionError("nvcc ran on a cache hit")

    monkeypatch.setattr(build_mod, "_run_nvcc", no_nvcc)
    monkeypatch.setattr(subprocess, "run", no_nvcc)  # not even `nvcc --version`: it is cached
    assert build(KernelBuild.create(source, {"FACTOR": "3"})) == path


@pytest.mark.nvcc
def test_compile_error_reports_nvcc_and_leaves_nothing(source):
    kb = KernelBuild.create(source, {"BROKEN": 1})
    with pytest.raises(BuildError) as info:
        build(kb)
    message = str(info.value)
    assert "broken on purpose" in message and str(source) in message and "'BROKEN': '1'" in message
    assert built_files(cache_dir()) == []


@pytest.mark.nvcc
def test_timeout_kills_nvcc_and_leaves_nothing(source):
    with pytest.raises(BuildError, match="nvcc took more than"):
        build(KernelBuild.create(source), timeout=0.05)
    assert built_files(cache_dir()) == []


@pytest.mark.nvcc
def test_build_many_in_parallel_with_one_failure(source, monkeypatch):
    running, peak, guard = [0], [0], threading.Lock()
    real = build_mod._run_nvcc

    def counting(command, timeout):
        with guard:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return real(command, timeout)
        finally:
            with guard:
                running[0] -= 1

    monkeypatch.setattr(build_mod, "_run_nvcc", counting)
    good = [KernelBuild.create(source, {"FACTOR": f}) for f in (2, 3, 4)]
    broken = KernelBuild.create(source, {"BROKEN": 1})
    results = build_many([*good, broken, good[0]], jobs=4)
    assert list(results) == [*good, broken]
    assert len({results[kb] for kb in good}) == 3 and all(results[kb].is_file() for kb in good)
    assert isinstance(results[broken], BuildError) and "broken on purpose" in str(results[broken])
    assert peak[0] >= 2, "nvcc never ran twice at once"


@pytest.mark.nvcc
def test_lock_of_a_killed_process_does_not_block(source):
    kb = KernelBuild.create(source)
    lock_path = f"{cache_dir() / kb.key()}.so.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import filelock, sys, time; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); "
         "print('locked', flush=True); time.sleep(120)", lock_path],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(filelock.Timeout):
            filelock.FileLock(lock_path, timeout=0.1).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert os.path.exists(lock_path)  # the file stays; the kernel released the flock
    start = time.monotonic()
    assert build(kb).is_file()
    assert time.monotonic() - start < 30


@pytest.mark.nvcc
def test_header_helpers_compile(tmp_path):
    path = tmp_path / "reduce.cu"
    path.write_text(REDUCE_CU)
    lib = load_library(build(KernelBuild.create(path)))
    assert hasattr(lib, "reduce") and hasattr(lib, "af_error_string")


@pytest.mark.gpu
@pytest.mark.nvcc
def test_launch_on_current_stream(source):
    import torch

    lib = load_library(build(KernelBuild.create(source, {"FACTOR": 3}, arch=build_mod.cuda_arch())))
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        status = lib.scale(ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.numel()), build_mod.stream_handle(x.device))
        check_status(lib, status, "scale")
    stream.synchronize()
    assert torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32) * 3)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("threads", [32, 96, 256, 1024])
def test_reductions_reach_every_thread(tmp_path, threads):
    import torch

    path = tmp_path / "reduce.cu"
    path.write_text(REDUCE_CU)
    lib = load_library(build(KernelBuild.create(path)))
    rows = 5
    x = torch.randn(rows, threads, device="cuda") - 3.0  # all-negative rows catch a max identity of 0
    outs = [torch.empty_like(x) for _ in range(4)]
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x, *outs)]
    check_status(lib, lib.reduce(*ptrs, rows, threads, build_mod.stream_handle(x.device)), "reduce")
    sums, maxes, warp_sums, warp_maxes = (t.cpu().double() for t in outs)
    xd, warps = x.cpu().double(), x.cpu().double().view(rows, threads // 32, 32)
    torch.testing.assert_close(sums, xd.sum(1, keepdim=True).expand_as(xd), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(maxes, xd.amax(1, keepdim=True).expand_as(xd), atol=0, rtol=0)
    torch.testing.assert_close(warp_sums, warps.sum(2, keepdim=True).expand_as(warps).reshape(rows, threads),
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(warp_maxes, warps.amax(2, keepdim=True).expand_as(warps).reshape(rows, threads),
                               atol=0, rtol=0)


def test_build_jobs_from_the_environment(monkeypatch):
    monkeypatch.delenv("AUTOFUSE_BUILD_JOBS", raising=False)
    assert build_mod.build_jobs() == (os.cpu_count() or 1)
    monkeypatch.setenv("AUTOFUSE_BUILD_JOBS", "3")
    assert build_mod.build_jobs() == 3
    for bad in ("0", "-2", "two", ""):
        monkeypatch.setenv("AUTOFUSE_BUILD_JOBS", bad)
        with pytest.raises(InputError, match="AUTOFUSE_BUILD_JOBS must be a whole number"):
            build_mod.build_jobs()
