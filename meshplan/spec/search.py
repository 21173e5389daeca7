"""Search input: the optional ``[search]`` table of a config.

Every field narrows or parameterises ``meshplan search`` (:mod:`meshplan.search.driver`); each
default is stated here with its source. Lists are the allowed values of one dimension of
the search space; ``None`` (the key left out) means every value the model, the cluster and
the training contract allow.

>>> SearchOptions().top, SearchOptions().min_gemm_efficiency
(10, 0.5)
>>> SearchOptions(tp=[4, 8]).tp
[4, 8]
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from meshplan.limits import BOUNDS
from meshplan.spec.mesh import Schedule, parse_schedule

Recompute = Literal["none", "selective", "full", "op", "layer", "block"]
Sharding = Literal["zero1", "zero2", "zero3", "hsdp"]
#: Pipeline schedules the search plans: ``1f1b`` (1F1B with vpp 1, interleaved 1F1B with
#: vpp > 1), the V-shaped ``zbv`` and ``dualpipev`` (vpp 2) and ZB-H1 ``zb_h1`` (vpp 1).
SearchedSchedule = Literal["1f1b", "zbv", "dualpipev", "zb_h1"]
#: The frameworks a search plans under (:data:`meshplan.search.frameworks.FRAMEWORKS`, ``[search] frameworks``).
SearchedFramework = Literal["torch", "megatron", "deepspeed", "megatron_deepspeed"]


def _all_recompute() -> list[Recompute]:
    return ["none", "selective", "full", "op"]


def _default_sharding() -> list[Sharding]:
    return ["zero1", "zero2", "zero3", "hsdp"]

#: The tie threshold (1%) has its home in :mod:`meshplan.spec.accuracy`, a judgement, not the
#: model's measured error: the search then orders toward simpler meshes (:mod:`meshplan.search.rank`),
#: ``compare`` names the tie rule, and ``place --choose`` keeps the given placement
#: (:func:`meshplan.placement.choice.choose_placement`).
from meshplan.spec.accuracy import TIE  # noqa: E402  (re-exported: meshplan.spec.search.TIE)


def shorter_by(fast_s: float, slow_s: float) -> float:
    """How much shorter the step ``fast_s`` is than ``slow_s`` (seconds both), as a fraction of
    ``slow_s``: ``1 - fast_s / slow_s``. meshplan's one convention for a percentage between two
    steps: the difference over the step after "than" (the reference): ``A's step is 8.5% shorter
    than B's`` (search's top line, ``compare``'s verdict, the rule's ``shorter step by more than
    1%``), ``A is 0.5% longer than B's`` (A / B - 1), and a ``hint:`` line's signed change
    ``step 7.08 s (-26.7%)`` (re-planned / current - 1: ``-shorter_by`` of the current step).

    >>> round(shorter_by(10.0, 10.93), 4), round(shorter_by(7.08, 9.65), 3)
    (0.0851, 0.266)
    """
    return 1 - fast_s / slow_s

#: Llama 3 paper (Grattafiori et al. 2024, arXiv 2407.21783, section 3.3.1): the Tectonic
#: storage fabric of Llama 3 pre-training "supports a sustainable throughput of 2 TB/s".
LLAMA3_STORAGE_GB_PER_S = 2000.0
#: That default's source as the search's goodput line names it (:meth:`SearchOptions.goodput_words`).
LLAMA3_STORAGE_SOURCE = "the Llama 3 paper's sustained storage throughput, 2 TB/s (arXiv 2407.21783, 3.3.1)"
#: Detection, rescheduling and start-up per restart when ``[search]`` (or ``reliability``'s
#: ``--restart-overhead-s``) gives none: no published figure, an assumption, and the output says so.
ASSUMED_RESTART_OVERHEAD_S = 600.0


def checkpoint_inputs_words(write_gb_per_s: float, read_gb_per_s: float, restart_overhead_s: float,
                            unset: dict[str, str], prefix: str = "") -> str:
    """The checkpoint storage bandwidths (GB/s) and restart overhead (s) as ``search``'s goodput
    line and ``reliability`` print them; ``unset`` maps each of ``write``, ``read`` and
    ``restart`` left at its default (:data:`LLAMA3_STORAGE_GB_PER_S`,
    :data:`ASSUMED_RESTART_OVERHEAD_S`) to the field that sets it, named after ``prefix`` with
    where the default comes from.

    >>> print(checkpoint_inputs_words(2000, 2000, 600, {"write": "--write-gbps", "read": "--read-gbps",
    ...                                                 "restart": "--restart-overhead-s"}))
    checkpoint write/read 2000/2000 GB/s (default: the Llama 3 paper's sustained storage throughput, 2 TB/s (arXiv 2407.21783, 3.3.1); set --write-gbps, --read-gbps), restart overhead 600 s (default: an assumption, no published figure; set --restart-overhead-s)
    >>> print(checkpoint_inputs_words(100, 2000, 60, {"read": "--read-gbps"}))
    checkpoint write/read 100/2000 GB/s (read default: the Llama 3 paper's sustained storage throughput, 2 TB/s (arXiv 2407.21783, 3.3.1); set --read-gbps), restart overhead 60 s
    """
    storage = f"checkpoint write/read {write_gb_per_s:g}/{read_gb_per_s:g} GB/s"
    bandwidths = [k for k in ("write", "read") if k in unset]
    if bandwidths:
        which = "" if len(bandwidths) == 2 else f"{bandwidths[0]} "
        storage += (f" ({which}default: {LLAMA3_STORAGE_SOURCE}; set {prefix}"
                    f"{', '.join(unset[k] for k in bandwidths)})")
    restart = f"restart overhead {restart_overhead_s:g} s"
    if "restart" in unset:
        restart += f" (default: an assumption, no published figure; set {prefix}{unset['restart']})"
    return f"{storage}, {restart}"


class SearchOptions(BaseModel):
    """Fields of ``[search]`` (all optional).

    - ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``ep``, ``etp``: allowed degrees
      of each axis (default: every divisor of the world that fits the axis's rules).
    - ``micro_batch``: allowed micro-batch sizes (default ``[1, 2, 4, 8]``; the training
      contract's ``micro_batch`` is ignored, its ``global_batch`` and ``seq_len`` are kept).
    - ``recompute``: allowed policies (default all four: ``none``, ``selective``, ``full``, and
      torchtitan's op-level selective AC ``op``, searched under ``training.framework = "torch"``
      with FSDP2 only, on candidates with cp = 1 (any tp and ep, MLA too): Megatron-LM and
      DeepSpeed have no such policy, and a config listing it for them gets an error naming
      ``search.recompute``; where torchtitan runs the rows the default leaves ``selective``,
      Megatron-LM's core-attention recompute, out, and a list naming it searches it:
      :func:`meshplan.search.space_recompute.searched_recompute`; torchtitan's per-layer AC ``layer``, at
      its default frequency 2 (:data:`meshplan.search.columns.LAYER_AC_FREQ`), is searched there
      by default beside ``op`` on the rows where the planner once refused it (ep > 1, multi-head latent
      attention: :func:`meshplan.search.space_recompute.layer_for_op`), elsewhere only where the list names it: both its bounds count the layers each stage
      surely replays and keeps (:mod:`meshplan.search.layer_replays`), yet with it listed the 405B
      benchmark plans 90 candidates exactly against 70 (7.9 s CPU against 5.6 s on one worker,
      medians of 3 on shared cores; 9.0-9.3 s wall with 2 workers before the profile pass of searchprof), too near the 10 s goal to be the default; listed for another runtime it is an error naming ``search.recompute``); under ``training.framework =
      "megatron"`` Megatron-LM's block recompute ``block`` (``--recompute-method block
      --recompute-num-layers n``) is searched by default beside ``none`` and ``full``, at the smallest n
      that fits on each mesh where none does not (:mod:`meshplan.search.block_recompute`); a list
      without it leaves it out, and listed for another runtime it is an error naming
      ``search.recompute``; ``sharding``: allowed among
      ``zero1``, ``zero2``, ``zero3`` (with dp_replicate 1) and ``hsdp`` (dp_replicate > 1), default
      all four; ``zero2`` is DeepSpeed's ZeRO-2 and searched where its engine runs the config's
      ZeRO (``training.zero12_engine = "deepspeed"``), nowhere else.
    - ``vpp``: allowed virtual stages per rank; ``max_vpp``: the bound on them (default 8).
      Searched: 1, and the divisors of layers / pp up to ``max_vpp`` when pp > 1; with the Llama
      3 split (``uneven_stages``) those up to ``max_vpp`` with (layers + 2) / (pp x vpp) whole and >= 1.
    - ``reshard_after_forward``, ``tp_comm_overlap``, ``uneven_stages``: allowed values of
      ``training.reshard_after_forward`` (where parameters are FSDP-sharded),
      ``training.tp_comm_overlap`` (where tp > 1) and of the Llama 3 split with the first and
      last stage lighter (where pp >= 3: with vpp 1 where it differs from the default, with vpp
      > 1 where (layers + 2) / (pp x vpp) is whole and >= 1, the only interleaved split when pp
      does not divide the layers); default
      both values of each.
    - ``zero_hpz_partition_size``: allowed DeepSpeed ZeRO++ hpZ group sizes g on the rows the search
      varies hpZ on (:func:`meshplan.search.space.hpz_applies`: zero3 under DeepSpeed's ZeRO-3, the data
      axis the world over more than one node, or hpZ set in the config or here); default the config's
      ``training.zero_hpz_partition_size``, the node's GPU count and 1; ``[1]`` holds hpZ off, ``[8]``
      holds g 8 (each g must divide the data axis, as DeepSpeed's ``_ensure_divisibility``).
    - ``pp_schedules``: pipeline schedules of candidates with pp > 1 (default ``["1f1b"]``:
      1F1B with vpp 1, interleaved 1F1B with vpp > 1); ``zbv`` and ``dualpipev`` add the
      V-shaped schedules (torch ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) on
      candidates with vpp 2, ``zb_h1`` ZB-H1 (torch ``ScheduleInterleavedZeroBubble`` with one
      stage per rank) on candidates with vpp 1; leaving ``1f1b`` out keeps only those with pp > 1. Under
      ``training.framework = "megatron"`` they are an error (Megatron-LM runs none of them:
      :func:`meshplan.pipeline.registry.check_searched`, at the search's start).
    - ``max_tp``: largest tp (default: GPUs per NVLink domain, so tp groups stay on NVLink).
    - ``top``: candidates printed (default 10).
    - ``frameworks``: search under these frameworks' runtimes in place of ``training.framework`` and
      its engines (``torch``, ``megatron``, ``deepspeed``, ``megatron_deepspeed``:
      :mod:`meshplan.search.frameworks`), several ranked in one table (``search --framework``, which
      replaces it; default unset: the config's own).
    - ``headroom_tier``: rank the meshes that keep under 15% of the usable memory free at every
      setting (while ``[memory] fragmentation_fraction`` is below it) after the meshes that keep it,
      each at its first such setting, each tier by the order rule applied to its own settings, the
      whole ranking before the cut to ``top`` (default true: an expert would not run a row at 0.5%
      free, which two newcomer trials found ranked first; :mod:`meshplan.search.headroom`); false
      (``search --rank-tight``) ranks by step time alone. The rows may differ: a faster tight mesh
      can be left out.
    - ``min_gemm_efficiency``: the declared kernel-efficiency threshold: FLOP-weighted
      efficiency of the step's local GEMMs by :func:`meshplan.compute.gemm.gemm_model`, below which a
      candidate is rejected unless no candidate at or above it fits (default 0.5, half the
      dense peak: a stated choice; H100's measured ceiling is 0.803).
    - ``exact_min``: candidates evaluated exactly (build_plan + step_time) before the bound
      may stop the search (default 1); ``exact_max``: the most evaluated exactly for the
      ranking (default 2000); reaching it is reported. ``refine_max``: the most candidates
      whose bound is tightened by evaluating the pipeline schedule exactly on their unit
      bounds (default 2000; :mod:`meshplan.search.pipeline`): first those near the top
      (step-time bound within 10% of the top's), then each one the ranking reaches before
      planning it (:mod:`meshplan.search.frontier`).
    - ``memory_margin``: allowance on the vectorised memory bounds (default 0.01): a
      candidate is rejected without a plan only when its lower bound exceeds usable memory
      by more than this fraction, kept without one only when its upper bound stays this
      fraction below it; anything nearer is planned exactly. The bounds mirror the memory
      timeline's events (:mod:`meshplan.search.memory`); the margin absorbs a small change
      there, and every exact plan is checked against them.
    - ``settle_max``: candidates near the memory limit that the ranking did not need to
      plan, planned after it to settle their memory verdict (it changes only the counts):
      the first ``settle_max`` of them by step-time lower bound, then candidate index
      (default 32: measured 0.4 s of CPU for the seed's 64 GPUs, 1.5 s for Llama-3-405B on
      16,384 H100, one worker, against ``settle_max = 0``; the former 2 s wall-clock budget
      on 2 cores cost more); those left are counted as undecided. A
      count, not seconds, so that the same input gives the same counts on any machine. The
      former ``settle_s`` (seconds) is refused with a message naming this key.
    - ``rank_max``: feasible candidates the line on the config's own ``[mesh]`` plans (step only)
      to rank it, those the search did not plan whose step-time lower bound is below its step,
      lowest bound first (default 32: 0.1-0.3 s each on 2 cores, :mod:`meshplan.search.configured`);
      each left unplanned could be faster or not, so the rank is a range as wide as their count,
      which only more plans narrow. A count, for the same output on any machine.
    - ``checkpoint_write_gb_per_s``, ``checkpoint_read_gb_per_s``: aggregate storage bandwidth
      for the goodput column (default 2000 GB/s each: the Llama 3 paper's sustained Tectonic
      throughput); ``restart_overhead_s``: detection, rescheduling and start-up per restart
      (default 600 s: a stated assumption, no published figure). The search names each value
      used, and for a default its source or that it is an assumption (:meth:`goodput_words`). Goodput is printed, not
      ranked: at a fixed world it changes only with the per-rank checkpoint size.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    #: Keys no longer read, with what to write instead (:func:`meshplan.config_errors.build` prints it).
    REMOVED: ClassVar[dict[str, str]] = {
        "settle_s": "removed: a wall-clock budget made the counts differ from run to run; write settle_max = N "
                    "(candidates near the memory limit planned after the ranking, default 32) instead"}

    pp: Optional[list[int]] = None
    dp_replicate: Optional[list[int]] = None
    dp_shard: Optional[list[int]] = None
    cp: Optional[list[int]] = None
    tp: Optional[list[int]] = None
    ep: Optional[list[int]] = None
    etp: Optional[list[int]] = None
    micro_batch: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    recompute: list[Recompute] = Field(default_factory=_all_recompute)
    sharding: list[Sharding] = Field(default_factory=_default_sharding)
    vpp: Optional[list[int]] = None
    max_vpp: int = Field(default=8, gt=0, le=BOUNDS["virtual_stages"].value)
    reshard_after_forward: Optional[list[bool]] = None
    tp_comm_overlap: Optional[list[bool]] = None
    uneven_stages: Optional[list[bool]] = None
    zero_hpz_partition_size: Optional[list[int]] = None
    pp_schedules: list[SearchedSchedule] = Field(default_factory=lambda: list[SearchedSchedule](["1f1b"]))
    max_tp: Optional[int] = Field(default=None, gt=0, le=BOUNDS["world"].value)
    top: int = Field(default=10, gt=0, le=BOUNDS["top"].value)
    frameworks: Optional[list[SearchedFramework]] = Field(default=None, min_length=1)
    headroom_tier: bool = True
    min_gemm_efficiency: float = Field(default=0.5, ge=0, le=1)
    exact_min: int = Field(default=1, gt=0, le=BOUNDS["exact_min"].value)
    exact_max: int = Field(default=2000, gt=0, le=BOUNDS["exact_max"].value)
    refine_max: int = Field(default=2000, ge=0, le=BOUNDS["refine_max"].value)
    memory_margin: float = Field(default=0.01, ge=0, lt=1)
    settle_max: int = Field(default=32, ge=0, le=BOUNDS["settle_max"].value)
    rank_max: int = Field(default=32, ge=0, le=BOUNDS["rank_max"].value)
    checkpoint_write_gb_per_s: float = Field(default=LLAMA3_STORAGE_GB_PER_S, gt=0,
                                             le=BOUNDS["checkpoint_write_gb_per_s"].value)
    checkpoint_read_gb_per_s: float = Field(default=LLAMA3_STORAGE_GB_PER_S, gt=0,
                                            le=BOUNDS["checkpoint_read_gb_per_s"].value)
    restart_overhead_s: float = Field(default=ASSUMED_RESTART_OVERHEAD_S, ge=0, le=BOUNDS["restart_overhead_s"].value)

    def goodput_words(self, same: str = "") -> str:
        """The goodput column's inputs as the search prints them under its table: the storage
        bandwidths and restart overhead, and for each left at its default where the default
        comes from and the ``[search]`` field that sets it; ``same``, where every row shown has
        one goodput and the search drops the column (:func:`meshplan.report.search.goodput_line`),
        first.

        >>> print(SearchOptions().goodput_words())
        goodput (Daly, printed, not ranked): checkpoint write/read 2000/2000 GB/s (default: the Llama 3 paper's sustained storage throughput, 2 TB/s (arXiv 2407.21783, 3.3.1); set [search] checkpoint_write_gb_per_s, checkpoint_read_gb_per_s), restart overhead 600 s (default: an assumption, no published figure; set [search] restart_overhead_s)
        >>> print(SearchOptions(checkpoint_write_gb_per_s=100, restart_overhead_s=300).goodput_words())
        goodput (Daly, printed, not ranked): checkpoint write/read 100/2000 GB/s (read default: the Llama 3 paper's sustained storage throughput, 2 TB/s (arXiv 2407.21783, 3.3.1); set [search] checkpoint_read_gb_per_s), restart overhead 300 s
        >>> print(SearchOptions(checkpoint_write_gb_per_s=100, checkpoint_read_gb_per_s=100,
        ...                     restart_overhead_s=300).goodput_words("99.00% on every row"))
        goodput (Daly, printed, not ranked): 99.00% on every row; checkpoint write/read 100/100 GB/s, restart overhead 300 s ([search] fields)
        """
        return f"goodput (Daly, printed, not ranked): {same + '; ' if same else ''}{self.goodput_inputs()}"

    def goodput_inputs(self) -> str:
        """The storage bandwidths and restart overhead the goodput reads, each default's source and
        ``[search]`` field (what :meth:`goodput_words` prints after its head; step's ``--tokens`` line).

        >>> SearchOptions(checkpoint_write_gb_per_s=100, checkpoint_read_gb_per_s=100, restart_overhead_s=300).goodput_inputs()
        'checkpoint write/read 100/100 GB/s, restart overhead 300 s ([search] fields)'
        """
        fields = {"write": "checkpoint_write_gb_per_s", "read": "checkpoint_read_gb_per_s",
                  "restart": "restart_overhead_s"}
        unset = {k: f for k, f in fields.items() if f not in self.model_fields_set}
        words = checkpoint_inputs_words(self.checkpoint_write_gb_per_s, self.checkpoint_read_gb_per_s,
                                        self.restart_overhead_s, unset, "[search] ")
        return words + ("" if unset else " ([search] fields)")

    @field_validator("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "micro_batch", "vpp",
                     "zero_hpz_partition_size")
    @classmethod
    def _positive(cls, v):
        if v is not None:
            if not v:
                raise ValueError("empty list: give at least one allowed value, or leave the key out")
            bad = [x for x in v if x < 1]
            if bad:
                raise ValueError(f"degrees and sizes must be >= 1 (got {bad[0]})")
            if len(v) > 64 or max(v) > BOUNDS["world"].value:
                raise ValueError(f"at most 64 values, each at most {BOUNDS['world'].value} ({BOUNDS['world'].reason})")
        return v

    @field_validator("pp_schedules", mode="before")
    @classmethod
    def _schedule_spellings(cls, v):
        """Each name as ``mesh.pp_schedule`` spells it (:func:`~meshplan.spec.mesh.parse_schedule`:
        ``"1F1B"``, ``"ZBVZeroBubble"``); a schedule the search does not plan is named with the
        ones it does (interleaved 1F1B is ``1f1b`` at vpp > 1)."""
        if not isinstance(v, list):
            return v
        out = []
        for name in v:
            sched = parse_schedule(name)
            if sched is Schedule.INTERLEAVED_1F1B:
                raise ValueError(f"{name!r}: the search plans interleaved 1F1B as 1f1b on candidates with vpp > 1 "
                                 f"([search] vpp); write \"1f1b\"")
            if sched not in (Schedule.ONE_F_ONE_B, Schedule.ZBV, Schedule.DUALPIPEV, Schedule.ZB_H1):
                raise ValueError(f"{name!r} ({sched}) is not searched; the search plans 1f1b, zbv, dualpipev and zb_h1")
            out.append(str(sched))
        return out

    @field_validator("recompute", "sharding", "reshard_after_forward", "tp_comm_overlap", "uneven_stages",
                     "pp_schedules")
    @classmethod
    def _nonempty(cls, v):
        if v is not None and not v:
            raise ValueError("empty list: give at least one allowed value, or leave the key out")
        if v is not None and len(v) > 64:
            raise ValueError("at most 64 values")
        return v
