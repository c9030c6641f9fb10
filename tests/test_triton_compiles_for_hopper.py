"""Every kernel a ``triton`` variant launches, forward and backward, compiles for Hopper (sm_90), on the CPU.

Running a kernel needs the GPU; compiling it needs only Triton's compiler and the ptxas that
ships with it. So CI catches here what otherwise costs device time: a kernel that no longer
compiles for the GPU (the interpreter runs Python, not Triton's compiler), or a configuration
whose stages and epilogue overflow the 227 KB of shared memory a block may have on an H100. A
knob tried on the device did that (flattened tile loops, ``tl.range(flatten=True)``: 278 KB at
128×256 tiles), and a space that offers such configurations wastes tuning trials on them.

Launches are recorded instead of run: the variant's forward runs on CPU tensors with its kernel
modules swapped for recorders, with and without a gradient needed (the kernels then also store
what the backward reads); then the backward runs on the forward's (unwritten) outputs, its Triton
passes admitted on the CPU, and its launches are recorded too (at fp32 the GEMMs on float16 parts,
``triton_backward``, among them). Each recorded launch is compiled with the types Triton would
give its arguments. Configurations: per precision, the tuner's first, and the largest-footprint
configuration of each operand path, with and without TMA (the backward: the first; its kernels do
not depend on the GEMM's).
"""

import importlib
import re
import sys

import pytest
import torch

from autofuse.core import registry
from autofuse.kernels import autograd
from autofuse.kernels.triton import backward as triton_backward
from autofuse.kernels.triton import host as triton_host
from autofuse.kernels.triton import variant as tv
from autofuse.tuning import batch_classes
from autofuse.tuning.gate import CheckCase, build_case

pytestmark = pytest.mark.skipif(tv.triton_missing() is not None, reason=f"needs triton: {tv.triton_missing()}")

H100_SHARED = 232448  # bytes of shared memory one block may take on an H100 (227 KB)
# (batch, K, N): sizes only pick the compiled code through EVEN_K and TMA. K = 1024 is a multiple of
# every BLOCK_K, as at the default shapes; gemm_bn's K = 1000 compiles the masked K tail (TMA still allowed).
SHAPES = {"matmul_gelu_softmax": (8, 1024, 384), "matmul_clamp_lse_mish": (8, 1024, 384), "gemm_bn": (8, 1000, 384)}


class _Launch:
    def __init__(self, record, fn):
        self.record, self.fn = record, fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.record.append((self.fn, args, kwargs))


class _Recorder:
    """A kernel module whose ``@triton.jit`` functions record their launches instead of running."""

    def __init__(self, name, record):
        self._module, self._record = importlib.import_module(name), record

    def __getattr__(self, name):
        import triton

        value = getattr(self._module, name)
        return _Launch(self._record, value) if isinstance(value, triton.runtime.jit.JITFunction) else value

    def epilogue(self, name):
        return getattr(self._module, name)


def _on_any_device(*tensors, dtypes=(torch.float32,)):
    """``fused_kernels_apply`` without its device check: the backward's Triton passes are recorded on the CPU."""
    return all(t.dtype in dtypes and t.is_contiguous() for t in tensors)


def _recording(monkeypatch) -> list:
    """The list every Triton launch through ``triton_host``'s kernel modules is appended to, from now on."""
    # The kernel modules are imported anew with the interpreter off: another test of this session
    # may have imported them under TRITON_INTERPRET=1, which makes their kernels Python functions.
    # After the test sys.modules holds what it held before (setitem's undo removes a new entry).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    problems = [*SHAPES, "gemm_avgpool_gelu_residual"]  # 51: its backward's Triton passes
    shared = ["autofuse.kernels.triton.gemm", "autofuse.kernels.triton.epilogue"]
    for name in shared + [f"autofuse.variants.{p}.triton_kernels" for p in problems]:
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    record = []
    monkeypatch.setattr(triton_host, "_kernel_module", lambda name: _Recorder(name, record))
    return record


def recorded_launches(monkeypatch, problem, mode, precision, params, grad, backward=False, dtype=torch.float32,
                      batch=None):
    """The launches of the variant's forward, or with ``backward`` those of its backward after it,
    on a model of ``dtype``, at SHAPES' batch or ``batch``."""
    record = _recording(monkeypatch)
    prob = registry.get_problem(problem)
    shape = dict(zip(prob.dims, (batch or SHAPES[problem][0], *SHAPES[problem][1:])))
    model, x = build_case(prob, CheckCase(shape, "randn", 0, False), "cpu", dtype, mode)
    variant = registry.get_variant(problem, "triton")(precision, **params)
    with torch.set_grad_enabled(grad):
        model.requires_grad_(grad)
        out = variant(model, x)
    assert record, f"{problem}: the forward launched no kernel"
    if not backward:
        return record
    for module in (importlib.import_module(f"autofuse.variants.{problem}.gradients"), triton_backward, autograd):
        monkeypatch.setattr(module, "fused_kernels_apply", _on_any_device)
    forward = len(record)
    out.backward(torch.randn_like(out))
    assert len(record) > forward, f"{problem}: the backward launched no Triton kernel"
    return record[forward:]


def compile_for_hopper(fn, args, kwargs):
    """triton.compile of one recorded launch for sm_90, its arguments typed as Triton types them (without
    the 16-byte divisibility hints it adds for aligned pointers: they change load widths, not buffers).
    A tuple's items are typed one by one, its None items constants under their index paths, as Triton's
    own launch makes them (``persistent_gemm``'s epilogue arguments). An int equal to 1 is a constant,
    as Triton's launch specializes it: at batch 1, M. A kernel may then fold a mask away and meet a
    compiler pass the general case does not (Triton 3.6's thread-locality pass failed an assertion on
    22's finish inside the launch at M = 1, a bfloat16 model, on the H200)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constants = {}, {}
    for param in fn.params:
        value = values.get(param.name, param.default)
        kind = "constexpr" if param.is_constexpr or value is None else mangle_type(value, not param.do_not_specialize)
        if kind == "constexpr":
            signature[param.name], constants[param.name] = "constexpr", value
        else:
            signature[param.name] = kind
            if isinstance(value, tuple):
                constants.update(_constant_items(value, signature[param.name], (param.num,)))
    return triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)


def _constant_items(value, types, path):
    """(index path, item) of each item of a tuple argument that Triton makes a constant (None)."""
    for i, (item, ty) in enumerate(zip(value, types)):
        if isinstance(ty, tuple):
            yield from _constant_items(item, ty, (*path, i))
        elif ty == "constexpr":
            yield (*path, i), item


def configurations(problem, precision):
    """The tuner's first configuration, and per TMA choice the one whose stages take the most shared memory."""
    cls = registry.get_variant(problem, "triton")
    prob = registry.get_problem(problem)
    configs = cls.configs_for(dict(zip(prob.dims, SHAPES[problem])), "cuda", precision)

    chosen = [configs[0]]
    for tma in (True, False):
        mine = [c for c in configs if c["tma"] == tma]
        if mine:
            chosen.append(max(mine, key=tv.stage_bytes))
    return chosen


CASES = [(p, m) for p in SHAPES for m in (("train", "eval") if p == "gemm_bn" else ("train",))]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("problem,mode", CASES)
def test_every_forward_kernel_compiles_for_hopper_within_its_shared_memory(monkeypatch, problem, mode, precision):
    compiled = {}
    for params in configurations(problem, precision):
        for grad in (False, True):
            for fn, args, kwargs in recorded_launches(monkeypatch, problem, mode, precision, params, grad):
                kernel = compile_for_hopper(fn, args, dict(kwargs))
                compiled[(fn.__name__, repr(sorted(params.items())), grad)] = kernel.metadata.shared
                assert kernel.metadata.shared <= H100_SHARED, (
                    f"{fn.__name__} at {params} (gradient {grad}): {kernel.metadata.shared} bytes of shared memory, "
                    f"an H100 block has {H100_SHARED}")
    names = {name for name, _, _ in compiled}
    assert "persistent_gemm" in names, names  # the GEMM itself was among them, through the shared main loop


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("problem,mode", CASES)
def test_every_backward_kernel_compiles_for_hopper(monkeypatch, problem, mode, precision):
    names = set()
    for fn, args, kwargs in recorded_launches(monkeypatch, problem, mode, precision,
                                              configurations(problem, precision)[0], True, backward=True):
        kernel = compile_for_hopper(fn, args, dict(kwargs))
        assert kernel.metadata.shared <= H100_SHARED, f"{fn.__name__}: {kernel.metadata.shared} bytes of shared memory"
        names.add(fn.__name__)
    assert names, problem
    if (problem, mode) == ("gemm_bn", "eval"):
        assert {"eval_grad_sums", "eval_param_grads"} <= names, names
    if problem in ("matmul_gelu_softmax", "matmul_clamp_lse_mish"):  # the bias's gradient from the partial sums
        assert "column_sums" in names, names
    if precision == "fp32":  # split_fp16 (the first configuration) multiplies its backward on float16 parts
        assert {"persistent_gemm", "fp16_col_parts"} <= names, names  # dW: x does not require grad here


@pytest.mark.parametrize("problem,mode", CASES)
def test_a_bfloat16_models_kernels_compile_for_hopper(monkeypatch, problem, mode):
    """A bfloat16 model's forward under bf16 (its own epilogue branches: gemm_bn's and 22's rounding
    as the reference stores tensors), with and without a gradient, at the tuner's first configuration."""
    params = configurations(problem, "bf16")[0]
    names = set()
    for grad in (False, True):
        for fn, args, kwargs in recorded_launches(monkeypatch, problem, mode, "bf16", params, grad,
                                                  dtype=torch.bfloat16):
            kernel = compile_for_hopper(fn, args, dict(kwargs))
            assert kernel.metadata.shared <= H100_SHARED, f"{fn.__name__}: {kernel.metadata.shared} bytes"
            names.add(fn.__name__)
    assert "persistent_gemm" in names, names


@pytest.mark.parametrize("batch", [2, 1, 8])
@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"])
def test_a_bfloat16_models_backward_from_cublas_logits_compiles_for_hopper(monkeypatch, problem, batch):
    """cublas_epilogue's backward of a bfloat16 model: the Triton passes on cuBLAS's bfloat16
    logits (99's also of a float32 model's, whose bias is added as they are read; 22's z from them
    too, ``clamp_lse_rows``; gemm_bn's training, its statistics from them, in the same pass as its
    gradient sums), at the smallest batch (M a constant) and 8."""
    if batch == (1 if problem == "gemm_bn" else 2):
        pytest.skip("the smallest batch is 2 for gemm_bn's training, 1 for the others")
    record = _recording(monkeypatch)
    gradients = importlib.import_module(f"autofuse.variants.{problem}.gradients")
    for module in (gradients, autograd):
        monkeypatch.setattr(module, "fused_kernels_apply", _on_any_device)
    n_in, n_out = SHAPES[problem][1:]
    x, w, b = (torch.randn(*s).bfloat16() for s in ((batch, n_in), (n_out, n_in), (n_out,)))
    y, needs = torch.nn.functional.linear(x, w, b), (True, True, True)
    if problem == "matmul_gelu_softmax":
        gradients.backward((x, w, b, y, None, torch.softmax(y, dim=1)), torch.randn_like(y), needs, "bf16")
        # a float32 model's: bf16 logits without the float32 bias, which the backward adds as it reads them
        out = torch.softmax(y.float() + b.float(), dim=1)
        gradients.backward((x, w, b.float(), y, b.float(), out), torch.randn_like(out), needs, "bf16")
    elif problem == "matmul_clamp_lse_mish":
        gradients.backward((x, w, b, y, None, None), torch.randn(batch, 1).bfloat16(), needs, "bf16", (2.0, -1.0, 1.0))
    else:
        gradients.train_backward((x, w, y, None, None, b, b), torch.randn_like(y), needs * 2, "bf16", 1e-5, None)
    names = set()
    for fn, args, kwargs in record:
        kernel = compile_for_hopper(fn, args, dict(kwargs))
        assert kernel.metadata.shared <= H100_SHARED, f"{fn.__name__}: {kernel.metadata.shared} bytes of shared memory"
        names.add(fn.__name__)
    assert names == {"matmul_gelu_softmax": {"softmax_grad_rows", "gelu_softmax_backward", "column_sums"},
                     "matmul_clamp_lse_mish": {"clamp_lse_rows", "clamp_lse_backward", "column_sums"},
                     "gemm_bn": {"column_grad_stats", "bn_grad_coefficients", "bn_backward"}}[problem], names


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_bn_eval_with_a_gradient_on_cublas_z_compiles_for_hopper(monkeypatch, dtype, batch):
    """cublas_epilogue's eval mode with a gradient, a float32 model's and a bfloat16 model's: k,
    shift and r (``eval_terms``), the output from cuBLAS's z (``eval_apply``, a bfloat16 model's
    rounded once), and the backward's two launches, at batch 1 (M a constant) and 8."""
    record = _recording(monkeypatch)
    gradients = importlib.import_module("autofuse.variants.gemm_bn.gradients")
    monkeypatch.setattr(gradients, "fused_kernels_apply", _on_any_device)
    n_in, n_out = SHAPES["gemm_bn"][1:]
    x, w = torch.randn(batch, n_in).to(dtype), torch.randn(n_out, n_in).to(dtype)
    bias, scale, gamma, beta, mean = (torch.randn(n_out).to(dtype) for _ in range(5))
    var = (torch.rand(n_out) + 0.5).to(dtype)
    k, shift, r = gradients.eval_terms(bias, scale, gamma, beta, mean, var, 1e-5, torch.float32)
    z = torch.nn.functional.linear(x, w)
    out = gradients.eval_apply(z, k, shift, dtype)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    gradients.eval_backward((x, w, z, k, r, bias, scale, gamma, mean), torch.randn_like(out), (True,) * 6, precision)
    names = set()
    for fn, args, kwargs in record:
        kernel = compile_for_hopper(fn, args, dict(kwargs))
        assert kernel.metadata.shared <= H100_SHARED, f"{fn.__name__}: {kernel.metadata.shared} bytes of shared memory"
        names.add(fn.__name__)
    assert names == {"eval_terms", "eval_apply", "eval_grad_sums", "eval_param_grads"}, names


@pytest.mark.parametrize("batch", [1, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_avgpool_backward_compiles_for_hopper(monkeypatch, dtype, batch):
    """51's two backward passes (its forwards are CUDA), a float32 model's and a bfloat16 model's
    (dW, db and dsubtract rounded to bfloat16 as stored), every gradient asked for, with the
    forward's r saved and without, at batch 1 (M a constant) and 37."""
    record = _recording(monkeypatch)
    gradients = importlib.import_module("autofuse.variants.gemm_avgpool_gelu_residual.gradients")
    x, grad = torch.randn(batch, 96).to(dtype), torch.randn(batch, 96).to(dtype)
    w_mean, offset = torch.randn(96), torch.tensor(0.3)
    for r in (torch.addmv(offset, x.float(), w_mean), None):
        gradients.fused_backward(x, w_mean, offset, r, grad, (True,) * 4, 80)
    names = set()
    for fn, args, kwargs in record:
        kernel = compile_for_hopper(fn, args, dict(kwargs))
        assert kernel.metadata.shared <= H100_SHARED, f"{fn.__name__}: {kernel.metadata.shared} bytes of shared memory"
        names.add(fn.__name__)
    assert names == {"row_gradients", "weight_gradient"}, names


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("tf32", torch.float32),
                                             ("bf16", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("problem,mode", CASES)
@pytest.mark.parametrize("smallest", [False, True])
def test_the_small_batch_tiles_compile_for_hopper(monkeypatch, problem, mode, precision, dtype, smallest):
    """The batch classes' first small-tile seeds (16 rows, 4 warps: tl.dot's smallest M; k-slices up to
    256) compile within Hopper's shared memory, with the epilogue's reductions over 64- and 32-column
    tiles; 22's and 99's with their finish inside the launch too (their seeds hold each tile twice).
    At SHAPES' batch and at the mode's smallest (1, M a constant; gemm_bn's training 2), for float32
    and bfloat16 models."""
    prob = registry.get_problem(problem)
    batch = batch_classes.smallest_batch(prob, mode) if smallest else SHAPES[problem][0]
    shape = dict(zip(prob.dims, (batch, *SHAPES[problem][1:])))
    seeds = registry.get_variant(problem, "triton").small_batch_seeds(shape, "cuda", precision, tv.DEFAULTS[precision])
    tiles = list(dict.fromkeys((c["block_m"], c["block_n"]) for c in seeds))
    assert tiles[:2] == [(16, 64), (16, 32)], seeds
    first_two = [c for c in seeds if (c["block_m"], c["block_n"]) in tiles[:2]]
    if registry.get_variant(problem, "triton").finishes_inside:  # each tile twice, the finish inside first at few rows
        first = shape[prob.batch_dim] <= tv.FINISH_INSIDE_BATCH
        assert [c.get("finish_inside", False) for c in first_two] == [first, not first] * 2, first_two
    for params in first_two:
        for fn, args, kwargs in recorded_launches(monkeypatch, problem, mode, precision, params, False, dtype=dtype,
                                                  batch=batch):
            kernel = compile_for_hopper(fn, args, dict(kwargs))
            assert kernel.metadata.shared <= H100_SHARED, f"{fn.__name__} at {params}: {kernel.metadata.shared} bytes"


def test_the_fp32_backwards_range_checked_gemms_compile_for_hopper(monkeypatch):
    """dx and dW with their range check (``triton_backward.Fp16Gemms``): dy's checked rows, W's
    columns by the count rule, the columns of dy and x by weights, their flags merged, and both GEMMs
    with the exact path (inline on a persistent grid, else a second launch) reading dy, Wᵀ and xᵀ
    through strides, at the tuner's first fp32 configuration, with TMA and without (K = 1000 and
    37: no TMA for dW)."""
    from autofuse.kernels.autograd import GemmGrad

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name in ("autofuse.kernels.triton.gemm", "autofuse.kernels.triton.epilogue"):
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    record = []
    monkeypatch.setattr(triton_host, "_kernel_module", lambda name: _Recorder(name, record))
    monkeypatch.setattr(triton_backward, "fused_kernels_apply", _on_any_device)
    params = configurations("gemm_bn", "fp32")[0]
    for batch in (64, 37):
        dy, x, w = torch.randn(batch, 1000), torch.randn(batch, 768), torch.randn(1000, 768)
        triton_backward.Fp16Gemms(params)(GemmGrad(dy, None, None), x, w, "fp32", True, True, torch.float32)
    names, exact_passes = set(), 0
    for fn, args, kwargs in record:
        kernel = compile_for_hopper(fn, args, dict(kwargs))
        assert kernel.metadata.shared <= H100_SHARED, f"{fn.__name__}: {kernel.metadata.shared} bytes of shared memory"
        names.add(fn.__name__)
        if fn.__name__ == "persistent_gemm" and (kwargs.get("EXACT_PASS") or kwargs.get("EXACT_INLINE")):
            exact_passes += 1
            assert exact_slices_summed_apart(kernel.asm["ttir"])
    assert names == {"fp16_row_parts", "column_max", "fp16_col_parts", "column_flags", "persistent_gemm"}, names
    assert exact_passes == 4, exact_passes  # dx and dW at both batches: each GEMM's flagged tiles


def exact_slices_summed_apart(ttir: str) -> bool:
    """Whether every float32 tt.dot (the exact path's, ``exact_tile``) starts from a zero constant:
    each k-slice summed apart and then added. Triton folds acc + dot(a, b, 0) into dot(a, b, acc), one
    FMA chain over all of K, which erred 3-5x cuBLAS fp32's relative error at K = 1000 (H100)."""
    zeros = set(re.findall(r"(%[\w.]+) = arith.constant dense<0.000000e\+00> : tensor<\w+xf32", ttir))
    accumulators = re.findall(r"tt.dot %[\w.]+, %[\w.]+, (%[\w.]+)\b[^\n]*: tensor<\w+xf32> \* tensor<\w+xf32>", ttir)
    assert accumulators, "no float32 tt.dot: the exact path is missing"
    return set(accumulators) <= zeros
