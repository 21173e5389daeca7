"""What every command shares: the help texts and the typed options (``--calibration``, ``--json``,
``--html``; the foreign-config options are :mod:`meshplan.cli.foreign_opts`), printing (input
made printable, the ``wrote PATH`` line, a console wide enough for the collective tables), the
verdict lines and exits of :data:`meshplan.cli.EXIT_CODES`, and outputs: refused before the work
when they exist, written at the end, ``--json -`` (and ``-o -`` of import, export, search
--export) on stdout with everything else moved to stderr (:func:`_json_to_stdout`).

The names with a leading underscore are the CLI package's own helpers, shared by its command
modules (``meshplan.cli.*_cmd(s)``); nothing outside ``meshplan.cli`` imports them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import shutil
import sys
import typing
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console

from meshplan.errors import ConfigError, printable
from meshplan.fileio import check_destination, write_output
from meshplan.fileread import command_inputs
from meshplan.interop.file_words import file_words
from meshplan.interop.keymaps import keymap_of
from meshplan.plan import Infeasible, Plan
from meshplan.plan_fix_rules import experts_fix, heads_fix, seq_fix, split_fix, vpp_fix
from meshplan.report.json_docs import to_json


#: CONFIG of a command that reads foreign configs directly (plan, report, groups, memory, step, reliability,
#: search, export), and of one that reads meshplan TOML only (a foreign config: import it first).
CONFIG_HELP = ("meshplan TOML config ([model], [cluster], [training], [mesh]), or a torchtitan job TOML, Megatron-LM "
               "arguments (file or launch script) or DeepSpeed JSON, read directly with --cluster/--nodes")


TOML_ONLY_HELP = "meshplan TOML config (a torchtitan, Megatron-LM or DeepSpeed file: meshplan import it first)"


CALIBRATION_HELP = ("calibration TOML (meshplan calibrate or bench comm): its alpha-beta fit per link class replaces "
                    "the cluster's link bandwidths and latencies; a header line names the file, its GPU and those bandwidths, "
                    "a line per class the catalog figure it replaced, and a warning line a GPU that is not the cluster's. "
                    "Repeat it for files of other link classes (a 1-node nvlink file and a 2-node nic file); a class "
                    "in two files is refused")


# Shared by plan, step, compare (both configs) and search: the measured links they all time with.
CalibrationOpt = Annotated[Optional[list[Path]], typer.Option("--calibration", metavar="<path>", help=CALIBRATION_HELP)]


TOPOLOGY_HELP = ("nvidia-smi topo -m text or NCCL topology XML of the nodes: replaces their sockets, NUMA cores "
                 "and NICs with their PCIe affinity; the catalog node's links and measured curves stay (a note says "
                 "why when its NVLink curves are dropped, and which NICs have no GPU under their PCIe switch)")


# Shared by plan, step, place, launch, compare (both configs) and search: one reader
# (meshplan.cli.loading.topology_node).
TopologyOpt = Annotated[Optional[Path], typer.Option("--topology", help=TOPOLOGY_HELP)]


KERNELS_HELP = ("measured kernel table (kernels.toml form, as `meshplan bench gemm --grid` / `bench attention --grid` "
                "/ `bench rank --kernels-out` write it) for the config's GPU, laid over the catalog's for this run: "
                "its GEMM points replace the catalog's for each dtype it has, its attention rows come first, its "
                "[host] table replaces eager DTensor TP's host pace (a file with a [host] table alone applies to any GPU); repeatable (later files over earlier ones), "
                "after a config's [kernels] files; a line 'kernels: FILE (source; bf16: N points ...)' names what was used "
                "and how many points replace the catalog's; a point (TFLOP/s) above the GPU's peak x max_gemm_fraction "
                "is refused, one under 1% of the shape model's rate warned")


# Shared by plan, report, step, reliability, compare (both configs) and search: the measured kernels they time with.
KernelsOpt = Annotated[Optional[list[Path]], typer.Option("--kernels", metavar="FILE", help=KERNELS_HELP)]


def _echo(text, err: bool = False) -> None:
    """``typer.echo`` with whatever came from input made printable (control characters and
    escape sequences escaped, :func:`meshplan.errors.printable`); newlines of multi-line text
    kept."""
    typer.echo(printable(str(text), keep_newlines=True), err=err)


def _wrote(path) -> None:
    """The ``wrote PATH`` line, the path on one printable line."""
    _echo(f"wrote {printable(str(path))}")


def _console() -> Console:
    """A console at least 160 columns wide (wider when the terminal or COLUMNS says so), so
    the collective tables keep whole numbers."""
    return Console(width=max(160, shutil.get_terminal_size((160, 40)).columns))


def _infeasible(plan, who: str = "") -> None:
    """Print the plan's reasons as ``infeasible: [who: ]<reason>`` on stderr (the verdict line
    of every command that resolves a mesh), a foreign config's in its own keys (:func:`_in_file`)."""
    for r in plan.reasons:
        _echo(f"infeasible: {who + ': ' if who else ''}{_in_file(plan, r)}", err=True)


def _in_file(plan, line: str) -> str:
    """``line`` (a reason or a ``fix:`` line of ``plan``) in the keys of the foreign file its
    config was read from (:func:`meshplan.interop.file_words.file_words`); as it is for a meshplan
    TOML or a result without a config."""
    cfg = getattr(plan, "config", None)
    return file_words(cfg, line) if cfg is not None else line


def _verdict_exit(plan) -> None:
    """Exit 1 after the verdict lines when ``plan`` is infeasible; return when it fits."""
    if not plan.feasible:
        _exit_infeasible(plan)


def _exit_infeasible(plan: Plan | Infeasible) -> NoReturn:
    """The verdict lines of ``plan`` (and, for an ep that does not divide the experts, the
    ``fix:`` line of :func:`meshplan.plan_fix_rules.experts_fix`; for a tp that does not split the
    heads, :func:`~meshplan.plan_fix_rules.heads_fix`'s; for layers per stage that vpp does not
    divide, :func:`~meshplan.plan_fix_rules.vpp_fix`'s; for layers that pp does not divide without
    a split, :func:`meshplan.plan_fix_rules.split_fix`'s; for a sequence cp does not split into 2 x cp
    chunks, :func:`~meshplan.plan_fix_rules.seq_fix`'s), then exit 1."""
    _infeasible(plan)
    fix = None
    if isinstance(plan, Infeasible):  # heads/split/vpp_fix built in a foreign file's keys; experts_fix rewritten
        keys = keymap_of(plan.config)
        experts = experts_fix(plan)  # its refusals quote the rules' reasons, which are in meshplan's words
        fix = _in_file(plan, experts) if experts else (heads_fix(plan, keys) or vpp_fix(plan, keys)
                                                       or split_fix(plan, keys) or seq_fix(plan, keys))
    if fix:
        _echo(fix, err=True)
    raise typer.Exit(1)


def _require_torch(command: str) -> None:
    """A one-line error when ``command`` needs torch and it is not installed (``make demo``
    installs meshplan alone)."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError("torch", f"meshplan {command} runs torch, which is not installed: pip install "
                          f"torch==2.13.0 (the runtime extra, pip install -e '.[runtime]'; make test installs it)")


def _refuse_existing(path: Optional[Path], force: bool, field: str) -> None:
    """Refuse, before any work, an output file that exists (written at the end with --force) or
    cannot be written (:func:`meshplan.fileio.check_destination`); ``--json -`` (stdout) is
    never refused."""
    if path and not isinstance(path, _Stdout):
        check_destination(path, field, force)


class _Stdout:
    """``--json -``: the document goes to ``stream`` (the command's stdout), and everything
    else the command prints goes to stderr (:func:`_json_to_stdout`)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __str__(self) -> str:
        return "-"


#: Commands whose ``-o``/``--out`` is a file a Unix user may send to stdout with ``-o -``
#: (import, export, search --export); every other output option refuses ``-``
#: (:func:`meshplan.fileio.check_destination`).
STDOUT_OUT = ("import_cmd", "export_cmd", "search_cmd")


def _json_to_stdout(command):
    """Wrap a command so that ``--json -`` (or, for :data:`STDOUT_OUT`, ``-o -``) prints its
    one document on stdout and moves its human output (echo, rich tables, progress, the
    runtime's prints) to stderr; both at once is a ConfigError (one stdout)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        json_out = str(kwargs.get("json_path")) == "-"
        file_out = command.__name__ in STDOUT_OUT and str(kwargs.get("out")) == "-"
        if json_out and file_out:
            raise ConfigError("-o", "-o - and --json - both write to stdout; give one of them a file path")
        if not (json_out or file_out):
            return command(*args, **kwargs)
        out = _Stdout(sys.stdout)
        with contextlib.redirect_stdout(sys.stderr):
            return command(*args, **{**kwargs, "json_path" if json_out else "out": out})
    return run


#: The parameters by which commands name what they write (files or folders); every other path a
#: command takes is an input, which no output may be, --force or not (:func:`_inputs_guarded`).
OUTPUT_PARAMS = frozenset({"json_path", "html_path", "out", "trace", "bindings_path", "kernels_out"})


def _input_names(command) -> dict[str, str]:
    """``{parameter: its name on the command line}`` for the parameters of ``command`` that are
    not :data:`OUTPUT_PARAMS`: an argument by its metavar (``CONFIG``, ``NCCL_TESTS_OUTPUT``), an
    option by its long flag (``--topology``)."""
    hints = typing.get_type_hints(command, include_extras=True)
    names = {}
    for name, par in inspect.signature(command).parameters.items():
        metadata = getattr(hints.get(name), "__metadata__", ())
        info = next((m for m in (par.default, *metadata) if isinstance(m, typer.models.ParameterInfo)), None)
        if name in OUTPUT_PARAMS or info is None:
            continue
        if isinstance(info, typer.models.ArgumentInfo):
            names[name] = (info.metavar or name.upper()).rstrip(".")
        else:
            names[name] = max(info.param_decls or (f"--{name.replace('_', '-')}",), key=len)
    return names


def _inputs_guarded(command):
    """Wrap a command so that it runs inside :func:`meshplan.fileread.command_inputs` with its
    input paths (:func:`_input_names`) and so every file it reads: an output that is one of them
    is refused even with --force (:func:`meshplan.fileio.input_clash`; newcomer trial 23 #1)."""
    names = _input_names(command)

    @functools.wraps(command)
    def run(*args, **kwargs):
        named = [(p, names[k]) for k, v in kwargs.items() if k in names
                 for p in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(p, Path)]
        with command_inputs(named):
            return command(*args, **kwargs)
    return run


def json_path_given(value: Optional[Path]) -> Optional[Path]:
    """``--json``'s callback: the path as given, refused where it is an option (``--json --out DIR``:
    ``--json`` takes a path, so the parser took ``--out`` for it and then refused ``DIR`` as an extra
    argument, newcomer trial 27 #F); a short option too (``--json -o FILE``), but ``-`` itself
    (stdout). Click runs the callbacks before it checks for extra arguments, so this line is the
    one the user sees.

    >>> json_path_given(Path("plan.json")).name, json_path_given(None), str(json_path_given(Path("-")))
    ('plan.json', None, '-')
    >>> json_path_given(Path("--out"))
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --json: takes a path (--json PATH), got the option --out: give the file right after --json (--json out.json --out ...)
    >>> json_path_given(Path("-o"))
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --json: takes a path (--json PATH), got the option -o: give the file right after --json (--json out.json -o ...)
    """
    if value is not None and str(value).startswith("-") and str(value) != "-":
        raise ConfigError("--json", f"takes a path (--json PATH), got the option {value}: give the file right after "
                          f"--json (--json out.json {value} ...)")
    return value


def _json_option(command: str):
    return typer.Option(None, "--json", callback=json_path_given, help=f"write the result as JSON to PATH, or with - to stdout (the rest of "
                                             f"the output then on stderr) (schema meshplan.{command}/v1, file "
                                             f"meshplan/schemas/{command}.v1.schema.json; SI units)")


def _write_text(path, text: str, force: bool) -> None:
    """Write a ``--json`` document's text to ``path`` (``wrote PATH``) or, for ``--json -``,
    to stdout; nothing when not asked."""
    if isinstance(path, _Stdout):
        path.stream.write(text)
        path.stream.flush()
    elif path:
        _wrote(write_output(path, text, force, '--json'))


def _write_doc(path: Optional[Path], doc: dict, force: bool) -> None:
    """Write a ``--json`` document (when asked; :func:`_write_text`)."""
    if path:
        _write_text(path, to_json(doc), force)


def _written(paths) -> list[tuple[str, int]]:
    """``(path, size in bytes)`` of each file written, for a document's ``files``."""
    return [(str(p), Path(p).stat().st_size) for p in paths]


def _html_option(what: str):
    return typer.Option(None, "--html", help=f"write {what} as one self-contained HTML page (tables, memory plot, "
                                             "pipeline Gantt chart, link-load bars; no script, no external file)")


def _check_rank(plan, rank: int) -> None:
    if not 0 <= rank < plan.world:
        raise ConfigError("--rank", f"{rank} outside 0..{plan.world - 1}")
