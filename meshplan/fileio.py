"""Atomic file writes (a reader sees the old file or the whole new one, never a part), and
bounded reads of input files (regular files only, a size limit, UTF-8).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_text_atomic(d / "a.txt", "hello\\n").read_text()
'hello\\n'
>>> sorted(p.name for p in d.iterdir())
['a.txt']
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from meshplan.errors import ConfigError
from meshplan.limits import FileLimit


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


def write_output(path, text: str, force: bool = False, field: str = "--out", mode: int = 0o644) -> Path:
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


# --------------------------------------------------------------------------- reading input

_BOMS = ((b"\xef\xbb\xbf", None), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
         (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


def read_bytes_limited(path, field: str, limit: int | FileLimit, hint: str = "check the path") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them. Anything else is
    a one-line ConfigError naming ``field`` and the path: no such file, a directory, a FIFO,
    device or socket (never opened for reading, so a FIFO cannot block and ``/dev/zero``
    cannot fill memory), a symlink loop, a path with a NUL or too long, a file over
    ``limit`` bytes (:data:`meshplan.limits.FILE_BYTES` gives each reader's limit and reason).
    ``hint`` ends the message of a path that cannot be read.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> read_bytes_limited(d, "config", 100)
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: config: '...' is a directory, not a file; check the path
    >>> read_bytes_limited("/dev/zero", "config", 100)
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: config: '/dev/zero' is not a regular file (a device, FIFO or socket); give a file
    """
    name = os.fspath(path)
    max_bytes, why = (limit.value, limit.reason) if isinstance(limit, FileLimit) else (limit, "")
    if "\0" in name:
        raise ConfigError(field, f"{name!r}: a path cannot contain a NUL character; {hint}")
    if len(name) > 4096:
        raise ConfigError(field, f"a path of {len(name)} characters is over Linux's PATH_MAX (4096); {hint}")
    try:
        st = os.stat(name)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(field, f"{name!r} is a directory, not a file; {hint}")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(field, f"{name!r} is not a regular file (a device, FIFO or socket); give a file")
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the stat and the open
                raise ConfigError(field, f"{name!r} is not a regular file; give a file")
            chunks, left = [], max_bytes + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise ConfigError(field, f"no such file {name!r}; {hint}") from None
    except OSError as err:
        why = {errno.ELOOP: "a symlink loop", errno.ENAMETOOLONG: "a name too long",
               errno.ENOTDIR: "a path through a file"}.get(err.errno or 0, err.strerror or "unreadable")
        raise ConfigError(field, f"cannot read {name!r} ({why}); {hint}") from None
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ConfigError(field, f"{name!r} is larger than {max_bytes} bytes, the limit for this input"
                                 f"{f' ({why})' if why else ''}; give the file the tool wrote")
    return data


def decode_text(data: bytes, field: str, name: str, errors: str = "strict") -> str:
    """``data`` as UTF-8 (a UTF-8 byte-order mark dropped); UTF-16/32 or any other bytes are a
    one-line ConfigError naming the offset and asking for UTF-8. ``errors="replace"`` (logs,
    where other programs' bytes may mix in) keeps only the UTF-16/32 check.

    >>> decode_text("[a]".encode("utf-16"), "config", "c.toml")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: config: 'c.toml' is UTF-16 text (byte-order mark); save it as UTF-8
    """
    for bom, enc in _BOMS:
        if data.startswith(bom):
            if enc:
                raise ConfigError(field, f"{name!r} is {enc} text (byte-order mark); save it as UTF-8")
            data = data[len(bom):]
            break
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(field, f"{name!r} is not UTF-8 text (byte {data[err.start]:#04x} at line {line}, "
                                 f"offset {err.start}); save it as UTF-8") from None


def read_text_limited(path, field: str, limit: int | FileLimit, hint: str = "check the path",
                      errors: str = "strict") -> str:
    """:func:`read_bytes_limited` then :func:`decode_text`: the one way every reader opens its
    input (configs, HF config.json, topologies, NCCL logs, calibration, nccl-tests output,
    GEMM and attention tables)."""
    return decode_text(read_bytes_limited(path, field, limit, hint), field, os.fspath(path), errors)


def parse_json(text: str, field: str, name: str, hint: str) -> Any:
    """``json.loads(text)`` with every failure one ConfigError naming ``field``, the file
    ``name`` and its line, and ending with ``hint``: syntax, NaN and Infinity (not JSON
    numbers), integers past Python's 4,300-digit limit, nesting past the interpreter's
    recursion limit.

    >>> parse_json('{"a": NaN}', "t", "t.json", "fix it")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: t: t.json: NaN is not a JSON number; fix it
    """

    def constant(word: str):
        raise ValueError(f"{word} is not a JSON number")

    try:
        return json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as err:
        raise ConfigError(field, f"{name}:{err.lineno}: invalid JSON ({err.msg}); {hint}") from None
    except RecursionError:
        raise ConfigError(field, f"{name}: nested too deeply to read; {hint}") from None
    except ValueError as err:
        raise ConfigError(field, f"{name}: {str(err).splitlines()[0][:120]}; {hint}") from None
