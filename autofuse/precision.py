"""Stable import path of ``autofuse.core.precision`` (plugin API: precision classes and math modes).

The module lives in ``autofuse.core.precision``; this name is the same module object, so
``from autofuse.precision import X`` and ``autofuse.precision.X`` keep working for plugins written against it.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("autofuse.core.precision")
