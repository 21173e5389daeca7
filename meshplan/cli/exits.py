"""How :func:`meshplan.cli.main` ends when a command does not: a usage error of click as one
line ``error: <option>: ...`` (exit 2), and a stdout closed by its reader as
:data:`EXIT_PIPE_CLOSED` (141) with nothing on stderr."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

import typer

from meshplan.errors import printable


# typer raises click's UsageError (BadParameter's base); typer >= 0.2x vendors click, so the
# class is taken from the public BadParameter rather than imported from either package.
_USAGE_ERROR: Any = typer.BadParameter.__mro__[1]  # click's UsageError (show(), exit_code)


def _usage_line(e, argv: Sequence[str] = ()) -> Optional[str]:
    """A one-line ``error: <option>: <what is wrong>`` for a usage error whose message is one
    line (a value that does not parse, a missing or unknown option); None for the help text
    shown when a group is called without a command. A number that does not parse is said in
    meshplan's words, with the value from ``argv`` (:func:`_not_a_number`)."""
    if "\n" in e.format_message().strip():
        return None
    field, message = usage_error(e, argv)
    return f"error: {field}: {message}"


def usage_error(e, argv: Sequence[str] = ()) -> tuple[str, str]:
    """``(field, message)`` of the one-line usage error ``e`` (:func:`_usage_line` prints them as
    ``error: <field>: <message>``; the ``meshplan.error/v1`` document holds them)."""
    msg = e.format_message()
    param = getattr(e, "param", None)
    field = (param.opts[0] if param is not None and getattr(param, "opts", None) else
             getattr(e, "option_name", None) or (e.ctx.command_path if e.ctx is not None else "usage"))
    cmd = e.ctx.command_path if e.ctx is not None else "meshplan"
    msg = _not_a_number(field, getattr(e, "message", msg), argv) or msg
    override = _torchtitan_override(str(field), msg)
    return printable(str(field)), printable(override or f"{msg.rstrip('.')}; see {cmd} --help")


def _torchtitan_override(option: str, message: str) -> Optional[str]:
    """What meshplan says of an unknown option spelt as torchtitan's command-line override of a config
    field (``--parallelism.tensor_parallel_degree 8``: tyro over the config function's result, or
    v0.2.2's ``--section.key``), None for another (newcomer trial nc57 #5): meshplan reads the file,
    not the overrides, so the fix is to write the value there.

    >>> print(_torchtitan_override("--parallelism.tensor_parallel_degree", "No such option: --parallelism.tensor_parallel_degree"))
    torchtitan's command-line overrides are not read; fix: write it in the job file: config.parallelism.tensor_parallel_degree = VALUE in the config function (config_registry.py), or tensor_parallel_degree under [parallelism] in a job TOML
    >>> _torchtitan_override("--nodez", "No such option: --nodez") is None
    True
    """
    name = option[2:].split("=", 1)[0] if option.startswith("--") else ""
    section, _, key = name.rpartition(".")
    if not message.startswith("No such option") or not section or not key:
        return None
    return (f"torchtitan's command-line overrides are not read; fix: write it in the job file: config.{name} = VALUE "
            f"in the config function (config_registry.py), or {key} under [{section}] in a job TOML")


#: The message typer (0.2x, which converts option values with pydantic) gives a number that
#: does not parse, and what meshplan says instead (newcomer trial nc55 #13: ``Invalid value for
#: '--nodes': Input should be a valid integer, unable to parse string as an integer``).
_NUMBER_WORDS = {"Input should be a valid integer": ("an integer", "a whole number"),
                 "Input should be a valid number": ("a number", "a number (digits, a decimal point, an exponent)")}


def _not_a_number(option: str, message: str, argv: Sequence[str]) -> Optional[str]:
    """``'abc' is not an integer; fix: give --nodes a whole number`` for typer's message of a
    value of ``option`` that does not parse as a number (None for other messages); the value is
    the last one ``argv`` gives ``option`` (``--nodes abc`` or ``--nodes=abc``).

    >>> _not_a_number("--nodes", "Input should be a valid integer, unable to parse string as an integer",
    ...               ["plan", "x.toml", "--nodes", "abc"])
    "'abc' is not an integer; fix: give --nodes a whole number"
    """
    kind = next((w for k, w in _NUMBER_WORDS.items() if message.startswith(k)), None)
    if kind is None:
        return None
    given = [b for a, b in zip(argv, argv[1:]) if a == option] + [a.split("=", 1)[1] for a in argv
                                                                  if a.startswith(option + "=")]
    value = f"{given[-1]!r}" if given else "the value"
    return f"{value} is not {kind[0]}; fix: give {option} {kind[1]}"


#: The exit status of a command whose stdout was closed under it (``meshplan step ... | head -1``):
#: 128 + SIGPIPE (13), what the shell reports for a Unix filter killed by SIGPIPE (``yes | head``
#: gives 141 under ``set -o pipefail``), so a cut-short pipe never reads as a verdict (1 infeasible,
#: 2 bad input). Python ignores SIGPIPE and raises BrokenPipeError instead; the click core that
#: typer runs catches EPIPE and exits 1 (typer/core.py, ``except OSError`` with ``errno.EPIPE``).
EXIT_PIPE_CLOSED = 141


def _stdout_closed(exc: BaseException) -> bool:
    """True when ``exc`` is the end of a write into a closed stdout: a BrokenPipeError, or the
    ``SystemExit(1)`` raised while handling one, by click's EPIPE handler (typer/core.py) or
    rich's ``Console.on_broken_pipe`` (rich/console.py), both of which exit 1."""
    if isinstance(exc, SystemExit) and exc.code == 1:
        exc = exc.__context__  # type: ignore[assignment]
    return isinstance(exc, OSError) and exc.errno == errno.EPIPE


def _exit_pipe_closed() -> NoReturn:
    """Exit quietly with EXIT_PIPE_CLOSED; stdout is pointed at /dev/null first so the
    interpreter's final flush does not raise again (the recipe of the Python docs, "Note on
    SIGPIPE", library/signal.html, with 141 instead of their 1, which means infeasible here)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
    sys.exit(EXIT_PIPE_CLOSED)
