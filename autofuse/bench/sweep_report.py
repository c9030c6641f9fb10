"""The batch sweep's reports: one shape family at many batches, as JSON and as one Markdown table.

A sweep report is one problem, shape family (every dim but the batch), model dtype, precision,
mode and step; each point is one batch with its rows (``autofuse.bench.sweep``): GPU times
(CUDA events, as every bench row), and with ``--wall`` the wall time per call with a synchronize
after each (``WALL_PREFIX`` rows) and the weight-read floor. The Markdown has one table per sweep,
rows = batches, with the entry that served each batch and the ratios issue 34 sets targets on;
``autofuse.bench.report.sweep_section`` puts them on the page.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import ClassVar

from autofuse.bench.floors import WEIGHT_READ
from autofuse.bench.report import DISPATCH, BenchRow, file_stem, row_of, section
from autofuse.bench.targets import FLOOR, FORWARD, GPU_OVER_WEIGHT_READ, SMALL_BATCHES, WALL_OVER_CUBLAS, Target
from autofuse.core import registry
from autofuse.tuning.batch_classes import smallest_batch

WALL_PREFIX = "wall: "
REDUCE_OVERHEAD = "torch.compile reduce-overhead"
# The table's columns: (header, row) for GPU times, then wall times, in ms.
GPU_COLUMNS = (("dispatch", DISPATCH), ("eager", "eager"), ("torch.compile", "torch.compile"), ("floor", FLOOR))
WALL_COLUMNS = tuple((f"wall: {header}", WALL_PREFIX + name) for header, name in (
    ("dispatch", DISPATCH), ("eager", "eager"), ("torch.compile", "torch.compile"),
    ("reduce-overhead", REDUCE_OVERHEAD), ("floor", FLOOR)))


@dataclasses.dataclass
class SweepPoint:
    batch: int
    rows: list[BenchRow]
    note: str = ""  # why a batch was not measured (BatchNorm in training at batch 1)

    def row(self, candidate: str) -> BenchRow | None:
        return next((r for r in self.rows if r.candidate == candidate), None)

    def ratio(self, name: str, to: str) -> float | None:
        """``name``'s median over ``to``'s (None where either was not timed)."""
        mine, theirs = self.row(name), self.row(to)
        if mine is None or theirs is None or mine.timing is None or theirs.timing is None:
            return None
        return mine.timing.median_ms / theirs.timing.median_ms


@dataclasses.dataclass
class SweepReport:
    problem: str
    shape: dict  # the family: every dim but batch_dim as measured, batch_dim as named (or the default)
    batch_dim: str
    dtype: str
    precision: str
    mode: str
    step: str
    device: dict
    points: list[SweepPoint]
    measured: str | None = None
    INTRO: ClassVar[str] = (
        "Per batch: the entry that served the dispatch (its `dispatch_info` source), GPU medians in ms, and the "
        "dispatch's time over the floor. With wall times: host + GPU per call with a synchronize after each, the "
        "dispatch's wall time over the floor's called from Python, and its GPU time over reading W once at the "
        f"copy bandwidth of the same run (targets at batches {' and '.join(map(str, SMALL_BATCHES))}, 2 for 1 "
        "in a training BatchNorm's sweep: "
        f"≤ {WALL_OVER_CUBLAS} and ≤ {GPU_OVER_WEIGHT_READ}).")

    def target_batches(self) -> tuple[int, ...]:
        """The batches the small-batch targets hold at: ``SMALL_BATCHES``, where 1 is the smallest
        the mode admits (2 for a training BatchNorm, whose sweeps measure 2 for 1)."""
        problem = registry.problems().get(self.problem)
        smallest = 1 if problem is None else smallest_batch(problem, self.mode)
        return tuple(smallest if batch == 1 else batch for batch in SMALL_BATCHES)

    def markdown(self) -> list[str]:
        """Its part of the "Batch sweeps" section (``autofuse.bench.report.sweep_section``): title and table."""
        return [f"### {self.title}", ""] + _table(self) + [""]

    @property
    def family(self) -> str:
        """The shape without its batch: "×8192×8192"."""
        return "".join(f"×{size}" for dim, size in self.shape.items() if dim != self.batch_dim)

    @property
    def title(self) -> str:
        step = "" if self.step == FORWARD else f", {self.step}"
        return f"{self.problem} {self.batch_dim}{self.family} ({section(self.precision, self.dtype)}, {self.mode}{step})"

    def to_dict(self) -> dict:
        points = [{"batch": p.batch, "note": p.note, "rows": [
            {"candidate": r.candidate, "role": r.role, "params": r.params, "note": r.note,
             **(r.timing.to_dict() if r.timing else {})} for r in p.rows]} for p in self.points]
        return {"sweep": True, "problem": self.problem, "shape": self.shape, "batch_dim": self.batch_dim,
                "dtype": self.dtype, "precision": self.precision, "mode": self.mode, "step": self.step,
                "measured": self.measured, "device": self.device, "points": points}


def save_sweeps(sweeps: list[SweepReport], out: str | pathlib.Path) -> list[pathlib.Path]:
    """Write each sweep as JSON (``PROBLEM-sweep-xIN-xOUT-...``, apart from the one-shape reports): ASCII
    names, which every file system and transfer takes (the lent GPU's copy-back refused a "×")."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for sweep in sweeps:
        family = "sweep" + sweep.family.replace("×", "-x")
        path = out / f"{file_stem(sweep.problem, family, sweep.precision, sweep.dtype, sweep.mode, sweep.step)}.json"
        path.write_text(json.dumps(sweep.to_dict(), indent=1) + "\n")
        paths.append(path)
    return paths


def load_sweeps(folder: str | pathlib.Path) -> list[SweepReport]:
    """The sweeps ``save_sweeps`` wrote into ``folder``, in file order; other JSON is passed over."""
    sweeps = []
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and data.get("sweep") is True):
            continue
        points = [SweepPoint(p["batch"], [row_of(r) for r in p["rows"]], p.get("note", "")) for p in data["points"]]
        sweeps.append(SweepReport(data["problem"], data["shape"], data["batch_dim"], data["dtype"], data["precision"],
                                  data["mode"], data["step"], data["device"], points, data.get("measured")))
    return sweeps


def _table(sweep: SweepReport) -> list[str]:
    """The sweep's table: a row per batch, its GPU times, wall times if measured, and the ratios."""
    wall = any(p.row(WALL_PREFIX + DISPATCH) is not None for p in sweep.points)
    columns = GPU_COLUMNS + (WALL_COLUMNS if wall else ())
    ratios = ["dispatch / floor"] + (["wall / floor's wall", "GPU / weight read"] if wall else [])
    header = "| batch | served by | " + " | ".join(h for h, _ in columns) + " | " + " | ".join(ratios) + " |"
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    targets = sweep.target_batches()
    for point in sweep.points:
        if not point.rows:
            lines.append(f"| {point.batch} | {point.note} |" + " - |" * (len(columns) + len(ratios)))
            continue
        dispatch = point.row(DISPATCH)
        cells = [str(point.batch), dispatch.note if dispatch is not None else "-"]
        cells += [_ms(point.row(name)) for _, name in columns]
        cells.append(_ratio(point.ratio(DISPATCH, FLOOR)))
        if wall:
            small = point.batch in targets
            cells.append(_ratio(point.ratio(WALL_PREFIX + DISPATCH, WALL_PREFIX + FLOOR), WALL_OVER_CUBLAS if small else None))
            cells.append(_ratio(point.ratio(DISPATCH, WEIGHT_READ), GPU_OVER_WEIGHT_READ if small else None))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ms(row: BenchRow | None) -> str:
    return f"{row.timing.median_ms:.4f}" if row is not None and row.timing is not None else "-"


def _ratio(measured: float | None, target: float | None = None) -> str:
    if measured is None:
        return "-"
    missed = Target(target).miss(measured) if target is not None else None
    return f"{measured:.3f}" + (f" (target {target}: {missed})" if missed else "")
