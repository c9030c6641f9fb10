"""The dispatch table: keys, round-trips, merging, concurrency, and files left intact."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import subprocess
import sys

import filelock
import pytest

from autofuse.errors import TableError
from autofuse.serve import table as table_mod
from autofuse.serve.table import (
    SCHEMA,
    VERSION,
    DispatchKey,
    DispatchTable,
    current_fingerprint,
    default_table_path,
    fingerprint_key,
    parse_shape_key,
    shape_key,
)

CUDA_FP = {
    "kind": "cuda",
    "name": "NVIDIA H200",
    "capability": "9.0",
    "sm_count": 132,
    "cuda": "13.0",
    "torch": "2.11.0+cu130",
}
CPU_FP = {"kind": "cpu", "name": "x86_64", "cores": 2, "torch": "2.13.0+cpu"}
SHAPE = shape_key({"batch_size": 1024, "in_features": 8192, "out_features": 8192})
DKEY = DispatchKey("float32", "fp32", "train", False).to_str()


def entry(variant: str = "simplified", median_ms: float = 0.5) -> dict:
    return {"variant": variant, "params": {"BLOCK": 256}, "median_ms": median_ms, "trials": 30}


# --- keys -------------------------------------------------------------------------------


def test_shape_key_keeps_order_and_round_trips():
    shape = {"out_features": 8192, "batch_size": 1, "in_features": 8191}
    key = shape_key(shape)
    assert key == "out_features=8192,batch_size=1,in_features=8191"
    assert list(parse_shape_key(key).items()) == list(shape.items())
    assert parse_shape_key(shape_key({})) == {}


@pytest.mark.parametrize(
    "key, bad_part",
    [
        ("batch_size=1024,in_features", "in_features"),
        ("batch_size=abc", "abc"),
        ("batch_size=-1", "-1"),
        ("=3", "=3"),
        ("a=1,a=2", "a"),
        ("a=1=2", "a=1=2"),
    ],
)
def test_parse_shape_key_names_the_bad_part(key, bad_part):
    with pytest.raises(ValueError, match=bad_part):
        parse_shape_key(key)


@pytest.mark.parametrize("shape", [{"a": 1.5}, {"a": True}, {"a,b": 1}, {"a": -1}])
def test_shape_key_rejects_what_would_not_round_trip(shape):
    with pytest.raises(ValueError):
        shape_key(shape)


@pytest.mark.parametrize(
    "key",
    [
        DispatchKey("float32", "fp32", "train", False),
        DispatchKey("bfloat16", "bf16", "eval", True),
        DispatchKey("float32", "tf32", "any", True),
    ],
)
def test_dispatch_key_round_trips(key):
    assert DispatchKey.from_str(key.to_str()) == key


def test_dispatch_key_string_form():
    assert DKEY == "dtype=float32,precision=fp32,mode=train,autograd=false"


@pytest.mark.parametrize(
    "text, match",
    [
        ("dtype=float32,precision=fp32,mode=train", "exactly"),
        ("dtype=float16,precision=fp32,mode=train,autograd=false", "float16"),
        ("dtype=float32,precision=fp32,mode=train,autograd=yes", "yes"),
        ("dtype=float32,precision=fp32,mode=train,autograd", "autograd"),
    ],
)
def test_dispatch_key_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        DispatchKey.from_str(text)


def test_dispatch_key_validates_itself():
    with pytest.raises(ValueError, match="mode"):
        DispatchKey("float32", "fp32", "inference", False)
    with pytest.raises(ValueError, match="autograd"):
        DispatchKey("float32", "fp32", "train", 1)


# --- fingerprints and paths ---------------------------------------------------------------


def test_default_table_path_honours_autofuse_home(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOFUSE_HOME", str(tmp_path / "home"))
    assert default_table_path() == tmp_path / "home" / "table.json"
    assert DispatchTable().path == tmp_path / "home" / "table.json"
    monkeypatch.delenv("AUTOFUSE_HOME")
    assert default_table_path() == pathlib.Path.home() / ".cache" / "autofuse" / "table.json"


def test_cpu_fingerprint_has_documented_keys_and_stable_key():
    import torch

    fp = current_fingerprint("cpu")
    assert set(fp) == {"kind", "name", "cores", "torch"}
    assert fp["kind"] == "cpu" and fp["cores"] == os.cpu_count() and fp["torch"] == torch.__version__
    assert current_fingerprint(torch.device("cpu")) == fp
    assert fingerprint_key(fp) == fingerprint_key(dict(reversed(fp.items())))
    assert fingerprint_key(CPU_FP) == "cpu|x86_64|2 cores|torch 2.13.0+cpu"


def test_cuda_fingerprint_key():
    assert fingerprint_key(CUDA_FP) == "cuda|NVIDIA H200|sm_90|132 SMs|cuda 13.0|torch 2.11.0+cu130"
    with pytest.raises(ValueError, match="sm_count"):
        fingerprint_key({k: v for k, v in CUDA_FP.items() if k != "sm_count"})


# --- record, lookup, merge -----------------------------------------------------------------


def test_record_then_lookup_round_trips(tmp_path):
    path = tmp_path / "sub" / "dir" / "table.json"  # parents are created
    table = DispatchTable(path)
    assert table.lookup(fingerprint_key(CUDA_FP), "gemm_bn", SHAPE, DKEY) is None
    table.record(CUDA_FP, "gemm_bn", SHAPE, DKEY, entry())
    assert table.lookup(fingerprint_key(CUDA_FP), "gemm_bn", SHAPE, DKEY) == entry()
    assert table.lookup(fingerprint_key(CUDA_FP), "gemm_bn", SHAPE, DispatchKey.from_str(DKEY)) == entry()
    assert table.lookup(fingerprint_key(CPU_FP), "gemm_bn", SHAPE, DKEY) is None
    doc = json.loads(path.read_text())
    assert doc["schema"] == SCHEMA and doc["version"] == VERSION
    assert doc["devices"][fingerprint_key(CUDA_FP)]["fingerprint"] == CUDA_FP
    assert path.read_text().endswith("}\n") and "\n  " in path.read_text()  # indented for people
    assert list(table.entries()) == [(fingerprint_key(CUDA_FP), "gemm_bn", SHAPE, DKEY, entry())]


def test_missing_file_is_an_empty_table(tmp_path):
    table = DispatchTable(tmp_path / "nothing.json")
    assert table.load() == {"schema": SCHEMA, "version": VERSION, "devices": {}}
    assert list(table.entries()) == []


def test_two_tables_on_one_path_merge_and_same_key_is_replaced(tmp_path):
    path = tmp_path / "table.json"
    first, second = DispatchTable(path), DispatchTable(str(path))
    eval_key = DispatchKey("float32", "fp32", "eval", False).to_str()
    first.record(CUDA_FP, "gemm_bn", SHAPE, DKEY, entry("a"))
    second.record(CUDA_FP, "gemm_bn", SHAPE, eval_key, entry("b"))
    second.record(CPU_FP, "matmul_gelu_softmax", "n=1", DKEY, entry("c"))
    first.record(CUDA_FP, "gemm_bn", SHAPE, DKEY, entry("a2", 0.25))
    found = {(f, p, s, d): e["variant"] for f, p, s, d, e in DispatchTable(path).entries()}
    assert found == {
        (fingerprint_key(CUDA_FP), "gemm_bn", SHAPE, DKEY): "a2",
        (fingerprint_key(CUDA_FP), "gemm_bn", SHAPE, eval_key): "b",
        (fingerprint_key(CPU_FP), "matmul_gelu_softmax", "n=1", DKEY): "c",
    }


def test_record_many_writes_all_items(tmp_path):
    table = DispatchTable(tmp_path / "table.json")
    table.record_many([(CUDA_FP, "gemm_bn", f"n={n}", DKEY, entry(str(n))) for n in range(5)])
    assert sorted(e["variant"] for *_, e in table.entries()) == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(
    "item, match",
    [
        ((CUDA_FP, "gemm_bn", "n=x", DKEY, entry()), "n=x"),
        ((CUDA_FP, "gemm_bn", "n=1", "dtype=float32", entry()), "dispatch key"),
        ((CUDA_FP, "gemm_bn", "n=1", DKEY, {"t": object()}), "serializable"),
        ((CUDA_FP, "", "n=1", DKEY, entry()), "problem"),
        (({"kind": "cuda"}, "gemm_bn", "n=1", DKEY, entry()), "lacks"),
    ],
)
def test_record_rejects_bad_items_before_touching_the_file(tmp_path, item, match):
    path = tmp_path / "table.json"
    with pytest.raises(TableError, match=match):
        DispatchTable(path).record(*item)
    assert not path.exists()


# --- concurrency ---------------------------------------------------------------------------


def _record_twenty(path: str, worker: int) -> None:
    table = DispatchTable(path)
    for i in range(20):
        table.record(CUDA_FP, "gemm_bn", shape_key({"worker": worker, "i": i}), DKEY, {"worker": worker, "i": i})


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "table.json"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_record_twenty, args=(str(path), w)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=60)
    assert [p.exitcode for p in workers] == [0, 0, 0, 0]
    json.loads(path.read_text())  # still one valid document
    found = {(e["worker"], e["i"]) for *_, e in DispatchTable(path).entries()}
    assert found == {(w, i) for w in range(4) for i in range(20)}


def test_lock_timeout_names_the_lock_file(tmp_path, monkeypatch):
    table = DispatchTable(tmp_path / "table.json")
    monkeypatch.setattr(table_mod, "LOCK_TIMEOUT_S", 0.1)
    with filelock.FileLock(str(table.lock_path)):
        with pytest.raises(TableError, match="table.json.lock"):
            table.record(CUDA_FP, "gemm_bn", SHAPE, DKEY, entry())
    assert not table.path.exists()


# --- files left intact ------------------------------------------------------------------------


def _valid_document() -> str:
    doc = {"schema": SCHEMA, "version": VERSION, "devices": {}}
    doc["devices"][fingerprint_key(CUDA_FP)] = {
        "fingerprint": CUDA_FP,
        "problems": {"gemm_bn": {SHAPE: {DKEY: entry()}}},
    }
    return json.dumps(doc, indent=2) + "\n"


BAD_FILES = {
    "garbage": (b"\x00\xff not json at all \x89PNG", "not valid JSON"),
    "truncated": (_valid_document()[: len(_valid_document()) // 2].encode(), "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "foreign": (b'{"foo": 1}', "not an autofuse dispatch table"),
    "list": (b"[1, 2]", "not an autofuse dispatch table"),
    "newer": (json.dumps({"schema": SCHEMA, "version": VERSION + 1, "devices": {}}).encode(), "newer"),
    "bad layout": (json.dumps({"schema": SCHEMA, "version": VERSION, "devices": {"x": 1}}).encode(), "'x'"),
    # json.loads raised RecursionError here, which no caller catches (issue 32).
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, "nested"),
    # Loads, but nested deeper than any table autofuse writes: json.dumps of it on a deeper
    # stack (a rewrite under the lock, a module's first call) would raise RecursionError.
    "deep entry": (_valid_document().replace('"BLOCK": 256', '"BLOCK": ' + "[" * 500 + "]" * 500).encode(), "nested"),
}


@pytest.mark.parametrize("content, match", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_file_is_reported_and_left_intact(tmp_path, content, match):
    path = tmp_path / "table.json"
    path.write_bytes(content)
    table = DispatchTable(path)
    for action in (
        table.load,
        lambda: table.lookup(fingerprint_key(CUDA_FP), "gemm_bn", SHAPE, DKEY),
        lambda: list(table.entries()),
        lambda: table.record(CUDA_FP, "gemm_bn", SHAPE, DKEY, entry()),
    ):
        with pytest.raises(TableError, match=match) as info:
            action()
        assert str(path) in str(info.value) and "left intact" in str(info.value)
    assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "table.json.lock") == ["table.json"]


@pytest.mark.parametrize("broken", ["replace", "fsync"])
def test_failed_write_keeps_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch, broken):
    path = tmp_path / "table.json"
    table = DispatchTable(path)
    table.record(CUDA_FP, "gemm_bn", SHAPE, DKEY, entry())
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(f"simulated {broken} failure")

    monkeypatch.setattr(os, broken, boom)
    with pytest.raises(OSError, match="simulated"):
        table.record(CPU_FP, "gemm_bn", SHAPE, DKEY, entry("other"))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "table.json.lock") == ["table.json"]


def test_rewrite_keeps_the_file_mode(tmp_path):
    path = tmp_path / "table.json"
    table = DispatchTable(path)
    table.record(CUDA_FP, "gemm_bn", SHAPE, DKEY, entry())
    path.chmod(0o664)
    table.record(CPU_FP, "gemm_bn", SHAPE, DKEY, entry())
    assert path.stat().st_mode & 0o777 == 0o664


def test_importing_the_table_does_not_import_torch():
    # Reading a table (autofuse show, a runtime lookup) must not pay seconds for torch.
    code = (
        "import sys, autofuse\n"
        "if 'torch' in sys.modules: print('autofuse itself imports torch'); sys.exit(0)\n"
        "import autofuse.serve.table\n"
        "assert 'torch' not in sys.modules, 'autofuse.serve.table imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
