"""The plugin manager, built lazily on first use (never at import time).

A plugin is a module registered through the ``autofuse`` entry-point group (or
AUTOFUSE_PLUGINS). A plugin may be a package that lists its plugin modules in
``PLUGIN_MODULES``: each registers as the plugin ``<its name>.<module>`` (``gemm_bn.simplified``),
so each can be blocked by name, and the package is one entry point (one line of pyproject.toml
per built-in problem: ``gemm_bn = "autofuse.variants.gemm_bn"``). A blocked module is not imported.

Environment:
  AUTOFUSE_BLOCK_PLUGINS  comma-separated plugin names to skip: an entry point (``gemm_bn``, all of a
                          package) or a module of one (``gemm_bn.simplified``)
  AUTOFUSE_PLUGINS        comma-separated importable modules to register as plugins without an
                          entry point (handy for local experiments; worker subprocesses inherit it)
  AUTOFUSE_TRACE_PLUGINS  set to 1 to print every hook call to stderr
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

import pluggy

from autofuse import hookspecs
from autofuse.errors import PluginError

ENTRY_POINT_GROUP = "autofuse"

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_generation = 0  # moves on every reset, so what is built from the manager (the registry) rebuilds


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def blocked_plugins() -> list[str]:
    """Plugin names AUTOFUSE_BLOCK_PLUGINS asks to skip."""
    return _env_list("AUTOFUSE_BLOCK_PLUGINS")


def _build() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("autofuse")
    pm.add_hookspecs(hookspecs)
    for name in blocked_plugins():
        pm.set_blocked(name)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for name, plugin in pm.list_name_plugin():  # the entry points' (a blocked name maps to None)
        if plugin is not None:
            _register_modules_of(pm, name, plugin)
    for module_name in _env_list("AUTOFUSE_PLUGINS"):
        if pm.is_blocked(module_name):
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(
                f"AUTOFUSE_PLUGINS names module {module_name!r}, which cannot be imported: {exc}"
            ) from exc
        if not pm.is_registered(module):
            pm.register(module, name=module_name)
            _register_modules_of(pm, module_name, module)
    # A misspelled hook name in a plugin fails here rather than being silently ignored.
    pm.check_pending()
    if os.environ.get("AUTOFUSE_TRACE_PLUGINS"):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    return pm


def _register_modules_of(pm: pluggy.PluginManager, name: str, package) -> None:
    """Register each module ``package`` lists in ``PLUGIN_MODULES`` as the plugin ``name.module``."""
    for stem in getattr(package, "PLUGIN_MODULES", ()):
        plugin_name = f"{name}.{stem}"
        if pm.is_blocked(plugin_name) or pm.has_plugin(plugin_name):
            continue
        try:
            module = importlib.import_module(f"{package.__name__}.{stem}")
        except ImportError as exc:
            raise PluginError(f"plugin {name!r} lists {stem!r} in PLUGIN_MODULES, but "
                              f"{package.__name__}.{stem} cannot be imported: {exc}") from exc
        pm.register(module, name=plugin_name)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading entry points on the first call."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = _build()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the manager (tests, after changing plugins); the registry, which compares
    ``generation()``, is rebuilt from the next one."""
    global _manager, _generation
    with _lock:
        _manager = None
        _generation += 1


def generation() -> int:
    """How many times the manager was reset: a registry built at another generation is stale."""
    return _generation
