"""Dispatch tables served side by side at batches between their rungs, beside variants called directly.

    python3 benchmarks/gpu/tables_side_by_side.py matmul_clamp_lse_mish --precision bf16 \
        --tables shipped=benchmarks/table.json,new=NEW.json --batches 37,80,100,180,200,300 \
        [--variants compiled,cublas_epilogue] [--dtype float32] [--mode eval] [--out DIR]

For each batch b, each table serves the family's forward through ``get_module`` as a caller's
would, timed interleaved (``exact_batch.race_tables``: CUDA events, L2 flushed, medians of 30
rounds) with eager and with each of ``--variants`` called directly at its first configuration
there (no tune: the kinds a tune at b would race, as a floor for what one could find). One line
per batch: every median, the entry each table served (variant and source) and each table's time
over the fastest call timed. How the bf16 and tf32 ladders' rungs at 128 and 256 were measured
(docs/tuning.md): a table tuned with them against the shipped one, which lacks them.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from autofuse.bench.setup import FORWARD, make_setup
from autofuse.core import registry
from autofuse.core.variant import EagerVariant

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from exact_batch import family_parser, race_tables, shape_at, write_rows  # noqa: E402


def named_paths(text: str) -> dict[str, str]:
    """``name=path,...`` → {name: path}."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if not pairs or any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected name=path[,name=path...], got {text!r}")
    return dict(pairs)


def main(argv=None) -> int:
    ap = family_parser(__doc__.splitlines()[0], "37,80,100,180,200,300")
    ap.add_argument("--tables", required=True, type=named_paths, help="name=path,... served side by side")
    ap.add_argument("--variants", default="compiled,cublas_epilogue",
                    help="called directly at their first configuration beside the tables (names the problem "
                         "lacks are left out)")
    ap.add_argument("--out", default=None, type=pathlib.Path, help="write the lines as JSON here too")
    args = ap.parse_args(argv)
    prob = registry.get_problem(args.problem)
    mode = (args.mode or "train") if prob.mode_sensitive else "any"
    variants = registry.variants(prob.name)
    direct = [name for name in args.variants.split(",") if name in variants]
    rows = []
    for batch in args.batches:
        setup = make_setup(prob, shape_at(prob, batch, args.shape), "cuda", args.dtype, args.precision, mode,
                           FORWARD)
        others = {"eager": setup.timed(EagerVariant(args.precision))}
        for name in direct:
            configs = variants[name].configs_for(setup.shape, "cuda", args.precision)
            others[name] = setup.timed(variants[name](args.precision, **configs[0]))
        medians, served = race_tables(setup, args.tables, others)
        fastest = min(medians.values())
        row = {"batch": batch, **{f"{name}_ms": ms for name, ms in medians.items()},
               **{f"{name}_served_by": by for name, by in served.items()},
               **{f"{name}_over_fastest": medians[name] / fastest for name in args.tables}}
        rows.append(row)
        print(f"batch {batch:5d}: " + "  ".join(f"{name} {ms:.4f}" for name, ms in medians.items()) + "  |  "
              + "  ".join(f"{name}/fastest {row[f'{name}_over_fastest']:.3f} [{served[name]}]" for name in args.tables),
              flush=True)
    write_rows(args.out, f"tables-side-by-side-{prob.name}-{args.precision}-{args.dtype}-{mode}.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
