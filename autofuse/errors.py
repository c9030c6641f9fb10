"""The autofuse exception hierarchy.

Every message states the broken invariant and the offending values, so a user can
act on it without reading the source.
"""


class AutofuseError(Exception):
    """Base class of every error autofuse raises on purpose."""


class PluginError(AutofuseError):
    """A plugin registered something invalid, or two plugins registered one name."""


class UnknownNameError(AutofuseError, KeyError):
    """A problem, variant or precision name that nothing registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class InputError(AutofuseError, ValueError):
    """An input tensor, shape or argument that does not fit the problem."""


class TableError(AutofuseError):
    """A dispatch table that cannot be read or written (corrupt, foreign, locked)."""


class BuildError(AutofuseError):
    """A variant could not be compiled or loaded."""


class StorageError(AutofuseError):
    """A study storage that cannot be used: an unknown URL form, a missing driver, an unreachable database."""
