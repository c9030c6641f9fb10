"""The shipped table (benchmarks/table.json) describes the code beside it: no stale entry, and
every batch of a tuned shape family is served by an entry gated in its batch class.

Each entry's variant must exist and carry the source hash it was measured with; a change to a
variant's files moves its hash, and the entry must then be retuned on a GPU, or re-stamped with
benchmarks/restamp_table.py where the change provably keeps the kernels (its docstring says when).
A family tuned without batch classes serves other batches ungated or by the reference;
benchmarks/gpu/batch_class_gaps.py --run adds them.
"""

import pathlib

import pytest

from autofuse.core import registry
from autofuse.report.entries import variant_staleness
from autofuse.serve.dispatch import serving
from autofuse.serve.table import DispatchKey, DispatchTable, parse_shape_key
from autofuse.tuning.batch_classes import smallest_batch

SHIPPED = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "table.json"
ENTRIES = list(DispatchTable(SHIPPED).entries())


@pytest.fixture(autouse=True)
def every_variant(with_compiled):
    """`compiled` registered too (conftest leaves it out of other tests): the table holds its entries."""


def test_the_shipped_table_loads_and_has_entries():
    assert len(ENTRIES) >= 40


@pytest.mark.parametrize("problem, shape, key, entry", [(p, s, k, e) for _, p, s, k, e in ENTRIES],
                         ids=[f"{p}-{s.split(',')[0]}-{k}" for _, p, s, k, _ in ENTRIES])
def test_no_shipped_entry_is_stale(problem, shape, key, entry):
    assert variant_staleness(problem, entry) == [], (
        f"{problem} {shape} {key}: the variant's source changed since it was tuned; retune it, or run "
        f"benchmarks/restamp_table.py if the change keeps its kernels")


def _tuned_families():
    """(device section, problem, tuned shape key, dispatch key) of every entry a search wrote (not a
    batch class's), in every device section the table holds."""
    return sorted({(d, p, s, k) for d, p, s, k, e in ENTRIES
                   if "rung_of" not in e and registry.get_problem(p).batch_dim is not None})


@pytest.mark.parametrize("device_key, problem, shape, key", _tuned_families(),
                         ids=[f"{d.split('|')[1]}-{p}-{s.split(',')[0]}-{k}" for d, p, s, k in _tuned_families()])
def test_every_batch_of_a_tuned_family_is_served_by_a_gated_entry_at_its_precision(device_key, problem, shape, key):
    """Issue 34's batches (1 or a training BatchNorm's 2, 8, 37, 100, 512, B-1, B+1, 2B): the entry
    the runtime would serve on the table's GPU is of the key's own precision and of the family's
    tune (the entry at B, or one its batch classes gated: ``rung_of``), never the reference, a
    stricter precision's entry or another tune's. benchmarks/gpu/batch_class_gaps.py checks every
    batch from 1 to 2B."""
    prob, dkey = registry.get_problem(problem), DispatchKey.from_str(key)
    device = DispatchTable(SHIPPED).load()["devices"][device_key]
    tuned, shapes = parse_shape_key(shape), device["problems"][problem]
    assert any(by_key.get(key, {}).get("rung_of") == shape for by_key in shapes.values()), (
        "tuned without batch classes: another batch is served by an entry gated only at B "
        "(benchmarks/gpu/batch_class_gaps.py --run adds them)")
    b = tuned[prob.batch_dim]
    for batch in sorted({smallest_batch(prob, dkey.mode), 8, 37, 100, 512, b - 1, b + 1, 2 * b}):
        served, why = serving(shapes, prob, {**tuned, prob.batch_dim: batch}, dkey, "cuda", lacking_ok=True)
        assert served is not None, f"batch {batch}: the reference would serve ({why})"
        assert served.precision == dkey.precision, (batch, served.source)
        assert shape in (served.shape, served.entry.get("rung_of")), (batch, served.source)
