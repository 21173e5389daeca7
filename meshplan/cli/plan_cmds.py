"""plan, report, groups, memory: one mesh planned and shown: the plan (text, JSON, HTML page),
what a rank prints at start-up, and the memory timeline with its PNG plots."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import typer

from meshplan.cli.common import (
    CONFIG_HELP,
    CalibrationOpt,
    KernelsOpt,
    TopologyOpt,
    _check_rank,
    _console,
    _echo,
    _exit_infeasible,
    _infeasible,
    _html_option,
    _json_option,
    json_path_given,
    _refuse_existing,
    _verdict_exit,
    _write_doc,
    _write_text,
    _written,
    _wrote,
)
from meshplan.cli.foreign_opts import Foreign, foreign_options
from meshplan.cli.loading import _cal_note, _calibrated, _calibration, _kernels_note, _load
from meshplan.fileio import check_destination, page_folder, write_output
from meshplan.interop.keymaps import keymap_of
from meshplan.mesh.tpsplit import model_groups
from meshplan.plan import Infeasible, Plan, with_example_rank
from meshplan.plan_capacity import checked
from meshplan.plan_fix import memory_fix
from meshplan.report.axis_need import need_line
from meshplan.report.html_pages import plan_page
from meshplan.report.json_docs import envelope, groups_doc, memory_doc, report_doc
from meshplan.report.json_out import plan_to_dict
from meshplan.report.memory import print_memory
from meshplan.report.memory_plot import write_png
from meshplan.report.text import print_groups, print_plan
from meshplan.schedule.reshard_note import reshard_default_note
from meshplan.schedule.steptime import step_time


def _write_plan_html(p: Plan | Infeasible, path: Path, name: str, force: bool, field: str = "--html",
                     note: str = "") -> None:
    """The HTML report of ``p`` (with its predicted step when it was planned; ``note``: a header line)."""
    st = step_time(p) if isinstance(p, Plan) else None
    _wrote(write_output(path, plan_page(p, st, name, note), force, field, create_folders=page_folder(path)))


def _refuse_page(path: Optional[Path], force: bool, field: str) -> None:
    """:func:`_refuse_existing` for the HTML page, whose missing folder is made where its parent
    exists (:func:`meshplan.fileio.page_folder`)."""
    if path:
        check_destination(path, field, force, create_folders=page_folder(path))


def closing_notes(p: Plan) -> list[str]:
    """The ``note:`` lines after a feasible plan: a tp or cp larger than memory needs
    (:func:`need_line`), then torchtitan's reshard default under pp (:func:`reshard_default_note`, no re-plan);
    the plan's own step predicted once, for the first if it needs it (benchmarks/bench_plan.py times them)."""
    here = functools.cache(lambda: step_time(p).step_s)
    return [x for x in (need_line(p, here), reshard_default_note(p)) if x]


@foreign_options()
def plan(config: Path = typer.Argument(..., help=CONFIG_HELP),
         json_path: Optional[Path] = typer.Option(None, "--json", callback=json_path_given,
                                                  help="write the whole plan (every group) as JSON "
                                                  "to PATH, or with - to stdout (the rest of the output then on "
                                                  "stderr)"),
         rank: int = typer.Option(0, "--rank", help="rank whose groups and placement are printed; "
                                                 "a placement fault names this rank's group where it offends"),
         html_path: Optional[Path] = _html_option("the plan report"),
         force: bool = typer.Option(False, "--force", help="replace existing --json and --html files"),
         topology: TopologyOpt = None,
         calibration: CalibrationOpt = None,
         kernels: KernelsOpt = None,
         foreign: Foreign = Foreign()):
    """Plan one mesh (under training.framework megatron a 'megatron runtime:' line under the header names the
    Megatron-LM generation modelled, the other one and the key: training.megatron_runtime; --json megatron_runtime):
    constraints (the capacity row of the plan's own sharding and recompute from its memory
    timeline, the others first estimates), degrees, groups, placement, shapes, memory, collectives. CONFIG may be a
    torchtitan job TOML, Megatron-LM arguments or a DeepSpeed JSON (the cluster from --cluster/--nodes). A mesh over
    memory exits 1 with a 'fix:' line: the knobs re-planned (grad_accumulation sync from no_sync, recompute full,
    except under Megatron-LM torchtitan's per-layer AC recompute layer at the largest ac_freq that fits, half the micro-batch, zero3 or resharding, tp x2, pp x2, the smallest cp from the data axis that fits, or the lowest cp peak, or why no cp), those
    that fit first, fastest first, each with its predicted step. An ep that does not divide the routed experts, or ep x etp the dense block
    dp_shard x cp x tp: a 'fix:' line with the ep degrees that divide both and pass the rules, led by a smaller
    etp with ep kept where one passes (Megatron-LM's etp defaults to tp). A pp the model's
    layers do not divide, without mesh.pp_layer_split, exits 1 with a 'fix:' line giving the split the framework
    sets (Megatron-LM's --decoder-first/last-pipeline-num-layers with their values, or that it sets none at this
    pp; under torch a balanced split); a vpp that does not divide the layers per stage, with the vpp degrees that
    do; a tp that does not split the attention heads, with the tp degrees that do (q_heads % tp == 0 and kv_heads
    % tp == 0 or tp % kv_heads == 0), each with its mesh. A feasible mesh whose tp (or cp) is larger than its memory needs ends with a
    'note:' line: the smallest tp (cp) that still fits, the data axis grown by the same factor, re-planned, its peak
    and both predicted steps, and whether the configured degree is kept for the step. For a foreign CONFIG the errors, reasons and fix lines name its own keys
    where it has them (training.global_batch_size, activation_checkpoint.mode, the degrees' keys; the flags)."""

    _refuse_existing(json_path, force, "--json")  # refused before the work and the report, as compare --out
    _refuse_page(html_path, force, "--html")
    p = checked(_load(config, topology, calibration, foreign.fmt, foreign.options(),
                      kernels=kernels))  # its own setting's capacity row from the timeline
    if p.mesh is not None:
        _check_rank(p, rank)
        p = with_example_rank(p, rank)  # the fault lines name rank's group, as the group table does (C3)
    cal = _calibration(calibration, p.config.cluster)
    kern = _kernels_note(p.config.cluster)
    print_plan(p, rank=rank, console=_console())
    for note in closing_notes(p) if isinstance(p, Plan) and p.feasible else []:
        _echo(note)
    _write_text(json_path, json.dumps(_calibrated(plan_to_dict(p), cal), separators=(",", ":")), force)
    if html_path:
        _write_plan_html(p, html_path, config.name, force, note=_cal_note(cal, kern))
    if not p.feasible and isinstance(p, Plan):  # over memory: the knobs that would bring the peak under it
        _infeasible(p)
        _echo(memory_fix(p, keymap_of(p.config)) or "", err=True)  # a foreign file's keys (interop.keymaps)
        raise typer.Exit(1)
    _verdict_exit(p)


@foreign_options()
def report(config: Path = typer.Argument(..., help=CONFIG_HELP),
           out: Optional[Path] = typer.Option(None, "--out", help="HTML file (default: out/report/ and CONFIG's "
                                                                  "name with .html; an existing file is refused "
                                                                  "unless --force or meshplan's own under out/)"),
           json_path: Optional[Path] = _json_option("report"),
           force: bool = typer.Option(False, "--force", help="replace existing --out and --json files"),
           topology: TopologyOpt = None,
           calibration: CalibrationOpt = None,
           kernels: KernelsOpt = None,
           foreign: Foreign = Foreign()):
    """One self-contained HTML page of the plan: verdict, input, groups, shapes, memory timeline plot, collective
    table, step time with the pipeline Gantt chart and link-load bars; the page plan --html writes, with the same
    --topology, --calibration and --kernels. A mesh that does not fit is still reported, then exits 1 with its
    reasons."""

    path = out or Path("out") / "report" / (config.stem + ".html")  # defaults go under out/ (docs/commands.md "Outputs")
    _refuse_page(path, force, "--out")
    _refuse_existing(json_path, force, "--json")
    p = checked(_load(config, topology, calibration, fmt=foreign.fmt, opts=foreign.options(), kernels=kernels))
    cal = _calibration(calibration, p.config.cluster)
    _write_plan_html(p, path, config.name, force, "--out", note=_cal_note(cal, _kernels_note(p.config.cluster)))
    _write_doc(json_path, report_doc(p, _written([path])), force)
    _verdict_exit(p)


@foreign_options()
def groups(config: Path = typer.Argument(..., help=CONFIG_HELP),
           rank: int = typer.Option(0, "--rank", help="the rank whose start-up print is shown"),
           json_path: Optional[Path] = _json_option("groups"),
           force: bool = typer.Option(False, "--force", help="replace an existing --json file"),
           foreign: Foreign = Foreign()):
    """Print what RANK would print at start-up: its coordinates and every group's ranks, the data axis named as
    the plan's mesh line names it (dp, or dp_shard where the parameters are sharded over it; --json keeps the
    config's names). A mesh that does not fit is still printed, then exits 1 with its reasons."""

    _refuse_existing(json_path, force, "--json")
    p = _load(config, fmt=foreign.fmt, opts=foreign.options())
    if p.mesh is None:
        _write_doc(json_path, groups_doc(p, rank), force)
        _exit_infeasible(p)
    _check_rank(p, rank)
    print_groups(p.mesh, rank, _console(), model_groups(p.mesh, p.config.model, p.config.training.framework), training=p.config.training,
                 origin=p.config.origin)
    _write_doc(json_path, groups_doc(p, rank), force)
    _verdict_exit(p)


@foreign_options()
def memory(config: Path = typer.Argument(..., help=CONFIG_HELP + "; a meshplan TOML's optional [memory] table sets the timeline parameters"),
           out: Path = typer.Option(Path("out/memory"), "--out",
                                    help="folder for the PNG plot(s) (created; out/ is git-ignored)"),
           all_stages: bool = typer.Option(False, "--all-stages", help="every pipeline stage, not only the most loaded"),
           json_path: Optional[Path] = _json_option("memory"),
           force: bool = typer.Option(False, "--force", help="replace an existing PNG or --json file. Without it, a PNG "
                                       "meshplan wrote under out/ (the default out/memory) and unchanged since is "
                                       "replaced; any other existing PNG (as in an explicit --out) is refused after "
                                       "the timeline is printed, an existing --json before planning (exit 2, "
                                       "nothing written)"),
           foreign: Foreign = Foreign()):
    """Memory timeline of one training step: peak, headroom, events by kind, and a PNG per stage shown."""

    check_destination(out, "--out", force=True, folder=True)  # a writable folder before the work
    _refuse_existing(json_path, force, "--json")
    p = _load(config, fmt=foreign.fmt, opts=foreign.options())
    if isinstance(p, Infeasible):
        _write_doc(json_path, envelope("memory", p, stages=[], persistent_bytes={}, pngs=[]), force)
        _exit_infeasible(p)
    shown = p.timelines if all_stages else (p.timeline,)
    paths = [out / f"{config.stem}_memory_stage{tl.stage}.png" for tl in shown]
    print_memory(p, _console(), all_stages=all_stages)  # the timeline even when a PNG is refused (n26small #1)
    for path in paths:  # which stage is plotted is known only now; nothing is written if one is refused
        check_destination(path, "--out", force, create_folders=True)  # in the folder checked above
    for tl, path in zip(shown, paths):
        _wrote(write_png(tl, path, name=config.name, force=force))
    _write_doc(json_path, memory_doc(p, all_stages, [str(x) for x in paths]), force)
    _verdict_exit(p)

