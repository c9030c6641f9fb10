"""The registry as plain records: what ``autofuse list`` prints and plugins can inspect."""

from __future__ import annotations

from autofuse import registry


def list_problems() -> list[dict]:
    """Every registered problem: name, aliases, description, shape parameters, default shapes, plugin."""
    return [
        {
            "name": p.name,
            "aliases": list(p.aliases),
            "description": p.description,
            "dims": list(p.dims),
            "default_shapes": [p.shape_str(s) for s in p.default_shapes],
            "plugin": registry.owner(p.name),
        }
        for p in sorted(registry.problems().values(), key=lambda p: p.name)
    ]


def list_variants(problem: str) -> list[dict]:
    """Every variant of ``problem``, simplest first: name, kind, devices, precisions, autograd, plugin."""
    variants = sorted(registry.variants(problem).values(), key=lambda v: (v.rank(), v.name))
    return [
        {
            "name": v.name,
            "kind": v.kind,
            "description": v.description,
            "devices": list(v.devices),
            "precisions": list(v.precisions),
            "autograd": v.supports_autograd,
            "plugin": registry.owner(problem, v.name),
        }
        for v in variants
    ]
