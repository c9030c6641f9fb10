"""Which of a shape family's rungs serves a batch between two of them faster: the one below or the one above.

    python3 benchmarks/gpu/between_rungs.py matmul_clamp_lse_mish --precision bf16 --batches 37,48,100 \
        [--dtype float32] [--mode eval] [--table benchmarks/table.json] [--out DIR]

For each batch b, the table is served twice, through ``get_module`` as a caller would: once with
the key's entries above b left out (the nearest rung below serves) and once with those below b
left out (the nearest above serves), timed interleaved with eager (``time_interleaved``: CUDA
events, L2 flushed, medians of 30 rounds) on one model and input. One line per batch: each side's
entry (its batch and variant) and median, and below over above. Where a rung's configuration
holds fewer rows per tile than b has, the weight is read once per row tile: 22 at batch 37 under
bf16 took 0.0692 ms from rung 32's 32-row tile where a tune at 37 found 0.0437 (H200).
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys
import tempfile

from autofuse.bench.setup import FORWARD, make_setup
from autofuse.core import registry
from autofuse.core.variant import EagerVariant
from autofuse.serve.table import DispatchKey, parse_shape_key

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from exact_batch import family_parser, race_tables, shape_at, write_rows  # noqa: E402


def without(table: dict, prob, dkey: str, keep) -> dict:
    """``table`` with the entries of ``dkey`` in ``prob``'s family left out where ``keep(batch)`` is false."""
    table = copy.deepcopy(table)
    for section in table["devices"].values():
        for skey, by_key in section.get("problems", {}).get(prob.name, {}).items():
            batch = parse_shape_key(skey).get(prob.batch_dim)
            if dkey in by_key and batch is not None and not keep(batch):
                del by_key[dkey]
    return table


def main(argv=None) -> int:
    ap = family_parser(__doc__.splitlines()[0], "37,48,100")
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--out", default=None, type=pathlib.Path, help="write the lines as JSON here too")
    args = ap.parse_args(argv)
    prob = registry.get_problem(args.problem)
    mode = (args.mode or "train") if prob.mode_sensitive else "any"
    table = json.loads(pathlib.Path(args.table).read_text())
    dkey = DispatchKey(args.dtype, args.precision, mode, False).to_str()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            setup = make_setup(prob, shape_at(prob, batch, args.shape), "cuda", args.dtype, args.precision,
                               args.mode or "train", FORWARD)
            tables = {}
            for side, keep in (("below", lambda b: b <= batch), ("above", lambda b: b >= batch)):
                tables[side] = pathlib.Path(tmp) / f"{side}-{batch}.json"
                tables[side].write_text(json.dumps(without(table, prob, dkey, keep)))
            medians, served = race_tables(setup, {side: str(path) for side, path in tables.items()},
                                          {"eager": setup.timed(EagerVariant(args.precision))})
            row = {"batch": batch, **{f"{name}_ms": ms for name, ms in medians.items()},
                   **{f"{side}_served_by": by for side, by in served.items()},
                   "below_over_above": medians["below"] / medians["above"]}
            rows.append(row)
            print(f"batch {batch:5d}: below {medians['below']:.4f} ms [{row['below_served_by']}]  above "
                  f"{medians['above']:.4f} ms [{row['above_served_by']}]  eager {medians['eager']:.4f}  "
                  f"below/above {row['below_over_above']:.3f}", flush=True)
    write_rows(args.out, f"between-rungs-{prob.name}-{args.precision}-{args.dtype}-{mode}.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
