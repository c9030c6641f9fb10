"""autofuse: a plugin-based autotuner for fused GPU kernels.

    autofuse.tune("gemm_bn", {"batch_size": 1024, "in_features": 8192, "out_features": 8192})
    module = autofuse.get_module("gemm_bn", 8192, 8192, (8192,))

Heavy modules (torch, optuna) are imported on first use, so ``import autofuse`` is cheap.
"""

from autofuse.errors import AutofuseError, InputError, PluginError, StorageError, TableError, UnknownNameError
from autofuse.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "AutofuseError", "InputError", "PluginError", "StorageError", "TableError", "UnknownNameError",
    "Problem", "Tolerance", "Variant", "hookimpl",
    "get_module", "list_problems", "list_variants", "tune",
]


def __getattr__(name):
    if name in ("Problem", "Tolerance"):
        from autofuse.core import problem
        return getattr(problem, name)
    if name == "Variant":
        from autofuse.core.variant import Variant
        return Variant
    if name == "tune":
        from autofuse.tuning.tuner import tune
        return tune
    if name == "get_module":
        from autofuse.serve.runtime import get_module
        return get_module
    if name in ("list_problems", "list_variants"):
        from autofuse.core import listing
        return getattr(listing, name)
    raise AttributeError(f"module 'autofuse' has no attribute {name!r}")
