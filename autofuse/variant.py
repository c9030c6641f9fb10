"""Stable import path of ``autofuse.core.variant`` (plugin API: Variant and its helpers).

The module lives in ``autofuse.core.variant``; this name is the same module object, so
``from autofuse.variant import X`` and ``autofuse.variant.X`` keep working for plugins written against it.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("autofuse.core.variant")
