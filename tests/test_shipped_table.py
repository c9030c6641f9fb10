"""The shipped table (benchmarks/table.json) describes the code beside it: no stale entry.

Each entry's variant must exist and carry the source hash it was measured with; a change to a
variant's files moves its hash, and the entry must then be retuned on a GPU, or re-stamped with
benchmarks/restamp_table.py where the change provably keeps the kernels (its docstring says when).
"""

import pathlib

import pytest

from autofuse.report.entries import variant_staleness
from autofuse.serve.table import DispatchTable

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
