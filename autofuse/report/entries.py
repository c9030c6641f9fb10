"""What ``autofuse report`` shows, read from a dispatch table: entries, candidates, staleness.

Per device, problem, shape and dispatch key: every variant's time, speedup over eager, error
and outcome, the winner, and each study's tuning history (from the Optuna journal, where it is
on this machine). Entries that no longer describe this machine are marked stale: tuned on
another device, under another torch or CUDA, with a variant whose source has changed since,
or with a variant nothing registers any more. The table may be hand-edited, so every value is
read defensively here (``num``); ``report_html`` renders and escapes what this collects.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

from autofuse.core import registry
from autofuse.errors import UnknownNameError
from autofuse.report.history import Histories, Trial
from autofuse.serve.table import DispatchTable, current_fingerprint, fingerprint_key
from autofuse.tuning.study import config_label

# Fingerprint fields that change with software, not hardware: a difference there means
# "re-tune after the upgrade", not "another machine".
VERSION_FIELDS = ("torch", "cuda")


@dataclasses.dataclass
class Candidate:
    """One variant's best in an entry's search (or the entry itself where no search was kept)."""

    variant: str
    kind: str
    params: dict
    median_ms: float | None
    speedup: float | None
    error: float | None
    outcome: str
    reason: str
    winner: bool


@dataclasses.dataclass
class Entry:
    device: str
    problem: str
    shape: str
    key: str
    raw: dict
    candidates: list[Candidate]
    stale: list[str]
    study: str | None
    history: list[Trial] | None  # None: the study is not in the journal here


def num(value) -> float | None:
    """A finite float, or None for anything a hand-edited table may hold instead."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def fingerprint_label(fp) -> str:
    try:
        return fingerprint_key(fp)
    except (ValueError, TypeError, AttributeError):
        return repr(fp)


def here() -> list[dict]:
    """The fingerprints of this machine's devices: its CPU and every visible GPU."""
    import torch

    cuda = [current_fingerprint(f"cuda:{i}") for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return [current_fingerprint("cpu"), *cuda]


def device_staleness(fp, machine: list[dict]) -> list[str]:
    """Why timings taken on device `fp` do not hold on this machine (empty: they do)."""
    if not isinstance(fp, dict):
        return ["the entry's device has no fingerprint"]
    if any(fp == mine for mine in machine):
        return []
    same = [mine for mine in machine if _hardware(mine) == _hardware(fp)]
    if not same:
        kind = fp.get("kind")
        mine = [str(m.get("name")) for m in machine if m.get("kind") == kind]
        return [f"tuned on another device ({fp.get('name')}); this machine has "
                + (", ".join(mine) if mine else f"no {kind} device")]
    return [f"tuned under {field} {fp.get(field)}, running {same[0].get(field)}"
            for field in VERSION_FIELDS if fp.get(field) != same[0].get(field)]


def _hardware(fp: dict) -> dict:
    return {k: v for k, v in fp.items() if k not in VERSION_FIELDS}


def variant_staleness(problem: str, entry: dict) -> list[str]:
    """Why the entry's variant may no longer be what was measured (empty: it is)."""
    name = entry.get("variant")
    try:
        registry.get_problem(problem)
    except UnknownNameError:
        return [f"problem {problem} is not registered here"]
    try:
        cls = registry.get_variant(problem, str(name))
    except UnknownNameError:
        return [f"variant {problem}/{name} is not registered here"]
    recorded = entry.get("source_hash")
    if not recorded:
        return ["no source_hash recorded: cannot tell whether the source changed"]
    if recorded != cls.source_hash():
        return [f"the source of {name} changed since tuning (hash {recorded}, now {cls.source_hash()})"]
    return []


def _kind(problem: str, variant: str) -> str:
    try:
        return registry.get_variant(problem, variant).kind
    except UnknownNameError:
        return "not registered"


def candidates(problem: str, entry: dict, errors: dict) -> list[Candidate]:
    """Every variant's best from the entry's search, fastest first; failures last."""
    searched = entry.get("candidates")
    if not isinstance(searched, dict) or not searched:  # autograd entries, older or hand-made ones
        searched = {str(entry.get("variant")): {**entry, "outcome": "ok"}}
    eager = num((searched.get("eager") or {}).get("median_ms")) if isinstance(searched.get("eager"), dict) else None
    eager = eager or num(entry.get("eager_ms"))
    rows = []
    for name, cand in searched.items():
        cand = cand if isinstance(cand, dict) else {}
        params = cand.get("params") if isinstance(cand.get("params"), dict) else {}
        median = num(cand.get("median_ms"))
        error = num(cand.get("error")) if "error" in cand else errors.get((name, config_label(params)))
        rows.append(Candidate(name, _kind(problem, name), params, median, eager / median if eager and median else None,
                              error, str(cand.get("outcome", "?")), str(cand.get("reason") or ""),
                              name == entry.get("variant") and params == entry.get("params", params)))
    return sorted(rows, key=lambda c: (c.median_ms is None, c.median_ms or 0.0, c.variant))


def collect(table: DispatchTable, journal: pathlib.Path, machine: list[dict]) -> list[Entry]:
    """Every entry of `table`, with its candidates, staleness on `machine` and study history."""
    doc = table.load()  # a corrupt or foreign table raises TableError, reported by the CLI
    histories, entries = Histories(journal), []
    for fkey, device in doc["devices"].items():
        device_reasons = device_staleness(device.get("fingerprint"), machine)
        for problem, shapes in device["problems"].items():
            for skey, keys in shapes.items():
                for dkey, raw in keys.items():
                    study = raw.get("study") if isinstance(raw.get("study"), str) else None
                    history, errors = histories.get(study)
                    entries.append(Entry(fkey, problem, skey, dkey, raw, candidates(problem, raw, errors),
                                         device_reasons + variant_staleness(problem, raw), study, history))
    return entries
