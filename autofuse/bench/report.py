"""``autofuse bench``'s reports: rows, ratios, JSON in and out, charts, and the Markdown summary.

A report is one problem, shape, model dtype (float32, or a bfloat16 model), precision, mode and
step: ``forward`` (inference) or ``forward+backward`` (a training step, ``autofuse.tuning.timed_call``). Reports of several runs (one per
precision, say) are saved into one folder and rendered together (``--from-out``). The Markdown
is a summary (per precision and model dtype, one table against eager, torch.compile and the floor, how it was
measured, the command that reproduces it); every variant's row stays in the JSON and the charts.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib

from autofuse.bench.targets import FLOOR, FORWARD, target_for
from autofuse.serve.table import PRECISIONS, shape_key
from autofuse.tuning.timing import Timing

# An optional hand-written file in the results folder that says why targets were missed; the
# Markdown report includes it after the tables, so the explanation travels with the numbers.
ANALYSIS_FILE = "analysis.md"
BF16_COPY = "compiled bf16 copy"
DISPATCH = "autofuse dispatch"


@dataclasses.dataclass
class BenchRow:
    candidate: str
    role: str  # baseline, variant, dispatch, floor, or reference (a part of the work, for scale)
    params: dict
    timing: Timing | None = None
    note: str = ""


@dataclasses.dataclass
class BenchReport:
    problem: str
    shape: dict
    precision: str
    mode: str
    device: dict
    rows: list[BenchRow]
    step: str = FORWARD
    # When the run finished (UTC, ISO 8601 to the minute). Reports of several runs share a
    # folder and one BENCHMARKS.md, so the page says when they were measured; None in reports
    # saved before the field existed.
    measured: str | None = None
    dtype: str = "float32"  # the model's: "bfloat16" for a bfloat16 model (under bf16 only)

    def row(self, candidate: str) -> BenchRow | None:
        return next((r for r in self.rows if r.candidate == candidate), None)

    def ratio(self, row: BenchRow, to: str) -> float | None:
        other = self.row(to)
        if row.timing is None or other is None or other.timing is None:
            return None
        return other.timing.median_ms / row.timing.median_ms if to == "eager" else row.timing.median_ms / other.timing.median_ms

    @property
    def title(self) -> str:
        step = "" if self.step == FORWARD else f", {self.step}"
        return f"{self.problem} {shape_key(self.shape)} ({section(self.precision, self.dtype)}, {self.mode}{step})"

    def to_dict(self) -> dict:
        rows = [{"candidate": r.candidate, "role": r.role, "params": r.params, "note": r.note,
                 **(r.timing.to_dict() if r.timing else {}),
                 "speedup_vs_eager": self.ratio(r, "eager"), "x_floor": self.ratio(r, FLOOR)} for r in self.rows]
        return {"problem": self.problem, "shape": self.shape, "dtype": self.dtype, "precision": self.precision,
                "mode": self.mode, "step": self.step, "measured": self.measured, "device": self.device, "rows": rows}


def load(folder: str | pathlib.Path) -> list[BenchReport]:
    """The reports ``save`` wrote into ``folder`` (e.g. by one bench run per precision): the
    forward ones, then the forward+backward ones, each in file order.

    Other JSON there is passed over: benchmarks.sh keeps the dispatch table the runs tuned
    (``table.json``) beside the reports it was used for.
    """
    reports = []
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and {"problem", "rows"} <= data.keys()):
            continue
        rows = [row_of(r) for r in data["rows"]]
        reports.append(BenchReport(data["problem"], data["shape"], data["precision"], data["mode"], data["device"], rows,
                                   data.get("step", FORWARD), data.get("measured"), data.get("dtype", "float32")))
    return sorted(reports, key=lambda report: report.step != FORWARD)  # stable: file order within a step


def now_utc() -> str:
    """The ``measured`` stamp: the current UTC time, ISO 8601 to the minute."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def section(precision: str, dtype: str) -> str:
    """A report's precision, and "bfloat16 model" for one: its section of the summary."""
    return precision if dtype == "float32" else f"{precision}, {dtype} model"


def file_stem(problem: str, size, precision: str, dtype: str, mode: str, step: str) -> str:
    """The name a report is saved under: a float32 model's as it always was, a bfloat16 model's
    with its dtype, so the two never overwrite each other."""
    parts = [problem, str(size), precision] + ([] if dtype == "float32" else [dtype]) + [mode]
    return "-".join(parts) + ("" if step == FORWARD else "-fwdbwd")


def timing_of(row: dict) -> Timing | None:
    fields = ("median_ms", "p20_ms", "p80_ms", "reps")
    return Timing(*(row[f] for f in fields)) if all(row.get(f) is not None for f in fields) else None


def row_of(row: dict) -> BenchRow:
    """A row as ``to_dict`` wrote it."""
    return BenchRow(row["candidate"], row["role"], row["params"], timing_of(row), row.get("note", ""))


def save(reports: list[BenchReport], out: str | pathlib.Path) -> list[pathlib.Path]:
    """Write each report as JSON and, if matplotlib is installed, a PNG chart; return the chart paths."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    charts = []
    for report in reports:
        stem = file_stem(report.problem, next(iter(report.shape.values())), report.precision, report.dtype, report.mode,
                         report.step)
        (out / f"{stem}.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        chart = _chart(report, out / f"{stem}.png")
        if chart is not None:
            charts.append(chart)
    return charts


def _chart(report: BenchReport, path: pathlib.Path) -> pathlib.Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timed = [r for r in report.rows if r.timing is not None]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(timed) + 1.2))
    ax.barh([r.candidate for r in timed], [r.timing.median_ms for r in timed],
            xerr=[[r.timing.median_ms - r.timing.p20_ms for r in timed], [r.timing.p80_ms - r.timing.median_ms for r in timed]],
            color=["#999999" if r.role in ("baseline", FLOOR) else "#3b75af" for r in timed])
    ax.set_xscale("log")
    ax.set_xlabel("median ms (p20-p80), log scale")
    step = "" if report.step == FORWARD else f" {report.step}"
    ax.set_title(f"{report.problem} {shape_key(report.shape)}\n{section(report.precision, report.dtype)} {report.mode}{step} on {report.device.get('name')}", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# The summary's columns: (header, row) for the times, in ms, then the two ratios.
COMPILE_MODES = (("torch.compile default", "torch.compile"),
                 ("max-autotune-no-cudagraphs", "torch.compile max-autotune"))
TIMES = (("eager", "eager"), *COMPILE_MODES, (DISPATCH, DISPATCH), ("cuBLAS-alone floor", FLOOR))
HEADER = "| problem | shape | mode | step | " + " | ".join(h for h, _ in TIMES) + " | time over floor | speedup vs compile |"
# How the reports that --from-out renders are measured: benchmarks/gpu/benchmarks.sh writes them
# (with KernelBench's harness output) under $OUT/benchmarks, default OUT=gpu-out.
# p80 over p20 past which a row's samples fall in two modes (a host that stalls some calls): its
# median is then one of them, and the speedup cell gives the ratio of the p20s beside it.
BIMODAL = 2.0
MEASURE_ON_GPU = ("bash benchmarks/gpu/benchmarks.sh ieee fp32 tf32 bf16\n"
                  "cp gpu-out/benchmarks/*.json gpu-out/benchmarks/*.png {out}/\n"
                  "cp -r gpu-out/benchmarks/harness {out}/")


def markdown(reports: list[BenchReport], command: str, out: pathlib.Path, relative_to: pathlib.Path,
             analysis: str | None = None, measured_by: str | None = None, sweeps=()) -> str:
    """BENCHMARKS.md: per precision (and model dtype) one summary table, the batch ``sweeps``
    (``autofuse.bench.sweep_report``), how it was measured, and ``command`` (which wrote this page);
    ``measured_by``, where given, is how the reports in ``out`` were measured. ``analysis``
    (hand-written: why targets were missed) follows. Nothing here depends on when it is
    rendered, so rendering the same reports again gives the same page."""
    lines = ["# Benchmarks", "",
             "Time per call of the autofuse dispatch against what a user would pick instead (eager PyTorch, "
             "torch.compile in two modes) and against the floor, per precision; medians in ms. "
             f"Every variant's row, with its p20-p80, is in the JSON reports and charts in {_link(out, relative_to)}.", ""]
    for precision, dtype in sorted({(r.precision, r.dtype) for r in reports}, key=_section_order):
        lines += [f"## {section(precision, dtype)}", "", HEADER, "|---" * (HEADER.count("|") - 1) + "|"]
        lines += [_summary_row(r) for r in reports if (r.precision, r.dtype) == (precision, dtype)]
        lines.append("")
    lines += sweep_section(list(sweeps)) + _method([*reports, *sweeps]) + _reproduce(command, measured_by)
    if analysis:
        lines += [analysis.strip(), ""]
    return "\n".join(lines)


def sweep_section(sweeps: list) -> list[str]:
    """The "Batch sweeps" section: each ``autofuse.bench.sweep_report.SweepReport``'s table (it
    renders itself: that module builds on this one), empty without sweeps."""
    if not sweeps:
        return []
    return ["## Batch sweeps", "", sweeps[0].INTRO, ""] + [line for sweep in sweeps for line in sweep.markdown()]


def _section_order(key: tuple[str, str]) -> tuple[int, str, bool, str]:
    """Strictest precision first, a float32 model before a bfloat16 one."""
    precision, dtype = key
    return (PRECISIONS.index(precision) if precision in PRECISIONS else len(PRECISIONS), precision, dtype != "float32", dtype)


def _summary_row(report: BenchReport) -> str:
    def ms(name):
        row = report.row(name)
        return f"{row.timing.median_ms:.4f}" if row is not None and row.timing is not None else "-"
    dispatch = report.row(DISPATCH)
    over = report.ratio(dispatch, FLOOR) if dispatch is not None else None
    compiled = [report.row(name) for _, name in COMPILE_MODES]
    fastest = min((r for r in compiled if r is not None and r.timing is not None), key=lambda r: r.timing.median_ms, default=None)
    speedup = (fastest.timing.median_ms / dispatch.timing.median_ms
               if fastest is not None and dispatch is not None and dispatch.timing is not None else None)
    cells = [f"{over:.3f}" if over else "-", f"{speedup:.2f}x" if speedup else "-"]
    if speedup and any(r.timing.p80_ms > BIMODAL * r.timing.p20_ms for r in (fastest, dispatch)):
        cells[1] += f" (bimodal; p20 over p20: {fastest.timing.p20_ms / dispatch.timing.p20_ms:.2f}x)"
    target = target_for(report.problem, report.step, report.precision, report.mode, report.shape, report.dtype)
    measured = target.measure(report, dispatch) if target else None
    missed = target.miss(measured) if measured is not None else None
    if missed:  # said in the cell it concerns: time over the floor, or the speedup over a baseline
        cells[0 if target.over == FLOOR else 1] += f" (target {target.text()}: {missed})"
    shape = "×".join(str(v) for v in report.shape.values())
    return (f"| {report.problem} | {shape} | {report.mode} | {report.step} | "
            + " | ".join(ms(name) for _, name in TIMES) + " | " + " | ".join(cells) + " |")


def _method(reports: list) -> list[str]:
    """How it was measured, for the reports and sweeps on the page (each has ``device`` and ``measured``)."""
    devices = list(dict.fromkeys(_device_text(r.device) for r in reports))
    stamps = sorted(r.measured[:10] for r in reports if r.measured)
    when = "" if not stamps else f", measured {stamps[0]}" + (f" to {stamps[-1]}" if stamps[-1] != stamps[0] else "") + " (UTC)"
    undated = sum(r.measured is None for r in reports)
    cpu = all(r.device.get("kind") != "cuda" for r in reports)
    clock = "a monotonic clock around each call" if cpu else "CUDA events around each call, the L2 flushed before it"
    return [
        "## How it was measured", "",
        f"On {'; '.join(devices)}{when}"
        + (f"; {undated} of {len(reports)} reports predate the date stamp." if undated else ".")
        + " Each report times its rows interleaved in one process (`autofuse.tuning.timing.time_interleaved`): "
        f"rounds of three timed calls per row after one untimed call, {clock}; the table gives each row's median, "
        "the JSON its p20-p80 as well. Every variant is checked against the float64 reference before it is "
        "timed; one that fails is reported, not timed.", "",
        "- *forward*: the module's call under no_grad. *forward+backward*: a training step: parameter gradients set "
        "to None, the forward, then the backward of a fixed random-normal upstream gradient; the input does not "
        "require grad (a first layer).",
        "- *cuBLAS-alone floor*: cuBLAS's GEMM alone at the precision (bf16: on operands already cast; a training "
        "step: the forward and the weight-gradient GEMMs). A *bfloat16 model* section runs every row on the model "
        "cast with `model.bfloat16()` and bfloat16 inputs, the dispatch on its `dtype=bfloat16` entries. gemm_avgpool_gelu_residual's algebra removes its GEMM, "
        "so its floor is a copy of the bytes the call must move (the floor row's note in the JSON says which).",
        "- *time over floor*: the dispatch's median over the floor's. *speedup vs compile*: the faster "
        "torch.compile mode's median over the dispatch's (under bf16 the JSON also times a compiled copy of the "
        "model cast to bfloat16 once). Where the dispatch misses the project's target "
        "(`autofuse/bench/targets.py`), the cell says by how much. Where either row's p80 is over "
        f"{BIMODAL:g}x its p20, its samples fall in two modes and the median is one of them: the cell "
        "then also gives the ratio of the two rows' p20s.", ""]


def _device_text(device: dict) -> str:
    if device.get("kind") == "cuda":
        return (f"{device.get('name')} ({device.get('sm_count')} SMs, compute capability {device.get('capability')}), "
                f"CUDA {device.get('cuda')}, torch {device.get('torch')}")
    return f"{device.get('name')} ({device.get('cores')} CPU cores), torch {device.get('torch')}"


def _reproduce(command: str, measured_by: str | None) -> list[str]:
    lines = ["## Reproduce", ""]
    if measured_by:
        lines += ["Measure on a GPU (tune every problem at its default shapes, bench the forward and the training "
                  "step, run KernelBench's harness), then copy the reports into place:", "", "```", measured_by, "```", "",
                  "Render this page from the reports (it reads JSON only, so any machine will do):", ""]
    return lines + ["```", command, "```", ""]


def _link(folder: pathlib.Path, relative_to: pathlib.Path) -> str:
    # relpath, not Path.relative_to: a page outside the reports' folder tree (/tmp/x.md with the
    # reports in ./benchmarks) needs "../" steps, which relative_to raises on.
    path = pathlib.Path(os.path.relpath(pathlib.Path(folder).resolve(), pathlib.Path(relative_to).resolve())).as_posix()
    return f"[`{path}/`]({path}/)"
