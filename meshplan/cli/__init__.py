"""Command line: thin wrappers over :func:`meshplan.plan.build_plan` and the reports, one module
per group of commands, registered here in the order ``--help`` lists them (:data:`COMMANDS`):

- :mod:`~meshplan.cli.plan_cmds`: plan, report, groups, memory
- :mod:`~meshplan.cli.step_cmd`: step (its collectives and link-load lines: :mod:`~meshplan.cli.step_links`)
- :mod:`~meshplan.cli.reliability_cmd`: reliability
- :mod:`~meshplan.cli.search_cmds`: compare, search
- :mod:`~meshplan.cli.interop_cmds`: import, export
- :mod:`~meshplan.cli.placement_cmds`: nccl-check, place, launch
- :mod:`~meshplan.cli.validate_cmds`: validate, validate-slice, testbed up/down
- :mod:`~meshplan.cli.machine_cmds`: catalog, calibrate, bench comm/gemm/attention
- :mod:`~meshplan.cli.common` (options, printing, verdicts, outputs), :mod:`~meshplan.cli.foreign_opts`
  (the foreign-config options), :mod:`~meshplan.cli.loading` (config to plan),
  :mod:`~meshplan.cli.exits` (usage errors, a closed stdout): what they share.

Every malformed input ends with one line ``error: <field>: <message>`` on stderr and exit
status 2 (degrees whose product is not the world among them: :func:`meshplan.cli.loading._load`), and
where ``--json`` was given the ``meshplan.error/v1`` document (:mod:`meshplan.cli.error_doc`);
an infeasible mesh prints its reasons and exits 1.

One verdict everywhere (:data:`EXIT_CODES`): every command that resolves a mesh (plan, groups,
memory, step, reliability, place, nccl-check) exits 1 and prints ``infeasible: <reason>`` on stderr when
``meshplan plan`` calls the mesh infeasible, whatever it printed before; ``step`` then prints
only the step the mesh would take, labelled ``would be ... if it fit``. ``compare`` exits 0
when a mesh that fits wins (the other's infeasibility is one of the verdict's reasons) and 1
when neither fits; ``search`` exits 0 when some candidate fits and 1 when none does.

Every command takes ``--json PATH`` (its document, schema ``meshplan/schemas/<command>.v1.schema.json``,
a group's command as ``<group>-<command>``); ``--json -`` prints the document alone on stdout and
moves everything else the command prints to stderr (:func:`meshplan.cli.common._json_to_stdout`,
applied to every command once they are registered); so does ``-o -`` of import, export and search
--export (the file on stdout). Every other output option refuses ``-``.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Optional

import numpy as np
import typer
import typer.main

from meshplan.cli import (
    interop_cmds,
    machine_cmds,
    placement_cmds,
    plan_cmds,
    rank_cmd,
    reliability_cmd,
    search_cmds,
    step_cmd,
    validate_cmds,
)
from meshplan.cli.common import _inputs_guarded, _json_to_stdout
from meshplan.cli.error_doc import config_errors, write_error_doc
from meshplan.cli.exits import _USAGE_ERROR, _exit_pipe_closed, _stdout_closed, _usage_line, usage_error
from meshplan.errors import ConfigError, InfeasibleInput

__all__ = ["COMMANDS", "EXIT_CODES", "app", "main"]


EXIT_CODES = ("exit status: 0 feasible (compare: a mesh that fits wins; search: some candidate fits), "
              "1 infeasible (the reasons on stderr as 'infeasible: ...'; groups, place, nccl-check and step still print "
              "what they show, step labelled 'would be ... if it fit') or a measured difference, "
              "2 malformed input (degrees whose product is not the world and counts that disagree included), or a "
              "log nccl-check cannot check (one line 'error: <field>: <what is wrong>'; with --json, the document "
              "meshplan.error/v1 in place of the command's)")


app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Design, check and validate parallel meshes for distributed training. " + EXIT_CODES + ".")


testbed_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Emulated multi-node cluster in network namespaces (root).")
bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Measure this machine (or the testbed) for calibration.")

#: Every command as (its typer app, its name, the function), in the order ``--help`` lists them;
#: a new command is a function in its group's module and one line here.
#: Help texts built from shared strings rather than a docstring, by command name.
HELP = {"export": interop_cmds.EXPORT_HELP}

COMMANDS = (
    (app, "plan", plan_cmds.plan),
    (app, "report", plan_cmds.report),
    (app, "groups", plan_cmds.groups),
    (app, "memory", plan_cmds.memory),
    (app, "step", step_cmd.step),
    (app, "reliability", reliability_cmd.reliability),
    (app, "compare", search_cmds.compare_cmd),
    (app, "search", search_cmds.search_cmd),
    (app, "import", interop_cmds.import_cmd),
    (app, "export", interop_cmds.export_cmd),
    (app, "nccl-check", placement_cmds.nccl_check),
    (app, "validate", validate_cmds.validate),
    (app, "place", placement_cmds.place_cmd),
    (app, "launch", placement_cmds.launch_cmd),
    (app, "catalog", machine_cmds.catalog_cmd),
    (app, "calibrate", machine_cmds.calibrate_cmd),
    (app, "validate-slice", validate_cmds.validate_slice),
    (testbed_app, "up", validate_cmds.testbed_up_cmd),
    (testbed_app, "down", validate_cmds.testbed_down_cmd),
    (bench_app, "comm", machine_cmds.bench_comm_cmd),
    (bench_app, "gemm", machine_cmds.bench_gemm),
    (bench_app, "attention", machine_cmds.bench_attention),
    (bench_app, "rank", rank_cmd.bench_rank),
)


def _register() -> None:
    """Each of :data:`COMMANDS` on its app, in order, then the two groups on ``app``."""
    for parent, name, command in COMMANDS:
        parent.command(name, help=HELP.get(name))(command)
    app.add_typer(testbed_app, name="testbed")
    app.add_typer(bench_app, name="bench")


_register()


def _json_to_stdout_everywhere(*apps: typer.Typer) -> None:
    """``--json -`` on every registered command of ``apps`` (:func:`_json_to_stdout`), and no
    output that is one of the command's inputs (:func:`_inputs_guarded`)."""
    for a in apps:
        for command in a.registered_commands:
            command.callback = _json_to_stdout(_inputs_guarded(command.callback))


_json_to_stdout_everywhere(app, testbed_app, bench_app)


def small_pages() -> None:
    """Allocate numpy arrays without asking the kernel for transparent huge pages. numpy
    advises huge pages (``madvise(MADV_HUGEPAGE)``) for every array of 4 MiB or more; under
    Linux's usual ``transparent_hugepage/defrag = madvise`` each first touch of such an array
    may then compact memory to find 2 MiB pages. A command's arrays are short-lived (a pipeline
    of 10^6 units: some tens of 8 MB arrays, each written once or twice), so that costs more
    than the TLB saves: ``benchmarks/bench_step.py`` on GPT-1T 1F1B under Megatron-LM at pp 128
    x 4,096 micro-batches, 0.63 -> 0.47 CPU s of the command, the process's system time 0.74 ->
    0.35 s (2 loaded cores). numpy's own switch (``NUMPY_MADVISE_HUGEPAGE=0``); the results are
    the same arrays. Both settings (this and :func:`heap_kept`'s) are the whole process's, so
    only the CLI's entry (:func:`main`, the console script and ``python -m meshplan``) makes them,
    never an import of meshplan: a program that uses meshplan as a library keeps its own
    (tests/test_small_pages.py)."""
    core = getattr(np, "_core", None) or getattr(np, "core")  # (numpy < 2: numpy.core)
    getattr(core.multiarray, "_set_madvise_hugepage")(False)  # (not in numpy's type stubs)
    heap_kept()


#: glibc ``mallopt`` parameters (``malloc.h``) and the values :func:`heap_kept` sets: arrays up to
#: 32 MiB (glibc's largest mmap threshold on 64-bit, ``DEFAULT_MMAP_THRESHOLD_MAX``) from the heap,
#: and freed heap kept up to 1 GiB.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES = 32 << 20, 1 << 30


def heap_kept() -> None:
    """Let glibc's allocator reuse the pages of freed arrays instead of returning them to the
    kernel: each fresh page of an array costs a page fault on first touch, and a command frees
    and allocates some tens of 8 MB arrays (a pipeline of 10^6 units). By default glibc maps each
    array over 128 KiB apart (unmapped when freed) until a freed one raises that threshold, and
    trims the heap's free top past twice it; fixed thresholds (``mallopt``) keep the pages in the
    process. ``benchmarks/bench_step.py`` on GPT-1T 1F1B at pp 128 x 4,096 micro-batches: 103,305
    -> 83,388 minor page faults of the command's first run, about 0.1 CPU s (2 loaded cores). Not
    glibc (no ``mallopt``: macOS, Windows): nothing; musl's ``mallopt`` does nothing. The results
    are the same arrays. Process-wide: called by :func:`small_pages` at the CLI's entry only."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError, TypeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: run the app; malformed input (a ConfigError, or a usage error of an
    option or argument) is one line ``error: <field>: ...`` and exit 2; a stdout closed
    by its reader exits EXIT_PIPE_CLOSED (141) with nothing on stderr. Arrays in small
    pages (:func:`small_pages`)."""
    small_pages()
    try:
        rc = _run_app(argv)
    except (BrokenPipeError, SystemExit) as e:
        if _stdout_closed(e):
            _exit_pipe_closed()
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


def _argv(argv: Optional[list[str]]) -> list[str]:
    """The command line's words after the program name (``sys.argv`` where main() was given none)."""
    return list(sys.argv[1:] if argv is None else argv)


def _run_app(argv: Optional[list[str]]) -> Any:
    """The app's return value; the error paths of main() (exit 2 for bad input, with the
    ``meshplan.error/v1`` document where ``--json`` was asked: :func:`meshplan.cli.error_doc.write_error_doc`)."""
    try:
        rc = app(args=argv, standalone_mode=False)
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
    except InfeasibleInput as e:  # the mesh's fault, found by a foreign reader: exit 1 as an infeasible plan
        print(f"infeasible: {e}", file=sys.stderr)
        write_error_doc(_argv(argv), typer.main.get_command(app), config_errors(e), 1)
        sys.exit(1)
    except ConfigError as e:
        for one in getattr(e, "errors", [e]):  # ConfigErrors: one line each
            print(f"error: {one}", file=sys.stderr)
        write_error_doc(_argv(argv), typer.main.get_command(app), config_errors(e))
        sys.exit(2)
    except _USAGE_ERROR as e:
        line = _usage_line(e, sys.argv[1:] if argv is None else argv)
        if line is None:
            e.show()
        else:
            print(line, file=sys.stderr)
            write_error_doc(_argv(argv), typer.main.get_command(app), [usage_error(e, _argv(argv))], e.exit_code)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    return rc
