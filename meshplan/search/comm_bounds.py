"""The collective seconds of many candidates at once, for the step-time bound: every axis's
per-layer, per-unit and per-step collectives (:func:`comm_times`) with the sizes of
:func:`meshplan.comm.collectives.collective_table`, and FSDP2's copies on the compute stream
around each all-gather and reduce-scatter (:func:`fsdp_copies`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from meshplan.comm import deepep, fsdp2
from meshplan.comm.pp_rows import boundary_seconds
from meshplan.compute.dtensor_sp import fp8_tp_gathers
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.measured import KernelData
from meshplan.compute.routing import RoutingOptions, a2a_rows, routed_tokens
from meshplan.config import Config
from meshplan.mesh.tpsplit import expert_shard_dim, experts_apart_degrees, local_heads, padded_numel
from meshplan.mesh.resolve import resolved_mesh
from meshplan.search.memory import Tables, lookup, split
from meshplan.search.float8_bounds import amax_times
from meshplan.search.space import SHARDING, Candidates
from meshplan.search.time_tables import TimeTables, coll_nic_s, coll_times
from meshplan.spec.axes.base import Dim
from meshplan.spec.axes.cp import kv_elements, ring_shift_bytes
from meshplan.spec.axes.moe_tp import moe_mlp_blocks_tp
from meshplan.spec.axes.tp import sdpa_kv_heads
from meshplan.spec.axes.tp_kv import qkv_gather_numel, qkv_gathered
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.training_checks import zeropp_keys_set
from meshplan.units import dtype_bytes


def p2p_bound(tt: TimeTables, c: Candidates, size: np.ndarray) -> np.ndarray:
    """Seconds of one pp send/recv of ``size`` bytes per candidate, at most every boundary's
    simulated transfer (each on its own pairs' path, :func:`meshplan.comm.pp_rows.boundary_seconds`):
    where the pp stride (dp x cp x tp ranks) is below the NVLink domain, stages 0 and 1 of rank 0's
    group share it and the boundaries differ: the fastest of them, timed as the step times them
    (:func:`_fastest_boundary`; not the NVLink pair's alone: below about 617 KiB the measured NVLink
    p2p curve is slower than a NIC pair, 22.7 us against 20.4 us at 512 KiB on dgx-h100); else
    every boundary crosses nodes and the pp axis's path (each rank its own NIC share) is the
    pairs'."""
    stride = c.dpr * c.dps * c.cp * c.tp
    near = (c.pp > 1) & (stride < tt.domain_gpus) & (tt.world % 2 == 0)
    far = coll_times(tt, "send/recv", np.where(near, 1, c.pp), size, stride)
    if not near.any():
        return far
    pp, size, stride = (np.broadcast_to(np.asarray(x, dtype=np.int64), near.shape) for x in (c.pp, size, stride))
    keys = [np.where(near, pp, 1), np.where(near, size, 0), np.where(near, stride, 1)]
    fast = lookup(keys, lambda p, b, st: {"t": _fastest_boundary(tt, p, b, st) if p > 1 else 0.0}, ("t",),
                  dtype=np.float64)["t"]
    return np.where(near, fast, far)


def _fastest_boundary(tt: TimeTables, pp: int, size: int, stride: int) -> float:
    """The fastest stage boundary's send/recv of ``size`` bytes, seconds, with pp outermost (stage
    s on ranks s x stride ..): :func:`meshplan.comm.pp_rows.boundary_seconds` on the search's
    placement, every boundary (the looped schedules' wrap too)."""
    outer = tt.world // (pp * stride)
    mesh = resolved_mesh(MeshSpec(names=["outer", "pp", "inner"], shape=[outer, pp, stride]), tt.world)
    return float(boundary_seconds(mesh, tt.placement, tt.cfg.cluster, size).min())


def p2p_links_apart(tt: TimeTables, c: Candidates) -> np.ndarray:
    """Per candidate, whether its pp boundaries may take different links (some on NVLink, some
    through the NIC): the pp stride below the NVLink domain (stages 0 and 1 of rank 0's group share
    a node) while the world spans more than one domain (pp outermost: a later boundary crosses).
    There a blocking call's transfers through different links run at once
    (:func:`meshplan.pipeline.rendezvous.call_seconds`): one that sends (or receives) ``k``
    transfers takes at least ``ceil(k / 2)`` of the fastest boundary's (its busier link carries at
    least half of them), not ``k`` (:func:`meshplan.search.pipeline.hold_loads`)."""
    stride = c.dpr * c.dps * c.cp * c.tp
    return (c.pp > 1) & (stride < tt.domain_gpus) & (tt.world > tt.domain_gpus)


def comm_times(cfg: Config, tt: TimeTables, c: Candidates) -> dict[str, np.ndarray]:
    """Seconds per call of each collective the bound uses, per candidate (sizes of
    :func:`meshplan.comm.collectives.collective_table`): tp's per layer (:func:`_tp_times`,
    :func:`_tp_qkv_amax_times`), cp's (:func:`_cp_times`), one pp send/recv (:func:`p2p_bound`),
    the FSDP units' (:func:`_fsdp_times`) and ep's (:func:`_ep_times`)."""
    m, t = cfg.model, cfg.training
    cd = dtype_bytes(t.compute_dtype)
    sp, seq = c.tp > 1, split(c, Dim.SEQUENCE)  # the sequence as the registered axes divide it
    act = c.mb * (t.seq_len // seq) * m.hidden * cd
    out = _tp_times(cfg, tt, c, act, seq)
    out.update(_cp_times(cfg, tt, c))
    out["p2p"] = p2p_bound(tt, c, act // np.where(sp, c.tp, 1))
    out.update(_tp_qkv_amax_times(cfg, tt, c, seq))
    out.update(_fsdp_times(cfg, tt, c))
    out.update(_ep_times(cfg, tt, c, seq))
    return out


def _tp_times(cfg: Config, tt: TimeTables, c: Candidates, act: np.ndarray, seq: np.ndarray) -> dict[str, np.ndarray]:
    """tp's per-layer collectives of :func:`comm_times`, seconds per call per candidate, of the
    layer activations ``act`` (bytes, compute dtype) with the sequence split ``seq`` ways: under SP
    (tp > 1) the all-gathers ``tp_sp`` and ``tp_ag`` (in float8 under torchao's float8 TP,
    :func:`meshplan.compute.dtensor_sp.float8_tp`: the contract's, with SP), else the all-reduce
    ``tp_ar``; ``loss``: the vocab-parallel loss's three all-reduces of one fp32 value per token
    (:func:`meshplan.comm.tp_rows._loss_rows`)."""
    m, t = cfg.model, cfg.training
    cd = dtype_bytes(t.compute_dtype)
    sp, one = c.tp > 1, np.ones_like(c.tp)
    # the layers' all-gathers in float8 under torchao's float8 TP (dtensor_sp.float8_tp: the
    # contract's, with SP); the reduce-scatters, the head's and the embedding's in compute dtype
    f8 = fp8_tp_gathers(m, t)  # torchao's float8 TP or Transformer Engine's fp8 (compute.dtensor_sp)
    return {"tp_sp": np.where(sp, coll_times(tt, "all-gather", c.tp, act, one), 0.0),
            "tp_ag": np.where(sp, coll_times(tt, "all-gather", c.tp, act // cd if f8 else act, one), 0.0),
            "tp_ar": np.where(sp, 0.0, coll_times(tt, "all-reduce", c.tp, act, one)),
            "loss": 3 * coll_times(tt, "all-reduce", c.tp, c.mb * (t.seq_len // seq) * 4, one)}


def _cp_times(cfg: Config, tt: TimeTables, c: Candidates) -> dict[str, np.ndarray]:
    """cp's collectives of :func:`comm_times` per layer, seconds per call per candidate, each over
    cp ranks tp apart, at the local heads of each candidate's tp
    (:func:`meshplan.mesh.tpsplit.local_heads`)."""
    m, t = cfg.model, cfg.training
    cd = dtype_bytes(t.compute_dtype)
    tps, at = np.unique(c.tp, return_inverse=True)
    heads = np.array([local_heads(m, x)[:2] for x in tps.tolist()], dtype=np.int64)[at.reshape(-1)]
    # K and V (MLA: value head dim d_v) at the KV heads; torch's ring attention (training.cp_ring;
    # spec.axes.cp.ring_rows) gathers them at the heads its SDPA reads (spec.axes.tp.sdpa_kv_heads of
    # [memory] kv_expanded: the q heads after repeat_kv, else the KV heads), and "cp_x" is one fp32 dK/dV shift of the
    # local tokens (0 under all-gather CP)
    # Transformer Engine's p2p ring (training.cp_p2p; spec.axes.cp.p2p_rows) gathers nothing: "cp_kv" is
    # one send of the local K/V at the KV heads, "cp_kv2" one of K, V, dK and dV (0 otherwise)
    # torch's ring with cp_rotate "alltoall" (spec.axes.cp.alltoall_kv_rows) gathers nothing either:
    # "cp_kvs" is one shift of the local K/V at those heads (its forward's cp - 1 each beside a step;
    # the backward's, queued with the dK/dV shifts, left out: a lower bound)
    ring, p2p = t.cp_ring, t.cp_p2p
    a2a = ring and t.cp_rotate == "alltoall"
    at_sdpa = kv_elements(m, c.mb, t.seq_len, sdpa_kv_heads(heads[:, 0], heads[:, 1], cfg.memory.kv_expanded))
    at_kv = kv_elements(m, c.mb, t.seq_len, heads[:, 1])
    kv = (at_sdpa if ring else at_kv) * cd
    shift = ring_shift_bytes(at_sdpa, c.cp)
    local = at_kv // c.cp * cd
    return {"cp_ag": np.zeros(len(c)) if p2p or a2a else coll_times(tt, "all-gather", c.cp, kv, c.tp),
            "cp_kvs": coll_times(tt, "send/recv", c.cp, at_sdpa // c.cp * cd, c.tp) if a2a else np.zeros(len(c)),
            "cp_rs": np.zeros(len(c)) if ring or p2p else coll_times(tt, "reduce-scatter", c.cp, kv, c.tp),
            "cp_x": coll_times(tt, "send/recv", c.cp, shift, c.tp) if ring else np.zeros(len(c)),
            "cp_n": (c.cp - 1) * ring,  # the shifts that run beside a later step (the last: exposed)
            "cp_kv": coll_times(tt, "send/recv", c.cp, local, c.tp) if p2p else np.zeros(len(c)),
            "cp_kv2": coll_times(tt, "send/recv", c.cp, 2 * local, c.tp) if p2p else np.zeros(len(c)),
            # Megatron-LM's all-gather CP: Transformer Engine's gathers and reduce-scatter block, nothing
            # beside them (fused linear_qkv; schedule.ring_timeline.cp_attention_forward/_backward)
            "cp_te_ag": np.full(len(c), float(t.framework == "megatron" and not ring and not p2p))}


def _tp_qkv_amax_times(cfg: Config, tt: TimeTables, c: Candidates, seq: np.ndarray) -> dict[str, np.ndarray]:
    """tp's other blocking collectives of :func:`comm_times` per layer, seconds per candidate:
    Megatron-LM's fused QKV output all-gather and gradient reduce-scatter at tp > kv_heads
    (``tp_qkv_ag``, ``tp_qkv_rs``, per call) and the amax (scale) all-reduces of a dense layer's
    float8 Linears under TP (``amax_f``, ``amax_b``: all of a layer's forward, backward;
    :func:`meshplan.search.float8_bounds.amax_times`)."""
    m, t = cfg.model, cfg.training
    cd = dtype_bytes(t.compute_dtype)
    one = np.ones_like(c.tp)
    # framework megatron at tp > kv_heads: the fused QKV output's all-gather (forward) and its
    # gradient's reduce-scatter (backward), blocking, once per layer (tp_rows.qkv_gather_rows)
    qkv = qkv_gathered(t.framework, c.tp, m.n_kv_heads) & (not m.is_mla)
    qkv_b = qkv_gather_numel(m, c.mb, t.seq_len, seq) * cd
    out = {"tp_qkv_ag": np.where(qkv, coll_times(tt, "all-gather", c.tp, qkv_b, one), 0.0),
           "tp_qkv_rs": np.where(qkv, coll_times(tt, "reduce-scatter", c.tp, qkv_b, one), 0.0)}
    out.update(amax_times(cfg, tt, c, seq))  # the float8 casts' tp all-reduces (search.float8_bounds)
    return out


def _fsdp_times(cfg: Config, tt: TimeTables, c: Candidates) -> dict[str, np.ndarray]:
    """The FSDP units' collectives of :func:`comm_times`, seconds per call per candidate (0 without
    zero3 or hsdp): a dense layer unit's all-gather (``fsdp_ag``) and reduce-scatter
    (``fsdp_rs``), the ``[norm, output]`` unit's (``head_rs``, ``head_ag``), HSDP's all-reduce
    over dp_replicate (``hsdp_ar``) and the routed experts' unit's all-gather over efsdp
    (``efsdp_ag``); ``fsdp_ag_nic``, ``fsdp_rs_nic``, ``head_rs_nic``, ``hsdp_ar_nic``: the NIC seconds of
    the first three and of ``hsdp_ar`` (:func:`~meshplan.search.time_tables.coll_nic_s`)."""
    m, t = cfg.model, cfg.training
    cd, rd = dtype_bytes(t.compute_dtype), dtype_bytes(t.fsdp_reduce_dtype)  # the table's FSDP dtypes
    on = (c.sh == SHARDING.index("zero3")) | (c.sh == SHARDING.index("hsdp"))
    unit = _padded_unit(tt.tables, c)
    out = {}
    # each weight in its gather dtype (training.gather_dtype: float8 Linear weights under
    # fp8_all_gather), as the collective table sizes the unit's all-gather
    # (``_nic``: each call's NIC seconds, TimeTables._nic: what FSDP2's two queues share, layer_bounds._fsdp_backward)
    gathered = _padded_unit(tt.tables, c, gather=True)
    if t.fp8_all_gather:  # off at dp_shard 1, FSDP over cp gathering the compute dtype (TrainingSpec.at_dp_shard)
        gathered = np.where(c.dps > 1, gathered, unit * cd)
    out["fsdp_ag"] = np.where(on, coll_times(tt, "all-gather", c.fsdp, gathered, c.tp), 0.0)
    out["fsdp_ag_nic"] = np.where(on, coll_nic_s(tt, "all-gather", c.fsdp, gathered, c.tp), 0.0)
    out["fsdp_rs"] = np.where(on, coll_times(tt, "reduce-scatter", c.fsdp, unit * rd, c.tp), 0.0)
    out["fsdp_rs_nic"] = np.where(on, coll_nic_s(tt, "reduce-scatter", c.fsdp, unit * rd, c.tp), 0.0)
    # the [norm, output] unit's reduce-scatter (unpadded elements: never above the table's; the
    # output layer counted, a tied one being its own unit only under pp)
    head = lookup([c.tp], lambda tp: {"n": sum(tt.tables.roots(tp)[1:3])}, ("n",))["n"]
    out["head_rs"] = np.where(on, coll_times(tt, "reduce-scatter", c.fsdp, head * rd, c.tp), 0.0)
    out["head_rs_nic"] = np.where(on, coll_nic_s(tt, "reduce-scatter", c.fsdp, head * rd, c.tp), 0.0)
    # its all-gather, each weight in its gather dtype (unpadded: never above the table's), which
    # training.reshard_head_after_forward runs again before each backward (gather_passes.head_regathers)
    head_g = lookup([c.tp], lambda tp: {"b": sum(tt.tables.roots_gather(tp)[k] for k in ("norm", "out"))}, ("b",))["b"]
    out["head_ag"] = np.where(on, coll_times(tt, "all-gather", c.fsdp, head_g, c.tp), 0.0)
    # HSDP: the reduced shard all-reduced over dp_replicate (ranks dp_shard * cp * tp apart)
    hpz = np.zeros(len(c), dtype=bool) if c.hz is None else c.hz > 1  # the search's hpZ rows (space.hpz_applies)
    if (zeropp_keys_set(t) or hpz.any()) and t.searched_zero3_engine == "deepspeed":
        # ZeRO++ (comm.zeropp_rows) moves the zero3 rows' gathers and reductions onto other groups and
        # dtypes: their seconds here are no lower bound of its, so none is counted (a looser bound)
        z3 = (c.sh == SHARDING.index("zero3")) & (hpz | bool(zeropp_keys_set(t)))
        for k in ("fsdp_ag", "fsdp_rs", "head_rs", "head_ag", "fsdp_ag_nic", "fsdp_rs_nic", "head_rs_nic"):
            out[k] = np.where(z3, 0.0, out[k])
    hsdp = c.sh == SHARDING.index("hsdp")
    out["hsdp_ar"] = np.where(hsdp, coll_times(tt, "all-reduce", c.dpr, unit // c.fsdp * rd, c.dps * c.cp * c.tp), 0.0)
    out["hsdp_ar_nic"] = np.where(hsdp, coll_nic_s(tt, "all-reduce", c.dpr, unit // c.fsdp * rd, c.dps * c.cp * c.tp), 0.0)
    # the routed experts' own FSDP unit, all-gathered over efsdp (expert mesh (efsdp, ep, etp):
    # efsdp ranks ep * etp apart) when a MoE layer's forward finds it sharded; under ep 1 (efsdp
    # fsdp's group) they ride in the layer's all-gather (mesh.tpsplit.experts_apart): none apart
    apart = experts_apart_degrees(c.ep, c.efsdp, c.fsdp)
    out["efsdp_ag"] = np.where(on & apart, coll_times(tt, "all-gather", c.efsdp, _padded_unit(tt.tables, c, True) * cd,
                                              c.ep * c.etp), 0.0) if m.is_moe else np.zeros(len(c))
    return out


def _ep_times(cfg: Config, tt: TimeTables, c: Candidates, seq: np.ndarray) -> dict[str, np.ndarray]:
    """ep's collectives of :func:`comm_times` per MoE layer, seconds per call per candidate (0 for
    a dense model): the dispatch's (``ep``) and the combine's (``ep_out``), DeepEP's call or the
    all-to-all with Megatron-LM's etp all-gather or reduce-scatter; ``moe_mlp_tp``: 1 where an MoE
    layer's MLP block opens and closes with the tp collectives, else 0."""
    m, t = cfg.model, cfg.training
    cd = dtype_bytes(t.compute_dtype)
    out = {}
    tokens, gathered = routed_tokens(c.mb * (t.seq_len // seq), c.tp, c.etp, t.framework)  # as comm.ep_rows
    zero = np.zeros(len(c))
    if m.is_moe and t.moe_dispatcher == "deepep":  # DeepEP's dispatch, the collective table's one call
        out["ep"] = lookup([c.ep, c.etp, tokens], lambda n, e, tok: {"t": _deepep_s(cfg, tt, n, e, tok)}, ("t",),
                           dtype=np.float64)["t"]
        out["ep_out"] = out["ep"]
    elif m.is_moe:
        rows = a2a_rows(RoutingOptions.of(t), tokens, m.top_k, m.experts, c.ep)
        a2a = coll_times(tt, "all-to-all", c.ep, rows * m.hidden * cd, c.etp)
        # Megatron-LM's etp all-gather and reduce-scatter of the received rows (comm.ep_rows._etp_rows;
        # etp innermost: stride 1), 0 at etp 1 and under torch: the all-gather after the dispatch
        # ("ep": the blocking calls before the expert GEMMs), the reduce-scatter before the combine
        # ("ep_out"), which the compute waits for at any ep: in forward (layer_timeline._block) for the
        # reduce-scatter and the combine (none at ep 1), in backward (_block_backward) the "grad wait"
        size, one = gathered * rows * m.hidden * cd, np.ones(len(c), dtype=np.int64)
        out["ep"] = a2a + coll_times(tt, "all-gather", gathered, size, one)
        out["ep_out"] = a2a + coll_times(tt, "reduce-scatter", gathered, size, one)
    else:
        out["ep"] = out["ep_out"] = zero
    # 1/0: an MoE layer's MLP block opens and closes with the tp collectives (spec.axes.moe_tp.moe_mlp_tp_ops)
    out["moe_mlp_tp"] = moe_mlp_blocks_tp(t.framework, c.etp, c.tp, bool(m.shared_experts)).astype(np.float64)
    return out


def _deepep_s(cfg: Config, tt: TimeTables, ep: int, etp: int, tokens: int) -> float:
    """Seconds per call of a deepep dispatch or combine (:func:`meshplan.comm.deepep.call_on`) over the
    flex dispatcher's ep x etp consecutive ranks (the expert block, etp innermost), each rank
    dispatching its own ``tokens`` (:func:`meshplan.compute.routing.routed_tokens`),
    as :func:`meshplan.comm.ep_rows.ep_rows` times it; 0 at ep 1."""
    if ep <= 1:
        return 0.0
    token_bytes = cfg.model.hidden * dtype_bytes(cfg.training.compute_dtype)
    own = tokens
    keep = deepep.keep_share(cfg.training, cfg.model, own, ep)
    return deepep.call_on(tt.path(1, ep * etp), cfg.cluster, cfg.model, own, token_bytes, ep, keep, etp).time_s


def _padded_unit(tables: Tables, c: Candidates, experts: bool = False, gather: bool = False) -> np.ndarray:
    """Elements of one dense layer's FSDP unit on one rank, dim 0 padded to the shard
    degree (:func:`~meshplan.mesh.tpsplit.fsdp_padded_numel`); the dense layer of MoE models
    with dense layers, else the MoE layer's non-expert part. ``experts``: the MoE layer's
    routed-expert unit instead, padded to efsdp on the dim FSDP2 shards (dim 1 past efsdp x ep
    > experts, :func:`~meshplan.mesh.tpsplit.fsdp_shard_len`; the collective table's
    ``experts`` unit).
    ``gather``: its all-gather bytes instead, each weight in its gather dtype
    (:class:`~meshplan.search.memory.LayerNumel` ``tensors``)."""
    moe = int(experts or (tables.model.is_moe and tables.model.dense_layers == 0))

    def padded(tp, ep, etp, shards):
        dim1 = experts and expert_shard_dim(tables.model.experts, shards, ep) == 1
        return sum(padded_numel(d1 if dim1 and d1 else r, n, shards) * (gb if gather else 1)
                   for r, n, expert, gb, d1 in tables.layer(tp, ep, etp, moe).tensors if expert == experts)
    shards = c.efsdp if experts else c.fsdp
    return lookup([c.tp, c.ep, c.etp, shards], lambda *k: {"n": padded(*k)}, ("n",))["n"]


def fsdp_copies(cfg: Config, tables: Tables, c: Candidates) -> dict[str, np.ndarray]:
    """Seconds per call of FSDP2's copies on the compute stream (:mod:`meshplan.comm.fsdp2`, as
    :func:`meshplan.comm.collectives.collective_table` times them) per candidate: ``out`` and
    ``in``, a layer unit's copy-out (twice its all-gather bytes, each weight in its gather dtype)
    and copy-in (its padded elements x (gradient + reduce dtype bytes)), of the smaller layer
    kind (the dense layer, a MoE layer's non-expert part; the routed experts' own unit left out);
    ``root_out``, ``root_in`` the same of pp 1's one root unit (embedding, final norm, output
    layer unless tied; without dim-0 padding, so never above the table's); ``emb_out``,
    ``emb_in``, ``head_out``, ``head_in`` of the end units apart (torchtitan's embedding and
    [norm, output] units; the output layer counted, a tied one being the last stage's own copy
    under pp); ``e_out``, ``e_in`` of a MoE layer's routed experts, their own unit over efsdp
    (unpadded; 0 where efsdp is 1). Llama 3 8B's embedding in bf16 (525,336,576 elements): copy-out
    2 x 1.051 GB, copy-in 525,336,576 x (2 + 4) B, at Triad 2.97 TB/s. 0 where the
    candidate has no FSDP2 unit over more than one rank (no zero3 or hsdp, dp_shard x cp 1, or
    zero3 under DeepSpeed's engines: the 2021 list copies and today's split and bucket copies are in
    their collectives' time, :func:`meshplan.comm.fsdp2.compute_stream_copies`), and
    under ``training.framework = "megatron"`` (Megatron FSDP computes in its buckets:
    :func:`meshplan.comm.fsdp2.compute_stream_copies`).

    >>> from meshplan.config import config_from_dict
    >>> from meshplan.search.memory import Tables
    >>> from meshplan.search.space import enumerate_candidates
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 8, "seq_len": 8192, "param_dtype": "fp32", "reduce_dtype": "fp32"},
    ...     "mesh": {"names": ["dp_shard"], "shape": [8]}})
    >>> c = enumerate_candidates(cfg)
    >>> i = int(np.flatnonzero((c.fsdp == 8) & (c.tp == 1) & (c.sh == SHARDING.index("zero3")))[0])
    >>> {k: round(float(v[0]) * 1e6, 1) for k, v in fsdp_copies(cfg, Tables(cfg), c.take([i])).items()}
    ... # doctest: +NORMALIZE_WHITESPACE
    {'out': 293.8, 'in': 440.6, 'root_out': 1415.1, 'root_in': 2122.6, 'emb_out': 707.5, 'emb_in': 1061.3,
     'head_out': 707.5, 'head_in': 1061.3, 'e_out': 0.0, 'e_in': 0.0}
    """
    m, t, gpu = cfg.model, cfg.training, cfg.cluster.gpu
    rates = _CopyRates(kernel_data(gpu), gpu.hbm_bandwidth_bytes_per_s, *fsdp2.copy_in_element_bytes(t))
    kinds = [1] if m.is_moe and m.dense_layers == 0 else [0, 1] if m.is_moe else [0]
    fsdp2_on = (c.sh == SHARDING.index("hsdp")) | ((c.sh == SHARDING.index("zero3"))
                                                   & (t.searched_zero3_engine == "fsdp2"))
    # Megatron FSDP: none (meshplan.comm.fsdp2); hsdp candidates run FSDP2 whatever zero3_engine says
    fsdp2_on &= fsdp2.compute_stream_copies(t.model_copy(update={"zero3_engine": "fsdp2"}))
    on = fsdp2_on & (c.fsdp > 1)
    lay = lookup([c.tp, c.ep, c.etp, c.fsdp], lambda *k: _layer_copies(tables, kinds, rates, *k), ("out", "in"),
                 dtype=np.float64)
    rt = lookup([c.tp], lambda tp: _root_copies(tables, m.tied_embeddings, rates, tp),
                ("root_out", "root_in", "emb_out", "emb_in", "head_out", "head_in"), dtype=np.float64)
    ex = lookup([c.tp, c.ep, c.etp], lambda *k: _expert_copies(tables, m.is_moe, rates, *k), ("e_out", "e_in"),
                dtype=np.float64)
    return {**{k: np.where(on, v, 0.0) for k, v in {**lay, **rt}.items()},
            **{k: np.where(fsdp2_on & (c.efsdp > 1), v, 0.0) for k, v in ex.items()}}


class _CopyRates(NamedTuple):
    """What FSDP2's copies are timed with (:func:`meshplan.comm.fsdp2.copy_out_seconds`,
    :func:`~meshplan.comm.fsdp2.copy_in_seconds`): the GPU's kernel data, its HBM datasheet
    bandwidth (bytes/s), and the bytes per element the copy-in reads (the unsharded gradient) and
    writes (the reduce-scatter input) (:func:`~meshplan.comm.fsdp2.copy_in_element_bytes`)."""

    data: Optional[KernelData]
    hbm_bytes_per_s: float
    grad_bytes: int
    reduce_bytes: int


def _layer_copies(tables: Tables, kinds: list[int], r: _CopyRates, tp: int, ep: int, etp: int,
                  shards: int) -> dict[str, float]:
    """:func:`fsdp_copies`' ``out`` and ``in`` of one layer unit at (tp, ep, etp) over ``shards``
    ranks: the smaller over the layer ``kinds`` (0 dense, 1 MoE: its non-expert part), dim 0
    padded to the shard degree."""
    out, inn = [], []
    for moe in kinds:
        ts = [x for x in tables.layer(tp, ep, etp, moe).tensors if not x[2]]
        out.append(fsdp2.copy_out_seconds(sum(padded_numel(r_, n, shards) * gb for r_, n, _, gb, _ in ts), r.data,
                                          r.hbm_bytes_per_s))
        inn.append(fsdp2.copy_in_seconds(sum(padded_numel(r_, n, shards) for r_, n, *_ in ts), r.grad_bytes,
                                         r.reduce_bytes, r.data, r.hbm_bytes_per_s))
    return {"out": min(out), "in": min(inn)}


def _root_copies(tables: Tables, tied: bool, r: _CopyRates, tp: int) -> dict[str, float]:
    """:func:`fsdp_copies`' copies of the end units at ``tp``: pp 1's one root unit (embedding,
    final norm, output layer unless ``tied`` to the embedding), the embedding's and the ``[norm,
    output]`` unit's apart (under pp the head holds its own copy); unpadded."""
    emb, norm, out = tables.roots(tp)[:3]
    g = tables.roots_gather(tp)

    def out_of(gathered, numel):
        return {"out": fsdp2.copy_out_seconds(gathered, r.data, r.hbm_bytes_per_s),
                "in": fsdp2.copy_in_seconds(numel, r.grad_bytes, r.reduce_bytes, r.data, r.hbm_bytes_per_s)}
    one, e, h = out_of(g["emb"] + g["norm"] + (0 if tied else g["out"]), emb + norm + (0 if tied else out)), \
        out_of(g["emb"], emb), out_of(g["norm"] + g["out"], norm + out)  # under pp the head holds its own copy
    return {"root_out": one["out"], "root_in": one["in"], "emb_out": e["out"], "emb_in": e["in"],
            "head_out": h["out"], "head_in": h["in"]}


def _expert_copies(tables: Tables, moe: bool, r: _CopyRates, tp: int, ep: int, etp: int) -> dict[str, float]:
    """:func:`fsdp_copies`' ``e_out`` and ``e_in``: a MoE layer's routed experts, their own unit
    over efsdp: unpadded elements (the table pads each expert tensor on the dim it shards, so never
    more than its bytes); 0 for a dense model (``moe`` False)."""
    ts = [x for x in tables.layer(tp, ep, etp, 1).tensors if x[2]] if moe else []
    return {"e_out": fsdp2.copy_out_seconds(sum(n * gb for _, n, _, gb, _ in ts), r.data, r.hbm_bytes_per_s),
            "e_in": fsdp2.copy_in_seconds(sum(n for _, n, *_ in ts), r.grad_bytes, r.reduce_bytes, r.data,
                                          r.hbm_bytes_per_s)}
