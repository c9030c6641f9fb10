"""The modules of autofuse import one way: problem → variant → worker → gate → timer → study →
table → runtime, with no module importing one that imports it back.

Every ``import`` counts, at the top of a module or inside a function: a lazy import is still
an edge a reader has to follow. ``autofuse/__init__.py`` is the node ``__init__``; importing a
name from the package that is not a submodule (``from autofuse import hookimpl``) is an edge to it.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autofuse"


def _target(dotted: str, modules: set[str]) -> str | None:
    """The autofuse module that ``import <dotted>`` loads, or None outside autofuse."""
    parts = dotted.split(".")
    if parts[0] != "autofuse":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in modules else "__init__"


def _edges(source: str, modules: set[str]) -> set[str]:
    edges = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges |= {_target(alias.name, modules) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level <= 1:  # `from . import x` is `from autofuse import x`
            module = ".".join(filter(None, ["autofuse" if node.level else None, node.module]))
            if module == "autofuse":  # each name: a submodule, or a name defined in __init__
                edges |= {alias.name if alias.name in modules else "__init__" for alias in node.names}
            else:
                edges.add(_target(module, modules))
    return edges - {None}


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the autofuse modules it imports (itself left out)."""
    modules = {path.stem for path in package.glob("*.py")}
    return {name: _edges((package / f"{name}.py").read_text(), modules) - {name} for name in modules}


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
    assert "verify" in graph["evaluate"]  # a top-level `from autofuse.verify import ...`
    assert "evaluate" in graph["worker"]  # imported inside the child's _serve(): still an edge
    assert "tuner" in graph["__init__"]  # the package's lazy __getattr__


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
        f"autofuse/*.py must import without cycles, got {' -> '.join(cycle)}: move what both need "
        f"into the lower module, or pass a callable in, rather than import back up"
    )
