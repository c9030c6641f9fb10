"""``autofuse bench``: every way to compute a problem, measured side by side in one run.

Rows: eager; what a user would pick instead, ``torch.compile`` in its default and
``max-autotune-no-cudagraphs`` modes and, under bf16, a compiled copy of the model cast to
bf16 once; each variant's best tuned configuration (from the dispatch table; the default
configuration where the shape was not tuned); the tuned dispatch itself (``get_module``);
and the floor: cuBLAS's GEMM alone at the same precision for GEMM-bound problems, or the
problem's minimum bytes moved at the measured copy bandwidth where the algebra removes the
GEMM. Every variant passes the correctness gate before it is timed.

A bfloat16 model (``dtype="bfloat16"``, under bf16 only) is the model cast with
``model.bfloat16()`` and fed bfloat16 inputs: its rows are the eager bfloat16 model, torch.compile
of it, each variant that admits a bfloat16 model (configured from the table's ``dtype=bfloat16``
entries), the dispatch cast to bfloat16 (served by those keys), and cuBLAS's GEMM alone on the
same bfloat16 operands. ``autofuse.bench.sweep`` measures a few of these rows at many batches.

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

import torch

from autofuse.bench.floors import floor_row
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
from autofuse.bench.setup import STEPS, Setup, check_step, dispatch_call, make_setup, resolve_dtype  # noqa: F401
from autofuse.bench.targets import FLOOR, FORWARD, TARGETS, TRAINING  # noqa: F401
from autofuse.core import registry
from autofuse.core.precision import dtype_name, math_mode
from autofuse.core.variant import EagerVariant
from autofuse.errors import InputError
from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, serving_devices, shape_key
from autofuse.tuning import placement
from autofuse.tuning.gate import check_cases, check_variant
from autofuse.tuning.timing import time_interleaved

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
KNOWN_COMPILE_MODES = COMPILE_MODES + ("max-autotune", "reduce-overhead")  # torch.compile's own modes


def bench(problem: str, shape=None, *, device: str | None = None, precision: str | None = None, mode: str | None = None,
          table=None, rounds: int = 20, use_compile: bool = True, compile_modes=COMPILE_MODES, step: str = FORWARD,
          skip_variants=(), dtype: str = "float32") -> list[BenchReport]:
    """One report per shape (default: the problem's default shapes, CPU-sized ones on the CPU:
    ``placement``). ``precision`` defaults to bf16 for a bfloat16 model, else fp32.
    ``use_compile=False`` leaves every compiled row out, the ``compiled`` kind's variant too;
    ``skip_variants`` leaves those variants' rows out."""
    prob = registry.get_problem(problem)
    asked, device = device, placement.resolve_device(device)
    dtype, precision = resolve_dtype(dtype, precision)
    check_step(step)
    check_rounds(rounds)
    modes = check_compile_modes(compile_modes) if use_compile else ()
    mode = (mode or "train") if prob.mode_sensitive else "any"
    table = table if isinstance(table, DispatchTable) else DispatchTable(table)
    shapes = placement.shapes_to_run(prob, shape, device, asked)
    skip = set(skip_variants)
    if not use_compile:  # the `compiled` variant is torch.compile too (test_bad_input)
        skip |= {name for name, cls in registry.variants(prob.name).items() if cls.kind == "compiled"}
    settings = {"device": device, "dtype": dtype, "precision": precision, "mode": mode, "step": step}
    return [_bench_shape(prob, s, settings, table, rounds, modes, skip) for s in shapes]


def check_rounds(rounds) -> None:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:  # 0: StatisticsError from the timing
        raise InputError(f"rounds (--rounds) must be an int >= 1, got {rounds!r}")


def check_compile_modes(compile_modes) -> tuple[str, ...]:
    unknown = [m for m in compile_modes if m not in KNOWN_COMPILE_MODES]
    if unknown:
        raise InputError(f"torch.compile modes are {KNOWN_COMPILE_MODES}, got {unknown}")
    return tuple(compile_modes)


def _bench_shape(prob, shape: dict, settings: dict, table, rounds, compile_modes, skip) -> BenchReport:
    setup = make_setup(prob, shape, **settings)
    if compile_modes:
        # Dynamo caches compiled code per code object (the Model class's forward) and recompiles
        # for each mode, precision (TF32 is in its guards) and step; past its recompile limit it
        # would silently run eager. A fresh start per report keeps every compiled row compiled.
        torch._dynamo.reset()
    fingerprint = current_fingerprint(setup.device)
    entries = _entries(table, fingerprint, setup)
    float_input = setup.dtype == torch.float32
    rows = [(BenchRow("eager", "baseline", {}), setup.timed(EagerVariant(setup.precision)))]
    rows += [compiled_row(setup, compile_mode) for compile_mode in compile_modes]
    if compile_modes and setup.precision == "bf16" and setup.step == FORWARD and float_input:
        rows.append(_bf16_copy_row(setup))
    rows += [_variant_row(setup, cls, entries) for cls in _benched_variants(setup, skip)]
    rows += [dispatch_row(setup, table), floor_row(setup)]
    if setup.precision == "bf16" and setup.prob.floor == "gemm" and setup.step == FORWARD and float_input:
        rows.append((BenchRow("cast x to bf16", "reference", {},
                              note="the input's cast alone: a float32-input variant pays it on top of the floor"),
                     setup.x.bfloat16))
    timings = time_interleaved({row.candidate: call for row, call in rows if call is not None}, setup.device, rounds=rounds)
    for row, _ in rows:
        row.timing = timings.get(row.candidate)
    return BenchReport(setup.prob.name, setup.shape, setup.precision, setup.mode, fingerprint, [row for row, _ in rows],
                       setup.step, now_utc(), dtype_name(setup.dtype))


def _entries(table, fingerprint, setup: Setup) -> dict[str, dict]:
    """The table's entries for this key by step (forward, and the autograd entry's training step)."""
    found, dtype = {}, dtype_name(setup.dtype)
    try:  # as get_module asks: this device's section, then its siblings' (table.serving_devices)
        sections = serving_devices(table.load()["devices"], fingerprint)
    except Exception:  # noqa: BLE001 - an unreadable table means "untuned" here
        sections = []
    for step, autograd in ((FORWARD, False), (TRAINING, True)):
        key = DispatchKey(dtype, setup.precision, setup.mode, autograd=autograd)
        found[step] = next((entry for section in sections
                            if (entry := table.lookup(section, setup.prob.name, shape_key(setup.shape), key))), {})
    return found


def warmed(row: BenchRow, call):
    """``(row, call)`` after one call (for a compiled row: the compilation, under the row's math
    mode); a call that fails is the row's note, not the end of the bench."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        row.note = f"failed: {exc}"[:200]
        return row, None
    return row, call


def compiled_name(compile_mode: str) -> str:
    return "torch.compile" if compile_mode == "default" else f"torch.compile {compile_mode.removesuffix('-no-cudagraphs')}"


def compiled_row(setup: Setup, compile_mode: str, name: str | None = None, **options):
    """torch.compile of a copy of the model (a bfloat16 model's copy is bfloat16 too), called as
    eager is (autocast under bf16 for a float32 model). Compiled at its first call, inside
    ``math_mode(precision)``: inductor bakes TF32 into its kernels. ``options`` go to torch.compile."""
    compiled = torch.compile(copy.deepcopy(setup.model), mode=compile_mode, **options)
    row = BenchRow(name or compiled_name(compile_mode), "baseline", {"mode": compile_mode})
    return warmed(row, setup.timed(EagerVariant(setup.precision), compiled))


def _bf16_copy_row(setup: Setup):
    """A compiled copy of the float32 model cast to bfloat16 once; each call casts x and returns float32."""
    compiled = torch.compile(copy.deepcopy(setup.model).to(torch.bfloat16))

    def run(model, x):
        with math_mode("bf16"):
            return model(x.to(torch.bfloat16)).float()
    return warmed(BenchRow(BF16_COPY, "baseline", {"mode": "default"}, note="weights cast once, x per call"),
                  setup.timed(run, compiled))


def _benched_variants(setup: Setup, skip: set) -> list[type]:
    """Every variant admitted at this dtype and precision (and with autograd for a training step), simplest first."""
    autograd = setup.step == TRAINING
    return [cls for name, cls in sorted(registry.variants(setup.prob.name).items(), key=lambda item: (item[1].rank(), item[0]))
            if name != "eager" and name not in skip
            and cls.admits(setup.device_type, setup.dtype, setup.precision, autograd) is None]


def _tuned_params(entries: dict, name: str, step: str) -> tuple[dict | None, str]:
    """The configuration tuned for variant ``name`` in this step's entry, else in the forward's."""
    for source, label in ((entries[step], "tuned"), (entries[FORWARD], "tuned for the forward")):
        params = (source.get("candidates") or {}).get(name, {}).get("params")
        if params is None and source.get("variant") == name:
            params = source.get("params")
        if params is not None:
            return params, label
    return None, ""


def _variant_row(setup: Setup, cls, entries: dict):
    configs = cls.configs_for(setup.shape, setup.device_type, setup.precision)
    if not configs:
        return BenchRow(cls.name, "variant", {}, note="no valid configuration at this shape"), None
    tuned, label = _tuned_params(entries, cls.name, setup.step)
    params = tuned if tuned in configs else configs[0]
    note = label if tuned == params else "default configuration (not tuned)"
    variant = cls(setup.precision, **params)
    try:
        variant.build(setup.device)
        result = check_variant(variant, setup.prob, check_cases(setup.prob, setup.shape, seed=7), setup.device,
                               dtype=setup.dtype, mode=setup.mode, autograd=setup.step == TRAINING)
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
        return BenchRow(cls.name, "variant", params, note=f"failed: {exc}"[:200]), None
    if not result.ok:
        return BenchRow(cls.name, "variant", params, note=f"incorrect: {result.reason}"[:200]), None
    return BenchRow(cls.name, "variant", params, note=note), setup.timed(variant)


def dispatch_row(setup: Setup, table):
    """``get_module``'s module, called as a user would (``autofuse.bench.setup.dispatch_call``);
    the row's note says which entry serves the call."""
    info, call = dispatch_call(setup, table)
    return BenchRow(DISPATCH, "dispatch", info["params"], note=f"{info['variant']} ({info['source']})"), call
