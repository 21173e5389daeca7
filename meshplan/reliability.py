"""Reliability of a mesh: failure domains, interruptions, checkpoint size and write time,
the optimal checkpoint interval, expected goodput and restart cost (which mesh a restart on
fewer nodes runs: :mod:`meshplan.restart`).

Sources and conventions:

- **Failure rate.** Default per-GPU rate from the Llama 3 paper (Grattafiori et al. 2024,
  arXiv 2407.21783, section 3.3.4): 419 unexpected interruptions in a 54-day snapshot on
  up to 16,384 H100 GPUs, i.e. ``419 / (54 * 16384) = 4.74e-4`` per GPU-day. Each
  interruption stops the whole synchronous job, so the job's rate is ``rate * gpus``
  (independent failures) and its MTBF ``1 / (rate * gpus)``. The denominator assumes all
  16,384 GPUs for all 54 days (fewer would mean a higher per-GPU rate); the count includes
  every unexpected cause (GPU, HBM, network, host, software), as a job experiences them.
- **Checkpoint.** Persistent state without gradients: parameters, fp32 master copy and
  optimizer moments (:mod:`meshplan.memory.state`), plus data-loader and RNG state (small,
  not counted). Per rank: the most loaded rank. In total: every distinct shard once (a
  replicated copy is written by one rank, as DCP deduplicates): ``tp x shards`` pieces of
  the dense state of each stage, ``ep x etp x shards`` of the expert state (norms, held
  whole by every tp rank, are counted tp times: small). KV heads replicated past
  ``kv_heads`` (tp > kv_heads, handed case C6) are one head's state per rank but are counted
  once per KV head, ``kv_heads`` per stage, not ``tp`` (a checkpoint in the model's layout,
  as Megatron-LM and HF save it, holds each head once; the copies are equal, kept so by the
  ``kv_replica`` all-reduce). Write time at a stated storage
  bandwidth: ``max(total / aggregate bandwidth, per rank / per-rank bandwidth)``.
- **Interval.** Young (1974), "A first order approximation to the optimum checkpoint
  interval", CACM 17(9): ``tau = sqrt(2 C M)``; Daly (2006), "A higher order estimate of
  the optimum checkpoint interval for restart dumps", FGCS 22(3):
  ``tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for C < 2M, else M.
- **The job's interval** (torchtitan ``checkpoint.interval``, Megatron-LM ``--save-interval``,
  [reliability] ``checkpoint_interval_steps``): steps x the plan's predicted step time is its ``tau``, set
  beside Daly's with the goodput of each and the expected work lost per failure: the mean time
  since the last completed checkpoint when a failure strikes, an exponential time to failure
  (mean M) conditioned on falling within one segment ``T = tau + C``:
  ``M - T / (e^{T/M} - 1)`` (about ``T / 2`` when ``T << M``; Daly 2006's failure model).
- **Goodput** (Daly 2006's model with exponential failures, failures also during restart
  and checkpoint): wall time per unit of work ``M e^{R/M} (e^{(tau + C)/M} - 1) / tau``;
  goodput is its inverse. Restart cost ``R`` = a stated overhead (detection, rescheduling,
  process and NCCL start-up) + reading the checkpoint at the stated read bandwidth.

>>> round(DEFAULT_RATE_PER_GPU_DAY, 7), round(interruptions_per_day(16384), 2)
(0.0004736, 7.76)
>>> round(young_interval_s(60, 3600)), round(daly_interval_s(60, 3600))
(657, 618)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil, exp, expm1, sqrt
from typing import Optional

from meshplan.mesh.tpsplit import local_heads, local_numel
from meshplan.restart_text import checkpoint_engine
from meshplan.spec.cluster import ClusterSpec

#: Llama 3 (arXiv 2407.21783, section 3.3.4): unexpected interruptions, days, GPUs.
LLAMA3_UNEXPECTED, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
DEFAULT_RATE_PER_GPU_DAY = LLAMA3_UNEXPECTED / (LLAMA3_DAYS * LLAMA3_GPUS)
DAY_S = 86400.0
CHECKPOINT_KINDS = ("params", "master", "optimizer")


def interruptions_per_day(gpus: int, rate_per_gpu_day: float = DEFAULT_RATE_PER_GPU_DAY) -> float:
    """Expected job interruptions per day on ``gpus`` GPUs: ``rate * gpus``."""
    return rate_per_gpu_day * gpus


def mtbf_s(gpus: int, rate_per_gpu_day: float = DEFAULT_RATE_PER_GPU_DAY) -> float:
    """Mean time between job interruptions, seconds: ``86400 / (rate * gpus)``.

    >>> round(mtbf_s(16384) / 3600, 2)
    3.09
    """
    return DAY_S / interruptions_per_day(gpus, rate_per_gpu_day)


@dataclass(frozen=True)
class FailureDomain:
    """``count`` domains of ``gpus_each`` GPUs; one failure stops the whole job."""

    name: str
    count: int
    gpus_each: int
    note: str = ""


def failure_domains(cluster: ClusterSpec, world: int) -> list[FailureDomain]:
    """GPU, node and each network tier with a domain size (``nodes_per_domain``: a leaf or
    rack switch) holding the job's ``world`` ranks (node-major placement). ``gpus_each``
    counts the job's GPUs in the fullest domain, not the switch's capacity: 32 GPUs under a
    leaf of 32 nodes x 8 GPUs are one leaf of 32 GPUs, not of 256.

    >>> from meshplan import catalog
    >>> [(d.name, d.count, d.gpus_each) for d in failure_domains(catalog.system("dgx-h100", 8), 64)][:2]
    [('gpu', 64, 1), ('node', 8, 8)]
    >>> [(d.name, d.count, d.gpus_each) for d in failure_domains(catalog.system("dgx-h100", 1), 4)]
    [('gpu', 4, 1), ('node', 1, 4), ('leaf', 1, 4)]
    """
    g = cluster.node.gpus
    nodes = ceil(world / g)
    out = [FailureDomain("gpu", world, 1, "GPU, HBM or its NVLink port"),
           FailureDomain("node", nodes, min(g, world), "host, PCIe, NIC, NVSwitch or power of one server")]
    for tier in cluster.network:
        if tier.nodes_per_domain:
            out.append(FailureDomain(tier.name, ceil(nodes / tier.nodes_per_domain),
                                     min(tier.nodes_per_domain * g, world),
                                     f"switch of tier {tier.name} ({tier.nodes_per_domain} nodes)"))
    return out


@dataclass(frozen=True)
class CheckpointSize:
    """``per_rank_bytes``: what the most loaded rank holds (and reads back on load);
    ``total_bytes``: distinct shards once; ``written_per_rank_bytes``: what the busiest rank
    writes (0: unknown, ``per_rank_bytes`` is used) under ``writer``: "dcp" (:func:`dcp_write_bytes`) or
    "deepspeed" (:func:`deepspeed_write_bytes`)."""

    per_rank_bytes: float
    total_bytes: float
    written_per_rank_bytes: float = 0.0
    writer: str = "dcp"


def checkpoint_size(states, mesh, model=None) -> CheckpointSize:
    """Checkpoint bytes from :func:`meshplan.memory.state.state_bytes` (one StateBytes per
    stage) of ``mesh``: kinds params, master and optimizer (module docstring). ``model``
    (the :class:`~meshplan.spec.model.ModelSpec`): count replicated KV heads once
    (:func:`kv_copy_numel`), as meshplan's runtime saves them
    (:func:`meshplan.runtime.execution.kvsync.dedup_kv_state`); without it every tp rank's
    copy counts."""
    tp, ep, etp = mesh.degree("tp"), mesh.degree("ep"), mesh.degree("etp")
    per_rank = 0.0
    for st in states:
        per_rank = max(per_rank, sum(i.size_bytes for i in st.items if i.kind in CHECKPOINT_KINDS))
    totals = _stage_totals(states, mesh, model)
    ranks = mesh.world / mesh.degree("pp")
    return CheckpointSize(per_rank, sum(totals), max(t / ranks for t in totals))


def kv_copy_numel(st, model, mesh) -> int:
    """Elements of stage ``st``'s dense state (per kind, before data-parallel sharding) that
    the tp ranks of one group hold as copies of replicated KV heads: with ``r = tp / kv_heads
    > 1`` each rank holds one KV head's wk, wv (and biases), ``k`` elements per layer, so the
    group holds ``tp k`` of which ``kv_heads k`` are distinct: ``(tp - kv_heads) k`` per layer.

    128 q / 8 KV heads of 128, h 16384, tp 16 (C6): k = 2 x 128 x 16384 = 4,194,304; 8 copies
    of it per layer:

    >>> from types import SimpleNamespace as N
    >>> from meshplan.spec.model import ModelSpec
    >>> m = ModelSpec(layers=1, hidden=16384, ffn=1, q_heads=128, kv_heads=8, head_dim=128, vocab=1)
    >>> kv_copy_numel(N(params=N(layer_ids=(0,))), m, N(degree=lambda a: 16))
    33554432
    """
    tp = mesh.degree("tp")
    if local_heads(model, tp)[2] == 1:
        return 0
    per_layer = sum(local_numel(t, model, tp) for t in model.layer_tensors(0) if t.split == "kv_column")
    return (tp - model.n_kv_heads) * per_layer * len(st.params.layer_ids)


def _stage_totals(states, mesh, model=None) -> list[float]:
    """Checkpoint bytes of each stage, every distinct shard once (:func:`_distinct`), less
    the replicated KV heads' copies when ``model`` is given (:func:`kv_copy_numel`)."""
    tp, ep, etp = mesh.degree("tp"), mesh.degree("ep"), mesh.degree("etp")
    out = []
    for st in states:
        items = [i for i in st.items if i.kind in CHECKPOINT_KINDS]
        copies = kv_copy_numel(st, model, mesh) if model is not None else 0
        out.append(sum(i.size_bytes * _distinct(i, tp, ep, etp) for i in items)
                   - sum(copies * i.bytes_per_element for i in items if copies and i.group == "dense"))
    return out


def _distinct(item, tp: int, ep: int, etp: int) -> int:
    """Distinct shards of one state item on a stage: its model split (tp, or ep x etp for
    experts) times its data-parallel shard degree."""
    return (ep * etp if item.group == "expert" else tp) * item.divisor


def dcp_write_bytes(states, mesh, model=None) -> list[float]:
    """Bytes one rank of each stage writes under DCP (torch.distributed.checkpoint): the
    default save planner deduplicates replicated shards (``dedup_save_plans``), writing each
    once, from the replica whose plan is smallest so far, so the ``r`` ranks holding the same
    shard split its bytes. A stage's ``world / pp`` ranks hold ``split x divisor`` distinct
    shards of an item (:func:`_distinct`), each held by ``r = (world / pp) / (split x divisor)``
    ranks (dp_replicate under HSDP, dp under DDP, 1 under FSDP): a rank writes
    ``sum(size / r)``, the balanced share (greedy: within one tensor of it).

    DDP over dp 4 (nothing sharded): each rank holds the whole model and writes a quarter:

    >>> from types import SimpleNamespace as N
    >>> mesh = N(world=4, degree=lambda a: {"tp": 1, "ep": 1, "etp": 1, "pp": 1}.get(a, 1))
    >>> item = N(kind="params", group="dense", size_bytes=1000, divisor=1)
    >>> dcp_write_bytes([N(items=[item])], mesh)
    [250.0]
    """
    ranks = mesh.world / mesh.degree("pp")
    return [t / ranks for t in _stage_totals(states, mesh, model)]


def deepspeed_write_bytes(states, sharding: str) -> float:
    """Bytes the busiest rank writes in DeepSpeed's ``save_checkpoint`` (deepspeedai/DeepSpeed
    deepspeed/runtime/engine.py@edaa722). Data-parallel rank 0 alone writes the module's
    state_dict (``_configure_checkpointing`` 1586-1589: ``is_data_parallel_writer(rank)``, which
    runtime/checkpoint_engine/checkpoint_engine.py 47-48 makes ``dp_rank == 0``; ``_save_checkpoint``
    5239-5266 saves ``module_state_dict()`` then), and every rank of the ZeRO group its own
    ``zero_pp_rank_{dp_rank}`` optimizer file (1591-1596, ``_save_zero_checkpoint`` 5409-5424:
    ``optimizer.state_dict()``, its fp32 partition and moments: runtime/zero/stage_1_and_2.py
    2620-2624, stage3.py 3177-3178). Under ZeRO-0/1/2 the module
    holds the whole parameters (in the model dtype), so rank 0 writes them and its partition:
    everything it holds (parameters, master copy, optimizer state). Under ZeRO-3 every rank
    writes a model-states file (``is_first_weights_partition_group``, 1291-1296, true without
    MiCS) whose parameters are the partitioned placeholders (empty), and its optimizer
    partition: its master copy and optimizer state. Per stage the busiest rank; ``sharding``:
    ``training.sharding``.

    Llama 3 8B (8.03e9 parameters), ZeRO-2 at dp 16 in bf16: 16.06 GB module + 12 B x 8.03e9 / 16
    = 6.02 GB partition = 22.08 GB on rank 0:

    >>> from types import SimpleNamespace as N
    >>> items = [N(kind="params", size_bytes=16.06e9), N(kind="master", size_bytes=2.007e9),
    ...          N(kind="optimizer", size_bytes=4.015e9), N(kind="grads", size_bytes=1.0e9)]
    >>> round(deepspeed_write_bytes([N(items=items)], "zero2") / 1e9, 3), deepspeed_write_bytes([N(items=items)], "zero3")
    (22.082, 6022000000.0)
    """
    kinds = ("master", "optimizer") if sharding == "zero3" else CHECKPOINT_KINDS
    return max(sum(i.size_bytes for i in st.items if i.kind in kinds) for st in states)


def write_time_s(size: CheckpointSize, bandwidth_bytes_per_s: float,
                 per_rank_bandwidth_bytes_per_s: Optional[float] = None, read: bool = False) -> float:
    """Seconds to write (or, ``read``, read) the checkpoint: total bytes / aggregate storage
    bandwidth, or the busiest rank's bytes / its own bandwidth when that is slower; a rank
    writes its DCP share (``written_per_rank_bytes``) and reads back all it holds.

    >>> write_time_s(CheckpointSize(2e9, 1e12), 50e9, 1e9)
    20.0
    >>> size = CheckpointSize(2e9, 1e12, 5e8)  # holds 2 GB, writes its 0.5 GB DCP share
    >>> write_time_s(size, 2000e9, 1e9), write_time_s(size, 2000e9, 1e9, read=True)
    (0.5, 2.0)
    """
    t = size.total_bytes / bandwidth_bytes_per_s
    if per_rank_bandwidth_bytes_per_s:
        rank = size.per_rank_bytes if read or not size.written_per_rank_bytes else size.written_per_rank_bytes
        t = max(t, rank / per_rank_bandwidth_bytes_per_s)
    return t


def young_interval_s(checkpoint_s: float, mtbf: float) -> float:
    """Young (1974): ``sqrt(2 C M)``, seconds of work between checkpoints."""
    return sqrt(2.0 * checkpoint_s * mtbf)


def daly_interval_s(checkpoint_s: float, mtbf: float) -> float:
    """Daly (2006) higher-order optimum: ``sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` for
    ``C < 2M``, else ``M``."""
    c, m = checkpoint_s, mtbf
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return sqrt(2 * c * m) * (1 + sqrt(x) / 3 + x / 9) - c


def goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf: float) -> float:
    """Fraction of wall time spent on useful work (Daly 2006 exponential model):
    ``tau / (M e^{R/M} (e^{(tau + C)/M} - 1))``.

    >>> round(goodput(600, 60, 300, 36000), 4)
    0.8933
    """
    t, c, r, m = interval_s, checkpoint_s, restart_s, mtbf
    return t / (m * exp(r / m) * (exp((t + c) / m) - 1.0))


def lost_work_s(interval_s: float, checkpoint_s: float, mtbf: float) -> float:
    """Expected work lost per failure (s): the mean time since the last completed checkpoint
    at a failure, ``M - T / (e^{T/M} - 1)`` with ``T = tau + C`` (module docstring).

    >>> round(lost_work_s(600, 60, 36000), 1)  # about (600 + 60) / 2
    329.0
    """
    t = interval_s + checkpoint_s
    return mtbf - t / expm1(t / mtbf)  # expm1: e^x - 1 without cancellation when T << M


@dataclass(frozen=True)
class JobInterval:
    """The job's own checkpoint interval: ``steps`` between saves (``source``: the field that
    said so) at ``step_s`` seconds per step, the plan's predicted step."""

    steps: int
    step_s: float
    source: str

    @property
    def interval_s(self) -> float:
        return self.steps * self.step_s


@dataclass(frozen=True)
class Reliability:
    """The reliability account of one mesh (all seconds, bytes)."""

    gpus: int
    rate_per_gpu_day: float
    domains: tuple[FailureDomain, ...]
    checkpoint: CheckpointSize
    write_s: float
    read_s: float
    restart_overhead_s: float
    per_rank_bandwidth_bytes_per_s: Optional[float] = None
    sharding: str = ""
    job: Optional[JobInterval] = None

    @property
    def mtbf_s(self) -> float:
        return mtbf_s(self.gpus, self.rate_per_gpu_day)

    @property
    def restart_s(self) -> float:
        """Restart cost R: stated overhead + checkpoint read."""
        return self.restart_overhead_s + self.read_s

    @property
    def interval_s(self) -> float:
        return daly_interval_s(self.write_s, self.mtbf_s)

    @property
    def goodput(self) -> float:
        return goodput(self.interval_s, self.write_s, self.restart_s, self.mtbf_s)

    def job_line(self) -> str:
        """The job's interval in time beside Daly's, the work lost per failure and the goodput at
        each ("" when the config says no interval)."""
        if self.job is None:
            return ""
        j, c, m, r = self.job, self.write_s, self.mtbf_s, self.restart_s
        lost, best = (lost_work_s(t, c, m) / 60 for t in (j.interval_s, self.interval_s))
        return (f"job's interval: {j.steps} steps ({j.source}) x {j.step_s:.3f} s per step = "
                f"{j.interval_s / 60:.1f} min against Daly's {self.interval_s / 60:.1f} min; expected work lost per "
                f"failure {lost:.1f} min (at Daly's {best:.1f} min); goodput {goodput(j.interval_s, c, r, m):.2%} "
                f"(at Daly's {self.goodput:.2%})")

    def job_fields(self) -> Optional[dict]:
        """The job's interval for ``--json`` (seconds; None without one): its steps, step, interval,
        the work lost per failure and goodput at it and at Daly's interval."""
        if self.job is None:
            return None
        j, c, m = self.job, self.write_s, self.mtbf_s
        return {"steps": j.steps, "source": j.source, "step_s": j.step_s, "interval_s": j.interval_s,
                "lost_work_s": lost_work_s(j.interval_s, c, m), "goodput": goodput(j.interval_s, c, self.restart_s, m),
                "optimal_lost_work_s": lost_work_s(self.interval_s, c, m)}

    def dcp_line(self) -> str:
        """What the busiest rank writes under its checkpoint engine (DCP: its share on disk;
        DeepSpeed: :func:`deepspeed_write_bytes`) and reads back (all it holds: :func:`size_line`),
        each labelled, and, at the stated per-rank bandwidth, how long."""
        ck, bw = self.checkpoint, self.per_rank_bandwidth_bytes_per_s
        what = ({"zero3": "DeepSpeed ZeRO-3: the busiest rank writes {} GB, its zero_pp_rank partition (master copy "
                          "and optimizer state; its model-states file holds empty placeholders)"}.get(
            self.sharding, "DeepSpeed: the busiest rank (data-parallel rank 0) writes {} GB, the whole module "
                           "state_dict (model_states.pt) and its zero_pp_rank optimizer partition")
                if ck.writer == "deepspeed" else "DCP: the busiest rank writes {} GB, its share on disk (replicated "
                                                 "shards written once, split between the replicas that hold them)")
        out = what.format(f"{ck.written_per_rank_bytes / 1e9:.3f}") + (
            f", and reads back {ck.per_rank_bytes / 1e9:.3f} GB, all it holds")
        if bw:
            out += (f"; at {bw / 1e9:g} GB/s per rank: write {ck.written_per_rank_bytes / bw:.2f} s, read "
                    f"{ck.per_rank_bytes / bw:.2f} s")
        return out

    def size_line(self) -> str:
        """The checkpoint's bytes, each labelled: on disk in total (every distinct shard once),
        held by the most loaded rank (its parameters, master copy and optimizer state in memory,
        :data:`CHECKPOINT_KINDS`: what it reads back on load; :func:`dcp_line` says what it
        writes), and the write and read times."""
        ck = self.checkpoint
        return (f"checkpoint {ck.total_bytes / 1e9:.1f} GB on disk (every distinct shard once), "
                f"{ck.per_rank_bytes / 1e9:.2f} GB held by the most loaded rank (parameters, master copy and "
                f"optimizer state in its memory); write {self.write_s:.1f} s, read {self.read_s:.1f} s")

    def lines(self) -> list[str]:
        m, c = self.mtbf_s, self.write_s
        return [f"{self.gpus} GPUs x {self.rate_per_gpu_day:.3g} interruptions per GPU-day = "
                f"{interruptions_per_day(self.gpus, self.rate_per_gpu_day):.3g} per day; MTBF {m / 3600:.2f} h "
                f"(default rate: Llama 3, arXiv 2407.21783 3.3.4, 419 / (54 d x 16384))",
                "failure domains: " + "; ".join(f"{d.name} {d.count} x {d.gpus_each} GPU" for d in self.domains),
                self.size_line(),
                self.dcp_line(),
                f"interval: Young sqrt(2 C M) = {young_interval_s(c, m) / 60:.1f} min, Daly = {self.interval_s / 60:.1f} min",
                f"restart cost R = {self.restart_overhead_s:.0f} s overhead + {self.read_s:.1f} s read = {self.restart_s:.1f} s; "
                f"expected goodput {self.goodput:.1%} (Daly 2006 model)"] + ([self.job_line()] if self.job else [])


def reliability(plan, *, write_bandwidth_bytes_per_s: float, read_bandwidth_bytes_per_s: float,
                restart_overhead_s: float, rate_per_gpu_day: float = DEFAULT_RATE_PER_GPU_DAY,
                per_rank_bandwidth_bytes_per_s: Optional[float] = None,
                job: Optional[JobInterval] = None) -> Reliability:
    """Reliability account of a plan. Storage bandwidths and the restart overhead are
    stated by the caller: there is no default for them; ``job``: the job's own interval."""
    size = checkpoint_size(plan.state, plan.mesh, plan.config.model)
    t = plan.config.training
    if checkpoint_engine(t) == "deepspeed":  # DeepSpeed's save_checkpoint, not DCP's balanced shares
        size = replace(size, written_per_rank_bytes=deepspeed_write_bytes(plan.state, t.sharding), writer="deepspeed")
    return Reliability(plan.world, rate_per_gpu_day, tuple(failure_domains(plan.config.cluster, plan.world)), size,
                       write_time_s(size, write_bandwidth_bytes_per_s, per_rank_bandwidth_bytes_per_s),
                       write_time_s(size, read_bandwidth_bytes_per_s, per_rank_bandwidth_bytes_per_s, read=True),
                       restart_overhead_s, per_rank_bandwidth_bytes_per_s, t.sharding, job)
