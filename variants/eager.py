"""``eager``, for every problem: the reference model's own forward, verbatim.

The baseline every speedup is measured against, and the fallback that serves any shape,
dtype, device and autograd need. Under bf16 with float32 input it runs under autocast, as a
PyTorch user would (``autofuse.core.variant.EagerVariant``). No preconditions.

Generic, as ``compiled`` is: one class per problem (``eager_variant``), built-in, plugin or
KernelBench file, so a problem adds no eager module of its own. Its source hash is
EagerVariant's source and the reference's (a KernelBench file's digest): a changed reference
is another baseline, and the tuner re-times entries whose hash moved.
"""

from __future__ import annotations

import functools
import hashlib

from autofuse.core.problem import Problem, reference_identity
from autofuse.core.variant import EagerVariant
from autofuse.hookspecs import hookimpl

_classes: dict[str, tuple[Problem, type[EagerVariant]]] = {}


def eager_variant(problem: Problem) -> type[EagerVariant]:
    """The ``eager`` variant class of ``problem`` (the same class while the problem is the same)."""
    known = _classes.get(problem.name)
    if known is None or known[0] is not problem:
        cls = type(f"Eager_{problem.name}", (EagerVariant,), {
            "name": "eager", "problem": problem.name, "reference_problem": problem, "__module__": __name__,
            "description": "the reference forward, verbatim (autocast under bf16)",
            "source_hash": classmethod(_class_hash),
        })
        _classes[problem.name] = known = (problem, cls)
    return known[1]


@functools.cache
def _class_hash(cls: type[EagerVariant]) -> str:
    """EagerVariant's source and the reference's: a changed reference is another baseline."""
    digest = EagerVariant.source_hash() + reference_identity(cls.reference_problem)
    return hashlib.sha256(digest.encode()).hexdigest()[:16]


@hookimpl
def autofuse_register_generic_variants(problem):
    return [eager_variant(problem)]
