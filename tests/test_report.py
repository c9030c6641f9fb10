"""autofuse report: a page from a real CPU tune (failures and a searched parameter included) plus
hand-made entries that are stale in each way, checked in its HTML and in a headless browser."""

import copy
import html.parser
import pathlib
import struct
import subprocess
import sys

import pytest
from conftest import CHROMIUM
from helpers import use_test_plugins

import autofuse
from autofuse.cli import main
from autofuse.core import plugins, registry
from autofuse.report.page import write_report
from autofuse.serve.table import DispatchTable, current_fingerprint

SHAPE = {"batch_size": 16, "in_features": 48, "out_features": 40}
TUNED = "batch_size=16,in_features=48,out_features=40"
OTHER_GPU = {"kind": "cuda", "name": "NVIDIA Imaginary X1", "capability": "9.0", "sm_count": 7, "cuda": "13.0",
             "torch": "2.11.0+cu130"}
# Shape key -> what the page must say about that entry (None: not stale).
EXPECTED = {
    TUNED: None,
    "batch_size=8,in_features=48,out_features=40": "tuned under torch 2.0.0",
    "batch_size=4,in_features=48,out_features=40": "the source of simplified changed since tuning",
    "batch_size=1024,in_features=8192,out_features=8192": "tuned on another device (NVIDIA Imaginary X1)",
    "batch_size=4,in_features=6,out_features=5": "is not registered here",
}
EVIL = "<script>alert('autofuse')</script>"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(table, journal): matmul_gelu_softmax tuned on the CPU with correct and broken variants, then
    entries written by hand as a table from another device, torch or source would hold them."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOFUSE_HOME", str(home))
        use_test_plugins(mp, "broken_variants,report_variants")
        try:
            autofuse.tune("matmul_gelu_softmax", SHAPE, device="cpu", seed=1, progress=False, trial_timeout=60,
                          variants=["eager", "simplified", "row_blocks", "raises", "wrong", "compile_error"],
                          budget="full", batch_classes=False)  # full: every candidate gated, so "wrong" is
            # recorded incorrect; no batch classes: the one entry the stale copies below are made from
        finally:
            plugins.reset_plugin_manager()
    table = DispatchTable(home / "table.json")
    _add_stale_entries(table)
    return table.path, home / "studies.journal"


def _add_stale_entries(table: DispatchTable) -> None:
    [(_, _, _, key, entry)] = [item for item in table.entries() if "autograd=false" in item[3]]
    here = current_fingerprint("cpu")
    big = "batch_size=1024,in_features=8192,out_features=8192"
    table.record(OTHER_GPU, "matmul_gelu_softmax", big, key, {
        **entry, "variant": "cublas_epilogue", "params": {}, "median_ms": 2.71, "study": "tuned|over|there",
        "source_hash": registry.get_variant("matmul_gelu_softmax", "cublas_epilogue").source_hash(),
        "candidates": {"eager": {"params": {}, "outcome": "ok", "median_ms": 2.79},
                       "cublas_epilogue": {"params": {}, "outcome": "ok", "median_ms": 2.71},
                       "cuda_naive": {"params": {}, "outcome": "timed_out", "median_ms": None}}})
    table.record(dict(here, torch="2.0.0"), "matmul_gelu_softmax", "batch_size=8,in_features=48,out_features=40", key,
                 {**copy.deepcopy(entry), "study": entry["study"].replace("torch ", "torch 2.0.0 was ")})
    table.record(here, "matmul_gelu_softmax", "batch_size=4,in_features=48,out_features=40", key,
                 {**entry, "variant": "simplified", "source_hash": "0" * 16, "candidates": None, "study": None})
    table.record(here, "gemm_bn", "batch_size=4,in_features=6,out_features=5",  # hand-edited, badly
                 "dtype=float32,precision=fp32,mode=train,autograd=false",
                 {"variant": EVIL, "params": {"<em id=k>": "<u>v</u>"}, "median_ms": "fast", "speedup": True, "date": EVIL})


class Page(html.parser.HTMLParser):
    """What the tests read from the page: its entries (staleness, text, candidate rows), overview rows, images."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.body, self.entries, self.overview, self.images, self._entry = {}, {}, [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "div" and "entry" in attrs.get("class", "").split():
            self._entry = self.entries[attrs["id"]] = {"stale": attrs["data-stale"], "text": "", "rows": {}, "images": []}
        elif tag == "tr" and "data-variant" in attrs and self._entry is not None:
            self._entry["rows"][attrs["data-variant"]] = attrs["data-outcome"]
        elif tag == "tr" and "data-problem" in attrs:
            self.overview.append(attrs)
        elif tag == "img":
            self.images.append(attrs["src"])
            if self._entry is not None:
                self._entry["images"].append(attrs["src"])

    def handle_data(self, data):
        if self._entry is not None:
            self._entry["text"] += data


def _report(tuned, out, **kwargs) -> Page:
    table, journal = tuned
    index = write_report(table, out, kwargs.pop("journal", journal))
    return Page(index.read_text(encoding="utf-8"))


def _by_entry(table):
    """(entry id on the page, shape key, dispatch key, entry) in the table's order, as the page numbers them."""
    return [(f"entry-{i}", shape, key, entry) for i, (_, _, shape, key, entry) in enumerate(DispatchTable(table).entries())]


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG: starts {head[:8]!r}"
    return struct.unpack(">II", head[16:24])


def test_every_entry_shows_each_variant_outcome_and_staleness(tuned, tmp_path):
    page = _report(tuned, tmp_path / "out")
    entries = _by_entry(tuned[0])
    assert len(page.overview) == len(entries) == len(page.entries)
    for anchor, shape, key, entry in entries:
        shown = page.entries[anchor]
        expected = {name: c["outcome"] for name, c in entry["candidates"].items()} \
            if isinstance(entry.get("candidates"), dict) else {entry["variant"]: "ok"}
        assert shown["rows"] == expected, (anchor, shape, key)
        why = EXPECTED[shape]
        assert shown["stale"] == ("true" if why else "false"), (shape, shown["text"][:300])
        assert why is None or why in shown["text"], (why, shown["text"][:600])
    tuned_rows = page.entries[entries[[s for _, s, k, _ in entries].index(TUNED)][0]]["rows"]
    assert {"ok", "incorrect", "runtime_failed", "compile_failed"} <= set(tuned_rows.values())


def test_charts_and_the_tuning_history_are_pngs_beside_the_page(tuned, tmp_path):
    page = _report(tuned, tmp_path / "out")
    shapes = {shape for _, shape, _, _ in _by_entry(tuned[0])}
    charts = [src for src in page.images if src.startswith("chart-")]
    histories = {src for src in page.images if src.startswith("history-")}
    assert len(charts) == len(shapes) and len(histories) == 1, page.images
    for src in page.images:
        width, height = _png_size(tmp_path / "out" / src)
        assert width >= 300 and height >= 100, (src, width, height)
    tuned_anchor = next(a for a, s, k, _ in _by_entry(tuned[0]) if s == TUNED and "autograd=false" in k)
    assert [src for src in page.entries[tuned_anchor]["images"] if src in histories], page.entries[tuned_anchor]
    other = next(a for a, s, _, _ in _by_entry(tuned[0]) if s.startswith("batch_size=1024"))
    assert "is not in the journal here" in page.entries[other]["text"]


def test_without_the_journal_the_page_says_so_and_creates_none(tuned, tmp_path):
    journal = tmp_path / "absent.journal"
    page = _report(tuned, tmp_path / "out", journal=journal)
    assert not journal.exists() and not any(src.startswith("history-") for src in page.images)
    assert all("is not in the journal here" in e["text"] or "No study" in e["text"] for e in page.entries.values())


def test_values_from_a_hand_edited_table_are_escaped(tuned, tmp_path):
    text = write_report(tuned[0], tmp_path / "out", tuned[1]).read_text(encoding="utf-8")
    assert EVIL not in text and "<em id=k>" not in text and "<u>" not in text
    assert html.escape(EVIL) in text and html.escape("<u>v</u>") in text


def test_the_cli_writes_the_page_and_a_corrupt_table_is_a_message(tuned, tmp_path, capsys):
    assert main(["report", "--table", str(tuned[0]), "--out", str(tmp_path / "out"), "--studies", str(tuned[1])]) == 0
    assert f"wrote {tmp_path / 'out' / 'index.html'}" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "autofuse-dispatch-table", "vers')
    assert main(["report", "--table", str(bad), "--out", str(tmp_path / "bad-out")]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "left intact" in err and "Traceback" not in err
    assert not (tmp_path / "bad-out" / "index.html").exists()


def test_without_matplotlib_the_error_says_what_to_install(tuned, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["report", "--table", str(tuned[0]), "--out", str(tmp_path / "out")]) == 2
    assert 'pip install "autofuse[report]"' in capsys.readouterr().err


def _chromium(*args, tmp_path) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}"
    return done


@pytest.mark.chromium
def test_the_page_renders_in_a_headless_browser(tuned, tmp_path):
    index = write_report(tuned[0], tmp_path / "out", tuned[1])
    dom = Page(_chromium("--dump-dom", index.as_uri(), tmp_path=tmp_path).stdout)
    assert dom.body.get("data-images") == "ok", f"images did not all load: {dom.body}"
    assert int(dom.body["data-images-loaded"]) == len(dom.images) == len(Page(index.read_text()).images) > 0
    assert len(dom.overview) == len(_by_entry(tuned[0])) and len(dom.entries) == len(dom.overview)
    shot = tmp_path / "shot.png"
    _chromium("--window-size=1200,1600", f"--screenshot={shot}", index.as_uri(), tmp_path=tmp_path)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1600, 1200) and pixels[..., :3].std() > 0.05, "the screenshot is blank"


def test_an_empty_or_missing_table_gives_a_page_that_says_so(tmp_path):
    page = write_report(tmp_path / "none.json", tmp_path / "out", tmp_path / "none.journal").read_text(encoding="utf-8")
    assert "holds no entries yet" in page and not (tmp_path / "none.json").exists()
