"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_text_atomic(d / "a.txt", "hello\\n").read_text()
'hello\\n'
>>> sorted(p.name for p in d.iterdir())
['a.txt']
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, fsync, then
    ``os.replace`` (atomic on POSIX). The folder must exist. Returns the path."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
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
