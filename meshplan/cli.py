"""Command line: thin wrappers over :func:`meshplan.plan.build_plan` and the reports.

Every malformed input ends with one line ``error: <field>: <message>`` on stderr and exit
status 2 (degrees whose product is not the world among them: :func:`_load`); an infeasible
mesh prints its reasons and exits 1.

One verdict everywhere (:data:`EXIT_CODES`): every command that resolves a mesh (plan, groups,
memory, step, reliability, place, nccl-check) exits 1 and prints ``infeasible: <reason>`` on stderr when
``meshplan plan`` calls the mesh infeasible, whatever it printed before; ``step`` then prints
only the step the mesh would take, labelled ``would be ... if it fit``. ``compare`` exits 0
when a mesh that fits wins (the other's infeasibility is one of the verdict's reasons) and 1
when neither fits; ``search`` exits 0 when some candidate fits and 1 when none does.

Every command takes ``--json PATH`` (its document, schema ``meshplan/schemas/<command>.v1.schema.json``,
a group's command as ``<group>-<command>``); ``--json -`` prints the document alone on stdout and
moves everything else the command prints to stderr (:func:`_json_to_stdout`, applied to every
command once they are registered); so does ``-o -`` of import, export and search --export (the
file on stdout). Every other output option refuses ``-``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from meshplan import catalog
from meshplan.comm.calibrate import calibrate
from meshplan.comm.calibration import (
    apply_calibration,
    calibration_doc,
    calibration_toml,
    load_calibration,
)
from meshplan.comm.nccl_check import check_log
from meshplan.comm.nccl_log import read_nccl_log
from meshplan.compare import compare, compare_html, compare_to_dict, evidence_folder, table_rows, write_evidence
from meshplan.compute.gemm import load_gemm_table
from meshplan.errors import ConfigError, check_number, printable
from meshplan.fileio import check_destination, write_output
from meshplan.interop.common import FORMATS, ImportOptions
from meshplan.interop.deepspeed import DS_SCOPE
from meshplan.interop.foreign import (UserFile, export, import_text, load_any, search_export_refusal,
                                      search_row_refusal, user_source)
from meshplan.mesh.tpsplit import model_groups
from meshplan.mesh.resolve import world_error
from meshplan.mesh.validity import input_error
from meshplan.placement.assign import rank_row
from meshplan.placement.bindings import LAUNCH_VISIBLE, bindings, write_bindings
from meshplan.placement.choice import choose_placement, for_command, weights_from_plan
from meshplan.placement.launch import LaunchOptions, check_launch_folder, write_launch
from meshplan.placement.topology import (
    check_identity_nic_map,
    load_topology,
    node_from_topology,
)
from meshplan.plan import Infeasible, Plan, build_plan, config_warnings, export_refusals, run_reasons
from meshplan.reliability import reliability as rel
from meshplan.restart import checkpoint_engine, engine_rules, plan_evaluator, restart_on_fewer_nodes
from meshplan.report import shown
from meshplan.report.html_pages import plan_page, search_page
from meshplan.report.json_docs import (
    bench_attention_doc,
    bench_comm_doc,
    bench_gemm_doc,
    calibrate_doc,
    catalog_doc,
    envelope,
    export_doc,
    groups_doc,
    import_doc,
    launch_doc,
    memory_doc,
    nccl_check_doc,
    place_doc,
    reliability_doc,
    report_doc,
    step_doc,
    step_infeasible_doc,
    testbed_down_doc,
    testbed_up_doc,
    to_json,
    validate_doc,
    validate_slice_doc,
)
from meshplan.report.json_out import plan_to_dict
from meshplan.report.memory import print_memory
from meshplan.report.memory_plot import write_png
from meshplan.report.place_text import launch_lines, place_lines
from meshplan.report.search import ProgressBar, infeasible_line, print_search, search_to_dict
from meshplan.report.text import print_groups, print_plan
from meshplan.runtime.bench.comm import parse_sizes, run_bench
from meshplan.runtime.testbed.netns import main_down, main_up
from meshplan.runtime.validation.slice import MARKER as SLICE_MARKER
from meshplan.runtime.validation.slice import main as slice_main
from meshplan.limits import MAX_MICRO_BATCHES
from meshplan.runtime.validation.validate import Options
from meshplan.runtime.validation.validate import main as validate_main
from meshplan.schedule.linkload import concurrency, edge_loads, timings
from meshplan.schedule.placement_score import step_scorer
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.overlap_policy import megatron_reduce_line
from meshplan.schedule.steptime import step_time
from meshplan.schedule.tp_overlap_lines import ideal_tp_overlap_line, tp_overlap_line
from meshplan.schedule.verdict import network_verdict, rebuilt_step
from meshplan.schedule.waits import bubble_wait
from meshplan.search.driver import search
from meshplan.search.candidate import candidate_config
from meshplan.spec.mesh import Schedule
from meshplan.spec.wording import schedule_words

EXIT_CODES = ("exit status: 0 feasible (compare: a mesh that fits wins; search: some candidate fits), "
              "1 infeasible (the reasons on stderr as 'infeasible: ...'; groups, place, nccl-check and step still print "
              "what they show, step labelled 'would be ... if it fit') or a measured difference, "
              "2 malformed input (degrees whose product is not the world and counts that disagree included), or a "
              "log nccl-check cannot check (one line 'error: <field>: <what is wrong>')")

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Design, check and validate parallel meshes for distributed training. " + EXIT_CODES + ".")


#: CONFIG of a command that reads foreign configs directly (plan, report, groups, memory, step, reliability,
#: search, export), and of one that reads meshplan TOML only (a foreign config: import it first).
CONFIG_HELP = ("meshplan TOML config ([model], [cluster], [training], [mesh]), or a torchtitan job TOML, Megatron-LM "
               "arguments (file or launch script) or DeepSpeed JSON, read directly with --cluster/--nodes")
TOML_ONLY_HELP = "meshplan TOML config (a torchtitan, Megatron-LM or DeepSpeed file: meshplan import it first)"
FORMAT_HELP = ("format of CONFIG: " + ", ".join(FORMATS) + " (default: detected; a torchtitan job TOML, Megatron-LM "
               "arguments or a DeepSpeed JSON is read directly)")
CLUSTER_HELP = "foreign configs: catalog node of the cluster (e.g. dgx-h100), which they do not say"
NODES_HELP = "foreign configs: number of nodes (default: a launch script's --nnodes)"
GPU_HELP = "foreign configs: catalog GPU replacing the node's"
MODEL_HELP = "foreign configs: catalog model or HF config.json (DeepSpeed needs it; replaces the file's model)"
SEQ_HELP = "foreign configs: tokens per sequence (DeepSpeed needs it)"

# The foreign-config options, defined once and shared by plan, step, search, export (and, without
# --format, import): what a torchtitan, Megatron-LM or DeepSpeed file does not say.
FormatOpt = Annotated[Optional[str], typer.Option("--format", help=FORMAT_HELP)]
ClusterOpt = Annotated[Optional[str], typer.Option("--cluster", help=CLUSTER_HELP)]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help=NODES_HELP)]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", help=GPU_HELP)]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help=MODEL_HELP)]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help=SEQ_HELP)]
CALIBRATION_HELP = ("calibration TOML (meshplan calibrate or bench comm): its alpha-beta fit per link class replaces "
                    "the cluster's link bandwidths and latencies; a header line names the file, its GPU and those bandwidths, "
                    "and a warning line a GPU that is not the cluster's")
# Shared by plan, step, compare (both configs) and search: the measured links they all time with.
CalibrationOpt = Annotated[Optional[Path], typer.Option("--calibration", help=CALIBRATION_HELP)]


def _opts(cluster, nodes, gpu, model, seq_len) -> ImportOptions:
    return ImportOptions(cluster=cluster, nodes=nodes, gpu=gpu, model=model, seq_len=seq_len)



def _echo(text, err: bool = False) -> None:
    """``typer.echo`` with whatever came from input made printable (control characters and
    escape sequences escaped, :func:`meshplan.errors.printable`); newlines of multi-line text
    kept."""
    typer.echo(printable(str(text), keep_newlines=True), err=err)


def _wrote(path) -> None:
    """The ``wrote PATH`` line, the path on one printable line."""
    _echo(f"wrote {printable(str(path))}")


def _load(config: Path, topology: Optional[Path] = None, calibration: Optional[Path] = None,
          fmt: Optional[str] = None, opts: Optional[ImportOptions] = None,
          unresolved: bool = False) -> Plan | Infeasible:
    """Plan of ``config`` (a meshplan TOML, or with ``opts`` given a foreign config, ``fmt``
    or detected, ``opts`` filling what it does not say); ``topology`` (nvidia-smi topo -m text
    or NCCL topology XML) replaces the node's sockets and NIC affinity, ``calibration``
    (meshplan calibration TOML) the link bandwidths and latencies. Malformed input is a
    ConfigError (exit 2, one line): degrees that cannot make the world
    (:func:`~meshplan.mesh.resolve.world_error`; with ``unresolved``, as ``compare`` plans two
    configs, such a plan is returned, infeasible) and counts that disagree
    (:func:`~meshplan.mesh.validity.input_error`)."""

    cfg = load_any(config, fmt, opts or ImportOptions(), foreign=opts is not None)
    _notes(cfg)
    plan = build_plan(_measured_cluster(cfg, topology, calibration))
    if isinstance(plan, Infeasible) and cfg.mesh is not None:  # malformed, not infeasible: exit 2
        bad = input_error(cfg.model, cfg.training, plan.mesh, cfg.mesh) if plan.mesh is not None else \
            None if unresolved else world_error(cfg.mesh, cfg.cluster.world, cfg.cluster.node.gpus)
        if bad is not None:
            raise bad
    return plan


def _measured_cluster(cfg, topology: Optional[Path] = None, calibration: Optional[Path] = None):
    """``cfg`` with its cluster's node replaced by ``topology`` (nvidia-smi topo -m text or
    NCCL topology XML) and its links by ``calibration`` (:func:`apply_calibration`); ``cfg``
    itself when neither is given. The one place plan, step, compare and search apply them."""
    if not (topology or calibration):
        return cfg
    cluster = cfg.cluster
    if topology:
        node = node_from_topology(load_topology(topology), cluster.node)
        for w in check_identity_nic_map(node):
            _echo(f"warning: {w}", err=True)
        cluster = cluster.model_copy(update={"node": node})
    if calibration:
        cluster = apply_calibration(cluster, load_calibration(calibration))
    return replace(cfg, cluster=cluster)


def _calibration(calibration: Optional[Path], cluster) -> Optional[dict]:
    """``--calibration``'s entry of the --json documents, its ``line`` the header plan, step,
    search and compare print (:func:`calibration_doc`: ``links calibrated from cal.toml on
    NVIDIA H100 80GB HBM3: nvlink 450 GB/s, nic 45 GB/s``), and print that line and a
    ``warning:`` line per GPU model of the file that is not ``cluster``'s
    (:func:`~meshplan.comm.calibration.gpu_warnings`); None without a calibration."""
    if not calibration:
        return None
    doc = calibration_doc(calibration, load_calibration(calibration), cluster)
    _echo(doc["line"])
    for w in doc["warnings"]:
        _echo(f"warning: {w}")
    return doc


def _cal_note(cal: Optional[dict]) -> str:
    """The HTML pages' header note of ``--calibration``: its line, then its GPU warnings."""
    return "; ".join([cal["line"], *(f"warning: {w}" for w in cal["warnings"])]) if cal else ""


def _calibrated(doc: dict, cal: Optional[dict]) -> dict:
    """``doc`` with its ``calibration`` entry when a calibration was given."""
    return {**doc, "calibration": cal} if cal else doc


def _notes(cfg) -> None:
    """The reader's notes (an axis alias renamed, a foreign file's unused fields) on stderr."""
    for n in cfg.notes:
        typer.echo(f"note: {n}", err=True)


def _console() -> Console:
    """A console at least 160 columns wide (wider when the terminal or COLUMNS says so), so
    the collective tables keep whole numbers."""
    return Console(width=max(160, shutil.get_terminal_size((160, 40)).columns))


def _infeasible(plan, who: str = "") -> None:
    """Print the plan's reasons as ``infeasible: [who: ]<reason>`` on stderr (the verdict line
    of every command that resolves a mesh)."""
    for r in plan.reasons:
        _echo(f"infeasible: {who + ': ' if who else ''}{r}", err=True)


def _verdict_exit(plan) -> None:
    """Exit 1 after the verdict lines when ``plan`` is infeasible; return when it fits."""
    if not plan.feasible:
        _exit_infeasible(plan)


def _exit_infeasible(plan: Plan | Infeasible) -> NoReturn:
    """The verdict lines of ``plan``, then exit 1."""
    _infeasible(plan)
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


def _json_option(command: str):
    return typer.Option(None, "--json", help=f"write the result as JSON to PATH, or with - to stdout (the rest of "
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


def _write_plan_html(p: Plan | Infeasible, path: Path, name: str, force: bool, field: str = "--html",
                     note: str = "") -> None:
    """The HTML report of ``p`` (with its predicted step when it was planned; ``note``: a header line)."""
    st = step_time(p) if isinstance(p, Plan) else None
    _wrote(write_output(path, plan_page(p, st, name, note), force, field))


def _check_rank(plan, rank: int) -> None:
    if not 0 <= rank < plan.world:
        raise ConfigError("--rank", f"{rank} outside 0..{plan.world - 1}")


@app.command()
def plan(config: Path = typer.Argument(..., help=CONFIG_HELP),
         json_path: Optional[Path] = typer.Option(None, "--json", help="write the whole plan (every group) as JSON "
                                                  "to PATH, or with - to stdout (the rest of the output then on "
                                                  "stderr)"),
         rank: int = typer.Option(0, "--rank", help="rank whose groups and placement are printed"),
         html_path: Optional[Path] = _html_option("the plan report"),
         force: bool = typer.Option(False, "--force", help="replace existing --json and --html files"),
         topology: Optional[Path] = typer.Option(None, "--topology", help="nvidia-smi topo -m text or NCCL topology XML"),
         calibration: CalibrationOpt = None,
         fmt: FormatOpt = None,
         cluster: ClusterOpt = None,
         nodes: NodesOpt = None,
         gpu: GpuOpt = None,
         model: ModelOpt = None,
         seq_len: SeqLenOpt = None):
    """Plan one mesh: constraints, degrees, groups, placement, shapes, memory, collectives. CONFIG may be a
    torchtitan job TOML, Megatron-LM arguments or a DeepSpeed JSON (the cluster from --cluster/--nodes)."""

    _refuse_existing(json_path, force, "--json")  # refused before the work and the report, as compare --out
    _refuse_existing(html_path, force, "--html")
    p = _load(config, topology, calibration, fmt, _opts(cluster, nodes, gpu, model, seq_len))
    if p.mesh is not None:
        _check_rank(p, rank)
    cal = _calibration(calibration, p.config.cluster)
    print_plan(p, rank=rank, console=_console())
    _write_text(json_path, json.dumps(_calibrated(plan_to_dict(p), cal), separators=(",", ":")), force)
    if html_path:
        _write_plan_html(p, html_path, config.name, force, note=_cal_note(cal))
    _verdict_exit(p)


@app.command()
def report(config: Path = typer.Argument(..., help=CONFIG_HELP),
           out: Optional[Path] = typer.Option(None, "--out", help="HTML file (default: out/report/ and CONFIG's "
                                                                  "name with .html; an existing file is refused "
                                                                  "unless --force)"),
           json_path: Optional[Path] = _json_option("report"),
           force: bool = typer.Option(False, "--force", help="replace existing --out and --json files"),
           fmt: FormatOpt = None,
           cluster: ClusterOpt = None,
           nodes: NodesOpt = None,
           gpu: GpuOpt = None,
           model: ModelOpt = None,
           seq_len: SeqLenOpt = None):
    """One self-contained HTML page of the plan: verdict, input, groups, shapes, memory timeline plot, collective
    table, step time with the pipeline Gantt chart and link-load bars. A mesh that does not fit is still reported,
    then exits 1 with its reasons."""

    path = out or Path("out") / "report" / (config.stem + ".html")  # defaults go under out/ (README "Outputs")
    _refuse_existing(path, force, "--out")
    _refuse_existing(json_path, force, "--json")
    p = _load(config, fmt=fmt, opts=_opts(cluster, nodes, gpu, model, seq_len))
    _write_plan_html(p, path, config.name, force, "--out")
    _write_doc(json_path, report_doc(p, _written([path])), force)
    _verdict_exit(p)


@app.command()
def groups(config: Path = typer.Argument(..., help=CONFIG_HELP),
           rank: int = typer.Option(0, "--rank", help="the rank whose start-up print is shown"),
           json_path: Optional[Path] = _json_option("groups"),
           force: bool = typer.Option(False, "--force", help="replace an existing --json file"),
           fmt: FormatOpt = None,
           cluster: ClusterOpt = None,
           nodes: NodesOpt = None,
           gpu: GpuOpt = None,
           model: ModelOpt = None,
           seq_len: SeqLenOpt = None):
    """Print what RANK would print at start-up: its coordinates and every group's ranks, the data axis named as
    the plan's mesh line names it (dp, or dp_shard where the parameters are sharded over it; --json keeps the
    config's names). A mesh that does not fit is still printed, then exits 1 with its reasons."""

    _refuse_existing(json_path, force, "--json")
    p = _load(config, fmt=fmt, opts=_opts(cluster, nodes, gpu, model, seq_len))
    if p.mesh is None:
        _write_doc(json_path, groups_doc(p, rank), force)
        _exit_infeasible(p)
    _check_rank(p, rank)
    print_groups(p.mesh, rank, _console(), model_groups(p.mesh, p.config.model), p.config.training.sharding)
    _write_doc(json_path, groups_doc(p, rank), force)
    _verdict_exit(p)


@app.command()
def memory(config: Path = typer.Argument(..., help=CONFIG_HELP + "; a meshplan TOML's optional [memory] table sets the timeline parameters"),
           out: Path = typer.Option(Path("out/memory"), "--out",
                                    help="folder for the PNG plot(s) (created; out/ is git-ignored)"),
           all_stages: bool = typer.Option(False, "--all-stages", help="every pipeline stage, not only the most loaded"),
           json_path: Optional[Path] = _json_option("memory"),
           force: bool = typer.Option(False, "--force", help="replace existing PNG and --json files"),
           fmt: FormatOpt = None,
           cluster: ClusterOpt = None,
           nodes: NodesOpt = None,
           gpu: GpuOpt = None,
           model: ModelOpt = None,
           seq_len: SeqLenOpt = None):
    """Memory timeline of one training step: peak, headroom, events by kind, and a PNG per stage shown."""

    check_destination(out, "--out", force=True, folder=True)  # a writable folder before the work
    for old in _memory_plots(out, config.stem):  # before the work: which stage is plotted is known after it
        check_destination(old, "--out", force)
    _refuse_existing(json_path, force, "--json")
    p = _load(config, fmt=fmt, opts=_opts(cluster, nodes, gpu, model, seq_len))
    if isinstance(p, Infeasible):
        _write_doc(json_path, envelope("memory", p, stages=[], persistent_bytes={}, pngs=[]), force)
        _exit_infeasible(p)
    shown = p.timelines if all_stages else (p.timeline,)
    paths = [out / f"{config.stem}_memory_stage{tl.stage}.png" for tl in shown]
    for path in paths:
        check_destination(path, "--out", force, create_folders=True)  # in the folder checked above
    print_memory(p, _console(), all_stages=all_stages)
    for tl, path in zip(shown, paths):
        _wrote(write_png(tl, path, name=config.name, force=force))
    _write_doc(json_path, memory_doc(p, all_stages, [str(x) for x in paths]), force)
    _verdict_exit(p)


def _memory_plots(out: Path, stem: str) -> list[Path]:
    """The PNGs ``memory`` writes for config ``stem`` that already exist in ``out``
    (``<stem>_memory_stage<k>.png``, any stage k: the stage shown, the most loaded, is known
    only once planned), refused before planning unless ``--force``."""
    return sorted(out.glob(f"{glob.escape(stem)}_memory_stage*.png")) if out.is_dir() else []


def _overlap(overlap_tp: bool, no_prefetch: bool):
    return Overlap(tp=overlap_tp, fsdp_prefetch=not no_prefetch)


@app.command()
def step(config: Path = typer.Argument(..., help=CONFIG_HELP),
         trace: Optional[Path] = typer.Option(None, "--trace", help="write the predicted timeline (Chrome/Perfetto JSON)"),
         overlap_tp: bool = typer.Option(False, "--overlap-tp", help="with training.tp_comm_overlap off: assume TP "
                                         "communication overlaps compute, ideally (whole GEMMs), and print its exposed "
                                         "tp, compute and step against blocking TP; with it on, ignored "
                                         "(a note says so): the config's model, the runtimes' decomposed GEMMs, runs"),
         no_prefetch: bool = typer.Option(False, "--no-prefetch", help="no FSDP all-gather prefetch"),
         gemm_table: Optional[Path] = typer.Option(None, "--gemm-table", help="measured GEMM times (meshplan bench gemm)"),
         schedule: Optional[str] = typer.Option(None, "--schedule", help="gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv or dualpipev "
                                                                        "(zbv and dualpipev: virtual_stages 2, a V; "
                                                                        "at pp 1 a note says it changes nothing)"),
         json_path: Optional[Path] = _json_option("step"),
         force: bool = typer.Option(False, "--force", help="replace existing --trace and --json files"),
         calibration: CalibrationOpt = None,
         fmt: FormatOpt = None,
         cluster: ClusterOpt = None,
         nodes: NodesOpt = None,
         gpu: GpuOpt = None,
         model: ModelOpt = None,
         seq_len: SeqLenOpt = None):
    """Scheduled rank timeline: step time and its parts on the critical stage (compute + bubble + exposed
    communication), critical path, exposed communication, bubble (FSDP waits apart under pp), MFU; how much of the
    critical stage's bubble waits for communication another stage exposes (an MoE's ep all-to-alls behind a dense
    first stage); when the step is network-bound (exposed communication and that wait half the step or more), a
    verdict naming the communication and its cause. A mesh that does not fit exits 1 with its reasons after one
    line 'step would be X s ... if it fit'."""

    if schedule is not None and schedule not in {x.value for x in Schedule}:
        raise ConfigError("--schedule", f"unknown schedule {schedule!r}; use " + ", ".join(x.value for x in Schedule))
    if trace:
        check_destination(trace, "--trace", force)
    _refuse_existing(json_path, force, "--json")
    p = _load(config, calibration=calibration, fmt=fmt, opts=_opts(cluster, nodes, gpu, model, seq_len))
    cal = _calibration(calibration, p.config.cluster)
    if isinstance(p, Infeasible):
        _write_doc(json_path, _calibrated(envelope("step", p, step_s=None), cal), force)
        _exit_infeasible(p)
    table = load_gemm_table(gemm_table) if gemm_table else None
    unscheduled = schedule if schedule is not None and p.mesh.degree("pp") == 1 else None
    schedule = None if unscheduled else schedule  # pp 1: nothing to schedule (as --overlap-tp at tp 1)
    ideal_tp = overlap_tp and not p.config.training.tp_comm_overlap  # with it on, the config's model runs alone
    st = _step_with(p, _overlap(ideal_tp, no_prefetch), table, schedule)
    if not p.feasible:
        sched = schedule_words(st.pipeline.spec.schedule, st.pipeline.spec.p)  # "no pipeline" at pp 1
        _echo(f"step would be {st.step_s:.3f} s ({sched}, MFU {st.mfu:.1%}) if it fit; "
                   f"it does not fit")
        _write_doc(json_path, _calibrated(step_infeasible_doc(p, st), cal), force)
        _verdict_exit(p)
    for line in st.lines():
        _echo(line)
    tp = tp_overlap_line(p, st, lambda alt: _step_with(alt, _overlap(False, no_prefetch), table, schedule))
    if overlap_tp and not tp:
        tp = ideal_tp_overlap_line(p, st, _step_with(p, _overlap(False, no_prefetch), table, schedule))
    if tp:
        _echo(tp)
    if megatron_reduce_line(p.config.training):
        _echo(megatron_reduce_line(p.config.training))
    if unscheduled:
        _echo(f"note: --schedule {unscheduled} changes nothing: pp 1 has no pipeline to schedule")
    if overlap_tp and p.mesh.degree("tp") < 2:
        _echo("note: --overlap-tp changes nothing: tp 1 has no TP collectives")
    elif overlap_tp and p.config.training.tp_comm_overlap:
        _echo("note: --overlap-tp ignored: training.tp_comm_overlap is on, and the config's model of it (the line "
              "above) is what the step runs; --overlap-tp (ideal overlap of whole GEMMs) applies with it off")

    again = rebuilt_step(p, lambda alt: _step_with(alt, _overlap(ideal_tp, no_prefetch), table, schedule))
    bw = bubble_wait(st)  # once: the verdict's lines and the JSON's most_exposed_stage both use it
    verdict = network_verdict(p, st, again, bw=bw)
    for line in verdict:
        _echo(line)
    path = st.critical_path()
    _echo(f"critical path ({len(path)} entries{', first 12 and last 6' if len(path) > 18 else ''}):")
    for line in (path if len(path) <= 18 else path[:12] + ["..."] + path[-6:]):
        _echo(f"  {line}")
    _print_links(p, st)
    if trace:
        _wrote(st.write_trace(trace, force=force))
    _write_doc(json_path, _calibrated(step_doc(p, st, verdict, str(trace) if trace else None, bw=bw), cal), force)


def _step_with(p, overlap, table, schedule: Optional[str]):
    """``step_time`` of ``p``; with ``--schedule`` given, the schedule's own refusal (ZB-V
    without virtual_stages 2, interleaved 1F1B with m not a multiple of p, a chunked mesh
    under a one-chunk schedule) names ``--schedule``, the value that brought it."""
    try:
        return step_time(p, overlap, table=table, schedule=schedule)
    except ConfigError as e:
        if schedule is None or e.field not in ("mesh.pp_schedule", "mesh.virtual_stages"):
            raise
        raise ConfigError("--schedule", f"{schedule}: {e.message}; choose a schedule this mesh allows, or set "
                          f"the config's virtual stages to what {schedule} needs") from None


def _print_links(p, st) -> None:
    """Readiness of each collective kind, concurrency and the load on each physical edge."""

    _echo("collectives on stage 0, first occurrence (ms from step start): ready, deadline, duration, slack "
          "(deadline - ready - duration: 0 when the next op waits for it, < 0 exposed; a cp K/V all-gather's "
          "deadline is the end of the Q projection it runs beside)")
    for t in timings(st):
        _echo(f"  {st.named(t.stream):13s} {t.phase:8s} {t.op:15s} {t.ready_s * 1e3:10.3f} {t.deadline_s * 1e3:10.3f} "
                   f"{t.duration_s * 1e3:9.3f} {t.slack_s * 1e3:10.3f}")
    for (a, b), sec in sorted(concurrency(st).items()):
        _echo(f"concurrent: {st.named(a)} and {st.named(b)} overlap {sec * 1e3:.1f} ms per step (shared copy engines and links)")
    _echo("edge load per step (busy = bytes / capacity; must fit the stage's compute time, and per layer "
               "the layer's forward + backward time)")
    for e in edge_loads(p, st):
        verdict = "fits" if e.fits else "DOES NOT FIT"
        _echo(f"  {e.edge:36s} {e.bytes_per_step / 1e9:10.1f} GB  busy {e.busy_s:8.3f} s of {e.interval_s:8.3f} s; "
                   f"per layer {e.per_layer_bytes / e.capacity_bytes_per_s * 1e3:8.3f} of "
                   f"{e.layer_interval_s * 1e3:8.3f} ms: {verdict}")


@app.command()
def reliability(config: Path = typer.Argument(..., help=CONFIG_HELP),
                write_gbps: float = typer.Option(..., "--write-gbps", help="aggregate checkpoint write bandwidth, GB/s"),
                read_gbps: float = typer.Option(..., "--read-gbps", help="aggregate checkpoint read bandwidth, GB/s"),
                rank_gbps: Optional[float] = typer.Option(
                    None, "--rank-gbps", help="storage bandwidth of one rank, GB/s: times the bytes the busiest rank "
                                              "writes under DCP (its share of replicated shards) or DeepSpeed's save_checkpoint, and reads back"),
                restart_overhead_s: float = typer.Option(..., "--restart-overhead-s",
                                                         help="detection + rescheduling + start-up, seconds"),
                lost_nodes: Optional[int] = typer.Option(
                    None, "--lost-nodes", help="nodes lost in the restart scenario (default 1); given, a restart "
                                               "that cannot run makes the command exit 1"),
                spare_nodes: int = typer.Option(0, "--spare-nodes", help="spare nodes available"),
                json_path: Optional[Path] = _json_option("reliability"),
                force: bool = typer.Option(False, "--force", help="replace an existing --json file"),
                fmt: FormatOpt = None,
                cluster: ClusterOpt = None,
                nodes: NodesOpt = None,
                gpu: GpuOpt = None,
                model: ModelOpt = None,
                seq_len: SeqLenOpt = None):
    """Failure domains, interruptions per day, checkpoint size and interval, goodput, restart."""

    for name, v in (("--write-gbps", write_gbps), ("--read-gbps", read_gbps)) + ((("--rank-gbps", rank_gbps),)
                                                                              if rank_gbps is not None else ()):
        check_number(name, v, 1e-3, 1e6, "GB/s", "1 MB/s to 1 PB/s: beyond every storage system, and the write "
                     "and read times stay finite")
    check_number("--restart-overhead-s", restart_overhead_s, 0.0, 1e6, "s", "up to 11.6 days")
    asked = lost_nodes is not None  # the default scenario is a what-if: it informs, it does not fail the command
    lost_nodes = 1 if lost_nodes is None else lost_nodes
    check_number("--lost-nodes", lost_nodes, 0, 10 ** 7, "nodes")
    check_number("--spare-nodes", spare_nodes, 0, 10 ** 7, "nodes")
    _refuse_existing(json_path, force, "--json")
    p = _load(config, fmt=fmt, opts=_opts(cluster, nodes, gpu, model, seq_len))
    if isinstance(p, Infeasible):
        _write_doc(json_path, envelope("reliability", p), force)
        _exit_infeasible(p)
    if lost_nodes > p.config.cluster.nodes:
        nodes = p.config.cluster.nodes
        raise ConfigError("--lost-nodes", f"{lost_nodes} is more than the cluster's {nodes} node{'s' * (nodes != 1)}")
    r = rel(p, write_bandwidth_bytes_per_s=write_gbps * 1e9, read_bandwidth_bytes_per_s=read_gbps * 1e9,
            restart_overhead_s=restart_overhead_s,
            per_rank_bandwidth_bytes_per_s=rank_gbps * 1e9 if rank_gbps else None)
    for line in r.lines():
        _echo(line)
    t = p.config.training
    before = step_time(p, Overlap())  # the throughput a restart loses is against the plan's own step
    pipeline, degrees = engine_rules(p)  # within what the engine runs (DeepSpeed: the data axis, pp where it can)
    rs = restart_on_fewer_nodes(p.mesh, lost_nodes, gpus_per_node=p.config.cluster.node.gpus,
                                global_batch=t.global_batch, micro_batch=t.micro_batch, spare_nodes=spare_nodes,
                                micro_batch_reasons=lambda pp, m: run_reasons(p.spec.pp_schedule, pp, m, p.vpp,
                                                                              t.pp_schedule_runs, t.framework),
                                pipeline=pipeline, degrees=degrees, sharding=t.sharding,
                                checkpoint=checkpoint_engine(t),
                                old_infeasible="" if p.feasible else f"infeasible: {p.reasons[0]}",
                                evaluate=plan_evaluator(p, p.config.cluster.nodes - max(0, lost_nodes - spare_nodes)),
                                old_step=(before.step_s, before.tokens_per_s))
    for line in rs.lines():
        _echo(line)
    _write_doc(json_path, reliability_doc(p, r, rs), force)
    _verdict_exit(p)
    if not rs.feasible and asked:  # the restart asked for is a verdict too: no GPU or no mesh left is exit 1
        _infeasible(rs, f"restart after losing {lost_nodes} of {p.config.cluster.nodes} nodes ({spare_nodes} spare)")
        raise typer.Exit(1)


@app.command("compare")
def compare_cmd(config_a: Path = typer.Argument(..., help="mesh A: " + TOML_ONLY_HELP),
                config_b: Path = typer.Argument(..., help="mesh B (same model, cluster and workload): " + TOML_ONLY_HELP),
                out: Path = typer.Option(Path("out/compare"), "--out", help="folder for the rejected mesh's evidence"),
                html_path: Optional[Path] = _html_option("both meshes side by side"),
                json_path: Optional[Path] = _json_option("compare"),
                force: bool = typer.Option(False, "--force", help="replace an existing evidence folder, --html and "
                                                                  "--json files"),
                calibration: CalibrationOpt = None):
    """Compare two plans of one workload side by side and keep the rejected one's evidence. Both configs share the
    model, the cluster and the workload's [training] fields (batch, sequence, dtypes); the mesh and the plan's knobs
    (micro_batch, recompute, sharding, reshard_after_forward, tp_comm_overlap, schedule, virtual stages ...) may
    differ, each differing knob shown as a row. Exit 0 when a plan that fits wins or the two are identical or equal on
    every criterion (nothing rejected), 1 when neither fits, identical or not (both reasons printed)."""

    check_destination(out, "--out", force=True, folder=True)  # a writable folder before the work
    _refuse_existing(html_path, force, "--html")
    _refuse_existing(json_path, force, "--json")
    a, b = (_load(c, calibration=calibration, unresolved=True) for c in (config_a, config_b))
    names = (config_a.stem, config_b.stem)
    if names[0] == names[1] and config_a.resolve() != config_b.resolve():
        names = (f"{names[0]}-A", f"{names[1]}-B")  # two files of one name: keep the sides apart
    c = compare(a, b, names=names)  # refuses a different workload (model, cluster, batch ...) naming the field
    evidence_folder(c, out, force)  # refuse an existing folder before printing the report
    cal = _calibration(calibration, a.config.cluster)  # the header line (one cluster: compare refuses two)
    tab = Table(title="compare", title_justify="left")
    for col in ("quantity", c.a.name, c.b.name):
        tab.add_column(shown(col))
    for row in table_rows(c):
        tab.add_row(*(shown(x) for x in row))
    con = _console()
    con.print(tab)
    con.print(f"[bold]verdict:[/] {shown(c.verdict)}")
    if c.decided_by:
        con.print(f"decided by: {c.decided_by}", highlight=False, markup=False)
    for r in c.reasons:
        con.print(f"  - {shown(r)}")
    for side in (c.a, c.b):  # what the framework's runtime does differently (plan prints them as notes)
        for w in config_warnings(side.plan.config):
            con.print(f"warning ({shown(side.name)}): {shown(w)}", highlight=False)
    for path in write_evidence(c, out, force=force, calibration=cal):
        con.print(f"wrote {printable(str(path))}", markup=False)
    if html_path:
        con.print(f"wrote {printable(str(write_output(html_path, compare_html(c, _cal_note(cal)), force, '--html')))}",
                  highlight=False, markup=False)
    _write_doc(json_path, _calibrated(compare_to_dict(c), cal), force)
    if c.none_fit:
        for side in (c.a,) if c.a.name == c.b.name else (c.a, c.b):  # one file given twice: its reasons once
            _infeasible(side.plan, side.name)
        raise typer.Exit(1)


@app.command("search")
def search_cmd(config: Path = typer.Argument(..., help=CONFIG_HELP + "; a meshplan TOML's optional [search] "
                                                      "table sets the search, its [mesh] table is ignored"),
               top: Optional[int] = typer.Option(None, "--top", help="candidates ranked and shown (default: "
                                                                    "[search] top, 10)"),
               json_path: Optional[Path] = typer.Option(None, "--json", help="write the result as JSON to PATH, or "
                                                        "with - to stdout (the rest of the output then on stderr)"),
               html_path: Optional[Path] = _html_option("the top candidates and the rejection counts"),
               force: bool = typer.Option(False, "--force", help="replace existing --json, --html and -o files"),
               export_rank: Optional[int] = typer.Option(None, "--export", help="export the top row of this rank "
                                                         "(1 = the fastest) with --to and -o"),
               to: str = typer.Option("meshplan", "--to", help="export format: " + ", ".join(FORMATS)),
               out: Optional[Path] = typer.Option(None, "-o", "--out", help="file the --export row is written to "
                                                  "(-: stdout, the rest of the output then on stderr)"),
               calibration: CalibrationOpt = None,
               fmt: FormatOpt = None,
               cluster: ClusterOpt = None,
               nodes: NodesOpt = None,
               gpu: GpuOpt = None,
               model: ModelOpt = None,
               seq_len: SeqLenOpt = None):
    """Search every mesh of the workload: reject with reasons, rank by predicted step time. Exit 0 when some
    candidate fits, 1 when none does (then one line instead of the table names the rules that rejected the
    most candidates, their counts, and a fix).

    Searched: degrees of pp, dp_replicate, dp_shard, cp, tp (ep, etp for MoE), micro-batch, recompute
    (op-level "op" under framework torch, tp = cp = ep = 1), vpp (interleaved 1F1B), sharding, training.reshard_after_forward (FSDP), training.tp_comm_overlap
    (tp > 1) and the Llama 3 layer split with lighter first and last stages (pp >= 3); [search] narrows
    each. Order: by step time; candidates within 1% of the fastest not yet listed go toward fewer axes,
    then lower tp*pp*cp*ep, then lower tp. The output names what makes the top faster than #2 (compute,
    bubble, exposed communication per axis, with their seconds), or, where the tie rule listed it before a
    faster candidate, how much longer its step is than the fastest's, naming it. The same input gives the
    same output on any machine ([search] budgets are counts: settle_max, exact_max, refine_max).
    --export N --to FORMAT -o FILE writes row N (its layer split included) as a meshplan TOML, torchtitan
    TOML, Megatron-LM arguments or DeepSpeed JSON. training.fp8_all_gather and training.grad_accumulation
    apply to the FSDP candidates (grad_accumulation with pp 1); the others are planned without them (a note
    says so). training.zero3_engine deepspeed or deepspeed-2021 applies to zero3 candidates with pp 1 (the
    others with zero3 are rejected, rule 'engine'; hsdp is planned with FSDP2; under deepspeed, zero1 and
    zero2 with DeepSpeed's ZeRO-1/2, the same runtime at another stage); training.zero12_engine deepspeed applies to
    zero1 and zero2 candidates (zero2 is searched under it, or zero3_engine deepspeed, only; zero3 candidates
    then run DeepSpeed's ZeRO-3, zero3_engine deepspeed). Under training.framework
    torch zero1 is rejected (rule 'framework': torch and torchtitan have no ZeRO-1 engine) unless
    training.zero12_engine or zero3_engine is deepspeed; a zero1 candidate without a data axis (dp_shard x cp 1) is its
    zero3 twin's run and is listed once, as zero3. --export --to T is refused before the search when T
    takes no row the search can rank (a model without a torchtitan flavor, no zero3/hsdp in [search]
    sharding for torchtitan, no one-data-axis mesh for DeepSpeed), and after it when T refuses row N (one
    line naming the first row T takes). Under DeepSpeed a line says what --export N --to deepspeed of the rows
    shown does not express (training.recompute: the model code chooses activation checkpointing), and under
    training.framework megatron what --export N --to megatron does not (reshard_after_forward false: Megatron
    FSDP reshards after forward) and which rows it refuses (hsdp)."""

    if export_rank is not None:
        if export_rank < 1:
            raise ConfigError("--export", f"{export_rank}: rows are ranked from 1")
        if out is None:
            raise ConfigError("-o", "--export needs -o FILE")
        if to not in FORMATS:
            raise ConfigError("--to", f"{to!r}; use {', '.join(FORMATS)}")
        _refuse_existing(out, force, "-o")
    cfg = load_any(config, fmt, _opts(cluster, nodes, gpu, model, seq_len), require_mesh=False)
    _notes(cfg)
    cfg = _measured_cluster(cfg, calibration=calibration)
    if top is not None:
        check_number("--top", top, 1, 10_000)
        cfg = replace(cfg, search=cfg.search.model_copy(update={"top": top}))
    if export_rank is not None and export_rank > cfg.search.top:  # before the search, not after it
        raise ConfigError("--export", f"{export_rank} > --top {cfg.search.top}: the search lists {cfg.search.top} "
                          f"row(s); pass --top {export_rank} or export a lower rank")
    if export_rank is not None and (refusal := search_export_refusal(cfg, to)) is not None:
        raise ConfigError("--to", refusal)  # a target that refuses every row, before the search
    _refuse_existing(json_path, force, "--json")
    _refuse_existing(html_path, force, "--html")
    cal = _calibration(calibration, cfg.cluster)  # the header line, after the refusals
    with ProgressBar() as bar:
        result = search(cfg, progress=bar)
    print_search(result, _console())
    if export_rank is not None and out is not None:  # its refusals (exit 2) come before any --json document
        if export_rank > len(result.top):
            raise ConfigError("--export", f"{export_rank}: the search ranked {len(result.top)} row(s); raise --top "
                              f"or export a lower rank")
        rows = [candidate_config(result.config, result.candidates, e.index) for e in result.top]
        refusal = search_row_refusal(export_rank, rows, to, lambda c: {t: export_refusals(c, t) for t in FORMATS})
        if refusal is not None:  # one line naming the first row the target takes
            raise ConfigError("--export", refusal)
        _write_export(rows[export_rank - 1], to, out, f"search {config} row {export_rank}", force,
                      user_source(config, fmt))
    _write_text(json_path, json.dumps(_calibrated(search_to_dict(result), cal), indent=1), force)
    if html_path:
        _wrote(write_output(html_path, search_page(result, config.name, _cal_note(cal)), force,
                            '--html'))
    if not result.top:  # the verdict on stderr as every command's exit 1 (EXIT_CODES), after the report on stdout
        _echo(f"infeasible: {infeasible_line(result)}", err=True)
    raise typer.Exit(0 if result.top else 1)


def _write_export(cfg, to: str, out: Path | _Stdout, source: str, force: bool,
                  user: Optional[UserFile] = None) -> list[str]:
    """Write ``cfg`` as ``to`` to ``out`` (``-o -``: stdout), printing the header (source,
    how to import it, what the format does not express, the torchtitan or DeepSpeed settings
    ``user``'s file carries or not); returns the header."""
    refused = {t: export_refusals(cfg, t) for t in FORMATS}
    text, header = export(replace(cfg, notes=()), to, source, user, config_warnings(cfg), refused, _step_s)
    for line in header[1:]:
        typer.echo(line)
    if isinstance(out, _Stdout):
        out.stream.write(text)
        out.stream.flush()
    else:
        _wrote(write_output(out, text, force=force, field='-o'))
    return header


def _step_s(cfg) -> Optional[float]:
    """The predicted step of ``cfg`` in seconds, None when its mesh does not resolve (export's
    round-trip line)."""
    try:
        p = build_plan(cfg)
        return None if isinstance(p, Infeasible) else step_time(p).step_s
    except ConfigError:  # a pipeline the plan refuses (its own export refusal says so)
        return None


@app.command("import")
def import_cmd(fmt: str = typer.Argument(..., metavar="FORMAT", help="torchtitan, megatron or deepspeed (auto: "
                                         "detect)"),
               source: Path = typer.Argument(..., metavar="FILE", help="the foreign config"),
               out: Optional[Path] = typer.Option(None, "-o", "--out", help="meshplan TOML to write (omitted "
                                                  "or -: print it to stdout)"),
               force: bool = typer.Option(False, "--force", help="replace existing -o and --json files"),
               json_path: Optional[Path] = _json_option("import"),
               cluster: ClusterOpt = None,
               nodes: NodesOpt = None,
               gpu: GpuOpt = None,
               model: ModelOpt = None,
               seq_len: SeqLenOpt = None):
    """Read a torchtitan job TOML, Megatron-LM arguments (file or launch script) or DeepSpeed JSON and write the
    meshplan TOML. The fields meshplan does not use are listed by name (in the output and its header); what
    the file does not say (the cluster; a DeepSpeed config's model and sequence length) comes from the
    options."""

    if fmt not in ("auto",) + FORMATS[1:]:
        raise ConfigError("FORMAT", f"{fmt!r}; use torchtitan, megatron, deepspeed or auto")
    file = out if isinstance(out, Path) else None  # None: printed (no -o, or -o -)
    _refuse_existing(file, force, "-o")
    _refuse_existing(json_path, force, "--json")
    text, imp = import_text(source, None if fmt == "auto" else fmt, _opts(cluster, nodes, gpu, model, seq_len))
    if isinstance(out, _Stdout):
        out.stream.write(text)
        out.stream.flush()
    elif file is None:
        typer.echo(text, nl=False)
    else:
        for n in imp.all_notes():
            typer.echo(f"note: {n}")
        _wrote(write_output(file, text, force=force, field='-o'))
    _write_doc(json_path, import_doc(imp.fmt, str(source), imp, text, _written([file] if file else [])), force)


#: ``export --help``: the DeepSpeed scope is the one string its refusal and ``search`` use.
_EXPORT_HELP = (
    "Write a plan's config as a meshplan TOML (its layer split written out), a torchtitan job TOML, "
    f"Megatron-LM arguments or a DeepSpeed config ({DS_SCOPE}). Every meshplan field the target does not "
    "express is listed (re-imported and compared), with the step before and after when it differs, and "
    "what the framework's runtime is known to run differently as warning lines; a mesh the target cannot "
    "run is refused with the reason. From a torchtitan job TOML, a torchtitan file carries the settings "
    "meshplan does not plan ([optimizer], [lr_scheduler], [checkpoint], training.steps, ...) unchanged, "
    "from a DeepSpeed JSON a DeepSpeed file its keys meshplan does not plan (steps_per_print, optimizer, "
    "scheduler, ...), and from Megatron-LM arguments a Megatron-LM file its flags meshplan does not read "
    "(--lr, --train-iters, ...); every key of that file written with another value or dropped is listed; "
    "another target lists them as not carried."
)


@app.command("export", help=_EXPORT_HELP)
def export_cmd(config: Path = typer.Argument(..., help="the plan's " + CONFIG_HELP),
               to: str = typer.Option(..., "--to", help="meshplan, torchtitan, megatron or deepspeed"),
               out: Path = typer.Option(..., "-o", "--out", help="file to write (-: stdout, the header then on "
                                                                   "stderr)"),
               force: bool = typer.Option(False, "--force", help="replace existing -o and --json files"),
               json_path: Optional[Path] = _json_option("export"),
               fmt: FormatOpt = None,
               cluster: ClusterOpt = None,
               nodes: NodesOpt = None,
               gpu: GpuOpt = None,
               model: ModelOpt = None,
               seq_len: SeqLenOpt = None):

    if to not in FORMATS:
        raise ConfigError("--to", f"{to!r}; use {', '.join(FORMATS)}")
    _refuse_existing(out, force, "-o")
    _refuse_existing(json_path, force, "--json")
    cfg = load_any(config, fmt, _opts(cluster, nodes, gpu, model, seq_len))
    _notes(cfg)
    header = _write_export(cfg, to, out, str(config), force, user_source(config, fmt))
    _write_doc(json_path, export_doc(str(config), to, header, _written([] if isinstance(out, _Stdout) else [out])),
               force)


@app.command("nccl-check")
def nccl_check(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its placement is checked"),
               log: Path = typer.Argument(..., help="NCCL_DEBUG=INFO output of the run"),
               json_path: Optional[Path] = _json_option("nccl-check"),
               force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Check that each communicator used the NICs and intra-node links the placement meant. Global ranks come from
    the log's communicator of every rank; a log without one cannot be checked (exit 2). A mesh that does not fit is
    still checked when it can be placed, then exits 1 with its reasons."""

    _refuse_existing(json_path, force, "--json")
    p = _load(config)
    if p.placement is None:
        _exit_infeasible(p)
    expected = {r: rank_row(p.placement, r)["nic"] for r in range(p.world)}
    report = read_nccl_log(log)
    for n in report.notes:  # before the check: they name the lines a "cannot check" (exit 2) comes from
        _echo(f"note: {n}", err=True)
    check = check_log(report, expected)  # a log without the world communicator: exit 2
    for n in check.unchecked:
        _echo(f"note: {n}", err=True)
    diffs = list(check.differences)
    for d in diffs:
        _echo(d)
    _echo(f"{len(diffs)} difference(s) between the NCCL log and the placement")
    _write_doc(json_path, nccl_check_doc(p, str(log), diffs), force)
    _verdict_exit(p)
    raise typer.Exit(1 if diffs else 0)


@app.command()
def validate(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its mesh is scaled to each world size"),
             worlds: str = typer.Option("2,4", "--worlds", help="world sizes run in this order, e.g. 2,4,8"),
             layers: int = typer.Option(2, "--layers", help="layers of the scaled-down model"),
             hidden_div: Optional[int] = typer.Option(None, "--hidden-div",
                                                     help="divide hidden, head_dim, ffn by N (default: to <= 256)"),
             seq_len: int = typer.Option(64, "--seq-len", help="tokens per sequence in the run"),
             vocab: int = typer.Option(512, "--vocab", help="vocabulary of the scaled-down model"),
             steps: int = typer.Option(3, "--steps", help="timed steps (after a recorded and a memory step)"),
             micro_batches: Optional[int] = typer.Option(
                 None, "--micro-batches", help="micro-batches per step of each data-parallel rank (default: the "
                                               "fewest the pipeline schedule runs, e.g. pp for 1F1B, 2 pp for "
                                               "DualPipeV; 1 without pp)"),
             out: Path = typer.Option(Path("validate-out"), "--out", help="evidence folder"),
             timeout_s: float = typer.Option(120.0, "--timeout-s", help="wall-clock limit per world size"),
             tolerance: Optional[float] = typer.Option(None, "--tolerance",
                                                      help="fail when step time (calibrated when probed) or peak "
                                                           "memory is off by more than this fraction, e.g. 0.5; "
                                                           "default: report them without failing"),
             testbed: Optional[str] = typer.Option(None, "--testbed",
                                                   help="prefix of a `meshplan testbed up` cluster to run across"),
             probe: bool = typer.Option(True, "--probe/--no-probe",
                                        help="after the steps, time each of the plan's collectives under the run's "
                                             "load and re-predict the step with those times (calibrated rows), then "
                                             "each axis's message curve, 1 KiB..4 MiB (staged evidence)"),
             nnodes: int = typer.Option(1, "--nnodes", help="hosts of a multi-host run: run the same command on "
                                                            "each with its --node-rank (W / nnodes ranks per host)"),
             node_rank: int = typer.Option(0, "--node-rank", help="this host's node (0 hosts the rendezvous and "
                                                                  "writes the evidence)"),
             rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                         help="HOST:PORT of node 0 for the c10d rendezvous (same on "
                                                              "every host; --out must be a folder all hosts share)"),
             local_addr: Optional[str] = typer.Option(None, "--local-addr",
                                                      help="this host's address the others reach (torchrun "
                                                           "--local-addr), when its FQDN does not resolve there"),
             checkpoint_gbps: Optional[float] = typer.Option(
                 None, "--checkpoint-gbps", help="storage bandwidth of one rank, GB/s: predicts the DCP save and "
                                                 "load times measured after the steps (bytes per rank are "
                                                 "predicted without it)"),
             json_path: Optional[Path] = _json_option("validate"),
             force: bool = typer.Option(False, "--force", help="replace an existing evidence folder and --json "
                                                                "file")):
    """Run the mesh for real (torchrun: NCCL on the GPUs when CUDA is present, else gloo on CPU) and compare
    collectives, times, memory and checkpoint (DCP) writes with the plan; one host, the netns testbed, or
    several hosts (--nnodes/--node-rank/--rdzv-endpoint)."""
    _require_torch("validate")

    try:
        sizes = tuple(int(w) for w in worlds.split(","))
    except ValueError:
        raise ConfigError("--worlds", f"{worlds!r}: give comma-separated integers, e.g. 2,4,8") from None
    for w in sizes:
        check_number("--worlds", w, 1, 4096, "ranks")
    _check_run_options(layers, seq_len, vocab, steps, hidden_div, timeout_s, tolerance)
    if checkpoint_gbps is not None:
        check_number("--checkpoint-gbps", checkpoint_gbps, 1e-3, 1e6, "GB/s")
    if micro_batches is not None:
        check_number("--micro-batches", micro_batches, 1, MAX_MICRO_BATCHES)
    opt = Options(worlds=sizes, layers=layers, hidden_div=hidden_div, seq_len=seq_len, vocab=vocab, steps=steps,
                  micro_batches=micro_batches,
                  timeout_s=timeout_s, tolerance=tolerance, testbed=testbed, probe=probe, nnodes=nnodes,
                  node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, local_addr=local_addr,
                  checkpoint_bytes_per_s=checkpoint_gbps * 1e9 if checkpoint_gbps else None)
    _refuse_existing(json_path, force, "--json")
    code, results = validate_main(str(config), opt, out, force)
    _write_doc(json_path, validate_doc(str(config), code, results, str(out), node_rank), force)
    raise typer.Exit(code)


def _check_run_options(layers: int, seq_len: int, vocab: int, steps: int, hidden_div: Optional[int],
                       timeout_s: float, tolerance: Optional[float]) -> None:
    """The scaled-down run's options of validate and validate-slice, checked as fields (one-line
    error naming the option): whole numbers in range, finite times and tolerance."""
    for name, v, lo, hi in (("--layers", layers, 1, 1024), ("--seq-len", seq_len, 1, 1 << 20),
                            ("--vocab", vocab, 1, 1 << 24), ("--steps", steps, 1, 10_000)):
        check_number(name, v, lo, hi)
    if hidden_div is not None:
        check_number("--hidden-div", hidden_div, 1, 1 << 20)
    check_number("--timeout-s", timeout_s, 1.0, 86400.0, "s")
    if tolerance is not None:
        check_number("--tolerance", tolerance, 1e-6, 1e6, "(fraction)")


@app.command("place")
def place_cmd(config: Path = typer.Argument(..., help=TOML_ONLY_HELP),
              choose: bool = typer.Option(False, "--choose", help="search the rank -> GPU permutation with the shortest predicted step (fewest weak-path bytes at equal steps)"),
              bindings_path: Optional[Path] = typer.Option(None, "--bindings", help="write every rank's binding to this file"),
              fmt: str = typer.Option("json", "--format", help="bindings file format: json (list) or sh (launcher)"),
              force: bool = typer.Option(False, "--force", help="replace existing --bindings and --json files"),
              visible: str = typer.Option(LAUNCH_VISIBLE, "--visible", help="CUDA_VISIBLE_DEVICES per rank, printed "
                                                                   "and in --bindings: all (default, as `meshplan launch`: "
                                                                   "the node's GPUs in LOCAL_RANK order, device "
                                                                   "cuda:{LOCAL_RANK}, as torchtitan's and Megatron-LM's "
                                                                   "scripts use) or one (its own GPU alone, cuda:0)"),
              ranks: Optional[list[int]] = typer.Option(None, "--rank", help="rank whose binding is printed (repeatable; default first, second, last)"),
              json_path: Optional[Path] = _json_option("place")):
    """Placement per axis, decisions and warnings, per-rank bindings (CUDA_VISIBLE_DEVICES, NCCL_IB_HCA, numactl).
    A mesh that does not fit is still placed, then exits 1 with its reasons."""

    if fmt not in ("json", "sh"):
        raise ConfigError("--format", f"{fmt!r} is not one of json, sh")
    if visible not in ("one", "all"):
        raise ConfigError("--visible", f"{visible!r} is not one of one, all")
    if bindings_path:
        check_destination(bindings_path, "--bindings", force)
    _refuse_existing(json_path, force, "--json")
    p = _load(config)
    if p.mesh is None:
        _write_doc(json_path, envelope("place", p), force)
        _exit_infeasible(p)
    shown = ranks or sorted({0, min(1, p.world - 1), p.world - 1})
    for r in shown:
        _check_rank(p, r)
    score = None
    if choose and isinstance(p, Plan):
        score = step_scorer(p)
    c = choose_placement(p.mesh, p.config.cluster, (weights_from_plan(p) or None) if isinstance(p, Plan) else None,
                         rank_to_gpu=p.spec.rank_to_gpu, search=choose, source="collective table", step_s=score,
                         schedule=p.spec.pp_schedule, vpp=p.vpp)
    for line in place_lines(c, shown, visible=visible):
        _echo(line)
    if bindings_path:
        _wrote(write_bindings(bindings_path, c.placement, fmt=fmt, force=force, visible=visible))
    _write_doc(json_path, place_doc(p, c, [bindings(c.placement, r, visible=visible) for r in shown]), force)
    _verdict_exit(p)


@app.command("launch")
def launch_cmd(config: Path = typer.Argument(..., help=TOML_ONLY_HELP),
               program: Optional[list[str]] = typer.Argument(None, metavar="-- PROGRAM...",
                                                            help="the training command each rank runs, after `--` "
                                                                 "(e.g. -- python train.py --job.config_file x.toml)"),
               out: Optional[Path] = typer.Option(None, "--out", help="folder for bind.sh, torchrun.sh, job.sbatch "
                                                                         "and bindings.json (default: out/launch/ "
                                                                         "and CONFIG's name, refused when it holds "
                                                                         "files unless --force)"),
               rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                           help="HOST:PORT of node 0 for the c10d rendezvous "
                                                                "(default: Slurm's first host at --port; "
                                                                "MESHPLAN_RDZV_ENDPOINT overrides it at run time)"),
               port: int = typer.Option(29500, "--port", help="rendezvous port with Slurm's first host"),
               hosts: Optional[str] = typer.Option(None, "--hosts", help="comma-separated host names, one per node "
                                                                         "(Slurm --nodelist)"),
               transport: str = typer.Option("ib", "--transport", help="ib (NCCL_IB_HCA per rank) or socket "
                                                                      "(NCCL_SOCKET_IFNAME per rank)"),
               nic_scope: str = typer.Option("rank", "--nic-scope", help="rank (only the rank's NIC) or node "
                                                                        "(every compute NIC, NCCL chooses)"),
               socket_ifname: Optional[str] = typer.Option(None, "--socket-ifname",
                                                           help="the IP interface (NCCL_SOCKET_IFNAME, "
                                                                "GLOO_SOCKET_IFNAME): NCCL's bootstrap and gloo's "
                                                                "with --transport ib, every rank's data with "
                                                                "socket (default: each NIC's ifname; required "
                                                                "when the node's NICs have none)"),
               cpu_bind: str = typer.Option("numactl", "--cpu-bind", help="numactl (cores and memory node), taskset "
                                                                         "(cores) or none"),
               job_name: str = typer.Option("meshplan", "--job-name", help="Slurm job name"),
               partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition"),
               time_limit: str = typer.Option("01:00:00", "--time", help="Slurm time limit"),
               choose: bool = typer.Option(False, "--choose", help="bind the rank -> GPU permutation `place "
                                                                  "--choose` finds"),
               topology: Optional[Path] = typer.Option(None, "--topology",
                                                       help="nvidia-smi topo -m text or NCCL topology XML of the "
                                                            "nodes: their sockets and NIC affinity"),
               json_path: Optional[Path] = _json_option("launch"),
               force: bool = typer.Option(False, "--force", help="replace existing files in --out and --json")):
    """Write a multi-node torchrun command (c10d rendezvous), a Slurm sbatch script and per-rank bindings
    (GPUs visible in LOCAL_RANK order for cuda:{LOCAL_RANK} scripts, NUMA cores, NCCL NIC variables).
    A mesh that does not fit writes nothing and exits 1."""

    if out is None:  # defaults go under out/ (README "Outputs"); an earlier run's folder is refused, as report's file
        out = check_destination(Path("out") / "launch" / config.stem, "--out", force, folder=True)
    check_launch_folder(out, force)  # an existing script is refused before the planning, as --json
    _refuse_existing(json_path, force, "--json")
    p = _load(config, topology)
    if p.mesh is None or not p.feasible:
        _write_doc(json_path, launch_doc(p, 0, [], ""), force)
        _exit_infeasible(p)
    score = step_scorer(p) if choose and isinstance(p, Plan) else None
    c = choose_placement(p.mesh, p.config.cluster, (weights_from_plan(p) or None) if isinstance(p, Plan) else None,
                         rank_to_gpu=p.spec.rank_to_gpu, search=choose, source="collective table", step_s=score,
                         schedule=p.spec.pp_schedule, vpp=p.vpp)
    c = for_command(c, "launch")  # its warnings name launch --choose
    opts = LaunchOptions(program=tuple(program or ()), rdzv_endpoint=rdzv_endpoint, port=port,
                         hosts=tuple(h for h in (hosts or "").split(",") if h), transport=transport,
                         nic_scope=nic_scope, socket_ifname=socket_ifname, cpu_bind=cpu_bind, job_name=job_name,
                         partition=partition, time_limit=time_limit)
    written = write_launch(out, c.placement, opts, force=force)
    for line in launch_lines(c):  # the choice and the warnings place prints: never a silent permutation
        _echo(line)
    for path in written:
        _wrote(path)
    nodes = int(c.placement.node.max()) + 1
    endpoint = "" if rdzv_endpoint else " MESHPLAN_RDZV_ENDPOINT=<node 0 host:port>"
    run = (f"on each of the {nodes} node(s) NODE_RANK=<k>{endpoint} {out / 'torchrun.sh'}; or with Slurm: "
           f"sbatch {out / 'job.sbatch'}")
    typer.echo(f"run: {run}")
    _write_doc(json_path, launch_doc(p, nodes, _written(written), run, c), force)


@app.command("catalog")
def catalog_cmd(kind: str = typer.Argument("model", help="gpu, node, network or model"),
                json_path: Optional[Path] = _json_option("catalog"),
                force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """List the built-in catalog entries of KIND: each one's values (scalars, and a table's scalars
    inline), then its sources. --json has every field."""

    _refuse_existing(json_path, force, "--json")
    for name in catalog.names(kind):
        entry = catalog.entry(kind, name)
        _echo(f"{name}: {_catalog_values(entry)}")
        _echo(f"  source: {entry.get('source', '')}")
    _write_doc(json_path, catalog_doc(kind, {n: catalog.entry(kind, n) for n in catalog.names(kind)}), force)


def _catalog_values(entry: dict) -> str:
    """The scalar fields of a catalog entry as ``key value`` (a table of scalars as
    ``key {k v, ...}``, without its source; lists and deeper tables by their length), in the
    catalog's units (named in the keys)."""
    def one(v):
        if isinstance(v, dict):
            inner = [f"{k} {x:g}" if isinstance(x, float) else f"{k} {x}" for k, x in v.items()
                     if not isinstance(x, (dict, list)) and k != "source"]
            return "{" + ", ".join(inner) + "}" if inner else f"({len(v)} entries)"
        if isinstance(v, list):
            return f"({len(v)} entries)"
        return f"{v:g}" if isinstance(v, float) else str(v)
    return "; ".join(f"{k} {one(v)}" for k, v in entry.items() if k != "source")


@app.command("calibrate")
def calibrate_cmd(logs: list[Path] = typer.Argument(..., metavar="NCCL_TESTS_OUTPUT...",
                                                    help="nccl-tests outputs (stdout text or -J JSON), one run each"),
                  out: Path = typer.Option(Path("calibration.toml"), "--out", help="calibration TOML for --calibration"),
                  link: Optional[str] = typer.Option(None, "--link", help="nvlink, pcie or nic for every file "
                                                     "(default: from the ranks' hosts)"),
                  json_path: Optional[Path] = _json_option("calibrate"),
                  force: bool = typer.Option(False, "--force", help="replace existing --out and --json files")):
    """Fit alpha-beta per link class to your nccl-tests runs and write the calibration file, with the GPU model the
    runs name (runs on two GPU models are refused: one calibration file per model)."""

    check_destination(out, "--out", force)
    _refuse_existing(json_path, force, "--json")
    fits, notes, sources = calibrate(logs, link)
    source = "; ".join(f"{cls}: {text}" for cls, text in sources.items())  # --json: every class's own
    for line in notes:
        _echo(line)
    _wrote(write_output(out, calibration_toml(fits, sources), force=force))
    _write_doc(json_path, calibrate_doc(fits, notes, source, str(out)), force)


@app.command("validate-slice")
def validate_slice(configs: list[Path] = typer.Argument(..., help="TOML configs of one workload, one mesh each"),
                   testbed: str = typer.Option(..., "--testbed", help="prefix of a `meshplan testbed up` cluster"),
                   world: int = typer.Option(8, "--world", help="ranks per mesh (nodes x ranks per node)"),
                   layers: int = typer.Option(2, "--layers", help="layers of the scaled-down model"),
                   hidden_div: int = typer.Option(64, "--hidden-div", help="divide hidden, head_dim, ffn by N"),
                   seq_len: int = typer.Option(512, "--seq-len", help="tokens per sequence in the run"),
                   vocab: int = typer.Option(128, "--vocab", help="vocabulary of the scaled-down model"),
                   steps: int = typer.Option(3, "--steps", help="timed steps per mesh"),
                   timeout_s: float = typer.Option(120.0, "--timeout-s", help="wall-clock limit per mesh"),
                   out: Path = typer.Option(Path("slice-out"), "--out", help="evidence folder"),
                   json_path: Optional[Path] = _json_option("validate-slice"),
                   force: bool = typer.Option(False, "--force", help="replace an existing slice folder and --json "
                                                                     "file")):
    """Run several meshes on the testbed; order measured step times against predicted; keep the rejected."""
    _require_torch("validate-slice")
    _check_run_options(layers, seq_len, vocab, steps, hidden_div, timeout_s, None)
    check_number("--world", world, 1, 4096)

    opt = Options(worlds=(world,), layers=layers, hidden_div=hidden_div, seq_len=seq_len, vocab=vocab,
                  steps=steps, timeout_s=timeout_s, testbed=testbed)
    _refuse_existing(json_path, force, "--json")
    code = slice_main([str(c) for c in configs], testbed, out, opt, force)
    if json_path:
        evidence = json.loads((out / SLICE_MARKER).read_text(encoding="utf-8"))
        _write_doc(json_path, validate_slice_doc(evidence, code, str(out)), force)
    raise typer.Exit(code)


testbed_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Emulated multi-node cluster in network namespaces (root).")
app.add_typer(testbed_app, name="testbed")


@testbed_app.command("up")
def testbed_up_cmd(nodes: int = typer.Option(2, help="emulated nodes (one network namespace each)"),
                   nics: int = typer.Option(2, help="NICs per node (one rail bridge each)"),
                   rate_mbit: float = typer.Option(200.0, help="tbf rate limit per NIC, Mbit/s"),
                   prefix: str = typer.Option("t", help="name prefix of the namespaces"),
                   json_path: Optional[Path] = _json_option("testbed-up"),
                   force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Create one namespace per node, one rate-limited interface per NIC (10.77.RAIL.NODE+1), a bridge
    per rail and a spine between the rails (gateway 10.77.RAIL.254): traffic from a NIC's address leaves
    by that NIC, to another rail through the spine."""

    _refuse_existing(json_path, force, "--json")
    code, tb = main_up(nodes, nics, rate_mbit, prefix=prefix)
    if tb is not None:
        _write_doc(json_path, testbed_up_doc(tb), force)
    raise typer.Exit(code)


@testbed_app.command("down")
def testbed_down_cmd(prefix: str = typer.Option("t", help="name prefix given to up"),
                     json_path: Optional[Path] = _json_option("testbed-down"),
                     force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Remove every namespace, interface, bridge and process of the testbed PREFIX."""

    _refuse_existing(json_path, force, "--json")
    code, removed = main_down(prefix=prefix)
    if code == 0:
        _write_doc(json_path, testbed_down_doc(prefix, removed), force)
    raise typer.Exit(code)


bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Measure this machine (or the testbed) for calibration.")
app.add_typer(bench_app, name="bench")


@bench_app.command("comm")
def bench_comm_cmd(nproc: int = typer.Option(4, help="ranks (per node with --testbed)"),
                   sizes: str = typer.Option("1K..64M", help="LO..HI doubling, or a comma list (K/M/G = 2^10/20/30)"),
                   out: Path = typer.Option(Path("bench-comm"), help="folder for the nccl-tests text, pairs and calibration.toml"),
                   testbed: Optional[str] = typer.Option(None, help="run on the netns testbed of this prefix"),
                   iters: int = typer.Option(20, help="timed calls per size at most"),
                   budget_s: float = typer.Option(0.2, help="seconds per size, which caps iters"),
                   timeout_s: float = typer.Option(600.0, help="kill the run after this many seconds"),
                   json_path: Optional[Path] = _json_option("bench-comm"),
                   force: bool = typer.Option(False, "--force", help="replace an existing --out folder and --json "
                                                                     "file")):
    """Collectives per link class in nccl-tests columns, alpha-beta fits, and a send/recv matrix. The --out folder
    is built under a temporary name and renamed into place when the run succeeds."""
    _require_torch("bench comm")

    check_number("--timeout-s", timeout_s, 1.0, 86400.0, "s")
    _refuse_existing(json_path, force, "--json")
    size_list = parse_sizes(sizes)
    try:
        fits = run_bench(nproc, size_list, out, testbed=testbed, iters=iters, budget_s=budget_s,
                         timeout_s=timeout_s, echo=_echo, force=force)
    except RuntimeError as e:
        _echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    files = _written(sorted(p for p in out.rglob("*") if p.is_file()))
    _write_doc(json_path, bench_comm_doc(nproc, size_list, testbed, fits, files), force)
    raise typer.Exit(0 if fits else 1)


def _bench_target(config: Path, device: str, dtype: Optional[str], json_path: Optional[Path], force: bool,
                  infeasible_doc) -> tuple[Plan, str, str]:
    """The plan whose local shapes a bench times, the device (``--device``: auto is cuda when
    torch sees one) and the dtype (``--dtype``; default the compute dtype on a GPU, fp32 on the
    CPU). A mesh that does not resolve writes ``infeasible_doc(plan)`` to ``--json`` and exits 1
    with its reasons."""
    from meshplan.runtime.bench.gemm import resolve_device

    p = _load(config)
    if isinstance(p, Infeasible):
        _write_doc(json_path, infeasible_doc(p), force)
        _exit_infeasible(p)
    device = resolve_device(device)
    dt = dtype or (p.config.training.compute_dtype if device == "cuda" else "fp32")
    if dt not in ("fp32", "bf16", "fp16"):
        raise ConfigError("--dtype", f"{dt!r}; use fp32, bf16 or fp16")
    if device == "cpu":
        _echo(cpu_headline(dt))
    return p, device, dt


def cpu_headline(dtype: str) -> str:
    """What a bench on the CPU measures (said first: its rows are not a GPU's)."""
    from meshplan.runtime.bench.gemm import device_name

    return (f"no GPU: timing on the CPU, {device_name('cpu')}, {dtype}; the table describes this CPU, not "
            f"the plan's GPU, and --gemm-table with it predicts this CPU's compute")


@bench_app.command("gemm")
def bench_gemm(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its local GEMM shapes are timed"),
               out: Path = typer.Option(Path("out/bench/gemm.csv"), "--out", help="CSV table for --gemm-table "
                                        "(default under out/, which git ignores)"),
               device: str = typer.Option("auto", "--device", help="cpu, cuda or auto (cuda when present)"),
               dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: compute dtype "
                                                   "on a GPU, fp32 on the CPU)"),
               max_elements: Optional[int] = typer.Option(None, "--max-elements",
                                                          help="scale M down so an operand has at most this many "
                                                               "elements (default 2**22 on the CPU, none on a GPU)"),
               json_path: Optional[Path] = _json_option("bench-gemm"),
               force: bool = typer.Option(False, "--force", help="replace existing --out and --json files")):
    """Time the plan's local GEMM shapes (forward and backward) and write the efficiency table."""
    _require_torch("bench gemm")
    from meshplan.runtime.bench.gemm import bench, write_table

    if max_elements is not None:
        check_number("--max-elements", max_elements, 1, 1 << 40)
    check_destination(out, "--out", force)
    _refuse_existing(json_path, force, "--json")
    p, device, dt = _bench_target(config, device, dtype, json_path, force,
                                  lambda p: bench_gemm_doc(p, [], device, dtype or "", []))
    limit = max_elements if max_elements is not None else (2 ** 22 if device == "cpu" else None)
    rows = bench(list(p.gemms), dtype=dt, device=device, max_elements=limit)
    _echo(f"{'M':>7} {'N':>7} {'K':>7} {'dtype':>5} {'time (us)':>11} {'TFLOP/s':>8}  device")
    for r in rows:
        scaled = f" (run at M {r.scaled_m})" if r.scaled_m != r.gemm.m else ""
        _echo(f"{r.gemm.m:7d} {r.gemm.n:7d} {r.gemm.k:7d} {r.dtype:>5} {r.seconds * 1e6:11.1f} "
                   f"{r.tflops:8.2f}  {r.device}{scaled}")
    _wrote(write_table(rows, out, force=force))
    _write_doc(json_path, bench_gemm_doc(p, rows, device, dt, _written([out])), force)


@bench_app.command("attention")
def bench_attention(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its local attention is timed"),
                    out: Path = typer.Option(Path("out/bench/attention.json"), "--out", help="JSON table for "
                                             "--gemm-table (default under out/, which git ignores)"),
                    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto (cuda when present)"),
                    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: compute "
                                                        "dtype on a GPU, fp32 on the CPU)"),
                    with_gemm: Optional[Path] = typer.Option(None, "--with-gemm", help="a `bench gemm` table whose "
                                                             "rows are written into --out too (one file for step)"),
                    repeats: int = typer.Option(5, "--repeats", help="timed calls (median)"),
                    json_path: Optional[Path] = _json_option("bench-attention"),
                    force: bool = typer.Option(False, "--force", help="replace existing --out and --json files")):
    """Time the plan's local attention (torch SDPA, forward and backward) and write the table --gemm-table reads."""
    _require_torch("bench attention")
    from meshplan.runtime.bench.attention import bench_plan, gemm_rows, write_table

    check_number("--repeats", repeats, 1, 10_000)
    check_destination(out, "--out", force)
    _refuse_existing(json_path, force, "--json")
    p, device, dt = _bench_target(config, device, dtype, json_path, force,
                                  lambda p: bench_attention_doc(p, None, []))
    r = bench_plan(p, dt, device, repeats=repeats)
    fwd_flops = 2.0 * r["batch"] * r["q_heads"] * r["seq_q"] * r["seq_kv"] * r["head_dim"]  # causal half
    _echo(f"attention b {r['batch']} heads {r['q_heads']} (kv {r['kv_heads']}) s_q {r['seq_q']} s_kv "
               f"{r['seq_kv']} d {r['head_dim']} {dt}: forward {r['forward_s'] * 1e6:.1f} us "
               f"({fwd_flops / r['forward_s'] / 1e12:.3f} TFLOP/s), backward {r['backward_s'] * 1e6:.1f} us "
               f"({2.5 * fwd_flops / r['backward_s'] / 1e12:.3f} TFLOP/s; flash-attention FLOP convention)  "
               f"{r['device']}")
    rows = (gemm_rows(with_gemm) if with_gemm else []) + [r]
    _wrote(write_table(rows, out, force=force))
    _write_doc(json_path, bench_attention_doc(p, r, _written([out])), force)


def _json_to_stdout_everywhere(*apps: typer.Typer) -> None:
    """``--json -`` on every registered command of ``apps`` (:func:`_json_to_stdout`)."""
    for a in apps:
        for command in a.registered_commands:
            command.callback = _json_to_stdout(command.callback)


_json_to_stdout_everywhere(app, testbed_app, bench_app)


# typer raises click's UsageError (BadParameter's base); typer >= 0.2x vendors click, so the
# class is taken from the public BadParameter rather than imported from either package.
_USAGE_ERROR: Any = typer.BadParameter.__mro__[1]  # click's UsageError (show(), exit_code)


def _usage_line(e) -> Optional[str]:
    """A one-line ``error: <option>: <what is wrong>`` for a usage error whose message is one
    line (a value that does not parse, a missing or unknown option); None for the help text
    shown when a group is called without a command."""
    msg = e.format_message()
    if "\n" in msg.strip():
        return None
    param = getattr(e, "param", None)
    field = (param.opts[0] if param is not None and getattr(param, "opts", None) else
             getattr(e, "option_name", None) or (e.ctx.command_path if e.ctx is not None else "usage"))
    cmd = e.ctx.command_path if e.ctx is not None else "meshplan"
    return printable(f"error: {field}: {msg.rstrip('.')}; see {cmd} --help")


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


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: run the app; malformed input (a ConfigError, or a usage error of an
    option or argument) is one line ``error: <field>: ...`` and exit 2; a stdout closed
    by its reader exits EXIT_PIPE_CLOSED (141) with nothing on stderr."""
    try:
        rc = _run_app(argv)
    except (BrokenPipeError, SystemExit) as e:
        if _stdout_closed(e):
            _exit_pipe_closed()
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


def _run_app(argv: Optional[list[str]]) -> Any:
    """The app's return value; the error paths of main() (exit 2 for bad input)."""
    try:
        rc = app(args=argv, standalone_mode=False)
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except _USAGE_ERROR as e:
        line = _usage_line(e)
        if line is None:
            e.show()
        else:
            print(line, file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    return rc


if __name__ == "__main__":
    main()
