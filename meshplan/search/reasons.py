"""The rules a search candidate can break before its plan is built, in build_plan's order, over
all candidates at once (:func:`first_reason`): every registered axis's validity rules
(:mod:`meshplan.mesh.validity`), the pipeline schedules' micro-batch rules, the engines' rules
(DeepSpeed's ZeRO-1/2 and ZeRO-3) and the framework's; their words (:func:`reason_table`,
:func:`reason_texts`) and codes (:data:`CODE`, :data:`OK`).
"""

from __future__ import annotations

import numpy as np

from meshplan import catalog
from meshplan.config import Config
from meshplan.mesh.layers import first_last_split
from meshplan.pipeline.registry import get
from meshplan.pipeline.split_backward_ac import OP_AC_RAISES, op_ac_raises
from meshplan.pipeline.vshape import VShaped, reshard_defect
from meshplan.plan_runtime import dualpipev_ep_ac_reasons
from meshplan.search.block_recompute import BLOCK_REFUSED, block_pointless
from meshplan.search.columns import PIPELINE, RECOMPUTE, SEARCHED, SHARDING, ZERO12, Candidates
from meshplan.spec.axes.registry import rules

#: The pipeline schedules' own rules the search evaluates (each schedule's ``refused`` under
#: ``training.framework``: :meth:`OneFOneB.refused`, torch's m >= pp for candidates with vpp 1;
#: :meth:`Interleaved1F1B.refused`, m a multiple of pp under Megatron-LM or of torch's rounds
#: max(1, m // pp), for candidates with vpp > 1; :meth:`DualPipeV.refused`: m >= 2 pp, torch
#: ScheduleDualPipeV), then the rules applied after the plan's checks.
#: The ``framework`` rule under ``framework = "megatron"``: rows Megatron-LM cannot run as planned. Its
#: zero3 is Megatron FSDP, whose post-forward hook reshards every unit (``_post_forward``, megatron/core/
#: distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:975-1000 at NVIDIA/Megatron-LM d98e8a6), and
#: ``export --to megatron`` writes one data-parallel axis (:mod:`meshplan.interop.megatron_write`).
MEGATRON_REFUSED = ("framework megatron: parameters kept gathered (Megatron FSDP reshards every layer after its "
                    "forward) or hsdp (Megatron FSDP's HSDP, --num-distributed-optimizer-instances, is not modelled)")

#: The ``replicate`` rule under ``framework = "torch"``: an hsdp row that shards nothing
#: (:attr:`~meshplan.search.columns.Candidates.replicated`) is DDP over dp_replicate, which torchtitan
#: does not run as meshplan plans the row: it applies FSDP2 only where dp_shard x cp > 1
#: (``ParallelDims.fsdp_enabled``) and otherwise DDP (``apply_ddp``, meshplan's sharding none, which the
#: search does not plan), and that only as the whole mesh: beside pp, tp or cp ``parallelize_llama``
#: raises "DDP has not supported > 1D parallelism" (pytorch/torchtitan 018740b,
#: torchtitan/models/llama3/infra/parallelize.py). ``export --to torchtitan`` refuses such a plan
#: (:func:`meshplan.interop.torchtitan_write._write_degrees`).
TORCH_DDP_REFUSED = ("ddp (hsdp with dp_shard x cp 1) under framework torch: torchtitan shards with FSDP2 only where "
                     "dp_shard x cp > 1 and otherwise runs DDP, which it refuses beside pp or tp (\"DDP has not "
                     "supported > 1D parallelism\")")

#: The ``split`` rule under ``framework = "megatron"``: a pp that does not divide the layers, at vpp 1,
#: where Megatron-LM's only uneven split, ``--decoder-first/last-pipeline-num-layers`` with the middle
#: stages even (:func:`~meshplan.mesh.layers.first_last_split`), has none (61 layers at pp 32: 2 on
#: each of the 30 middle stages leave 1 for both ends, 1 on each leave 31). Megatron-Core takes no other
#: uneven split but ``--pipeline-model-parallel-layout``, which meshplan does not write.
MEGATRON_SPLIT_REFUSED = ("framework megatron: no layer split at this pp that Megatron-LM's --decoder-first/last-"
                          "pipeline-num-layers set (middle stages even, an end stage left no layer)")

#: The ``v-reshard`` rule under ``framework = "torch"``: a V-shaped row (zbv, dualpipev) with FSDP2 over a
#: data axis (:attr:`~meshplan.search.columns.Candidates.fsdp2_over_data`) and ``reshard_after_forward``
#: true (column ``rf``), whose gradients torch 2.13 gets wrong (:data:`meshplan.pipeline.vshape.RESHARD_DEFECT`,
#: why and the measurements; :func:`meshplan.pipeline.vshape.reshard_defect`, the condition of the plan's
#: warning and validate's refusal). The same rows with ``reshard_after_forward`` false are kept.
V_RESHARD_REFUSED = ("zbv, dualpipev or zb_h1 with FSDP2 over a data axis (zero3 or hsdp, dp_replicate x dp_shard x "
                     "cp > 1) and reshard_after_forward true under framework torch: torch 2.13 computes no weight "
                     "gradient for a layer unit resharded after its forward where the schedule splits its backward "
                     "(measured by meshplan validate, tests/test_zbv_fsdp_torch.py and tests/test_zbh1_fsdp_torch.py), "
                     "so its gradients are wrong; the same rows with reshard_after_forward false are kept")
#: The ``deepep`` rule under ``training.moe_dispatcher = "deepep"``: an ep x etp group of 1 rank or of a
#: size DeepEP has no kernel config for (:func:`meshplan.comm.deepep.group_reason`, the plan's reason).
DEEPEP_REFUSED = ("deepep: ep x etp 1 (Megatron-LM's flex dispatcher asserts TPxEP > 1) or a group size DeepEP has no "
                  "dispatch config for (Buffer.get_dispatch_config: 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160 ranks); "
                  "under framework torch also ep 1 or etp > 1 (torchtitan raises on both)")
#: Whether each schedule of :data:`~meshplan.search.columns.PIPELINE` has torch 2.13's reshard defect (rule
#: ``v-reshard``): the V-shaped ones (:data:`meshplan.pipeline.vshape.RESHARD_DEFECT`) and ZB-H1, the same
#: runtime's I/W split (:data:`meshplan.pipeline.zb_h1.RESHARD_DEFECT`); 1F1B and interleaved 1F1B run whole backwards.
_SPLITS = np.array([isinstance(get(name), VShaped) or name == "zb_h1" for name in PIPELINE])

_SCHEDULE_REASONS = (
    ("runs", "training.pp_schedule_runs does not divide the micro-batches (pp > 1)"),
    ("1f1b", "1F1B: micro-batches fewer than pp (torch Schedule1F1B)"),
    ("interleaved", "interleaved 1F1B: micro-batches not a multiple of pp (megatron) or of torch's rounds, or pp 2 "
                    "without p2p overlap (megatron)"),
    ("dualpipev", "DualPipeV: micro-batches fewer than 2 pp, or under framework torch ep > 1 with activation "
                  "checkpointing and training.pp_ep_overlap (torchtitan raises NotImplementedError)"),
    ("zb_h1", "ZB-H1: micro-batches not a multiple of torch's rounds max(1, m // pp) "
              "(torch ScheduleInterleavedZeroBubble)"),
    ("engine", "zero3_engine deepspeed or deepspeed-2021: pp > 1, cp > 1 or parameters kept gathered; "
               "zero12_engine deepspeed: cp > 1, ep > 1, or pp > 1 with zero2, overlap_comm, vpp > 1 or a schedule "
               "other than 1F1B"),
    ("framework", "zero1 under framework torch: no torch engine shards the optimizer alone (torchtitan cannot run it); "
                  + MEGATRON_REFUSED),
    ("split", MEGATRON_SPLIT_REFUSED),
    ("replicate", TORCH_DDP_REFUSED),
    ("v-reshard", V_RESHARD_REFUSED),
    ("deepep", DEEPEP_REFUSED),
    ("split-op", OP_AC_RAISES),
)
#: The ``host`` rule under ``training.offload_optimizer = "cpu"`` (DeepSpeed ZeRO-Offload): the plan's
#: host-memory reason (:func:`meshplan.memory.offload_host.host_memory_reasons`), over every candidate at
#: once (:mod:`meshplan.search.host_memory`); a row the memory lower bound rejects first stays ``memory``.
HOST_REFUSED = ("host memory: ZeRO-Offload's host state of a node's ranks (fp32 master, Adam moments, fp32 gradients "
                "and a 16-bit staging partition, 18-20 B a partition element) > cluster.node.host_memory_gb")
_LATE_REASONS = (
    ("memory", "memory peak > usable"),
    ("host", HOST_REFUSED),
    ("gemm", "local GEMM efficiency below the threshold"),
    ("block", BLOCK_REFUSED.split(": ", 1)[1]),  # last: the others' codes kept
)


def reason_table() -> tuple[tuple[str, str], ...]:
    """Rejection categories (key, summary), in the order build_plan finds them: every
    registered axis's rules with a vectorised form, in their order (mesh resolution, then
    :func:`meshplan.mesh.validity.check`), then the schedules' rules, then the memory timeline
    and the search's own GEMM rule."""
    axis = tuple((r.key, r.summary) for r in rules() if r.bad is not None)
    return axis + _SCHEDULE_REASONS + _LATE_REASONS


#: The ``engine`` rule's words per (sharding family, engine) (:data:`_SCHEDULE_REASONS` holds them all,
#: for a table that names no config): current DeepSpeed's ZeRO-1/2 engine (``zero12_engine``), its
#: ZeRO-3 (``zero3_engine = "deepspeed"``, which a DeepSpeed ZeRO-1/2 search plans its zero3 rows
#: with: :attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`) and the ZeRO-3 of 2021.
_ENGINE_TEXT = {("zero12", "deepspeed"): "zero12_engine deepspeed (DeepSpeed's ZeRO-1/2): cp > 1, ep > 1, or pp > 1 "
                                         "with zero2, overlap_comm, vpp > 1 or a schedule other than 1F1B",
                ("zero3", "deepspeed"): "zero3 rows under DeepSpeed's ZeRO-3 (zero3_engine deepspeed): pp > 1, cp > 1 "
                                        "or parameters kept gathered",
                ("zero3", "deepspeed-2021"): "zero3_engine deepspeed-2021: pp > 1, cp > 1 or parameters kept gathered"}


def reason_texts(training) -> dict[str, str]:
    """:data:`REASONS` as a dict, the ``engine`` rule labelled by the engine(s) ``training``
    actually plans (``zero12_engine = "deepspeed"``, the zero3 rows' engine
    :attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`), so a search of current
    DeepSpeed's ZeRO-1/2 does not name the 2021 ZeRO-3 engine.

    >>> from meshplan.spec.training import TrainingSpec
    >>> reason_texts(TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed"))["engine"]
    "zero12_engine deepspeed (DeepSpeed's ZeRO-1/2): cp > 1, ep > 1, or pp > 1 with zero2, overlap_comm, vpp > 1 or a schedule other than 1F1B; zero3 rows under DeepSpeed's ZeRO-3 (zero3_engine deepspeed): pp > 1, cp > 1 or parameters kept gathered"
    >>> reason_texts(TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed-2021"))["engine"]
    'zero3_engine deepspeed-2021: pp > 1, cp > 1 or parameters kept gathered'
    """
    engines = engine_texts(training)
    text = dict(REASONS)
    text["framework"] = MEGATRON_REFUSED if training.framework == "megatron" else text["framework"].split("; ")[0]
    if engines:
        text["engine"] = "; ".join(engines.values())
    return text


def engine_texts(training) -> dict[str, str]:
    """The ``engine`` rule's words per sharding family (``zero12``, ``zero3``) of the engines
    ``training`` plans, so a count can name the rule that rejected its rows alone."""
    planned = {("zero12", training.searched_zero12_engine), ("zero3", training.searched_zero3_engine)}
    out = {k[0]: _ENGINE_TEXT[k] for k in _ENGINE_TEXT if k in planned}
    if "zero3" in out and _zeropp_groups(training):
        out["zero3"] += (f", or ZeRO++ groups (hpZ {training.zero_hpz_partition_size}, qgZ) on a data axis that is not "
                         "the whole world or that hpZ's group does not divide")
    return out


#: :func:`reason_table` of the registered axes.
REASONS = reason_table()
#: How many of :data:`REASONS` are decided after the validity rules (memory, host, gemm, block).
LATE_RULES = len(_LATE_REASONS)
OK = -1
#: Code of a candidate near the memory limit left unplanned (beyond ``[search] settle_max``).
UNDECIDED = -2
CODE = {key: i for i, (key, _) in enumerate(REASONS)}


def zero1_refused(training) -> bool:
    """Whether the search rejects zero1 candidates under ``training`` (rule ``framework``): where
    no engine runs meshplan's zero1 (:attr:`~meshplan.spec.training.TrainingSpec.has_zero1_engine`;
    plan and step warn instead, :func:`meshplan.plan_runtime.runtime_warnings`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> [zero1_refused(TrainingSpec(global_batch=8, seq_len=16, **kw)) for kw in
    ...  ({}, {"framework": "megatron"}, {"sharding": "zero1", "zero12_engine": "deepspeed"})]
    [True, False, False]
    """
    return not training.has_zero1_engine


def first_reason(cfg: Config, c: Candidates) -> np.ndarray:
    """Code (index into :func:`reason_table`, :data:`REASONS` for the registered axes) of
    the first rule each candidate breaks, in build_plan's order, or :data:`OK`; the memory
    and GEMM rules are applied later. The axes' rules are their :attr:`Rule.bad` predicates
    (the ones :func:`meshplan.mesh.validity.check` runs on one mesh) over the columns."""
    m, t = cfg.model, cfg.training
    micro = t.global_batch // np.maximum(c.mb * c.dp, 1)
    runs = np.where(c.pp > 1, t.pp_schedule_runs, 1)  # build_plan's run_reasons: each run is one schedule
    run_micro = micro // runs
    checks = [(r.key, r.bad(m, t, c)) for r in rules() if r.bad is not None] + [
        ("runs", micro % runs != 0),
        # the schedules' own micro-batch rules (their refused, as build_plan's reasons): 1F1B
        # with vpp 1, interleaved 1F1B with vpp > 1, DualPipeV
        ("1f1b", (c.pp > 1) & (c.ps == 0) & (c.vpp == 1) & get(SEARCHED).refused(c.pp, run_micro, t.framework)),
        ("interleaved", (c.ps == 0) & (c.vpp > 1)
         & (get(get(SEARCHED).for_chunks(2)).refused(c.pp, run_micro, t.framework)
            # Megatron-LM asserts pp > 2 without its p2p overlap (plan_runtime.megatron_p2p_reasons)
            | ((t.framework == "megatron") & (t.pp_p2p_overlap is False) & (c.pp == 2)))),
        ("dualpipev", (c.ps == PIPELINE.index("dualpipev")) & (get("dualpipev").refused(c.pp, run_micro, t.framework)
                       # build_plan's dualpipev_ep_ac_reasons (plan_runtime): torchtitan's EP + DualPipeV + AC
                       | ((c.pp > 1) & (c.ep > 1) & bool(dualpipev_ep_ac_reasons(t, "dualpipev", 2, 2))))),
        ("zb_h1", (c.ps == PIPELINE.index("zb_h1")) & get("zb_h1").refused(c.pp, run_micro, t.framework)),
        # build_plan and TrainingSpec: DeepSpeed's pipeline engine refuses ZeRO 3 (pp 1 only), no
        # all-gather CP, and its ZeRO-3 re-gathers in backward (reshard_after_forward is an FSDP2 knob)
        ("engine", ((t.searched_zero3_engine != "fsdp2") & (c.sh == SHARDING.index("zero3"))
                    & ((c.pp > 1) | (c.cp > 1) | (c.rf == 0)))
         # ZeRO++ hpZ / qgZ: groups of world ranks, the data axis the whole world, g dividing it (plan_checks.check_zeropp)
         | (_zeropp_groups(t, c) & (c.sh == SHARDING.index("zero3"))
            & ((c.tp > 1) | (c.ep > 1) | (c.dpr > 1) | ((c.dps * c.cp) % _hpz(t, c) != 0)))
         # DeepSpeed's ZeRO-1 and ZeRO-2 (comm.deepspeed_zero12.check_mesh; dp_replicate 1 here):
         # its pipeline engine refuses ZeRO-2 and overlap_comm and runs 1F1B only (check_schedule)
         # (overlap_comm as given, else stages 1 and 2's default false: TrainingSpec.overlaps_comm)
         | ((t.searched_zero12_engine == "deepspeed") & np.isin(c.sh, ZERO12)
            & ((c.cp > 1) | (c.ep > 1) | ((c.pp > 1) & (bool(t.overlap_comm) | (c.sh == SHARDING.index("zero2"))
                                                          | (c.vpp > 1) | (c.ps != 0)))))),
        ("framework", (zero1_refused(t) & (c.sh == SHARDING.index("zero1"))) | ((t.framework == "megatron") & (
            (c.sh == SHARDING.index("hsdp")) | ((c.sh == SHARDING.index("zero3")) & (c.rf == 0))))),
        ("split", (t.framework == "megatron") & (c.vpp == 1) & (c.us == 0) & _no_first_last(m.layers, c.pp)),
        ("replicate", (t.framework == "torch") & c.replicated),
        # torch 2.13's split-backward schedules drop weight gradients of units resharded after forward
        # (vshape.RESHARD_DEFECT, zb_h1.RESHARD_DEFECT)
        ("v-reshard", _SPLITS[c.ps] & reshard_defect(t.framework, c.pp, c.fsdp2_over_data, c.rf)),
        ("deepep", (t.moe_dispatcher == "deepep") & m.is_moe
         & (~np.isin(c.ep * c.etp, catalog.deepep_buffer()["group_sizes"])
            | ((t.framework == "torch") & ((c.ep < 2) | (c.etp > 1))))),
        # op-level selective AC raised in W under torch 2.13's split backward (pipeline.split_backward_ac.OP_AC_RAISES)
        ("split-op", op_ac_raises(t.framework, c.pp, _SPLITS[c.ps], c.rc == RECOMPUTE.index("op"))),
        # a block row whose largest chunk has one layer: n 1 is full (the search's memory pass and
        # exact planner reject the others that add nothing, search.block_recompute)
        ("block", False if c.rk is None else block_pointless(c.rc, c.rk)),
    ]
    code = {key: i for i, (key, _) in enumerate(reason_table())}
    out = np.full(len(c), OK, dtype=np.int64)
    for key, bad in reversed(checks):
        out[np.broadcast_to(bad, out.shape)] = code[key]
    return out


def _hpz(t, c=None):
    """hpZ's g of each row of ``c`` (its :attr:`~meshplan.search.columns.Candidates.hz`, which the
    search varies), else ``t``'s ``zero_hpz_partition_size``."""
    return t.zero_hpz_partition_size if c is None or c.hz is None else c.hz


def _zeropp_groups(t, c=None):
    """Whether ``t`` (on each row of ``c``: its hpZ g, :func:`_hpz`) runs a ZeRO++ switch that builds
    groups of world ranks (hpZ, qgZ; :func:`meshplan.plan_checks.check_zeropp`), which a zero3 row then
    needs whole."""
    return (_hpz(t, c) > 1) | t.zero_quantized_gradients


def _no_first_last(layers: int, pp: np.ndarray) -> np.ndarray:
    """Where ``pp`` (an int array; one look per distinct pp) does not divide ``layers`` and
    :func:`~meshplan.mesh.layers.first_last_split` has no split (rule ``split``); past one
    stage a layer is rule ``layers``'s.

    >>> _no_first_last(61, np.array([1, 16, 30, 32, 61, 64])).tolist()
    [False, False, False, True, False, False]
    """
    keys, inv = np.unique(pp, return_inverse=True)
    bad = [p <= layers and layers % p != 0 and first_last_split(layers, p) is None for p in keys.tolist()]
    return np.array(bad, dtype=bool)[inv.reshape(-1)]
