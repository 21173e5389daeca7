"""The ledger of what meshplan wrote under :data:`OUTPUT_ROOT`, so that re-running a command
replaces its own earlier output: every file and folder meshplan writes there is recorded in
:data:`LEDGER` with a SHA-256 digest of its bytes (a folder: of its files' names and bytes);
a destination whose digest matches its record (:func:`owned`) is replaced as with ``force``
(:mod:`meshplan.fileio`). A file meshplan did not write there, or one changed since, is
refused as anywhere else, and nothing outside ``out/`` (a path the user named) is ever replaced
without ``force``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from meshplan.atomic_write import write_json_atomic
from meshplan.errors import ConfigError
from meshplan.fileread import read_bytes_limited

#: The relative folder under which missing folders are created (the commands' default outputs).
OUTPUT_ROOT = "out"

#: The ledger of what meshplan wrote under :data:`OUTPUT_ROOT` (``out/.meshplan-written.json``):
#: ``{path below out/: "sha256:<hex>"}``; a hidden name, so no command's output lists it.
LEDGER = ".meshplan-written.json"


def edited_files(folder: Path) -> list[str]:
    """The files under ``folder`` (names below it, sorted) that meshplan wrote under ``out/``
    itself, each recorded in :data:`LEDGER` (:func:`remember`), whose bytes changed since;
    [] for a path outside ``out/``, a file, or a folder none of whose recorded files changed
    (a file added to it is not listed: files written inside an evidence folder under its
    temporary name have no record of their own)."""
    key = ledger_key(Path(folder))
    if key is None or not Path(folder).is_dir():
        return []
    return sorted(k[len(key) + 1:] for k, digest in _ledger().items()
                  if k.startswith(key + "/") and (Path(OUTPUT_ROOT) / k).is_file()
                  and _digest(Path(OUTPUT_ROOT) / k) != digest)


def edited_words(names: list[str], lead: str = "") -> str:
    """``names`` (:func:`edited_files`) in words, after ``lead``; "" for none.

    >>> edited_words(["job.sbatch"]), edited_words(["bind.sh", "job.sbatch", "torchrun.sh"], ": ")
    ('job.sbatch was edited since meshplan wrote it', ': bind.sh, job.sbatch and torchrun.sh were edited since meshplan wrote them')
    """
    if not names:
        return ""
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{lead}{listed} {'was' if len(names) == 1 else 'were'} edited since meshplan wrote " \
           f"{'it' if len(names) == 1 else 'them'}"


def ledger_key(dest: Path) -> str | None:
    """``dest``'s key in :data:`LEDGER`: its path below ``out/`` when ``dest`` is a relative
    path under :data:`OUTPUT_ROOT` with no hidden part (temporary names, the ledger); else None.

    >>> ledger_key(Path("out/memory/a.png")), ledger_key(Path("/tmp/out/a.png")), ledger_key(Path("out/.a.x.tmp"))
    ('memory/a.png', None, None)
    """
    parts = dest.parts
    if dest.is_absolute() or len(parts) < 2 or parts[0] != OUTPUT_ROOT:
        return None
    return None if any(p.startswith(".") for p in parts[1:]) else "/".join(parts[1:])


def _digest(path: Path) -> str | None:
    """``sha256:<hex>`` of a file's bytes, or of a folder's files (relative name, NUL, the
    file's own digest, in name order); None when ``path`` is neither or cannot be read."""
    h = hashlib.sha256()
    try:
        if path.is_file():
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        elif path.is_dir():
            for sub in sorted(x for x in path.rglob("*") if x.is_file()):
                h.update(f"{sub.relative_to(path).as_posix()}\0{_digest(sub)}\0".encode())
        else:
            return None
    except OSError:
        return None
    return f"sha256:{h.hexdigest()}"


def _ledger() -> dict[str, str]:
    """The records of :data:`LEDGER` ({} when missing, unreadable or not meshplan's)."""
    try:
        doc = json.loads(read_bytes_limited(Path(OUTPUT_ROOT) / LEDGER, "ledger", 16 << 20))
    except (ConfigError, ValueError, RecursionError):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, str)} if isinstance(doc, dict) else {}


def owned(path) -> bool:
    """True when meshplan wrote ``path`` under ``out/`` itself and nobody changed it since: its
    digest is the one :data:`LEDGER` records (:func:`remember`). Only such an output is
    replaced without ``force``, so re-running a command with its default output works.

    >>> owned(Path("/etc/hostname"))
    False
    """
    key = ledger_key(Path(path))
    digest = _digest(Path(path)) if key is not None else None
    return digest is not None and _ledger().get(key or "") == digest


def remember(path) -> None:
    """Record ``path`` (a file or folder meshplan just wrote under ``out/``) in :data:`LEDGER`,
    dropping records of paths gone since; nothing for a path elsewhere. A record that cannot
    be written is skipped (the rerun is then refused, never a file lost)."""
    p = Path(path)
    key, digest = ledger_key(p), _digest(p)
    if key is None or digest is None:
        return
    book = {k: v for k, v in _ledger().items() if (Path(OUTPUT_ROOT) / k).exists()}
    book[key] = digest
    try:
        write_json_atomic(Path(OUTPUT_ROOT) / LEDGER, book)
    except OSError:
        pass
