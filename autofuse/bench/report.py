"""``autofuse bench``'s reports: rows, ratios, JSON in and out, charts, and the Markdown summary.

A report is one problem, shape, precision, mode and step: ``forward`` (inference) or
``forward+backward`` (a training step, ``autofuse.tuning.timed_call``). Reports of several runs (one per
precision, say) are saved into one folder and rendered together (``--from-out``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib

from autofuse.bench.targets import FLOOR, FORWARD, TRAINING, Target, target_for
from autofuse.serve.table import shape_key
from autofuse.tuning.timing import Timing

# A hand-written file in the results folder that says why targets were missed; the Markdown
# report includes it after the summary, so the explanation travels with the numbers it explains.
ANALYSIS_FILE = "analysis.md"
# What a user would pick instead (issue 11): a verdict names those it was not compared with.
EXPECTED_BASELINES = ("eager", "torch.compile", "torch.compile max-autotune")
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
    # When the run finished (UTC, ISO 8601 to the minute). Reports of several sessions share a
    # folder and one BENCHMARKS.md, so each table says when it was measured; None in reports
    # saved before the field existed.
    measured: str | None = None

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
        return f"{self.problem} {shape_key(self.shape)} ({self.precision}, {self.mode}{step})"

    def to_dict(self) -> dict:
        rows = [{"candidate": r.candidate, "role": r.role, "params": r.params, "note": r.note,
                 **(r.timing.to_dict() if r.timing else {}),
                 "speedup_vs_eager": self.ratio(r, "eager"), "x_floor": self.ratio(r, FLOOR)} for r in self.rows]
        return {"problem": self.problem, "shape": self.shape, "precision": self.precision, "mode": self.mode,
                "step": self.step, "measured": self.measured, "device": self.device, "rows": rows}


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
        rows = [BenchRow(r["candidate"], r["role"], r["params"], _timing(r), r.get("note", "")) for r in data["rows"]]
        reports.append(BenchReport(data["problem"], data["shape"], data["precision"], data["mode"], data["device"], rows,
                                   data.get("step", FORWARD), data.get("measured")))
    return sorted(reports, key=lambda report: report.step != FORWARD)  # stable: file order within a step


def now_utc() -> str:
    """The ``measured`` stamp: the current UTC time, ISO 8601 to the minute."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def _timing(row: dict) -> Timing | None:
    fields = ("median_ms", "p20_ms", "p80_ms", "reps")
    return Timing(*(row[f] for f in fields)) if all(row.get(f) is not None for f in fields) else None


def save(reports: list[BenchReport], out: str | pathlib.Path) -> list[pathlib.Path]:
    """Write each report as JSON and, if matplotlib is installed, a PNG chart; return the chart paths."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    charts = []
    for report in reports:
        stem = f"{report.problem}-{report.shape[next(iter(report.shape))]}-{report.precision}-{report.mode}"
        stem += "" if report.step == FORWARD else "-fwdbwd"
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
    ax.set_title(f"{report.problem} {shape_key(report.shape)}\n{report.precision} {report.mode}{step} on {report.device.get('name')}", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _verdict(measured: float | None, target: Target | float | None, behind: dict[str, float] | None = None,
             missing: tuple[str, ...] = ()) -> str:
    """``met``, or each part missed: the target (by how much) and every baseline the dispatch
    did not beat (``behind``: its time over theirs); ``missing`` names the baselines that were
    not measured, so a "met" never hides a comparison that was not made."""
    if measured is None or target is None:
        return "-"
    target = target if isinstance(target, Target) else Target(target)
    misses = [m for m in [target.miss(measured)] if m]
    misses += [f"{100 * (over - 1):.2f}% slower than {name}" for name, over in (behind or {}).items()]
    verdict = "; ".join(misses) or ("met" if target.over == FLOOR else f"met ({measured:.2f}x {target.over})")
    return verdict + (f" (not compared with {', '.join(missing)})" if missing else "")


def _behind(report: BenchReport, dispatch: BenchRow | None) -> dict[str, float]:
    """The baselines whose median the dispatch's does not beat, with its time over theirs."""
    if dispatch is None or dispatch.timing is None:
        return {}
    mine = dispatch.timing.median_ms
    return {r.candidate: mine / r.timing.median_ms for r in report.rows
            if r.role == "baseline" and r.timing is not None and mine >= r.timing.median_ms}


def _missing(report: BenchReport) -> tuple[str, ...]:
    """Baselines a user would pick instead that this report did not time (--no-compile, a failed compile)."""
    expected = EXPECTED_BASELINES + ((BF16_COPY,) if report.precision == "bf16" and report.step == FORWARD else ())
    present = [r.candidate for r in report.rows if r.role == "baseline"]
    names = list(expected) + [name for name in present if name not in expected]
    return tuple(n for n in names if report.row(n) is None or report.row(n).timing is None)


def _summary(reports: list[BenchReport]) -> list[str]:
    """A table per step: one line per report with the dispatch against its target, and the
    fastest variant and every baseline, each over the floor."""
    lines = []
    for step, title in ((FORWARD, "## Summary: time over the floor"),
                        (TRAINING, "## Summary: forward+backward (a training step), time over the floor")):
        mine = [r for r in reports if r.step == step]
        if mine:
            lines += _summary_table(mine, title)
    return lines


def _summary_table(reports: list[BenchReport], title: str) -> list[str]:
    baselines = list(dict.fromkeys(r.candidate for report in reports for r in report.rows if r.role == "baseline"))
    lines = [title, "",
             "| problem | shape | precision, mode | target | autofuse dispatch | verdict | fastest variant | " + " | ".join(baselines) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(baselines)]
    for report in reports:
        def over(row):
            ratio = report.ratio(row, FLOOR) if row is not None else None
            return f"{ratio:.3f}" if ratio else "-"
        variants = [r for r in report.rows if r.role == "variant" and r.timing is not None]
        fastest = min(variants, key=lambda r: r.timing.median_ms, default=None)
        dispatch = report.row(DISPATCH)
        target = target_for(report.problem, report.step, report.precision, report.mode, report.shape)
        measured = target.measure(report, dispatch) if target else None
        if target and measured is None:  # say which row the target needed, not a bare "-"
            untimed = [n for n in (DISPATCH, target.over) if report.row(n) is None or report.row(n).timing is None]
            verdict = f"not measured (no {' or '.join(untimed)} timing)"
        else:
            verdict = _verdict(measured, target, _behind(report, dispatch), _missing(report))
        lines.append(f"| {report.problem} | {shape_key(report.shape)} | {report.precision}, {report.mode} | "
                     f"{target.text() if target else '-'} | {over(dispatch)} ({dispatch.note if dispatch else '-'}) | "
                     f"{verdict} | {over(fastest)} ({fastest.candidate if fastest else '-'}) | "
                     + " | ".join(over(report.row(name)) for name in baselines) + " |")
    return lines + [""]


def markdown(reports: list[BenchReport], command: str, charts: list[pathlib.Path], relative_to: pathlib.Path,
             analysis: str | None = None) -> str:
    """BENCHMARKS.md: what ran where, every number as measured, and ``analysis`` (hand-written:
    why targets were missed) after the summary."""
    lines = _preamble(reports, command) + _summary(reports)
    if analysis:
        lines += [analysis.strip(), ""]
    for report in reports:
        lines += [f"## {report.title}", "",
                  f"Measured {report.measured.replace('T', ' ')} UTC." if report.measured
                  else "Measured before reports recorded when (2026-11-23 or earlier).", "",
                  "| candidate | params | median ms | p20-p80 | speedup vs eager | x floor | note |",
                  "|---|---|---|---|---|---|---|"]
        for row in report.rows:
            t = row.timing
            params = ",".join(f"{k}={v}" for k, v in row.params.items()) or "-"
            speed, floor = report.ratio(row, "eager"), report.ratio(row, FLOOR)
            lines.append(f"| {row.candidate} | {params} | {f'{t.median_ms:.4f}' if t else '-'} | "
                         f"{f'{t.p20_ms:.4f}-{t.p80_ms:.4f}' if t else '-'} | {f'{speed:.2f}x' if speed else '-'} | "
                         f"{f'{floor:.2f}' if floor else '-'} | {row.note} |")
        lines.append("")
    for chart in charts:
        # relpath, not Path.relative_to: a --markdown outside the charts' folder tree (/tmp/x.md
        # with charts in ./benchmarks) needs "../" steps, which relative_to raised on.
        link = pathlib.Path(os.path.relpath(chart.resolve(), relative_to.resolve())).as_posix()
        lines.append(f"![{chart.stem}]({link})")
    return "\n".join(lines) + "\n"


def _preamble(reports: list[BenchReport], command: str) -> list[str]:
    device = reports[0].device if reports else {}
    return [
        "# Benchmarks", "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}: {device.get('name')} "
        + (f"({device.get('sm_count')} SMs, compute capability {device.get('capability')}), CUDA {device.get('cuda')}"
           if device.get("kind") == "cuda" else f"({device.get('cores')} CPU cores)")
        + f", torch {device.get('torch')}. "
        "Medians of interleaved runs (L2 flushed between repetitions), p20-p80 in brackets; "
        "`x floor` is time over the floor (1.00 = as fast as the floor). A forward+backward table times "
        "a training step: parameter gradients set to None, the forward, then the backward of a fixed "
        "random-normal upstream gradient; the input does not require grad (a first layer).", "",
    ]
