"""The modules of autofuse import one way, with no module importing one that imports it back,
and the packages in layers: ``core`` (problems, variants, plugins) and ``kernels`` (what compiled
variants share) import nothing from ``tuning``, ``serve``, ``bench``, ``report`` or the CLI.

Every ``import`` counts, at the top of a module or inside a function: a lazy import is still
an edge a reader has to follow. Modules are named by their dotted path under ``autofuse``
(``tuning.gate``); ``autofuse/__init__.py`` is ``__init__`` and a package's is its name
(``tuning``); importing a name from a package that is not a submodule (``from autofuse import
hookimpl``) is an edge to that package.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autofuse"
ABOVE_CORE = {"tuning", "serve", "bench", "report", "cli", "runtime"}


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _target(dotted: str, modules: set[str]) -> str | None:
    """The autofuse module that ``import <dotted>`` loads (the longest known prefix), or None."""
    parts = dotted.split(".")
    if parts[0] != "autofuse":
        return None
    for end in range(len(parts), 1, -1):
        if ".".join(parts[1:end]) in modules:
            return ".".join(parts[1:end])
    return "__init__"


def _package_of(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1])


def _edges(path: pathlib.Path, package: pathlib.Path, modules: set[str]) -> set[str]:
    edges = set()
    here = _package_of(path, package)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges |= {_target(alias.name, modules) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here.split(".") if here else []
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(["autofuse", *base, *filter(None, [node.module])])
            else:
                module = node.module or ""
            for alias in node.names:  # each name: a submodule, or a name the package defines
                edges.add(_target(f"{module}.{alias.name}", modules))
    return edges - {None}


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the autofuse modules it imports (itself left out)."""
    paths = {_module_name(path, package): path for path in package.rglob("*.py")}
    return {name: _edges(path, package, set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colouring nodes)."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once fully explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_parser_sees_top_level_and_lazy_imports():
    graph = import_graph()
    assert "tuning.gate" in graph["tuning.evaluate"]  # a top-level `from autofuse.tuning.gate import ...`
    assert "tuning.evaluate" in graph["tuning.worker"]  # imported inside the child's _serve(): still an edge
    assert "tuning.tuner" in graph["__init__"]  # the package's lazy __getattr__
    assert "hookspecs" in graph["__init__"]  # `from autofuse.hookspecs import hookimpl`
    assert "core.registry" in graph["tuning.search"]  # `from autofuse.core import registry`


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"x": {"y"}, "y": {"y2", "x"}, "y2": set()}, ["x", "y", "x"]),
])
def test_find_cycle_finds_one_where_there_is_one(graph, cycle):
    assert find_cycle(graph) == cycle


def test_autofuse_modules_import_one_way():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"autofuse's modules must import without cycles, got {' -> '.join(cycle)}: move what both need "
        f"into the lower module, or pass a callable in, rather than import back up"
    )


@pytest.mark.parametrize("layer", ["core", "kernels"])
def test_lower_layers_do_not_import_upper_ones(layer):
    graph = import_graph()
    upward = {(name, target) for name, targets in graph.items() if name.split(".")[0] == layer
              for target in targets if target.split(".")[0] in ABOVE_CORE}
    assert not upward, f"autofuse.{layer} must not import tuning, serve, bench, report or the CLI, got {sorted(upward)}"
