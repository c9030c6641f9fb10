"""The hooks through which plugins (the built-ins included) extend autofuse.

A plugin is a module or object with functions decorated by ``autofuse.hookimpl``
whose names match the specs below; it reaches autofuse through the ``autofuse``
entry-point group (see docs/plugins.md).
"""

from pluggy import HookimplMarker, HookspecMarker

hookspec = HookspecMarker("autofuse")
hookimpl = HookimplMarker("autofuse")


@hookspec
def autofuse_register_problems():
    """Return a list of ``autofuse.Problem`` instances to add to the registry."""


@hookspec
def autofuse_register_variants():
    """Return a list of ``autofuse.Variant`` subclasses (each names its problem)."""


@hookspec
def autofuse_register_generic_variants(problem):
    """Return a list of ``autofuse.Variant`` subclasses for ``problem`` (an ``autofuse.Problem``),
    called once for every registered problem (built-in, plugin or KernelBench file): variants
    that apply to any problem, such as ``torch.compile`` of its reference."""
