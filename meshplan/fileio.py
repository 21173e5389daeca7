"""Output files and folders: atomic, never replacing a user's file without ``force``, checked
before the work starts, and leaving nothing behind when interrupted.

- :func:`write_output` (user-facing files): refuses an existing destination unless ``force``;
  writes a temporary file in the destination's folder, then hard-links it to the destination
  (``os.link`` fails when the name exists, so a file created meanwhile is never replaced: no
  check-then-replace race) or, with ``force``, ``os.replace``; a filesystem without hard links
  falls back to an exclusive create (``O_CREAT | O_EXCL``).
- :func:`check_destination`: the same refusal, plus a writable folder (the nearest existing
  ancestor is a folder, writable, with free space) that exists, called by the CLI before
  planning, searching or measuring, so an unwritable destination is a one-line error, not a
  traceback after the work. Missing folders are created only under :data:`OUTPUT_ROOT` (the
  commands' defaults, ``out/memory``, ``out/bench/gemm.csv``); a user's ``-o /nodir/x.args``
  is refused (a typo in a folder name would otherwise make a new tree silently). Files inside a
  command's own output folder (``memory --out DIR``, ``compare --out DIR``, ``launch --out DIR``:
  DIR checked first, its parent existing) pass ``create_folders`` to make DIR.
- :func:`staged_folder` (evidence folders): built under a hidden temporary name beside the
  destination and renamed into place at the end; an exception, Ctrl-C or SIGTERM removes it,
  so an interrupted run leaves nothing that blocks the rerun.
- Re-running a command replaces its own earlier output: under :data:`OUTPUT_ROOT` (where the
  commands' defaults go) a destination meshplan wrote itself, unchanged since (:func:`owned`),
  is replaced as with ``force``; the ledger of what it wrote there is
  :mod:`meshplan.output_ledger`'s.
- Never an input: a destination that is (the same file as) one of the running command's inputs,
  its input arguments or any file it read (:func:`meshplan.fileread.command_inputs`), is refused
  even with ``force`` (:func:`meshplan.fileread.input_clash`); so is a folder that would be replaced whole while it
  holds one.
- Interrupted: the temporary file or folder is removed on any error, Ctrl-C or SIGTERM
  (:func:`meshplan.atomic_write.terminate_raises`).

Every OSError of a write becomes a one-line :class:`~meshplan.errors.ConfigError` naming the
option. Atomic writes of meshplan's own files are :mod:`meshplan.atomic_write`'s; reading
input is :mod:`meshplan.fileread`'s.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from meshplan.atomic_write import FILE_MODE, temp_name, terminate_raises
from meshplan.errors import ConfigError
from meshplan.fileread import input_clash
# LEDGER: the tests import it from here, where it lived before the ledger had its own module
from meshplan.output_ledger import (LEDGER, OUTPUT_ROOT, edited_files, edited_words, ledger_key,  # noqa: F401
                                    owned, remember)



def taken(dest: Path, field: str) -> ConfigError:
    """The refusal to replace ``dest`` (one line, naming ``field``); under ``out/`` it says
    why a rerun's own output would have been replaced and this one is not (:func:`owned`),
    and for a folder the files in it edited since meshplan wrote them (:func:`edited_files`):
    ``out/launch/e exists: job.sbatch was edited since meshplan wrote it; ...``."""
    own = " (meshplan replaces only what it wrote under out/ itself, unchanged since)" if ledger_key(dest) else ""
    return ConfigError(field, f"{dest} exists{edited_words(edited_files(dest), ': ')}; choose another path or pass "
                              f"--force to replace it{own}")


def check_destination(path, field: str = "--out", force: bool = False, folder: bool = False,
                      create_folders: bool = False, replaced: bool = False) -> Path:
    """Refuse, before any work, an output that cannot be written: ``path`` exists and not
    ``force`` (a folder counts only when not empty, ``folder=True``), is a folder where a file
    goes or a file where a folder goes, its nearest existing ancestor is not a writable
    folder with free space, its folder does not exist (unless under :data:`OUTPUT_ROOT` or
    ``create_folders``: a file of a command's own output folder, checked itself), or it is
    ``-`` (stdout: the CLI passes it on only for the options that print there), or it is one of
    the command's inputs, even with ``force`` (a folder ``replaced`` whole: one holding an
    input; :func:`meshplan.fileread.input_clash`). Raises ConfigError naming ``field``; returns the path.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "f"
    >>> _ = f.write_text("x")
    >>> check_destination(f / "out.json", "--json")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --json: cannot write .../f/out.json: .../f is a file, not a folder; choose another path
    """
    dest = Path(path)
    if str(path) == "-":  # Unix tools' stdout: only the options that print there take it (the CLI says which)
        raise ConfigError(field, f"'-' (stdout) is not taken here; give a {'folder' if folder else 'file'} path "
                          f"(./- for one named '-')")
    clash = input_clash(dest, field, replaced)
    if clash is not None:
        raise clash
    if dest.is_dir() and not folder:
        raise ConfigError(field, f"{dest} is a folder; give a file path")
    if folder and dest.exists() and not dest.is_dir():
        raise ConfigError(field, f"{dest} is a file; give a folder path")
    if device(dest) and not folder:  # /dev/null, a FIFO: written through, never replaced
        return dest
    if dest.exists() and not force and not (folder and not any(dest.iterdir())) and not owned(dest):
        raise taken(dest, field)
    anc = dest.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    why = _unwritable(anc)
    if why:
        raise ConfigError(field, f"cannot write {dest}: {why}; choose another path")
    if anc != dest.parent and not create_folders and not (not dest.is_absolute() and dest.parts[:1] == (OUTPUT_ROOT,)):
        raise ConfigError(field, f"cannot write {dest}: folder {dest.parent} does not exist; create it or choose "
                          f"another path")
    return dest


def device(path: Path) -> bool:
    """Whether ``path`` is an existing character device or FIFO (``-o /dev/null``, a named pipe):
    an output meshplan writes through, never refused as taken nor replaced (newcomer trial 53 #8).

    >>> import pathlib
    >>> device(pathlib.Path("/dev/null")), device(pathlib.Path("/"))
    (True, False)
    """
    return path.is_char_device() or path.is_fifo()


def page_folder(path) -> bool:
    """Whether a page's (``report --out``, ``plan --html``) missing folder is made: it is missing
    and its own parent is an existing folder, as ``memory --out DIR``, ``compare --out DIR`` and
    ``launch --out DIR`` make their DIR (newcomer trial 49: ``report --out report/job.html`` was
    refused where ``memory --out report`` made the folder); a deeper missing tree is refused as
    anywhere (a typo in a folder name).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> page_folder(d / "report" / "job.html"), page_folder(d / "a" / "b" / "job.html"), page_folder(d / "j.html")
    (True, False, False)
    """
    parent = Path(path).parent
    return not parent.exists() and parent.parent.is_dir()


def _unwritable(folder: Path) -> str:
    """Why files cannot be made in the existing ``folder`` ("" when they can), from
    ``statvfs``: a read-only mount (``ST_RDONLY``), a pseudo file system with no storage at
    all (``f_blocks`` 0: /proc, /sys, whose "free blocks" are 0 without being full), no write
    permission, or no free block on a real one."""
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        st = os.statvfs(folder)
    except OSError:
        st = None
    if st is not None and st.f_flag & os.ST_RDONLY:
        return f"{folder} is on a read-only file system"
    if st is not None and st.f_blocks == 0:
        return f"{folder} is on a pseudo file system with no storage (such as /proc or /sys)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable (permission denied)"
    if st is not None and (st.f_bfree if os.geteuid() == 0 else st.f_bavail) == 0:
        return f"no space left on the device of {folder}"
    return ""


#: errno -> the cause in words, for a write that failed (:func:`_oserror`).
WRITE_ERRORS = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted", errno.ENOENT: "a folder on the way does not exist",
                errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.ENOTDIR: "a part of the path is a file, not a folder", errno.EISDIR: "it is a folder",
                errno.ENAMETOOLONG: "the name is too long", errno.EEXIST: "it exists"}


def _oserror(dest: Path, field: str, err: OSError) -> ConfigError:
    """One line for a failed write: the errno's cause (:data:`WRITE_ERRORS`, else the OS's words).

    >>> _oserror(Path("/sys/x.json"), "--json", OSError(errno.EROFS, "x")).message
    'cannot write /sys/x.json: read-only file system; choose another path'
    """
    why = WRITE_ERRORS.get(err.errno or 0) or err.strerror or str(err)
    return ConfigError(field, f"cannot write {dest}: {why}; choose another path")


def write_output(path, data: str | bytes, force: bool = False, field: str = "--out", mode: int = FILE_MODE,
                 create_folders: bool = False) -> Path:
    """Write a user-facing output file (text or bytes): refuse (ConfigError naming ``field``)
    to replace an existing file unless ``force``, create the folder, write a temporary file
    with ``mode``, then link it to ``path`` (exclusive: a file that appeared meanwhile is
    refused, never replaced) or, with ``force`` or an output of meshplan's own (:func:`owned`),
    rename it over ``path``, recorded (:func:`remember`). An OSError (read-only folder, full
    disk) is a one-line ConfigError; the temporary file never outlives the call.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
    >>> write_output(p, "{}").read_text()
    '{}'
    >>> write_output(p, "{}")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --out: ... exists; choose another path or pass --force to replace it
    >>> sorted(x.name for x in p.parent.iterdir())
    ['x.json']
    >>> write_output(p.parent / "sub" / "x.json", "{}")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --out: cannot write .../sub/x.json: folder .../sub does not exist; create it or choose another path
    """
    dest = check_destination(path, field, force, create_folders=create_folders)
    force = force or owned(dest)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if device(dest):  # written through: a temporary file renamed over it would replace the device
        try:
            with open(dest, "wb") as f:
                f.write(raw)
        except OSError as err:
            raise _oserror(dest, field, err) from None
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _oserror(dest, field, err) from None
    with terminate_raises():
        tmp = temp_name(dest, ".tmp")  # named before it exists: a signal at any point finds it
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
    remember(dest)
    return dest


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
def staged_folder(out, field: str = "--out", force: bool = False, create_folders: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it to ``out`` at the end.

    Yields a new empty folder beside ``out`` (``.<name>.<random>.partial``). When the block
    ends normally, the folder becomes ``out``: renamed (an existing non-empty ``out`` is
    refused unless ``force`` or meshplan's own, :func:`owned`, then moved aside and removed
    after the rename; the folder is then recorded, :func:`remember`). When the block
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
    dest = check_destination(out, field, force, folder=True, create_folders=create_folders, replaced=True)
    force = force or owned(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _oserror(dest, field, err) from None
    with terminate_raises():
        tmp = temp_name(dest, ".partial")
        try:
            os.mkdir(tmp, 0o755)
            yield tmp
            _install(tmp, dest, field, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    remember(dest)


def _install(tmp: Path, dest: Path, field: str, force: bool) -> None:
    """Rename ``tmp`` to ``dest``; an empty ``dest`` is replaced, a non-empty one only with
    ``force`` (moved aside first, removed after)."""
    old = None
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if not force:
            raise taken(dest, field)
        old = temp_name(dest, ".old")
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
