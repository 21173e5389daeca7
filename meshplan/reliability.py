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
- **Checkpoint.** Its bytes per rank and in total, what each rank writes under DCP or
  DeepSpeed, and the write time: :mod:`meshplan.checkpoint_bytes`.
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

from meshplan.memory.offload_host import saved_states
from meshplan.checkpoint_bytes import CheckpointSize, checkpoint_size, deepspeed_write_bytes, write_time_s
from meshplan.restart_text import checkpoint_engine
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.search import LLAMA3_STORAGE_GB_PER_S

#: Llama 3 (arXiv 2407.21783, section 3.3.4): unexpected interruptions, days, GPUs.
LLAMA3_UNEXPECTED, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
DEFAULT_RATE_PER_GPU_DAY = LLAMA3_UNEXPECTED / (LLAMA3_DAYS * LLAMA3_GPUS)
DAY_S = 86400.0


def storage_default_note(cluster: ClusterSpec, flags: list[str]) -> str:
    """The note ``reliability`` prints where a checkpoint bandwidth is left at its default
    (:data:`meshplan.spec.search.LLAMA3_STORAGE_GB_PER_S`, 2 TB/s; ``flags``: the options that set
    those left out): that figure is the storage of Llama 3's 16,384-GPU cluster, not this cluster's,
    and meshplan cannot cap it by what this cluster's nodes can push (nodes x a node's storage or
    front-end NIC bandwidth): the catalog's nodes list their compute NICs alone, and a checkpoint is
    written through the storage network (DGX A100's storage NICs mlx5_4-5 are not compute NICs,
    catalog/nodes.toml). Newcomer trial 27 #E: 256 A100 were timed at the 16K-GPU cluster's 2 TB/s
    with no word.

    >>> from meshplan.catalog import system
    >>> print(storage_default_note(system("dgx-a100", nodes=32), ["--write-gbps", "--read-gbps"]))  # doctest: +NORMALIZE_WHITESPACE
    note: the 2000 GB/s checkpoint default is the storage of Llama 3's 16,384-GPU cluster (arXiv 2407.21783,
    3.3.1), not this cluster's 32 nodes; the catalog holds no storage or front-end NIC bandwidth for dgx-a100,
    so it is not capped at what 32 nodes can push: measure yours (fio or IOR from every node at once) and set
    --write-gbps, --read-gbps
    """
    nodes = f"{cluster.nodes} node{'s' * (cluster.nodes != 1)}"
    return (f"note: the {LLAMA3_STORAGE_GB_PER_S:g} GB/s checkpoint default is the storage of Llama 3's 16,384-GPU "
            f"cluster (arXiv 2407.21783, 3.3.1), not this cluster's {nodes}; the catalog holds no storage or front-end "
            f"NIC bandwidth for {cluster.node.name}, so it is not capped at what {nodes} can push: measure yours (fio "
            f"or IOR from every node at once) and set {', '.join(flags)}")


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
    """``count`` domains of ``gpus_each`` GPUs, the last of them holding ``gpus_last`` (fewer where
    the job's GPUs do not fill it: node-major ranks fill the domains in order); one failure stops
    the whole job."""

    name: str
    count: int
    gpus_each: int
    note: str = ""
    gpus_last: int = 0

    @property
    def text(self) -> str:
        """``leaf 1 x 32 GPU``; with a partial last domain the full ones and the last apart:
        ``leaf 1 x 160 GPU + 1 x 96 GPU (the last leaf partial)``.

        >>> FailureDomain("leaf", 2, 160, gpus_last=96).text
        'leaf 1 x 160 GPU + 1 x 96 GPU (the last leaf partial)'
        """
        if not self.gpus_last or self.gpus_last == self.gpus_each:
            return f"{self.name} {self.count} x {self.gpus_each} GPU"
        return (f"{self.name} {self.count - 1} x {self.gpus_each} GPU + 1 x {self.gpus_last} GPU "
                f"(the last {self.name} partial)")


def failure_domains(cluster: ClusterSpec, world: int) -> list[FailureDomain]:
    """GPU, node and each network tier with a domain size (``nodes_per_domain``: a leaf or
    rack switch) holding the job's ``world`` ranks (node-major placement). ``gpus_each``
    counts the job's GPUs in the fullest domain, not the switch's capacity: 32 GPUs under a
    leaf of 32 nodes x 8 GPUs are one leaf of 32 GPUs, not of 256; ``gpus_last`` those in the
    last one: 256 GPUs on 32 dgx-a100 under leaves of 20 nodes are leaves of 160 and 96 GPUs.

    >>> from meshplan import catalog
    >>> [(d.name, d.count, d.gpus_each) for d in failure_domains(catalog.system("dgx-h100", 8), 64)][:2]
    [('gpu', 64, 1), ('node', 8, 8)]
    >>> [(d.name, d.count, d.gpus_each) for d in failure_domains(catalog.system("dgx-h100", 1), 4)]
    [('gpu', 4, 1), ('node', 1, 4), ('leaf', 1, 4)]
    >>> [(d.name, d.count, d.gpus_each, d.gpus_last) for d in failure_domains(catalog.system("dgx-a100", 32), 256)][2]
    ('leaf', 2, 160, 96)
    """
    g = cluster.node.gpus
    out = [FailureDomain("gpu", world, 1, "GPU, HBM or its NVLink port", 1),
           _domain("node", g, world, "host, PCIe, NIC, NVSwitch or power of one server")]
    for tier in cluster.network:
        if tier.nodes_per_domain:
            out.append(_domain(tier.name, tier.nodes_per_domain * g, world,
                               f"switch of tier {tier.name} ({tier.nodes_per_domain} nodes)"))
    return out


def _domain(name: str, size: int, world: int, note: str) -> FailureDomain:
    """The domains of ``size`` GPUs that ``world`` node-major ranks fill in order: as many as
    they reach, each full but the last, which holds the remainder (``world - (count - 1) size``)."""
    count = ceil(world / size)
    return FailureDomain(name, count, min(size, world), note, world - (count - 1) * size)


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


#: The field that gave the job's checkpoint interval, by the config's origin (Config.origin).
INTERVAL_SOURCE = {"torchtitan": "checkpoint.interval", "megatron": "--save-interval",
                   "": "reliability.checkpoint_interval_steps"}


def job_interval(config, step_s: float) -> Optional[JobInterval]:
    """The job's own checkpoint interval (``config.checkpoint_interval_steps``, named by the field
    of its origin that gave it) at ``step_s`` per step; None where the config says none."""
    steps = config.checkpoint_interval_steps
    return JobInterval(steps, step_s, INTERVAL_SOURCE.get(config.origin, INTERVAL_SOURCE[""])) if steps else None


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
        :data:`meshplan.checkpoint_bytes.CHECKPOINT_KINDS`: what it reads back on load; :func:`dcp_line` says what it
        writes), and the write and read times."""
        ck = self.checkpoint
        return (f"checkpoint {ck.total_bytes / 1e9:.1f} GB on disk (every distinct shard once), "
                f"{ck.per_rank_bytes / 1e9:.2f} GB held by the most loaded rank (parameters, master copy and "
                f"optimizer state in its memory); write {self.write_s:.1f} s, read {self.read_s:.1f} s")

    def lines(self) -> list[str]:
        m, c = self.mtbf_s, self.write_s
        return [f"{self.gpus} GPUs x {self.rate_per_gpu_day:.3g} interruptions per GPU-day = "
                f"{interruptions_per_day(self.gpus, self.rate_per_gpu_day):.3g} per day; MTBF {m / 3600:.2f} h "
                + ("(default rate: Llama 3, arXiv 2407.21783 3.3.4, 419 / (54 d x 16384))"
                   if self.rate_per_gpu_day == DEFAULT_RATE_PER_GPU_DAY else "(rate given: --gpu-failure-rate)"),
                "failure domains: " + "; ".join(d.text for d in self.domains),
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
    t = plan.config.training
    saved = saved_states(plan.state, plan.config.model, plan.mesh, t, plan.stages)  # ZeRO-Offload's host state too
    size = checkpoint_size(saved, plan.mesh, plan.config.model, t.framework)
    if checkpoint_engine(t) == "deepspeed":  # DeepSpeed's save_checkpoint, not DCP's balanced shares
        size = replace(size, written_per_rank_bytes=deepspeed_write_bytes(saved, t.sharding), writer="deepspeed")
    return Reliability(plan.world, rate_per_gpu_day, tuple(failure_domains(plan.config.cluster, plan.world)), size,
                       write_time_s(size, write_bandwidth_bytes_per_s, per_rank_bandwidth_bytes_per_s),
                       write_time_s(size, read_bandwidth_bytes_per_s, per_rank_bandwidth_bytes_per_s, read=True),
                       restart_overhead_s, per_rank_bandwidth_bytes_per_s, t.sharding, job)


def configured_reliability(plan, job: Optional[JobInterval] = None) -> Reliability:
    """:func:`reliability` of ``plan`` at its config's ``[search]`` storage bandwidths and restart
    overhead (defaults: :data:`meshplan.spec.search.LLAMA3_STORAGE_GB_PER_S`,
    :data:`~meshplan.spec.search.ASSUMED_RESTART_OVERHEAD_S`), the goodput search prints and
    step's train-time line divides by."""
    o = plan.config.search
    return reliability(plan, write_bandwidth_bytes_per_s=o.checkpoint_write_gb_per_s * 1e9,
                       read_bandwidth_bytes_per_s=o.checkpoint_read_gb_per_s * 1e9,
                       restart_overhead_s=o.restart_overhead_s, job=job)


@dataclass(frozen=True)
class TrainTime:
    """How long ``tokens`` take at ``tokens_per_s`` (the predicted step's, all ranks): ``compute_s``
    = tokens / tokens_per_s of uninterrupted steps, and ``wall_s`` = compute_s / ``goodput``, the
    Daly (2006) fraction of wall time spent on useful work (:func:`goodput`: checkpoint writes,
    the work lost to each interruption and the restarts), at the job's checkpoint interval where
    the config gives one (``at``), else Daly's optimum. Seconds inside, days only in :meth:`line`.

    >>> t = TrainTime(15e12, 306_188.0, 0.9, "Daly's interval")
    >>> round(t.compute_s / DAY_S, 1), round(t.wall_s / DAY_S, 1)  # 15e12 / 306188 / 86400; / 0.9
    (567.0, 630.0)
    """

    tokens: float
    tokens_per_s: float
    goodput: float
    at: str

    @property
    def compute_s(self) -> float:
        return self.tokens / self.tokens_per_s

    @property
    def wall_s(self) -> float:
        return self.compute_s / self.goodput

    def line(self, inputs: str) -> str:
        """The line step prints; ``inputs``: the storage and restart inputs of the goodput."""
        return (f"train time: {self.tokens:.4g} tokens at {self.tokens_per_s:,.0f} tokens/s: "
                f"{self.compute_s / DAY_S:.1f} days of steps ({self.wall_s / DAY_S:.1f} days at goodput "
                f"{self.goodput:.2%}: meshplan reliability's checkpoint writes, interruptions and restarts, checkpoints "
                f"at {self.at}; {inputs})")

    def fields(self) -> dict:
        """``--json``'s ``train_time`` (seconds)."""
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "compute_s": self.compute_s,
                "goodput": self.goodput, "goodput_at": self.at, "wall_s": self.wall_s}


def train_time(tokens: float, tokens_per_s: float, r: Reliability) -> TrainTime:
    """:class:`TrainTime` of ``tokens`` at ``tokens_per_s`` with ``r``'s goodput: at the job's own
    checkpoint interval where ``r`` has one (:meth:`Reliability.job_fields`), else at Daly's."""
    if r.job is not None:
        return TrainTime(tokens, tokens_per_s, goodput(r.job.interval_s, r.write_s, r.restart_s, r.mtbf_s),
                         f"the job's interval ({r.job.steps} steps, {r.job.source})")
    return TrainTime(tokens, tokens_per_s, r.goodput, f"Daly's interval ({r.interval_s / 60:.1f} min)")
