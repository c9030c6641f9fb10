"""The ``autofuse`` command: list, tune, bench, show, export, report."""

from __future__ import annotations

import argparse
import signal
import sys

from tabulate import tabulate

from autofuse.errors import AutofuseError
from autofuse.serve.table import PRECISIONS  # torch-free: `autofuse --help` stays fast


def main(argv: list[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `autofuse list | head` should end quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except AutofuseError as exc:
        print(f"autofuse: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autofuse: interrupted; finished trials are kept in the study and a rerun resumes", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autofuse", description="Autotune fused GPU kernels and dispatch to the winners.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    listing = commands.add_parser("list", help="list problems and their variants")
    listing.add_argument("problem", nargs="?", help="only this problem")
    listing.set_defaults(run=_list)

    tune = commands.add_parser("tune", help="tune a problem and record the winner in the dispatch table")
    tune.add_argument("problem", help="problem name or alias (autofuse list shows them), or a KernelBench file's path")
    tune.add_argument("--shape", type=_shape_arg, help="e.g. batch_size=1024,in_features=8192,out_features=8192 (default: every default shape)")
    tune.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda if available)")
    tune.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    tune.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    tune.add_argument("--mode", choices=["train", "eval"], help="for problems whose train/eval differ (gemm_bn); default train")
    tune.add_argument("--trials", type=int, help="trials per shape (default: the budget's, 24 quick or 40 full, "
                      "at most every configuration)")
    tune.add_argument("--budget", choices=["quick", "full"], default="quick",
                      help="quick (default): gate only candidates within reach of the best, stop a stalled search; "
                      "full: gate every candidate, search every trial")
    tune.add_argument("--timeout", type=float, help="seconds of search per shape")
    tune.add_argument("--trial-timeout", type=float, default=600.0, help="seconds one candidate may take (default 600)")
    tune.add_argument("--variants", type=lambda s: s.split(","), help="only these variants, comma-separated")
    tune.add_argument("--seed", type=int, help="seed of the sampler and the check inputs (default: random, recorded)")
    tune.add_argument("--table", help="dispatch table path (default: $AUTOFUSE_HOME/table.json)")
    tune.add_argument("--workers", type=int, default=1, help="processes searching at once: one per GPU, or N on the CPU (default 1)")
    tune.add_argument("--storage", help="study storage shared with other processes or machines: sqlite:///f.db, "
                      "postgresql://user:pw@host/db or journal:///path/f.journal (default: $AUTOFUSE_HOME/studies.journal)")
    tune.add_argument("--no-autograd-entry", action="store_true", help="skip the entry for calls that need gradients")
    tune.add_argument("--batch-classes", action=argparse.BooleanOptionalAction, default=True,
                      help="also gate and time entries for the shape's other batch classes: the smallest batch, "
                           "8, 32, 64, 512 ... below it and twice it (default on)")
    tune.add_argument("--batch-classes-only", action="store_true",
                      help="search nothing: add the batch classes of the entries the table holds for the key "
                           "(one tuned before batch classes, or with --no-batch-classes)")
    tune.add_argument("--rungs", type=_batches_arg, metavar="B1,B2,...",
                      help="race only the batch classes at these batches, leaving the others as the table holds them "
                           "(e.g. 1,8,32,64: the ones the runtime replays as CUDA graphs)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    tune.set_defaults(run=_tune)

    bench = commands.add_parser("bench", help="measure eager, torch.compile, every variant, the dispatch and the floor side by side "
                                   "(forward, or forward+backward)")
    bench.add_argument("problem", nargs="?", help="problem name or alias (or --all)")
    bench.add_argument("--all", action="store_true", help="every problem at its default shapes (both modes where they differ)")
    bench.add_argument("--shape", type=_shape_arg, help="default: every default shape")
    bench.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda if available)")
    bench.add_argument("--precision", choices=list(PRECISIONS), help="default fp32; bf16 for a bfloat16 model")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="the model's dtype: bfloat16 benches model.bfloat16() on bfloat16 inputs, under bf16 only")
    bench.add_argument("--mode", choices=["train", "eval"], help="for gemm_bn (default: train; --all does both)")
    bench.add_argument("--table", help="dispatch table to read tuned configurations from")
    bench.add_argument("--rounds", type=int, default=20, help="interleaved rounds (3 timed calls each)")
    bench.add_argument("--no-compile", action="store_true", help="leave every torch.compile row out (they compile for minutes)")
    bench.add_argument("--compile-modes", type=lambda s: s.split(","), default=["default", "max-autotune-no-cudagraphs"],
                       help="torch.compile modes to time, comma-separated (default: default,max-autotune-no-cudagraphs)")
    bench.add_argument("--step", choices=["forward", "backward", "both"], default="forward",
                       help="forward: inference; backward: forward+backward, a training step (autograd-capable "
                       "variants, the autograd entry); both: the two tables (default forward)")
    bench.add_argument("--skip-variants", type=lambda s: s.split(","), default=[],
                       help="leave these variants' rows out, comma-separated (names a problem lacks are ignored)")
    bench.add_argument("--batches", type=_batches_arg, metavar="B1,B2,...",
                       help="a batch sweep instead: per batch the dispatch (and which entry served it), eager, "
                       "torch.compile default and the floor, e.g. 1,8,37,100,512,1023,1025,2048")
    bench.add_argument("--wall", action="store_true", help="with --batches: also the wall time per call with a "
                       "synchronize after each, and the GPU time over reading W once")
    bench.add_argument("--out", default="bench-out", help="folder for the JSON and PNG results (default bench-out)")
    bench.add_argument("--markdown", help="also write this Markdown report (e.g. BENCHMARKS.md)")
    bench.add_argument("--from-out", action="store_true",
                       help="measure nothing: write --markdown from every report already in --out (several runs, e.g. one per precision), with the hand-written analysis.md and KernelBench harness/*.md there, if any")
    bench.set_defaults(run=_bench)

    report = commands.add_parser("report", help="write an HTML report of the dispatch table: times, charts, tuning histories, stale entries")
    report.add_argument("--table", help="dispatch table path (default: $AUTOFUSE_HOME/table.json)")
    report.add_argument("--out", default="autofuse-report", help="folder for index.html and its PNGs (default autofuse-report)")
    report.add_argument("--studies", help="Optuna journal with the tuning histories (default: $AUTOFUSE_HOME/studies.journal)")
    report.set_defaults(run=_report)

    show = commands.add_parser("show", help="print the dispatch table")
    show.add_argument("--table", help="dispatch table path (default: $AUTOFUSE_HOME/table.json)")
    show.set_defaults(run=_show)

    export = commands.add_parser("export", help="write a KernelBench ModelNew file that dispatches through the tuned table")
    export.add_argument("problem", help="problem name or alias, or a KernelBench file's path")
    export.add_argument("--kernelbench", required=True, metavar="OUT.py", help="the file to write")
    export.add_argument("--table", help="dispatch table ModelNew reads (default: $AUTOFUSE_HOME/table.json where it runs)")
    export.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                        help="precision of every dispatch (bf16 for a harness that runs in bfloat16)")
    export.set_defaults(run=_export)
    return parser


def _shape_arg(text: str) -> dict:
    from autofuse.serve.table import parse_shape_key

    try:
        return parse_shape_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _list(args) -> None:
    from autofuse.core.listing import list_problems, list_variants
    from autofuse.core.registry import get_problem

    names = [get_problem(args.problem).name] if args.problem else [p["name"] for p in list_problems()]
    for problem in list_problems():
        if problem["name"] not in names:
            continue
        aliases = f" ({', '.join(problem['aliases'])})" if problem["aliases"] else ""
        print(f"{problem['name']}{aliases}: {problem['description']}")
        print(f"  default shapes: {'; '.join(problem['default_shapes'])}   [plugin {problem['plugin']}]")
        rows = [[v["name"], v["kind"], ",".join(v["devices"]), ",".join(v["precisions"]), "yes" if v["autograd"] else "no",
                 v["bfloat16_model"], "yes" if v["unavailable"] is None else f"no: {v['unavailable']}", v["plugin"],
                 v["description"]]
                for v in list_variants(problem["name"])]  # fmt: skip
        print(tabulate(rows, headers=["variant", "kind", "devices", "precisions", "autograd", "bfloat16 model",
                                      "runs here", "plugin", "description"]))
        print()


def _tune(args) -> None:
    from autofuse.tuning.tuner import tune

    results = tune(args.problem, args.shape, device=args.device, dtype=args.dtype, precision=args.precision,
                   mode=args.mode, n_trials=args.trials, timeout=args.timeout, table=args.table, seed=args.seed,
                   trial_timeout=args.trial_timeout, variants=args.variants,
                   autograd_entry=not args.no_autograd_entry, storage=args.storage, workers=args.workers,
                   progress=not args.no_progress, budget=args.budget, batch_classes=args.batch_classes,
                   classes_only=args.batch_classes_only, rungs=args.rungs)
    for result in results:
        _print_result(result)


def _print_result(result) -> None:
    from autofuse.serve.table import fingerprint_key, shape_key

    print(f"\n{result.problem} {shape_key(result.shape)} on {fingerprint_key(result.fingerprint)} ({result.key.to_str()})")
    eager = next((r.timing.median_ms for r in result.rows if r.variant == "eager" and r.ok), None)
    # A column for variants that compile at their first call (torch.compile), where any did.
    compiles = any(r.result is not None and r.result.compile_s is not None for r in result.rows)
    rows = []
    for row in sorted(result.rows, key=lambda r: (_timed(r).median_ms if _timed(r) else float("inf"))):
        timing, compile_s = _timed(row), row.result.compile_s if row.result else None
        rows.append([
            row.variant, _params(row.params) if timing else "",
            f"{timing.median_ms:.4g}" if timing else "", f"{timing.p20_ms:.4g}-{timing.p80_ms:.4g}" if timing else "",
            f"{eager / timing.median_ms:.2f}x" if timing and eager else "",
            f"{row.result.error:.2e}" if row.result and row.result.error is not None else "",
            *([f"{compile_s:.1f}" if compile_s is not None else ""] if compiles else []),
            row.result.outcome.value if row.result else "not run", row.trials,
            (row.result.reason or "")[:90] if row.result else "",
        ])
    headers = ["variant", "params", "median ms", "p20-p80", "vs eager", "error", *(["compile s"] if compiles else []),
               "outcome", "trials", "reason"]
    if not result.classes_only:  # otherwise nothing was searched: the entries below are the table's
        print(tabulate(rows, headers=headers))
    for label, entry in (("winner", result.winner), ("autograd winner", result.grad_winner)):
        if entry is not None:
            speedup = f", {entry['speedup']:.2f}x eager" if entry.get("speedup") else ""
            print(f"{label}: {entry['variant']} {_params(entry['params'])} {entry['median_ms']:.4g} ms{speedup}")
    if result.winner is None:  # the table was not written: naming it as "table:" said it was
        print(f"no variant passed the correctness gate: nothing was recorded in {result.table_path}")
    else:
        print(f"table: {result.table_path}")
    first = f"; first entry after {result.first_entry_s:.0f} s" if result.first_entry_s is not None else ""
    entries = ("" if result.entries_s is None else f" (its entries after {result.entries_s:.0f} s, its batch "
               f"classes {result.seconds - result.entries_s:.0f} s more)")
    done = f"batch classes added in {result.seconds:.0f} s" if result.classes_only else f"tuned in {result.seconds:.0f} s{entries}"
    print(f"{done}{first}; what the candidates printed: {result.log_path}")


def _timed(row):
    """A row's timing: the final or gated one, or the time of one that was out of reach."""
    if row.timing is not None:
        return row.timing
    return row.result.timing if row.result is not None and row.result.outcome.value == "out_of_reach" else None


def _params(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items()) or "-"


def _batches_arg(text: str) -> list[int]:
    try:
        return [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batches are comma-separated ints, e.g. 1,8,37; got {text!r}") from None


def _bench(args) -> None:
    import pathlib

    from autofuse.bench.run import bench, markdown, save
    from autofuse.bench.sweep import bench_sweep
    from autofuse.bench.sweep_report import save_sweeps

    if args.markdown:  # before the bench, which can take minutes, not after it
        _make_parent(args.markdown)
    if args.from_out:
        return _bench_markdown_from_out(args)
    if args.all == bool(args.problem):
        raise AutofuseError("name one problem, or pass --all")
    if args.wall and not args.batches:
        raise AutofuseError("--wall measures per batch: name the batches, e.g. --batches 1,32")
    common = {"device": args.device, "dtype": args.dtype, "precision": args.precision, "table": args.table,
              "rounds": args.rounds, "use_compile": not args.no_compile}
    reports, sweeps = [], []
    for name, mode, step in _bench_jobs(args):
        if args.batches:
            sweeps += bench_sweep(name, args.shape, args.batches, mode=mode, step=step, wall=args.wall, **common)
            _print_sweep(sweeps[-1])
            continue
        for report in bench(name, args.shape, mode=mode, compile_modes=args.compile_modes, step=step,
                            skip_variants=args.skip_variants, **common):
            _print_bench(report)
            reports.append(report)
    save(reports, args.out)
    save_sweeps(sweeps, args.out)
    if args.markdown:
        target = pathlib.Path(args.markdown)
        command = "autofuse " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("autofuse") else "autofuse bench ..."
        target.write_text(markdown(reports, command, pathlib.Path(args.out), target.parent, sweeps=sweeps))
        print(f"wrote {target}")


def _bench_jobs(args) -> list[tuple[str, str | None, str]]:
    """(problem, mode, step) of each bench: --all's problems in both BatchNorm modes, each step asked for."""
    from autofuse.core.listing import list_problems
    from autofuse.core.registry import get_problem

    jobs = []
    for name in [p["name"] for p in list_problems()] if args.all else [args.problem]:
        modes = [args.mode] if args.mode or not get_problem(name).mode_sensitive else (["train", "eval"] if args.all else ["train"])
        jobs += [(name, mode) for mode in modes]
    steps = {"forward": ["forward"], "backward": ["forward+backward"], "both": ["forward", "forward+backward"]}[args.step]
    return [(name, mode, step) for name, mode in jobs for step in steps]


def _make_parent(path: str) -> None:
    """Create ``path``'s folder, as ``autofuse tune`` does its table's, or say why it cannot be."""
    import pathlib

    folder = pathlib.Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AutofuseError(f"cannot create the folder {folder} for {path}: {exc.strerror or exc}") from None


def _bench_markdown_from_out(args) -> None:
    import pathlib

    from autofuse.bench.report import MEASURE_ON_GPU
    from autofuse.bench.run import ANALYSIS_FILE, load, markdown
    from autofuse.bench.sweep_report import load_sweeps

    if not args.markdown:
        raise AutofuseError("--from-out writes a Markdown report: name it with --markdown FILE")
    reports, sweeps = load(args.out), load_sweeps(args.out)
    if not reports and not sweeps:
        raise AutofuseError(f"--from-out: no bench reports (*.json) in {args.out}")
    target, out = pathlib.Path(args.markdown), pathlib.Path(args.out)
    # Spelled from the arguments, not sys.argv: the page names the command that rewrites it.
    command = f"autofuse bench --from-out --out {args.out} --markdown {args.markdown}"
    # The hand-written analysis (optional), then what benchmarks/gpu/kernelbench_harness.py wrote into harness/.
    written = [out / ANALYSIS_FILE] + sorted((out / "harness").glob("*.md"))
    analysis = "\n\n".join(path.read_text().strip() for path in written if path.exists()) or None
    target.write_text(markdown(reports, command, out, target.parent, analysis, MEASURE_ON_GPU.format(out=args.out), sweeps))
    print(f"wrote {target} from {len(reports) + len(sweeps)} reports in {args.out}")


def _print_bench(report) -> None:
    print(f"\n{report.title} on {report.device.get('name')}")
    rows = []
    for row in report.rows:
        t, speed, floor = row.timing, report.ratio(row, "eager"), report.ratio(row, "floor")
        rows.append([row.candidate, _params(row.params), f"{t.median_ms:.4f}" if t else "", f"{t.p20_ms:.4f}-{t.p80_ms:.4f}" if t else "",
                     f"{speed:.2f}x" if speed else "", f"{floor:.2f}" if floor else "", row.note[:70]])
    print(tabulate(rows, headers=["candidate", "params", "median ms", "p20-p80", "vs eager", "x floor", "note"]))


def _print_sweep(sweep) -> None:
    print(f"\non {sweep.device.get('name')}:")
    print("\n".join(sweep.markdown()))


def _report(args) -> None:
    from autofuse.report.page import write_report

    print(f"wrote {write_report(args.table, args.out, args.studies)}")


def _show(args) -> None:
    from autofuse.errors import TableError
    from autofuse.serve.dispatch import bad_entry
    from autofuse.serve.table import DispatchKey, DispatchTable

    table = DispatchTable(args.table)
    if not table.path.exists():  # load() reads a missing file as an empty table, which a typo is not
        raise TableError(f"dispatch table {table.path}: no such file; `autofuse tune` writes one there, "
                         f"or name another with --table")
    rows, unusable = [], []
    for device, problem, shape, key, entry in table.entries():
        try:
            dkey = DispatchKey.from_str(key)
            key = f"{dkey.dtype}/{dkey.precision}/{dkey.mode}" + ("/grad" if dkey.autograd else "")
        except ValueError as exc:  # shown as written, and said why (test_bad_input)
            unusable.append(f"{device} {problem} {shape} {key}: {exc}")
        if bad_entry(entry):
            unusable.append(f"{device} {problem} {shape} {key}: {bad_entry(entry)}")
        params = entry.get("params", {})
        rows.append([device, problem, shape, key, entry.get("variant"), _params(params) if isinstance(params, dict) else repr(params),
                     _number(entry.get("median_ms"), ".4g"), _number(entry.get("speedup") or None, ".2f", "x"),
                     _number(entry.get("error"), ".1e"), _batch_class(entry), entry.get("date", "")])
    if not rows:
        print(f"{table.path}: no entries")
        return
    print(f"{table.path}:")
    print(tabulate(rows, headers=["device", "problem", "shape", "key", "variant", "params", "ms", "vs eager", "error",
                                  "batch class", "date"]))
    for line in unusable:
        print(f"unusable entry (get_module passes it over): {line}")


def _batch_class(entry: dict) -> str:
    """Where a tune's batch classes put the entry: "rung of 1024" for a rung's choice (", at fp32"
    where it runs at a stricter precision than its key), and the batches its configuration passed
    the gate at ("gated 8-2048"), which bound where it may serve if its operands are restricted."""
    parts = []
    rung = entry.get("rung_of")
    if isinstance(rung, str):
        parts.append(f"rung of {rung.split(',')[0].partition('=')[2] or rung}")
    if entry.get("runs_at"):
        parts.append(f"at {entry['runs_at']}")
    gated = entry.get("gated_batches")
    if isinstance(gated, list) and gated:
        parts.append(f"gated {','.join(str(b) for b in gated)}")
    return ", ".join(parts)


def _number(value, spec: str, suffix: str = "") -> str:
    """``value`` formatted as a number, or as written where it is not one (a hand-edited table)."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    return format(value, spec) + suffix


def _export(args) -> None:
    from autofuse.kernelbench.export import export_kernelbench

    command = "autofuse " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("autofuse") else None
    lines = export_kernelbench(args.problem, args.kernelbench, table=args.table, precision=args.precision, command=command)
    print(f"wrote {args.kernelbench}; ModelNew dispatches through:")
    for line in lines:
        print(f"  {line}")


if __name__ == "__main__":
    sys.exit(main())
