"""Re-stamp the shipped table's source hashes after a change that keeps every variant's kernels.

    python3 benchmarks/restamp_table.py [benchmarks/table.json]

An entry records the source hash of the variant it measured; ``autofuse report`` (and
tests/test_shipped_table.py) call an entry stale once the hash moves. A change that moves files,
rewrites comments or imports, or restructures code into the same kernels (the same SASS) keeps
what was measured: re-stamp then, after checking on a GPU that each tabled configuration still
runs at its recorded speed (``.ci``-free: run ``autofuse bench`` or benchmarks/gpu/ scripts on the
tabled keys). Any change to what a kernel computes or how fast it runs is a retune instead.
Prints each entry whose hash it changes.
"""

import json
import pathlib
import sys

from autofuse.core import registry
from autofuse.errors import UnknownNameError


def restamp(path: pathlib.Path) -> int:
    doc = json.loads(path.read_text())
    changed = 0
    for device in doc["devices"].values():
        for problem, shapes in device["problems"].items():
            for shape, keys in shapes.items():
                for key, entry in keys.items():
                    try:
                        now = registry.get_variant(problem, entry["variant"]).source_hash()
                    except UnknownNameError as exc:
                        raise SystemExit(f"{problem} {shape} {key}: {exc}; retune this entry") from None
                    if entry.get("source_hash") != now:
                        print(f"{problem} {shape} {key}: {entry['variant']} {entry.get('source_hash')} -> {now}")
                        entry["source_hash"], changed = now, changed + 1
    write_table(path, doc)
    return changed


def write_table(path: pathlib.Path, doc: dict) -> None:
    """``doc`` to ``path`` in the table's own layout (schema and version first, sorted below), as
    DispatchTable writes it."""
    head = {"schema": doc["schema"], "version": doc["version"]}
    devices = json.loads(json.dumps(doc["devices"], sort_keys=True))
    path.write_text(json.dumps({**head, "devices": devices}, indent=2) + "\n")


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/table.json")
    print(f"{restamp(target)} entries re-stamped in {target}")
