"""Reading a KernelBench file: its module-level sizes, and its code re-run at other sizes.

A KernelBench file defines ``Model``, ``get_inputs``, ``get_init_inputs`` and module-level
sizes (``batch_size = 128``, ``height = width = 32``) that the two functions read, often
through derived globals (``bias_shape = (out_channels, 1, 1)``). Setting a size therefore
re-runs the file with that literal replaced, so derived globals follow; the statements of
such a file are imports and definitions, so a re-run costs milliseconds.

The sizes of a call are read back from the model's init args and the input's shape: at
load, each size is moved by a few units in turn (on the meta device, so nothing is
allocated) to find the init arg or input axis that carries it verbatim; a call's sizes
are then read from those places and accepted only if re-running the file at them gives
exactly the call's init args and input shape.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import sys
import types
from collections.abc import Mapping

import torch

from autofuse.errors import InputError

REQUIRED = ("Model", "get_inputs", "get_init_inputs")
# How far each size is moved when probing where it shows up (small: a file whose inputs
# cannot be built on the meta device builds them for real).
PROBE_STEP = 3
_NAMESPACE_CACHE = 16


class KernelBenchFile:
    """One file's source, sizes and definitions; ``namespace(sizes)`` is the file run at ``sizes``."""

    def __init__(self, source: str, origin: str, module_name: str):
        self.source, self.origin = source, origin
        self.digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        self._tree = _parse(source, origin)
        self.sizes = literal_sizes(self._tree)
        self._cache: dict[tuple, dict] = {}
        self.module = self._load_module(module_name)
        self.Model = self.module.Model
        init_leaves, input_shape = self.signature(self.sizes)
        self.places = self._find_places(init_leaves, input_shape)
        self.positions = {name: places[0] for name, places in self.places.items()}

    # -- running the file ------------------------------------------------------
    def _load_module(self, module_name: str) -> types.ModuleType:
        """The file run at its own sizes, as a module in sys.modules (so models pickle and
        ``inspect`` finds their source); fails naming every required name it lacks."""
        module = types.ModuleType(module_name)
        module.__file__ = self.origin
        self._run(self._tree, module.__dict__)
        missing = [name for name in REQUIRED if name not in module.__dict__]
        if missing:
            raise InputError(
                f"{self.origin} is not a KernelBench file: it defines no {' and no '.join(missing)} "
                f"(a KernelBench file defines all of {', '.join(REQUIRED)})"
            )
        if not (isinstance(module.Model, type) and issubclass(module.Model, torch.nn.Module)):
            raise InputError(f"{self.origin}: Model must be an nn.Module subclass, got {module.Model!r}")
        sys.modules[module_name] = module
        self._cache[_key(self.sizes)] = module.__dict__
        return module

    def _run(self, tree: ast.Module, namespace: dict) -> None:
        try:
            exec(compile(tree, self.origin, "exec"), namespace)  # noqa: S102 - running the user's file is the point
        except Exception as exc:
            raise InputError(f"{self.origin} raised {type(exc).__name__} when run: {exc}") from exc

    def namespace(self, sizes: Mapping[str, int]) -> dict:
        """The file's globals after running it with its size literals set to ``sizes``."""
        key = _key(sizes)
        if key not in self._cache:
            tree = copy.deepcopy(self._tree)
            for name, node in _size_literals(tree):
                if name in sizes:
                    node.value = int(sizes[name])
            namespace = {"__name__": self.module.__name__, "__file__": self.origin}
            self._run(tree, namespace)
            if len(self._cache) >= _NAMESPACE_CACHE:
                self._cache.pop(next(k for k in self._cache if k != _key(self.sizes)))
            self._cache[key] = namespace
        return self._cache[key]

    def _call(self, sizes: Mapping[str, int], function: str):
        try:
            return self.namespace(sizes)[function]()
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"{self.origin}: {function}() raised {type(exc).__name__} at {dict(sizes)}: {exc}") from exc

    def init_inputs(self, sizes: Mapping[str, int]) -> list:
        return list(self._call(sizes, "get_init_inputs"))

    def inputs(self, sizes: Mapping[str, int], seed: int) -> torch.Tensor:
        """The one tensor ``get_inputs()`` returns at ``sizes``, drawn from ``seed`` (the global
        generator is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._one_tensor(self._call(sizes, "get_inputs"))

    def signature(self, sizes: Mapping[str, int]) -> tuple[tuple, tuple]:
        """(the init args flattened, the input's shape) at ``sizes``; nothing is allocated
        unless the file's get_inputs cannot run on the meta device."""
        get_inputs = self.namespace(sizes)["get_inputs"]
        try:
            with torch.device("meta"):
                x = self._one_tensor(get_inputs())
        except InputError:
            raise
        except Exception:  # noqa: BLE001 - e.g. an explicit device=; build it for real
            x = self.inputs(sizes, 0)
        return tuple(flatten(self.init_inputs(sizes))), tuple(x.shape)

    def _one_tensor(self, inputs) -> torch.Tensor:
        if not isinstance(inputs, (list, tuple)) or len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
            got = [type(v).__name__ for v in inputs] if isinstance(inputs, (list, tuple)) else type(inputs).__name__
            raise InputError(
                f"{self.origin}: get_inputs() returns {got}; autofuse tunes files whose get_inputs() "
                f"returns exactly one tensor (a list of one)"
            )
        return inputs[0]

    # -- reading the sizes of a call -------------------------------------------
    def _find_places(self, init_leaves: tuple, input_shape: tuple) -> dict[str, list[tuple[str, int]]]:
        """Where each size shows up verbatim: ("init", i) in the flattened init args, ("input", i)."""
        places = {}
        for name, value in self.sizes.items():
            probe = value + PROBE_STEP
            try:
                moved = self.signature({**self.sizes, name: probe})
            except InputError:
                continue  # the file cannot run with this size moved: it stays fixed
            for where, before, after in (("init", init_leaves, moved[0]), ("input", input_shape, moved[1])):
                if len(before) == len(after):
                    hits = [(where, i) for i, (b, a) in enumerate(zip(before, after)) if b == value and a == probe]
                    places.setdefault(name, []).extend(hits)
        return {name: found for name, found in places.items() if found}

    def sizes_of(self, init_args: list, input_shape: tuple) -> dict[str, int] | None:
        """The sizes at which the file gives exactly these init args and input shape, or None."""
        leaves, input_shape = tuple(flatten(init_args)), tuple(input_shape)
        sizes = dict(self.sizes)
        for name, (where, i) in self.positions.items():
            found = leaves if where == "init" else input_shape
            value = found[i] if i < len(found) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return None
            sizes[name] = value
        try:
            return sizes if self.signature(sizes) == (leaves, input_shape) else None
        except InputError:
            return None

    def axis_names(self) -> list[str]:
        """The input's axes named by the size each carries (its default length otherwise)."""
        names = [str(n) for n in self.signature(self.sizes)[1]]
        for name, places in reversed(self.places.items()):
            for where, i in places:
                if where == "input":
                    names[i] = name
        return names


def _parse(source: str, origin: str) -> ast.Module:
    try:
        tree = ast.parse(source, origin)
    except SyntaxError as exc:
        raise InputError(f"{origin} does not parse as Python: {exc}") from exc
    return _split_chained(tree)


def _split_chained(tree: ast.Module) -> ast.Module:
    """``height = width = 32`` becomes one assignment per name, so each literal can be set alone."""
    body = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) > 1 and isinstance(node.value, ast.Constant):
            body += [ast.copy_location(ast.Assign(targets=[t], value=copy.deepcopy(node.value)), node) for t in node.targets]
        else:
            body.append(node)
    tree.body = body
    return ast.fix_missing_locations(tree)


def _is_size(node) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0


def _assignments(node: ast.stmt):
    """(name, value node or None where it is not a plain literal) for each module-level assignment."""
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Name):
                yield target.id, node.value
            elif isinstance(target, (ast.Tuple, ast.List)):
                values = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) else None
                for j, element in enumerate(target.elts):
                    if isinstance(element, ast.Name):
                        same_length = values is not None and len(values) == len(target.elts)
                        yield element.id, values[j] if same_length else None
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        yield node.target.id, node.value
    elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        yield node.target.id, None


def _size_literals(tree: ast.Module):
    for node in tree.body:
        for name, value in _assignments(node):
            if _is_size(value):
                yield name, value


def literal_sizes(tree: ast.Module) -> dict[str, int]:
    """Module-level names only ever assigned a non-negative int literal, in order of first
    assignment, with their last value: the file's shape parameters."""
    sizes: dict[str, int] = {}
    other: set[str] = set()
    for node in tree.body:
        for name, value in _assignments(node):
            if _is_size(value) and name not in other:
                sizes[name] = value.value
            else:
                other.add(name)
                sizes.pop(name, None)
    return sizes


def flatten(values) -> list:
    """Nested lists and tuples (``bias_shape``) as one flat list of leaves."""
    leaves = []
    for value in values:
        if isinstance(value, (list, tuple)):
            leaves.extend(flatten(value))
        elif isinstance(value, torch.Tensor):  # compared by shape: equality of tensors is elementwise
            leaves.append(("tensor", tuple(value.shape)))
        else:
            leaves.append(value)
    return leaves


def _key(sizes: Mapping[str, int]) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in sizes.items()))
