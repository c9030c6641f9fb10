"""How close a tuned shape family serves a batch nobody tuned: the shipped table's dispatch at batch b
against a tune made at exactly b (issue 34's "every batch" target: at most 1.10x).

    python3 benchmarks/gpu/exact_batch.py matmul_clamp_lse_mish --precision bf16 --dtype float32 \
        --batches 1,8,37,100,512,1023,1025,2048 [--mode eval] [--table benchmarks/table.json] [--out DIR]

For each batch b: ``autofuse tune`` at the family's shape with the batch set to b into a fresh
table (``--budget quick --no-batch-classes --no-autograd-entry``: the forward key alone, as fast as
a tune gets), then the forward of the module ``get_module`` returns with the shipped table and
with that exact table, timed interleaved (``autofuse.tuning.timing.time_interleaved``: CUDA
events, L2 flushed, medians of 30 rounds), on the same model and input. It prints a line per batch:
the variant and source each table dispatches to, both medians, and their ratio. With ``--out`` the
exact tables stay there (``exact-tables-*/b<batch>.json``): each winner's configuration and the
candidates it beat. Each tune takes
20-60 s on an H100 once the CUDA variants are built (the first tune of a run builds them), so
a full list of batches takes minutes: run it for one key at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

from autofuse.bench.setup import FORWARD, dispatch_call, make_setup
from autofuse.core import registry
from autofuse.serve.table import parse_shape_key, shape_key
from autofuse.tuning.timing import time_interleaved


def shape_at(prob, batch: int, shape: str | None) -> dict:
    base = dict(prob.default_shapes[0])
    if shape:
        base.update(parse_shape_key(shape))
    base[prob.batch_dim] = batch
    return base


def family_parser(description: str, batches: str) -> argparse.ArgumentParser:
    """The arguments every script here takes: a problem, the key (precision, the model's dtype,
    mode), the family's shape and the batches (``batches``: the default list)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("problem")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mode", default=None)
    ap.add_argument("--shape", default=None, help="the family's shape (default: the first default shape)")
    ap.add_argument("--batches", default=batches, type=lambda s: [int(b) for b in s.split(",")])
    return ap


def race_tables(setup, tables: dict[str, str], others: dict | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """The setup's call served by each table (name → path) through ``get_module``, timed interleaved
    with ``others`` (name → call): (median ms by name, "variant (source)" by table name)."""
    calls, served = dict(others or {}), {}
    for name, table in tables.items():
        info, calls[name] = dispatch_call(setup, table)
        served[name] = f"{info['variant']} ({info['source']})"
    with torch.no_grad():
        timings = time_interleaved(calls, "cuda")
    return {name: t.median_ms for name, t in timings.items()}, served


def write_rows(out: pathlib.Path | None, name: str, rows: list[dict]) -> None:
    """The rows as JSON in ``out``/``name``, with the device named (nothing without ``out``)."""
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


def tune_exact(prob, shape: dict, args, table: pathlib.Path, home: pathlib.Path) -> int:
    """``autofuse tune`` at ``shape`` into ``table``; its return code. ``home`` is one
    AUTOFUSE_HOME for all the batches of a run, so each CUDA configuration is built once
    (``$AUTOFUSE_HOME/build``), not once a batch, and no study of another run is resumed. With a
    home per batch, 22 at bf16 on a fresh H100 got through one batch's tune in 330 s and 99 at
    fp32 through none in 200."""
    command = [sys.executable, "-m", "autofuse.cli", "tune", prob.name, "--shape", shape_key(shape),
               "--precision", args.precision, "--dtype", args.dtype, "--table", str(table), "--budget", "quick",
               "--no-batch-classes", "--no-autograd-entry", "--no-progress"]
    if args.mode:
        command += ["--mode", args.mode]
    if args.variants:
        command += ["--variants", args.variants]
    env = {**os.environ, "AUTOFUSE_HOME": str(home)}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.tune_timeout).returncode


def main(argv=None) -> int:
    ap = family_parser(__doc__.splitlines()[0], "1,8,37,100,512")
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--variants", default=None, help="the tunes' variants (default: all)")
    ap.add_argument("--tune-timeout", type=int, default=240)
    ap.add_argument("--out", default=None, type=pathlib.Path, help="write the lines as JSON here too")
    args = ap.parse_args(argv)
    prob = registry.get_problem(args.problem)
    mode = args.mode or "train"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tables = (args.out or pathlib.Path(tmp)) / f"exact-tables-{prob.name}-{args.precision}-{args.dtype}-{mode}"
        for batch in args.batches:
            shape = shape_at(prob, batch, args.shape)
            exact = tables / f"b{batch}.json"  # kept under --out: its winner's configuration and candidates
            exact.parent.mkdir(parents=True, exist_ok=True)
            rc = tune_exact(prob, shape, args, exact, pathlib.Path(tmp) / "home")
            setup = make_setup(prob, shape, "cuda", args.dtype, args.precision, mode, FORWARD)
            medians, served = race_tables(setup, {"shipped": args.table, "exact": str(exact)})
            ratio = medians["shipped"] / medians["exact"]
            row = {"batch": batch, "tune_rc": rc, "ratio": ratio, **{f"{name}_ms": ms for name, ms in medians.items()},
                   **{f"{name}_variant": by for name, by in served.items()}}
            rows.append(row)
            print(f"batch {batch:6d}: shipped {row['shipped_ms']:.4f} ms [{row['shipped_variant']}]  exact "
                  f"{row['exact_ms']:.4f} ms [{row['exact_variant']}]  ratio {ratio:.3f}"
                  f"{'' if rc == 0 else f'  (tune rc {rc})'}", flush=True)
    write_rows(args.out, f"exact-batch-{prob.name}-{args.precision}-{args.dtype}-{mode}.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
