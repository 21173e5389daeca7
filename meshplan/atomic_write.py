"""Atomic writes of meshplan's own files (evidence, calibration, checkpoints' metadata, the
outputs ledger) and the cleanup of temporaries when interrupted.

- :func:`write_text_atomic`, :func:`write_json_atomic`: a temporary file in the destination's
  folder, fsync, then ``os.replace`` (atomic on POSIX); the file is 0644 (:data:`FILE_MODE`).
- :func:`terminate_raises`: while a temporary file or folder exists, SIGTERM raises
  :class:`Terminated` (exit status 143 = 128 + SIGTERM, as the default action reports) so the
  cleanup runs as it does for SIGINT's KeyboardInterrupt.
- :func:`temp_name`: the hidden name of such a temporary, beside its destination.

User-facing outputs, refused when they exist, are :mod:`meshplan.fileio`'s.

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
import secrets
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

#: Mode of every file meshplan writes (rw-r--r--), whatever mkstemp created.
FILE_MODE = 0o644


class Terminated(SystemExit):
    """SIGTERM arrived while a temporary output existed; exit status 143 (128 + 15)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextmanager
def terminate_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` (so ``finally`` and ``except``
    clauses clean up, as for Ctrl-C); the previous handler comes back afterwards. A no-op off
    the main thread (Python runs signal handlers there only), when SIGTERM is ignored, or when
    another Python handler is installed (an outer block already raises)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def temp_name(dest: Path, suffix: str) -> Path:
    """A fresh hidden name beside ``dest``: ``.<name>.<12 random hex digits><suffix>`` (48
    random bits; created exclusively by the caller)."""
    return dest.parent / f".{dest.name}.{secrets.token_hex(6)}{suffix}"


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, fsync, then
    ``os.replace`` (atomic on POSIX; replaces an existing file: for files of the program's own
    evidence folders). The folder must exist. The temporary file is removed on any error,
    Ctrl-C or SIGTERM. The file is 0644 (:data:`FILE_MODE`). Returns the path."""
    p = Path(path)
    with terminate_raises():
        tmp = temp_name(p, ".tmp")
        try:
            with open(tmp, "x", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fchmod(f.fileno(), FILE_MODE)  # whatever the umask: reports and evidence readable by all
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return p


def write_json_atomic(path, doc: Any) -> Path:
    """``doc`` as indented, key-sorted JSON, written with :func:`write_text_atomic`."""
    return write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
