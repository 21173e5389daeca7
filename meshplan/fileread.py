"""Reading input: bounded reads of input files (regular files only, a size limit, UTF-8) and
JSON parsed with every failure one line. :func:`read_text_limited` (or
:func:`read_bytes_limited`) is the one way every reader opens its input; :func:`parse_json` the
one way a JSON input is parsed. Every failure is a one-line
:class:`~meshplan.errors.ConfigError` naming the field and the file.

Inside :func:`command_inputs` (the CLI runs every command in it) each file read is noted with
the field it was read as, beside the command's own input arguments, so that
:func:`meshplan.fileio.check_destination` refuses an output that is one of them (:func:`input_clash`), ``--force``
or not (newcomer trial 23 #1: ``step job.sh --json job.sh --force`` replaced the launch script).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterable, Iterator

import hjson as hjson_lib

from meshplan.errors import ConfigError
from meshplan.limits import FileLimit

_BOMS = ((b"\xef\xbb\xbf", None), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
         (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


#: The running command's inputs, ``[(path, what it is)]``: its input arguments first, then every
#: file read (:func:`read_bytes_limited`); None outside :func:`command_inputs`. A context variable
#: set and reset by :func:`command_inputs` only, so one command's files never leak into another's.
_INPUTS: ContextVar[list[tuple[str, str]] | None] = ContextVar("meshplan_command_inputs", default=None)


@contextmanager
def command_inputs(named: Iterable[tuple[Any, str]] = ()) -> Iterator[list[tuple[str, str]]]:
    """Note, for the block, the command's inputs: ``named`` ((path, its name on the command line:
    ``CONFIG``, ``--topology``)) and every file the block reads; yields that list.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "job.sh"
    >>> _ = f.write_text("x")
    >>> with command_inputs([("a.toml", "CONFIG")]) as seen:
    ...     _ = read_bytes_limited(f, "config", 100)
    >>> [(pathlib.Path(p).name, what) for p, what in seen]
    [('a.toml', 'CONFIG'), ('job.sh', 'config')]
    """
    seen = [(os.fspath(p), what) for p, what in named]
    token = _INPUTS.set(seen)
    try:
        yield seen
    finally:
        _INPUTS.reset(token)


def note_input(path, what: str) -> None:
    """Name ``path`` an input of the running command as ``what`` (``the [source] of job.toml``)
    before it is read, so that an output refused for being it says so; nothing outside
    :func:`command_inputs`."""
    seen = _INPUTS.get()
    if seen is not None:
        seen.append((os.fspath(path), what))


def inputs_read() -> list[tuple[str, str]]:
    """The running command's inputs so far (:func:`command_inputs`); [] outside one."""
    return list(_INPUTS.get() or [])


def _same_file(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` are one file (``os.path.samefile``: the same device and inode,
    through symlinks and hard links), else when their resolved paths are equal."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def input_clash(dest: Path, field: str, replaced: bool = False) -> ConfigError | None:
    """The refusal of an output ``dest`` that is one of the running command's inputs
    (:func:`meshplan.fileread.inputs_read`: CONFIG, --topology, --calibration, --kernels, the
    logs read, a config's [source] file), or, when ``replaced`` (a folder replaced whole), a
    folder holding one; None when it is none of them. ``--force`` does not lift it.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "job.sh"
    >>> _ = f.write_text("x")
    >>> with command_inputs([(f, "CONFIG")]):
    ...     print(input_clash(f, "--json").message, input_clash(f.parent, "--out", replaced=True) is None)
    choose another path: --json is the CONFIG being read (.../job.sh; --force never replaces an input) False
    """
    if not dest.exists():
        return None
    for name, what in inputs_read():
        src = Path(name)
        if not src.exists():
            continue
        if _same_file(dest, src):
            return ConfigError(field, f"choose another path: {field} is the {what} being read ({dest}; --force "
                                      f"never replaces an input)")
        if replaced and dest.is_dir() and src.resolve().is_relative_to(dest.resolve()):
            return ConfigError(field, f"choose another folder: {field} {dest} holds {src}, the {what} being read, "
                                      f"and would be replaced whole")
    return None


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
    seen = _INPUTS.get()
    if seen is not None:
        seen.append((name, field))
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


def parse_json(text: str, field: str, name: str, hint: str, unique_keys: bool = False, hjson: bool = False) -> Any:
    """``json.loads(text)`` with every failure one ConfigError naming ``field``, the file
    ``name`` and its line, and ending with ``hint``: syntax, NaN and Infinity (not JSON
    numbers), integers past Python's 4,300-digit limit, nesting past the interpreter's
    recursion limit. ``unique_keys`` (a config a person edits): a key given twice in one
    object is a ConfigError naming its dotted path (``json`` keeps the last one silently).
    ``hjson`` (a DeepSpeed config): a text that is not JSON is read with ``hjson.loads`` as
    DeepSpeed reads its config (deepspeedai/DeepSpeed at edaa722, runtime/config.py
    ``DeepSpeedConfig.__init__``: ``hjson.load(open(config, "r"),
    object_pairs_hook=dict_raise_error_on_duplicate_keys)``), so ``//`` and ``#`` comments and
    trailing commas are taken as DeepSpeed takes them. Plain JSON is read by ``json`` first: hjson
    turns a whole float into an int (``1.0`` -> 1), which would read as a changed value on export.

    >>> parse_json('{"a": 1, // a comment\\n "b": [2, 3,],}', "t", "t.json", "fix it", True, hjson=True)
    {'a': 1, 'b': [2, 3]}

    >>> parse_json('{"a": NaN}', "t", "t.json", "fix it")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: t: t.json: NaN is not a JSON number; fix it
    >>> parse_json('{"z": {"stage": 1, "stage": 3}}', "t", "t.json", "fix it", unique_keys=True)
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: z.stage: given twice in t.json (JSON readers keep the last one silently); keep one
    """

    def constant(word: str):
        raise ValueError(f"{word} is not a JSON number")

    hook = _KeyCheck if unique_keys else None
    try:
        try:
            doc = json.loads(text, parse_constant=constant, object_pairs_hook=hook)
        except json.JSONDecodeError:
            if not hjson:
                raise
            doc = hjson_lib.loads(text, object_pairs_hook=hook or dict)
    except (json.JSONDecodeError, hjson_lib.HjsonDecodeError) as err:
        what = "invalid JSON, nor Hjson (DeepSpeed's reader)" if hjson else "invalid JSON"
        raise ConfigError(field, f"{name}:{err.lineno}: {what} ({err.msg}); {hint}") from None
    except OverflowError as err:  # hjson: 1e999
        raise ConfigError(field, f"{name}: a number out of range ({err}); {hint}") from None
    except RecursionError:
        raise ConfigError(field, f"{name}: nested too deeply to read; {hint}") from None
    except ValueError as err:
        raise ConfigError(field, f"{name}: {str(err).splitlines()[0][:120]}; {hint}") from None
    twice = _given_twice(doc, "") if unique_keys else None
    if twice is not None:
        raise ConfigError(twice, f"given twice in {name} (JSON readers keep the last one silently); keep one")
    return doc


class _KeyCheck(dict):
    """A JSON object as ``json``'s ``object_pairs_hook`` builds it, remembering the first key
    given twice in it (``twice``, None when every key is given once)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.twice: str | None = None
        seen: set[str] = set()
        for k, _ in pairs if len(self) < len(pairs) else ():
            if k in seen:
                self.twice = k
                break
            seen.add(k)


def _given_twice(doc: Any, path: str) -> str | None:
    """The dotted path (``[i]`` for list items) of the first key given twice in ``doc``
    (objects built by :class:`_KeyCheck`), in document order; None when there is none."""
    if isinstance(doc, _KeyCheck) and doc.twice is not None:
        return f"{path}.{doc.twice}" if path else doc.twice
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        hit = _given_twice(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else k)
        if hit is not None:
            return hit
    return None
