"""Stable import path of ``autofuse.core.problem`` (plugin API: Problem, Tolerance).

The module lives in ``autofuse.core.problem``; this name is the same module object, so
``from autofuse.problem import X`` and ``autofuse.problem.X`` keep working for plugins written against it.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("autofuse.core.problem")
