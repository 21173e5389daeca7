"""Errors and results that users can trigger.

Malformed input is a :class:`ConfigError` with a one-line message naming the field and the
fix. An infeasible mesh is never an exception: it is a result carrying reasons (see
:class:`meshplan.mesh.validity.Reason`).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Malformed input. ``str(err)`` is one line: ``<field>: <what is wrong>; <fix>``."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded as asked: missing or incomplete, or holding state
    that cannot be resharded to the new mesh (handed case C13). One line, as ConfigError."""
