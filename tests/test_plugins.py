"""Plugins: entry points (the built-ins and a tiny third-party distribution), errors, blocking."""

import importlib
import importlib.metadata
import inspect
import os
import pathlib
import textwrap

import pytest
import torch
from helpers import PROBLEMS

import autofuse
from autofuse import hookspecs
from autofuse.core import plugins, registry
from autofuse.core.variant import EagerVariant

EXTERNAL = '''
import torch.nn.functional as F
import autofuse
from autofuse.core.variant import Variant


class External(Variant):
    name = "external"
    problem = "matmul_gelu_softmax"
    kind = "simplified"
    description = "a variant from a package that is not autofuse"
    supports_autograd = True

    def forward(self, model, x):
        return F.softmax(F.gelu(F.linear(x, model.linear.weight, model.linear.bias)), dim=1)


@autofuse.hookimpl
def autofuse_register_variants():
    return [External]
'''


@pytest.fixture
def fresh_registry():
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


@pytest.fixture
def third_party(tmp_path, monkeypatch, fresh_registry):
    """A distribution installed only as a dist-info on sys.path, declaring an `autofuse` entry point."""
    (tmp_path / "autofuse_tiny_plugin.py").write_text(EXTERNAL)
    info = tmp_path / "autofuse_tiny_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: autofuse-tiny-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[autofuse]\ntiny = autofuse_tiny_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    plugins.reset_plugin_manager()
    return tmp_path


def _register(monkeypatch, source: str, name: str, tmp_path) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTOFUSE_PLUGINS", name)
    plugins.reset_plugin_manager()


def test_builtins_register_through_the_entry_point_group(fresh_registry):
    # The built-ins by name: a plugin installed beside autofuse (the example, say) adds its own.
    owners = {p: registry.owner(p) for p in PROBLEMS}
    assert owners == {p: f"problems.{p}" for p in PROBLEMS}, owners
    assert registry.owner("gemm_bn", "simplified") == "gemm_bn.simplified"
    # The hand-written CUDA variants (every kernel autofuse's own, no cuBLAS) live in cuda_fused.py
    # in every problem's folder; the variant names the table stores are unchanged.
    for problem in PROBLEMS:
        cuda = {v for v in registry.variants(problem) if registry.owner(problem, v) == f"{problem}.cuda_fused"}
        assert cuda == ({"cuda_naive", "cuda_tiled", "single_pass"} if problem == "gemm_avgpool_gelu_residual"
                        else {"cuda_naive", "cuda_tiled", "cuda_templated"}), (problem, cuda)


def test_a_third_party_distribution_adds_a_variant_that_is_listed_tuned_and_dispatched(third_party, tmp_path):
    listed = {v["name"]: v for v in autofuse.list_variants("matmul_gelu_softmax")}
    assert listed["external"]["plugin"] == "tiny"
    table = tmp_path / "t.json"
    [result] = autofuse.tune("matmul_gelu_softmax", {"batch_size": 8, "in_features": 24, "out_features": 16},
                             device="cpu", table=table, variants=["external"], seed=0, progress=False)
    assert result.winner["variant"] == "external"
    module = autofuse.get_module("matmul_gelu_softmax", 24, 16, table=table)
    with torch.no_grad():
        assert module.dispatch_info(torch.rand(8, 24))["variant"] == "external"


def test_duplicate_names_fail_naming_both_plugins(monkeypatch, tmp_path, fresh_registry):
    _register(monkeypatch, '''
        import autofuse
        from autofuse.core.variant import Variant

        class Again(Variant):
            name = "simplified"
            problem = "gemm_bn"
            kind = "simplified"
            description = "clashes with the built-in"

        @autofuse.hookimpl
        def autofuse_register_variants():
            return [Again]
    ''', "clashing_plugin", tmp_path)
    with pytest.raises(autofuse.PluginError, match="gemm_bn.simplified.*clashing_plugin"):
        registry.variants("gemm_bn")


def test_duplicate_problem_alias_fails_naming_both(monkeypatch, tmp_path, fresh_registry):
    _register(monkeypatch, '''
        import dataclasses
        import autofuse
        from autofuse.problems.gemm_bn import PROBLEM

        @autofuse.hookimpl
        def autofuse_register_problems():
            return [dataclasses.replace(PROBLEM, name="gemm_bn_copy", aliases=("kb2-39",))]
    ''', "alias_plugin", tmp_path)
    with pytest.raises(autofuse.PluginError, match="kb2-39.*problems.gemm_bn.*alias_plugin"):
        registry.problems()


def test_a_misspelled_hook_is_caught(monkeypatch, tmp_path, fresh_registry):
    _register(monkeypatch, '''
        import autofuse

        @autofuse.hookimpl
        def autofuse_register_variant():
            return []
    ''', "typo_plugin", tmp_path)
    with pytest.raises(Exception, match="autofuse_register_variant"):
        registry.problems()


def test_a_variant_for_an_unknown_problem_lists_the_known_ones(monkeypatch, tmp_path, fresh_registry):
    monkeypatch.delenv("AUTOFUSE_BLOCK_PLUGINS", raising=False)  # with any plugin blocked it is skipped instead
    _register(monkeypatch, '''
        import autofuse
        from autofuse.core.variant import Variant

        class Orphan(Variant):
            name = "orphan"
            problem = "no_such_problem"
            kind = "eager"
            description = "for a problem nobody registered"

        @autofuse.hookimpl
        def autofuse_register_variants():
            return [Orphan]
    ''', "orphan_plugin", tmp_path)
    with pytest.raises(autofuse.PluginError, match="orphan_plugin.*known problems: gemm_avgpool"):
        registry.problems()


def test_unknown_names_list_the_known_ones(fresh_registry):
    with pytest.raises(autofuse.UnknownNameError, match="known problems: .*gemm_bn"):
        registry.get_problem("gemm_bm")
    with pytest.raises(autofuse.UnknownNameError, match="known variants: .*simplified"):
        registry.get_variant("kb2-39", "simplifed")


def test_an_environment_variable_blocks_named_plugins(monkeypatch, fresh_registry):
    monkeypatch.setenv("AUTOFUSE_BLOCK_PLUGINS", "gemm_bn.simplified, problems.matmul_clamp_lse_mish")
    plugins.reset_plugin_manager()
    assert "simplified" not in registry.variants("gemm_bn")
    assert "eager" in registry.variants("gemm_bn")
    assert "matmul_clamp_lse_mish" not in registry.problems()


def test_eager_is_one_generic_variant_for_every_problem_a_file_problem_too(monkeypatch, fresh_registry):
    # Issue 31: the four variants/*/eager.py differed only in a class name; like `compiled`, one
    # generic `eager` now joins every problem, with a class per problem and the reference in its hash.
    from autofuse.kernelbench import problem as kernelbench

    monkeypatch.setenv(kernelbench.ENV, "")
    file_problem = str(pathlib.Path(__file__).parent / "kernelbench" / "gemm_sigmoid_sum.py")
    try:
        classes = {p: registry.get_variant(p, "eager") for p in [*PROBLEMS, file_problem]}
        for problem, cls in classes.items():
            assert registry.is_generic(problem, "eager") and registry.owner(problem, "eager") == "eager", problem
            assert issubclass(cls, EagerVariant) and cls.problem == registry.get_problem(problem).name
        assert len({cls.source_hash() for cls in classes.values()}) == len(classes)  # each its reference's
        assert classes["gemm_bn"] is registry.get_variant("gemm_bn", "eager")  # the same class while the problem is
    finally:
        kernelbench.forget()
    monkeypatch.setenv("AUTOFUSE_BLOCK_PLUGINS", "eager")
    plugins.reset_plugin_manager()
    assert all("eager" not in registry.variants(p) for p in PROBLEMS)


def test_a_problems_own_variant_is_kept_over_a_generic_one_of_the_same_name(monkeypatch, tmp_path, fresh_registry):
    # Plugins written before eager was generic (the example's matmul_sigmoid_sum) register their own.
    _register(monkeypatch, '''
        import dataclasses
        import autofuse
        from autofuse.core.variant import EagerVariant
        from autofuse.problems.gemm_bn import PROBLEM

        class OwnEager(EagerVariant):
            name = "eager"
            problem = "gemm_bn_copy"
            description = "the problem's own eager"

        @autofuse.hookimpl
        def autofuse_register_problems():
            return [dataclasses.replace(PROBLEM, name="gemm_bn_copy", aliases=())]

        @autofuse.hookimpl
        def autofuse_register_variants():
            return [OwnEager]
    ''', "own_eager_plugin", tmp_path)
    assert registry.get_variant("gemm_bn_copy", "eager").__name__ == "OwnEager"
    assert registry.owner("gemm_bn_copy", "eager") == "own_eager_plugin" and not registry.is_generic("gemm_bn_copy", "eager")
    assert registry.is_generic("gemm_bn", "eager")


def test_a_problems_package_is_one_entry_point_and_one_line_of_pyproject(fresh_registry):
    # Issue 31: adding a problem touches its own files and one line of pyproject.toml, where 24
    # hand-listed entry points and a package and a package-data line per problem were.
    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    for problem in PROBLEMS:
        lines = [line for line in pyproject.splitlines() if problem in line and not line.startswith("#")]
        assert lines == [f'{problem} = "autofuse.variants.{problem}"'], (problem, lines)
    ours = {ep.name for ep in importlib.metadata.entry_points(group="autofuse") if ep.value.startswith("autofuse.")}
    assert ours == {"problems", "eager", "compiled", *PROBLEMS}, ours


PACKAGE_INIT = '''
PLUGIN_MODULES = ("first", "second")
'''
PACKAGE_MODULE = '''
import autofuse
from autofuse.core.variant import EagerVariant

class {cls}(EagerVariant):
    name = "{name}"
    problem = "gemm_bn"
    description = "from a plugin package"

@autofuse.hookimpl
def autofuse_register_variants():
    return [{cls}]
'''


def test_a_plugin_package_registers_each_listed_module_under_a_name_of_its_own(monkeypatch, tmp_path, fresh_registry):
    package = tmp_path / "pkg_plugin"
    package.mkdir()
    (package / "__init__.py").write_text(PACKAGE_INIT)
    for stem in ("first", "second"):
        (package / f"{stem}.py").write_text(PACKAGE_MODULE.format(cls=stem.title(), name=f"{stem}_variant"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTOFUSE_PLUGINS", "pkg_plugin")
    plugins.reset_plugin_manager()
    assert registry.owner("gemm_bn", "first_variant") == "pkg_plugin.first"
    assert registry.owner("gemm_bn", "second_variant") == "pkg_plugin.second"
    monkeypatch.setenv("AUTOFUSE_BLOCK_PLUGINS", "pkg_plugin.second, gemm_bn.triton_gemm")
    plugins.reset_plugin_manager()
    assert {"first_variant", "simplified", "eager"} <= set(registry.variants("gemm_bn"))
    assert not {"second_variant", "triton"} & set(registry.variants("gemm_bn"))
    monkeypatch.setenv("AUTOFUSE_BLOCK_PLUGINS", "gemm_bn")  # a problem's whole package: its generic variants stay
    plugins.reset_plugin_manager()
    assert {v for v in registry.variants("gemm_bn") if not registry.is_generic("gemm_bn", v)} == {"first_variant", "second_variant"}


def test_tracing_prints_hook_calls(monkeypatch, capsys, fresh_registry):
    monkeypatch.setenv("AUTOFUSE_TRACE_PLUGINS", "1")
    plugins.reset_plugin_manager()
    registry.problems()
    assert "autofuse_register_problems" in capsys.readouterr().err


def test_every_hookspec_is_documented_and_tested():
    specs = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("autofuse_")]
    readme = (pathlib.Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    tests = "".join(p.read_text() for p in pathlib.Path(__file__).parent.rglob("test_*.py"))
    for name in specs:
        assert getattr(hookspecs, name).__doc__, f"hookspec {name} has no docstring"
        assert name in readme, f"hookspec {name} is not documented in docs/plugins.md"
        assert name in tests.replace(f'"{name}"', ""), f"hookspec {name} is not used by any test"


GENERIC = '''
import autofuse
from autofuse.core.variant import EagerVariant

_classes = {}


@autofuse.hookimpl
def autofuse_register_generic_variants(problem):
    if problem.name not in _classes:
        _classes[problem.name] = type("Again", (EagerVariant,), {
            "name": "again", "problem": problem.name, "description": "the reference, for any problem"})
    return [_classes[problem.name]]
'''


def test_a_generic_variant_joins_every_problem_a_file_problem_too(monkeypatch, tmp_path, fresh_registry):
    from autofuse.kernelbench import problem as kernelbench

    monkeypatch.setenv(kernelbench.ENV, "")
    _register(monkeypatch, GENERIC, "generic_plugin", tmp_path)
    try:
        for problem in PROBLEMS:
            assert registry.owner(problem, "again") == "generic_plugin" and registry.is_generic(problem, "again")
        file_problem = pathlib.Path(__file__).parent / "kernelbench" / "gemm_sigmoid_sum.py"
        assert "again" in registry.variants(str(file_problem))  # a file loaded later gets one too
        assert not registry.is_generic("gemm_bn", "simplified")
    finally:
        kernelbench.forget()


def test_a_generic_variant_naming_another_problem_fails_naming_the_plugin(monkeypatch, tmp_path, fresh_registry):
    _register(monkeypatch, GENERIC.replace('"problem": problem.name', '"problem": "gemm_bn"'), "confused_plugin", tmp_path)
    with pytest.raises(autofuse.PluginError, match="confused_plugin.*names problem 'gemm_bn'"):
        registry.problems()
