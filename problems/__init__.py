"""The built-in problems, one module each: one entry point, ``problems = "autofuse.problems"``.

Each module here registers as the plugin ``problems.<module>``, which AUTOFUSE_BLOCK_PLUGINS can
name (``autofuse.core.plugins``). They are found, not listed: adding a problem adds its module only.
"""

import pkgutil

PLUGIN_MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
