"""The page of ``autofuse report``: one self-contained folder, index.html beside its PNGs.

A small f-string template: the page is a few tables and images, and every value from the
table (which may be hand-edited) passes through ``e()``. PNG names are counters, never
built from table values. An inline script marks ``<body data-images="ok">`` once every
image has loaded, so a headless browser can check that the page renders.
"""

from __future__ import annotations

import datetime
import html
import pathlib
from itertools import groupby

from autofuse.report import plots as report_plots
from autofuse.report.entries import Entry, fingerprint_label, num
from autofuse.serve.table import DispatchKey

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1100px;
       padding: 1.5em 2em 4em; color: #1d1d1f; }
h1 { margin-bottom: .2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
h3 { margin-top: 1.6em; } h4 { margin: 1.4em 0 .4em; font-family: ui-monospace, monospace; font-weight: 600; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 12.5px; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 13px; }
th, td { border-bottom: 1px solid #e3e3e3; padding: .3em .7em; text-align: left; vertical-align: top; }
td.num, td.nowrap { white-space: nowrap; } td.device { font-size: 11.5px; max-width: 16em; }
th { background: #f4f4f6; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.winner td { background: #fff4e6; font-weight: 600; } tr.failed td { color: #8a8a8a; }
.badge { display: inline-block; border-radius: 9px; padding: 0 .6em; font-size: 12px; font-weight: 600; }
.badge.current { background: #e3f4e6; color: #1f6b31; } .badge.stale { background: #fde8e8; color: #9b1c1c; }
.badge.other { background: #eceff4; color: #444; }
.entry { border: 1px solid #e3e3e3; border-radius: 8px; padding: .6em 1em; margin: .8em 0; }
.entry h5 { margin: .2em 0 .4em; font-size: 13px; } .why { color: #9b1c1c; margin: .2em 0; }
.note { color: #666; font-style: italic; } .reason { color: #8a8a8a; font-size: 12px; }
img { max-width: 100%; border: 1px solid #eee; border-radius: 6px; margin: .4em 0; }
img.broken { outline: 3px solid #c23030; } .meta td:first-child { color: #666; }
"""

SCRIPT = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var broken = images.filter(function (img) { return !(img.complete && img.naturalWidth > 0); });
  broken.forEach(function (img) { img.classList.add("broken"); });
  document.body.setAttribute("data-images-loaded", String(images.length - broken.length));
  document.body.setAttribute("data-images", broken.length ? "broken" : "ok");
});
"""


def e(value) -> str:
    return html.escape(str(value), quote=True)


def ms(value) -> str:
    return f"{value:.4g}" if value is not None else "–"


def key_label(key: str) -> str:
    try:
        k = DispatchKey.from_str(key)
    except ValueError:
        return key
    return f"{k.dtype} · {k.precision} · mode {k.mode}" + (" · autograd" if k.autograd else "")


def params_text(params) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) if isinstance(params, dict) and params else "–"


def render(entries: list[Entry], table_path, journal: pathlib.Path, machine: list[dict],
           out: pathlib.Path, plt) -> str:
    ids = {id(entry): f"entry-{i}" for i, entry in enumerate(entries)}
    images = _Images(out, plt)
    body = [_header(entries, table_path, journal, machine), _overview(entries, ids)]
    here_keys = {fingerprint_label(fp) for fp in machine}
    for device, of_device in groupby(entries, key=lambda x: x.device):
        badge = '<span class="badge current">this machine</span>' if device in here_keys else \
            '<span class="badge other">another device or version</span>'
        body.append(f'<h2 class="device">{e(device)} {badge}</h2>')
        for problem, of_problem in groupby(of_device, key=lambda x: x.problem):
            body.append(f'<h3>{e(problem)}</h3>')
            for shape, of_shape in groupby(of_problem, key=lambda x: x.shape):
                body.append(_shape(problem, shape, list(of_shape), ids, images))
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>autofuse report</title>'
            f'<style>{STYLE}</style></head>\n<body data-images="pending">\n' + "\n".join(body)
            + f"\n<script>{SCRIPT}</script>\n</body></html>\n")


class _Images:
    """Numbered PNGs in the output folder; one history per study, however many entries share it."""

    def __init__(self, out: pathlib.Path, plt) -> None:
        self.out, self.plt, self.count, self.histories, self.shown = out, plt, 0, {}, {}

    def _name(self, stem: str) -> pathlib.Path:
        self.count += 1
        return self.out / f"{stem}-{self.count:03d}.png"

    def chart(self, title: str, groups) -> str:
        return report_plots.shape_chart(self.plt, title, groups, self._name("chart")).name

    def history(self, entry: Entry, anchor: str) -> tuple[str, str | None]:
        """The study's PNG, and the anchor of the entry that shows it already (None: this one)."""
        if entry.study in self.histories:
            return self.histories[entry.study], self.shown[entry.study]
        title = f"tuning history: {len(entry.history)} trials, {sum(t.value_ms is None for t in entry.history)} failed"
        self.histories[entry.study] = report_plots.history_chart(self.plt, title, entry.history, self._name("history")).name
        self.shown[entry.study] = anchor
        return self.histories[entry.study], None


def _header(entries, table_path, journal, machine) -> str:
    stale = sum(1 for x in entries if x.stale)
    devices = len({x.device for x in entries})
    mine = "".join(f"<li><code>{e(fingerprint_label(fp))}</code></li>" for fp in machine)
    journal_note = "" if journal.is_file() else ' <span class="note">(not found: no tuning histories)</span>'
    summary = (f"{len(entries)} entries on {devices} device(s); "
               + (f'<span class="badge stale">{stale} stale</span>' if stale else '<span class="badge current">none stale</span>'))
    return (f"<h1>autofuse report</h1>\n<table class=\"meta\">"
            f"<tr><td>table</td><td><code>{e(table_path)}</code></td></tr>"
            f"<tr><td>tuning journal</td><td><code>{e(journal)}</code>{journal_note}</td></tr>"
            f"<tr><td>generated</td><td>{e(datetime.datetime.now().isoformat(timespec='seconds'))}</td></tr>"
            f"<tr><td>this machine</td><td><ul>{mine}</ul></td></tr></table>\n<p id=\"summary\">{summary}</p>\n"
            '<p class="note">Per entry, the winner\'s line gives the final re-timing, interleaved with eager; the table '
            "below it gives each variant's best in the search and its speedup over eager's time in that search.</p>")


def _overview(entries, ids) -> str:
    if not entries:
        return '<p class="note" id="empty">The table holds no entries yet: run <code>autofuse tune</code>.</p>'
    rows = []
    for x in entries:
        status = '<span class="badge stale">stale</span>' if x.stale else '<span class="badge current">current</span>'
        speedup = num(x.raw.get("speedup"))
        rows.append(
            f'<tr class="{"stale" if x.stale else "current"}" data-problem="{e(x.problem)}">'
            f'<td><a href="#{ids[id(x)]}">{e(x.problem)}</a></td><td class="mono">{e(x.shape)}</td>'
            f"<td>{e(key_label(x.key))}</td><td class=\"mono device\">{e(x.device.replace('|', ' | '))}</td>"
            f"<td>{e(x.raw.get('variant'))}</td><td class=\"num\">{e(ms(num(x.raw.get('median_ms'))))}</td>"
            f"<td class=\"num\">{e(f'{speedup:.2f}x' if speedup else '–')}</td><td>{status}</td></tr>")
    return ('<h2 id="entries">Entries</h2>\n<table id="overview"><thead><tr><th>problem</th><th>shape</th><th>key</th>'
            '<th>device</th><th>winner</th><th>ms</th><th>vs eager</th><th>status</th></tr></thead>\n<tbody>'
            + "\n".join(rows) + "</tbody></table>\n" + _stale(entries, ids))


def _stale(entries, ids) -> str:
    stale = [x for x in entries if x.stale]
    if not stale:
        return ('<h2 id="stale">Stale entries</h2><p class="note">None: every entry was tuned on this machine, '
                "under the running torch and CUDA, with the variants' current sources.</p>")
    rows = [f'<tr data-entry="{ids[id(x)]}"><td><a href="#{ids[id(x)]}">{e(x.problem)}</a><br>'
            f'<span class="mono">{e(x.shape)}</span><br>{e(key_label(x.key))}</td>'
            f'<td>{"".join(f"<div>{e(r)}</div>" for r in x.stale)}</td><td><code>{e(retune(x))}</code></td></tr>' for x in stale]
    return ('<h2 id="stale">Stale entries</h2>\n<p>Their timings may not hold here: tuned on another device, under '
            "another torch or CUDA, or with a variant whose source has changed or that is gone.</p>\n"
            '<table id="stale-entries"><thead><tr><th>entry</th><th>why</th><th>re-tune with (on the target device)</th>'
            "</tr></thead>\n<tbody>" + "\n".join(rows) + "</tbody></table>")


def retune(x: Entry) -> str:
    """The tune command that re-measures the entry (it records the autograd entry too)."""
    command = f"autofuse tune {x.problem} --shape {x.shape}"
    try:
        k = DispatchKey.from_str(x.key)
    except ValueError:
        return command
    command += f" --precision {k.precision}" + (f" --dtype {k.dtype}" if k.dtype != "float32" else "")
    return command + (f" --mode {k.mode}" if k.mode != "any" else "")


def _shape(problem, shape, entries, ids, images) -> str:
    groups = [(key_label(x.key), x.candidates) for x in entries]
    chart = images.chart(f"{problem}  {shape}", groups)
    parts = [f'<h4>{e(shape)}</h4>', f'<img src="{e(chart)}" alt="median time of each variant at {e(shape)}">']
    parts += [_entry(x, ids[id(x)], images) for x in entries]
    return "\n".join(parts)


def _entry(x: Entry, anchor: str, images) -> str:
    raw = x.raw
    badge = '<span class="badge stale">stale</span>' if x.stale else '<span class="badge current">current</span>'
    why = "".join(f'<p class="why">{e(r)}</p>' for r in x.stale)
    spread = f" (p20–p80 {ms(num(raw.get('p20_ms')))}–{ms(num(raw.get('p80_ms')))})" if num(raw.get("p20_ms")) else ""
    speedup = f", {num(raw.get('speedup')):.2f}x eager" if num(raw.get("speedup")) else ""
    params = f" <code>{e(params_text(raw.get('params')))}</code>" if raw.get("params") else ""
    winner = (f"winner <b>{e(raw.get('variant'))}</b>{params}: "
              f"{e(ms(num(raw.get('median_ms'))))} ms{e(spread)}{e(speedup)}, re-timed interleaved with eager; "
              f"{e(raw.get('trials', '?'))} trials, tuned {e(raw.get('date', '?'))}, seed {e(raw.get('seed', '?'))}")
    return (f'<div class="entry" id="{anchor}" data-stale="{str(bool(x.stale)).lower()}">'
            f"<h5>{e(key_label(x.key))} {badge}</h5>{why}<p>{winner}</p>{_candidates(x)}{_history(x, images, anchor)}</div>")


def _candidates(x: Entry) -> str:
    rows = []
    for c in x.candidates:
        cls = "winner" if c.winner else ("failed" if c.outcome != "ok" else "")
        reason = f'<div class="reason">{e(c.reason[:200])}</div>' if c.reason else ""
        rows.append(
            f'<tr class="{cls}" data-variant="{e(c.variant)}" data-outcome="{e(c.outcome)}">'
            f"<td>{e(c.variant)}{' ★' if c.winner else ''}</td><td>{e(c.kind)}</td><td class=\"mono\">{e(params_text(c.params))}</td>"
            f"<td class=\"num\">{e(ms(c.median_ms))}</td><td class=\"num\">{e(f'{c.speedup:.2f}x' if c.speedup else '–')}</td>"
            f"<td class=\"num\">{e(f'{c.error:.1e}' if c.error is not None else '–')}</td><td>{e(c.outcome)}{reason}</td></tr>")
    return ('<table class="candidates"><thead><tr><th>variant</th><th>kind</th><th>params</th><th>median ms</th>'
            '<th>vs eager</th><th>error</th><th>outcome</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>")


def _history(x: Entry, images, anchor: str) -> str:
    if x.study is None:
        return '<p class="note">No study recorded with this entry, so no tuning history.</p>'
    if x.history == []:
        return f'<p class="note">Tuning history: study <code>{e(x.study)}</code> has no trials yet.</p>'
    if x.history is None:
        return (f'<p class="note history-missing">Tuning history: study <code>{e(x.study)}</code> is not in the '
                f"journal here (tuned on another machine, or the journal was moved or deleted).</p>")
    png, shown = images.history(x, anchor)
    if shown is not None:
        return f'<p class="note">Tuning history: the same study as <a href="#{shown}">the entry above</a>.</p>'
    return f'<img class="history" src="{e(png)}" alt="tuning history of {e(x.study)}">'
