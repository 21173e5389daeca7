"""The CLI package (issue 11: cli.py split by concern): one module per group of commands, each
command registered once in :data:`meshplan.cli.COMMANDS`, whose order is the order of --help."""

import importlib
import inspect
import pkgutil

import typer
from typer.models import ArgumentInfo, OptionInfo

import meshplan.cli as cli

# the order of `meshplan --help` (frozen: a reordering is a visible change of the help)
HELP_ORDER = ["plan", "report", "groups", "memory", "step", "reliability", "compare", "search", "import", "export",
              "nccl-check", "validate", "place", "launch", "catalog", "calibrate", "validate-slice", "testbed",
              "bench"]


def test_help_lists_the_commands_in_registry_order():
    group = typer.main.get_command(cli.app)
    assert list(group.commands) == HELP_ORDER
    assert list(group.commands["testbed"].commands) == ["up", "down"]
    assert list(group.commands["bench"].commands) == ["comm", "gemm", "attention", "rank"]


def _is_command(fn) -> bool:
    """A function whose parameters are typer arguments or options (a command's signature)."""
    return any(isinstance(p.default, (ArgumentInfo, OptionInfo)) for p in inspect.signature(fn).parameters.values())


def test_every_command_function_is_registered_once():
    """A command written in its group's module but missing from COMMANDS would be absent from
    the CLI without an error; one registered twice would shadow another."""
    registered = [fn for _, _, fn in cli.COMMANDS]
    assert len(registered) == len(set(registered)) == 23
    found = []
    for info in pkgutil.iter_modules(cli.__path__):
        mod = importlib.import_module(f"meshplan.cli.{info.name}")
        found += [fn for _, fn in inspect.getmembers(mod, inspect.isfunction)
                  if fn.__module__ == mod.__name__ and _is_command(fn)]
    assert sorted(f.__qualname__ for f in found) == sorted(f.__qualname__ for f in registered)
    assert all(f.__module__.endswith(("_cmd", "_cmds")) for f in found)
