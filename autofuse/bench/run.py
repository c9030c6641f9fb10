"""``autofuse bench``: every way to compute a problem, measured side by side in one run.

Rows: eager; what a user would pick instead, ``torch.compile`` in its default and
``max-autotune-no-cudagraphs`` modes and, under bf16, a compiled copy of the model cast to
bf16 once; each variant's best tuned configuration (from the dispatch table; the default
configuration where the shape was not tuned); the tuned dispatch itself (``get_module``);
and the floor: cuBLAS's GEMM alone at the same precision for GEMM-bound problems, or the
problem's minimum bytes moved at the measured copy bandwidth where the algebra removes the
GEMM. Every variant passes the correctness gate before it is timed.

A ``forward`` report times inference; a ``forward+backward`` report times a training step
(``autofuse.tuning.timed_call``): only autograd-capable variants, gated with gradients, the dispatch in
grad mode (the ``autograd=true`` entry), and a floor that adds the backward's own minimum:
the weight-gradient GEMM (under tf32 from K-major operands), or reading the upstream gradient
and x and writing each parameter's gradient once. Timing is ``time_interleaved``: CUDA events,
L2 flushed, medians with p20/p80, all candidates round-robin. Variants run in this process:
bench measures candidates the tuner already isolated and checked. The reports and their
Markdown are ``bench_report``'s.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from autofuse.bench.report import (  # noqa: F401 - re-exported: the CLI and plugins import them from here
    ANALYSIS_FILE,
    BF16_COPY,
    DISPATCH,
    BenchReport,
    BenchRow,
    load,
    markdown,
    now_utc,
    save,
)
from autofuse.bench.targets import FLOOR, FORWARD, TARGETS, TRAINING  # noqa: F401
from autofuse.core import registry
from autofuse.core.precision import check_dtype, linear, math_mode
from autofuse.core.problem import Problem
from autofuse.core.variant import EagerVariant
from autofuse.errors import InputError
from autofuse.serve.runtime import get_module
from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, fingerprint_key, shape_key
from autofuse.tuning import placement
from autofuse.tuning.gate import CheckCase, build_case, check_cases, check_variant
from autofuse.tuning.timed_call import forward_call, training_call
from autofuse.tuning.timing import time_interleaved

STEPS = (FORWARD, TRAINING)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
KNOWN_COMPILE_MODES = COMPILE_MODES + ("max-autotune", "reduce-overhead")  # torch.compile's own modes


@dataclasses.dataclass
class _Setup:
    """One report's problem, shape and settings, its model and input, and how a call is timed."""

    prob: Problem
    shape: dict
    device: str
    precision: str
    mode: str
    step: str
    model: nn.Module
    x: torch.Tensor
    upstream: dict = dataclasses.field(default_factory=dict)  # one upstream gradient for every row

    def timed(self, run, model: nn.Module | None = None):
        """``run(model, x)`` as the call to time: a forward, or a training step."""
        model = self.model if model is None else model
        if self.step == FORWARD:
            return forward_call(run, model, self.x)
        return training_call(run, model, self.x, self.upstream, self.precision)


def bench(problem: str, shape=None, *, device: str | None = None, precision: str = "fp32", mode: str | None = None,
          table=None, rounds: int = 20, use_compile: bool = True, compile_modes=COMPILE_MODES, step: str = FORWARD,
          skip_variants=()) -> list[BenchReport]:
    """One report per shape (default: the problem's default shapes, CPU-sized ones on the CPU:
    ``placement``). ``use_compile=False`` leaves every compiled row out, the ``compiled`` kind's
    variant too; ``skip_variants`` leaves those variants' rows out."""
    prob = registry.get_problem(problem)
    asked, device = device, placement.resolve_device(device)
    check_dtype(torch.float32, precision)
    if step not in STEPS:
        raise InputError(f"step must be one of {STEPS}, got {step!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:  # 0: StatisticsError from the timing
        raise InputError(f"rounds (--rounds) must be an int >= 1, got {rounds!r}")
    unknown = [m for m in compile_modes if m not in KNOWN_COMPILE_MODES]
    if use_compile and unknown:
        raise InputError(f"torch.compile modes are {KNOWN_COMPILE_MODES}, got {unknown}")
    mode = (mode or "train") if prob.mode_sensitive else "any"
    table = table if isinstance(table, DispatchTable) else DispatchTable(table)
    shapes = placement.shapes_to_run(prob, shape, device, asked)
    modes = tuple(compile_modes) if use_compile else ()
    skip = set(skip_variants)
    if not use_compile:  # the `compiled` variant is torch.compile too (test_bad_input)
        skip |= {name for name, cls in registry.variants(prob.name).items() if cls.kind == "compiled"}
    return [_bench_shape(prob, s, device, precision, mode, step, table, rounds, modes, skip) for s in shapes]


def _bench_shape(prob, shape, device, precision, mode, step, table, rounds, compile_modes, skip) -> BenchReport:
    if compile_modes:
        # Dynamo caches compiled code per code object (the Model class's forward) and recompiles
        # for each mode, precision (TF32 is in its guards) and step; past its recompile limit it
        # would silently run eager. A fresh start per report keeps every compiled row compiled.
        torch._dynamo.reset()
    model, x = build_case(prob, CheckCase(shape, "rand", 0, False), device, torch.float32, mode)
    setup = _Setup(prob, shape, device, precision, mode, step, model, x)
    fingerprint = current_fingerprint(device)
    entries = _entries(table, fingerprint, prob, shape, precision, mode)
    rows = [(BenchRow("eager", "baseline", {}), setup.timed(EagerVariant(precision)))]
    rows += [_compiled_row(setup, compile_mode) for compile_mode in compile_modes]
    if compile_modes and precision == "bf16" and step == FORWARD:
        rows.append(_bf16_copy_row(setup))
    rows += [_variant_row(setup, cls, entries) for cls in _benched_variants(setup, skip)]
    rows += [_dispatch_row(setup, table), _floor_row(setup)]
    if precision == "bf16" and prob.floor == "gemm" and step == FORWARD:
        rows.append((BenchRow("cast x to bf16", "reference", {},
                              note="the input's cast alone: a float32-input variant pays it on top of the floor"), x.bfloat16))
    timings = time_interleaved({row.candidate: call for row, call in rows if call is not None}, device, rounds=rounds)
    for row, _ in rows:
        row.timing = timings.get(row.candidate)
    return BenchReport(prob.name, shape, precision, mode, fingerprint, [row for row, _ in rows], step, now_utc())


def _entries(table, fingerprint, prob, shape, precision, mode) -> dict[str, dict]:
    """The table's entries for this key by step (forward, and the autograd entry's training step)."""
    found = {}
    for step, autograd in ((FORWARD, False), (TRAINING, True)):
        try:
            found[step] = table.lookup(fingerprint_key(fingerprint), prob.name, shape_key(shape),
                                       DispatchKey("float32", precision, mode, autograd=autograd)) or {}
        except Exception:  # noqa: BLE001 - an unreadable table means "untuned" here
            found[step] = {}
    return found


def _warmed(row: BenchRow, call):
    """``(row, call)`` after one call (for a compiled row: the compilation, under the row's math
    mode); a call that fails is the row's note, not the end of the bench."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        row.note = f"failed: {exc}"[:200]
        return row, None
    return row, call


def _compiled_row(setup: _Setup, compile_mode: str):
    """torch.compile of a copy of the model, called as eager is (autocast under bf16). Compiled
    at its first call, inside ``math_mode(precision)``: inductor bakes TF32 into its kernels."""
    name = "torch.compile" if compile_mode == "default" else f"torch.compile {compile_mode.removesuffix('-no-cudagraphs')}"
    compiled = torch.compile(copy.deepcopy(setup.model), mode=compile_mode)
    return _warmed(BenchRow(name, "baseline", {"mode": compile_mode}), setup.timed(EagerVariant(setup.precision), compiled))


def _bf16_copy_row(setup: _Setup):
    """A compiled copy of the model cast to bfloat16 once; each call casts x and returns float32."""
    compiled = torch.compile(copy.deepcopy(setup.model).to(torch.bfloat16))

    def run(model, x):
        with math_mode("bf16"):
            return model(x.to(torch.bfloat16)).float()
    return _warmed(BenchRow(BF16_COPY, "baseline", {"mode": "default"}, note="weights cast once, x per call"),
                   setup.timed(run, compiled))


def _benched_variants(setup: _Setup, skip: set) -> list[type]:
    """Every variant admitted at this precision (and with autograd for a training step), simplest first."""
    device_type, autograd = torch.device(setup.device).type, setup.step == TRAINING
    return [cls for name, cls in sorted(registry.variants(setup.prob.name).items(), key=lambda item: (item[1].rank(), item[0]))
            if name != "eager" and name not in skip
            and cls.admits(device_type, torch.float32, setup.precision, autograd) is None]


def _tuned_params(entries: dict, name: str, step: str) -> tuple[dict | None, str]:
    """The configuration tuned for variant ``name`` in this step's entry, else in the forward's."""
    for source, label in ((entries[step], "tuned"), (entries[FORWARD], "tuned for the forward")):
        params = (source.get("candidates") or {}).get(name, {}).get("params")
        if params is None and source.get("variant") == name:
            params = source.get("params")
        if params is not None:
            return params, label
    return None, ""


def _variant_row(setup: _Setup, cls, entries: dict):
    configs = cls.configs_for(setup.shape, torch.device(setup.device).type, setup.precision)
    if not configs:
        return BenchRow(cls.name, "variant", {}, note="no valid configuration at this shape"), None
    tuned, label = _tuned_params(entries, cls.name, setup.step)
    params = tuned if tuned in configs else configs[0]
    note = label if tuned == params else "default configuration (not tuned)"
    variant = cls(setup.precision, **params)
    try:
        variant.build(setup.device)
        result = check_variant(variant, setup.prob, check_cases(setup.prob, setup.shape, seed=7), setup.device,
                               mode=setup.mode, autograd=setup.step == TRAINING)
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
        return BenchRow(cls.name, "variant", params, note=f"failed: {exc}"[:200]), None
    if not result.ok:
        return BenchRow(cls.name, "variant", params, note=f"incorrect: {result.reason}"[:200]), None
    return BenchRow(cls.name, "variant", params, note=note), setup.timed(variant)


def _dispatch_row(setup: _Setup, table):
    """``get_module``'s module, called as a user would: without grad, or (a training step) with
    its parameters requiring grad in grad mode, which takes the ``autograd=true`` entry."""
    prob, model = setup.prob, setup.model
    args, kwargs = prob.init_args(setup.shape)
    module = get_module(prob.name, *args, table=table, precision=setup.precision, tune_on_miss=False, **kwargs)
    module.load_state_dict(model.state_dict())
    module.to(setup.x.device).train(model.training)
    for attr in ("scale_factor", "clamp_min", "clamp_max"):  # plain attributes the state_dict omits
        if hasattr(model, attr):
            setattr(module, attr, getattr(model, attr))
    with torch.set_grad_enabled(setup.step == TRAINING):
        info = module.dispatch_info(setup.x)
    row = BenchRow(DISPATCH, "dispatch", info["params"], note=f"{info['variant']} ({info['source']})")
    return row, setup.timed(lambda m, inp: m(inp), module)


def _floor_row(setup: _Setup):
    if setup.prob.floor == "memory":
        return _memory_floor(setup)
    weight = setup.prob.linear_of(setup.model).weight.detach()
    x, precision, training = setup.x, setup.precision, setup.step == TRAINING
    # A training step's GEMMs: the forward's, then the weight's gradient from the GEMM's upstream gradient.
    grad_y = torch.randn(x.shape[0], weight.shape[0], device=x.device) if training else None
    what = "forward GEMM + weight-gradient GEMM" if training else "GEMM"
    if precision == "bf16":
        # The strictest floor: operands already in bfloat16, a bfloat16 result. A variant fed
        # float32 inputs still pays for casting x, which this floor does not.
        xb, wb = x.bfloat16(), weight.bfloat16()
        gb = grad_y.bfloat16() if training else None
        note = f"cuBLAS {what} alone (bf16 operands and result)"
        return BenchRow(FLOOR, "floor", {}, note=note), (lambda: (xb @ wb.t(), gb.t() @ xb) if training else xb @ wb.t())

    # The weight gradient dyᵀ·x from the operands' fastest layout, made before the clock starts:
    # under tf32, K-major copies (Hopper's TF32 tensor cores read K-major only: 0.397 ms against
    # 0.569 as laid out, 1024×8192×8192, H100); in float32 FMA the layout as it comes is as fast.
    k_major = training and precision == "tf32" and x.is_cuda
    grad_t, x_t = (grad_y.t().contiguous(), x.t().contiguous()) if k_major else (None, None)

    def gemms():
        with math_mode(precision):
            y = linear(x, weight, None, precision)
            if not training:
                return y
            return y, (grad_t @ x_t.t() if k_major else grad_y.t() @ x)
    arithmetic = "tf32" if precision == "tf32" else "float32 FMA"
    return BenchRow(FLOOR, "floor", {}, note=f"cuBLAS {what} alone ({arithmetic})"), gemms


def _memory_floor(setup: _Setup):
    """Copy the bytes no implementation can avoid moving: the forward's input and output and,
    for a training step, also reading the upstream gradient and x and writing each parameter's
    gradient once (x does not require grad: autofuse.tuning.timed_call)."""
    nbytes = setup.prob.memory_floor_bytes(setup.shape)
    what = "read + write"
    if setup.step == TRAINING:
        with torch.no_grad():
            out = copy.deepcopy(setup.model)(setup.x)
        size = setup.x.element_size()
        nbytes += size * (out.numel() + setup.x.numel() + sum(p.numel() for p in setup.model.parameters() if p.requires_grad))
        what = "forward's read + write; upstream gradient and x read, parameter gradients written"
    buffer = torch.empty(nbytes // 8, dtype=torch.float32, device=setup.device)  # copying it moves nbytes
    return BenchRow(FLOOR, "floor", {}, note=f"copy of {nbytes / 1e6:.4g} MB ({what})"), buffer.clone
