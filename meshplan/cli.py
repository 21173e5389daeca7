"""Command line: thin wrappers over :func:`meshplan.plan.build_plan` and the reports.

Every malformed input ends with one line ``error: <field>: <message>`` on stderr and exit
status 2; an infeasible mesh prints its reasons and exits 1.

One verdict everywhere (:data:`EXIT_CODES`): every command that resolves a mesh (plan, groups,
memory, step, reliability, place) exits 1 and prints ``infeasible: <reason>`` on stderr when
``meshplan plan`` calls the mesh infeasible, whatever it printed before; ``step`` then prints
only the step the mesh would take, labelled ``would be ... if it fit``. ``compare`` exits 0
when a mesh that fits wins (the other's infeasibility is one of the verdict's reasons) and 1
when neither fits; ``search`` exits 0 when some candidate fits and 1 when none does.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from meshplan import catalog
from meshplan.comm.calibrate import calibrate
from meshplan.comm.calibration import (
    apply_calibration,
    calibration_toml,
    load_calibration,
)
from meshplan.comm.nccl_log import check_against_placement, read_nccl_log
from meshplan.compare import compare, evidence_folder, table_rows, write_evidence
from meshplan.compute.gemm import load_gemm_table
from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.fileio import write_output
from meshplan.mesh.axes import axis_name_warnings, from_megatron_order
from meshplan.placement.assign import rank_row
from meshplan.placement.bindings import write_bindings
from meshplan.placement.choice import choose_placement, weights_from_plan
from meshplan.placement.topology import (
    check_identity_nic_map,
    load_topology,
    node_from_topology,
)
from meshplan.plan import Infeasible, Plan, build_plan
from meshplan.reliability import reliability as rel
from meshplan.reliability import restart_on_fewer_nodes
from meshplan.report.json_out import write_json
from meshplan.report.memory import print_memory
from meshplan.report.memory_plot import write_png
from meshplan.report.place_text import place_lines
from meshplan.report.search import ProgressBar, print_search, write_search_json
from meshplan.report.text import print_groups, print_plan
from meshplan.runtime.bench.comm import parse_sizes, run_bench
from meshplan.runtime.testbed.netns import main_down, main_up
from meshplan.runtime.validation.slice import main as slice_main
from meshplan.runtime.validation.validate import Options
from meshplan.runtime.validation.validate import main as validate_main
from meshplan.schedule.linkload import concurrency, edge_loads, timings
from meshplan.schedule.placement_score import step_scorer
from meshplan.schedule.rank_timeline import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import network_verdict, rebuilt_step
from meshplan.search.driver import search
from meshplan.spec.mesh import Schedule

EXIT_CODES = ("exit status: 0 feasible (compare: a mesh that fits wins; search: some candidate fits), "
              "1 infeasible (the reasons on stderr as 'infeasible: ...'; groups, place and step still print "
              "what they show, step labelled 'would be ... if it fit') or a measured difference, "
              "2 malformed input (one line 'error: <field>: <what is wrong>')")

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Design, check and validate parallel meshes for distributed training. " + EXIT_CODES + ".")


def _load(config: Path, topology: Optional[Path] = None, calibration: Optional[Path] = None) -> Plan | Infeasible:
    """Plan of ``config``; ``topology`` (nvidia-smi topo -m text or NCCL topology XML) replaces
    the node's sockets and NIC affinity, ``calibration`` (meshplan calibration TOML) the link
    bandwidths and latencies."""

    cfg = load_config(config)
    if cfg.mesh is not None:
        names, field = (cfg.mesh.names, "mesh.names") if cfg.mesh.names is not None else \
            (from_megatron_order(cfg.mesh.order or ""), "mesh.order")  # MeshSpec: names or order is set
        for w in axis_name_warnings(names, field):
            typer.echo(f"warning: {w}", err=True)
    if topology or calibration:
        cluster = cfg.cluster
        if topology:
            node = node_from_topology(load_topology(topology), cluster.node)
            for w in check_identity_nic_map(node):
                typer.echo(f"warning: {w}", err=True)
            cluster = cluster.model_copy(update={"node": node})
        if calibration:
            cluster = apply_calibration(cluster, load_calibration(calibration))
        cfg = replace(cfg, cluster=cluster)
    return build_plan(cfg)


def _console() -> Console:
    """A console at least 160 columns wide (wider when the terminal or COLUMNS says so), so
    the collective tables keep whole numbers."""
    return Console(width=max(160, shutil.get_terminal_size((160, 40)).columns))


def _infeasible(plan, who: str = "") -> None:
    """Print the plan's reasons as ``infeasible: [who: ]<reason>`` on stderr (the verdict line
    of every command that resolves a mesh)."""
    for r in plan.reasons:
        typer.echo(f"infeasible: {who + ': ' if who else ''}{r}", err=True)


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


def _check_rank(plan, rank: int) -> None:
    if not 0 <= rank < plan.world:
        raise ConfigError("--rank", f"{rank} outside 0..{plan.world - 1}")


@app.command()
def plan(config: Path = typer.Argument(..., help="TOML config with [model], [cluster], [training], [mesh]"),
         json_path: Optional[Path] = typer.Option(None, "--json", help="write the whole plan (every group) as JSON"),
         rank: int = typer.Option(0, "--rank", help="rank whose groups and placement are printed"),
         force: bool = typer.Option(False, "--force", help="replace an existing --json file"),
         topology: Optional[Path] = typer.Option(None, "--topology", help="nvidia-smi topo -m text or NCCL topology XML"),
         calibration: Optional[Path] = typer.Option(None, "--calibration", help="calibration TOML (bench comm)")):
    """Plan one mesh: constraints, degrees, groups, placement, shapes, memory, collectives."""

    if json_path and json_path.exists() and not force:  # refused before the report, as compare --out
        raise ConfigError("--json", f"{json_path} exists; choose another path or pass --force to replace it")
    p = _load(config, topology, calibration)
    if p.mesh is not None:
        _check_rank(p, rank)
    print_plan(p, rank=rank, console=_console())
    if json_path:
        typer.echo(f"wrote {write_json(p, json_path, force=force)}")
    _verdict_exit(p)


@app.command()
def groups(config: Path = typer.Argument(..., help="TOML config"),
           rank: int = typer.Option(0, "--rank", help="the rank whose start-up print is shown")):
    """Print what RANK would print at start-up: its coordinates and every group's ranks. A mesh that does not
    fit is still printed, then exits 1 with its reasons."""

    p = _load(config)
    if p.mesh is None:
        _exit_infeasible(p)
    _check_rank(p, rank)
    print_groups(p.mesh, rank, _console())
    _verdict_exit(p)


@app.command()
def memory(config: Path = typer.Argument(..., help="TOML config (an optional [memory] table sets the timeline parameters)"),
           out: Path = typer.Option(Path("."), "--out", help="folder for the PNG plot(s)"),
           all_stages: bool = typer.Option(False, "--all-stages", help="every pipeline stage, not only the most loaded"),
           force: bool = typer.Option(False, "--force", help="replace existing PNG files")):
    """Memory timeline of one training step: peak, headroom, events by kind, and a PNG per stage shown."""

    p = _load(config)
    if isinstance(p, Infeasible):
        for r in p.reasons:
            typer.echo(f"infeasible: {r}", err=True)
        raise typer.Exit(1)
    shown = p.timelines if all_stages else (p.timeline,)
    paths = [out / f"{config.stem}_memory_stage{tl.stage}.png" for tl in shown]
    taken = [str(x) for x in paths if x.exists()]
    if taken and not force:
        raise ConfigError("--out", f"{taken[0]} exists; choose another folder or pass --force to replace it")
    print_memory(p, _console(), all_stages=all_stages)
    for tl, path in zip(shown, paths):
        typer.echo(f"wrote {write_png(tl, path, name=config.name, force=force)}")
    _verdict_exit(p)


def _overlap(overlap_tp: bool, no_prefetch: bool):
    return Overlap(tp=overlap_tp, fsdp_prefetch=not no_prefetch)


@app.command()
def step(config: Path = typer.Argument(..., help="TOML config"),
         trace: Optional[Path] = typer.Option(None, "--trace", help="write the predicted timeline (Chrome/Perfetto JSON)"),
         overlap_tp: bool = typer.Option(False, "--overlap-tp", help="assume TP communication overlaps compute"),
         no_prefetch: bool = typer.Option(False, "--no-prefetch", help="no FSDP all-gather prefetch"),
         gemm_table: Optional[Path] = typer.Option(None, "--gemm-table", help="measured GEMM times (meshplan bench gemm)"),
         schedule: Optional[str] = typer.Option(None, "--schedule", help="gpipe, 1f1b, interleaved_1f1b or zb_h1"),
         force: bool = typer.Option(False, "--force", help="replace an existing --trace file")):
    """Scheduled rank timeline: step time, critical path, exposed communication, bubble, MFU; when the step is
    network-bound, a verdict naming the communication and its cause. A mesh that does not fit exits 1 with its
    reasons after one line 'step would be X s ... if it fit'."""

    if schedule is not None and schedule not in {x.value for x in Schedule}:
        raise ConfigError("--schedule", f"unknown schedule {schedule!r}; use " + ", ".join(x.value for x in Schedule))
    p = _load(config)
    if isinstance(p, Infeasible):
        _exit_infeasible(p)
    table = load_gemm_table(gemm_table) if gemm_table else None
    st = step_time(p, _overlap(overlap_tp, no_prefetch), table=table, schedule=schedule)
    if not p.feasible:
        typer.echo(f"step would be {st.step_s:.3f} s ({st.pipeline.spec.schedule}, MFU {st.mfu:.1%}) if it fit; "
                   f"it does not fit")
        _verdict_exit(p)
    for line in st.lines():
        typer.echo(line)

    again = rebuilt_step(p, lambda alt: step_time(alt, _overlap(overlap_tp, no_prefetch), table=table,
                                                  schedule=schedule))
    for line in network_verdict(p, st, again):
        typer.echo(line)
    path = st.critical_path()
    typer.echo(f"critical path ({len(path)} entries{', first 12 and last 6' if len(path) > 18 else ''}):")
    for line in (path if len(path) <= 18 else path[:12] + ["..."] + path[-6:]):
        typer.echo(f"  {line}")
    _print_links(p, st)
    if trace:
        typer.echo(f"wrote {st.write_trace(trace, force=force)}")


def _print_links(p, st) -> None:
    """Readiness of each collective kind, concurrency and the load on each physical edge."""

    typer.echo("collectives on stage 0, first occurrence (ms from step start): ready, deadline, duration, slack")
    for t in timings(st):
        typer.echo(f"  {t.stream:13s} {t.phase:8s} {t.op:15s} {t.ready_s * 1e3:10.3f} {t.deadline_s * 1e3:10.3f} "
                   f"{t.duration_s * 1e3:9.3f} {t.slack_s * 1e3:10.3f}")
    for (a, b), sec in sorted(concurrency(st).items()):
        typer.echo(f"concurrent: {a} and {b} overlap {sec * 1e3:.1f} ms per step (shared copy engines and links)")
    typer.echo("edge load per step (busy = bytes / capacity; must fit the stage's compute time, and per layer "
               "the layer's forward + backward time)")
    for e in edge_loads(p, st):
        verdict = "fits" if e.fits else "DOES NOT FIT"
        typer.echo(f"  {e.edge:36s} {e.bytes_per_step / 1e9:10.1f} GB  busy {e.busy_s:8.3f} s of {e.interval_s:8.3f} s; "
                   f"per layer {e.per_layer_bytes / e.capacity_bytes_per_s * 1e3:8.3f} of "
                   f"{e.layer_interval_s * 1e3:8.3f} ms: {verdict}")


@app.command()
def reliability(config: Path = typer.Argument(..., help="TOML config"),
                write_gbps: float = typer.Option(..., "--write-gbps", help="aggregate checkpoint write bandwidth, GB/s"),
                read_gbps: float = typer.Option(..., "--read-gbps", help="aggregate checkpoint read bandwidth, GB/s"),
                rank_gbps: Optional[float] = typer.Option(
                    None, "--rank-gbps", help="storage bandwidth of one rank, GB/s: times the bytes the busiest rank "
                                              "writes under DCP (its share of replicated shards) and reads back"),
                restart_overhead_s: float = typer.Option(..., "--restart-overhead-s",
                                                         help="detection + rescheduling + start-up, seconds"),
                lost_nodes: int = typer.Option(1, "--lost-nodes", help="nodes lost in the restart scenario"),
                spare_nodes: int = typer.Option(0, "--spare-nodes", help="spare nodes available")):
    """Failure domains, interruptions per day, checkpoint size and interval, goodput, restart."""

    p = _load(config)
    if isinstance(p, Infeasible):
        for why in p.reasons:
            typer.echo(f"infeasible: {why}", err=True)
        raise typer.Exit(1)
    for name, v in (("--write-gbps", write_gbps), ("--read-gbps", read_gbps), ("--rank-gbps", 1.0 if rank_gbps is None else rank_gbps)):
        if v <= 0:
            raise ConfigError(name, f"{v} must be > 0 GB/s")
    r = rel(p, write_bandwidth_bytes_per_s=write_gbps * 1e9, read_bandwidth_bytes_per_s=read_gbps * 1e9,
            restart_overhead_s=restart_overhead_s,
            per_rank_bandwidth_bytes_per_s=rank_gbps * 1e9 if rank_gbps else None)
    for line in r.lines():
        typer.echo(line)
    t = p.config.training
    rs = restart_on_fewer_nodes(p.mesh, lost_nodes, gpus_per_node=p.config.cluster.node.gpus,
                                global_batch=t.global_batch, micro_batch=t.micro_batch, spare_nodes=spare_nodes,
                                interleaved=p.vpp > 1)
    for line in rs.lines():
        typer.echo(line)
    _verdict_exit(p)


@app.command("compare")
def compare_cmd(config_a: Path = typer.Argument(..., help="TOML config of mesh A"),
                config_b: Path = typer.Argument(..., help="TOML config of mesh B (same workload)"),
                out: Path = typer.Option(Path("out/compare"), "--out", help="folder for the rejected mesh's evidence"),
                force: bool = typer.Option(False, "--force", help="replace an existing evidence folder")):
    """Compare two meshes of one workload side by side and keep the rejected one's evidence. Exit 0 when a mesh
    that fits wins, 1 when neither fits (both reasons printed)."""

    a, b = _load(config_a), _load(config_b)
    ca, cb = a.config, b.config
    if (ca.model != cb.model or ca.training != cb.training) or ca.cluster.world != cb.cluster.world:
        raise ConfigError("compare", "A and B must share [model], [training] and the cluster size; only [mesh] differs")
    names = (config_a.stem, config_b.stem)
    if names[0] == names[1] and config_a.resolve() != config_b.resolve():
        names = (f"{names[0]}-A", f"{names[1]}-B")  # two files of one name: keep the sides apart
    c = compare(a, b, names=names)
    evidence_folder(c, out, force)  # refuse an existing folder before printing the report
    tab = Table(title="compare", title_justify="left")
    for col in ("quantity", c.a.name, c.b.name):
        tab.add_column(col)
    for row in table_rows(c):
        tab.add_row(*row)
    con = _console()
    con.print(tab)
    con.print("[bold]verdict:[/] identical meshes" if c.identical else "[bold]verdict:[/] neither mesh fits"
              if c.none_fit else f"[bold]verdict:[/] {c.winner} (rejected: {c.rejected})")
    for r in c.reasons:
        con.print(f"  - {r}")
    for path in write_evidence(c, out, force=force):
        con.print(f"wrote {path}")
    if c.none_fit:
        for side in (c.a, c.b):
            _infeasible(side.plan, side.name)
        raise typer.Exit(1)


@app.command("search")
def search_cmd(config: Path = typer.Argument(..., help="TOML config: [model], [cluster], [training], optional "
                                                      "[search]; a [mesh] table is ignored"),
               top: Optional[int] = typer.Option(None, "--top", help="candidates ranked and shown (default: "
                                                                    "[search] top, 10)"),
               json_path: Optional[Path] = typer.Option(None, "--json", help="write the result as JSON"),
               force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Search every mesh of the workload: reject with reasons, rank by predicted step time. Exit 0 when some
    candidate fits, 1 when none does.

    Searched: degrees of pp, dp_replicate, dp_shard, cp, tp (ep, etp for MoE), micro-batch, recompute,
    vpp (interleaved 1F1B), sharding, training.reshard_after_forward (FSDP), training.tp_comm_overlap
    (tp > 1) and the Llama 3 layer split with lighter first and last stages (pp >= 3); [search] narrows
    each. Order: by step time; candidates within 1% of the fastest not yet listed go toward fewer axes,
    then lower tp*pp*cp*ep, then lower tp. The output names what makes the top faster than #2 (compute,
    bubble, exposed communication per axis, with their seconds)."""

    cfg = load_config(config, require_mesh=False)
    if top is not None:
        if top < 1:
            raise ConfigError("--top", f"{top} must be >= 1")
        cfg = replace(cfg, search=cfg.search.model_copy(update={"top": top}))
    if json_path and json_path.exists() and not force:
        raise ConfigError("--json", f"{json_path} exists; choose another path or pass --force to replace it")
    with ProgressBar() as bar:
        result = search(cfg, progress=bar)
    print_search(result, _console())
    if json_path:
        typer.echo(f"wrote {write_search_json(result, json_path, force=force)}")
    raise typer.Exit(0 if result.top else 1)


@app.command("nccl-check")
def nccl_check(config: Path = typer.Argument(..., help="TOML config whose placement is checked"),
               log: Path = typer.Argument(..., help="NCCL_DEBUG=INFO output of the run")):
    """Check that each communicator used the NICs and intra-node links the placement meant."""

    p = _load(config)
    if p.placement is None:
        raise typer.Exit(1)
    expected = {r: rank_row(p.placement, r)["nic"] for r in range(p.world)}
    diffs = check_against_placement(read_nccl_log(log), expected)
    for d in diffs:
        typer.echo(d)
    typer.echo(f"{len(diffs)} difference(s) between the NCCL log and the placement")
    raise typer.Exit(1 if diffs else 0)


@app.command()
def validate(config: Path = typer.Argument(..., help="TOML config; its mesh is scaled to each world size"),
             worlds: str = typer.Option("2,4", "--worlds", help="world sizes run in this order, e.g. 2,4,8"),
             layers: int = typer.Option(2, "--layers", help="layers of the scaled-down model"),
             hidden_div: Optional[int] = typer.Option(None, "--hidden-div",
                                                     help="divide hidden, head_dim, ffn by N (default: to <= 256)"),
             seq_len: int = typer.Option(64, "--seq-len", help="tokens per sequence in the run"),
             vocab: int = typer.Option(512, "--vocab", help="vocabulary of the scaled-down model"),
             steps: int = typer.Option(3, "--steps", help="timed steps (after a recorded and a memory step)"),
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
                                             "load and re-predict the step with those times (calibrated rows)"),
             checkpoint_gbps: Optional[float] = typer.Option(
                 None, "--checkpoint-gbps", help="storage bandwidth of one rank, GB/s: predicts the DCP save and "
                                                 "load times measured after the steps (bytes per rank are "
                                                 "predicted without it)"),
             force: bool = typer.Option(False, "--force", help="replace an existing evidence folder")):
    """Run the mesh for real (torchrun: NCCL on the GPUs when CUDA is present, else gloo on CPU) and compare
    collectives, times, memory and checkpoint (DCP) writes with the plan."""
    _require_torch("validate")

    try:
        sizes = tuple(int(w) for w in worlds.split(","))
    except ValueError:
        raise ConfigError("--worlds", f"{worlds!r}: give comma-separated integers, e.g. 2,4,8") from None
    opt = Options(worlds=sizes, layers=layers, hidden_div=hidden_div, seq_len=seq_len, vocab=vocab, steps=steps,
                  timeout_s=timeout_s, tolerance=tolerance, testbed=testbed, probe=probe,
                  checkpoint_bytes_per_s=checkpoint_gbps * 1e9 if checkpoint_gbps else None)
    if checkpoint_gbps is not None and checkpoint_gbps <= 0:
        raise ConfigError("--checkpoint-gbps", f"{checkpoint_gbps} must be > 0 GB/s")
    raise typer.Exit(validate_main(str(config), opt, out, force))


@app.command("place")
def place_cmd(config: Path = typer.Argument(..., help="TOML config"),
              choose: bool = typer.Option(False, "--choose", help="search the rank -> GPU permutation with the shortest predicted step (fewest weak-path bytes at equal steps)"),
              bindings_path: Optional[Path] = typer.Option(None, "--bindings", help="write every rank's binding to this file"),
              fmt: str = typer.Option("json", "--format", help="bindings file format: json (list) or sh (launcher)"),
              force: bool = typer.Option(False, "--force", help="replace an existing --bindings file"),
              ranks: Optional[list[int]] = typer.Option(None, "--rank", help="rank whose binding is printed (repeatable; default first, second, last)")):
    """Placement per axis, decisions and warnings, per-rank bindings (CUDA_VISIBLE_DEVICES, NCCL_IB_HCA, numactl).
    A mesh that does not fit is still placed, then exits 1 with its reasons."""

    if fmt not in ("json", "sh"):
        raise ConfigError("--format", f"{fmt!r} is not one of json, sh")
    p = _load(config)
    if p.mesh is None:
        _exit_infeasible(p)
    shown = ranks or sorted({0, min(1, p.world - 1), p.world - 1})
    for r in shown:
        _check_rank(p, r)
    score = None
    if choose and isinstance(p, Plan):
        score = step_scorer(p)
    c = choose_placement(p.mesh, p.config.cluster, (weights_from_plan(p) or None) if isinstance(p, Plan) else None,
                         rank_to_gpu=p.spec.rank_to_gpu, search=choose, source="collective table", step_s=score)
    for line in place_lines(c, shown):
        typer.echo(line)
    if bindings_path:
        typer.echo(f"wrote {write_bindings(bindings_path, c.placement, fmt=fmt, force=force)}")
    _verdict_exit(p)


@app.command("catalog")
def catalog_cmd(kind: str = typer.Argument("model", help="gpu, node, network or model")):
    """List the built-in catalog entries of KIND with their sources."""

    for name in catalog.names(kind):
        typer.echo(f"{name}: {catalog.entry(kind, name).get('source', '')}")


@app.command("calibrate")
def calibrate_cmd(logs: list[Path] = typer.Argument(..., metavar="NCCL_TESTS_OUTPUT...",
                                                    help="nccl-tests outputs (stdout text or -J JSON), one run each"),
                  out: Path = typer.Option(Path("calibration.toml"), "--out", help="calibration TOML for --calibration"),
                  link: Optional[str] = typer.Option(None, "--link", help="nvlink, pcie or nic for every file "
                                                     "(default: from the ranks' hosts)"),
                  force: bool = typer.Option(False, "--force", help="replace an existing --out file")):
    """Fit alpha-beta per link class to your nccl-tests runs and write the calibration file."""

    fits, notes, source = calibrate(logs, link)
    for line in notes:
        typer.echo(line)
    typer.echo(f"wrote {write_output(out, calibration_toml(fits, source), force=force)}")


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
                   force: bool = typer.Option(False, "--force", help="replace an existing slice folder")):
    """Run several meshes on the testbed; order measured step times against predicted; keep the rejected."""
    _require_torch("validate-slice")

    opt = Options(worlds=(world,), layers=layers, hidden_div=hidden_div, seq_len=seq_len, vocab=vocab,
                  steps=steps, timeout_s=timeout_s, testbed=testbed)
    raise typer.Exit(slice_main([str(c) for c in configs], testbed, out, opt, force))


testbed_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Emulated multi-node cluster in network namespaces (root).")
app.add_typer(testbed_app, name="testbed")


@testbed_app.command("up")
def testbed_up_cmd(nodes: int = typer.Option(2, help="emulated nodes (one network namespace each)"),
                   nics: int = typer.Option(2, help="NICs per node (one rail bridge each)"),
                   rate_mbit: float = typer.Option(200.0, help="tbf rate limit per NIC, Mbit/s"),
                   prefix: str = typer.Option("t", help="name prefix of the namespaces")):
    """Create one namespace per node, one rate-limited interface per NIC (10.77.RAIL.NODE+1), a bridge
    per rail and a spine between the rails (gateway 10.77.RAIL.254): traffic from a NIC's address leaves
    by that NIC, to another rail through the spine."""

    raise typer.Exit(main_up(nodes, nics, rate_mbit, prefix=prefix))


@testbed_app.command("down")
def testbed_down_cmd(prefix: str = typer.Option("t", help="name prefix given to up")):
    """Remove every namespace, interface, bridge and process of the testbed PREFIX."""

    raise typer.Exit(main_down(prefix=prefix))


bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Measure this machine (or the testbed) for calibration.")
app.add_typer(bench_app, name="bench")


@bench_app.command("comm")
def bench_comm_cmd(nproc: int = typer.Option(4, help="ranks (per node with --testbed)"),
                   sizes: str = typer.Option("1K..64M", help="LO..HI doubling, or a comma list (K/M/G = 2^10/20/30)"),
                   out: Path = typer.Option(Path("bench-comm"), help="folder for the nccl-tests text, pairs and calibration.toml"),
                   testbed: Optional[str] = typer.Option(None, help="run on the netns testbed of this prefix"),
                   iters: int = typer.Option(20, help="timed calls per size at most"),
                   budget_s: float = typer.Option(0.2, help="seconds per size, which caps iters"),
                   timeout_s: float = typer.Option(600.0, help="kill the run after this many seconds")):
    """Collectives per link class in nccl-tests columns, alpha-beta fits, and a send/recv matrix."""
    _require_torch("bench comm")

    try:
        fits = run_bench(nproc, parse_sizes(sizes), out, testbed=testbed, iters=iters, budget_s=budget_s,
                         timeout_s=timeout_s, echo=typer.echo)
    except RuntimeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    raise typer.Exit(0 if fits else 1)


def _bench_target(config: Path, device: str, dtype: Optional[str]) -> tuple[Plan, str, str]:
    """The plan whose local shapes a bench times, the device (``--device``: auto is cuda when
    torch sees one) and the dtype (``--dtype``; default the compute dtype on a GPU, fp32 on the
    CPU). An infeasible mesh exits 1 with its reasons."""
    from meshplan.runtime.bench.gemm import resolve_device

    p = _load(config)
    if isinstance(p, Infeasible):
        _exit_infeasible(p)
    device = resolve_device(device)
    dt = dtype or (p.config.training.compute_dtype if device == "cuda" else "fp32")
    if dt not in ("fp32", "bf16", "fp16"):
        raise ConfigError("--dtype", f"{dt!r}; use fp32, bf16 or fp16")
    return p, device, dt


@bench_app.command("gemm")
def bench_gemm(config: Path = typer.Argument(..., help="TOML config whose local GEMM shapes are timed"),
               out: Path = typer.Option(Path("gemm.csv"), "--out", help="CSV table for --gemm-table"),
               device: str = typer.Option("auto", "--device", help="cpu, cuda or auto (cuda when present)"),
               dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: compute dtype "
                                                   "on a GPU, fp32 on the CPU)"),
               max_elements: Optional[int] = typer.Option(None, "--max-elements",
                                                          help="scale M down so an operand has at most this many "
                                                               "elements (default 2**22 on the CPU, none on a GPU)"),
               force: bool = typer.Option(False, "--force", help="replace an existing --out file")):
    """Time the plan's local GEMM shapes (forward and backward) and write the efficiency table."""
    _require_torch("bench gemm")
    from meshplan.runtime.bench.gemm import bench, write_table

    p, device, dt = _bench_target(config, device, dtype)
    limit = max_elements if max_elements is not None else (2 ** 22 if device == "cpu" else None)
    rows = bench(list(p.gemms), dtype=dt, device=device, max_elements=limit)
    typer.echo(f"{'M':>7} {'N':>7} {'K':>7} {'dtype':>5} {'time (us)':>11} {'TFLOP/s':>8}  device")
    for r in rows:
        scaled = f" (run at M {r.scaled_m})" if r.scaled_m != r.gemm.m else ""
        typer.echo(f"{r.gemm.m:7d} {r.gemm.n:7d} {r.gemm.k:7d} {r.dtype:>5} {r.seconds * 1e6:11.1f} "
                   f"{r.tflops:8.2f}  {r.device}{scaled}")
    typer.echo(f"wrote {write_table(rows, out, force=force)}")


@bench_app.command("attention")
def bench_attention(config: Path = typer.Argument(..., help="TOML config whose local attention is timed"),
                    out: Path = typer.Option(Path("attention.json"), "--out", help="JSON table for --gemm-table"),
                    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto (cuda when present)"),
                    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: compute "
                                                        "dtype on a GPU, fp32 on the CPU)"),
                    with_gemm: Optional[Path] = typer.Option(None, "--with-gemm", help="a `bench gemm` table whose "
                                                             "rows are written into --out too (one file for step)"),
                    repeats: int = typer.Option(5, "--repeats", help="timed calls (median)"),
                    force: bool = typer.Option(False, "--force", help="replace an existing --out file")):
    """Time the plan's local attention (torch SDPA, forward and backward) and write the table --gemm-table reads."""
    _require_torch("bench attention")
    from meshplan.runtime.bench.attention import bench_plan, gemm_rows, write_table

    p, device, dt = _bench_target(config, device, dtype)
    r = bench_plan(p, dt, device, repeats=max(1, repeats))
    fwd_flops = 2.0 * r["batch"] * r["q_heads"] * r["seq_q"] * r["seq_kv"] * r["head_dim"]  # causal half
    typer.echo(f"attention b {r['batch']} heads {r['q_heads']} (kv {r['kv_heads']}) s_q {r['seq_q']} s_kv "
               f"{r['seq_kv']} d {r['head_dim']} {dt}: forward {r['forward_s'] * 1e6:.1f} us "
               f"({fwd_flops / r['forward_s'] / 1e12:.3f} TFLOP/s), backward {r['backward_s'] * 1e6:.1f} us "
               f"({2.5 * fwd_flops / r['backward_s'] / 1e12:.3f} TFLOP/s; flash-attention FLOP convention)  "
               f"{r['device']}")
    rows = (gemm_rows(with_gemm) if with_gemm else []) + [r]
    typer.echo(f"wrote {write_table(rows, out, force=force)}")


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: run the app, turning ConfigError into one line and exit 2."""
    try:
        app(args=argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
