"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_text_atomic(d / "a.txt", "hello\\n").read_text()
'hello\\n'
>>> sorted(p.name for p in d.iterdir())
['a.txt']
>>> oct((d / "a.txt").stat().st_mode & 0o777)
'0o644'
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from meshplan.errors import ConfigError

#: Mode of every file meshplan writes (rw-r--r--), whatever mkstemp created.
FILE_MODE = 0o644


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, fsync, then
    ``os.replace`` (atomic on POSIX). The folder must exist. The file is 0644 (owner writes,
    everyone reads: mkstemp's own 0600 would hide reports and evidence from other users).
    Returns the path."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def write_json_atomic(path, doc: Any) -> Path:
    """``doc`` as indented, key-sorted JSON, written with :func:`write_text_atomic`."""
    return write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def write_output(path, text: str, force: bool = False, field: str = "--out", mode: int = FILE_MODE) -> Path:
    """Write a user-facing output file: refuse (ConfigError naming ``field``) to replace an
    existing file unless ``force``, create the folder, write atomically with ``mode``.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "sub" / "x.json"
    >>> write_output(p, "{}").read_text()
    '{}'
    >>> write_output(p, "{}")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --out: ... exists; choose another path or pass --force to replace it
    """

    dest = Path(path)
    if dest.exists() and not force:
        raise ConfigError(field, f"{dest} exists; choose another path or pass --force to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(dest, text)
    os.chmod(dest, mode)
    return dest
