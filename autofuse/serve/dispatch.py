"""Which dispatch-table entries may serve a call, best first.

A call asks for a precision; an entry tuned at that precision serves it, else one tuned at a
stricter precision (``precision.serving_order``: fp32 serves tf32 and bf16, tf32 serves bf16,
never the reverse), always under the same dtype, mode and autograd flag. Such an entry runs at
the precision it was tuned at, under the math mode and the gate it passed there.

Precision before batch size: for each serving precision, the exact shape, then the nearest
tuned batch size. A configuration tuned at a nearby batch is the same kernel at the same
arithmetic; a stricter precision can cost several times more (H100, 1024×8192², 99: the bf16
entry ran 0.22 ms, the fp32 one 2.69 ms). Where the family holds entries a tune wrote with its
batch classes (``autofuse.tuning.batch_classes``: ``rung_of``, ``gated_batches``), the further
ones follow the nearest, in order of distance: the nearest may be restricted to the batches where
it was gated, and the next one (a rung below) serve. A table without those fields is served as
before: the exact shape, then the nearest batch.

An entry may run at a stricter precision than its key (``runs_at``: a batch class whose key's
operands failed the gate there, served by the same variant at fp32); it is timed against its
key's reference, so the guard below does not apply to it beyond what its key's precision says.

On CUDA a stricter entry serves only where it is expected to beat the reference at the
requested precision, which can be much faster than its own precision's reference: its speedup
over its own eager must exceed ``REFERENCE_GAIN``, what the looser reference gained on an H100.
Without that guard an fp32 gemm_bn entry (16384×4096², 11.30 ms, 1.02x its eager) would serve a
bf16 call whose reference runs about 2 ms (2.2-2.4x the bf16 GEMM floor, issue 12); the fp32
entry of 51 (0.051 ms, 110x its eager) and the tf32 entries of gemm_bn (1.13-1.22x their eager)
still serve bf16.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from autofuse.core import registry
from autofuse.core.precision import dtype_name, parse_dtype, serving_order
from autofuse.core.problem import Problem
from autofuse.core.variant import check_params
from autofuse.serve.table import DispatchKey, parse_shape_key, shape_key

# Below this batch the weight's read is a call's floor (H100, 8192² bf16: 134 MB of weight, 40 µs
# at 3.35 TB/s, while 128 rows of products take ~2 µs; under bf16 and tf32 to a few hundred rows:
# the tuner's ladders there have rungs at 128 and 256, ``batch_classes.MEMORY_BOUND_RUNGS``), and
# the dispatcher keeps a call off a nearest entry whose tile would split it, so read the weight
# once per row tile (``_by_batch_distance``).
ONE_TILE_BATCH = 256

# How much faster the reference (eager) ran at the looser precision than at the stricter one,
# H100, eager_ms in benchmarks/table.json: fp32 → tf32 5.70-6.96x (all five shapes and modes),
# fp32 → bf16 5.94-6.63x and tf32 → bf16 0.97-1.04x (22, 99; autocast casts W and x every call).
# Rounded up: the guard errs towards the reference. Without tensor cores (the CPU) nothing gains.
REFERENCE_GAIN = {("fp32", "tf32"): 7.5, ("fp32", "bf16"): 7.5, ("tf32", "bf16"): 1.05}
_INPUT_DTYPES = {"ieee": ("float32",), "fp32": ("float32",), "tf32": ("float32",), "bf16": ("float32", "bfloat16")}


class CallKey(NamedTuple):
    """What a module's dispatcher looks one call up by, in its dict of ready callables.

    Made per call from the input and the model only (``runtime.call_key_parts``, the one
    place), so it holds the tensor attributes as they are, not the table's strings. Each part
    maps onto the table's keys when the dispatcher resolves it, once:

    - ``shape`` (``x.shape``) → the table's shape string: ``shape_key(problem.shape_of(model, x))``,
      which adds the sizes the model holds (out_features) and names each dimension;
    - ``dtype``, ``autograd``, ``training`` → the ``DispatchKey`` (``dispatch_key``): dtype by
      name, the same autograd flag, and ``problem.mode_of(model)`` for the mode ("any" where the
      problem computes the same in train and eval); the DispatchKey's precision is the module's
      own, so it is not part of a call's key;
    - ``device`` → the device's entry: ``fingerprint_key(current_fingerprint(device))``.

    A NamedTuple, not a dataclass: it hashes and compares as the tuple of its parts, so the
    hot path looks a call up with that plain tuple and builds no CallKey per call
    (``runtime.call_key_parts``); every key that is kept or passed on is a CallKey.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    autograd: bool  # grad mode on and x or a parameter requires grad
    training: bool  # the model's train/eval flag

    def dispatch_key(self, precision: str, mode: str) -> DispatchKey:
        """The table's dispatch key of this call at ``precision``, ``mode`` being the problem's
        ``mode_of(model)`` (the problem decides whether ``training`` matters)."""
        return DispatchKey(dtype_name(self.dtype), precision, mode, autograd=self.autograd)


@dataclasses.dataclass(frozen=True)
class Found:
    """A table entry that may serve a call: tuned at ``precision`` (which it runs at) and ``shape``."""

    entry: dict
    precision: str  # the key's precision it was found under
    shape: str
    exact_shape: bool
    requested: str

    @property
    def runs_at(self) -> str:
        """The precision it runs at: its key's, or the stricter one its entry names (``runs_at``)."""
        return self.entry.get("runs_at") or self.precision

    @property
    def source(self) -> str:
        """What ``dispatch_info`` says: "tuned", "tuned at fp32", "nearest batch (...)", ..."""
        rung = self.entry.get("rung_of")
        how = "tuned" if self.exact_shape else (
            f"nearest batch ({self.shape}, batch class of {rung})" if rung else f"nearest batch ({self.shape})")
        if self.precision == self.requested:
            return how
        return f"{how} at {self.precision}" if self.exact_shape else f"{how}, tuned at {self.precision}"


def candidates(shapes: dict, shape: dict, dkey: DispatchKey, batch_dim: str | None, device_type: str,
               tile_rows: Callable[[dict], int | None] | None = None) -> tuple[list[Found], list[tuple[int, str]]]:
    """(entries that may serve, best first; why stricter entries that exist were passed over).

    ``shapes`` is the table's shape key → dispatch key → entry mapping of one problem and device;
    ``tile_rows``: the rows per tile of an entry's configuration (``rows_per_tile``), for the order
    of a family's other batches (``_by_batch_distance``).
    Each passed-over entry comes with its rank: how many of the found ones rank before it
    (``passed_over_before`` keeps those that would have ranked before the one that serves).
    """
    found, passed_over = [], []
    for precision in serving_order(dkey.precision):
        if dkey.dtype not in _INPUT_DTYPES[precision]:
            continue  # a bfloat16-input key exists only under bf16
        key = dataclasses.replace(dkey, precision=precision).to_str()
        exact = shapes.get(shape_key(shape), {}).get(key)
        family = _by_batch_distance(shapes, shape, key, batch_dim, tile_rows)
        # Old tables: the nearest alone; entries of a tune with batch classes: each in turn (module docstring).
        nearby = family[:1] + [(skey, entry) for skey, entry in family[1:] if _of_batch_classes(entry)]
        for skey, entry in ([(shape_key(shape), exact)] if exact is not None else []) + nearby:
            candidate = Found(entry, precision, skey, exact_shape=skey == shape_key(shape), requested=dkey.precision)
            reason = (bad_entry(entry) or _runs_looser(entry, precision)
                      or slower_than_reference(entry, precision, dkey.precision, device_type))
            if reason is None:
                found.append(candidate)
            else:
                passed_over.append((len(found), f"the entry {candidate.source} ({entry.get('variant')}): {reason}"))
    return found, passed_over


def passed_over_before(passed_over: list[tuple[int, str]], served: int | None) -> list[str]:
    """The reasons of the entries passed over that rank before ``found[served]`` (all of them
    when nothing found serves, ``served`` None): a tf32 call served by its own tf32 entry need
    not hear why a stricter fp32 entry, which ranks after it, would not have served."""
    return [reason for rank, reason in passed_over if served is None or rank <= served]


def bad_entry(entry: dict) -> str | None:
    """What makes ``entry`` one the tuner cannot have written (a hand edit, a foreign tool), or None:
    no variant name, a time that is not a finite number >= 0 (``None``: not measured), params that
    are not an object."""
    if not isinstance(entry.get("variant"), str) or not entry["variant"]:
        return f"its variant must be a variant's name, got {entry.get('variant')!r}"
    for field, value in entry.items():
        if not field.endswith(("_ms", "_s")) or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return f"its {field} must be a finite number >= 0, got {value!r}"
    params = entry.get("params", {})
    if not isinstance(params, dict):
        return f"its params must be an object, got {params!r}"
    gated = entry.get("gated_batches")
    if gated is not None and not (isinstance(gated, list) and all(_batch_size(b) for b in gated)):
        return f"its gated_batches must be a list of batch sizes >= 1, got {gated!r}"
    if entry.get("runs_at") is not None and entry["runs_at"] not in _INPUT_DTYPES:
        return f"its runs_at must be one of {sorted(_INPUT_DTYPES)}, got {entry['runs_at']!r}"
    return None


def _batch_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def configuration(problem: Problem, candidate: Found, shape: dict, dkey: DispatchKey, device_type: str,
                  lacking_ok: bool = False) -> tuple:
    """(variant class, params) that ``candidate`` serves a call at ``shape`` with, or an exception
    saying why it may not serve there: its variant is unknown or does not admit the call, or its
    configuration passed the gate only where tuned and this batch is elsewhere. Builds nothing, so
    a table's coverage can be checked without a GPU (``serving``); ``lacking_ok``: as on a machine
    that has what the variant needs (nvcc, Triton), whatever this one lacks."""
    entry = candidate.entry
    variant_cls = registry.get_variant(problem.name, entry["variant"])
    reason = variant_cls.admits(device_type, parse_dtype(dkey.dtype), candidate.runs_at, dkey.autograd)
    if reason is not None and not (lacking_ok and reason == variant_cls.unavailable_reason(device_type)):
        raise ValueError(reason)
    params = entry.get("params", {})
    # Elsewhere than where it was gated: a neighbour of its configuration that passes everywhere.
    bracketed = candidate.exact_shape or gated_around(entry, shape[problem.batch_dim])
    if not bracketed:
        params = variant_cls.params_elsewhere(params)
    check_params(variant_cls, params, shape, device_type)  # at the exact shape too: test_runtime
    reason = None if bracketed else variant_cls.only_where_gated(params)
    if reason is not None:
        gated = entry.get("gated_batches")
        raise ValueError(f"{reason}; it was gated at {candidate.shape}"
                         + (f" and batches {gated}" if gated else "") + ", not around this batch")
    return variant_cls, params


def serving(shapes: dict, problem: Problem, shape: dict, dkey: DispatchKey, device_type: str,
            lacking_ok: bool = False) -> tuple[Found | None, list[str]]:
    """(the entry the runtime would serve a call at ``shape`` with, None for the reference; why each
    entry that ranks before it, or any, may not), as ``Dispatcher.choose`` decides it, without
    building anything: for checking a table's coverage (benchmarks/gpu/batch_class_gaps.py)."""
    found, passed_over = candidates(shapes, shape, dkey, problem.batch_dim, device_type,
                                    lambda entry: rows_per_tile(problem, entry))
    why = [reason for _, reason in passed_over]
    for candidate in found:
        try:
            configuration(problem, candidate, shape, dkey, device_type, lacking_ok)
        except Exception as exc:  # noqa: BLE001 - the runtime tries the next entry, and so does this
            why.append(f"the entry {candidate.source} ({candidate.entry.get('variant')}): {exc}")
            continue
        return candidate, why
    return None, why


def _runs_looser(entry: dict, precision: str) -> str | None:
    """Why an entry under a ``precision`` key may not run at its ``runs_at`` (a looser precision), or None."""
    runs_at = entry.get("runs_at")
    if runs_at is None or runs_at in serving_order(precision):
        return None
    return f"it runs at {runs_at}, looser than its key's {precision}"


def _of_batch_classes(entry: dict) -> bool:
    """Whether a tune with batch classes wrote ``entry`` (a rung's, or one whose gated batches it recorded)."""
    return "rung_of" in entry or "gated_batches" in entry


def gated_around(entry: dict, batch: int) -> bool:
    """Whether the entry's configuration passed the gate at ``batch``, or at batches on either side
    of it (``gated_batches``; a table without them: False). For entries ``candidates`` found, which
    ``bad_entry`` has checked: their ``gated_batches`` are None or a list of batch sizes."""
    gated = entry.get("gated_batches")
    return bool(gated) and min(gated) <= batch <= max(gated)


def slower_than_reference(entry: dict, tuned: str, requested: str, device_type: str) -> str | None:
    """Why an entry tuned at ``tuned`` is expected to lose to the reference at ``requested``, or None."""
    gain = REFERENCE_GAIN.get(("fp32" if tuned == "ieee" else tuned, requested))
    if gain is None or device_type != "cuda":
        return None
    median, eager = entry.get("median_ms"), entry.get("eager_ms")
    if not (isinstance(median, (int, float)) and isinstance(eager, (int, float)) and median > 0):
        return None  # nothing measured to judge by: the stricter entry serves
    if eager / median > gain:
        return None
    return (f"{eager / median:.2f}x its eager at {tuned} is not above the {gain:g}x by which "
            f"the reference gains at {requested}, so the reference at {requested} is expected to be faster")


def _by_batch_distance(shapes: dict, shape: dict, dkey: str, batch_dim: str | None,
                       tile_rows: Callable[[dict], int | None] | None = None) -> list[tuple[str, dict]]:
    """(shape key, entry) of every other batch size of ``shape``'s family (other dims equal) holding
    ``dkey``, nearest (in ratio) first; at equal distance the smaller batch: at 16, between the
    rungs at 8 and 32, a 16-row tile (rung 8's triton choice) was 2% faster than a 32-row one
    (rung 32's) (H100, 8192² bf16: 22, 99, gemm_bn eval), and the table's order, which decided
    before, put 32 first.

    Below ``ONE_TILE_BATCH`` rows, where the nearest entry's configuration takes fewer rows per tile
    than the call has (``tile_rows``), so it would read the weight once per row tile, the entries of
    memory-bound batches (up to ``ONE_TILE_BATCH``) known to take the call in one go first, the rest
    after in order: those whose tile holds the call's rows, and cuBLAS-based ones (no tile: cuBLAS
    picks its kernel per call) made at a batch at least the call's. At 37 rows, nearer rung 32 than
    64, rung 32's 32-row tile took 1.25-1.36x rung 64's 64-row one (22 under bf16: 0.0690 against
    0.0553 ms; 99 under fp32: 0.150 against 0.111; H200, benchmarks/gpu/between_rungs.py). Only
    then, and only from rungs up to ``ONE_TILE_BATCH``: at 100 rows, two tiles of rung 64's
    configuration still beat one of rung 512's 128-row configuration, made for a compute-bound
    batch (22: 0.0785 against 0.0922 ms; 99 under fp32: 0.159 against 0.186). Under bf16 and tf32
    the ladder's rungs at 128 and 256 take such calls (``batch_classes.MEMORY_BOUND_RUNGS``)."""
    if batch_dim is None or not shape.get(batch_dim):
        return []
    others = {k: v for k, v in shape.items() if k != batch_dim}
    found = []
    for skey, by_key in shapes.items():
        try:
            tuned = parse_shape_key(skey)
        except ValueError:
            continue
        if dkey not in by_key or not tuned.get(batch_dim) or tuned == shape:
            continue
        if {k: v for k, v in tuned.items() if k != batch_dim} != others:
            continue
        at, wanted = tuned[batch_dim], shape[batch_dim]
        found.append((fractions.Fraction(max(at, wanted), min(at, wanted)), at, skey, by_key[dkey]))  # exact: ties are ties
    wanted = shape[batch_dim]
    ranked = [(skey, entry, at) for _, at, skey, entry in sorted(found, key=lambda item: item[:2])]
    rows = [tile_rows(entry) if tile_rows is not None and wanted < ONE_TILE_BATCH else None for _, entry, _ in ranked]
    if ranked and rows[0] is not None and rows[0] < wanted:  # the nearest would split the call
        in_one = [i for i, (_, _, at) in enumerate(ranked)
                  if at <= ONE_TILE_BATCH and (at >= wanted if rows[i] is None else rows[i] >= wanted)]
        ranked = [ranked[i] for i in in_one] + [item for i, item in enumerate(ranked) if i not in in_one]
    return [(skey, entry) for skey, entry, _ in ranked]


def rows_per_tile(problem: Problem, entry: dict) -> int | None:
    """The rows per tile of ``entry``'s configuration (``Variant.rows_per_tile``), None where its
    variant is unknown here or its params are not a mapping (``candidates`` passes such entries
    over, saying why)."""
    params = entry.get("params", {})
    try:
        variant_cls = registry.get_variant(problem.name, entry.get("variant"))
    except Exception:  # noqa: BLE001 - an unknown variant: configuration() reports it
        return None
    rows = variant_cls.rows_per_tile(params) if isinstance(params, dict) else None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None
