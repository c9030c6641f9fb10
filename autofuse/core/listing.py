"""The registry as plain records: what ``autofuse list`` prints and plugins can inspect."""

from __future__ import annotations

from autofuse.core import registry


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


def list_variants(problem: str, device: str | None = None) -> list[dict]:
    """Every variant of ``problem``, simplest first: name, kind, devices, precisions, autograd,
    whether it serves a bfloat16 model (``bfloat16_model``: "yes", "forward" or "no"), plugin, and
    why it cannot run on ``device`` here (default: cuda if present, else cpu), or None."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    variants = sorted(registry.variants(problem).values(), key=lambda v: (v.rank(), v.name))
    return [
        {
            "name": v.name,
            "kind": v.kind,
            "description": v.description,
            "devices": list(v.devices),
            "precisions": list(v.precisions),
            "autograd": v.supports_autograd,
            "bfloat16_model": bfloat16_model(v),
            "plugin": registry.owner(problem, v.name),
            "unavailable": v.unavailable_reason(device),
        }
        for v in variants
    ]


def bfloat16_model(variant) -> str:
    """"yes" if ``variant`` serves a bfloat16 model under bf16 (forward and gradients), "forward"
    if only calls that need no gradient, else "no"; whatever this machine lacks to run it."""
    import torch

    device = variant.devices[-1]  # cuda, where it runs there
    lacking = variant.unavailable_reason(device)
    served = [variant.admits(device, torch.bfloat16, "bf16", grad) in (None, lacking) for grad in (False, True)]
    return "yes" if all(served) else "forward" if served[0] else "no"
