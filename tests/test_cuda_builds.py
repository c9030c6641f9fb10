"""Every kernel source compiles with the local nvcc (-arch=sm_90), and search spaces hold only valid points.

No GPU is needed: CI compiles what the device machine runs. Each CUDA variant builds its default
configuration at an odd shape; cuda_templated also builds a representative spread of its space.
"""

import pathlib
import shutil
import subprocess

import pytest
from helpers import PROBLEMS

from autofuse.core import registry
from autofuse.kernels import gemm_space
from autofuse.kernels.build import BuildError, build_many
from autofuse.kernels.cuda_variant import CudaVariant

ROOT = pathlib.Path(__file__).parents[1]
ODD = (37, 1000, 777)


def cuda_variants():
    return [(p, name, cls) for p in sorted(registry.problems()) for name, cls in sorted(registry.variants(p).items())
            if issubclass(cls, CudaVariant)]


def representative(configs):
    """The default, and the extremes of each parameter that the space offers."""
    chosen = [configs[0]]
    for key in configs[0]:
        for pick in (min, max):
            value = pick(c[key] for c in configs)
            extra = next(c for c in configs if c[key] == value)
            if extra not in chosen:
                chosen.append(extra)
    return chosen


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CUDA_ARCH", "sm_90")


@pytest.mark.nvcc
def test_every_cuda_variant_and_a_spread_of_templated_configs_compile(sm90):
    builds = {}
    for problem, name, cls in cuda_variants():
        shape = dict(zip(registry.get_problem(problem).dims, ODD))
        configs = cls.configs(shape, "cuda")
        for params in representative(configs) if name == "cuda_templated" else configs[:1]:
            builds[cls("fp32", **params).kernel_build("cuda")] = f"{problem}/{name} {params}"
    results = build_many(list(builds))
    failures = {builds[kb]: str(r)[-1500:] for kb, r in results.items() if isinstance(r, BuildError)}
    assert not failures, failures


@pytest.mark.nvcc
def test_no_kernel_library_shares_a_symbol_with_the_others(sm90):
    """Every configuration is its own library, loaded side by side in one process. A GNU-unique
    symbol (a static local of a template function with external linkage) binds to one copy across
    all of them: bf16_table.cuh's fill-once flags were one, and the second configuration's library
    read a table nobody had filled. Each CUDA variant's default build holds none."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils)")
    builds = []
    for problem, _, cls in cuda_variants():
        shape = dict(zip(registry.get_problem(problem).dims, ODD))
        builds.append(cls("fp32", **cls.configs(shape, "cuda")[0]).kernel_build("cuda"))
    for kb, library in build_many(builds).items():
        assert not isinstance(library, BuildError), str(library)[-1500:]
        symbols = subprocess.run([readelf, "-Ws", str(library)], capture_output=True, text=True, check=True).stdout
        unique = [line.split()[-1] for line in symbols.splitlines() if " UNIQUE " in line]
        assert not unique, (kb.source.name, unique[:4])


@pytest.mark.nvcc
def test_every_gemm_bn_epilogue_configuration_compiles(sm90):
    # Batch 2 is offered every strip width and the two-kernel path.
    cls = registry.get_variant("gemm_bn", "cublas_epilogue")
    configs = cls.configs({"batch_size": 2, "in_features": 37, "out_features": 53}, "cuda")
    assert {c["strip_cols"] for c in configs} == {0, 8, 16, 32}
    builds = {cls("fp32", **params).kernel_build("cuda"): str(params) for params in configs}
    failures = {builds[kb]: str(r)[-1500:] for kb, r in build_many(list(builds)).items() if isinstance(r, BuildError)}
    assert not failures, failures


def test_gemm_bn_epilogue_strips_fit_the_shared_memory_they_are_offered():
    cls = registry.get_variant("gemm_bn", "cublas_epilogue")
    for batch in (2, 37, 1024, 1600, 1601, 2048, 6400, 6401, 16384):
        configs = cls.configs({"batch_size": batch, "in_features": 8, "out_features": 8192}, "cuda")
        two_pass = [c for c in configs if c["strip_cols"] == 0]
        assert len(two_pass) == 3 and len(configs) == len({tuple(c.items()) for c in configs}), batch
        for c in configs:
            assert batch * c["strip_cols"] * 4 <= 200 * 1024, (batch, c)
    big = cls.configs({"batch_size": 16384, "in_features": 4096, "out_features": 4096}, "cuda")
    assert big[0]["strip_cols"] == 0  # no strip holds 16384 rows: the two kernels are the default
    small = cls.configs({"batch_size": 1024, "in_features": 8192, "out_features": 8192}, "cuda")
    assert small[0] == {"strip_cols": 16, "block": 512}  # 64 KB strips, 3 resident blocks per SM


def test_every_kernel_source_belongs_to_a_registered_variant():
    used = {cls.source_path().resolve() for _, _, cls in cuda_variants()}
    sources = {p.resolve() for p in (ROOT / "variants").glob("*/csrc/*.cu")}
    assert sources and sources <= used, f"not built by any variant: {sorted(map(str, sources - used))}"


def test_every_builtin_problem_has_every_cuda_kind():
    # The built-ins only: a plugin installed beside autofuse may bring pure-PyTorch problems.
    for problem in PROBLEMS:
        kinds = {cls.kind for _, cls in registry.variants(problem).items()}
        assert {"cuda_naive", "cuda_tiled", "cuda_templated", "cublas_epilogue"} <= kinds, problem


def test_the_blocked_gemm_space_lists_only_valid_points():
    configs = gemm_space.blocked_gemm_configs()
    assert configs[0] == gemm_space.DEFAULT and len(configs) == len({tuple(c.items()) for c in configs})
    for c in configs:
        assert gemm_space.invalid_reason(c) is None
        threads = (c["bm"] // c["tm"]) * (c["bn"] // c["tn"])
        assert threads % 32 == 0 and 64 <= threads <= 1024
        assert c["stages"] * (c["bm"] + c["bn"]) * c["bk"] * 4 <= 48 * 1024
        assert (c["bm"] * c["bk"]) % (c["vec"] * threads) == 0


@pytest.mark.parametrize("config,why", [
    (dict(gemm_space.DEFAULT, tn=4, bn=256), "power of two <= 32"),       # 64 threads share a row
    (dict(gemm_space.DEFAULT, bm=32, bn=32, tm=8, tn=8), "threads per block"),  # 16 threads
    (dict(gemm_space.DEFAULT, bm=256, bn=256, bk=32), "shared memory"),
    (dict(gemm_space.DEFAULT, bm=64, bn=32, bk=8, tm=4, tn=4, vec=4), "split into"),  # 128 threads, 64x8 slice
])
def test_invalid_gemm_configs_say_why(config, why):
    assert why in (gemm_space.invalid_reason(config) or "")


def test_single_pass_configs_fit_the_row():
    single_pass = registry.get_variant("gemm_avgpool_gelu_residual", "single_pass")
    for n_in in (1, 37, 1000, 8192, 8191):
        shape = {"batch_size": 3, "in_features": n_in, "out_features": 5}
        configs = single_pass.configs(shape, "cuda")
        assert configs, n_in
        for c in configs:
            capacity = c["block"] * c["vec"] * c["items"]
            assert capacity >= n_in and (c["vec"] == 1 or n_in % 4 == 0), (n_in, c)
    assert single_pass.configs({"batch_size": 1, "in_features": 1 << 20, "out_features": 1}, "cuda") == []
