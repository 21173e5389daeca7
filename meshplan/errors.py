"""Errors and results that users can trigger.

Malformed input is a :class:`ConfigError` with a one-line message naming the field and the
fix. An infeasible mesh is never an exception: it is a result carrying reasons (see
:class:`meshplan.mesh.validity.Reason`).
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every character that is not printable (newlines, escape sequences, other
    control and format characters) written as a Python escape, so that an error that echoes
    input stays one line and cannot drive the terminal.

    >>> printable("a\\nb\\x1b[2J")
    'a\\\\nb\\\\x1b[2J'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ConfigError(ValueError):
    """Malformed input. ``str(err)`` is one printable line: ``<field>: <what is wrong>; <fix>``
    (control characters from the input escaped, see :func:`printable`)."""

    def __init__(self, field: str, message: str):
        self.field = printable(str(field)) or "''"
        self.message = printable(str(message))
        super().__init__(f"{self.field}: {self.message}")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded as asked: missing or incomplete, or holding state
    that cannot be resharded to the new mesh (handed case C13). One line, as ConfigError."""
