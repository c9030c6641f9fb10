"""The import paths plugins and exported KernelBench files use keep working (the plugin API).

The modules moved into packages (``autofuse.core``, ``autofuse.serve``...); the old paths are
aliases of the same module objects, so ``isinstance`` checks and monkeypatching agree.
"""

import importlib
import pkgutil

import pytest

import autofuse

ALIASES = {
    "autofuse.variant": "autofuse.core.variant",
    "autofuse.problem": "autofuse.core.problem",
    "autofuse.precision": "autofuse.core.precision",
    "autofuse.runtime": "autofuse.serve.runtime",
}


@pytest.mark.parametrize("old, new", sorted(ALIASES.items()))
def test_the_old_module_paths_are_the_new_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_names_plugins_and_exported_files_import_resolve():
    import autofuse.kernelbench
    from autofuse import hookimpl
    from autofuse.hookspecs import hookspec
    from autofuse.precision import PRECISIONS, math_mode
    from autofuse.problem import Problem, Tolerance
    from autofuse.runtime import dispatching_class
    from autofuse.testing import CONFORMANCE_SHAPES
    from autofuse.variant import EagerVariant, FoldCache, Variant

    assert callable(autofuse.kernelbench.register_source)
    assert autofuse.Variant is Variant and autofuse.Problem is Problem and autofuse.Tolerance is Tolerance
    assert all(x is not None for x in (hookimpl, hookspec, PRECISIONS, math_mode, dispatching_class,
                                       CONFORMANCE_SHAPES, EagerVariant, FoldCache))


def test_the_public_functions_survive_importing_every_subpackage():
    """``autofuse.tune`` is a function; no subpackage may take its name (or another public one's)."""
    for module in pkgutil.walk_packages(autofuse.__path__, "autofuse."):
        if module.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as e:  # an optional dependency (triton, matplotlib) is missing here
            if e.name.startswith("autofuse"):
                raise
    for name in ("tune", "get_module", "list_problems", "list_variants"):
        assert callable(getattr(autofuse, name)), f"autofuse.{name} must stay a function, got {getattr(autofuse, name)!r}"
