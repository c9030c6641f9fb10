"""The dispatch table: which variant won, per device, problem, shape and dispatch key.

One JSON document, human-readable and versioned::

    {"schema": "autofuse-dispatch-table", "version": 1,
     "devices": {"<fingerprint_key>": {"fingerprint": {...},
                 "problems": {"<problem>": {"<shape_key>": {"<dispatch_key>": {entry}}}}}}}

An entry is whatever the tuner measured (variant, params, timings, error, date, source
hash); this module stores it and never interprets it. Writers take an inter-process lock,
re-read the file, merge and replace it atomically, so two tuners never lose each other's
entries and a reader never sees half a file. A corrupt, foreign or newer file is reported
with a TableError and left intact: it may be someone's only record of hours of tuning.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import platform
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import filelock

from autofuse.errors import TableError

SCHEMA = "autofuse-dispatch-table"
VERSION = 1

DTYPES = ("float32", "bfloat16")
PRECISIONS = ("ieee", "fp32", "tf32", "bf16")  # autofuse.core.precision.PRECISIONS, without importing torch
MODES = ("train", "eval", "any")

# Levels of nesting a table may have: a written one has about a dozen (devices, problems, shapes,
# keys, entry, candidates, params). A document nested deeper is not one autofuse wrote, and
# json.dumps of it from a deep stack (a rewrite under the lock, a module's first call) would
# raise RecursionError (issue 32); json.loads raises it already past about 990 levels.
MAX_DEPTH = 64

# Seconds a writer waits for another writer; a tuner records in bursts of milliseconds,
# so a minute of waiting means a stuck process, not contention.
LOCK_TIMEOUT_S = 60.0


def default_table_path() -> pathlib.Path:
    home = os.environ.get("AUTOFUSE_HOME") or "~/.cache/autofuse"
    return pathlib.Path(home).expanduser() / "table.json"


def _parse_pairs(text: str, what: str) -> list[tuple[str, str]]:
    """Split "a=1,b=2" into pairs; raise ValueError naming the part that does not parse."""
    pairs = []
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip() or "=" in value:
            raise ValueError(f"{what} {text!r}: part {part!r} is not of the form name=value")
        pairs.append((name.strip(), value.strip()))
    names = [name for name, _ in pairs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{what} {text!r}: name(s) {duplicates} appear more than once")
    return pairs


def shape_key(shape: Mapping[str, int]) -> str:
    """Render a shape as "batch_size=1024,in_features=8192", keeping the caller's order."""
    for name, size in shape.items():
        if not isinstance(name, str) or not name or any(c in name for c in ",= "):
            raise ValueError(f"shape dimension names must be non-empty without ',', '=' or ' ', got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"shape dimension {name!r} must be an int >= 0, got {size!r}")
    return ",".join(f"{name}={size}" for name, size in shape.items())


def parse_shape_key(key: str) -> dict[str, int]:
    if key == "":  # the empty shape, so that shape_key({}) round-trips
        return {}
    shape = {}
    for name, value in _parse_pairs(key, "shape key"):
        if not (value.isascii() and value.isdigit()):
            raise ValueError(f"shape key {key!r}: part {name}={value!r} is not a non-negative integer")
        shape[name] = int(value)
    return shape


@dataclass(frozen=True)
class DispatchKey:
    """What, besides the shape, decides which variant may run: the inputs' dtype, the
    admitted precision, train/eval mode and whether a backward pass is needed."""

    dtype: str
    precision: str
    mode: str
    autograd: bool

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("dtype", self.dtype, DTYPES),
            ("precision", self.precision, PRECISIONS),
            ("mode", self.mode, MODES),
        ):
            if value not in allowed:
                raise ValueError(f"DispatchKey.{field} must be one of {allowed}, got {value!r}")
        if not isinstance(self.autograd, bool):
            raise ValueError(f"DispatchKey.autograd must be a bool, got {self.autograd!r}")

    def to_str(self) -> str:
        autograd = "true" if self.autograd else "false"
        return f"dtype={self.dtype},precision={self.precision},mode={self.mode},autograd={autograd}"

    @classmethod
    def from_str(cls, s: str) -> DispatchKey:
        fields = dict(_parse_pairs(s, "dispatch key"))
        expected = {"dtype", "precision", "mode", "autograd"}
        if set(fields) != expected:
            raise ValueError(f"dispatch key {s!r} must name exactly {sorted(expected)}, got {sorted(fields)}")
        if fields["autograd"] not in ("true", "false"):
            raise ValueError(f"dispatch key {s!r}: autograd must be 'true' or 'false', got {fields['autograd']!r}")
        return cls(fields["dtype"], fields["precision"], fields["mode"], fields["autograd"] == "true")


def current_fingerprint(device) -> dict:
    """What makes timings on `device` comparable: the same chip, CUDA runtime and torch."""
    import torch  # lazily: reading a table must not pay for importing torch

    device = torch.device(device)
    if device.type == "cpu":
        return {
            "kind": "cpu",
            "name": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
        }
    if device.type != "cuda":
        raise ValueError(f"fingerprints exist for 'cpu' and 'cuda' devices, got {str(device)!r}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "kind": "cuda",
        "name": torch.cuda.get_device_name(index),
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
    }


def fingerprint_key(fp: dict) -> str:
    """One line a person can read in `autofuse show`; equal fingerprints give equal keys."""
    try:
        if fp["kind"] == "cuda":
            sm = "sm_" + str(fp["capability"]).replace(".", "")
            parts = ["cuda", fp["name"], sm, f"{fp['sm_count']} SMs", f"cuda {fp['cuda']}", f"torch {fp['torch']}"]
        elif fp["kind"] == "cpu":
            parts = ["cpu", fp["name"], f"{fp['cores']} cores", f"torch {fp['torch']}"]
        else:  # a kind from a plugin or a later version: still stable, just less pretty
            parts = [str(fp["kind"])] + [f"{k}={fp[k]}" for k in sorted(fp) if k != "kind"]
    except KeyError as e:
        raise ValueError(f"fingerprint of kind {fp.get('kind')!r} lacks the field {e.args[0]!r}: {fp!r}") from None
    return "|".join(str(part) for part in parts)


def serving_devices(devices: Mapping, fingerprint: dict) -> list[str]:
    """The keys of the table's device sections that may serve calls on a device of ``fingerprint``,
    in the order they are asked: its own section, where the table has one, then its siblings'.

    A sibling is a CUDA device of the same compute capability and SM count (an H100 SXM and an
    H200 are both sm_90 with 132 SMs): every kernel an entry names is compiled for the device it
    runs on and computes there what it computed where it was gated; only the timings that chose
    it are another chip's. Siblings of the same torch and CUDA come first, then in key order, so
    the choice is stable.
    """
    own = fingerprint_key(fingerprint)
    found = [own] if own in devices else []
    if fingerprint.get("kind") != "cuda":
        return found
    ranked = []
    for key, section in devices.items():
        theirs = section.get("fingerprint") if isinstance(section, Mapping) else None
        if (key != own and isinstance(theirs, Mapping) and theirs.get("kind") == "cuda"
                and str(theirs.get("capability")) == str(fingerprint.get("capability"))
                and theirs.get("sm_count") == fingerprint.get("sm_count")):
            versions = [theirs.get(part) != fingerprint.get(part) for part in ("torch", "cuda")]
            ranked.append((*versions, key))
    return found + [key for *_, key in sorted(ranked)]


def _empty_document() -> dict:
    return {"schema": SCHEMA, "version": VERSION, "devices": {}}


def _render(doc: dict) -> str:
    """Schema and version first, so a person opening the file sees what it is; every level
    below sorted, so rewrites give small diffs."""
    head = {"schema": SCHEMA, "version": VERSION}
    devices = json.loads(json.dumps(doc["devices"], sort_keys=True))
    return json.dumps({**head, "devices": devices}, indent=2) + "\n"


def _layout_problem(doc) -> str | None:
    """Say what makes `doc` not a dispatch table of this version, or None if it is one."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        return f"it is not an autofuse dispatch table (schema {found!r}, expected {SCHEMA!r})"
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return f"its version {version!r} is not a positive integer"
    if version > VERSION:
        return f"it has version {version}, newer than this autofuse reads ({VERSION}); upgrade autofuse"
    if _deeper_than(doc, MAX_DEPTH):
        return f"it is nested more than {MAX_DEPTH} levels deep, deeper than any table autofuse writes"
    devices = doc.get("devices")
    if not isinstance(devices, dict):
        return f"its 'devices' is {type(devices).__name__}, expected an object"
    for fkey, device in devices.items():
        if not isinstance(device, dict) or not isinstance(device.get("problems"), dict):
            return f"device {fkey!r} has no 'problems' object"
        for problem, shapes in device["problems"].items():
            entries = shapes.values() if isinstance(shapes, dict) else [None]
            if not all(isinstance(keys, dict) and all(isinstance(e, dict) for e in keys.values()) for keys in entries):
                return f"problem {problem!r} of device {fkey!r} is not shape -> dispatch key -> entry objects"
    return None


def _deeper_than(doc, limit: int) -> bool:
    """Whether ``doc`` nests objects and arrays more than ``limit`` levels (without recursion)."""
    stack = [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            if level > limit:
                return True
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


class DispatchTable:
    """A dispatch table file. Reads need no lock (writes replace the file atomically), so
    an application can ship a read-only table; writes lock, merge and replace."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = pathlib.Path(path) if path is not None else default_table_path()
        self.lock_path = pathlib.Path(str(self.path) + ".lock")

    def __repr__(self) -> str:
        return f"DispatchTable({str(self.path)!r})"

    def _fail(self, problem: str) -> TableError:
        return TableError(
            f"dispatch table {self.path}: {problem}; the file was left intact "
            f"(move it aside or delete it to start a new table)"
        )

    def load(self) -> dict:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _empty_document()
        except OSError as e:
            raise self._fail(f"cannot be read ({e.strerror or e})") from e
        try:
            doc = json.loads(raw)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for binary garbage
            raise self._fail(f"it is not valid JSON, corrupt or truncated ({e})") from None
        except RecursionError:
            raise self._fail(f"it is nested too deeply for JSON to read (a table is nested at most {MAX_DEPTH} levels)") from None
        problem = _layout_problem(doc)
        if problem is not None:
            raise self._fail(problem)
        return doc

    def lookup(self, fingerprint_key: str, problem: str, shape_key: str, dispatch_key) -> dict | None:
        if isinstance(dispatch_key, DispatchKey):
            dispatch_key = dispatch_key.to_str()
        device = self.load()["devices"].get(fingerprint_key)
        if device is None:
            return None
        return device["problems"].get(problem, {}).get(shape_key, {}).get(dispatch_key)

    def entries(self) -> Iterator[tuple[str, str, str, str, dict]]:
        for fkey, device in self.load()["devices"].items():
            for problem, shapes in device["problems"].items():
                for skey, keys in shapes.items():
                    for dkey, entry in keys.items():
                        yield fkey, problem, skey, dkey, entry

    def record(self, fingerprint: dict, problem: str, shape_key: str, dispatch_key, entry: dict) -> None:
        self.record_many([(fingerprint, problem, shape_key, dispatch_key, entry)])

    def record_many(self, items: list[tuple[dict, str, str, str, dict]]) -> None:
        """Merge `items` into the file; each replaces the entry under the same key, keeping the
        replaced entry's records of variants the new one's tune did not run (``_carry_candidates``)."""
        # Validate before locking, so a caller's mistake never reaches the file.
        checked = [_check_item(*item) for item in items]
        with self._locked() as doc:
            for fkey, fingerprint, problem, skey, dkey, entry in checked:
                entries = _entries_of(doc, fkey, fingerprint, problem, skey)
                entries[dkey] = _carry_candidates(entries.get(dkey), entry)
            self._write_atomic(_render(doc))

    def record_provisional(self, fingerprint: dict, problem: str, shape_key: str, dispatch_key, entry: dict) -> bool:
        """Record a tune's best so far (``entry`` marked ``provisional``) unless the key holds a
        finished entry that measured faster; return whether it was written. Compared and written
        under the lock, so a finished entry another tuner writes meanwhile is never overwritten by
        a slower provisional one."""
        fkey, fingerprint, problem, skey, dkey, entry = _check_item(fingerprint, problem, shape_key, dispatch_key, entry)
        with self._locked() as doc:
            entries = _entries_of(doc, fkey, fingerprint, problem, skey)
            if _finished_faster(entries.get(dkey), entry):
                return False
            # It carries every candidate record of the entry it replaces, for the final entry to carry on.
            entries[dkey] = _carry_candidates(entries.get(dkey), {**entry, "candidates": entry.get("candidates", {})})
            self._write_atomic(_render(doc))
            return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        """The document, re-read under the inter-process lock (another tuner may have written),
        for the caller to merge into and write before the lock is released."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock = filelock.FileLock(str(self.lock_path), timeout=LOCK_TIMEOUT_S)
            lock.acquire()
        except filelock.Timeout:
            raise TableError(
                f"dispatch table {self.path}: could not take the lock {self.lock_path} within "
                f"{LOCK_TIMEOUT_S:g} s; another process holds it (delete the lock file if none runs)"
            ) from None
        try:
            yield self.load()
        finally:
            lock.release()

    def _write_atomic(self, text: str) -> None:
        """Replace the file with `text` so that readers see the old or the new file, never half."""
        tmp = tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp", delete=False
        )
        try:
            with tmp:
                tmp.write(text)
                tmp.flush()
                os.fsync(tmp.fileno())
            # NamedTemporaryFile creates 0600; keep the mode of the table it replaces so a
            # table shared between users stays readable to them.
            mode = self.path.stat().st_mode & 0o777 if self.path.exists() else 0o644
            os.chmod(tmp.name, mode)
            os.replace(tmp.name, self.path)
        except BaseException:
            pathlib.Path(tmp.name).unlink(missing_ok=True)
            raise


def _entries_of(doc: dict, fkey: str, fingerprint: dict, problem: str, skey: str) -> dict:
    """The dispatch-key -> entry dict of ``problem`` at ``skey`` on the device, made where absent."""
    device = doc["devices"].setdefault(fkey, {"fingerprint": fingerprint, "problems": {}})
    device["fingerprint"] = fingerprint
    return device["problems"].setdefault(problem, {}).setdefault(skey, {})


def _finished_faster(previous, entry: dict) -> bool:
    """Whether ``previous`` is a finished (not provisional) entry that stands against the provisional
    ``entry``: it measured faster, or it is the final choice of the same study (made from the same
    results and more, so a rerun of a finished tune never puts its provisional entry back)."""
    if not isinstance(previous, dict) or previous.get("provisional"):
        return False
    if previous.get("study") is not None and previous.get("study") == entry.get("study"):
        return True
    was, now = previous.get("median_ms"), entry.get("median_ms")
    return isinstance(was, (int, float)) and isinstance(now, (int, float)) and was <= now


def _carry_candidates(previous, entry: dict) -> dict:
    """``entry`` with ``previous``'s candidate records (the entry it replaces, if any) for the
    variants its own tune did not run (``autofuse tune --variants``), each marked ``carried`` with
    the date of the tune that measured it. ``autofuse bench`` measures every variant in its tuned
    configuration: a retune of two variants must not send the others back to their defaults. The
    winner is still this tune's, from its own side-by-side timings."""
    old = previous.get("candidates") if isinstance(previous, dict) else None
    if not isinstance(old, dict) or not isinstance(entry.get("candidates"), dict):
        return entry
    carried = {name: {**record, "carried": record.get("carried", previous.get("date"))}
               for name, record in old.items() if name not in entry["candidates"] and isinstance(record, dict)}
    return {**entry, "candidates": {**entry["candidates"], **carried}} if carried else entry


def _check_item(fingerprint, problem, skey, dispatch_key, entry) -> tuple:
    """Check one record_many item and return it with its fingerprint key and canonical dispatch key."""
    if not isinstance(fingerprint, dict):
        raise TableError(f"a fingerprint must be a dict from current_fingerprint(), got {fingerprint!r}")
    if not isinstance(problem, str) or not problem:
        raise TableError(f"a problem name must be a non-empty str, got {problem!r}")
    if not isinstance(entry, dict):
        raise TableError(f"an entry must be a dict, got {type(entry).__name__}")
    if not isinstance(skey, str) or not isinstance(dispatch_key, (str, DispatchKey)):
        raise TableError(f"shape and dispatch keys must be str, got {skey!r} and {dispatch_key!r}")
    try:
        parse_shape_key(skey)
        dkey = dispatch_key if isinstance(dispatch_key, DispatchKey) else DispatchKey.from_str(dispatch_key)
        json.dumps(entry)  # fail here, not halfway through writing the file
        return fingerprint_key(fingerprint), fingerprint, problem, skey, dkey.to_str(), entry
    except (ValueError, TypeError) as e:
        raise TableError(f"cannot record {problem!r} at {skey!r}: {e}") from None
