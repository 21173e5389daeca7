"""The ``--json`` document of a malformed input (schema ``meshplan.error/v1``, file
``meshplan/schemas/error.v1.schema.json``): written by :func:`meshplan.cli._run_app`, the one place
the CLI catches input errors, beside the ``error: <field>: <message>`` line on stderr, so a CI gate
that passed ``--json PATH`` (or ``--json -``) reads the refusal as JSON (newcomer trial 55 #8).

The document, for ``meshplan step bad.toml --json out.json`` with a misspelt key::

    {"schema": "meshplan.error/v1", "meshplan_version": "...", "command": "step", "exit_code": 2,
     "error": {"field": "training.global_bach", "message": "unknown key in [training]",
               "fix": "did you mean global_batch?",
               "line": "error: training.global_bach: unknown key in [training]; did you mean global_batch?"},
     "errors": [<the same object; one per line where several inputs were refused at once>]}

``message`` and ``fix`` split the one line by meshplan's convention for a ConfigError,
``<field>: <what is wrong>; <fix>`` (:class:`meshplan.errors.ConfigError`): ``fix`` is the part after
the first ``; `` outside brackets and quotes (a leading ``fix: `` dropped), null where the message
has none; ``line`` is the stderr line exactly. What the document is written to follows the rules of
the command's own ``--json`` output (:func:`meshplan.fileio.write_output`): an existing file is
replaced only with ``--force`` (where the command takes it) and never when it is another argument of
the command line (an input); an error about ``--json`` itself writes nothing.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from meshplan import __version__
from meshplan.errors import ConfigError
from meshplan.fileio import write_output
from meshplan.report.json_docs import to_json

#: The ``schema`` of the document.
SCHEMA = "meshplan.error/v1"

#: Command groups whose commands are named ``<group>-<command>`` in the documents (bench-gemm).
GROUPS = ("testbed", "bench")

_OPEN, _CLOSE = "([{", ")]}"


def split_fix(message: str) -> tuple[str, Optional[str]]:
    """``(what is wrong, fix)`` of a ConfigError's message: split at the first ``; `` outside
    brackets and quotes, a leading ``fix: `` dropped; ``(message, None)`` where there is none.

    >>> split_fix("unknown key in [training]; did you mean global_batch?")
    ('unknown key in [training]', 'did you mean global_batch?')
    >>> split_fix("tp 3 does not divide 512 (a; b); fix: tp 1, 2 or 4")
    ('tp 3 does not divide 512 (a; b)', 'tp 1, 2 or 4')
    >>> split_fix("no such file")
    ('no such file', None)
    """
    depth, quote = 0, ""
    for i, ch in enumerate(message):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"" and (i == 0 or not message[i - 1].isalnum()):  # not an apostrophe (cluster's)
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(depth - 1, 0)
        elif depth == 0 and message.startswith("; ", i):
            fix = message[i + 2:].strip()
            return message[:i], (fix[len("fix: "):] if fix.startswith("fix: ") else fix) or None
    return message, None


def error_entry(field: str, message: str, prefix: str = "error") -> dict[str, Any]:
    """One refusal as the document's ``error`` object (field, message, fix, line; module docstring);
    ``prefix`` the stderr line's first word (``infeasible`` for a foreign reader's exit 1)."""
    what, fix = split_fix(message)
    return {"field": field, "message": what, "fix": fix, "line": f"{prefix}: {field}: {message}"}


def error_doc(command: str, errors: Sequence[tuple[str, str]], exit_code: int = 2) -> dict[str, Any]:
    """The ``meshplan.error/v1`` document of ``command`` (``step``, ``bench-gemm``) refusing
    ``errors`` (``(field, message)`` each, in the order printed), which exit ``exit_code``.

    >>> d = error_doc("plan", [("--nodes", "0 is outside 1..100000")])
    >>> d["error"], d["exit_code"], len(d["errors"])
    ({'field': '--nodes', 'message': '0 is outside 1..100000', 'fix': None, 'line': 'error: --nodes: 0 is outside 1..100000'}, 2, 1)
    """
    prefix = "infeasible" if exit_code == 1 else "error"  # meshplan.errors.InfeasibleInput: exit 1
    entries = [error_entry(f, m, prefix) for f, m in errors]
    return {"schema": SCHEMA, "meshplan_version": __version__, "command": command, "exit_code": exit_code,
            "error": entries[0], "errors": entries}


def config_errors(e: ConfigError) -> list[tuple[str, str]]:
    """``(field, message)`` of each line the CLI prints for ``e`` (a ConfigErrors: one each)."""
    return [(one.field, one.message) for one in getattr(e, "errors", [e])]


def json_request(argv: Sequence[str], root) -> Optional[tuple[str, str, bool]]:
    """``(command, json path, force)`` where ``argv`` asks a command of ``root`` (the app's click
    group, ``typer.main.get_command(app)``) that takes ``--json`` for a
    document (``--json PATH`` or ``--json=PATH``; the last one given, as click takes it); None
    where it does not, or names no such command. ``force``: ``--force`` is given and the command
    takes it.

    >>> import typer.main; from meshplan.cli import app; root = typer.main.get_command(app)
    >>> json_request(["step", "a.toml", "--json", "o.json"], root), json_request(["bench", "gemm", "--json=-", "--force"], root)
    (('step', 'o.json', False), ('bench-gemm', '-', True))
    >>> [json_request(a, root) for a in (["step", "a.toml"], ["nosuch", "--json", "x"], ["step", "--json"])]
    [None, None, None]
    """
    command, opts = _leaf(argv, root)
    if command is None or "--json" not in opts:
        return None
    path = None
    for i, a in enumerate(argv):
        if a == "--json" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--json="):
            path = a[len("--json="):]
    if path is None or not path or (path.startswith("-") and path != "-"):
        return None
    return command, path, "--force" in opts and "--force" in argv


def _leaf(argv: Sequence[str], root) -> tuple[Optional[str], set[str]]:
    """The document name of the command of ``root`` that ``argv`` runs and its option names;
    (None, set()) where ``argv`` names none."""
    words = [a for a in argv[:2] if not a.startswith("-")]
    cmd = root
    for depth, word in enumerate(words):
        sub = getattr(cmd, "commands", {}).get(word)
        if sub is None:
            return None, set()
        cmd = sub
        if word not in GROUPS or depth:
            name = "-".join(words[:depth + 1])
            return name, {o for p in cmd.params for o in getattr(p, "opts", ())}
    return None, set()


def write_error_doc(argv: Sequence[str], root, errors: Sequence[tuple[str, str]], exit_code: int = 2) -> None:
    """Write the error document where ``argv`` asked a command of ``root`` for ``--json`` (:func:`json_request`), by
    the rules of the module docstring; nothing where it did not, where the error is ``--json``'s
    own, or where the path may not be written (existing without ``--force``, an input, an
    unwritable folder: the ``error:`` line on stderr stays the one report)."""
    asked = json_request(argv, root)
    if asked is None or any(f == "--json" for f, _ in errors):
        return
    command, path, force = asked
    text = to_json(error_doc(command, errors, exit_code))
    if path == "-":
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.write(text)
            sys.stdout.flush()
        return
    dest = Path(path)
    if dest.exists() and (not force or _is_argument(dest, argv)):
        return
    with contextlib.suppress(ConfigError):
        write_output(dest, text, force, "--json")


def _is_argument(dest: Path, argv: Sequence[str]) -> bool:
    """Whether ``dest`` is the same file as a word of the command line other than a ``--json``
    value (an input: the CONFIG, a --topology file), which no output replaces, --force or not."""
    for i, a in enumerate(argv):
        if i and argv[i - 1] == "--json":
            continue
        with contextlib.suppress(OSError, ValueError):
            if Path(a).exists() and Path(a).samefile(dest):
                return True
    return False
