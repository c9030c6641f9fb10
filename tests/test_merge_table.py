"""benchmarks/merge_table.py: a tuned copy of the table merged back into the shipped one, per key."""

import json
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _record(variant, ms, date):
    return {"variant": variant, "median_ms": ms, "date": f"2026-12-0{date}T00:00:00+00:00", "params": {}}


def test_a_tuned_copy_merges_fresh_records_and_keeps_clearly_faster_older_ones(tmp_path, monkeypatch, capsys):
    """Taken: a new key, a re-gated record of the same date (with the shipped record's source hash,
    which a re-stamp may have moved since the copy was made), a newer one within the tolerance, a
    newer faster one, and a device the shipped table lacks. Kept, and said: an older record more
    than 2% faster than its re-race, and a shipped record newer than the copy's. Taken, and said:
    a slower re-race whose gate failed the older record's winner (its variant and parameters);
    a failure of the same variant at other parameters does not count."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import merge_table

    shape = "batch_size=8,in_features=64,out_features=32"
    keys = [f"dtype=float32,precision={p},mode={m},autograd=false"
            for m in ("eval", "train", "any") for p in ("bf16", "tf32", "fp32")]
    held = {keys[1]: {**_record("triton", 1.0, 1), "source_hash": "restamped", "gated_batches": [8, 37]},
            keys[2]: _record("eager", 1.0, 1),
            keys[3]: _record("triton", 1.0, 1), keys[4]: _record("triton", 1.0, 1), keys[5]: _record("triton", 1.0, 5),
            keys[6]: {**_record("single_pass", 0.4, 1), "params": {"block": 512}},
            keys[7]: {**_record("single_pass", 0.4, 1), "params": {"block": 512}}}
    shipped = {"schema": "autofuse-dispatch-table", "version": 1,
               "devices": {"cuda|H100": {"fingerprint": {}, "problems": {"gemm_bn": {shape: held}}}}}
    regated = {**_record("triton", 1.0, 1), "gated_batches": [1, 8], "source_hash": "as tuned"}
    raced = {keys[0]: _record("triton", 0.5, 6), keys[1]: regated, keys[2]: _record("compiled", 1.015, 6),
             keys[3]: _record("triton", 0.8, 6), keys[4]: _record("triton", 1.16, 6),
             keys[5]: _record("triton", 0.9, 3)}
    for key, params in ((keys[6], {"block": 512}), (keys[7], {"block": 256})):
        failed = {"outcome": "incorrect", "params": params, "reason": "gradient of subtract: 0.0153 > 0.015"}
        raced[key] = {**_record("simplified", 1.0, 6), "candidates": {"single_pass": failed}}
    tuned = {"schema": "autofuse-dispatch-table", "version": 1, "devices": {
        "cuda|H100": {"fingerprint": {}, "problems": {"gemm_bn": {shape: raced}}},
        "cuda|H200": {"fingerprint": {}, "problems": {"gemm_bn": {shape: {keys[0]: _record("triton", 0.4, 6)}}}}}}
    into, copy = tmp_path / "table.json", tmp_path / "tuned.json"
    into.write_text(json.dumps(shipped))
    copy.write_text(json.dumps(tuned))
    assert merge_table.main([str(copy), "--into", str(into)]) == 0
    merged = json.loads(into.read_text())
    records = merged["devices"]["cuda|H100"]["problems"]["gemm_bn"][shape]
    assert records[keys[0]]["median_ms"] == 0.5 and records[keys[1]] == {**regated, "source_hash": "restamped"}
    assert records[keys[2]]["variant"] == "compiled" and records[keys[3]]["median_ms"] == 0.8
    assert records[keys[4]]["median_ms"] == 1.0 and records[keys[5]]["date"].startswith("2026-12-05")
    assert records[keys[6]]["variant"] == "simplified" and records[keys[7]]["variant"] == "single_pass"
    assert merged["devices"]["cuda|H200"] == tuned["devices"]["cuda|H200"]
    assert list(merged) == ["schema", "version", "devices"]
    out = capsys.readouterr().out
    assert f"kept gemm_bn {shape} {keys[4]}: the older record is faster: triton 1.0000 ms (2026-12-01)" in out
    assert f"kept gemm_bn {shape} {keys[5]}: the shipped record is newer" in out
    assert (f"took gemm_bn {shape} {keys[6]}: the race failed the older record's single_pass (0.4000 ms, "
            "2026-12-01): incorrect, gradient of subtract: 0.0153 > 0.015; simplified 1.0000 ms serves instead") in out
    assert f"kept gemm_bn {shape} {keys[7]}: the older record is faster" in out
    assert out.strip().endswith("6 records taken from " + str(copy) + " into " + str(into) + ", 3 kept")


def test_two_copies_of_one_table_merge_each_ones_changes_given_their_base(tmp_path, monkeypatch, capsys):
    """Two runs tune copies of one table, each re-gating another family's tuned entry at the
    rungs it raced (a batch added or dropped). Merged one after the other with ``--base``, both
    changes stand; the second copy's untouched record does not undo the first's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import merge_table

    shape = "batch_size=8,in_features=64,out_features=32"
    key_a, key_b = (f"dtype=float32,precision={p},mode=any,autograd=true" for p in ("bf16", "fp32"))

    def table(a_batches, b_batches):
        records = {key_a: {**_record("triton", 1.0, 1), "gated_batches": a_batches},
                   key_b: {**_record("single_pass", 1.0, 1), "gated_batches": b_batches}}
        return {"schema": "autofuse-dispatch-table", "version": 1,
                "devices": {"cuda|H100": {"fingerprint": {}, "problems": {"p": {shape: records}}}}}

    base, into = tmp_path / "base.json", tmp_path / "table.json"
    base.write_text(json.dumps(table([8, 64], [8, 4096])))
    into.write_text(base.read_text())
    copies = {"first": table([1, 8, 64], [8, 4096]), "second": table([8, 64], [8])}  # 1 added; 4096 dropped
    for name, copy in copies.items():
        (tmp_path / name).write_text(json.dumps(copy))
        assert merge_table.main([str(tmp_path / name), "--base", str(base), "--into", str(into)]) == 0
    records = json.loads(into.read_text())["devices"]["cuda|H100"]["problems"]["p"][shape]
    assert records[key_a]["gated_batches"] == [1, 8, 64] and records[key_b]["gated_batches"] == [8]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("1 records taken") and out[1].startswith("1 records taken"), out
