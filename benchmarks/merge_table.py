"""Merge a copy of the table that a GPU run tuned back into the shipped one.

    python3 benchmarks/merge_table.py TUNED [--base BASE] [--into benchmarks/table.json] [--tolerance 0.02]

A device run tunes a copy (``autofuse tune ... --table COPY``), so a run cut short by its time
limit leaves the shipped table as it was, and the copy comes back with the run's other files.
Per key of each device in the copy:

- a key the shipped table lacks is taken;
- with ``--base``, the table the copy was made from, a record the copy holds as the base does
  is left out: the run did not touch it. Two copies of one table, each re-gating a different
  family's tuned entry (``gated_batches``: a race at a rung can add the batch or drop it),
  merge only so; without it the second copy's untouched records undo the first's;
- a record of the same date is taken with the shipped record's source hash: the same race,
  re-gated, perhaps re-stamped since in the tree;
- a newer record is taken unless the older is faster by more than ``--tolerance``: a re-race
  within that of the record refreshes it (a record timed before a timer fix then stops being
  listed by ``benchmarks/gpu/batch_class_gaps.py --timed-before``), one clearly slower keeps the
  older and is printed, a slowdown to explain before the older record goes;
- but a newer record whose race failed the older record's winner (the same variant and
  parameters: incorrect, crashed, timed out) is taken however slow, and printed: the table
  must not serve what its latest gate rejected;
- an older record than the shipped one is left out.

Writes the table in its own layout; re-stamp afterwards if the copy's code was not the tree's.
"""

import argparse
import json
import pathlib

from restamp_table import write_table  # this folder: the script's own path


def _record(table: dict, device: str, problem: str, shape: str, key: str) -> dict | None:
    return table["devices"].get(device, {}).get("problems", {}).get(problem, {}).get(shape, {}).get(key)


def merge(shipped: dict, tuned: dict, tolerance: float, base: dict | None = None) -> tuple[int, list[str]]:
    """Merge ``tuned``'s devices into ``shipped`` in place, leaving out what ``tuned`` holds as
    ``base`` does: (records taken, what was kept or taken and why)."""
    taken, notes = 0, []
    for name, device in tuned["devices"].items():
        if name not in shipped["devices"]:
            shipped["devices"][name] = device
            taken += sum(len(keys) for shapes in device["problems"].values() for keys in shapes.values())
            continue
        problems = shipped["devices"][name]["problems"]
        for problem, shapes in device["problems"].items():
            for shape, keys in shapes.items():
                held = problems.setdefault(problem, {}).setdefault(shape, {})
                for key, new in keys.items():
                    old = held.get(key)
                    if base is not None and _record(base, name, problem, shape, key) == new:
                        continue  # the copy left it as it found it
                    if old is not None and old["date"] == new["date"] and "source_hash" in old:
                        new = {**new, "source_hash": old["source_hash"]}  # the same race: the tree's stamp stays
                    if old == new:
                        continue
                    failed = None if old is None else _failed_in_race(old, new)
                    why = None if old is None or failed else _keep_older(old, new, tolerance)
                    if why:
                        notes.append(f"kept {problem} {shape} {key}: {why}")
                        continue
                    if failed:
                        notes.append(f"took {problem} {shape} {key}: {failed}")
                    held[key], taken = new, taken + 1
    return taken, notes


def _failed_in_race(old: dict, new: dict) -> str | None:
    """How ``new``'s race failed ``old``'s winner (its variant with its parameters), or None."""
    trial = new.get("candidates", {}).get(old["variant"])
    if new["date"] <= old["date"] or not trial or trial.get("params", {}) != old.get("params", {}):
        return None
    if trial.get("outcome") in (None, "ok", "out_of_reach"):
        return None
    return (f"the race failed the older record's {old['variant']} ({old['median_ms']:.4f} ms, "
            f"{old['date'][:10]}): {trial['outcome']}, {trial.get('reason')}; {new['variant']} "
            f"{new['median_ms']:.4f} ms serves instead")


def _keep_older(old: dict, new: dict, tolerance: float) -> str | None:
    """Why the shipped record ``old`` stays instead of ``new``, or None."""
    if new["date"] < old["date"]:
        return f"the shipped record is newer ({old['date']} against {new['date']})"
    if new["date"] > old["date"] and old.get("median_ms") and new.get("median_ms"):
        if new["median_ms"] > old["median_ms"] * (1 + tolerance):
            return (f"the older record is faster: {old['variant']} {old['median_ms']:.4f} ms ({old['date'][:10]}) "
                    f"against {new['variant']} {new['median_ms']:.4f}")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tuned", type=pathlib.Path, help="the copy a GPU run tuned")
    ap.add_argument("--into", type=pathlib.Path, default=pathlib.Path("benchmarks/table.json"))
    ap.add_argument("--base", type=pathlib.Path, help="the table the copy was made from (say `git show "
                    "REV:benchmarks/table.json > BASE`): what the copy holds as it does is left out")
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="how much faster an older record must be to stay (default 0.02: 2%%)")
    args = ap.parse_args(argv)
    shipped = json.loads(args.into.read_text())
    base = json.loads(args.base.read_text()) if args.base else None
    taken, notes = merge(shipped, json.loads(args.tuned.read_text()), args.tolerance, base)
    write_table(args.into, shipped)
    kept = sum(note.startswith("kept ") for note in notes)
    print("\n".join(notes + [f"{taken} records taken from {args.tuned} into {args.into}, {kept} kept"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
