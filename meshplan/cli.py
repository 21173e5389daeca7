"""Command line: thin wrappers over :func:`meshplan.plan.build_plan` and the reports.

Every malformed input ends with one line ``error: <field>: <message>`` on stderr and exit
status 2; an infeasible mesh prints its reasons and exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Design, check and validate parallel meshes for distributed training.")


def _load(config: Path):
    from .plan import build_plan
    from .spec.config import load_config

    return build_plan(load_config(config))


def _check_rank(plan, rank: int) -> None:
    if not 0 <= rank < plan.world:
        raise ConfigError("--rank", f"{rank} outside 0..{plan.world - 1}")


@app.command()
def plan(config: Path = typer.Argument(..., help="TOML config with [model], [cluster], [training], [mesh]"),
         json_path: Optional[Path] = typer.Option(None, "--json", help="write the whole plan (every group) as JSON"),
         rank: int = typer.Option(0, "--rank", help="rank whose groups and placement are printed"),
         force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Plan one mesh: constraints, degrees, groups, placement, shapes, memory, collectives."""
    from .report.text import print_plan

    p = _load(config)
    if p.mesh is not None:
        _check_rank(p, rank)
    print_plan(p, rank=rank, console=Console(width=160))
    if json_path:
        from .report.json_out import write_json

        typer.echo(f"wrote {write_json(p, json_path, force=force)}")
    raise typer.Exit(0 if p.feasible else 1)


@app.command()
def groups(config: Path = typer.Argument(..., help="TOML config"),
           rank: int = typer.Option(0, "--rank", help="the rank whose start-up print is shown")):
    """Print what RANK would print at start-up: its coordinates and every group's ranks."""
    from .report.text import print_groups

    p = _load(config)
    if p.mesh is None:
        for r in p.reasons:
            typer.echo(f"infeasible: {r}", err=True)
        raise typer.Exit(1)
    _check_rank(p, rank)
    print_groups(p, rank, Console(width=160))


@app.command()
def memory(config: Path = typer.Argument(..., help="TOML config (an optional [memory] table sets the timeline parameters)"),
           out: Path = typer.Option(Path("."), "--out", help="folder for the PNG plot(s)"),
           all_stages: bool = typer.Option(False, "--all-stages", help="every pipeline stage, not only the most loaded"),
           force: bool = typer.Option(False, "--force", help="replace existing PNG files")):
    """Memory timeline of one training step: peak, headroom, events by kind, and a PNG per stage shown."""
    from .report.memory import print_memory
    from .report.memory_plot import write_png

    p = _load(config)
    if not p.timelines:
        for r in p.reasons:
            typer.echo(f"infeasible: {r}", err=True)
        raise typer.Exit(1)
    shown = p.timelines if all_stages else (p.timeline,)
    paths = [out / f"{config.stem}_memory_stage{tl.stage}.png" for tl in shown]
    taken = [str(x) for x in paths if x.exists()]
    if taken and not force:
        raise ConfigError("--out", f"{taken[0]} exists; choose another folder or pass --force to replace it")
    print_memory(p, Console(width=160), all_stages=all_stages)
    for tl, path in zip(shown, paths):
        typer.echo(f"wrote {write_png(tl, path, name=config.name, force=force)}")
    raise typer.Exit(0 if p.feasible else 1)


@app.command("catalog")
def catalog_cmd(kind: str = typer.Argument("model", help="gpu, node, network or model")):
    """List the built-in catalog entries of KIND with their sources."""
    from . import catalog

    for name in catalog.names(kind):
        typer.echo(f"{name}: {catalog.entry(kind, name).get('source', '')}")


testbed_app = typer.Typer(no_args_is_help=True, help="Emulated multi-node cluster in network namespaces (root).")
app.add_typer(testbed_app, name="testbed")


@testbed_app.command("up")
def testbed_up_cmd(nodes: int = typer.Option(2, help="emulated nodes (one network namespace each)"),
                   nics: int = typer.Option(2, help="NICs per node (one rail bridge each)"),
                   rate_mbit: float = typer.Option(200.0, help="tbf rate limit per NIC, Mbit/s"),
                   prefix: str = typer.Option("t", help="name prefix of the namespaces")):
    """Create one namespace per node, one rate-limited interface per NIC and a bridge per rail."""
    from .runtime.testbed import main_up

    raise typer.Exit(main_up(nodes, nics, rate_mbit, prefix=prefix))


@testbed_app.command("down")
def testbed_down_cmd(prefix: str = typer.Option("t", help="name prefix given to up")):
    """Remove every namespace, interface, bridge and process of the testbed PREFIX."""
    from .runtime.testbed import main_down

    raise typer.Exit(main_down(prefix=prefix))


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: run the app, turning ConfigError into one line and exit 2."""
    try:
        app(args=argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
