"""On the GPU: every operand path and schedule of the ``triton`` kind through the tuner's gate.

Issue 11's list: batch 1, 37, 1000 and 1025, in all three precisions, train and eval, with and
without gradients (``assert_variant_conforms`` runs every mode and autograd need). K = 1000 is
a multiple of 8 but of no BLOCK_K (TMA, and the masked K tail of the pointer loads); K = 1004
is not a multiple of 8 (no TMA: the pointer path alone); N = 777 and 1025 leave partial column
tiles, batch 1025 a row tile of one. Each configuration is the first valid one of its operand
path, persistence and TMA choice, so the tile sizes are the defaults the tuner starts from.

At tf32 batch 1 is left out: there cuBLAS's TF32 mode (the gate's floor) multiplies in float32,
and TF32 products on large inputs failed the bound it sets (both operand paths, H100). So those
configurations may serve only the shapes the tuner gated them at (``TritonVariant.only_where_gated``;
tests/test_runtime.py checks the dispatcher keeps to that), and here they are checked from batch 37.
"""

import pytest
import torch
from helpers import relative_error

from autofuse.core import registry
from autofuse.kernels.triton.variant import OPERANDS
from autofuse.testing import assert_variant_conforms

PROBLEMS = ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"]
SIZES = ((1, 1000, 777), (37, 1004, 777), (1000, 1000, 777), (1025, 1000, 1025))


def representative_configs(cls, shape, precision) -> list[dict]:
    """The first valid configuration per (operands, persistent, tma) at this shape and precision."""
    seen, chosen = set(), []
    for params in cls.configs_for(shape, "cuda", precision):
        key = (params["operands"], params["persistent"], params["tma"])
        if key not in seen:
            seen.add(key)
            chosen.append(params)
    return chosen


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_every_triton_operand_path_passes_the_gate_at_odd_batches(problem, precision):
    prob = registry.get_problem(problem)
    cls = registry.get_variant(problem, "triton")
    if cls.admits("cuda", torch.float32, precision, autograd=True) is not None:
        pytest.skip(cls.admits("cuda", torch.float32, precision, autograd=True))
    paths, failures = set(), []
    for sizes in SIZES:
        shape = dict(zip(prob.dims, sizes))
        for params in representative_configs(cls, shape, precision):
            if cls.only_where_gated(params) is not None and sizes[0] < 37:
                continue
            paths.add(params["operands"])
            try:
                assert_variant_conforms(problem, "triton", device="cuda", precision=precision, params=params,
                                        shapes=[shape], seed=sizes[0])  # fmt: skip
            except AssertionError as exc:  # every failing configuration is reported, not only the first
                # A configuration served only where gated (split_trunc) may miss on the
                # ill-conditioned large inputs; on the others it must pass like the rest.
                if cls.params_elsewhere(params) != params and " large " in str(exc):
                    print(f"served only where gated, fails here: {sizes} {params}: {exc}")
                    continue
                failures.append(f"{sizes} {params}: {exc}")
    # Every operand path of this precision was exercised (a path the space lost would go unchecked).
    assert paths == {name for name, (served, *_) in OPERANDS.items() if served == precision}
    assert not failures, "\n".join(failures)


# The fp32 backward's range check (docs/precision.md) at moderate sizes: batch 1, odd sizes (no TMA
# where K = 777 or 37), and a tile-aligned one.
WIDE_SIZES = ((1, 1024, 768), (37, 1000, 777), (512, 1024, 768))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["persistent-tma", "grid-pointers"])
def test_the_fp32_backward_keeps_float32_accuracy_on_wide_rows(schedule):
    """dx and dW of ``Fp16Gemms`` on wide rows of x, W and dy (``wide_gradient_inputs``), M = 1e4 ...
    1e30, their partners zeroed or not: within 2x cuBLAS fp32's relative error against float64, or
    2⁻²² (the split's own accuracy per element) where that is larger. The floor is for cases whose
    norm rests on a few outputs: with W's 4 wide columns on every row at batch 1, dx's error is
    that of 4 sums of 1024 products, and cuBLAS erred 6.0e-8 there against its 1.2-1.9e-7 on the
    other cases, the split 1.3e-7 (H100).

    Until the exact path summed its k-slices apart and the few-terms rule flagged rows carried by a
    few entries, dx erred 2.3-4.8x cuBLAS fp32's on the wide families of W and dy here and dW at
    batch 1 2.4-6.5x (H100). Without the range check dx and dW erred 0.2-1
    (tests/interpreted/check_triton.py, wide_gradients)."""
    import itertools

    from autofuse.core.precision import math_mode
    from autofuse.kernels.autograd import GemmGrad
    from autofuse.kernels.triton.backward import Fp16Gemms
    from autofuse.kernels.triton.variant import DEFAULTS
    from autofuse.testing import wide_gradient_inputs

    params = DEFAULTS["fp32"] if schedule == "persistent-tma" else {**DEFAULTS["fp32"], "tma": False,
                                                                     "persistent": False}
    gemms, failures = Fp16Gemms(params), []
    for (m, n, k), side, span, ratio, zeroed in itertools.product(WIDE_SIZES, ("x", "W", "dy"), ("two", "all"),
                                                                  (1e4, 1e8, 1e12, 1e30), (True, False)):
        if m == 1 and span == "two":
            continue
        generator = torch.Generator().manual_seed(m + n)
        dy, x, w = (t.cuda() for t in wide_gradient_inputs(m, n, k, side, span, ratio, zeroed, generator))
        dx, dw = gemms(GemmGrad(dy, None, None), x, w, "fp32", True, True, torch.float32)
        for name, got, a, b in (("dx", dx, dy, w), ("dW", dw, dy.t(), x)):
            exact = a.double() @ b.double()
            if exact.norm() == 0:
                continue
            with math_mode("ieee"):
                floor = relative_error(a @ b, exact)
            error = relative_error(got, exact)
            if not error <= max(2 * floor, 2.0 ** -22):
                failures.append(f"{(m, n, k)} {side} rows ({span}) x{ratio:.0e} zeroed={zeroed}: {name} {error:.3g} "
                                f"> 2x cuBLAS fp32's {floor:.3g} and 2^-22")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_the_fp32_backwards_range_check_leaves_ordinary_inputs_unflagged():
    """No row or column flagged at 1024 × 4096² on rand, randn and large inputs (the fast path)."""
    from autofuse.kernels.triton import backward

    generator = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 4096, generator=generator) / 64).cuda()
    for name, scale, draw in (("rand", 1, torch.rand), ("randn", 1, torch.randn), ("large", 100, torch.randn)):
        dy, x = ((scale * draw(1024, 4096, generator=generator)).cuda() for _ in range(2))
        operands = (*backward.dx_operands(dy, backward.weight_columns(w)), *backward.dw_operands(dy, x))
        flagged = [int((op[2] < 0).sum()) for op in operands]
        assert flagged == [0, 0, 0, 0], f"{name}: flagged dy rows, W columns, dy columns, x columns: {flagged}"


@pytest.mark.gpu
@pytest.mark.parametrize("problem", PROBLEMS)
def test_the_gates_wide_case_passes_the_fp32_triton_backward(problem):
    """The tuner's wide case, gradients included (``Problem.quiet_wide_cotangent``), at fp32."""
    from autofuse.kernels.triton.variant import DEFAULTS
    from autofuse.tuning.gate import CheckCase, check_variant

    prob = registry.get_problem(problem)
    variant = registry.get_variant(problem, "triton")("fp32", **DEFAULTS["fp32"])
    for batch in (37, 512):
        shape = dict(zip(prob.dims, (batch, 1024, 768)))
        cases = [CheckCase(shape, "rand", 5, False), CheckCase(shape, "wide", 5, True)]
        for mode in ("train", "eval") if prob.mode_sensitive else ("train",):
            result = check_variant(variant, prob, cases, "cuda", autograd=True, mode=mode)
            assert result.ok, f"{problem} {shape} {mode}: {result.reason}"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32", "tf32"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_x_in_whole_row_tiles_changes_no_bit(problem, precision, monkeypatch):
    """x's operand pass writes whole TMA row tiles (``host._WHOLE_TILES``: a box past x's rows
    slowed the GEMM). bf16's cast is torch's bfloat16 bit for bit, float32 denormals included (the
    interpreter flushes them); and the forward at 37 rows on a 64-row tile (gemm_bn's training
    statistics too) is the one that descriptors of x's rows alone give, whose boxes the copy engine
    fills past the rows with zeros."""
    from autofuse.kernels.triton import host
    from autofuse.tuning.gate import CheckCase, build_case

    if precision == "bf16":
        x = torch.randn(37, 1000, device="cuda") * torch.logspace(-44, 38, 1000, device="cuda")
        got = host.bfloat16_whole_tiles(x, 64)
        assert got.shape == x.shape and getattr(got, host._WHOLE_TILES).shape == (64, 1000)
        assert torch.equal(got.view(torch.int16), x.bfloat16().view(torch.int16))
        assert (x.abs() < torch.finfo(torch.float32).tiny).any() and (got != 0).any()
    prob = registry.get_problem(problem)
    operands = {"bf16": "cast_pass", "fp32": "split_fp16", "tf32": "scaled_fp16"}[precision]
    params = {"block_m": 64, "block_n": 64, "block_k": 128, "stages": 3, "warps": 4, "group_m": 8,
              "persistent": False, "tma": True, "operands": operands}
    real_descriptors, outs = host.descriptors, []
    for views_alone in (False, True):
        if views_alone:
            monkeypatch.setattr(host, "descriptors", lambda tensors, rows, block_k: real_descriptors(
                [t if t is None else t[:] for t in tensors], rows, block_k))
        model, x = build_case(prob, CheckCase(dict(zip(prob.dims, (37, 1000, 777))), "randn", 3, False), "cuda",
                              torch.float32, "train")
        variant = registry.get_variant(problem, "triton")(precision, **params)
        with torch.no_grad():
            outs.append([variant(model, x)] + [b.clone() for b in model.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.gpu
@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.float32),
                                             ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("problem", ["matmul_clamp_lse_mish", "matmul_gelu_softmax"])
def test_a_finish_inside_the_gemms_launch_passes_the_gate_and_serves_graphs_and_streams(problem, precision, dtype):
    """The small-batch seed with the finish inside the GEMM's launch (``finish_inside``: the last
    program to arrive merges the rows) passes the gate at batch 1 and 37 without a gradient (the
    seeds serve forward keys; a call that keeps what a backward reads finishes apart); its output is the
    two-launch call's up to the order of a sum (its merge steps are sized apart); and it is the
    same bit for bit called plainly, replayed from a CUDA graph (which holds a counter of its own)
    and called on two streams at once, every counter back at 0 afterwards."""
    from autofuse.testing import conformance_cases
    from autofuse.tuning.gate import CheckCase, build_case, check_variant

    prob = registry.get_problem(problem)
    cls = registry.get_variant(problem, "triton")
    for sizes in ((1, 1000, 777), (37, 1004, 777), (5, 8192, 8192)):
        shape = dict(zip(prob.dims, sizes))
        inside = next(c for c in cls.small_batch_seeds(shape, "cuda", precision, {}) if c.get("finish_inside"))
        apart = {k: v for k, v in inside.items() if k != "finish_inside"}
        if sizes[0] != 5:
            check = check_variant(cls(precision, **inside), prob, conformance_cases(problem, 0, [shape]), "cuda",
                                  dtype=dtype, mode="train")
            assert check.ok, f"{shape} {inside}: {check.reason}"
        model, x = build_case(prob, CheckCase(shape, "randn", 9, False), "cuda", dtype, "train")
        one = cls(precision, **inside)
        with torch.no_grad():
            want = one(model, x)
            step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
            torch.testing.assert_close(want, cls(precision, **apart)(model, x), rtol=step, atol=0)
            static_x = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                one(model, static_x)  # warm-up, as torch.cuda.graphs asks
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = one(model, static_x)
            for _ in range(3):
                graph.replay()
                assert torch.equal(static_out, want), (shape, inside, "graph replay")
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]
            for s in streams:
                s.wait_stream(torch.cuda.current_stream())
            outs = []
            for i in range(16):
                with torch.cuda.stream(streams[i % 2]):
                    outs.append(one(model, x))
            for s in streams:
                torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
        assert all(torch.equal(o, want) for o in outs), (shape, inside, "two streams")
        counters = one._arrivals._buffers[x.device]
        assert not counters.any(), counters.nonzero()


@pytest.mark.gpu
@pytest.mark.parametrize("problem", ["matmul_clamp_lse_mish", "matmul_gelu_softmax"])
def test_the_runtimes_graphs_take_no_finish_counter_however_often_a_key_is_captured(problem):
    """A key captured again after each change of the model's state: its graphs (promised to the
    caller's stream, ``autofuse.core.capture``) and their warm-ups (one side stream a device) take
    no counter after the first capture's, every replay is the plain call bit for bit, and every
    counter is back at 0. Each capture took two counters before, for good (256 in all)."""
    from autofuse.serve import graphs
    from autofuse.tuning.gate import CheckCase, build_case

    prob = registry.get_problem(problem)
    cls = registry.get_variant(problem, "triton")
    shape = dict(zip(prob.dims, (1, 1000, 777)))
    inside = next(c for c in cls.small_batch_seeds(shape, "cuda", "bf16", {}) if c.get("finish_inside"))
    model, x = build_case(prob, CheckCase(shape, "randn", 9, False), "cuda", torch.float32, "eval")
    one = cls("bf16", **inside)
    graphed = graphs.GraphedCall.standalone(one, model)
    taken = []
    with torch.no_grad():
        for _ in range(5):
            prob.linear_of(model).weight.mul_(1.001)  # a new state: the graph is let go, then captured again
            want = one(model, x)
            for _ in range(graphs.WARM_CALLS + 3):
                out = graphed(model, x)
            assert graphed.graph is not None and graphed.failed is None, graphed.failed
            assert torch.equal(out, want)
            taken.append(one._arrivals._taken[x.device])
    torch.cuda.synchronize()
    assert len(set(taken)) == 1, f"counters given after each capture: {taken}"
    assert not one._arrivals._buffers[x.device].any()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["triton", "cublas_epilogue"])
@pytest.mark.parametrize("problem,mode", [("matmul_clamp_lse_mish", "train"), ("matmul_gelu_softmax", "train"),
                                          ("gemm_bn", "train"), ("gemm_bn", "eval")])
def test_a_float32_models_bf16_gradients_are_float32_sums_not_bfloat16(problem, mode, variant):
    """The forward keeps x's bfloat16 copy, the operand its GEMM read, for the backward's GEMMs (so
    the backward casts nothing); a float32 model's dx and dW are still cuBLAS's float32 sums of the
    bfloat16 operands, not bfloat16 results that autograd converted after (a rounding, and 0.21 of
    1.13 ms of gemm_bn's step at 2048×8192²)."""
    from autofuse.tuning.gate import CheckCase, build_case

    prob = registry.get_problem(problem)
    cls = registry.get_variant(problem, variant)
    shape = dict(zip(prob.dims, (37, 1000, 777)))
    model, x = build_case(prob, CheckCase(shape, "randn", 9, False), "cuda", torch.float32, mode)
    x.requires_grad_(True)
    out = cls("bf16", **cls.configs_for(shape, "cuda", "bf16")[0])(model, x)
    kept = [t.dtype for t in out.grad_fn.saved_tensors if t is not None and t.shape == x.shape]
    assert kept == [torch.bfloat16], f"x kept as {kept}"
    out.backward(torch.randn_like(out))
    for what, grad in (("dx", x.grad), ("dW", prob.linear_of(model).weight.grad)):
        assert grad.dtype == torch.float32, what
        assert not torch.equal(grad, grad.bfloat16().float()), f"{what}: every element a bfloat16"
