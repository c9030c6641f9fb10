"""The registry: hook results folded into dicts keyed by name.

A duplicate name fails naming both plugins, except that a problem's own variant is kept over a
generic one of the same name (``autofuse_register_generic_variants``); an unknown name lists the
known ones.
Built once per plugin manager (``plugins.reset_plugin_manager`` moves ``plugins.generation()``)
and again whenever a KernelBench file becomes a problem (``autofuse.kernelbench.problem``): a problem
name that is a path loads that file.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from autofuse.core import plugins
from autofuse.core.plugins import blocked_plugins, get_plugin_manager
from autofuse.core.problem import Problem
from autofuse.core.variant import Variant, validate_variant_class
from autofuse.errors import PluginError, UnknownNameError
from autofuse.kernelbench import problem as kernelbench


@dataclasses.dataclass
class _Registry:
    problems: dict[str, Problem]
    aliases: dict[str, str]
    variants: dict[str, dict[str, type[Variant]]]
    owners: dict[tuple[str, ...], str]  # (problem,) or (problem, variant) -> plugin name
    generic: set[tuple[str, str]] = dataclasses.field(default_factory=set)  # from autofuse_register_generic_variants
    kernelbench: int = -1  # kernelbench.generation() it was built at
    plugins: int = -1  # plugins.generation() it was built at


log = logging.getLogger("autofuse")
_lock = threading.Lock()
_registry: _Registry | None = None


def _hook_results(hook_name: str, **kwargs):
    """(plugin name, item) for every item every plugin returned, in registration order.

    Each plugin's implementation is called through its own subset hook caller, so the
    results stay attributable to a plugin and AUTOFUSE_TRACE_PLUGINS still sees the calls.
    """
    pm = get_plugin_manager()
    hook = getattr(pm.hook, hook_name)
    for impl in hook.get_hookimpls():  # registration order: entry points, then AUTOFUSE_PLUGINS
        others = [plugin for plugin in pm.get_plugins() if plugin is not impl.plugin]
        for returned in pm.subset_hook_caller(hook_name, others)(**kwargs):
            for item in returned or ():
                yield impl.plugin_name, item


def _build() -> _Registry:
    reg = _Registry(problems={}, aliases={}, variants={}, owners={}, plugins=plugins.generation())
    for plugin, problem in _hook_results("autofuse_register_problems"):
        _add_problem(reg, plugin, problem)
    # Before the plugins' variants, which may name a file problem (kb_<stem>). Its eager
    # variant is the generic one (variants/eager.py), as for every problem.
    for problem in kernelbench.registered():
        _add_problem(reg, f"kernelbench:{problem.file.origin}", problem)
    reg.kernelbench = kernelbench.generation()
    for plugin, variant in _hook_results("autofuse_register_variants"):
        _add_variant(reg, plugin, variant)
    for problem in list(reg.problems.values()):  # every problem is known now, the files' included
        for plugin, variant in _hook_results("autofuse_register_generic_variants", problem=problem):
            if getattr(variant, "problem", None) != problem.name:
                raise PluginError(f"plugin {plugin!r} returned {variant!r} for problem {problem.name!r}, "
                                  f"but it names problem {getattr(variant, 'problem', None)!r}")
            if _own_variant_named(reg, problem.name, variant.name):
                continue  # the problem's own (a plugin's "eager" from before eager was generic) is kept
            _add_variant(reg, plugin, variant)
            reg.generic.add((problem.name, variant.name))
    return reg


def _add_problem(reg: _Registry, plugin: str, problem: Problem) -> None:
    if not isinstance(problem, Problem):
        raise PluginError(f"plugin {plugin!r} registered {problem!r}, which is not an autofuse.Problem")
    for name in (problem.name, *problem.aliases):
        taken = reg.aliases.get(name)
        if taken is not None:
            raise PluginError(
                f"problem name {name!r} is registered twice: by plugin {reg.owners[(taken,)]!r} "
                f"(problem {taken!r}) and by plugin {plugin!r} (problem {problem.name!r})"
            )
        reg.aliases[name] = problem.name
    reg.problems[problem.name] = problem
    reg.variants[problem.name] = {}
    reg.owners[(problem.name,)] = plugin


def _add_variant(reg: _Registry, plugin: str, variant: type[Variant]) -> None:
    validate_variant_class(variant, plugin)
    if variant.problem not in reg.problems and blocked_plugins():
        # Its problem's plugin is probably the one the user blocked: skip, don't fail.
        log.warning("autofuse: skipping variant %s/%s of plugin %r: no such problem (blocked: %s)",
                    variant.problem, variant.name, plugin, ", ".join(blocked_plugins()))
        return
    if variant.problem not in reg.problems and variant.problem.startswith("kb_"):
        # A variant for a KernelBench file that this process has not loaded: it joins when the file does.
        log.debug("autofuse: variant %s/%s of plugin %r waits for its KernelBench file", variant.problem, variant.name, plugin)
        return
    if variant.problem not in reg.problems:
        raise PluginError(
            f"plugin {plugin!r} registered variant {variant.name!r} for unknown problem "
            f"{variant.problem!r}; known problems: {', '.join(sorted(reg.problems)) or 'none'}"
        )
    table = reg.variants[variant.problem]
    if variant.name in table:
        raise PluginError(
            f"variant {variant.problem}/{variant.name} is registered twice: by plugin "
            f"{reg.owners[(variant.problem, variant.name)]!r} and by plugin {plugin!r}"
        )
    table[variant.name] = variant
    reg.owners[(variant.problem, variant.name)] = plugin


def _own_variant_named(reg: _Registry, problem: str, name: str) -> bool:
    """Whether ``problem`` has a variant ``name`` that no generic hook registered."""
    return name in reg.variants.get(problem, {}) and (problem, name) not in reg.generic


def _get() -> _Registry:
    global _registry
    with _lock:
        stale = _registry is None or (_registry.kernelbench, _registry.plugins) != (kernelbench.generation(), plugins.generation())
        if stale:
            _registry = _build()
        return _registry


def problems() -> dict[str, Problem]:
    """Every registered problem by name."""
    return dict(_get().problems)


def get_problem(name: str) -> Problem:
    """The problem called ``name`` or one of its aliases (e.g. ``kb2-39``), or the problem of
    the KernelBench file at path ``name`` (loaded and registered on first use)."""
    reg = _get()
    canonical = reg.aliases.get(name)
    if canonical is None and kernelbench.is_path(name):
        canonical = kernelbench.load(name).name
        reg = _get()
    if canonical is None:
        known = ", ".join(
            f"{p.name} ({', '.join(p.aliases)})" if p.aliases else p.name for p in reg.problems.values()
        )
        hint = "; a KernelBench file is named by its path (it is then also known as kb_<stem>)" if name.startswith("kb_") else ""
        raise UnknownNameError(f"unknown problem {name!r}; known problems: {known or 'none'}{hint}")
    return reg.problems[canonical]


def variants(problem: str) -> dict[str, type[Variant]]:
    """Every variant of ``problem`` by name."""
    name = get_problem(problem).name  # first: a path loads its file, which rebuilds the registry
    return dict(_get().variants[name])


def get_variant(problem: str, name: str) -> type[Variant]:
    table = variants(problem)
    if name not in table:
        raise UnknownNameError(
            f"problem {get_problem(problem).name!r} has no variant {name!r}; known variants: {', '.join(table) or 'none'}"
        )
    return table[name]


def is_generic(problem: str, variant: str) -> bool:
    """Whether the variant came from ``autofuse_register_generic_variants`` (one for every problem)."""
    return (get_problem(problem).name, variant) in _get().generic


def owner(problem: str, variant: str | None = None) -> str:
    """The plugin that registered a problem or a variant."""
    key = (get_problem(problem).name,) if variant is None else (get_problem(problem).name, variant)
    return _get().owners[key]
