"""CUDA host entry points check their input contracts before any launch (no GPU needed to fail them)."""

import pytest
import torch

from autofuse import InputError
from autofuse.core import registry
from autofuse.kernels.cuda_variant import CudaVariant, bfloat16_model_linear, input_operand, linear_parameters, operand


def test_input_contract_names_expected_and_got():
    with pytest.raises(InputError, match=r"expected a 2-D input \(batch, 8\), got torch.Size\(\[8\]\)"):
        input_operand(torch.rand(8), 8)
    with pytest.raises(InputError, match="expected a CUDA input, got one on cpu"):
        input_operand(torch.rand(2, 8), 8)


def test_operand_contract_names_expected_and_got():
    with pytest.raises(InputError, match="expected float32, got float64"):
        operand(torch.rand(3, dtype=torch.float64), "bias", (3,), torch.device("cpu"))
    with pytest.raises(InputError, match=r"expected shape \(4,\), got \(3,\)"):
        operand(torch.rand(3), "bias", (4,), torch.device("cpu"))
    with pytest.raises(InputError, match="got None"):
        operand(None, "bias", (4,), torch.device("cpu"))
    strided = torch.rand(4, 6)[:, ::2]
    assert operand(strided, "weight", (4, 3), torch.device("cpu")).is_contiguous()  # made contiguous


BFLOAT16_MODELS = {("gemm_avgpool_gelu_residual", "single_pass"), ("gemm_bn", "cublas_epilogue"),
                   ("matmul_gelu_softmax", "cublas_epilogue"), ("matmul_clamp_lse_mish", "cublas_epilogue")}


def test_built_in_cuda_variants_are_fp32_cuda_only_and_all_have_a_backward():
    """float32 only, but 51's single_pass, which reads and writes a bfloat16 model's rows too, and
    the cublas_epilogue variants of gemm_bn, 22 and 99 (a bfloat16 model's forward); the others
    refuse a bfloat16 model naming the dtype and what serves it."""
    for problem in ("gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish"):
        for name, cls in registry.variants(problem).items():
            if issubclass(cls, CudaVariant):
                bf16 = (problem, name) in BFLOAT16_MODELS
                assert cls.dtypes == ((torch.float32, torch.bfloat16) if bf16 else (torch.float32,)), name
                assert cls.devices == ("cuda",) and cls.supports_autograd, name
                assert cls.admits("cpu", torch.float32, "fp32", False) is not None
                if not bf16:
                    assert "not bfloat16 (`autofuse list` shows the variants that serve a bfloat16 model)" in cls.admits(
                        "cuda", torch.bfloat16, "bf16", False)


def test_autofuse_list_says_which_variants_serve_a_bfloat16_model(monkeypatch):
    """What the refusal above points at, whatever this machine lacks (here: nvcc)."""
    from autofuse.core.listing import list_variants
    from autofuse.kernels import build

    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    for problem in ("gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish"):
        listed = {v["name"]: v["bfloat16_model"] for v in list_variants(problem, "cpu")}
        for name, cls in registry.variants(problem).items():
            if issubclass(cls, CudaVariant):
                want = "no" if (problem, name) not in BFLOAT16_MODELS else "yes" if cls.bfloat16_gradients else "forward"
                assert listed[name] == want, (problem, name)
        assert listed["eager"] == "yes" and listed.get("triton", "yes") == "yes"


@pytest.mark.parametrize("problem", ["gemm_bn", "matmul_gelu_softmax", "matmul_clamp_lse_mish"])
def test_cublas_epilogue_serves_a_bfloat16_model_at_bf16_only(problem):
    """With gradients too: each backward takes cuBLAS's bfloat16 logits."""
    cls = registry.get_variant(problem, "cublas_epilogue")
    assert cls.admits("cuda", torch.bfloat16, "bf16", autograd=False) is None
    assert cls.admits("cuda", torch.bfloat16, "bf16", autograd=True) is None
    assert "precision bf16 only" in cls.admits("cuda", torch.bfloat16, "fp32", autograd=False)
    assert cls.admits("cuda", torch.float32, "bf16", autograd=True) is None


def test_single_pass_takes_a_bfloat16_models_gradients_too():
    cls = registry.get_variant("gemm_avgpool_gelu_residual", "single_pass")
    assert cls.admits("cuda", torch.bfloat16, "bf16", autograd=True) is None
    assert "precision bf16 only" in cls.admits("cuda", torch.bfloat16, "tf32", autograd=True)


@pytest.mark.parametrize(("x", "match"), [
    (torch.rand(2, 3, 16, dtype=torch.bfloat16), r"expected a 2-D input \(batch, 16\)"),
    (torch.rand(2, 16, dtype=torch.bfloat16), "expected a CUDA input, got one on cpu"),
])
def test_a_bfloat16_models_linear_names_what_is_wrong_before_any_launch(x, match):
    """Its fast path (the GEMM checking devices and shapes) takes only a bfloat16 CUDA matrix; any
    other input is checked operand by operand (on the GPU: test_bf16_model_gpu.py)."""
    variant = registry.get_variant("matmul_gelu_softmax", "cublas_epilogue")("bf16")
    linear = torch.nn.Linear(16, 8).bfloat16().requires_grad_(False)
    with pytest.raises(InputError, match=match):
        bfloat16_model_linear(variant, x, *linear_parameters(linear), "linear")
    linear.requires_grad_(True)
    with pytest.raises(InputError, match="records no backward"):
        bfloat16_model_linear(variant, torch.rand(2, 16, dtype=torch.bfloat16), *linear_parameters(linear), "linear")
    with torch.no_grad(), pytest.raises(InputError, match=match):
        bfloat16_model_linear(variant, x, *linear_parameters(linear), "linear")


class _FakeLibrary:
    """Records each launch: its arguments and the device current while it ran."""

    def __init__(self, current, status=0):
        self.current, self.status, self.calls = current, status, []

    def af_step(self, *args):
        self.calls.append((args, self.current[0]))
        return self.status


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's device and stream as the launch path reads them, with no GPU."""
    import contextlib

    from autofuse.kernels import build

    current = [0]
    guards = []

    @contextlib.contextmanager
    def device(index):
        guards.append(index)
        saved, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = saved

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(build, "stream_handle", lambda index: f"stream of {index}")
    return current, guards


def _variant_with(lib):
    variant = CudaVariant.__new__(CudaVariant)
    variant.problem, variant.name, variant._lib = "p", "v", lib
    return variant


@pytest.mark.parametrize("index, guarded", [(0, []), (None, []), (1, [1])])
def test_a_launch_runs_on_its_device_and_stream_and_guards_only_another_device(fake_cuda, index, guarded):
    current, guards = fake_cuda
    lib = _FakeLibrary(current)
    tensor = torch.zeros(3)
    _variant_with(lib).launch("af_step", tensor, 7, device=torch.device("cuda", index) if index is not None
                              else torch.device("cuda"))
    [(args, ran_on)] = lib.calls
    expected = 0 if index is None else index
    assert args == (tensor.data_ptr(), 7, f"stream of {expected}") and ran_on == expected
    assert guards == guarded and current[0] == 0  # the caller's device is restored


def test_a_launch_that_returns_an_error_status_raises_naming_it(fake_cuda, monkeypatch):
    from autofuse.kernels import build

    def check_status(lib, status, what):  # the real one asks the library for the error's name
        raise RuntimeError(f"{what}: CUDA error {status}")

    monkeypatch.setattr(build, "check_status", check_status)
    with pytest.raises(RuntimeError, match="p/v af_step: CUDA error 700"):
        _variant_with(_FakeLibrary(fake_cuda[0], status=700)).launch("af_step", device=torch.device("cuda", 0))
