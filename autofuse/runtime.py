"""Stable import path of ``autofuse.serve.runtime`` (plugin API and exported KernelBench files: dispatching_class).

The module lives in ``autofuse.serve.runtime``; this name is the same module object, so
``from autofuse.runtime import X`` and ``autofuse.runtime.X`` keep working for plugins written against it.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("autofuse.serve.runtime")
