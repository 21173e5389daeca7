"""``meshplan validate``: run a planned mesh for real with torchrun and compare it with the plan.

For each world size W (staged: 2, then 4, then 8 ...):

1. **Scale.** The config's mesh is re-sized to W by its outermost data axis
   (dp_replicate, dp or dp_shard, the outermost one of degree > 1): every other axis keeps
   its degree, ``data = W / (product of the others)`` (printed). The model is scaled down by
   stated factors (:func:`~meshplan.runtime.execution.model.scale_model`: layers, hidden / N, vocab);
   the batch is ``micro_batches`` micro-batches of ``micro_batch`` x ``seq_len`` per
   data-parallel rank (``global_batch = micro_batch x dp x micro_batches``), by default the
   fewest the pipeline schedule runs (:func:`micro_batches_for`: 1 at pp 1, pp for 1F1B);
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
   ``node_rank`` and the same ``rdzv_endpoint`` (node 0's HOST:PORT, c10d rendezvous hosted
   by node 0), ``W / nnodes`` ranks per host; ``OUT`` must be a folder all hosts share (the
   workers write ``rank<r>/`` there); node 0 clears it, compares and writes the evidence,
   the others keep their inputs in a local temporary folder and leave
   ``world<W>/torchrun-node<k>.log``.
5. **Compare** (:mod:`meshplan.runtime.validation.evidence`): collectives of every rank against the
   plan's table (count, group, bytes, dtype), step and phase times against
   :func:`meshplan.schedule.steptime.step_time`, peak memory against the memory timeline, and
   the bytes each rank wrote in a DCP save after the steps against
   :func:`meshplan.reliability.dcp_write_bytes` (save and load times at ``--checkpoint-gbps``).
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
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from math import gcd, prod
from pathlib import Path
from typing import Optional

from meshplan.config import Config, load_config
from meshplan.errors import ConfigError
from meshplan.limits import BOUNDS
from meshplan.fileio import check_destination, owned, staged_folder
from meshplan.mesh.resolve import Infeasible, resolve_mesh, world_error
from meshplan.plan import Infeasible as NoPlan
from meshplan.plan import build_plan
from meshplan.plan_runtime import run_reasons
from meshplan.pipeline.registry import fewest_micro_batches
from meshplan.pipeline.registry import get as get_schedule
from meshplan.placement.launch import parse_endpoint
from meshplan.report.json_out import write_json
from meshplan.runtime.execution.launch import Rendezvous, diagnose, run_torchrun
from meshplan.runtime.testbed.cpu import cpu_cluster
from meshplan.runtime.testbed.nics import nic_rows
from meshplan.runtime.testbed.run import run_on_testbed, testbed_cluster
from meshplan.runtime.validation import host
from meshplan.runtime.validation.kerneltimes import measure_attention, measure_gemms
from meshplan.runtime.validation.probe import curve_spec, probe_spec
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.training import TrainingSpec

DATA_AXES = ("dp_replicate", "dp", "dp_shard")
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", grad_dtype="fp32", optimizer_dtype="fp32", reduce_dtype="fp32")
MARKER = "validate.json"
_ADDR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:-]{0,252}$")


@dataclass(frozen=True)
class Options:
    """Scale-down factors and run limits of one ``validate`` call."""

    worlds: tuple[int, ...] = (2, 4)
    layers: int = 2
    hidden_div: Optional[int] = None  # None: smallest power of two giving hidden <= 256
    seq_len: int = 64
    vocab: int = 512
    micro_batches: Optional[int] = None  # None: the fewest the schedule runs (micro_batches_for)
    steps: int = 3
    timeout_s: float = 120.0
    pg_timeout_s: Optional[float] = None  # None: timeout_s / 2
    fail_rank: int = -1
    hang_rank: int = -1
    fault_step: int = 1
    tolerance: Optional[float] = None  # relative error allowed on step time and peak memory
    testbed: Optional[str] = None  # prefix of a netns testbed to run across (meshplan.runtime.testbed.run)
    probe: bool = True  # time the plan's collectives in the launch, after the steps (meshplan.runtime.validation.probe)
    curves: bool = True  # with probe: each axis's message curve (staged evidence); off in validate-slice, whose NIC counters are the step's traffic
    nnodes: int = 1  # hosts of a multi-host run (each runs validate with its node_rank; see check_hosts)
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None  # host:port of node 0 (c10d rendezvous)
    local_addr: Optional[str] = None  # this host's address for the workers' store (torchrun --local-addr)
    checkpoint_bytes_per_s: Optional[float] = None  # one rank's storage bandwidth: predicts DCP save/load times

    @property
    def rendezvous(self) -> Optional[Rendezvous]:
        """The multi-host rendezvous (None on one host)."""
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            return None
        return Rendezvous(self.nnodes, self.node_rank, self.rdzv_endpoint or "", self.local_addr)


def check_hosts(opt: Options) -> None:
    """ConfigError for an inconsistent multi-host request: ``--nnodes`` >= 1, ``--node-rank``
    in 0..nnodes-1, ``--rdzv-endpoint`` HOST:PORT required with more than one node, no
    ``--testbed`` with it, and every world a multiple of the node count (``W / nnodes``
    processes per host)."""
    if opt.nnodes < 1:
        raise ConfigError("--nnodes", f"{opt.nnodes} must be at least 1")
    if not 0 <= opt.node_rank < opt.nnodes:
        raise ConfigError("--node-rank", f"{opt.node_rank} outside 0..{opt.nnodes - 1} (--nnodes {opt.nnodes})")
    if opt.rendezvous is None:
        return
    if opt.rdzv_endpoint is None:
        raise ConfigError("--rdzv-endpoint", "required with --nnodes > 1: HOST:PORT of node 0, the same on every host")
    parse_endpoint(opt.rdzv_endpoint)
    if opt.local_addr is not None and not _ADDR.match(opt.local_addr):
        raise ConfigError("--local-addr", f"{opt.local_addr!r} is not a host name or address")
    if opt.testbed:
        raise ConfigError("--testbed", "runs every node itself; give either --testbed or --nnodes/--rdzv-endpoint")
    for w in opt.worlds:
        if w % opt.nnodes:
            raise ConfigError("--worlds", f"world {w} is not a multiple of --nnodes {opt.nnodes} (W / nnodes "
                              "processes per host)")


def scale_mesh(spec: MeshSpec, base_world: int, world: int) -> tuple[MeshSpec, str]:
    """``spec`` re-sized to ``world`` ranks through its outermost data axis (see the module
    docstring); returns the new spec and the derivation line.

    >>> s, why = scale_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), 64, 16)
    >>> s.shape, why
    ([2, 8], 'dp_shard = 16 / (tp 8) = 2 (config: dp_shard 8)')
    """
    mesh = resolve_mesh(spec, base_world)
    bad = world_error(spec, base_world) if isinstance(mesh, Infeasible) else None
    if bad is not None:  # degrees that cannot make the world: the one line that names the fix
        raise bad
    if isinstance(mesh, Infeasible):
        raise ConfigError("mesh", "the config's mesh does not resolve: " + "; ".join(mesh.reasons))
    names, shape = list(mesh.layout.names), list(mesh.layout.shape)
    data = [i for i, n in enumerate(names) if n in DATA_AXES]
    if not data:
        raise ConfigError("mesh", f"axes {names} have no data axis ({', '.join(DATA_AXES)}) to scale to other worlds")
    i = next((j for j in data if shape[j] > 1), data[0])
    rest = [f"{n} {d}" for j, (n, d) in enumerate(zip(names, shape)) if j != i and d > 1] or ["1"]
    others = prod(d for j, d in enumerate(shape) if j != i)
    if world % others:
        raise ConfigError("--worlds", f"world {world} is not a multiple of {' * '.join(rest)} = {others}; the "
                          f"data axis {names[i]} absorbs the world size, the other axes keep their degrees")
    why = f"{names[i]} = {world} / ({' * '.join(rest)}) = {world // others} (config: {names[i]} {shape[i]})"
    shape[i] = world // others
    if mesh.ep * mesh.etp > 1:
        names, shape = names + ["ep", "etp"], shape + [mesh.ep, mesh.etp]
    upd = spec.model_dump(exclude={"names", "shape", "order", "degrees", "world", "rank_to_gpu"})
    return MeshSpec(names=names, shape=shape, world=world, **upd), why


def auto_hidden_div(hidden: int, head_dim: int, ffn: int, target: int = 256) -> int:
    """Smallest power of two that divides hidden, head_dim (leaving it even) and ffn and
    brings hidden to ``target`` or below.

    >>> auto_hidden_div(8192, 128, 28672)
    32
    """
    d = 1
    while hidden // d > target:
        nd = d * 2
        if hidden % nd or head_dim % nd or (head_dim // nd) % 2 or ffn % nd:
            break
        d = nd
    return d


def scale_config(config: Config, world: int, opt: Options) -> tuple[Config, list[str]]:
    """The config of one stage: scaled model, mesh, batch, fp32, CPU testbed (see module doc)."""
    from meshplan.runtime.execution.model import MLA_SCALED, scale_model

    m = config.model
    # MLA: every latent rank and head dim is divided with hidden, so the divisor must divide their gcd
    head = gcd(*(getattr(m, k) for k in MLA_SCALED if getattr(m, k))) if m.is_mla else m.d_head
    div = opt.hidden_div or auto_hidden_div(m.hidden, head, m.ffn)
    scaled = scale_model(m, layers=opt.layers, hidden_div=div, vocab=opt.vocab)
    spec = _spec(config)
    mesh_spec, mesh_why = scale_mesh(spec, spec.world or config.cluster.world, world)
    mesh = resolve_mesh(mesh_spec, world)
    if isinstance(mesh, Infeasible):
        raise ConfigError("mesh", "; ".join(mesh.reasons))
    t = config.training
    recompute = "none" if t.recompute == "selective" else t.recompute
    mb, micro = min(t.micro_batch, 2), opt.micro_batches or micro_batches_for(mesh_spec, mesh, t)
    training = TrainingSpec(**{**t.model_dump(), **FP32, "seq_len": opt.seq_len, "micro_batch": mb,
                               "global_batch": mb * mesh.dp * micro, "recompute": recompute})
    if opt.testbed:
        cluster, hw_why = testbed_cluster(opt.testbed, world)
    else:
        cluster, hw_why = cpu_cluster(world)
    from meshplan.runtime.validation.memcheck import TORCH_CPU_MEMORY

    memory = config.memory.model_copy(update={**TORCH_CPU_MEMORY, "optimizer_temp_states": 0})
    notes = [scaled.note + (f" (hidden_div {div} chosen automatically)" if not opt.hidden_div else ""),
             "mesh: " + mesh_why,
             f"batch: micro_batch {t.micro_batch} -> {mb}, seq_len {t.seq_len} -> {opt.seq_len}, global_batch "
             f"{t.global_batch} -> {training.global_batch} = micro_batch {mb} x dp {mesh.dp} x {micro} "
             "micro-batch(es)" + ("" if opt.micro_batches else _fewest_why(mesh_spec, mesh, t)),
             f"dtypes: all fp32 (config: params {t.param_dtype}, compute {t.compute_dtype}, reduce {t.reduce_dtype})",
             hw_why, "memory timeline: NCCL buffers and cuBLAS workspace 0 (gloo, CPU); optimizer temporaries 0 "
             "(the worker's AdamW is torch's CPU default, one parameter at a time, not foreach); the runtime model's "
             "torch variants (memcheck.TORCH_CPU_MEMORY: fp32 logits, torch cross entropy, no dropout, SP inputs "
             "all-gathered and kept, rms_norm decomposed, K/V repeated before SDPA, embedding gradient over the "
             "whole vocabulary)"]
    if recompute != t.recompute:
        notes.append("recompute 'selective' runs as none (the runtime model has no selective recompute)")
    if t.sharding == "none":  # the recorded first step: one bucket of every gradient (table: one row)
        memory = memory.model_copy(update={"grad_bucket_elements": BOUNDS["bytes"].value})
        notes.append("DDP (sharding none): the recorded first step all-reduces every gradient as one bucket "
                     "(torch 2.13, find_unused_parameters=False), so the plan is made with [memory] "
                     "grad_bucket_elements covering the model; later steps send the rebuilt 1 MiB / 25 MiB "
                     "buckets the table shows by default")
    cfg = Config(model=scaled.spec, cluster=cluster, training=training, mesh=mesh_spec, path=config.path,
                 memory=memory)
    return cfg, notes


def micro_batches_for(spec: MeshSpec, mesh, training: TrainingSpec) -> int:
    """The fewest micro-batches per step the scaled ``mesh`` runs (``--micro-batches``'s
    default): :func:`meshplan.pipeline.registry.fewest_micro_batches` of ``spec``'s schedule at
    its pp (torch's rules) times ``training.pp_schedule_runs``; 1 at pp 1."""
    pp = mesh.degree("pp")
    if pp == 1:
        return 1
    return fewest_micro_batches(spec.pp_schedule, pp, spec.virtual_stages) * training.pp_schedule_runs


def _fewest_why(spec: MeshSpec, mesh, training: TrainingSpec) -> str:
    """The clause of the batch note saying why this many micro-batches (none at pp 1)."""
    if mesh.degree("pp") == 1:
        return ""
    runs = training.pp_schedule_runs
    per = f" x pp_schedule_runs {runs}" if runs > 1 else ""
    return (f" (the fewest pp_schedule {get_schedule(spec.pp_schedule).name} runs at pp {mesh.degree('pp')}{per}; "
            "--micro-batches N sets them)")


def micro_batch_refusal(config: Config, world: int, opt: Options) -> Optional[str]:
    """Why the pipeline schedule refuses ``opt.micro_batches`` at ``world`` (None when it runs
    them or they are the default): :func:`meshplan.plan_runtime.run_reasons` of the scaled config, with
    the fix (the fewest it runs)."""
    if opt.micro_batches is None:
        return None
    cfg, _ = scale_config(config, world, opt)
    mesh, spec = resolve_mesh(_spec(cfg), world), _spec(cfg)
    if isinstance(mesh, Infeasible) or mesh.degree("pp") == 1:
        return None
    t = cfg.training
    why = run_reasons(spec.pp_schedule, mesh.degree("pp"), opt.micro_batches, spec.virtual_stages,
                      t.pp_schedule_runs)
    if not why:
        return None
    return (f"{opt.micro_batches} at world {world}: {'; '.join(why)}; give --micro-batches "
            f"{micro_batches_for(spec, mesh, t)} (the fewest it runs), or leave it out")


def prepare_out(out: Path, force: bool) -> None:
    """Refuse, before the run, a non-empty ``out`` unless ``force`` and it is an evidence
    folder of ours, and an ``out`` that cannot be written. The folder itself is built by
    :func:`meshplan.fileio.staged_folder` (under a temporary name, renamed at the end)."""
    if out.is_dir() and any(out.iterdir()) and not owned(out):  # a rerun replaces its own, unchanged (out/)
        if not force:
            raise ConfigError("--out", f"{out} exists and is not empty; choose another folder or pass --force")
        if not (out / MARKER).exists() and not any(out.glob("world*/plan.json")):
            raise ConfigError("--out", f"{out} is not a meshplan validate folder (no {MARKER}); --force only "
                              "replaces those")
    check_destination(out, "--out", force, folder=True)


def _spec(config: Config) -> MeshSpec:
    """``config``'s [mesh] table; ConfigError when it has none."""
    if config.mesh is None:
        raise ConfigError("mesh", "missing table [mesh]; validate runs one mesh")
    return config.mesh


def not_runnable(cfg: Config, mesh) -> Optional[str]:
    """Why the runtime cannot build the scaled ``cfg``'s resolved ``mesh`` (None when it can):
    :func:`meshplan.runtime.execution.parallelize.unsupported_mesh`, and for pp > 1
    :func:`meshplan.runtime.execution.pipelined.unsupported`."""
    from meshplan.runtime.execution.parallelize import unsupported_mesh

    if cfg.training.framework != "torch":
        return (f"training.framework is '{cfg.training.framework}': validate runs torch.distributed, which "
                "issues torch's collectives; set framework = \"torch\" to validate this mesh")
    if cfg.training.zero3_engine != "fsdp2":
        return (f"training.zero3_engine is '{cfg.training.zero3_engine}': validate shards parameters with torch's "
                "FSDP2; set zero3_engine = \"fsdp2\" to validate this mesh")
    if cfg.training.zero12_engine != "megatron":
        return (f"training.zero12_engine is '{cfg.training.zero12_engine}': validate runs torch.distributed, not "
                "DeepSpeed's ZeRO-1/2 engine; remove the key to validate this mesh")
    why = unsupported_mesh(mesh, cfg.training, pipeline=True, moe=cfg.model.is_moe)
    if not why and mesh.degree("pp") > 1:
        from meshplan.runtime.execution.pipelined import unsupported

        why = unsupported(mesh, cfg.training, _spec(cfg).pp_schedule, cfg.model)
    return why


def run_world(config: Config, world: int, opt: Options, out: Path, echo=print) -> dict:
    """Scale, plan, run and compare one world size; returns its result dict."""
    folder = out / f"world{world}"
    if opt.node_rank > 0:  # node 0 owns (and may still be clearing) the shared OUT: nothing of ours in it yet
        with tempfile.TemporaryDirectory(prefix=f"meshplan-node{opt.node_rank}-w{world}-") as tmp:
            return _run_world(config, world, opt, folder, Path(tmp), echo)
    folder.mkdir(parents=True, exist_ok=True)
    return _run_world(config, world, opt, folder, folder, echo)


def _run_world(config: Config, world: int, opt: Options, folder: Path, work: Path, echo) -> dict:
    """:func:`run_world` with this host's plan, GEMM table, probe spec and torchrun log in
    ``work`` (``folder`` on node 0, a local folder on the others: node 0 may still be
    clearing ``OUT``); the workers write their ``rank<r>/`` into ``folder``."""
    from meshplan.runtime.execution.worker import write_json as write_json_atomic
    from meshplan.runtime.validation.evidence import compare_world, write_world_evidence

    cfg, notes = scale_config(config, world, opt)
    if opt.rendezvous is not None:
        notes.append(f"hosts: {opt.nnodes} x {world // opt.nnodes} ranks (this is node {opt.node_rank}; c10d at "
                     f"{opt.rdzv_endpoint}); the prediction still models one host of {world} ranks")
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
    pg_timeout = opt.pg_timeout_s or max(5.0, opt.timeout_s / 2)
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
    echo(f"  torchrun: {world} ranks{here}, limit {opt.timeout_s:g} s (process-group timeout {pg_timeout:g} s)")
    before = host.state()
    nic_bytes = None
    if opt.testbed:
        outcome, nic_bytes = run_on_testbed(opt.testbed, world, argv, folder, opt.timeout_s,
                                            env={"PYTHONPATH": _pythonpath()})
    else:
        outcome = run_torchrun(world, argv, work / "torchrun.log", opt.timeout_s,
                               env={"PYTHONPATH": _pythonpath()}, rdzv=opt.rendezvous)
    if work != folder:  # another host: its log beside node 0's evidence; node 0 compares
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "torchrun.log", folder / f"torchrun-node{opt.node_rank}.log")
        return {"world": world, "notes": notes, "ok": outcome.ok, "stage": "run", "returncode": outcome.returncode,
                "timed_out": outcome.timed_out, "message": f"node {opt.node_rank}: torchrun exited "
                f"{'at the time limit' if outcome.timed_out else outcome.returncode}; node 0 compares the run with "
                f"the plan in {folder}"}
    host_record = host.verdict(world, before, host.state())
    result = {"world": world, "notes": notes, "host": host_record,
              "elapsed_s": round(outcome.elapsed_s, 2),
              "returncode": outcome.returncode, "timed_out": outcome.timed_out, "leftover_pids": outcome.leftover_pids}
    if nic_bytes is not None:
        result["nic_bytes"] = nic_bytes
    done = all((folder / f"rank{r}" / "status.json").exists() and
               json.loads((folder / f"rank{r}" / "status.json").read_text()).get("state") == "done"
               for r in range(world))
    if not (outcome.ok and done):
        fault = diagnose(outcome, folder, opt.timeout_s, pg_timeout)
        missing = [r for r in range(world) if not (folder / f"rank{r}").exists()]
        if opt.rendezvous is not None and missing:
            fault["message"] += (f" No rank<r>/ folders for ranks {missing} in {folder}: --out must be a folder "
                                 "every host shares at the same path")
        result.update(ok=False, stage="run", message=fault["message"], fault=fault)
        write_json_atomic(folder / "comparison.json", result)
        return result
    comp = compare_world(plan, folder, table, opt.tolerance, opt.checkpoint_bytes_per_s)
    if opt.testbed:  # bytes per NIC over the steps against the plan (meshplan.runtime.testbed.nics)

        comp["predicted_vs_measured"] += nic_rows(plan, folder, nic_bytes)
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
        raise ConfigError("--worlds", f"{list(opt.worlds)}: give positive world sizes, e.g. 2,4,8")
    if opt.timeout_s <= 0:
        raise ConfigError("--timeout-s", "must be positive")
    check_hosts(opt)
    for w in opt.worlds:  # every stage must scale, and the runtime must build it, before anything runs
        cfg, _ = scale_config(config, w, opt)
        why = not_runnable(cfg, resolve_mesh(_spec(cfg), w))
        if why:
            raise ConfigError("mesh", f"world {w}: the runtime cannot build this mesh: {why}; validate a mesh "
                              "without it (the plan itself does not need the runtime)")
    if opt.node_rank == 0:
        prepare_out(out, force)
    if opt.rendezvous is not None:  # every host's ranks write into the shared OUT itself: no staging
        return _run_worlds(config, opt, out, echo)
    with staged_folder(out, "--out", force) as tmp:
        code, results = _run_worlds(config, opt, tmp, echo)
    return code, results


def _run_worlds(config: Config, opt: Options, out: Path, echo) -> tuple[int, list[dict]]:
    """The worlds of :func:`validate` into the evidence folder ``out`` (a temporary one
    renamed at the end on one host; across hosts the shared ``OUT``)."""
    from meshplan.runtime.execution.worker import write_json as write_json_atomic
    from meshplan.runtime.validation.evidence import write_summary

    results = []
    cores = len(os.sched_getaffinity(0))
    for w in opt.worlds:
        echo(f"world {w}:")
        if w > 4 * cores and not opt.testbed:
            echo(f"  note: {w} ranks on {cores} cores ({w / cores:g} per core): every rank time-shares a core; "
                 "start-up alone takes tens of seconds and step times are dominated by scheduling")
        results.append(run_world(config, w, opt, out, echo))
        echo(f"  {'OK' if results[-1]['ok'] else 'FAILED'}: {results[-1]['message']}")
        if "host" in results[-1]:
            echo(f"  {host.line(results[-1]['host'])}")
        shaky = not results[-1].get("host", {"reliable": True})["reliable"]
        for row in (results[-1].get("comparison") or {}).get("predicted_vs_measured", []):
            if row["quantity"] in ("step time", "step time (calibrated)", "peak memory") and row["predicted"]:
                unit = (1e3, "ms") if row["unit"] == "s" else (2.0 ** -20, "MiB")
                echo(f"  {row['quantity']}: predicted {row['predicted'] * unit[0]:.1f} {unit[1]}, measured "
                     f"{row['measured'] * unit[0]:.1f} {unit[1]} ({row['error']:+.0%})"
                     + (" (unreliable: see host)" if shaky and row["unit"] == "s" else ""))
    ok = all(r["ok"] for r in results)
    if opt.node_rank > 0:
        return (0 if ok else 1), results
    write_summary(out, config, opt, results)
    write_json_atomic(out / MARKER, {"schema": "meshplan.validate.evidence/v1", "ok": ok, "config": config.path,
                                     "options": opt.__dict__, "worlds": results})
    return (0 if ok else 1), results


def main(config_path: str, opt: Options, out: Path, force: bool = False) -> tuple[int, list[dict]]:
    """``meshplan validate``: :func:`validate` of the config, then where the evidence is;
    returns (exit code, per-world results)."""
    config = load_config(config_path)
    for w in opt.worlds:  # a --micro-batches the schedule refuses: one line before anything runs
        refused = micro_batch_refusal(config, w, opt)
        if refused:
            raise ConfigError("--micro-batches", refused)
    code, results = validate(config, opt, out, force)
    if opt.node_rank > 0:
        print(f"node {opt.node_rank}: done; node 0 writes the evidence to {out / 'summary.md'}",
              file=sys.stderr if code else sys.stdout)
        return code, results
    print(f"evidence: {out / 'summary.md'}", file=sys.stderr if code else sys.stdout)
    return code, results
