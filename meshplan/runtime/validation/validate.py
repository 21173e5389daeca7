"""``meshplan validate``: run a planned mesh for real with torchrun and compare it with the plan.

For each world size W (staged: 2, then 4, then 8 ...):

1. **Scale** (:mod:`meshplan.runtime.validation.scaling`). The config's mesh is re-sized to W
   by its outermost data axis (dp_replicate, dp or dp_shard, the outermost one of degree > 1):
   every other axis keeps its degree, ``data = W / (product of the others)`` (printed). The
   model is scaled down by stated factors (:func:`~meshplan.runtime.execution.model.scale_model`:
   layers, hidden / N, vocab); the batch is ``micro_batches`` micro-batches of ``micro_batch``
   x ``seq_len`` per data-parallel rank (``global_batch = micro_batch x dp x micro_batches``),
   by default the fewest the pipeline schedule runs
   (:func:`~meshplan.runtime.validation.scaling.micro_batches_for`: 1 at pp 1, pp for 1F1B);
   every dtype is fp32 (CPU); ``recompute = "selective"`` runs as none (the runtime model
   recomputes whole layers or nothing).
2. **Hardware.** On CPU, the cluster is the CPU testbed (``cpu_testbed.toml``: measured core
   GEMM rate, memory bandwidth, gloo loopback bandwidth and latency), one node of W "GPUs"
   = ranks, each with ``min(1, cores / W)`` of a core; NCCL buffers and cuBLAS workspace are 0
   in the memory timeline (gloo and CPU BLAS allocate neither through torch). The plan's own
   local GEMM shapes and its local causal attention (forward, backward) are timed in this
   process (one thread) into a GEMM table (:class:`meshplan.compute.gemm.GemmTable`), divided by the
   core share, and the step-time model uses it. After the steps the worker times each of
   the plan's collectives under the run's load (:mod:`meshplan.runtime.validation.probe`); the
   comparison adds the step-time model re-evaluated with those times ("calibrated" rows).
3. **Plan** (:func:`meshplan.plan.build_plan`) written as ``plan.json``.
4. **Run** ``torchrun --standalone`` of :mod:`meshplan.runtime.execution.worker` (or, with
   ``testbed``, one torchrun per node namespace: :mod:`meshplan.runtime.testbed.run`) with a
   wall-clock limit (:mod:`meshplan.runtime.execution.launch`: nothing is left running, a failed or hung rank is
   named). Across real hosts (``nnodes > 1``): every host runs ``validate`` with its
   ``node_rank`` and the same ``rdzv_endpoint`` (node 0's HOST:PORT, static rendezvous hosted
   by node 0), ``W / nnodes`` ranks per host; ``OUT`` must be a folder all hosts share (the
   workers write ``rank<r>/`` there); node 0 clears it, compares and writes the evidence,
   the others keep their inputs in a local temporary folder and leave
   ``world<W>/torchrun-node<k>.log``.
5. **Compare** (:mod:`meshplan.runtime.validation.evidence`): collectives of every rank against the
   plan's table (count, group, bytes, dtype), step and phase times against
   :func:`meshplan.schedule.steptime.step_time`, peak memory against the memory timeline, and
   the bytes each rank wrote in a DCP save after the steps against
   :func:`meshplan.checkpoint_bytes.dcp_write_bytes` (save and load times at ``--checkpoint-gbps``).
6. **Staged evidence** (:mod:`meshplan.runtime.validation.staged`): each axis's message curve
   (1 KiB..4 MiB, timed in the launch after the probe) against the comm model, the arrival
   skew of every collective of the recorded step against the predicted slack, each local
   kernel against the kernel-efficiency model, and the checkpoint per rank; summed up across
   worlds at the top of ``summary.md``.

Evidence folder ``OUT``: ``validate.json`` and ``summary.md`` (all worlds), and per world
``world<W>/``: ``plan.json``, ``gemm_table.json``, ``torchrun.log``, ``rank<r>/`` (the
workers' files), ``collectives.csv``, ``predicted_vs_measured.csv`` and ``.json``,
``staged.json`` with ``message_curves.csv``, ``arrival_skew.csv``, ``kernels.csv`` and
``checkpoint.csv``, ``comparison.json`` (the world's result: notes, outcome, comparison or fault report, and
``host``: cores, load before and after, and whether measured times are reliable, see
:mod:`meshplan.runtime.validation.host`). The folder is built as ``.OUT.<random>.partial``
and renamed to ``OUT`` at the end. Exit code 0 when every world ran and matched, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from meshplan.config import Config, load_config
from meshplan.errors import ConfigError, ConfigErrors
from meshplan.fileio import check_destination, owned, staged_folder
from meshplan.plan import Infeasible as NoPlan
from meshplan.plan import build_plan
from meshplan.report.json_out import write_json
from meshplan.runtime.execution.launch import diagnose, run_torchrun
from meshplan.runtime.testbed.nics import nic_rows
from meshplan.runtime.testbed.run import run_on_testbed
from meshplan.runtime.validation import host
from meshplan.runtime.validation.coverage import everywhere, not_exercised
from meshplan.runtime.validation.kerneltimes import measure_attention, measure_gemms
from meshplan.runtime.validation.op_order import order_lines
from meshplan.runtime.validation.options import Options, check_hosts, world_timeout_s
from meshplan.runtime.validation.probe import curve_spec, probe_spec
from meshplan.runtime.validation.refusals import refusals, runtime_refusals
from meshplan.runtime.validation.scaling import scale_config

MARKER = "validate.json"


def prepare_out(out: Path, force: bool) -> None:
    """Refuse, before the run, a non-empty ``out`` unless ``force`` and it is an evidence
    folder of ours, and an ``out`` that cannot be written; its missing parent folders are made
    (newcomer trial 21 #6: ``--out runs/val1`` without ``runs/``). The folder itself is built by
    :func:`meshplan.fileio.staged_folder` (under a temporary name, renamed at the end)."""
    if out.is_dir() and any(out.iterdir()) and not owned(out):  # a rerun replaces its own, unchanged (out/)
        if not force:
            raise ConfigError("--out", f"{out} exists and is not empty; choose another folder or pass --force")
        if not (out / MARKER).exists() and not any(out.glob("world*/plan.json")):
            raise ConfigError("--out", f"{out} is not a meshplan validate folder (no {MARKER}); --force only "
                              "replaces those")
    check_destination(out, "--out", force, folder=True, create_folders=True, replaced=True)


def not_runnable(cfg: Config, mesh) -> Optional[str]:
    """Why the runtime cannot build the scaled ``cfg``'s resolved ``mesh`` (None when it can): every
    reason of :func:`meshplan.runtime.validation.refusals.runtime_refusals`, joined by "; "."""
    return "; ".join(runtime_refusals(cfg, mesh)) or None


def run_world(config: Config, world: int, opt: Options, out: Path, echo=print) -> dict:
    """Scale, plan, run and compare one world size; returns its result dict, with
    ``not_exercised``: the config's axes of degree > 1 this world runs at 1
    (:func:`meshplan.runtime.validation.coverage.not_exercised`)."""
    folder = out / f"world{world}"
    if opt.node_rank > 0:  # node 0 owns (and may still be clearing) the shared OUT: nothing of ours in it yet
        with tempfile.TemporaryDirectory(prefix=f"meshplan-node{opt.node_rank}-w{world}-") as tmp:
            result = _run_world(config, world, opt, folder, Path(tmp), echo)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        result = _run_world(config, world, opt, folder, folder, echo)
    return {**result, "not_exercised": not_exercised(config, world, opt)}  # axes this world left at degree 1


def _run_world(config: Config, world: int, opt: Options, folder: Path, work: Path, echo) -> dict:
    """:func:`run_world` with this host's plan, GEMM table, probe spec and torchrun log in
    ``work`` (``folder`` on node 0, a local folder on the others: node 0 may still be
    clearing ``OUT``); the workers write their ``rank<r>/`` into ``folder``."""
    prep = prepare_world(config, world, opt, folder, work, echo)
    if isinstance(prep, dict):  # infeasible or not runnable: nothing to launch
        return prep
    before = host.state()
    nic_bytes = None
    if opt.testbed:
        outcome, nic_bytes = run_on_testbed(opt.testbed, world, prep.argv, folder, prep.limit_s,
                                            env={"PYTHONPATH": _pythonpath()})
    else:
        outcome = run_torchrun(world, prep.argv, work / "torchrun.log", prep.limit_s,
                               env={"PYTHONPATH": _pythonpath()}, rdzv=opt.rendezvous)
    if work != folder:  # another host: its log beside node 0's evidence; node 0 compares
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "torchrun.log", folder / f"torchrun-node{opt.node_rank}.log")
        return {"world": world, "notes": prep.notes, "ok": outcome.ok, "stage": "run",
                "returncode": outcome.returncode, "timed_out": outcome.timed_out,
                "message": f"node {opt.node_rank}: torchrun exited "
                f"{'at the time limit' if outcome.timed_out else outcome.returncode}; node 0 compares the run with "
                f"the plan in {folder}"}
    return finish_world(prep, opt, outcome, before, nic_bytes)


@dataclass
class Prepared:
    """One world ready to launch: the scaled ``plan``, its measured GEMM ``table``, the worker's
    ``argv`` (module first), the scaling ``notes``, the process-group timeout (s), the evidence
    ``folder`` the ranks write into, the wall-clock ``limit_s`` (s,
    :func:`~meshplan.runtime.validation.options.world_timeout_s`)."""

    world: int
    plan: object
    table: object
    argv: list[str]
    notes: list[str]
    pg_timeout_s: float
    folder: Path
    limit_s: float


def prepare_world(config: Config, world: int, opt: Options, folder: Path, work: Path, echo) -> "Prepared | dict":
    """Steps 1-3 of the module docstring for one world: scale, plan (``work/plan.json``), time the
    plan's GEMMs (``work/gemm_table.json``) and the probe specs; a result dict instead when the
    scaled plan is infeasible or the runtime cannot build it."""
    from meshplan.runtime.execution.worker import write_json as write_json_atomic

    cfg, notes = scale_config(config, world, opt)
    if opt.rendezvous is not None:
        per = world // opt.nnodes
        notes.append(f"hosts: {opt.nnodes} x {per} ranks (this is node {opt.node_rank}, ranks {opt.node_rank * per}-"
                     f"{(opt.node_rank + 1) * per - 1}: static rendezvous at {opt.rdzv_endpoint}, --node-rank as "
                     f"launch's torchrun.sh); the prediction still models one host of {world} ranks")
    plan = build_plan(cfg)
    write_json(plan, work / "plan.json", force=True)
    for n in notes:
        echo(f"  {n}")
    if isinstance(plan, NoPlan) or not plan.feasible:
        return {"world": world, "ok": False, "stage": "plan", "notes": notes,
                "message": "the scaled plan is infeasible: " + "; ".join(plan.reasons)}
    why = not_runnable(cfg, plan.mesh)
    if why:
        return {"world": world, "ok": False, "stage": "plan", "notes": notes, "message": f"not runnable here: {why}"}
    share = min(1.0, len(os.sched_getaffinity(0)) / world)
    table, rows = measure_gemms(plan, share)
    if cfg.training.flash_attention:
        att, att_rows = measure_attention(plan, share)
        table, rows = replace(table, attention=att), rows + att_rows
    write_json_atomic(work / "gemm_table.json", {"device": "cpu", "torch": rows and _torch_version(), "rows": rows})
    limit, how = world_timeout_s(opt, world)
    pg_timeout = opt.pg_timeout_s or max(5.0, limit / 2)
    argv = ["meshplan.runtime.execution.worker", "--plan-json", str(work / "plan.json"), "--out", str(folder),
            "--steps", str(opt.steps), "--pg-timeout-s", str(pg_timeout), "--fail-rank", str(opt.fail_rank),
            "--hang-rank", str(opt.hang_rank), "--fault-step", str(opt.fault_step)]
    if opt.probe:
        write_json_atomic(work / "probe_spec.json", probe_spec(plan))
        argv += ["--probe-spec", str(work / "probe_spec.json")]
        if opt.curves:
            write_json_atomic(work / "curve_spec.json", curve_spec(plan))
            argv += ["--curve-spec", str(work / "curve_spec.json")]
    here = f" ({world // opt.nnodes} on this host, node {opt.node_rank} of {opt.nnodes})" if opt.rendezvous else ""
    echo(f"  torchrun: {world} ranks{here}, limit {limit:g} s ({how}; process-group timeout {pg_timeout:g} s)")
    return Prepared(world, plan, table, argv, notes, pg_timeout, folder, limit)


def finish_world(prep: Prepared, opt: Options, outcome, before: dict, nic_bytes=None) -> dict:
    """Steps 5-6 for one world after its launch (``outcome``, :class:`~meshplan.runtime.execution.launch.RunOutcome`;
    ``before``: :func:`meshplan.runtime.validation.host.state` before it): the fault report when a
    rank did not finish, else the comparison, written into ``prep.folder``; returns the world's result."""
    from meshplan.runtime.execution.worker import write_json as write_json_atomic
    from meshplan.runtime.validation.evidence import compare_world, write_world_evidence

    world, folder = prep.world, prep.folder
    host_record = host.verdict(world, before, host.state())
    result = {"world": world, "notes": prep.notes, "host": host_record,
              "elapsed_s": round(outcome.elapsed_s, 2),
              "returncode": outcome.returncode, "timed_out": outcome.timed_out, "leftover_pids": outcome.leftover_pids}
    if nic_bytes is not None:
        result["nic_bytes"] = nic_bytes
    done = all((folder / f"rank{r}" / "status.json").exists() and
               json.loads((folder / f"rank{r}" / "status.json").read_text()).get("state") == "done"
               for r in range(world))
    if not (outcome.ok and done):
        fault = diagnose(outcome, folder, prep.limit_s, prep.pg_timeout_s)
        missing = [r for r in range(world) if not (folder / f"rank{r}").exists()]
        if opt.rendezvous is not None and missing:
            fault["message"] += (f" No rank<r>/ folders for ranks {missing} in {folder}: --out must be a folder "
                                 "every host shares at the same path")
        result.update(ok=False, stage="run", message=fault["message"], fault=fault)
        write_json_atomic(folder / "comparison.json", result)
        return result
    comp = compare_world(prep.plan, folder, prep.table, opt.tolerance, opt.checkpoint_bytes_per_s)
    if opt.testbed:  # bytes per NIC over the steps against the plan (meshplan.runtime.testbed.nics)
        comp["predicted_vs_measured"] += nic_rows(prep.plan, folder, nic_bytes)
    host.mark(comp["predicted_vs_measured"], host_record)
    result.update(ok=comp["ok"], stage="compare", message=comp["message"], comparison=comp)
    write_world_evidence(folder, result)
    return result


def _torch_version() -> str:
    import torch

    return torch.__version__


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + old if old else "")


def validate(config: Config, opt: Options, out: Path, force: bool = False, echo=print) -> tuple[int, list[dict]]:
    """Run every world of ``opt.worlds`` in order; write the evidence folder. Returns
    (exit code, per-world results). The folder is built under a temporary name and renamed
    to ``out`` at the end: an interrupted run (Ctrl-C, SIGTERM) leaves no partial folder."""
    if not opt.worlds or any(w < 1 for w in opt.worlds):
        raise ConfigError(opt.world_option, f"{list(opt.worlds)}: give positive world sizes, e.g. 2,4,8")
    if opt.timeout_s is not None and opt.timeout_s <= 0:
        raise ConfigError("--timeout-s", "must be positive")
    check_hosts(opt)
    errors = refusals(config, opt)  # every stage must scale, and the runtime must build it, before anything runs
    if errors:
        raise ConfigErrors(errors)
    if opt.node_rank == 0:
        prepare_out(out, force)
    if opt.rendezvous is not None:  # every host's ranks write into the shared OUT itself: no staging
        return _run_worlds(config, opt, out, echo)
    with staged_folder(out, "--out", force, create_folders=True) as tmp:
        code, results = _run_worlds(config, opt, tmp, echo)
    return code, results


def _run_worlds(config: Config, opt: Options, out: Path, echo, run_one=None) -> tuple[int, list[dict]]:
    """The worlds of :func:`validate` into the evidence folder ``out`` (a temporary one
    renamed at the end on one host; across hosts the shared ``OUT``); each world's result from
    ``run_one(config, world, opt, out, echo)`` (default :func:`run_world`; a batch of configs
    sharing one launch passes its results: :mod:`meshplan.runtime.validation.batch`)."""
    from meshplan.runtime.execution.worker import write_json as write_json_atomic
    from meshplan.runtime.validation.summary import write_summary

    results = []
    cores = len(os.sched_getaffinity(0))
    for w in opt.worlds:
        echo(f"world {w}:")
        if w > 4 * cores and not opt.testbed:
            echo(f"  note: {w} ranks on {cores} cores ({w / cores:g} per core): every rank time-shares a core; "
                 "start-up alone takes tens of seconds and step times are dominated by scheduling")
        results.append((run_one or run_world)(config, w, opt, out, echo))
        echo(f"  {'OK' if results[-1]['ok'] else 'FAILED'}: {results[-1]['message']}")
        order = (results[-1].get("comparison") or {}).get("op_order")
        for line in order_lines(order)[2:-1] if order else []:  # each rank's first ops (and where it differs)
            echo(f"  {line[2:]}")
        for gap in results[-1]["not_exercised"]:
            echo(f"  {gap['line']}")
        if "host" in results[-1]:
            echo(f"  {host.line(results[-1]['host'])}")
        shaky = not results[-1].get("host", {"reliable": True})["reliable"]
        for row in (results[-1].get("comparison") or {}).get("predicted_vs_measured", []):
            if row["quantity"] in ("step time", "step time (calibrated)", "peak memory") and row["predicted"]:
                unit = (1e3, "ms") if row["unit"] == "s" else (2.0 ** -20, "MiB")
                echo(f"  {row['quantity']}: predicted {row['predicted'] * unit[0]:.1f} {unit[1]}, measured "
                     f"{row['measured'] * unit[0]:.1f} {unit[1]} ({row['error']:+.0%})"
                     + (" (unreliable: see host)" if shaky and row["unit"] == "s" else ""))
        if (results[-1].get("comparison") or {}).get("calibration_line"):
            echo(f"  {results[-1]['comparison']['calibration_line']}")
    ok = all(r["ok"] for r in results)
    if opt.node_rank > 0:
        return (0 if ok else 1), results
    write_summary(out, config, opt, results)
    write_json_atomic(out / MARKER, {"schema": "meshplan.validate.evidence/v1", "ok": ok, "config": config.path,
                                     "options": opt.__dict__, "not_exercised": everywhere(results), "worlds": results})
    return (0 if ok else 1), results


def main(config_path: str, opt: Options, out: Path, force: bool = False) -> tuple[int, list[dict]]:
    """``meshplan validate``: :func:`validate` of the config, then where the evidence is;
    returns (exit code, per-world results)."""
    config = load_config(config_path)  # a --micro-batches the schedule refuses: with validate's refusals
    code, results = validate(config, opt, out, force)
    if opt.node_rank > 0:
        print(f"node {opt.node_rank}: done; node 0 writes the evidence to {out / 'summary.md'}",
              file=sys.stderr if code else sys.stdout)
        return code, results
    print(f"evidence: {out / 'summary.md'}", file=sys.stderr if code else sys.stdout)
    return code, results
