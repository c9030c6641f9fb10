"""Checks of the Triton kernels under Triton's interpreter, run by tests/test_triton_interpreted.py.

TRITON_INTERPRET must be set before triton's kernels are defined, so these run in their own
process (``python check_triton.py CHECK ARGS...``), exit 0 on success and print why otherwise.
Tiles are 16 wide (the interpreter's configuration space), so the small odd shapes below cross
several tiles in every dimension: partial tiles, the K tail, clamped rows and batch 1.
"""

import itertools
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from autofuse.core import registry
from autofuse.kernels import autograd  # noqa: E402
from autofuse.tuning.gate import CheckCase, build_case, check_variant  # noqa: E402

SIZES = ((1, 37, 53), (37, 40, 33))  # batch 1 (BN training skips it: needs 2), odd sizes
CONFIGS = {  # the two schedules and both operand paths
    "persistent-pointers": {"block_m": 16, "block_n": 16, "block_k": 16, "stages": 2, "warps": 4, "group_m": 2,
                            "persistent": True, "tma": False},
    "grid-tma": {"block_m": 32, "block_n": 16, "block_k": 16, "stages": 2, "warps": 4, "group_m": 2,
                 "persistent": False, "tma": True},
}
# How the operands reach the dot, per precision and configuration: every path is run by one of the
# two, the float16 ones by both (pointer loads and TMA).
OPERANDS = {"fp32": (("split_trunc", "split_fp16"), ("split_host", "split_fp16")),
            "tf32": (("round_kernel", "scaled_fp16"), ("round_host", "scaled_fp16")),
            "bf16": (("cast_pass",), ("cast_pass",))}
# What ``gate`` takes besides the precisions: "bf16_model", a bfloat16 model (bfloat16 x,
# parameters and BN statistics) under bf16.
MODELS = {"bf16_model": ("bf16", torch.bfloat16)}


def gate(problem: str, config: str, precisions: str) -> list[str]:
    """The tuner's gate, gradients included, at every mode and distribution."""
    prob = registry.get_problem(problem)
    failures = []
    for name, sizes in itertools.product(precisions.split(","), SIZES):
        precision, dtype = MODELS.get(name, (name, torch.float32))
        for operands in OPERANDS[precision][list(CONFIGS).index(config)]:
            variant = registry.get_variant(problem, "triton")(precision, **CONFIGS[config], operands=operands)
            shape = dict(zip(prob.dims, sizes))
            if variant.params["tma"] and sizes[1] % 8:
                shape[prob.dims[1]] = 40  # TMA needs 16-byte rows
            cases = [CheckCase(shape, d, 11, r) for d, r in (("rand", False), ("randn", True), ("large", True))]
            if precision == "tf32":
                cases = cases[:2]  # see below: large inputs make TF32's error visible against a CPU floor
            for mode in ("train", "eval") if prob.mode_sensitive else ("train",):
                # The CPU has no TF32: plain PyTorch's tf32 result (the gate's floor for ill-conditioned
                # cases) is float32-exact here, while the kernel's operands are rounded to TF32, an
                # error that large inputs and gradients amplify (softmax of logits in the hundreds)
                # past the tolerance. So tf32 is checked on well-conditioned inputs, forward only;
                # the GPU, where the floor is TF32 too, gates all of it.
                result = check_variant(variant, prob, cases, "cpu", dtype=dtype, autograd=precision != "tf32", mode=mode)
                print(problem, name, operands, config, shape, mode, result.ok, f"{result.error:.3g}", flush=True)
                if not result.ok:
                    failures.append(f"{problem} {name} {operands} {config} {shape} {mode}: {result.reason}")
    return failures


def backward_kernels() -> list[str]:
    """Each Triton epilogue backward against its torch formula (float32): dy, dyᵀ and the bias's row
    sums as ``GradLayouts`` asks for them (the sums in the model's dtype), at batch 1 and at sizes
    that end in partial tiles of the 64 × 64 and 64 × 128 blocks both ways (several tiles each way),
    under bf16 dy in bfloat16; 99's and 22's also from a bfloat16 model's logits (cublas_epilogue
    keeps cuBLAS's bfloat16 y), and 22's z from the logits where no forward kept it
    (``clamped_logsumexp``); matmul_clamp_lse_mish's also from the softmax factors its bf16 forward
    saves (float32 ones against the formula from the logits, bfloat16 ones against the same
    formula); and gemm_bn's with z also as its bf16 training saves it (bfloat16, less each row
    tile's mean); then gemm_bn's per-column coefficients from either z, and from z alone (statistics
    taken in the same pass: float32, bfloat16, and far from 0); and gemm_bn's eval mode
    (``_eval_mode``)."""
    from autofuse.variants.gemm_bn import gradients as gbn
    from autofuse.variants.matmul_clamp_lse_mish import gradients as g22
    from autofuse.variants.matmul_gelu_softmax import gradients as g99

    from autofuse.kernels.autograd import GradLayouts
    from autofuse.kernels.triton import host as triton_host

    generator = torch.Generator().manual_seed(5)
    failures = []

    def torch_formula(run):
        """``run()`` with every backward's Triton path switched off (its torch formula instead)."""
        saved = triton_host.fused_kernels_apply
        for module in (g99, g22, gbn):
            module.fused_kernels_apply = lambda *t, **kwargs: False
        try:
            return run()
        finally:
            for module in (g99, g22, gbn):
                module.fused_kernels_apply = saved

    def compare(name, got, want):
        error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
        print(name, f"relative error {error:.3g}", flush=True)
        # bfloat16: its own rounding (2⁻⁹ relative per entry; the interpreter's conversion is not
        # the GPU's round-to-nearest, so not compared bit for bit).
        bound = 1e-5 if got.dtype == torch.float32 else 8e-3
        if got.shape != want.shape or not error < bound:
            failures.append(f"{name}: shape {tuple(got.shape)} (want {tuple(want.shape)}), relative error {error:.3g}")

    layouts = [GradLayouts(True, True, True), GradLayouts(False, True, True), GradLayouts(True, False, False),
               GradLayouts(True, False, True, torch.bfloat16)]
    for m, n in ((1, 53), (130, 150)):
        y, grad = torch.randn(m, n, generator=generator), torch.randn(m, n, generator=generator)
        out = torch.softmax(torch.randn(m, n, generator=generator), dim=1)
        bias = torch.randn(n, generator=generator) * 2
        z = torch.logsumexp(y * 2.0, dim=1, keepdim=True)
        mean = y.mean(0)
        # gemm_bn's z as its training forward saves it: plain, with shift −μ; or less each row
        # tile's mean (16 rows: several tiles, a partial one), in bfloat16, with shift tile mean − μ
        tile_means = torch.stack([tile.mean(0) for tile in y.split(16)])
        y16, shift16 = (y - tile_means[torch.arange(m) // 16]).bfloat16(), tile_means - mean
        # 22's bf16 forward saves q = exp(c − m)·[inside] with m the row's max over 16-column tiles
        q, part_max, z_clamped = g22.softmax_parts(y, 2.0, -1.0, 1.5, 16)
        runs = {
            "gelu_softmax": lambda lay: g99.epilogue_backward(y, out, grad, lay),
            "clamp_lse": lambda lay: g22.epilogue_backward(y, z, grad[:, :1].contiguous(), 2.0, -1.0, 1.5, lay),
            # a bfloat16 model's cuBLAS logits (cublas_epilogue), its output and ∂L/∂out in bfloat16
            "gelu_softmax y16": lambda lay: g99.epilogue_backward(y.bfloat16(), out.bfloat16(), grad.bfloat16(), lay),
            # a float32 model's bf16 cuBLAS logits, the bias its epilogue added left to the backward to add
            "gelu_softmax y16 + bias": lambda lay: g99.epilogue_backward(y.bfloat16(), out, grad, lay, y_bias=bias),
            "clamp_lse y16": lambda lay: g22.epilogue_backward(y.bfloat16(), z, grad[:, :1].bfloat16(), 2.0, -1.0, 1.5,
                                                               lay),
            "clamp_lse from q": lambda lay: g22.epilogue_backward_from_q(q, part_max, z_clamped,
                                                                         grad[:, :1].contiguous(), 2.0, 16, lay),
            "clamp_lse from q16": lambda lay: g22.epilogue_backward_from_q(q.bfloat16(), part_max, z_clamped,
                                                                           grad[:, :1].contiguous(), 2.0, 16, lay),
            "bn_backward": lambda lay: gbn._bn_backward(grad, y, -mean[None], m, mean * 2, mean * 0.5, mean * -3, lay),
            "bn_backward z16": lambda lay: gbn._bn_backward(grad, y16, shift16, 16, mean * 2, mean * 0.5, mean * -3,
                                                            lay),
        }
        MODEL_BF16 = {"gelu_softmax y16", "clamp_lse y16"}  # noqa: N806 - the runs on a bfloat16 model's tensors
        wants = {name: torch_formula(lambda: run(GradLayouts(True, False, True))) for name, run in runs.items()}
        # from float32 q, the formula from the logits themselves
        wants["clamp_lse from q"] = torch_formula(lambda: g22.epilogue_backward(
            y, z_clamped, grad[:, :1].contiguous(), 2.0, -1.0, 1.5, GradLayouts(True, False, True)))
        for (name, run), lay in itertools.product(runs.items(), layouts):
            got, want = run(lay), wants[name]
            case = f"{name} {(m, n)} rows={lay.rows} cols={lay.cols} sums={lay.sums} {str(lay.dtype)[6:]}"
            for part, asked, value, expected in (("dy", lay.rows, got.dy, want.dy),
                                                 ("dyT", lay.cols, got.dy_t, want.dy.t()),
                                                 ("bias", lay.sums, got.bias, want.bias)):
                if (value is not None) != asked:
                    failures.append(f"{case}: {part} {'missing' if value is None else 'not asked for'}")
                elif value is not None:
                    # dy and dyᵀ in the layouts' dtype; the bias's (``column_sums``) in the model's, ∂L/∂out's
                    dtype = lay.dtype if part != "bias" else torch.bfloat16 if name in MODEL_BF16 else torch.float32
                    if value.dtype != dtype:
                        failures.append(f"{case}: {part} is {value.dtype}, want {dtype}")
                    compare(f"{case} {part}", value, expected)
        var = y.var(0, unbiased=False)
        scale, gamma = torch.randn(n, generator=generator), torch.rand(n, generator=generator) + 0.5
        for z, shift, tile_rows, name in ((y, -mean[None], m, "plain z"), (y16, shift16, 16, "tiled bfloat16 z")):
            coefficients = lambda: gbn.bn_coefficients(grad, z, shift, tile_rows, var, scale, gamma, 1e-5)  # noqa: E731
            compare(f"bn_coefficients {(m, n)} {name}", coefficients()[0], torch_formula(coefficients)[0])
        # eval mode's pass: dz = g·k in each layout, Σ g·z and Σ g; z and g also a bfloat16 model's
        k = torch.randn(n, generator=generator)
        for (z, g), lay in itertools.product(((y, grad), (y.bfloat16(), grad.bfloat16())), layouts):
            run = lambda: gbn.eval_grad_sums(g, z, k, lay)  # noqa: E731
            (got, got_parts), (want, want_parts) = run(), torch_formula(run)
            (got_gz, got_g), (want_gz, want_g) = got_parts.sum(1), want_parts.sum(1)
            case = f"eval_grad_sums {(m, n)} {str(z.dtype)[6:]} rows={lay.rows} cols={lay.cols} {str(lay.dtype)[6:]}"
            for part, value, expected in (("dy", got.dy, want.dy), ("dyT", got.dy_t, None if want.dy is None else want.dy.t()),
                                          ("Σ g·z", got_gz, want_gz), ("Σ g", got_g, want_g)):
                asked = part.startswith("Σ") or (lay.rows if part == "dy" else lay.cols)
                if (value is not None) != asked:
                    failures.append(f"{case}: {part} {'missing' if value is None else 'not asked for'}")
                elif value is not None:
                    compare(f"{case} {part}", value, expected)
        _eval_mode(gbn, y, generator, compare, torch_formula, failures)
        # z alone (cublas_epilogue's: float32, or a bfloat16 model's y; also far from 0, where
        # torch's formula in float32 loses C to the rounding of z − μ, and with a first row 10⁴
        # times the rest, inside the first chunk's reference rows): the pass takes μ and σ²
        # itself, against the float64 formula on z as stored
        for offset, outlier, dtype in ((0.0, 1.0, torch.float32), (0.0, 1.0, torch.bfloat16),
                                       (3000.0, 1.0, torch.float32), (1e5, 1.0, torch.float32),
                                       (300.0, 1.0, torch.bfloat16), (0.0, 1e4, torch.float32)):
            z = (y * torch.where(torch.arange(m) == 0, outlier, 1.0)[:, None] + offset).to(dtype)
            coef, got_shift = gbn.bn_coefficients(grad, z, None, m, None, scale, gamma, 1e-5)
            want, want_shift = _bn_coefficients_float64(grad, z, scale, gamma, 1e-5)
            name = f"bn_coefficients {(m, n)} {str(dtype)[6:]} z about {offset:g}, row 0 × {outlier:g}, no statistics"
            for row, part in enumerate(("a", "b", "c", "ds", "dgamma", "dbeta")):
                compare(f"{name}: {part}", coef[row], want[row])
            compare(f"{name}: shift", got_shift, want_shift)
    # the same with several chunks of ``gbn.STATS_BLOCK`` rows, the last one partial
    rows = 2 * gbn.STATS_BLOCK[0] + gbn.STATS_BLOCK[1] + 3
    y, grad = torch.randn(rows, 24, generator=generator), torch.randn(rows, 24, generator=generator)
    scale, gamma = torch.randn(24, generator=generator), torch.rand(24, generator=generator) + 0.5
    for offset, outlier in ((3000.0, 1.0), (0.0, 1e4)):
        z = y * torch.where(torch.arange(rows) == rows - 1, outlier, 1.0)[:, None] + offset
        coef, got_shift = gbn.bn_coefficients(grad, z, None, rows, None, scale, gamma, 1e-5)
        want, want_shift = _bn_coefficients_float64(grad, z, scale, gamma, 1e-5)
        name = f"bn_coefficients {(rows, 24)} z about {offset:g}, last row × {outlier:g}, no statistics"
        compare(name, coef, want)
        compare(f"{name}: shift", got_shift, want_shift)
    failures += _clamped_logsumexp(generator, torch_formula)
    # 22 from softmax factors where a row has a NaN logit, and where a row is clamped whole but for
    # a NaN: NaN exactly where the formula from the logits puts it (the entries inside the clamp),
    # 0 elsewhere, as clamp's own backward gives; the kernel and its torch formula alike.
    y = torch.randn(3, 40, generator=generator) * 3
    y[1, 5], y[2], y[2, 7] = float("nan"), 10.0, float("nan")
    q, part_max, z = g22.softmax_parts(y, 2.0, -1.0, 1.5, 16)
    g, rows_only = torch.randn(3, 1, generator=generator), GradLayouts(True, False, False)
    want = g22.epilogue_backward(y, z, g, 2.0, -1.0, 1.5, rows_only).dy
    for name, run in (("kernel", lambda: g22.epilogue_backward_from_q(q, part_max, z, g, 2.0, 16, rows_only)),
                      ("torch", lambda: torch_formula(lambda: g22.epilogue_backward_from_q(q, part_max, z, g, 2.0, 16,
                                                                                           rows_only)))):
        got = run().dy
        same = torch.equal(got.isnan(), want.isnan()) and torch.allclose(got.nan_to_num(), want.nan_to_num(), atol=1e-6)
        print(f"clamp_lse from q, NaN rows, {name}: NaN where the logits' formula has them: {same}", flush=True)
        if not same:
            failures.append(f"clamp_lse from q, NaN rows ({name}): NaN at {got.isnan().nonzero().tolist()}, "
                            f"want {want.isnan().nonzero().tolist()}")
    # Nearly one-hot rows longer than a block (2048), the top entry in the last block: the kernel
    # finds it across blocks and keeps float32 accuracy (the textbook formula is 100x off here).
    a = torch.randn(5, 4100, generator=generator, dtype=torch.float64) * 8.0
    a[:, 3000] += 30.0
    out64, grad64 = torch.softmax(a, dim=1), torch.randn(5, 4100, generator=generator, dtype=torch.float64)
    want = out64 * (grad64 - (grad64 * out64).sum(dim=1, keepdim=True)) * 0.5  # gelu'(0) = 1/2
    got = g99.epilogue_backward(torch.zeros(5, 4100), out64.float(), grad64.float(), GradLayouts(True, False, False))
    error = ((got.dy.double() - want).norm() / want.norm()).item()
    print("gelu_softmax, one-hot rows", f"relative error {error:.3g} against float64", flush=True)
    if not error < 3e-7:
        failures.append(f"gelu_softmax on nearly one-hot rows: relative error {error:.3g} > 3e-7 against float64")
    return failures


def _eval_mode(gbn, y, generator, compare, torch_formula, failures):
    """gemm_bn's eval mode with a gradient: k, shift and r, the output from z = ``y`` and the
    parameters' gradients (from three chunks of sums), a float32 model's and a bfloat16 model's
    (k, shift and r in float32, the output and the gradients in bfloat16), with b, γ and β and
    without, each against its torch formula."""
    n = y.shape[1]
    for dtype, affine in itertools.product((torch.float32, torch.bfloat16), (True, False)):
        def vector(low=-1.0, dtype=dtype):
            return (2 * torch.rand(n, generator=generator) + low).to(dtype)

        bias, gamma, beta = (vector(), vector(0.5), vector()) if affine else (None, None, None)
        scale, mean, var = vector(), vector(), vector(0.5)
        terms = lambda: gbn.eval_terms(bias, scale, gamma, beta, mean, var, 1e-5, torch.float32)  # noqa: E731
        case = f"eval {tuple(y.shape)} {str(dtype)[6:]} {'with' if affine else 'without'} b, γ, β"
        (k, shift, r), want = terms(), torch_formula(terms)
        for part, got, expected in zip(("k", "shift", "r"), (k, shift, r), want, strict=True):
            compare(f"{case}: {part}", got, expected)
        z = y.to(dtype)
        output = lambda: gbn.eval_apply(z, k, shift, dtype)  # noqa: E731
        parts = torch.randn(2, 3, n, generator=generator)
        grads = lambda: gbn.eval_param_grads(parts, k, r, bias, scale, gamma, mean)  # noqa: E731
        for part, run in (("output", output), ("db, ds, dγ, dβ", grads)):
            got = run()
            if got.dtype != dtype:
                failures.append(f"{case}: {part} is {got.dtype}, want {dtype}")
            compare(f"{case}: {part}", got, torch_formula(run))


def _bn_coefficients_float64(grad, z, scale, gamma, eps):
    """``bn_coefficients``'s six rows and shift −μ in float64, from z as stored."""
    g, z, scale, gamma = grad.double(), z.double(), scale.double(), gamma.double()
    var, mean = torch.var_mean(z, dim=0, correction=0)
    sum_g, sum_gc, m = g.sum(0), (g * (z - mean)).sum(0), z.shape[0]
    r = torch.rsqrt(scale * scale * var + eps)
    a = scale * gamma * r
    return torch.stack([a, -a * sum_g / m, -a * scale * scale * r * r * sum_gc / m, gamma * eps * r ** 3 * sum_gc,
                        scale * r * sum_gc, sum_g]), -mean[None]


def _clamped_logsumexp(generator, torch_formula) -> list[str]:
    """22's z from the logits where the forward kept none (``clamp_lse_rows``) against torch's
    logsumexp, float32 and bfloat16 logits: batch 1, a partial last row block, rows of several
    column steps ending in a partial one, a row clamped whole, a row past both bounds, a NaN row."""
    from autofuse.variants.matmul_clamp_lse_mish import gradients as g22

    failures = []
    for m, n in ((1, 53), (5, 2500)):
        y = torch.randn(m, n, generator=generator) * 2
        if m > 1:
            y[1], y[2, ::2], y[3, 7] = 10.0, -10.0, float("nan")
        for logits in (y, y.bfloat16()):
            got = g22.clamped_logsumexp(logits, 2.0, -1.0, 1.5)
            want = torch_formula(lambda: g22.clamped_logsumexp(logits, 2.0, -1.0, 1.5))
            close = got.shape == (m, 1) and torch.allclose(got, want, rtol=2e-6, atol=0.0, equal_nan=True)
            print(f"clamped_logsumexp {(m, n)} {str(logits.dtype)[6:]}: as torch's {close}", flush=True)
            if not close:
                failures.append(f"clamped_logsumexp {(m, n)} {logits.dtype}: {got.flatten().tolist()[:6]}, "
                                f"want {want.flatten().tolist()[:6]}")
    return failures


def _untracked(bn: torch.nn.BatchNorm1d) -> torch.nn.BatchNorm1d:
    """``bn`` with the same affine parameters and eps, tracking no running statistics."""
    fresh = torch.nn.BatchNorm1d(bn.num_features, eps=bn.eps, track_running_stats=False)
    fresh.load_state_dict({k: v for k, v in bn.state_dict().items() if k in ("weight", "bias")})
    return fresh.to(device=bn.weight.device, dtype=bn.weight.dtype)


def bn_without_running_stats() -> list[str]:
    """gemm_bn's Triton training with BatchNorm1d(track_running_stats=False): batch statistics and
    nothing to update (``bn_finish`` without running-statistics pointers), output and gradients
    against float64, at fp32 and bf16, over several row tiles and a partial one."""
    import copy

    from autofuse.tuning.gate import build_case

    prob = registry.get_problem("gemm_bn")
    failures = []
    for precision in ("fp32", "bf16"):
        operands = OPERANDS[precision][0][0]
        variant = registry.get_variant("gemm_bn", "triton")(precision, **CONFIGS["persistent-pointers"],
                                                            operands=operands)
        model, x = build_case(prob, CheckCase({"batch_size": 37, "in_features": 40, "out_features": 33}, "randn", 3,
                                              True), "cpu", torch.float32, "train")
        model.bn = _untracked(model.bn)
        model64 = copy.deepcopy(model).double()
        x64 = x.double().requires_grad_()
        ref = model64(x64)
        upstream = torch.randn_like(ref)
        wants = torch.autograd.grad(ref, [x64, *model64.parameters()], upstream)
        xv = x.clone().requires_grad_()
        out = variant(model, xv)
        gots = torch.autograd.grad(out, [xv, *model.parameters()], upstream.float(), allow_unused=True)
        bound = prob.tolerances[precision].rel_l2
        names = ["out", "x"] + [n for n, _ in model.named_parameters()]
        for name, got, want in zip(names, [out, *gots], [ref, *wants]):
            if name == "gemm.bias":  # zero in exact arithmetic (the batch mean removes it)
                continue
            error = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            print("bn without running stats", precision, name, f"relative error {error:.3g}", flush=True)
            if not error < bound:
                failures.append(f"bn without running stats {precision} {name}: relative error {error:.3g} > {bound}")
    return failures


def one_tile_training() -> list[str]:
    """gemm_bn's Triton training where one row tile holds the whole batch (``column_batchnorm``:
    statistics, running statistics and output in the GEMM's epilogue, one launch): the tuner's
    gate with gradients at batch 2, an odd batch and a full tile, both schedules, every operand
    path without the range check's exact pass, a bfloat16 model too, with running statistics and
    without; and that those calls took the one-tile epilogue, and a batch one row past the tile
    did not."""
    from autofuse.variants.gemm_bn import triton_gemm

    prob = registry.get_problem("gemm_bn")
    failures, epilogues = [], []
    launch = triton_gemm.TritonGemmBn.launch_gemm

    def recording(self, epilogue, *args):
        epilogues.append(epilogue)
        return launch(self, epilogue, *args)

    triton_gemm.TritonGemmBn.launch_gemm = recording
    paths = (("fp32", "split_host", torch.float32), ("tf32", "round_host", torch.float32),
             ("bf16", "cast_pass", torch.float32), ("bf16", "cast_pass", torch.bfloat16))
    for config, (precision, operands, dtype), stats in itertools.product(CONFIGS, paths, (True, False)):
        params = CONFIGS[config]
        variant = registry.get_variant("gemm_bn", "triton")(precision, **params, operands=operands)
        for batch in (2, 13, params["block_m"], params["block_m"] + 1):
            if precision == "tf32" and batch == 2:
                # two rows normalised: TF32's operand rounding against the CPU's float32-exact tf32
                # floor (``gate``) gives 0.0036 > 0.002 for the three-launch path as for this one
                continue
            shape = {"batch_size": batch, "in_features": 40, "out_features": 33}
            cases = [CheckCase(shape, d, 11, r) for d, r in (("rand", False), ("randn", True))]
            epilogues.clear()
            if stats:
                result = check_variant(variant, prob, cases, "cpu", dtype=dtype, autograd=precision != "tf32",
                                       mode="train")
            else:  # the gate builds its own models: swap in a BatchNorm without running statistics
                result = _without_running_stats(variant, prob, cases, dtype, precision)
            want = "column_partials" if batch > params["block_m"] else "column_batchnorm"
            what = f"one tile: {config} {precision} {operands} {dtype} running stats {stats} batch {batch}"
            print(what, result.ok, f"{result.error:.3g}", sorted(set(epilogues)), flush=True)
            if not result.ok:
                failures.append(f"{what}: {result.reason}")
            if not epilogues or set(epilogues) != {want}:
                failures.append(f"{what}: launched {sorted(set(epilogues))}, expected {want} only")
    triton_gemm.TritonGemmBn.launch_gemm = launch
    return failures + _one_tile_batch_count(prob)


def _one_tile_batch_count(prob) -> list[str]:
    """The batch count after one-tile training calls, as nn.BatchNorm1d keeps it: the epilogue adds
    each batch where momentum is set, the host where it is None (the factor reads the count), so
    never both and never neither, and the cumulative average's running statistics follow."""
    import copy

    failures = []
    shape = {"batch_size": 5, "in_features": 40, "out_features": 33}
    for (config, params), momentum in itertools.product(CONFIGS.items(), (0.1, None)):
        variant = registry.get_variant("gemm_bn", "triton")("fp32", **params, operands="split_host")
        model = prob.build_model(shape).train()
        model.bn.momentum = momentum
        reference = copy.deepcopy(model).double()
        for step in range(3):
            x = torch.randn(5, 40, generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                variant(model, x)
                reference(x.double())
        count, want = int(model.bn.num_batches_tracked), int(reference.bn.num_batches_tracked)
        want_mean = reference.bn.running_mean
        error = float((model.bn.running_mean.double() - want_mean).norm() / want_mean.norm())
        what = f"one tile, {config}, momentum {momentum}: count {count} (want {want}), running mean error {error:.3g}"
        print(what, flush=True)
        if count != want or error > 1e-5:
            failures.append(what)
    return failures


def _without_running_stats(variant, prob, cases, dtype, precision):
    """``check_variant``'s verdict on ``cases`` with the model's BatchNorm tracking no running
    statistics (copied into a fresh module the gate's case builder then uses)."""
    from autofuse.tuning import gate

    build = gate.build_case

    def untracked(*args, **kwargs):
        model, x = build(*args, **kwargs)
        model.bn = _untracked(model.bn)
        return model, x

    gate.build_case = untracked
    try:
        return check_variant(variant, prob, cases, "cpu", dtype=dtype, autograd=precision != "tf32", mode="train")
    finally:
        gate.build_case = build


def eval_after_training() -> list[str]:
    """gemm_bn's Triton variant in eval mode, then training (which updates the running statistics
    through their pointers), then eval again: the second eval must use the new statistics, not
    the (k, shift) cached from the first."""
    import copy

    from autofuse.tuning.gate import build_case

    prob = registry.get_problem("gemm_bn")
    variant = registry.get_variant("gemm_bn", "triton")("fp32", **CONFIGS["persistent-pointers"],
                                                        operands=OPERANDS["fp32"][0][0])
    shape = {"batch_size": 37, "in_features": 40, "out_features": 33}
    model, x = build_case(prob, CheckCase(shape, "randn", 5, False), "cpu", torch.float32, "eval")
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        first = variant(model.eval(), x)
        variant(model.train(), x * 3.0 + 1.0)  # statistics far from the initial ones
        reference.train()(x.double() * 3.0 + 1.0)
        got, want = variant(model.eval(), x), reference.eval()(x.double())
    error = ((got.double() - want).norm() / want.norm()).item()
    moved = ((first.double() - want).norm() / want.norm()).item()
    print("eval after training", f"relative error {error:.3g}; the first eval's {moved:.3g}", flush=True)
    bound = prob.tolerances["fp32"].rel_l2
    if not moved > 100 * bound:
        return [f"eval after training: the statistics barely moved ({moved:.3g}); the check cannot fail"]
    return [] if error < bound else [f"eval after training: relative error {error:.3g} > {bound} (stale statistics)"]


def avgpool_backward() -> list[str]:
    """51's two backward passes against its torch formulas, with the forward's r saved and without:
    every subset of gradients asked for, at blocks small enough that rows, columns, partial sums
    and dW's rows all end in partial tiles (and batch 1); then at the default blocks, a row wider
    than one column block. Each also with a bfloat16 model's x and g (the passes load them as
    float32; dx is bfloat16, within its rounding)."""
    from autofuse.variants.gemm_avgpool_gelu_residual import gradients as g51

    generator = torch.Generator().manual_seed(7)
    failures = []
    small = {"rows": 4, "row_block_k": 16, "w_block_k": 16, "w_block_o": 8, "out_split": 3}
    cases = [((37, 53, 29), small), ((1, 53, 29), small), ((9, 1100, 70), {})]
    needs_cases = [(True, True, True, True), (False, True, False, False), (False, False, True, True),
                   (True, False, False, False), (False, True, True, False)]
    for (m, k, n_out), blocks in cases:
        x = torch.randn(m, k, generator=generator)
        w_mean = torch.randn(k, generator=generator) * 0.05
        offset = torch.tensor(0.3)
        grad = torch.randn(m, k, generator=generator)
        r = torch.addmv(offset, x, w_mean)
        for needs, saved_r, dtype in itertools.product(needs_cases, (r, None), (torch.float32, torch.bfloat16)):
            x, grad = x.to(dtype), grad.to(dtype)
            saved = (x, w_mean, offset, saved_r)
            got = g51.fused_backward(x, w_mean, offset, saved_r, grad, needs, n_out, **blocks)
            want = g51.torch_backward(saved, grad, needs, n_out)
            for name, a, b in zip(("dx", "dW", "db", "dsubtract"), got, want):
                if (a is None) != (b is None):
                    failures.append(f"{(m, k, n_out)} {needs} {name}: {'missing' if a is None else 'not asked for'}")
                    continue
                if a is None:
                    continue
                error = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                case = f"{(m, k, n_out)} {needs} r {'saved' if saved_r is not None else 'recomputed'} {dtype} {name}"
                print("avgpool", case, f"relative error {error:.3g}", flush=True)
                bound = 1e-5 if a.dtype == torch.float32 else 8e-3  # a bfloat16 dx: its own rounding
                if a.shape != b.shape or a.dtype != b.dtype or not error < bound:
                    failures.append(f"{case}: shape {tuple(a.shape)}, relative error {error:.3g}")
    return failures


@triton.jit
def _tf32_dot_kernel(a_ptr, b_ptr, out_ptr, MODE: tl.constexpr):
    from autofuse.kernels.triton.gemm import operand_dot

    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    acc = operand_dot(a, a, b, b, tl.zeros((16, 16), dtype=tl.float32), MODE, True)
    tl.store(out_ptr + r[:, None] * 16 + r[None, :], acc)


def tf32_operands() -> list[str]:
    """x's TF32 parts as the kernels make them, and the interpreter's model of the tensor cores.

    - ``tf32_parts``: hi is x rounded to nearest (``round_tf32``), lo the rest rounded likewise.
    - ``tf32_low_part`` (split_trunc): lo is exactly a TF32 number and trunc(x) + lo is x to 2⁻²².
    - A TF32 dot under the interpreter multiplies truncated operands, as the GPU does: x with
      13 low bits set times the identity gives trunc(x), not x. Without that model, split_trunc
      would count x's low part twice here and still pass (the sums would be right to 2⁻¹¹).
    """
    from autofuse.kernels.triton import variant as tv
    from autofuse.kernels.triton.gemm import tf32_low_part, tf32_parts

    failures = []
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5003, generator=generator) * torch.logspace(-20, 20, 5003)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    tf32_parts[(2,)](x, hi, lo, x.numel(), SPLIT=True, BLOCK=4096)
    if not torch.equal(hi, tv.round_tf32(x)) or not torch.equal(lo, tv.round_tf32(x - hi)):
        failures.append("tf32_parts: hi or lo differs from rounding to nearest on the host")
    tf32_low_part[(2,)](x, lo, x.numel(), BLOCK=4096)
    trunc = (x.view(torch.int32) & -0x2000).view(torch.float32)
    exact = (lo.view(torch.int32) & 0x1FFF == 0).all().item()
    error = ((trunc.double() + lo.double() - x.double()).abs() / x.double().abs()).max().item()
    print("tf32_low_part: lo a TF32 number", exact, f"max relative error of trunc(x) + lo {error:.3g}", flush=True)
    if not exact or not error <= 2.0 ** -22:
        failures.append(f"tf32_low_part: lo exact TF32 {exact}, trunc(x) + lo off by {error:.3g} > 2^-22")
    a = 1.0 + torch.arange(256, dtype=torch.float32).reshape(16, 16) * 2.0 ** -8 + 2.0 ** -12  # low bits set
    out = torch.empty(16, 16)
    for mode in ("tf32", "3xtf32"):
        _tf32_dot_kernel[(1,)](a, torch.eye(16), out, MODE=mode)
        want = (a.view(torch.int32) & -0x2000).view(torch.float32) * (1 if mode == "tf32" else 3)  # 3 products
        if not torch.equal(out, want):
            failures.append(f"an interpreted {mode} dot does not truncate its operands to TF32")
    # tf32_round rounds x's tile to nearest before the dot: 3/4 of a TF32 unit in the low bits
    # rounds up (away from zero for the negative half), where truncation would drop it.
    a = (1.0 + torch.arange(256, dtype=torch.float32).reshape(16, 16) * 2.0 ** -8 + 3 * 2.0 ** -12)
    a[8:] = -a[8:]
    _tf32_dot_kernel[(1,)](a, torch.eye(16), out, MODE="tf32_round")
    if not torch.equal(out, tv.round_tf32(a)):
        failures.append("an interpreted tf32_round dot does not multiply x rounded to TF32 to nearest")
    return failures


def _fp16_parts_on_the_host(t: torch.Tensor):
    """``fp16_row_parts`` written with torch: the scale from the exponent of each row's max |value|."""
    biased = (t.abs().amax(dim=1).view(torch.int32) >> 23) & 0xFF
    e = (14 - (biased - 127)).clamp(-126, 126)
    scaled = t * torch.pow(2.0, e.float())[:, None]
    hi = scaled.half()
    return hi, (scaled - hi.float()).half(), torch.pow(2.0, -e.float())


def fp16_operands() -> list[str]:
    """The float16 operands (``triton_gemm.fp16_row_parts``) for split_fp16 and scaled_fp16.

    - Equal, bit for bit, to the same arithmetic in torch, over rows that each take several
      BLOCKs and a tail (K = 5003): randn spread over 1e±20 across the row, all zeros, denormal
      (1e-40), near float32's max (1e38), and a row holding inf (a NaN low part, as x − x).
    - Each row's max lands in [2¹⁴, 2¹⁵); 1/s is a power of two.
    - hi is x to 2⁻¹¹ of itself down to the row's max·2⁻²⁸, and hi + lo is x to 2⁻²² of itself
      or the row's max·2⁻³⁹, whichever is larger (float16's spacing at the bottom of its range).
    - What that range means for a GEMM with outliers in x's rows (``_fp16_outliers``).
    """
    from autofuse.kernels.triton import variant as tv

    generator = torch.Generator().manual_seed(5)
    k = 5003
    rows = [torch.randn(k, generator=generator) * torch.logspace(-20, 20, k)[torch.randperm(k, generator=generator)],
            torch.randn(k, generator=generator), torch.zeros(k), torch.full((k,), 1e-40),
            torch.randn(k, generator=generator).clamp(-3, 3) * 1e38 / 3]
    x = torch.stack(rows)
    failures = []
    hi, lo, inv = tv.fp16_parts(x, split=True)
    want = _fp16_parts_on_the_host(x)
    for name, got, expected in zip(("hi", "lo", "1/s"), (hi, lo, inv), want):
        if not torch.equal(got, expected):
            failures.append(f"fp16_row_parts: {name} differs from the host's arithmetic")
    top = hi.float().abs().amax(dim=1)[[0, 1, 4]]
    if not ((top >= 2.0 ** 14) & (top <= 2.0 ** 15)).all():
        failures.append(f"fp16_row_parts: rows' max scaled to {top.tolist()}, not into [2^14, 2^15]")
    xd, big = x.double(), x.double().abs().amax(dim=1, keepdim=True)
    one = hi.double() * inv.double()[:, None]
    two = (hi.double() + lo.double()) * inv.double()[:, None]
    normal = (xd.abs() >= big * 2.0 ** -28) & (xd != 0)
    err_one = ((one - xd).abs() / xd.abs())[normal].max().item()
    err_two = ((two - xd).abs() / torch.maximum(xd.abs() * 2.0 ** -22, big * 2.0 ** -39)).nan_to_num(0.0).max().item()
    print("fp16_row_parts: hi off by", f"{err_one:.3g}", "(bound 2^-11 =", f"{2.0 ** -11:.3g})",
          "hi + lo off by", f"{err_two:.3g}", "of its bound", flush=True)
    if not err_one <= 2.0 ** -11 or not err_two <= 1.0:
        failures.append(f"fp16_row_parts: hi off by {err_one:.3g} > 2^-11 or hi + lo by {err_two:.3g}x its bound")
    failures += _fp16_outliers()
    with_inf = x[1:2].clone()
    with_inf[0, 7] = float("inf")
    hi, lo, inv = tv.fp16_parts(with_inf, split=True)
    if hi[0, 7].item() != float("inf") or not lo[0, 7].isnan() or inv.item() != 2.0 ** 114:
        failures.append(f"fp16_row_parts at inf: hi {hi[0, 7].item()}, lo {lo[0, 7].item()}, 1/s {inv.item()}")
    return failures


def _fp16_outliers() -> list[str]:
    """The float16 split's range, as docs/precision.md states it: x's rows hold one
    element R times the rest, multiplying a zero weight, so the result is carried by elements R
    below the row's max. The products of the kernel's parts, summed in float64, against float64:
    float32-accurate (within 4x a float32 matmul's error) up to R = 1e5; beyond, each element
    keeps the row's max·2⁻³⁹, so the error is bounded by that (printed: the numbers docs/precision.md gives)."""
    from autofuse.kernels.triton import variant as tv

    failures = []
    generator = torch.Generator().manual_seed(0)
    m, k, n = 64, 4096, 64
    for outlier in (1e3, 1e5, 1e6, 1e7, 1e9):
        x = torch.randn(m, k, generator=generator)
        w = torch.randn(n, k, generator=generator) / k ** 0.5
        x[:, 0], w[:, 0] = outlier, 0.0
        exact = x.double() @ w.double().T
        (xh, xl, xs), (wh, wl, ws) = tv.fp16_parts(x, split=True), tv.fp16_parts(w, split=True)
        xh, xl, wh, wl = (t.double() for t in (xh, xl, wh, wl))
        scale = xs.double()[:, None] * ws.double()[None, :]
        split = (xh @ wh.T + xh @ wl.T + xl @ wh.T) * scale
        float32 = (x @ w.T).double()
        error = lambda got: ((got - exact).norm() / exact.norm()).item()  # noqa: E731
        floor = x.double().abs().amax() * 2.0 ** -39 * w.double().abs().sum(dim=1).max() * m ** 0.5 * n ** 0.5
        print(f"outlier {outlier:.0e}: split_fp16 {error(split):.3g}, float32 {error(float32):.3g}, "
              f"scaled_fp16 {error((xh @ wh.T) * scale):.3g}", flush=True)
        if outlier <= 1e5 and not error(split) <= 4 * error(float32):
            failures.append(f"split_fp16 with a {outlier:.0e} outlier: {error(split):.3g} > 4x float32's")
        if not (split - exact).norm().item() <= floor.item() + 2.0 ** -21 * exact.norm().item():
            failures.append(f"split_fp16 with a {outlier:.0e} outlier: beyond the max·2^-39 bound")
    return failures


def fp16_backward_gemms() -> list[str]:
    """The fp32 backward's GEMMs on float16 parts (``triton_backward.Fp16Gemms``), both schedules:

    - a column's parts (``fp16_col_parts``, written transposed) equal, bit for bit, the row
      kernel's parts of the transposed copy, at sizes ending in partial blocks both ways and
      with several chunks of rows, with columns spread over 1e±20, an all-zero and a denormal column;
    - dx = dy·W and dW = dyᵀ·x against float64 at batch 1 and odd sizes, rand and large inputs:
      within 4x a float32 matmul's error or 2⁻²² (the split keeps 22 bits: at batch 1 dW is an
      outer product, one rounded product per element);
    - W's column parts are made once for an unchanged W, detached anew each call, and again after
      an in-place update of W (its version moves).
    """
    from autofuse.kernels.triton import backward as triton_backward
    from autofuse.kernels.triton import host as triton_host

    failures = []
    generator = torch.Generator().manual_seed(6)
    for rows, cols in ((1, 37), (37, 1), (70, 45), (700, 45)):  # 700: three chunks of rows, the last partial
        t = torch.randn(rows, cols, generator=generator) * torch.logspace(-20, 20, cols)[None, :]
        t[:, 0] = 0.0
        if cols > 2:
            t[:, 1] = 1e-40
        for split in (True, False):
            got = triton_backward.column_parts(t, split)
            want = triton_host.fp16_parts(t.t().contiguous(), split)
            if not all(torch.equal(g, w) for g, w in zip(got, want)):
                failures.append(f"fp16_col_parts {(rows, cols)} split={split}: differs from the row parts of tᵀ")
    for config in CONFIGS:
        gemms = triton_backward.Fp16Gemms(CONFIGS[config])
        for (m, n, k), spread in itertools.product(((1, 37, 53), (37, 40, 33), (48, 19, 70)), (1.0, 1e4)):
            dy = torch.randn(m, n, generator=generator) * spread
            x = torch.rand(m, k, generator=generator) * spread
            w = torch.randn(n, k, generator=generator) / k ** 0.5
            dx, dw = gemms(autograd.GemmGrad(dy, None, None), x, w, "fp32", True, True, torch.float32)
            for name, got, a, b in (("dx", dx, dy, w), ("dW", dw, dy.t(), x)):
                exact = a.double() @ b.double()
                error = ((got.double() - exact).norm() / exact.norm()).item()
                floor = ((a @ b).double() - exact).norm().item() / exact.norm().item()
                bound = max(4 * floor, 2.0 ** -22)
                print("fp16 backward", config, (m, n, k), spread, name, f"{error:.3g} (bound {bound:.3g})", flush=True)
                if not error <= bound:
                    failures.append(f"{name} {config} {(m, n, k)} x{spread}: {error:.3g} > {bound:.3g}")
    gemms = triton_backward.Fp16Gemms(CONFIGS["persistent-pointers"])
    w = torch.randn(24, 40, generator=generator)
    dy = torch.randn(5, 24, generator=generator)
    made, weight_columns = [], triton_backward.weight_columns
    triton_backward.weight_columns = lambda t: made.append(t.shape) or weight_columns(t)
    try:  # a backward gets a fresh detach() of W each step: the parts are still W's
        for _ in range(2):
            gemms(autograd.GemmGrad(dy, None, None), torch.rand(5, 40), w.detach(), "fp32", True, False, torch.float32)
    finally:
        triton_backward.weight_columns = weight_columns
    if len(made) != 1:
        failures.append(f"Fp16Gemms made W's column parts {len(made)} times for an unchanged W")
    w.mul_(2.0)
    dx, _ = gemms(autograd.GemmGrad(dy, None, None), torch.rand(5, 40), w, "fp32", True, False, torch.float32)
    if not torch.allclose(dx, dy @ w, rtol=1e-5, atol=1e-5):
        failures.append("Fp16Gemms kept W's column parts after an in-place update of W")
    return failures


def tf32_round_in_the_kernel() -> list[str]:
    """Every triton variant with x rounded in its main loop (round_kernel) gives bit for bit what
    it gives with x rounded by the pass (round_host): the same products in the same order. Both
    schedules (by pointer loads, as the space offers round_kernel), partial tiles and a K tail
    (K = 40 against BLOCK_K = 16); with gradients, so the backward sees the same saved tensors."""
    from autofuse.tuning.gate import build_case

    failures = []
    for problem in ("matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"):
        prob = registry.get_problem(problem)
        cls = registry.get_variant(problem, "triton")
        shape = dict(zip(prob.dims, (37, 40, 33)))
        for config in CONFIGS:
            model, x = build_case(prob, CheckCase(shape, "randn", 5, True), "cpu", torch.float32, "train")
            results = []
            for operands in ("round_host", "round_kernel"):
                xv = x.clone().requires_grad_()
                out = cls("tf32", **{**CONFIGS[config], "tma": False}, operands=operands)(model, xv)
                upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
                grads = torch.autograd.grad(out, [xv, *model.parameters()], upstream, allow_unused=True)
                results.append([out, *grads])
            same = all(torch.equal(a, b) if a is not None else b is None for a, b in zip(*results))
            print(problem, config, "by pointers: round_kernel == round_host bit for bit:", same, flush=True)
            if not same:
                failures.append(f"{problem} {config}: round_kernel differs from round_host")
    return failures


def transpose() -> list[str]:
    """``triton_host.transposed`` (the weight gradient's K-major copy of x) equals torch's
    transpose at shapes that end in partial tiles both ways, batch 1 and a single column included."""
    from autofuse.kernels.triton import host as triton_host

    generator = torch.Generator().manual_seed(4)
    failures = []
    for rows, cols in ((1, 37), (37, 1), (37, 53), (130, 67), (64, 128)):
        t = torch.randn(rows, cols, generator=generator)
        got = triton_host.transposed(t)
        print("transpose", (rows, cols), tuple(got.shape), flush=True)
        if not torch.equal(got, t.t().contiguous()) or not got.is_contiguous():
            failures.append(f"transpose of {(rows, cols)} differs from torch's")
    return failures


def whole_row_tiles() -> list[str]:
    """x's operand passes write whole TMA row tiles (``host._WHOLE_TILES``). bf16's cast
    (``bfloat16_whole_tiles``): torch's bfloat16 bit for bit (ties to even, inf, -0; NaN a NaN; the
    interpreter flushes float32 denormals, so the GPU test checks those); a bfloat16 x read as it
    is. The float16 parts (``fp16_parts``, with the range check's flags): the unpadded pass's parts
    and scales bit for bit. Each: zeros past x's rows, views of x's rows whose descriptors cover the
    whole buffer. Then each problem's triton forward (and gemm_bn's training statistics, which sum
    over the rows) under bf16, fp32 and tf32 the same bit for bit as with descriptors of the views
    alone, whose boxes the copy engine fills past the rows with zeros."""
    from autofuse.kernels.triton import host as triton_host
    from autofuse.tuning.gate import build_case

    generator = torch.Generator().manual_seed(5)
    failures = []

    def check_whole(what, view, want_rows, block_m):
        whole = getattr(view, triton_host._WHOLE_TILES, view)
        rows_whole = -(-want_rows // block_m) * block_m
        desc = triton_host.descriptors((view,), block_m, 16)[0]
        print("whole tiles", what, tuple(view.shape), tuple(whole.shape), tuple(desc.shape), flush=True)
        if (tuple(whole.shape) != (rows_whole, view.shape[1]) or whole.data_ptr() != view.data_ptr()
                or (whole[want_rows:] != 0).any()):
            failures.append(f"{what}: buffer {tuple(whole.shape)} is not whole tiles of {block_m} rows, zeros past x's")
        if tuple(desc.shape) != (rows_whole, view.shape[1]) or desc.base is not whole:
            failures.append(f"{what}: the descriptor covers {tuple(desc.shape)}, not the whole buffer")

    ties = (((torch.arange(64 * 48, dtype=torch.int32) + 0x3F00) << 16) | 0x8000).view(torch.float32).reshape(64, 48)
    w = torch.randn(48, 48, generator=generator)
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan"))  # no lucky zeros
    torch.empty_like = lambda t, **kwargs: torch.empty(t.shape, dtype=kwargs.get("dtype", t.dtype), device=t.device)
    for rows, block_m in ((1, 16), (5, 16), (37, 64), (33, 32), (64, 64)):
        x = torch.randn(rows, 48, generator=generator) * torch.logspace(-30, 38, 48)
        x[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])
        for name, t in (("random", x), ("ties", ties[:rows].contiguous())):
            got = triton_host.bfloat16_whole_tiles(t, block_m)
            want, nan = t.bfloat16(), t.isnan()  # a NaN's bits are the converter's own
            if not torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)) or not got[nan].isnan().all():
                failures.append(f"bf16 {name} {rows} rows: not torch's bfloat16 bit for bit")
            check_whole(f"bf16 {name} {rows} rows", got, rows, block_m)
            if triton_host.bfloat16_whole_tiles(want, block_m) is not want:
                failures.append(f"bf16 {name} {rows} rows: a bfloat16 x was copied, not read as it is")
        t = torch.randn(rows, 48, generator=generator) * torch.logspace(-3, 3, 48)
        for split in (True, False):
            parts, check = triton_host.fp16_weight_parts(w, split)
            got, _ = triton_host.fp16_input_parts(t, split, parts, check, block_m)
            want, _ = triton_host.fp16_input_parts(t, split, parts, check)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                failures.append(f"float16 parts, split {split}, {rows} rows: not the unpadded pass's bit for bit")
            for part in got[:2]:
                check_whole(f"float16 parts split {split} {rows} rows", part, rows, block_m)
    torch.empty, torch.empty_like = empty, empty_like
    real_descriptors = triton_host.descriptors
    for (problem, mode), (precision, operands) in itertools.product(
            (("matmul_clamp_lse_mish", "train"), ("matmul_gelu_softmax", "train"), ("gemm_bn", "train"),
             ("gemm_bn", "eval")), (("bf16", "cast_pass"), ("fp32", "split_fp16"), ("tf32", "scaled_fp16"))):
        prob = registry.get_problem(problem)
        outs = []
        for views_alone in (False, True):
            if views_alone:  # the descriptors of x's rows alone: the copy engine's zero fill past them
                triton_host.descriptors = lambda tensors, rows, block_k: real_descriptors(
                    [t if t is None else t[:] for t in tensors], rows, block_k)
            model, x = build_case(prob, CheckCase(dict(zip(prob.dims, (37, 40, 53))), "randn", 3, False), "cpu",
                                  torch.float32, mode)
            variant = registry.get_variant(problem, "triton")(precision, **CONFIGS["grid-tma"], operands=operands)
            with torch.no_grad():
                outs.append([variant(model, x)] + [b.clone() for b in model.buffers()])
            triton_host.descriptors = real_descriptors
        same = all(torch.equal(a, b) for a, b in zip(*outs))
        print("whole tiles", problem, mode, precision, operands, "as with the views' descriptors:", same, flush=True)
        if not same:
            failures.append(f"{problem} {mode} {precision} {operands}: whole tiles changed the output or statistics")
    return failures


@triton.jit
def _tanh_gelu(v):
    """GELU's tanh approximation: a different function from F.gelu's exact erf form."""
    u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
    return 0.5 * v * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0))


def mutant_fails() -> list[str]:
    """The gate must reject a kernel with the tanh GELU: proof that these checks can fail."""
    from autofuse.variants.matmul_gelu_softmax import triton_kernels

    triton_kernels.gelu = _tanh_gelu  # the interpreter runs the kernel's Python, resolving names at call time
    failures = gate("matmul_gelu_softmax", "persistent-pointers", "fp32")
    return [] if failures else ["a tanh-GELU kernel passed the gate"]


@triton.jit
def _exp_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    from autofuse.kernels.triton.epilogue import exp_nonpositive

    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, exp_nonpositive(tl.load(x_ptr + offsets, mask=offsets < n)), mask=offsets < n)


def exp_nonpositive() -> list[str]:
    """The range reduction of ``exp_nonpositive``: within 2 float32 ulp of exp over (−87, 0] (normal results),
    0 at −inf and below −104, NaN kept (the interpreter's exp2 is numpy's: this checks the
    algebra; the GPU's ex2.approx adds its 2⁻²² on r alone)."""
    x = torch.cat([-torch.logspace(-8, 2.01, 3000, dtype=torch.float64).float(), torch.tensor([0.0, -104.5, -1e30])])
    x = torch.cat([x, torch.tensor([float("-inf"), float("nan")])])
    out = torch.empty_like(x)
    _exp_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = torch.exp(x.double())
    normal = x > -87.0  # below, exp is a float32 denormal (flushed to 0 on the GPU)
    rel = ((out[normal].double() - want[normal]).abs() / want[normal]).max().item()
    failures = [f"max relative error {rel:.3g} > 2.4e-7"] if rel > 2.4e-7 else []
    edges = out[-4:]  # -104.5, -1e30, -inf, nan
    if not (edges[:3] == 0).all() or not edges[3].isnan():
        failures.append(f"edges: {edges.tolist()}")
    return failures


@triton.jit
def _mish_kernel(z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    from autofuse.variants.matmul_clamp_lse_mish.triton_kernels import tanh_softplus

    offsets = tl.arange(0, BLOCK)
    z = tl.load(z_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, z * z * tanh_softplus(z), mask=offsets < n)


def lse_mish_output() -> list[str]:
    """z·mish(z) of ``lse_mish_finish`` within 8 float32 ulp of float64 over z in ±(1e-6, 100), the
    range where log(1 + e^z) in float32 rounds to 0 included (z < −17) down to where e^z is a
    float32 denormal (z < −87); inf and NaN as torch."""
    z = torch.logspace(-6, 2, 2000, dtype=torch.float64)
    z = torch.cat([-z.flip(0), torch.zeros(1, dtype=torch.float64), z]).float()
    edges = torch.tensor([float("inf"), float("nan")])
    out = torch.empty(z.numel() + 2)
    _mish_kernel[(1,)](torch.cat([z, edges]), out, out.numel(), BLOCK=triton.next_power_of_2(out.numel()))
    zd = z.double()
    want = zd * zd * torch.tanh(torch.nn.functional.softplus(zd))
    normal = z > -87.0  # below, e^z is a float32 denormal (0 on the GPU), and so is the result soon after
    rel = ((out[:-2].double() - want).abs() / want.abs())[normal].max().item()
    failures = [f"max relative error {rel:.3g} > 4.8e-7"] if rel > 4.8e-7 else []
    if out[-2].item() != float("inf") or not out[-1].isnan():
        failures.append(f"z·mish(z) at inf, nan: {out[-2:].tolist()}")
    return failures


# Rows of x (or of W) whose WIDE_COUNT largest entries are M times the others: outlier features.
WIDE_RATIOS = (1e4, 1e8, 1e12, 1e30)
WIDE_COUNT = 4


def _wide_case(prob, model, x, side: str, ratio: float, zeroed: bool, generator) -> None:
    """Make ``side``'s ("x" or "w") rows wide in place: WIDE_COUNT columns times ``ratio``; with
    ``zeroed`` the other operand's matching columns are zero, so the result rests on the ordinary
    entries alone (the split's worst case)."""
    w = getattr(model, prob.linear_attr).weight.data
    wide = torch.randperm(x.shape[1], generator=generator)[:WIDE_COUNT]
    big, other = (x, w) if side == "x" else (w, x)
    big[:, wide] *= ratio
    if zeroed:
        other[:, wide] = 0.0


def err_of(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def wide_rows(problem: str, config: str) -> list[str]:
    """fp32 (split_fp16) and tf32 (scaled_fp16) on wide rows of x and of W, M = 1e4 ... 1e30, with
    and without the other operand's matching columns zeroed, batch 1 and an odd batch: the output's
    relative error against float64 within 2x float32 eager's (fp32; or 2⁻²², the split's own accuracy
    per element, where eager is exact to less) or the tf32 gate's tolerance (or 4x eager's, the
    gate's floor). Before the range check, M = 1e8 gave ~1e-4 at fp32."""
    import copy

    from autofuse.tuning.gate import FLOOR_FACTOR, build_case, floor_output

    prob = registry.get_problem(problem)
    failures = []
    modes = ("train", "eval") if prob.mode_sensitive else ("train",)
    for precision, operands in (("fp32", "split_fp16"), ("tf32", "scaled_fp16")):
        variant = registry.get_variant(problem, "triton")(precision, **CONFIGS[config], operands=operands)
        for mode, batch, side, ratio, zeroed in itertools.product(modes, (1, 37), ("x", "w"), WIDE_RATIOS,
                                                                  (True, False)):
            if batch == 1 and mode == "train" and prob.mode_sensitive:
                continue  # BatchNorm training needs two rows
            shape = dict(zip(prob.dims, (batch, 80, 33)))
            model, x = build_case(prob, CheckCase(shape, "randn", 3, True), "cpu", torch.float32, mode)
            _wide_case(prob, model, x, side, ratio, zeroed, torch.Generator().manual_seed(batch))
            ref = prob.reference(model, x)[0]
            eager = floor_output(model, x, "ieee")
            if not torch.isfinite(eager).all() or not err_of(eager, ref) <= 1e-3:
                continue  # float32 itself cannot represent this case (BatchNorm's variance at 1e30)
            with torch.no_grad():
                out = variant(copy.deepcopy(model), x)
            error, eager_error = err_of(out, ref), err_of(eager, ref)
            bound = 2 * eager_error if precision == "fp32" else max(prob.tolerances["tf32"].rel_l2,
                                                                    FLOOR_FACTOR * eager_error)
            what = (f"{precision} {mode} batch {batch}, {side} rows wide by {ratio:.0e}"
                    f"{' (other zeroed)' if zeroed else ''}")
            print(f"{what}: {error:.3g} (float32 eager {eager_error:.3g})", flush=True)
            if not error <= max(bound, 2.0 ** -22):  # the split's own accuracy per element: ordinary inputs
                failures.append(f"{problem} {what}: relative error {error:.3g} > {bound:.3g}")
    return failures


def _flag_cases(ratio: float, split: bool) -> dict:
    """name: (x, W, x's rows to flag, W's rows to flag), K = 8192; the wide rows ``ratio`` wide."""
    generator = torch.Generator().manual_seed(2)
    k, n = 8192, 48
    def randn(*size):
        return torch.randn(*size, generator=generator)

    wide = torch.randperm(k, generator=generator)[:16]
    outliers = randn(4, k)
    outliers[:, wide] *= 1e8
    x_wide, w_zeroed = randn(4, k), randn(n, k) / k ** 0.5
    x_wide[2, wide] *= ratio
    w_zeroed[:, wide] = 0.0
    w_wide, x_zeroed = randn(n, k) / k ** 0.5, randn(4, k)
    w_wide[5, wide] *= ratio
    x_zeroed[:, wide] = 0.0
    return {"rand": (torch.rand(5, k, generator=generator), randn(n, k) / k ** 0.5, [], []),
            "randn batch 1": (randn(1, k), randn(n, k) / k ** 0.5, [], []),
            "large": (100 * randn(5, k), randn(n, k), [], []),
            "relu batch 1": (randn(1, k).clamp_min(0), randn(n, k) / k ** 0.5, [], []),
            # 16 entries 1e8 (> 2²⁴) times the rest carry each row: the few-terms rule under split_fp16
            "outlier features": (outliers, randn(n, k) / k ** 0.5, [0, 1, 2, 3] if split else [], []),
            "wide x row": (x_wide, w_zeroed, [2], []),
            "wide W row": (x_zeroed, w_wide, [], [5]),
            # W's flag is made once with its parts, whatever x: its wide row is flagged even where x's
            # large columns make the loss harmless (the exact path then costs time, never accuracy).
            "wide W row, x reaching it": (randn(4, k), w_wide, [], [5])}


def wide_rows_flags() -> list[str]:
    """The range check flags rows by their effect, not by what they hold: ordinary rows of 8192
    (rand, randn, large; each holds values far below its max, whose loss is far below fp32's
    error) are not flagged, x's or W's, at batch 1 and 5, nor ReLU-like x (half zeros) at batch 1.
    x with outlier features (16 columns 1e8 times the rest, W's columns ordinary) is flagged under
    split_fp16 by the few-terms rule (16 entries carry each row), not under scaled_fp16. A wide row of
    x (M = 1e8 under split_fp16, 1e12 under scaled_fp16, whose 11-bit parts hold 1e8; W's matching
    columns zero) is flagged, and only it; a wide row of W is flagged whatever x (W's flag is made
    once, with its cached parts)."""
    from autofuse.kernels.triton import host

    failures = []
    for split in (True, False):
        for name, (x, w, want_x, want_w) in _flag_cases(1e8 if split else 1e12, split).items():
            parts, check = host.fp16_weight_parts(w, split)
            xs, ws = host.fp16_input_parts(x, split, parts, check)
            got_x = (xs[2] < 0).nonzero().flatten().tolist()
            got_w = (ws[2] < 0).nonzero().flatten().tolist()
            if got_x != want_x or got_w != want_w:
                failures.append(f"{name} (split={split}): flagged rows of x {got_x}, of W {got_w}; "
                                f"want {want_x} and {want_w}")
            if not torch.equal(xs[2].abs(), host.fp16_parts(x, split)[2]) or not torch.equal(ws[2].abs(),
                                                                                             parts[2].abs()):
                failures.append(f"{name} (split={split}): the checked scales differ from fp16_parts' in magnitude")
    return failures


def bf16_model_serving(tmp: str) -> list[str]:
    """A bfloat16 model end to end: ``autofuse tune --dtype bfloat16 --precision bf16``'s candidates
    include the triton variants (the CUDA ones are refused with a reason); a table entry for the
    bfloat16 key dispatches a bfloat16 ``get_module`` to the triton variant, which returns bfloat16
    within the bf16 tolerance of float64; and the KernelBench export at --precision bf16, run as
    KernelBench's harness does at precision=torch.bfloat16 (model and inputs converted), runs it too."""
    import pathlib

    import autofuse
    from autofuse.kernelbench.export import export_kernelbench
    from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, shape_key
    from autofuse.tuning.tuner import _spaces

    failures = []
    params = {**CONFIGS["persistent-pointers"], "operands": "cast_pass"}
    settings = {"device": "cpu", "dtype": "bfloat16", "precision": "bf16"}
    for problem in ("matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"):
        prob = registry.get_problem(problem)
        shape = dict(zip(prob.dims, (37, 40, 33)))
        if "triton" not in _spaces(prob, shape, settings, None):
            failures.append(f"{problem}: the triton variant is no candidate of a bfloat16 tune")
        table = pathlib.Path(tmp) / f"{problem}.json"
        mode = "train" if prob.mode_sensitive else "any"
        DispatchTable(table).record(current_fingerprint("cpu"), problem, shape_key(shape),
                                    DispatchKey("bfloat16", "bf16", mode, False).to_str(),
                                    {"variant": "triton", "params": params, "median_ms": 1.0, "eager_ms": 2.0})
        args, kwargs = prob.init_args(shape)
        module = autofuse.get_module(problem, *args, table=table, precision="bf16", **kwargs).bfloat16()
        x = torch.randn(37, 40, generator=torch.Generator().manual_seed(3)).bfloat16()
        plain = prob.model(*args, **kwargs)
        plain.load_state_dict(module.state_dict())
        want, _ = prob.reference(plain.bfloat16().train(module.training), x)
        with torch.no_grad():
            info, out = module.dispatch_info(x), module(x)
        error = err_of(out, want)
        print(problem, "bfloat16 get_module:", info["variant"], info["source"], out.dtype, f"{error:.3g}", flush=True)
        if info["variant"] != "triton" or out.dtype != torch.bfloat16 or not error < prob.tolerance("bf16").rel_l2:
            failures.append(f"{problem}: a bfloat16 get_module ran {info}, returned {out.dtype}, error {error:.3g}")
    from autofuse.variants.matmul_clamp_lse_mish.cublas_epilogue import CublasEpilogueClampLseMish

    # cublas_epilogue serves a bfloat16 model at bf16 only, with gradients too; its refusal says why.
    reason = CublasEpilogueClampLseMish.admits("cuda", torch.bfloat16, "fp32", autograd=False)
    if reason is None or "bfloat16" not in reason:
        failures.append(f"cublas_epilogue's refusal of a bfloat16 model at fp32 names no dtype: {reason!r}")
    reason = CublasEpilogueClampLseMish.admits("cuda", torch.bfloat16, "bf16", autograd=True)
    if reason is not None:
        failures.append(f"cublas_epilogue refuses a bfloat16 model's gradients at bf16: {reason!r}")
    lacking = CublasEpilogueClampLseMish.unavailable_reason("cuda")  # nvcc, on a machine without it
    if CublasEpilogueClampLseMish.admits("cuda", torch.bfloat16, "bf16", autograd=False) not in (None, lacking):
        failures.append("cublas_epilogue refuses a bfloat16 model's forward at bf16")
    failures += _kernelbench_bf16(pathlib.Path(tmp), export_kernelbench)
    return failures


def bf16_model_rounds_as_the_reference() -> list[str]:
    """22's bfloat16 model rounds where its bfloat16 reference does: its output equals, bit for bit,
    ``lse_mish_bf16``'s emulation of that reference's arithmetic on CUDA (linear's output, x·s, each
    term exp(v − max) against the row's max, logsumexp's sum, log and z, mish(z) and z·mish(z),
    each rounded to bfloat16). The inputs' GEMM is exact in float32 (``bf16_22_cases``), so the
    kernel's logits are the emulation's: randn ones, at scale 0.75 (x·s then rounds) and at the
    default scale with most logits near the clamp (z near 16.5; 19 at KernelBench's size), and rows
    built so that rounding each term against the row's max gives another z than the per-tile sums
    the kernels took before ``lse_mish_finish_bf16``: their max sits in one tile, the other tiles'
    maxima a distance below it that bfloat16 cannot hold. Printed: the rows where the kernel's
    output differs, those where the per-tile sums' z would (the built rows must have some), and the
    float64 result's distance from the emulation, for scale (up to 1.3% here, past KernelBench's
    atol = rtol = 1e-2)."""
    prob = registry.get_problem("matmul_clamp_lse_mish")
    failures = []
    cases = bf16_22_cases(prob)
    for config in ("persistent-pointers", "grid-tma"):
        variant = registry.get_variant(prob.name, "triton")("bf16", **CONFIGS[config], operands="cast_pass")
        tile_n = variant.params["block_n"]
        for name, (model, x) in cases.items():
            z, want = lse_mish_bf16(model, x)
            z_tiles, out_tiles = lse_mish_bf16(model, x, tile_n)
            exact = prob.reference(model, x)[0]  # float64 of the same bfloat16 parameters and input
            with torch.no_grad():
                out = variant(model, x).float()
            off = (out != want).flatten()
            rel = (out - want).abs().div(want.abs().clamp_min(1e-3)).max().item()
            tiles_off = (z_tiles != z).sum().item()
            exact_rel = (exact - want.double()).abs().div(want.double().abs().clamp_min(1e-3)).max().item()
            print(f"{config} {name} {tuple(x.shape)} → {model.matmul.out_features}: kernel vs emulation "
                  f"{off.sum().item()} rows off (max {rel:.3g}); per-tile sums' z off in {tiles_off} rows "
                  f"(out in {(out_tiles != want).sum().item()}); float64 vs emulation {exact_rel:.3g}", flush=True)
            if off.any():
                rows = off.nonzero().flatten()[:4].tolist()
                failures.append(f"{config} {name}: a bfloat16 model's output differs from its reference's "
                                f"arithmetic in {off.sum().item()} rows, by up to {rel:.3g} (rows {rows}: "
                                f"{out.flatten()[rows].tolist()}, want {want.flatten()[rows].tolist()})")
            if name.startswith("built") and not tiles_off:
                failures.append(f"{config} {name}: the built rows no longer tell the row's max from the tiles'")
    return failures


def lse_mish_bf16(model, x, tile_n=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, z·mish(z)) of 22's bfloat16 ``model`` at ``x`` as its reference computes them on CUDA, in
    float32 ops with each tensor it stores rounded to bfloat16: linear's output, x·s (x + x exact),
    the clamp; logsumexp's m = max(v), v − m, exp(v − m), their float32 sum, its log and + m; mish(z)
    and z·mish(z). Emulated rather than taken from PyTorch's CPU kernels, which need not round as
    CUDA's do (on the check's inputs they agree). With ``tile_n``, the sum as the kernels took it
    before their second pass: per tile of tile_n columns Σ exp(v − tile max) in float32, merged
    against m; the rest rounded as above. The GEMM must be exact in float32 (asserted; the check's
    inputs are made so), else its order of summation would decide roundings."""
    def r(t):
        return t.bfloat16().float()

    lin = model.matmul
    x, w, b = x.float(), lin.weight.float(), lin.bias.float()
    y = x @ w.t() + b
    assert torch.equal(y.double(), x.double() @ w.double().t() + b.double()), "the inputs' GEMM is not exact"
    v = r(torch.clamp(r(r(y) * model.scale_factor) * 2.0, model.clamp_min, model.clamp_max))
    m = v.amax(1, keepdim=True)
    if tile_n is None:
        s = r(torch.exp(r(v - m))).sum(1, keepdim=True)
    else:
        s = torch.zeros_like(m)
        for tile in v.split(tile_n, dim=1):
            tile_max = tile.amax(1, keepdim=True)
            s += torch.exp(tile - tile_max).sum(1, keepdim=True) * torch.exp(tile_max - m)
    z = r(m + r(torch.log(r(s))))
    return z, r(z * r(z * torch.tanh(torch.log1p(torch.exp(z)))))


def finish_inside() -> list[str]:
    """22's and 99's finish inside the GEMM's launch (``finish_inside``): the output equals the
    two-launch path's bit for bit, for float32 models at fp32 (float16 parts; x's rows made wide, so
    the range check's exact path takes tiles again: in a second launch on the grid, which then
    finishes, and in the same one when persistent), tf32 and bf16, and for bfloat16 models; at batch
    1, a batch over three row tiles and odd sizes, both schedules. A second call equals the first and
    the counter is 0 after each (the next launch counts from it). A row's pairs merged in several
    steps (``merged_partials``, as the finish does past 256 column tiles) give what one step gives,
    within float32's rounding. Where no counter is free (``Arrivals.counter`` None) the call
    finishes in a launch of its own, and equals it too."""
    from autofuse.kernels.triton import host

    failures = []
    models = (("fp32", torch.float32, "split_fp16"), ("tf32", torch.float32, "scaled_fp16"),
              ("bf16", torch.float32, "cast_pass"), ("bf16", torch.bfloat16, "cast_pass"))
    for problem, (precision, dtype, operands), config, sizes in itertools.product(
            ("matmul_clamp_lse_mish", "matmul_gelu_softmax"), models, ("persistent-pointers", "grid-tma"),
            ((1, 40, 53), (37, 24, 70))):
        prob = registry.get_problem(problem)
        cls = registry.get_variant(problem, "triton")
        shape = dict(zip(prob.dims, sizes))
        model, x = build_case(prob, CheckCase(shape, "randn", 5, False), "cpu", dtype, "train")
        if precision == "fp32":
            _wide_case(prob, model, x, "x", 1e8, False, torch.Generator().manual_seed(5))
        params = {**CONFIGS[config], "operands": operands}
        apart, inside = cls(precision, **params), cls(precision, **params, finish_inside=True)
        with torch.no_grad():
            want = apart(model, x)
            got = [inside(model, x) for _ in range(2)]
        counters = inside._arrivals._buffers[torch.device("cpu")]
        what = f"{problem} {precision} {dtype} {operands} {config} {sizes}"
        print(f"{what}: equal {[torch.equal(g, want) for g in got]}", flush=True)
        if not all(torch.equal(g, want) for g in got):
            failures.append(f"{what}: the finish inside differs from the finish apart, by up to "
                            f"{max((g.float() - want.float()).abs().max().item() for g in got):.3g}")
        if counters.any():
            failures.append(f"{what}: a counter was left at {counters.nonzero().tolist()}")
        if (precision, sizes) == ("fp32", (37, 24, 70)):
            weight = getattr(model, prob.linear_attr).weight.detach().contiguous()
            flagged = host.fp16_input_parts(x, True, *host.fp16_weight_parts(weight, True))[0][2]
            if not (flagged < 0).any():
                failures.append(f"{what}: no row of x is flagged: the exact path is not what this checks")
    prob = registry.get_problem("matmul_clamp_lse_mish")
    cls = registry.get_variant(prob.name, "triton")
    kernels = cls("fp32").module()
    generator = torch.Generator().manual_seed(7)
    rows, parts = 19, 37
    part_max = torch.randn(rows, parts, generator=generator) * 20
    part_sum = torch.rand(rows, parts, generator=generator) * 50 + 1
    top = part_max.double().amax(1, keepdim=True)
    want = top + (part_sum.double() * (part_max.double() - top).exp()).sum(1, keepdim=True).log()
    for block_p in (64, 4):  # one step, ten
        z, out = torch.empty(rows, 1), torch.empty(rows, 1)
        kernels.lse_mish_finish[(2,)](part_max, part_sum, z, out, rows, parts, BLOCK_R=16, BLOCK_P=block_p)
        error = ((z.double() - want).abs() / want.abs()).max().item()
        print(f"pairs merged {block_p} a step: z's relative error {error:.3g}", flush=True)
        if not error <= 4 * 2.0 ** -24:
            failures.append(f"pairs merged {block_p} a step: z's relative error {error:.3g}")
    model, x = build_case(prob, CheckCase(dict(zip(prob.dims, (5, 24, 70))), "randn", 5, False), "cpu",
                          torch.float32, "train")
    inside = cls("bf16", **CONFIGS["grid-tma"], operands="cast_pass", finish_inside=True)
    inside._arrivals.counter = lambda device: None
    with torch.no_grad():
        apart_out = cls("bf16", **CONFIGS["grid-tma"], operands="cast_pass")(model, x)
        if not torch.equal(inside(model, x), apart_out):
            failures.append("without a free counter the call differs from the finish apart")
    return failures


def bf16_22_cases(prob) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """22's bfloat16 models and inputs whose GEMM is exact in float32, by name. "randn": x on a 2⁻⁴
    grid, W and b on 2⁻¹⁰'s (``build_case_bf16``; K = 40, so every partial sum is a multiple of
    2⁻¹⁴ under 2¹⁰), 53 columns at scale 0.75, and 2000 at lift 2 (z near 16.5). "built rows": x
    one-hot, b = 0 and scale 2, so row i's logits are 4·W's column i; 2500 columns (157 tiles of 16,
    the last partial; 2 passes of the finish). Five rows have their max in one tile (the first, the
    middle, the partial last) and the rest at a value whose distance below it bfloat16 cannot hold,
    chosen so that z rounded against the row's max and from the tiles' sums differ, away from every
    rounding boundary (float64 sums round alike); then a row all at hi, one hi among lo, one all at
    lo, and one of bfloat16 values drawn from ±12 (the clamp at ±10 cuts some)."""
    def grid(t, step):
        return ((t.float() / step).round() * step).bfloat16()

    cases = {}
    for batch, hidden, lift, scale in ((37, 53, 0.0, 0.75), (16, 2000, 2.0, 2.0)):
        model, x = build_case_bf16(prob, dict(zip(prob.dims, (batch, 40, hidden))), lift)
        with torch.no_grad():
            model.matmul.weight.copy_(grid(model.matmul.weight, 2 ** -10))
            model.matmul.bias.copy_(grid(model.matmul.bias, 2 ** -10))
        model.scale_factor = scale
        cases[f"randn lift {lift} scale {scale}"] = (model, grid(x, 2 ** -4))
    hidden = 2500
    built = []
    for top, at, rest in ((10.0, 0, 3.390625), (10.0, 1300, 3.140625), (9.5, hidden - 1, 2.890625),
                          (10.0, 700, 1.46875), (10.0, hidden - 3, 3.703125)):
        row = torch.full((hidden,), rest)
        row[at] = top
        built.append(row)
    spread = torch.rand(hidden, generator=torch.Generator().manual_seed(22)) * 24 - 12
    built += [torch.full((hidden,), 10.0), torch.full((hidden,), -10.0).index_fill(0, torch.tensor([5]), 10.0),
              torch.full((hidden,), -10.0), spread.bfloat16().float()]
    args, kwargs = prob.init_args(dict(zip(prob.dims, (len(built), 40, hidden))))
    model = prob.model(*args, **kwargs).bfloat16()
    with torch.no_grad():
        model.matmul.weight.zero_()
        model.matmul.weight[:, :len(built)] = torch.stack(built, dim=1) / 4
        model.matmul.bias.zero_()
    cases["built rows"] = (model, torch.eye(len(built), 40).bfloat16())
    return cases


def bf16_model_bn_rounds_as_the_reference() -> list[str]:
    """gemm_bn's training forward on a bfloat16 model (KernelBench's rand inputs, linear's bias
    lifted so a column's mean is up to ~25 times its spread) within 2·2⁻⁸·(|out| + 1) of its
    bfloat16 reference (one bfloat16 step at any |out|; KernelBench allows 2.56 of these units) as
    CUDA computes it: linear's output and x·s rounded to bfloat16, then
    BatchNorm in float32, rounded once (emulated here: PyTorch's CPU BatchNorm on bfloat16 rounds
    otherwise, 1 step from it in half the elements). The float32-exact z is 4-40 units from it (more
    at the lift: BatchNorm's 1/σ scales the two roundings up); the kernels' are 1.3-1.5."""
    from autofuse.tuning.gate import build_case

    prob = registry.get_problem("gemm_bn")
    failures = []
    variant = registry.get_variant(prob.name, "triton")("bf16", **CONFIGS["persistent-pointers"], operands="cast_pass")
    for (batch, k, n), lift in itertools.product(((64, 96, 80), (37, 40, 53)), (0.0, 4.0)):
        shape = dict(zip(prob.dims, (batch, k, n)))
        model, x = build_case(prob, CheckCase(shape, "rand", 5, False), "cpu", torch.bfloat16, "train")
        with torch.no_grad():
            model.gemm.bias += lift
        w, b, s = (t.float() for t in (model.gemm.weight, model.gemm.bias, model.scale))
        y2 = ((x.float() @ w.t() + b).bfloat16().float() * s).bfloat16().float()
        bn = model.bn
        gamma, beta = bn.weight.float(), bn.bias.float()
        want = ((y2 - y2.mean(0)) / torch.sqrt(y2.var(0, unbiased=False) + bn.eps) * gamma + beta).bfloat16().float()
        z = x.float() @ w.t() + b
        exact = ((z - z.mean(0)) * s * gamma / torch.sqrt(s * s * z.var(0, unbiased=False) + bn.eps) + beta)
        with torch.no_grad():
            out = variant(model, x).float()
        # in units of 2⁻⁸·(|want| + 1): the output has unit spread, so near zero a step of 1's
        steps = ((out - want).abs() / (want.abs() + 1)).max().item() * 2 ** 8
        exact_steps = ((exact.bfloat16().float() - want).abs() / (want.abs() + 1)).max().item() * 2 ** 8
        print(f"{shape} lift {lift}: {steps:.2f} units from the reference (float32-exact: {exact_steps:.2f})",
              flush=True)
        if not steps <= 2.0:
            failures.append(f"{shape} lift {lift}: a bfloat16 model's BatchNorm output {steps:.2f} units of "
                            "2^-8·(|out| + 1) from its reference, more than one bfloat16 step")
    return failures


def float32_model_bf16_gradients() -> list[str]:
    """A float32 model's gradients under bf16 (cast_pass keeps x's bfloat16 copy for the backward):
    dx and dW in float32, the float32 sums of the bfloat16 operands, not rounded to bfloat16 on the
    way (a bfloat16 dW that autograd converted passed the gate's bf16 tolerance, and cost gemm_bn's
    training step 0.21 of 1.13 ms at 2048×8192², H100)."""
    from autofuse.tuning.gate import build_case

    failures = []
    for name, mode in (("matmul_gelu_softmax", "train"), ("matmul_clamp_lse_mish", "train"), ("gemm_bn", "train"),
                       ("gemm_bn", "eval")):
        prob = registry.get_problem(name)
        variant = registry.get_variant(name, "triton")("bf16", **CONFIGS["grid-tma"], operands="cast_pass")
        shape = dict(zip(prob.dims, (37, 40, 33)))
        model, x = build_case(prob, CheckCase(shape, "randn", 5, False), "cpu", torch.float32, mode)
        x.requires_grad_(True)
        out = variant(model, x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
        for what, grad in (("dx", x.grad), ("dW", prob.linear_of(model).weight.grad)):
            rounded = torch.equal(grad, grad.bfloat16().float())
            print(name, mode, what, grad.dtype, "every element a bfloat16" if rounded else "float32 sums", flush=True)
            if grad.dtype != torch.float32 or rounded:
                failures.append(f"{name} {mode}: a float32 model's {what} under bf16 is {grad.dtype}"
                                f"{', every element a bfloat16 (rounded on the way)' if rounded else ''}")
    return failures


def build_case_bf16(prob, shape, lift):
    """The gate's bfloat16 model of ``prob`` at ``shape`` (default init, randn input), linear's bias
    shifted by ``lift`` so that most logits sit near the clamp (z near log(hidden) + 10)."""
    from autofuse.tuning.gate import build_case

    model, x = build_case(prob, CheckCase(shape, "randn", 5, False), "cpu", torch.bfloat16, "train")
    with torch.no_grad():
        model.matmul.bias += lift
    return model, x


def _kernelbench_bf16(tmp, export_kernelbench) -> list[str]:
    """22's export at --precision bf16 at small sizes, run on a bfloat16 model and input."""
    table = tmp / "matmul_clamp_lse_mish.json"
    out_file = tmp / "kb22.py"
    lines = export_kernelbench("matmul_clamp_lse_mish", out_file, table=table, precision="bf16")
    text = out_file.read_text()
    for name, size in (("batch_size", 37), ("input_size", 40), ("hidden_size", 33)):
        text = text.replace(f"\n{name} = ", f"\n{name} = {size}  # ", 1)
    context = {}
    exec(compile(text, "<custom>", "exec"), context)
    model = context["ModelNew"](*context["get_init_inputs"]()).bfloat16()
    x = context["get_inputs"]()[0].bfloat16()
    with torch.no_grad():
        info = model.dispatch_info(x)
    print("KernelBench export at bf16:", lines, info, flush=True)
    if info["variant"] != "triton":
        return [f"the bf16 KernelBench export ran {info} for a bfloat16 model"]
    return []


def wide_gradients() -> list[str]:
    """The fp32 backward's GEMMs (``triton_backward.Fp16Gemms``) on wide rows of x, of W and of dy
    (their columns too: dW contracts over the batch), M = 1e4 ... 1e30, with and without the
    entries they multiply zeroed (``autofuse.testing.wide_gradient_inputs``), batch 1 and odd sizes, both schedules:
    dx and dW within 2x a float32 matmul's relative error against float64 (or 2⁻²², the split's own
    accuracy per element, where float32 is exact to less). Without the range check the zeroed
    cases lose up to all of the result (M = 1e12: errors of order 1)."""
    from autofuse.kernels.triton import backward as triton_backward
    from autofuse.testing import wide_gradient_inputs

    failures = []
    for config, params in CONFIGS.items():
        gemms = triton_backward.Fp16Gemms(params)
        for (m, n, k), side, span, ratio, zeroed in itertools.product(((1, 40, 33), (37, 40, 33)), ("x", "W", "dy"),
                                                                      ("two", "all"), WIDE_RATIOS, (True, False)):
            if m == 1 and span == "two":
                continue  # one row: "two" would be "all"
            dy, x, w = wide_gradient_inputs(m, n, k, side, span, ratio, zeroed, torch.Generator().manual_seed(m + n))
            dx, dw = gemms(autograd.GemmGrad(dy, None, None), x, w, "fp32", True, True, torch.float32)
            for name, got, a, b in (("dx", dx, dy, w), ("dW", dw, dy.t(), x)):
                exact = a.double() @ b.double()
                if exact.norm() == 0:
                    continue  # zeroed away entirely (batch 1)
                error, floor = err_of(got, exact), err_of(a @ b, exact)
                what = f"{config} {(m, n, k)} {side} rows ({span}) wide by {ratio:.0e}{' zeroed' if zeroed else ''}"
                print(f"{what}: {name} {error:.3g} (float32 {floor:.3g})", flush=True)
                if not error <= max(2 * floor, 2.0 ** -22):
                    failures.append(f"{what}: {name} relative error {error:.3g} > 2x float32's {floor:.3g}")
    return failures


def wide_gate(problem: str, config: str) -> list[str]:
    """The tuner's gate on its "wide" case with gradients, fp32 (split_fp16), every mode, batch 2 and
    an odd batch: x's and W's outliers in every other row, so the backward's columns are wide and
    the cotangent quiet where they would carry the gradient (``Problem.quiet_wide_cotangent``)."""
    prob = registry.get_problem(problem)
    failures = []
    variant = registry.get_variant(problem, "triton")("fp32", **CONFIGS[config], operands="split_fp16")
    for batch, mode in itertools.product((2, 37), ("train", "eval") if prob.mode_sensitive else ("train",)):
        shape = dict(zip(prob.dims, (batch, 80, 66)))
        # the gate's order: the after-an-update check runs on the first case (a wide W updated by
        # noise of its own spread overflows BatchNorm's float32 variance, for eager too)
        cases = [CheckCase(shape, "rand", 13, False), CheckCase(shape, "wide", 13, True)]
        result = check_variant(variant, prob, cases, "cpu", autograd=True, mode=mode)
        print(problem, config, shape, mode, result.ok, f"{result.error:.3g}", flush=True)
        if not result.ok:
            failures.append(f"{problem} {config} {shape} {mode}: {result.reason}")
    return failures


def _gradient_flag_cases() -> dict:
    """name: (dy, x, W, flagged rows of dy, columns of W, of dy, of x); 256 rows, 1024 columns.
    Ordinary inputs first (nothing flagged), then one wide row of x, of W or of dy (1e8, 16 entries)
    whose partners are zero (as ``wide_gradient_inputs`` zeroes them), which flags its row or columns."""
    generator = torch.Generator().manual_seed(3)
    m, n, k = 256, 1024, 1024

    def randn(*size):
        return torch.randn(*size, generator=generator)

    def ordinary(dy, x):
        return dy, x, randn(n, k) / k ** 0.5, [], [], [], []

    cases = {"randn": ordinary(randn(m, n), randn(m, k)), "rand": ordinary(torch.rand(m, n, generator=generator),
                                                                         torch.rand(m, k, generator=generator)),
             "large": ordinary(100 * randn(m, n), 100 * randn(m, k)),
             # batch 1: dW = dyᵀ·x is one product an element, so every column of dy and x is flagged
             # by the few-terms rule (the split's ~2⁻²³ against float32's exact product)
             "relu x, batch 1": (randn(1, n), randn(1, k).clamp_min(0), randn(n, k) / k ** 0.5, [], [],
                                 list(range(n)), list(range(k))),
             "softmax-like dy": ordinary(torch.softmax(4 * randn(m, n), dim=1) * randn(m, n), randn(m, k))}
    outliers = randn(m, k)
    outliers[:, :16] *= 1e8
    cases["outlier features of x"] = ordinary(randn(m, n), outliers)
    wide = torch.arange(16) * 61
    dy, x, w = randn(m, n), randn(m, k), randn(n, k) / k ** 0.5
    x[7, wide] *= 1e8
    dy[7] = 0.0
    cases["wide x row"] = (dy, x, w, [], [], [], wide.tolist())
    dy, x, w = randn(m, n), randn(m, k), randn(n, k) / k ** 0.5
    w[5, wide] *= 1e8
    dy[:, 5] = 0.0
    cases["wide W row"] = (dy, x, w, [], wide.tolist(), [], [])
    dy, x, w = randn(m, n), randn(m, k), randn(n, k) / k ** 0.5
    dy[9, wide] *= 1e8
    w[wide] = 0.0
    x[9] = 0.0
    cases["wide dy row"] = (dy, x, w, [9], [], wide.tolist(), [])
    return cases


def wide_gradients_flags() -> list[str]:
    """The backward's range check flags by effect: ordinary dy, x and W at 256 × 1024 (rand, randn,
    large, a softmax-like dy, x with outlier features on every row) leave every row and column
    unflagged, and at batch 1 (ReLU-like x) every column of dy and x is (the few-terms rule); a
    wide row of x, W or dy whose partners are zero flags exactly the rows (dy's, dx) and columns
    (W's, dx; dy's and x's, dW) that hold its wide entries. The checked scales equal the unchecked
    ones in magnitude."""
    from autofuse.kernels.triton import backward as triton_backward
    from autofuse.kernels.triton import host

    failures = []
    for name, (dy, x, w, *want) in _gradient_flag_cases().items():
        columns = triton_backward.weight_columns(w)
        dy_rows, w_cols = triton_backward.dx_operands(dy, columns)
        dy_cols, x_cols = triton_backward.dw_operands(dy, x)
        got = [(scales[2] < 0).nonzero().flatten().tolist() for scales in (dy_rows, w_cols, dy_cols, x_cols)]
        print(name, "flagged: dy rows, W columns, dy columns, x columns", got, flush=True)
        if got != want:
            failures.append(f"{name}: flagged {got}, want {want} (dy rows, W columns, dy columns, x columns)")
        plain = (host.fp16_parts(dy, True), *(triton_backward.column_parts(t, True) for t in (w, dy, x)))
        for checked, unchecked in zip((dy_rows, w_cols, dy_cols, x_cols), plain):
            if not all(torch.equal(c, u) for c, u in zip(checked[:2], unchecked[:2])) or not torch.equal(
                    checked[2].abs(), unchecked[2]):
                failures.append(f"{name}: the checked parts or scales differ from the unchecked ones")
    return failures


def exact_path_sum() -> list[str]:
    """The exact path (``gemm.exact_tile``) on rows carried by a few large terms: W's rows 16 entries
    1e6 times the rest (flagged by the count rule, so every tile takes it), x ordinary, K = 4096.
    Each k-slice's sum is added to a running sum ~1e4; added plainly (the slices' float32 sums,
    emulated here), every later slice rounds at that scale: on the H100 the softmax over such rows
    (99) erred 2.1x cuBLAS fp32's. The kernel keeps each addition's rounding error: its error must
    stay under half the plain sum's and under torch's float32 matmul's, against float64."""
    from autofuse.kernels.triton import backward as triton_backward
    from autofuse.kernels.triton import host

    generator = torch.Generator().manual_seed(4)
    k = 4096
    x, w = torch.randn(5, k, generator=generator), torch.randn(24, k, generator=generator) / k ** 0.5
    w[:, torch.randperm(k, generator=generator)[:16]] *= 1e6
    parts, check = host.fp16_weight_parts(w, True)
    xs, ws = host.fp16_input_parts(x, True, parts, check)
    if not bool((ws[2] < 0).all()):
        return ["W's wide rows are not all flagged: the exact path is not what this measures"]
    ref = x.double() @ w.double().t()
    plain = torch.zeros(5, 24)
    for start in range(0, k, host.EXACT_K):  # the slices' sums added as they come, in float32
        plain = plain + x[:, start:start + host.EXACT_K] @ w[:, start:start + host.EXACT_K].t()
    out = triton_backward.Fp16Gemms(CONFIGS["persistent-pointers"]).matmul(xs, ws)
    errors = {name: err_of(t, ref) for name, t in (("kernel", out), ("plain slices", plain), ("torch", x @ w.t()))}
    print(", ".join(f"{name} {e:.3g}" for name, e in errors.items()), flush=True)
    if not (errors["kernel"] <= 0.5 * errors["plain slices"] and errors["kernel"] <= errors["torch"]):
        return [f"exact path on rows carried by a few large terms: {errors}"]
    return []


def lucky_floor() -> list[str]:
    """22's x-gradient at batch 1 on large inputs, seed 21 (tests/test_gate_floors.py), where plain
    PyTorch's float32 error cancelled to a lucky 2e-5: both split paths pass the gate with both
    floors. Whether they fail with eager's floor alone is printed, not required: it rests on the
    interpreter's float32 products, which numpy's BLAS sums in an order it picks by CPU (the split
    kernels' gradient was 1.0e-4 off and failed it on the machines of earlier stops; on an AMD EPYC
    without AVX-512 it came within 4x the lucky error and passed). test_gate_floors.py shows the
    lucky floor failing a variant two float32 roundings off, in torch's arithmetic alone."""
    from autofuse.tuning import gate as gate_module

    prob = registry.get_problem("matmul_clamp_lse_mish")
    case = CheckCase(dict(zip(prob.dims, (1, 40, 53))), "large", 21, True)
    failures = []
    for operands, floors in itertools.product(("split_host", "split_fp16"), ("both", "eager's alone")):
        gate_module.PERTURBED_PRECISIONS = ("fp32", "ieee") if floors == "both" else ()
        variant = registry.get_variant(prob.name, "triton")("fp32", **CONFIGS["grid-tma"], operands=operands)
        result = check_variant(variant, prob, [case], "cpu", autograd=True)
        print(operands, floors, result.ok, result.reason, flush=True)
        if floors == "both" and not result.ok:
            failures.append(f"{operands} with both floors: {result.reason}")
    return failures

if __name__ == "__main__":
    check, *args = sys.argv[1:]
    problems = {"gate": gate, "backward_kernels": backward_kernels,
                "avgpool_backward": avgpool_backward, "mutant_fails": mutant_fails,
                "exp_nonpositive": exp_nonpositive, "lse_mish_output": lse_mish_output,
                "tf32_operands": tf32_operands, "tf32_round_in_the_kernel": tf32_round_in_the_kernel,
                "fp16_operands": fp16_operands, "fp16_backward_gemms": fp16_backward_gemms,
                "transpose": transpose, "whole_row_tiles": whole_row_tiles, "wide_rows": wide_rows,
                "wide_rows_flags": wide_rows_flags,
                "wide_gradients": wide_gradients, "wide_gradients_flags": wide_gradients_flags,
                "wide_gate": wide_gate, "bn_without_running_stats": bn_without_running_stats,
                "eval_after_training": eval_after_training, "one_tile_training": one_tile_training,
                "exact_path_sum": exact_path_sum, "lucky_floor": lucky_floor,
                "bf16_model_serving": bf16_model_serving,
                "bf16_model_rounds_as_the_reference": bf16_model_rounds_as_the_reference,
                "finish_inside": finish_inside, "float32_model_bf16_gradients": float32_model_bf16_gradients,
                "bf16_model_bn_rounds_as_the_reference": bf16_model_bn_rounds_as_the_reference}
    found = problems[check](*args)
    for line in found:
        print("FAIL:", line)
    sys.exit(1 if found else 0)
