"""place, launch, nccl-check: the rank -> GPU placement and its per-rank bindings, the
torchrun and Slurm scripts that apply it, and an NCCL_DEBUG=INFO log checked against it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from meshplan.cli.common import (
    TOML_ONLY_HELP,
    CalibrationOpt,
    TopologyOpt,
    _check_rank,
    _echo,
    _exit_infeasible,
    _json_option,
    _refuse_existing,
    _verdict_exit,
    _write_doc,
    _written,
    _wrote,
)
from meshplan.cli.loading import _calibration, _load
from meshplan.comm.nccl_check import check_log
from meshplan.comm.nccl_log import read_nccl_log
from meshplan.errors import ConfigError
from meshplan.fileio import check_destination
from meshplan.interop.launch_args import megatron_program_args, refuse_unplanned
from meshplan.interop.launch_deepspeed import refuse_deepspeed_mismatch
from meshplan.interop.megatron_env import launch_env, script_env
from meshplan.interop.source_file import carried_source
from meshplan.placement.assign import rank_row
from meshplan.placement.bindings import LAUNCH_VISIBLE, NIC_SCOPE, RANK_SCOPE_TRADE, bindings, write_bindings
from meshplan.placement.choice import choose_placement, for_command
from meshplan.placement.score import weights_from_plan
from meshplan.placement.launch import (LaunchOptions, check_launch_folder, check_program, local_folder_note,
                                      write_launch)
from meshplan.plan import Plan
from meshplan.report.json_docs import envelope, launch_doc, nccl_check_doc, place_doc
from meshplan.report.place_text import launch_lines, place_lines
from meshplan.schedule.placement_score import step_scorer
from meshplan.spec.wording import expert_data_axis, group_words


NIC_SCOPE_HELP = ("NICs each rank's NCCL may use (NCCL_IB_HCA, or NCCL_SOCKET_IFNAME with --transport socket): "
                  "node (default: every compute NIC of the node, the same list for all its ranks, as NCCL expects; "
                  "NCCL then takes the NIC nearest each GPU and can relay send/recv through a peer-rail NIC by "
                  "PXN) or rank (only the NIC under the rank's PCIe switch: a fixed NIC per rank, but a different "
                  "NCCL_IB_HCA per rank, which NCCL does not support, and no PXN or second NIC)")


def _check_nic_scope(nic_scope: str) -> None:
    """ConfigError naming --nic-scope for a value other than node or rank (before any planning)."""
    if nic_scope not in ("node", "rank"):
        raise ConfigError("--nic-scope", f"{nic_scope!r} is not one of node, rank")


def nccl_check(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its placement is checked"),
               log: Path = typer.Argument(..., help="NCCL_DEBUG=INFO output of the run"),
               json_path: Optional[Path] = _json_option("nccl-check"),
               force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Check that each communicator used the NICs and intra-node links the placement meant. Global ranks come from
    the log's communicator of every rank; a log without one cannot be checked (exit 2). A mesh that does not fit is
    still checked when it can be placed, then exits 1 with its reasons. A communicator whose channel lines fit another
    of their process alike (no Init START or comm lines to bracket them) is said 'cannot check', not differed."""

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
    for d in [*check.cannot_check, *diffs]:
        _echo(d)
    cannot = f"; {len(check.cannot_check)} communicator(s) cannot be checked" if check.cannot_check else ""
    _echo(f"{len(diffs)} difference(s) between the NCCL log and the placement{cannot}")
    _write_doc(json_path, nccl_check_doc(p, str(log), diffs, check.cannot_check), force)
    _verdict_exit(p)
    raise typer.Exit(1 if diffs else 0)



def _script_env(config: Path, cfg) -> tuple:
    """``torchrun.sh``'s lines for the NCCL_* / NVTE_* exports of the Megatron-LM launch script
    ``config`` was imported from (its ``[source]``; :func:`~meshplan.interop.megatron_env.script_env`),
    as ``export --to megatron`` carries them into its header (newcomer trial 34 finding 5); none for
    another source or where it no longer reads (export says so)."""
    try:
        user, _ = carried_source(config, None, cfg)
    except ConfigError:
        return ()
    return script_env(user.env, user.name or str(config)) if user is not None and user.fmt == "megatron" else ()


def _choice(p, choose: bool):
    """The placement choice of ``p`` (``--choose``: scored by its step model), weighted by its
    collective table, its axes named as ``plan`` names them (the experts' data axis by the sharding,
    :func:`meshplan.spec.wording.expert_data_axis`: ``edp`` under DDP and ZeRO-1/2; Megatron-LM's dp x cp
    group by :func:`~meshplan.spec.wording.group_words`, ``dp x cp (distributed optimizer)`` as ``plan``'s
    groups table has it, not ``fsdp``: newcomer trial 34 finding 8)."""
    score = step_scorer(p) if choose and isinstance(p, Plan) else None
    return choose_placement(p.mesh, p.config.cluster, (weights_from_plan(p) or None) if isinstance(p, Plan) else None,
                            rank_to_gpu=p.spec.rank_to_gpu, search=choose, source="collective table", step_s=score,
                            schedule=p.spec.pp_schedule, vpp=p.vpp,
                            labels={"efsdp": expert_data_axis(p.config.training.sharding),
                                    **group_words(p.config.training, p.config.origin)})

def place_cmd(config: Path = typer.Argument(..., help=TOML_ONLY_HELP),
              choose: bool = typer.Option(False, "--choose", help="search the rank -> GPU permutation with the shortest predicted step (fewest weak-path bytes at equal steps)"),
              bindings_path: Optional[Path] = typer.Option(None, "--bindings", help="write every rank's binding to this file (the environment launch's bind.sh exports, and its cores and NIC)"),
              fmt: str = typer.Option("json", "--format", help="bindings file format: json (list) or sh (launcher)"),
              force: bool = typer.Option(False, "--force", help="replace existing --bindings and --json files"),
              visible: str = typer.Option(LAUNCH_VISIBLE, "--visible", help="CUDA_VISIBLE_DEVICES per rank, printed "
                                                                   "and in --bindings: all (default, as `meshplan launch`: "
                                                                   "the node's GPUs in LOCAL_RANK order, device "
                                                                   "cuda:{LOCAL_RANK}, as torchtitan's and Megatron-LM's "
                                                                   "scripts use) or one (its own GPU alone, cuda:0)"),
              ranks: Optional[list[int]] = typer.Option(None, "--rank", help="rank whose binding is printed (repeatable; default first, second, last)"),
              nic_scope: str = typer.Option(NIC_SCOPE, "--nic-scope", help=NIC_SCOPE_HELP),
              topology: TopologyOpt = None,
              calibration: CalibrationOpt = None,
              json_path: Optional[Path] = _json_option("place")):
    """Placement per axis, decisions and warnings, per-rank bindings (CUDA_VISIBLE_DEVICES, NCCL_IB_HCA, numactl).
    --calibration times --choose's candidates on the measured links, as step does. A mesh that does not fit is
    still placed, then exits 1 with its reasons."""

    if fmt not in ("json", "sh"):
        raise ConfigError("--format", f"{fmt!r} is not one of json, sh")
    if visible not in ("one", "all"):
        raise ConfigError("--visible", f"{visible!r} is not one of one, all")
    _check_nic_scope(nic_scope)
    if bindings_path:
        check_destination(bindings_path, "--bindings", force)
    _refuse_existing(json_path, force, "--json")
    p = _load(config, topology, calibration)
    _calibration(calibration, p.config.cluster)
    if p.mesh is None:
        _write_doc(json_path, envelope("place", p), force)
        _exit_infeasible(p)
    shown = ranks or sorted({0, min(1, p.world - 1), p.world - 1})
    for r in shown:
        _check_rank(p, r)
    c = _choice(p, choose)
    for line in place_lines(c, shown, visible=visible, nic_scope=nic_scope):
        _echo(line)
    if nic_scope == "rank":
        _echo(f"note: {RANK_SCOPE_TRADE}")
    if bindings_path:
        _wrote(write_bindings(bindings_path, c.placement, fmt=fmt, force=force, visible=visible, nic_scope=nic_scope))
    _write_doc(json_path, place_doc(p, c, [bindings(c.placement, r, visible=visible, nic_scope=nic_scope)
                                           for r in shown]), force)
    _verdict_exit(p)


def launch_cmd(config: Path = typer.Argument(..., help=TOML_ONLY_HELP),
               program: Optional[list[str]] = typer.Argument(None, metavar="-- PROGRAM...",
                                                            help="the training command each rank runs, after `--` "
                                                                 "(e.g. -- python train.py --job.config_file x.toml)"),
               out: Optional[Path] = typer.Option(None, "--out", help="folder for bind.sh, torchrun.sh, job.sbatch "
                                                                         "and bindings.json (default: out/launch/ "
                                                                         "and CONFIG's name); a rerun replaces "
                                                                         "meshplan's own unchanged output under "
                                                                         "out/, and refuses any other of these "
                                                                         "files (an edited one, or one elsewhere) "
                                                                         "unless --force"),
               rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                           help="HOST:PORT of the plan's node 0 for torchrun's "
                                                                "static rendezvous (default: the first of --hosts, "
                                                                "else Slurm's first host, at --port; "
                                                                "MESHPLAN_RDZV_ENDPOINT overrides it at run time)"),
               port: int = typer.Option(29500, "--port", help="rendezvous port on the plan's node 0 (the first "
                                                                 "of --hosts, else Slurm's first host)"),
               hosts: Optional[str] = typer.Option(None, "--hosts", help="comma-separated host names, one per node "
                                                                         "in the plan's node order (Slurm "
                                                                         "--nodelist; torchrun.sh gives each host "
                                                                         "its place as --node-rank and bind.sh "
                                                                         "refuses another)"),
               transport: str = typer.Option("ib", "--transport", help="ib (NCCL_IB_HCA per rank) or socket "
                                                                      "(NCCL_SOCKET_IFNAME per rank)"),
               nic_scope: str = typer.Option(NIC_SCOPE, "--nic-scope", help=NIC_SCOPE_HELP),
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
               topology: TopologyOpt = None,
               json_path: Optional[Path] = _json_option("launch"),
               force: bool = typer.Option(False, "--force", help="replace existing files in --out and --json")):
    """Write a multi-node torchrun command (static rendezvous, --node-rank the host's node in the plan), a Slurm sbatch script and per-rank bindings
    (GPUs visible in LOCAL_RANK order for cuda:{LOCAL_RANK} scripts, NUMA cores, NCCL NIC variables;
    for a Megatron-LM plan CUDA_DEVICE_MAX_CONNECTIONS as its validate_args asserts it, and the NCCL_*/NVTE_* exports of the launch script it was imported from). A mesh that does not fit writes nothing and exits 1. A program whose first word is a Python file
    (train.py) is refused: bind.sh execs it as a command; give -- python train.py. For a Megatron-LM plan the flags
    export --to megatron writes (with its [source]'s flags meshplan does not plan) are appended to the program, after its
    own words (argparse keeps the last of a repeated flag), and a note says so; a flag meshplan plans that the program
    gives but the appended flags leave out (a switch the plan keeps off, such as --sequence-parallel) is refused, since
    no later word would undo it. For a DeepSpeed plan the command's HF Trainer batch flags
    (--per_device_train_batch_size, --gradient_accumulation_steps) and the DeepSpeed JSON after --deepspeed or
    --deepspeed_config (its ZeRO stage, hpZ partition and batch numbers) are checked against the plan, and a mismatch
    is refused."""

    out = _launch_refusals(config, program, nic_scope, out, json_path, force)
    p = _load(config, topology)
    if p.mesh is None or not p.feasible:
        _write_doc(json_path, launch_doc(p, 0, [], ""), force)
        _exit_infeasible(p)
    c = _choice(p, choose)
    c = for_command(c, "launch")  # its warnings name launch --choose
    appended, appended_note = (megatron_program_args(p.config, config)
                               if program and p.config.training.framework == "megatron" else ((), ""))
    # a planned flag the appended ones leave out (a carried switch the plan keeps off too)
    refuse_unplanned(tuple(program or ()), appended, config, p.config.training)
    # a DeepSpeed plan's command: its JSON's and the HF Trainer's batch and ZeRO numbers against the plan's
    for n in refuse_deepspeed_mismatch(tuple(program or ()), p.config.training, p.micro_batches, config):
        _echo(f"note: {n}", err=True)
    opts = LaunchOptions(program=tuple(program or ()) + appended, rdzv_endpoint=rdzv_endpoint, port=port,
                         hosts=tuple(h for h in (hosts or "").split(",") if h), transport=transport,
                         nic_scope=nic_scope, socket_ifname=socket_ifname, cpu_bind=cpu_bind, job_name=job_name,
                         partition=partition, time_limit=time_limit,
                         env=launch_env(p.config) + _script_env(config, p.config))
    written = write_launch(out, c.placement, opts, force=force)
    _echo_launch(c, nic_scope, appended_note, written, out)
    nodes = int(c.placement.node.max()) + 1
    endpoint = "" if rdzv_endpoint or hosts else " MESHPLAN_RDZV_ENDPOINT=<node 0 host:port>"
    who = f"host {hosts} (the plan's node order)" if hosts else f"of the {nodes} node(s) NODE_RANK=<k>"
    run = (f"on each {who}{endpoint} {out / 'torchrun.sh'}; or with Slurm: "
           f"sbatch {out / 'job.sbatch'}")
    typer.echo(f"run: {run}")
    _write_doc(json_path, launch_doc(p, nodes, _written(written), run, c), force)


def _launch_refusals(config: Path, program: Optional[list[str]], nic_scope: str, out: Optional[Path],
                     json_path: Optional[Path], force: bool) -> Path:
    """launch's refusals before the planning (a Python file as the program, --nic-scope, an
    existing script in --out or an existing --json); the --out folder, by default
    out/launch/<CONFIG's name>."""
    if program:  # a Python file as the command, before the planning (bind.sh execs it); none: after the plan
        check_program(tuple(program))
    _check_nic_scope(nic_scope)
    if out is None:  # defaults go under out/ (docs/commands.md "Outputs"); an earlier run's folder is refused, as report's file
        out = check_destination(Path("out") / "launch" / config.stem, "--out", force, folder=True)
    check_launch_folder(out, force)  # an existing script is refused before the planning, as --json
    _refuse_existing(json_path, force, "--json")
    return out


def _echo_launch(c, nic_scope: str, appended_note: str, written, out: Path) -> None:
    """The placement's lines and warnings, the notes (rank NIC scope, the appended Megatron-LM
    flags, a node-local --out) and the files written."""
    for line in launch_lines(c):  # the choice and the warnings place prints: never a silent permutation
        _echo(line)
    if nic_scope == "rank":
        _echo(f"note: {RANK_SCOPE_TRADE}")
    if appended_note:
        _echo(appended_note)
    for path in written:
        _wrote(path)
    if local_folder_note(out):  # job.sbatch finds the folder from the submit directory; the nodes must see it
        _echo(local_folder_note(out), err=True)
