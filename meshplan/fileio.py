"""Output files and folders: atomic, never replacing a user's file without ``force``, checked
before the work starts, and leaving nothing behind when interrupted.

- :func:`write_output` (user-facing files): refuses an existing destination unless ``force``;
  writes a temporary file in the destination's folder, then hard-links it to the destination
  (``os.link`` fails when the name exists, so a file created meanwhile is never replaced: no
  check-then-replace race) or, with ``force``, ``os.replace``; a filesystem without hard links
  falls back to an exclusive create (``O_CREAT | O_EXCL``).
- :func:`check_destination`: the same refusal, plus a writable folder (the nearest existing
  ancestor is a folder, writable, with free space), called by the CLI before planning,
  searching or measuring, so an unwritable destination is a one-line error, not a traceback
  after the work.
- :func:`staged_folder` (evidence folders): built under a hidden temporary name beside the
  destination and renamed into place at the end; an exception, Ctrl-C or SIGTERM removes it,
  so an interrupted run leaves nothing that blocks the rerun.
- :func:`terminate_raises`: while a temporary file or folder exists, SIGTERM raises
  :class:`Terminated` (exit status 143 = 128 + SIGTERM, as the default action reports) so the
  cleanup runs as it does for SIGINT's KeyboardInterrupt.

Every OSError of a write becomes a one-line :class:`~meshplan.errors.ConfigError` naming the
option.

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
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from meshplan.errors import ConfigError

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


def taken(dest: Path, field: str) -> ConfigError:
    """The refusal to replace ``dest`` (one line, naming ``field``)."""
    return ConfigError(field, f"{dest} exists; choose another path or pass --force to replace it")


def check_destination(path, field: str = "--out", force: bool = False, folder: bool = False) -> Path:
    """Refuse, before any work, an output that cannot be written: ``path`` exists and not
    ``force`` (a folder counts only when not empty, ``folder=True``), is a folder where a file
    goes or a file where a folder goes, or its nearest existing ancestor is not a writable
    folder with free space. Raises ConfigError naming ``field``; returns the path.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "f"
    >>> _ = f.write_text("x")
    >>> check_destination(f / "out.json", "--json")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --json: cannot write .../f/out.json: .../f is a file, not a folder; choose another path
    """
    dest = Path(path)
    if dest.is_dir() and not folder:
        raise ConfigError(field, f"{dest} is a folder; give a file path")
    if folder and dest.exists() and not dest.is_dir():
        raise ConfigError(field, f"{dest} is a file; give a folder path")
    if dest.exists() and not force and not (folder and not any(dest.iterdir())):
        raise taken(dest, field)
    anc = dest.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    why = (f"{anc} is a file, not a folder" if not anc.is_dir() else
           f"{anc} is not writable" if not os.access(anc, os.W_OK | os.X_OK) else
           f"no space left on the device of {anc}" if _no_space(anc) else "")
    if why:
        raise ConfigError(field, f"cannot write {dest}: {why}; choose another path")
    return dest


def _no_space(folder: Path) -> bool:
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) == 0


def _oserror(dest: Path, field: str, err: OSError) -> ConfigError:
    return ConfigError(field, f"cannot write {dest}: {err.strerror or err}; choose another path")


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, fsync, then
    ``os.replace`` (atomic on POSIX; replaces an existing file: for files of the program's own
    evidence folders). The folder must exist. The temporary file is removed on any error,
    Ctrl-C or SIGTERM. The file is 0644 (:data:`FILE_MODE`). Returns the path."""
    p = Path(path)
    with terminate_raises():
        tmp = _temp_name(p, ".tmp")
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


def write_output(path, data: str | bytes, force: bool = False, field: str = "--out", mode: int = FILE_MODE) -> Path:
    """Write a user-facing output file (text or bytes): refuse (ConfigError naming ``field``)
    to replace an existing file unless ``force``, create the folder, write a temporary file
    with ``mode``, then link it to ``path`` (exclusive: a file that appeared meanwhile is
    refused, never replaced) or, with ``force``, rename it over ``path``. An OSError (read-only
    folder, full disk) is a one-line ConfigError; the temporary file never outlives the call.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "sub" / "x.json"
    >>> write_output(p, "{}").read_text()
    '{}'
    >>> write_output(p, "{}")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --out: ... exists; choose another path or pass --force to replace it
    >>> sorted(x.name for x in p.parent.iterdir())
    ['x.json']
    """
    dest = check_destination(path, field, force)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _oserror(dest, field, err) from None
    with terminate_raises():
        tmp = _temp_name(dest, ".tmp")  # named before it exists: a signal at any point finds it
        try:
            with open(tmp, "xb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
                os.fchmod(f.fileno(), mode)
            if force:
                os.replace(tmp, dest)
            else:
                _link_new(tmp, dest, field, raw, mode)
        except OSError as err:
            raise _oserror(dest, field, err) from None
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def _temp_name(dest: Path, suffix: str) -> Path:
    """A fresh hidden name beside ``dest``: ``.<name>.<12 random hex digits><suffix>`` (48
    random bits; created exclusively by the caller)."""
    return dest.parent / f".{dest.name}.{secrets.token_hex(6)}{suffix}"


def _link_new(tmp: Path, dest: Path, field: str, raw: bytes, mode: int) -> None:
    """Give ``tmp`` the name ``dest`` only if no file has it: a hard link, or on a filesystem
    without hard links an exclusive create written in place."""
    try:
        os.link(tmp, dest)
        return
    except FileExistsError:
        raise taken(dest, field) from None
    except OSError:
        pass  # no hard links here (EPERM, ENOTSUP...): exclusive create
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise taken(dest, field) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


@contextmanager
def staged_folder(out, field: str = "--out", force: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it to ``out`` at the end.

    Yields a new empty folder beside ``out`` (``.<name>.<random>.partial``). When the block
    ends normally, the folder becomes ``out``: renamed (an existing non-empty ``out`` is
    refused unless ``force``, then moved aside and removed after the rename). When the block
    raises (an error, Ctrl-C, SIGTERM), the temporary folder is removed and ``out`` is left as
    it was, so a rerun is not blocked.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with staged_folder(d / "ev") as tmp:
    ...     _ = (tmp / "a.txt").write_text("x")
    >>> sorted(p.name for p in d.iterdir()), (d / "ev" / "a.txt").read_text()
    (['ev'], 'x')
    >>> try:
    ...     with staged_folder(d / "ev2") as tmp:
    ...         raise KeyboardInterrupt
    ... except KeyboardInterrupt:
    ...     pass
    >>> sorted(p.name for p in d.iterdir())
    ['ev']
    """
    dest = check_destination(out, field, force, folder=True)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _oserror(dest, field, err) from None
    with terminate_raises():
        tmp = _temp_name(dest, ".partial")
        try:
            os.mkdir(tmp, 0o755)
            yield tmp
            _install(tmp, dest, field, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _install(tmp: Path, dest: Path, field: str, force: bool) -> None:
    """Rename ``tmp`` to ``dest``; an empty ``dest`` is replaced, a non-empty one only with
    ``force`` (moved aside first, removed after)."""
    old = None
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if not force:
            raise taken(dest, field)
        old = _temp_name(dest, ".old")
        os.mkdir(old, 0o700)
        os.replace(dest, old / dest.name)
    try:
        os.replace(tmp, dest)  # onto a missing name or an empty folder only
    except OSError as err:
        if old is not None:
            os.replace(old / dest.name, dest)
        raise (taken(dest, field) if dest.exists() else _oserror(dest, field, err)) from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
