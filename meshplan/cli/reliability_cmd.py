"""reliability: failure domains, interruptions, checkpoint size and interval, goodput, and the
restart on fewer nodes (a verdict of its own when ``--lost-nodes`` is given)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from meshplan.cli.common import (
    CONFIG_HELP,
    CalibrationOpt,
    KernelsOpt,
    _echo,
    _exit_infeasible,
    _infeasible,
    _json_option,
    _refuse_existing,
    _verdict_exit,
    _write_doc,
)
from meshplan.cli.foreign_opts import Foreign, foreign_options
from meshplan.cli.loading import _calibrated, _calibration, _kernels_note, _load
from meshplan.errors import ConfigError, check_number
from meshplan.plan import Infeasible
from meshplan.plan_runtime import run_reasons
from meshplan.reliability import DEFAULT_RATE_PER_GPU_DAY, job_interval, reliability as rel, storage_default_note
from meshplan.report.json_docs import envelope, reliability_doc
from meshplan.restart import checkpoint_engine, engine_rules, plan_evaluator, restart_on_fewer_nodes
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.spec.accuracy import REMESH_MARGIN
from meshplan.spec.search import ASSUMED_RESTART_OVERHEAD_S, LLAMA3_STORAGE_GB_PER_S, checkpoint_inputs_words



def _check_storage(write_gbps: float, read_gbps: float, rank_gbps: Optional[float], restart_overhead_s: float) -> None:
    """The storage bandwidths (1 MB/s to 1 PB/s) and the restart overhead (up to 11.6 days), each
    a one-line error naming its option."""
    for name, v in (("--write-gbps", write_gbps), ("--read-gbps", read_gbps)) + ((("--rank-gbps", rank_gbps),)
                                                                              if rank_gbps is not None else ()):
        check_number(name, v, 1e-3, 1e6, "GB/s", "1 MB/s to 1 PB/s: beyond every storage system, and the write "
                     "and read times stay finite")
    check_number("--restart-overhead-s", restart_overhead_s, 0.0, 1e6, "s", "up to 11.6 days")


def _restart(p, lost_nodes: int, spare_nodes: int, before):
    """The restart of plan ``p`` after losing ``lost_nodes`` (``spare_nodes`` replacing them first),
    within what its engine runs, each mesh planned; ``before``: the plan's own step."""
    t = p.config.training
    pipeline, degrees = engine_rules(p)  # within what the engine runs (DeepSpeed: the data axis, pp where it can)
    return restart_on_fewer_nodes(p.mesh, lost_nodes, gpus_per_node=p.config.cluster.node.gpus,
                                  global_batch=t.global_batch, micro_batch=t.micro_batch, spare_nodes=spare_nodes,
                                  micro_batch_reasons=lambda pp, m: run_reasons(p.spec.pp_schedule, pp, m, p.vpp,
                                                                                t.pp_schedule_runs, t.framework),
                                  pipeline=pipeline, degrees=degrees, sharding=t.sharding,
                                  checkpoint=checkpoint_engine(t),
                                  old_infeasible="" if p.feasible else f"infeasible: {p.reasons[0]}",
                                  evaluate=plan_evaluator(p, p.config.cluster.nodes - max(0, lost_nodes - spare_nodes)),
                                  old_step=(before.step_s, before.tokens_per_s))


@foreign_options()
def reliability(config: Path = typer.Argument(..., help=CONFIG_HELP),
                write_gbps: Optional[float] = typer.Option(
                    None, "--write-gbps", help="aggregate checkpoint write bandwidth, GB/s (default 2000: the Llama 3 "
                                               "paper's sustained storage throughput, as search's; printed)"),
                read_gbps: Optional[float] = typer.Option(
                    None, "--read-gbps", help="aggregate checkpoint read bandwidth, GB/s (default 2000, as "
                                              "--write-gbps)"),
                rank_gbps: Optional[float] = typer.Option(
                    None, "--rank-gbps", help="storage bandwidth of one rank, GB/s: times the bytes the busiest rank "
                                              "writes under DCP (its share of replicated shards) or DeepSpeed's save_checkpoint, and reads back"),
                restart_overhead_s: Optional[float] = typer.Option(
                    None, "--restart-overhead-s", help="detection + rescheduling + start-up, seconds (default 600: an "
                                                       "assumption, no published figure, as search's; printed)"),
                lost_nodes: Optional[int] = typer.Option(
                    None, "--lost-nodes", help="nodes lost in the restart scenario (default 1): the restart keeps "
                                               "pp, tp and cp and shrinks the data axes unless a mesh changing them "
                                               f"plans over {REMESH_MARGIN:.1%} more tokens/s (a why: line says which); given, a "
                                               "restart that cannot run makes the command exit 1"),
                spare_nodes: int = typer.Option(0, "--spare-nodes", help="spare nodes available: they replace lost "
                                                                         "nodes first (the same mesh)"),
                gpu_failure_rate: float = typer.Option(
                    DEFAULT_RATE_PER_GPU_DAY, "--gpu-failure-rate",
                    help="unexpected job interruptions per GPU-day (default 4.74e-4: the Llama 3 paper, arXiv "
                         "2407.21783 3.3.4, 419 in 54 days on 16,384 H100); the job's rate is it x GPUs"),
                calibration: CalibrationOpt = None,
                json_path: Optional[Path] = _json_option("reliability"),
                force: bool = typer.Option(False, "--force", help="replace an existing --json file"),
                kernels: KernelsOpt = None,
                foreign: Foreign = Foreign()):
    """Failure domains, interruptions per day, checkpoint size and interval (the job's own beside the
    optimum, when the config says it), goodput, restart. Storage bandwidths and restart overhead left out
    take search's defaults, named on an 'inputs:' line with their source. --gpu-failure-rate sets the
    interruptions per GPU-day (default Llama 3's 4.74e-4); --calibration (as step's) times the plan and the
    restart meshes with the calibrated links."""

    defaults = [flag for flag, v in (("--write-gbps", write_gbps), ("--read-gbps", read_gbps)) if v is None]
    write_gbps, read_gbps, restart_overhead_s, inputs = _storage_inputs(write_gbps, read_gbps, restart_overhead_s)
    _check_storage(write_gbps, read_gbps, rank_gbps, restart_overhead_s)
    asked = lost_nodes is not None  # the default scenario is a what-if: it informs, it does not fail the command
    lost_nodes = 1 if lost_nodes is None else lost_nodes
    check_number("--lost-nodes", lost_nodes, 0, 10 ** 7, "nodes")
    check_number("--spare-nodes", spare_nodes, 0, 10 ** 7, "nodes")
    check_number("--gpu-failure-rate", gpu_failure_rate, 1e-9, 1.0, "per GPU-day",
                 "above 0 (an MTBF) and at most one interruption per GPU a day")
    _refuse_existing(json_path, force, "--json")
    p = _load(config, calibration=calibration, fmt=foreign.fmt, opts=foreign.options(), kernels=kernels)
    cal = _calibration(calibration, p.config.cluster)  # prints its header line, as step's
    _kernels_note(p.config.cluster)  # the restart meshes' tokens/s are timed with them
    if isinstance(p, Infeasible):
        _write_doc(json_path, _calibrated(envelope("reliability", p), cal), force)
        _exit_infeasible(p)
    if lost_nodes > p.config.cluster.nodes:
        nodes = p.config.cluster.nodes
        raise ConfigError("--lost-nodes", f"{lost_nodes} is more than the cluster's {nodes} node{'s' * (nodes != 1)}")
    before = step_time(p, Overlap())  # the throughput a restart loses is against the plan's own step
    job = job_interval(p.config, before.step_s)
    r = rel(p, write_bandwidth_bytes_per_s=write_gbps * 1e9, read_bandwidth_bytes_per_s=read_gbps * 1e9,
            restart_overhead_s=restart_overhead_s, rate_per_gpu_day=gpu_failure_rate,
            per_rank_bandwidth_bytes_per_s=rank_gbps * 1e9 if rank_gbps else None, job=job)
    note = [storage_default_note(p.config.cluster, defaults)] if defaults else []
    for line in ([inputs] if inputs else []) + note + r.lines():
        _echo(line)
    rs = _restart(p, lost_nodes, spare_nodes, before)
    for line in rs.lines():
        _echo(line)
    _write_doc(json_path, _calibrated(reliability_doc(p, r, rs), cal), force)
    _verdict_exit(p)
    if not rs.feasible and asked:  # the restart asked for is a verdict too: no GPU or no mesh left is exit 1
        _infeasible(rs, f"restart after losing {lost_nodes} of {p.config.cluster.nodes} nodes ({spare_nodes} spare)")
        raise typer.Exit(1)


def _storage_inputs(write_gbps: Optional[float], read_gbps: Optional[float],
                    restart_overhead_s: Optional[float]) -> tuple[float, float, float, Optional[str]]:
    """The write and read bandwidths (GB/s) and restart overhead (s), each left out at search's
    default (:data:`meshplan.spec.search.LLAMA3_STORAGE_GB_PER_S`,
    :data:`~meshplan.spec.search.ASSUMED_RESTART_OVERHEAD_S`), and the ``inputs:`` line naming the
    defaults taken with their source and option (None where all three are given)."""
    given = {"write": ("--write-gbps", write_gbps, LLAMA3_STORAGE_GB_PER_S),
             "read": ("--read-gbps", read_gbps, LLAMA3_STORAGE_GB_PER_S),
             "restart": ("--restart-overhead-s", restart_overhead_s, ASSUMED_RESTART_OVERHEAD_S)}
    unset = {k: opt for k, (opt, v, _) in given.items() if v is None}
    w, r, o = (default if v is None else v for _, v, default in given.values())
    return w, r, o, ("inputs: " + checkpoint_inputs_words(w, r, o, unset)) if unset else None
