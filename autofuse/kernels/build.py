"""Compile plain CUDA translation units into shared libraries, one per configuration.

Kernel sources include ``autofuse.cuh`` and no torch headers, and export ``extern "C"``
launchers that take raw pointers, ints, floats and a ``cudaStream_t``. On the H200 machine
``nvcc -shared`` of such a file took ~1 s, against ~40 s for a ``load_inline`` extension
that includes torch headers (DESIGN.md), so each configuration of a variant (its template
arguments as ``-D`` defines) is its own library, built in parallel into a persistent cache
under ``$AUTOFUSE_HOME/build``. A library's name is a hash of everything that changes the
binary, so a cache hit needs no nvcc at all and an edited header never reuses a stale build.

Libraries are loaded with ctypes and launched on torch's current stream
(:func:`stream_handle`). nvcc links the CUDA runtime statically by default, so a library
loads on a machine with no GPU or driver; only its launches fail there.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence

import filelock

from autofuse.errors import BuildError, InputError

CSRC_DIR = pathlib.Path(__file__).resolve().parent / "csrc"

# No --use_fast_math: it swaps erff/expf for approximations, and fp32 variants must match
# the float64 reference as closely as eager PyTorch does. -lineinfo costs nothing at run
# time and lets ncu and compute-sanitizer point at source lines.
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")

_ARCH_RE = re.compile(r"sm_\d+[a-z]?")
_DEFINE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STDERR_LINES = 40
_HEADER_SUFFIXES = (".cuh", ".h")


def find_nvcc() -> str | None:
    """The nvcc to use: $AUTOFUSE_NVCC, $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, PATH."""
    explicit = os.environ.get("AUTOFUSE_NVCC")
    if explicit:  # asked for by name: a wrong path must fail loudly, not fall back silently
        if not _is_executable(explicit):
            raise BuildError(f"AUTOFUSE_NVCC={explicit!r} is not an executable file")
        return explicit
    candidates = [os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")] if os.environ.get("CUDA_HOME") else []
    candidates.append("/usr/local/cuda/bin/nvcc")
    for candidate in candidates:
        if _is_executable(candidate):
            return candidate
    return shutil.which("nvcc")


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


@functools.cache
def nvcc_version(nvcc: str) -> str:
    """nvcc's release and build lines, e.g. "release 13.0, V13.0.88; Build cuda_13.0.r13.0/...".

    Part of every build key: a compiler upgrade must not reuse libraries built by the old one.
    """
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"`{nvcc} --version` failed: {error}") from error
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    release = [line[line.index("release"):] for line in lines if "release" in line]
    return "; ".join(release + lines[-1:]) if release else " | ".join(lines)


def cuda_arch(device="cuda") -> str:
    """The target, e.g. "sm_90", of `device`; $AUTOFUSE_CUDA_ARCH overrides (builds with no GPU)."""
    arch = os.environ.get("AUTOFUSE_CUDA_ARCH")
    if arch:
        return _checked_arch(arch, "AUTOFUSE_CUDA_ARCH")
    import torch

    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (AssertionError, RuntimeError) as error:  # torch raises AssertionError without CUDA
        raise BuildError(
            f"cannot read the compute capability of {device!r} ({error}); "
            "set AUTOFUSE_CUDA_ARCH, e.g. AUTOFUSE_CUDA_ARCH=sm_90, to build without a GPU"
        ) from error
    return f"sm_{major}{minor}"


def _checked_arch(arch: str, what: str) -> str:
    if not _ARCH_RE.fullmatch(arch):
        raise ValueError(f"{what} must look like 'sm_90' or 'sm_90a', got {arch!r}")
    return arch


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One configuration of one kernel source: what nvcc needs, and the key of its library."""

    source: pathlib.Path
    defines: tuple[tuple[str, str], ...] = ()
    arch: str = "sm_90"
    flags: tuple[str, ...] = ()

    def __post_init__(self):
        _checked_arch(self.arch, "KernelBuild.arch")
        for name, value in self.defines:
            if not _DEFINE_RE.fullmatch(name) or not isinstance(value, str):
                raise ValueError(f"defines must be (C identifier, str) pairs, got {(name, value)!r}")

    @classmethod
    def create(cls, source, defines: Mapping[str, object] | None = None, arch=None, flags=()) -> KernelBuild:
        """Normalise: sorted defines with str values (order must not change the key), default arch."""
        pairs = tuple(sorted((str(name), str(value)) for name, value in (defines or {}).items()))
        return cls(pathlib.Path(source), pairs, arch or cuda_arch(), tuple(flags))

    def key(self) -> str:
        """A hash of all that changes the binary; the source's path and mtimes are not part of it."""
        digest = hashlib.sha256()
        _feed(digest, "source", _read_source(self.source))
        for header in _headers(self.source.parent, CSRC_DIR):
            _feed(digest, f"header {header.name}", header.read_bytes())
        _feed(digest, "defines", repr(self.defines))
        _feed(digest, "arch", self.arch)
        _feed(digest, "flags", repr((self.flags, BASE_FLAGS)))
        _feed(digest, "nvcc", _compiler_id())
        _feed(digest, "torch", _torch_version())
        return digest.hexdigest()[:24]

    def command(self, nvcc: str, output: pathlib.Path) -> list[str]:
        number = self.arch[len("sm_"):]
        return [
            nvcc, *BASE_FLAGS, f"-gencode=arch=compute_{number},code=sm_{number}",
            "-I", str(CSRC_DIR), "-I", str(self.source.parent),
            *[f"-D{name}={value}" for name, value in self.defines],
            *self.flags, "-o", str(output), str(self.source),
        ]  # fmt: skip


def _feed(digest, label: str, data: str | bytes) -> None:
    """Length-prefixed, so no two different inputs can concatenate to the same bytes."""
    data = data.encode() if isinstance(data, str) else data
    digest.update(f"{label}\0{len(data)}\0".encode())
    digest.update(data)


def _read_source(source: pathlib.Path) -> bytes:
    try:
        return source.read_bytes()
    except OSError as error:
        raise BuildError(f"cannot read kernel source {source}: {error}") from error


def _headers(*directories: pathlib.Path) -> list[pathlib.Path]:
    """Headers a source may include: its own directory's, then CSRC_DIR's, each sorted by name."""
    found: dict[pathlib.Path, None] = {}
    for directory in directories:
        for path in sorted(directory.iterdir(), key=lambda p: p.name) if directory.is_dir() else ():
            if path.suffix in _HEADER_SUFFIXES and path.is_file():
                found[path.resolve()] = None
    return list(found)


def _compiler_id() -> str:
    nvcc = find_nvcc()
    return nvcc_version(nvcc) if nvcc else "no nvcc"


def _torch_version() -> str:
    import torch

    return torch.__version__


def cache_dir() -> pathlib.Path:
    home = os.environ.get("AUTOFUSE_HOME") or "~/.cache/autofuse"
    path = pathlib.Path(home).expanduser() / "build"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(kb: KernelBuild, timeout: float = 300.0) -> pathlib.Path:
    """The cached library of `kb`, compiling it first if no process has yet."""
    path = cache_dir() / f"{kb.key()}.so"
    if path.exists():
        return path
    nvcc = _require_nvcc()
    # filelock's FileLock is flock()-based on Linux: the kernel drops the lock when its
    # holder dies, so a lock file left by a killed tuner never blocks the next run.
    lock = filelock.FileLock(f"{path}.lock", timeout=timeout + 60.0)
    try:
        with lock:
            if not path.exists():  # another process may have built it while we waited
                _compile(kb, nvcc, path, timeout)
    except filelock.Timeout as error:
        held = f"another process held {lock.lock_file} for over {lock.timeout:.0f} s"
        raise BuildError(f"{held} while building {kb.source}") from error
    return path


def _require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(
            "nvcc (the CUDA compiler) was not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin; "
            "point to it with AUTOFUSE_NVCC=/path/to/nvcc or CUDA_HOME=/path/to/cuda"
        )
    return nvcc


def _compile(kb: KernelBuild, nvcc: str, path: pathlib.Path, timeout: float) -> None:
    """Compile into a temporary name, then rename: a reader never loads half a library."""
    temp = path.with_name(f"{path.stem}.{os.getpid()}-{threading.get_ident()}.tmp.so")
    command = kb.command(nvcc, temp)
    try:
        result = _run_nvcc(command, timeout)
        if result.returncode != 0:
            raise BuildError(_failure_message(kb, command, result))
        os.replace(temp, path)
    except subprocess.TimeoutExpired as error:
        raise BuildError(f"nvcc took more than {timeout:g} s on {kb.source} with defines {dict(kb.defines)}") from error
    except OSError as error:
        raise BuildError(f"running nvcc on {kb.source} failed: {error}") from error
    finally:
        temp.unlink(missing_ok=True)


def _run_nvcc(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run nvcc in its own process group: on timeout or interrupt, kill cicc and ptxas too."""
    pipe = subprocess.PIPE
    with subprocess.Popen(command, stdout=pipe, stderr=pipe, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _failure_message(kb: KernelBuild, command: list[str], result: subprocess.CompletedProcess) -> str:
    output = (result.stderr or "") + (result.stdout or "")
    tail = "\n".join(output.rstrip().splitlines()[-_STDERR_LINES:])
    return (
        f"nvcc failed (exit {result.returncode}) on {kb.source} with defines {dict(kb.defines)}:\n"
        f"{tail}\ncommand: {shlex.join(command)}"
    )


def build_many(builds: Sequence[KernelBuild], jobs: int | None = None) -> dict[KernelBuild, pathlib.Path | BuildError]:
    """Build in parallel, ``jobs`` nvcc at once (default: ``build_jobs()``); a failed build is
    its BuildError as a value, never an abort of the rest."""
    if jobs is not None and jobs < 1:
        raise ValueError(f"`jobs >= 1` must hold, got {jobs=}")
    unique = list(dict.fromkeys(builds))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or build_jobs()) as pool:
        futures = {kb: pool.submit(_build_or_error, kb) for kb in unique}
    return {kb: future.result() for kb, future in futures.items()}


def build_jobs() -> int:
    """How many nvcc run at once: $AUTOFUSE_BUILD_JOBS, else one per core. ``--workers N``
    sets it to the cores / N in each worker, so N workers do not oversubscribe the host N times."""
    value = os.environ.get("AUTOFUSE_BUILD_JOBS")
    if value is None:
        return os.cpu_count() or 1
    if not value.strip().isdigit() or int(value) < 1:
        raise InputError(f"AUTOFUSE_BUILD_JOBS must be a whole number >= 1, got {value!r}")
    return int(value)


def _build_or_error(kb: KernelBuild) -> pathlib.Path | BuildError:
    try:
        return build(kb)
    except BuildError as error:
        return error


def load_library(path) -> ctypes.CDLL:
    """The loaded library at `path`; loaded once per path, as dlopen would share it anyway."""
    return _load(str(path))


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as error:
        raise BuildError(f"cannot load the kernel library {path}: {error}") from error
    if hasattr(lib, "af_error_string"):
        _declare_error_string(lib)
    return lib


def _declare_error_string(lib: ctypes.CDLL):
    function = lib.af_error_string
    function.restype, function.argtypes = ctypes.c_char_p, [ctypes.c_int]
    return function


def check_status(lib: ctypes.CDLL, status: int, what: str) -> None:
    """Raise if a launcher returned a CUDA error; the worker recognises "CUDA error" in the text."""
    if status != 0:
        name = _declare_error_string(lib)(status)
        raise RuntimeError(f"{what}: CUDA error {status} ({name.decode() if name else 'unknown'})")


def stream_handle(device) -> ctypes.c_void_p:
    """torch's current stream on `device` (a torch.device or an index), as the cudaStream_t a
    launcher takes.

    Read raw, as Triton's and inductor's launchers read it: ``torch.cuda.current_stream``
    builds a ``Stream`` object to read one attribute off it (7.1 µs against 0.9, H100 host).
    A ``c_void_p``, not the int: a launcher called without declared argtypes would get a
    truncated 32-bit int.
    """
    import torch

    index = device if isinstance(device, int) else device.index
    return ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if index is None else index))
