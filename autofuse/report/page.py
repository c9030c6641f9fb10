"""``autofuse report``: what a dispatch table holds, as a page people would rather look at.

``report_entries`` reads the table (and the tuning journal) into entries, ``report_html``
renders them beside the PNGs that ``report_plots`` draws; this module writes the folder.
"""

from __future__ import annotations

import pathlib

from autofuse.errors import AutofuseError
from autofuse.report import html as report_html
from autofuse.report.entries import collect, here
from autofuse.serve.table import DispatchTable
from autofuse.tuning.study import studies_path


def write_report(table=None, out="autofuse-report", journal=None) -> pathlib.Path:
    """Write ``out/index.html`` and its PNGs for `table` (default: $AUTOFUSE_HOME/table.json);
    return the page's path. `journal` is the Optuna journal (default: the tuner's)."""
    plt = _pyplot()
    table = table if isinstance(table, DispatchTable) else DispatchTable(table)
    journal = pathlib.Path(journal) if journal is not None else studies_path()
    machine = here()
    entries = collect(table, journal, machine)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("chart-*.png"), *out.glob("history-*.png")]:  # an earlier report's, now unreferenced
        old.unlink()
    page = report_html.render(entries, table.path, journal, machine, out, plt)
    target = out / "index.html"
    target.write_text(page, encoding="utf-8")
    return target


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise AutofuseError('autofuse report draws its charts with matplotlib, which is not installed: '
                            'pip install "autofuse[report]" (or pip install matplotlib)') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
