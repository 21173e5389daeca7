"""A lower bound on the predicted step time of many search candidates at once, and the
efficiency of their local GEMMs, as numpy arrays.

The bound uses the same numbers as :func:`meshplan.schedule.steptime.step_time`: op times from
:func:`meshplan.compute.ops.layer_costs` (one call per distinct (tp, cp, micro-batch, ep,
etp), every recompute policy from the same ops), collective times from :func:`meshplan.comm.alphabeta.collective_time` on the path
:func:`meshplan.comm.collectives.axis_path` gives each axis (one call per distinct (stride,
degree): with the canonical order and node-major placement an axis's groups are ranks
``r0 + i * stride``), with the sizes of :func:`meshplan.comm.collectives.collective_table`.
It keeps only what the simulation (:mod:`meshplan.schedule.rank_timeline`, default
:class:`~meshplan.schedule.unit_sim.Overlap`) cannot avoid, so it never exceeds it:

- a layer's **chain**: every compute op in order, the blocking TP collectives before and
  after each block (with SP the all-gather and reduce-scatter, else the all-reduce), the
  blocking EP all-to-alls, the CP exchange beside the Q projection only (the K/V
  all-gather after the K/V projection, before the core attention: ``attention + max(0, ring -
  Q)``; backward the dK/dV reduce-scatter before the K/V projections' input gradients), the backward's
  weight-gradient GEMMs as ``max(W, reduce-scatter)``, full recompute's forward replay; under
  torchao's float8 TP the tp all-reduces of the casts' amaxes (4 forward, 7 backward per Llama
  layer; the forward's counted as with the float8 all-gather, the fewer), which the casts wait
  for;
- a **unit** (one micro-batch through a chunk of n layers): ``max(AG + n chain,
  n AG + chain)`` forward, ``max(AG + n chain, n AG + (n-2) RS + chain)`` backward, where
  AG, RS are the FSDP all-gather and reduce-scatter of one layer, serial on their stream
  (FSDP2 prefetches one layer; the layer waits for its gather; 0 with pp > 1, and with pp 1
  under ``training.grad_accumulation`` ``no_sync`` or ``no_sync_unsharded``, where a unit
  gathers only when it finds its chunk sharded and reduces once per step: those gathers are
  counted per gathering pass); the all-gather in each weight's gather dtype (float8 Linear
  weights under ``training.fp8_all_gather``); plus the embedding and the
  head (and the loss collectives) where the chunk holds them; where [norm, output] is its own
  unit (torchtitan's units) its pre-backward prefetches the last layer's all-gather, which then
  runs beside the head's backward: a gathering backward of the head's chunk counts its first
  gather less the head's backward time (the stage's other chunks' backwards do not);
  under ``training.reshard_head_after_forward`` (pp 1, ``sync``) each backward first waits
  for that unit's own all-gather and copy-out (:func:`_head_regathers`), the last layer's gather
  queued behind it;
- FSDP2's **copies on the compute stream** (:func:`fsdp_copies`, :mod:`meshplan.comm.fsdp2`):
  a layer's copy-out after each all-gather its pass waits for (forward; backward with
  ``reshard_after_forward``) before the layer's compute, its copy-in before each reduce-scatter
  after it (every backward with pp 1 under ``sync``, else the chunk's last gradient unit); with
  pp 1 the root unit's copy-out before the embedding (every forward under ``sync``, else
  the forwards that gather it) and copy-in after its gradient (every backward under ``sync``,
  else once); with pp > 1 each end unit's copy-out and copy-in once per step on the stage
  holding it; a MoE layer's routed experts' copy-in (their own unit over efsdp > 1) after each
  backward that reduces them; each counted as compute time serial with the chain;
- **one micro-batch's path**: micro-batch 0 forward through every virtual stage in order and
  back, one p2p send per hop, then stage 0's end (the whole step with one micro-batch);
- the **pipeline**: stage k cannot start before micro-batch 0 went forward through stages
  0..k-1 (each unit + one p2p send), runs all its units one after another, and stage 0
  cannot end before micro-batch m-1's gradient came back through stages k-1..0; the
  bound is the largest over k of ``fill_k + busy_k`` plus the larger of stage k's own
  end (optimizer step at HBM bandwidth, ZeRO-1's exposed parameter all-gather and its
  gradient reduce-scatter issued after the last unit's first layer) and ``drain_k +`` stage
  0's end.

With uneven chunks (the Llama 3 split with vpp > 1) every unit is bounded at its stage's
shortest chunk (``Stages.n_chunk``): each unit term grows with the chunk's layers, so the
bound of a longer chunk's unit is never below it; the chunk with the fewest MoE layers takes
the longest chunk (``n_chunk_hi``) for the others.

Under a V-shaped schedule (ZB-V, DualPipeV) only the fill and every stage's busy time and
end are kept (the last unit is a weight gradient; the gradient returns through input
gradients whose bound the units do not separate).

A middle stage's collectives are counted as its own table or stage 0's would count them,
whichever is less, so the bound holds with either convention of
:func:`~meshplan.schedule.steptime.step_time`. Tests check ``bound <= step_time`` on every
feasible candidate of small worlds; the search ranks by the exact step time and uses the
bound only to decide what it need not simulate.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from meshplan.comm import fsdp2
from meshplan.comm.collectives import FLOAT8_AMAX_BYTES, axis_path, fsdp_gather_flags, path_time
from meshplan.compute import float8
from meshplan.compute.dtensor_sp import float8_tp
from meshplan.compute.ops import (
    Workload,
    embedding_cost,
    float8_gemms,
    framework_kernels,
    head_cost,
    layer_costs,
    optimizer_bandwidth,
)
from meshplan.config import Config
from meshplan.compute.measured import kernel_data
from meshplan.compute.routing import RoutingOptions, a2a_rows
from meshplan.mesh.resolve import resolved_mesh
from meshplan.mesh.tpsplit import expert_shard_dim, local_heads, padded_numel
from meshplan.pipeline.fast import order_arrays
from meshplan.placement.assign import place
from meshplan.schedule.layer_timeline import cp_parts, LAYER_BLOCKS
from meshplan.schedule.optimizer_step import optimizer_step_s, ZEROED_GRAD_BUFFER
from meshplan.search.memory import Stages, Tables, lookup, split
from meshplan.search.space import FSDP_SHARDINGS, RECOMPUTE, SHARDING, ZERO12, Candidates, accumulates, \
    candidate_schedule
from meshplan.spec.axes.base import Dim
from meshplan.spec.mesh import MeshSpec
from meshplan.units import dtype_bytes

PHASES = {"f": ("forward", None), "bi": ("backward_input", None), "bin": ("backward_input", False),
          "br": ("backward_input", True), "bw": ("backward_weight", None)}
OP_FIELDS = tuple(f"{p}_{b}" for p in PHASES for b in LAYER_BLOCKS) + tuple(f"{p}_cpq" for p in PHASES if p != "bw")
EXTRA_FIELDS = ("emb_f", "emb_bw", "head_f", "head_b", "gemm_peak_s", "gemm_s")


class TimeTables:
    """Op times by workload key and collective paths by (stride, degree), each once."""

    def __init__(self, cfg: Config, tables: Tables):
        self.cfg, self.tables = cfg, tables
        self.world = cfg.cluster.world
        self.placement = place(cfg.cluster, self.world)
        self.ops = lru_cache(maxsize=None)(self._ops)
        self.shape = lru_cache(maxsize=None)(self._shape)
        self.path = lru_cache(maxsize=None)(self._path)
        self.coll = lru_cache(maxsize=None)(self._coll)

    def _shape(self, tp: int, cp: int, mb: int, ep: int, etp: int, layer: int) -> tuple[dict, dict]:
        """(layer ``layer``'s Cost by recompute policy of :data:`~meshplan.search.space.RECOMPUTE`,
        :func:`~meshplan.compute.ops.layer_costs`; the fields no policy changes: the embedding,
        the head and the GEMM totals, which count no recompute op) of one shape key."""
        cfg, m = self.cfg, self.cfg.model
        t, gpu = cfg.training, cfg.cluster.gpu
        w = Workload(seq_len=t.seq_len, micro_batch=mb, tp=tp, cp=cp, sp=tp > 1, ep=ep, etp=etp,
                     dtype=t.compute_dtype, recompute="none", flash=t.flash_attention,
                     vocab_pad_divisor=t.vocab_pad_divisor, routing=RoutingOptions.of(t), **framework_kernels(t),
                     **float8_gemms(m, t))
        costs = layer_costs(m, gpu, w, RECOMPUTE, layer=layer)
        emb, head = embedding_cost(m, gpu, w), head_cost(m, gpu, w)
        out = dict(emb_f=emb.seconds("forward"), emb_bw=emb.seconds("backward_weight"),
                   head_f=head.seconds("forward"), head_b=head.backward_s)
        # a policy only adds recompute ops: every policy's GEMMs are these, in this order
        gemms = [o for o in costs["none"].ops + head.ops if o.kind == "gemm" and not o.recompute]
        # each GEMM's seconds at the dense peak of its own dtype (float8 Linears: fp8's)
        at_peak = [o.hardware_flops / gpu.peak_flops(w.gemm_dtype(o.name)) for o in gemms]
        out.update(gemm_peak_s=sum(p for o, p in zip(gemms, at_peak) if o.block != "head"),
                   gemm_s=sum(o.seconds for o in gemms if o.block != "head"),
                   head_gemm_peak_s=sum(p for o, p in zip(gemms, at_peak) if o.block == "head"),
                   head_gemm_s=sum(o.seconds for o in gemms if o.block == "head"))
        return costs, out

    def _ops(self, tp: int, cp: int, mb: int, rc: int, ep: int, etp: int, layer: int) -> dict:
        """Op seconds of layer ``layer`` (0, or the first MoE layer) by field (module docstring)."""
        costs, shared = self.shape(tp, cp, mb, ep, etp, layer)
        cost = costs[RECOMPUTE[rc]]
        out = {f"{p}_{b}": cost.seconds(ph, b, rec) for p, (ph, rec) in PHASES.items() for b in LAYER_BLOCKS}
        # the attention's Q projection (input gradient in backward): all the CP K/V all-gather
        # (dK/dV reduce-scatter) may overlap (layer_timeline.cp_parts, the timeline's split); with
        # the sequence unsplit (cp 1) there is no exchange and ``chains`` adds max(0 - q, 0) = 0
        # whatever q: not asked
        out.update({f"{p}_cpq": cp_parts(cost, ph, rec)["q"] if cp > 1 else 0.0
                    for p, (ph, rec) in PHASES.items() if p != "bw"})
        out.update(shared)
        return out

    def _path(self, stride: int, degree: int):
        """:func:`~meshplan.comm.collectives.axis_path` of an axis of ``degree`` ranks ``stride``
        apart, on a three-axis mesh (outer, axis, inner) with the same groups."""
        outer = self.world // (stride * degree)
        mesh = resolved_mesh(MeshSpec(names=["outer", "axis", "inner"], shape=[outer, degree, stride]), self.world)
        return axis_path(mesh, self.placement, self.cfg.cluster, "axis")

    def _coll(self, op: str, n: int, size: int, stride: int) -> float:
        """Seconds of ``op`` over ``n`` ranks ``stride`` apart on a ``size``-byte buffer, as
        :func:`meshplan.comm.collectives.collective_table` times a row (``coll``: memoised,
        the pp groups of :func:`~meshplan.search.driver.estimate` ask the same rows)."""
        if n <= 1 or size <= 0:
            return 0.0
        return path_time(op, n, size, self.path(stride, n), self.cfg.cluster)[1]


def coll_times(tt: "TimeTables", op: str, n: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
    """Seconds of one ``op`` per candidate: :func:`meshplan.comm.alphabeta.collective_time` (the
    algorithm NCCL would pick, as the collective table times it) on the path of an axis of
    ``n`` ranks ``stride`` apart, once per distinct (n, size, stride)."""
    n, size = np.asarray(n, dtype=np.int64), np.asarray(size, dtype=np.int64)
    stride = np.broadcast_to(np.asarray(stride, dtype=np.int64), n.shape)
    out = lookup([n, size, stride], lambda k, b, st: {"t": tt.coll(op, k, b, st)}, ("t",), dtype=np.float64)["t"]
    return np.where((n <= 1) | (size <= 0), 0.0, out)


def comm_times(cfg: Config, tt: TimeTables, c: Candidates) -> dict[str, np.ndarray]:
    """Seconds per call of each collective the bound uses, per candidate (sizes of
    :func:`meshplan.comm.collectives.collective_table`)."""
    m, t = cfg.model, cfg.training
    cd, rd = dtype_bytes(t.compute_dtype), dtype_bytes(t.fsdp_reduce_dtype)  # the table's FSDP dtypes
    sp, seq = c.tp > 1, split(c, Dim.SEQUENCE)  # the sequence as the registered axes divide it
    act = c.mb * (t.seq_len // seq) * m.hidden * cd
    tps, at = np.unique(c.tp, return_inverse=True)
    kv_l = np.array([local_heads(m, x)[1] for x in tps.tolist()], dtype=np.int64)[at.reshape(-1)]
    kv = c.mb * t.seq_len * kv_l * (m.d_head + m.d_v) * cd  # K and V (MLA: value head dim d_v)
    one = np.ones_like(c.tp)
    # the layers' all-gathers in float8 under torchao's float8 TP (dtensor_sp.float8_tp: the
    # contract's, with SP); the reduce-scatters, the head's and the embedding's in compute dtype
    f8 = float8_tp(m, t)
    out = {"tp_sp": np.where(sp, coll_times(tt, "all-gather", c.tp, act, one), 0.0),
           "tp_ag": np.where(sp, coll_times(tt, "all-gather", c.tp, act // cd if f8 else act, one), 0.0),
           "tp_ar": np.where(sp, 0.0, coll_times(tt, "all-reduce", c.tp, act, one)),
           "loss": 3 * coll_times(tt, "all-reduce", c.tp, c.mb * (t.seq_len // seq) * 4, one),
           "cp_ag": coll_times(tt, "all-gather", c.cp, kv, c.tp),
           "cp_rs": coll_times(tt, "reduce-scatter", c.cp, kv, c.tp),
           "p2p": coll_times(tt, "send/recv", c.pp, act // np.where(sp, c.tp, 1), c.dpr * c.dps * c.cp * c.tp)}
    # the tp all-reduces of the float8 amaxes of a dense layer under torchao's float8 TP, blocking
    # (collectives._float8_amax_rows); forward counted as with fp8_all_gather (the fewer: 4 for
    # Llama against 11), as the candidates without FSDP plan it off
    names = float8_gemms(m, t).get("float8_gemms", frozenset()) if f8 else frozenset()
    n_f, n_b = float8.tp_amax_per_layer(names, True)
    amax = np.where(sp, coll_times(tt, "all-reduce", c.tp, one * FLOAT8_AMAX_BYTES, one), 0.0)
    out.update(amax_f=n_f * amax, amax_b=n_b * amax)
    on = (c.sh == SHARDING.index("zero3")) | (c.sh == SHARDING.index("hsdp"))
    unit = _padded_unit(tt.tables, c)
    # each weight in its gather dtype (training.gather_dtype: float8 Linear weights under
    # fp8_all_gather), as the collective table sizes the unit's all-gather
    out["fsdp_ag"] = np.where(on, coll_times(tt, "all-gather", c.fsdp, _padded_unit(tt.tables, c, gather=True), c.tp),
                              0.0)
    out["fsdp_rs"] = np.where(on, coll_times(tt, "reduce-scatter", c.fsdp, unit * rd, c.tp), 0.0)
    # the [norm, output] unit's reduce-scatter (unpadded elements: never above the table's; the
    # output layer counted, a tied one being its own unit only under pp)
    head = lookup([c.tp], lambda tp: {"n": sum(tt.tables.roots(tp)[1:3])}, ("n",))["n"]
    out["head_rs"] = np.where(on, coll_times(tt, "reduce-scatter", c.fsdp, head * rd, c.tp), 0.0)
    # its all-gather, each weight in its gather dtype (unpadded: never above the table's), which
    # training.reshard_head_after_forward runs again before each backward (_head_regathers)
    head_g = lookup([c.tp], lambda tp: {"b": sum(tt.tables.roots_gather(tp)[k] for k in ("norm", "out"))}, ("b",))["b"]
    out["head_ag"] = np.where(on, coll_times(tt, "all-gather", c.fsdp, head_g, c.tp), 0.0)
    # HSDP: the reduced shard all-reduced over dp_replicate (ranks dp_shard * cp * tp apart)
    out["hsdp_ar"] = np.where(c.sh == SHARDING.index("hsdp"),
                              coll_times(tt, "all-reduce", c.dpr, unit // c.fsdp * rd, c.dps * c.cp * c.tp), 0.0)
    # the routed experts' own FSDP unit, all-gathered over efsdp (expert mesh (efsdp, ep, etp):
    # efsdp ranks ep * etp apart) when a MoE layer's forward finds it sharded
    out["efsdp_ag"] = np.where(on, coll_times(tt, "all-gather", c.efsdp, _padded_unit(tt.tables, c, True) * cd,
                                              c.ep * c.etp), 0.0) if m.is_moe else np.zeros(len(c))
    if m.is_moe:
        rows = a2a_rows(RoutingOptions.of(t), c.mb * (t.seq_len // seq) * c.etp // c.tp, m.top_k, m.experts, c.ep)
        out["ep"] = coll_times(tt, "all-to-all", c.ep, rows * m.hidden * cd, c.etp)
    else:
        out["ep"] = np.zeros(len(c))
    return out


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
    data, hbm = kernel_data(gpu.name), gpu.hbm_bandwidth_bytes_per_s
    grad_b, red_b = fsdp2.copy_in_element_bytes(t)  # unsharded gradients, reduce-scatter input
    kinds = [1] if m.is_moe and m.dense_layers == 0 else [0, 1] if m.is_moe else [0]

    def layer(tp: int, ep: int, etp: int, shards: int) -> dict[str, float]:
        out, inn = [], []
        for moe in kinds:
            ts = [x for x in tables.layer(tp, ep, etp, moe).tensors if not x[2]]
            out.append(fsdp2.copy_out_seconds(sum(padded_numel(r, n, shards) * gb for r, n, _, gb, _ in ts), data, hbm))
            inn.append(fsdp2.copy_in_seconds(sum(padded_numel(r, n, shards) for r, n, *_ in ts), grad_b, red_b,
                                             data, hbm))
        return {"out": min(out), "in": min(inn)}

    def root(tp: int) -> dict[str, float]:
        emb, norm, out = tables.roots(tp)[:3]
        g = tables.roots_gather(tp)
        tied = m.tied_embeddings
        out_of = lambda gathered, numel: {"out": fsdp2.copy_out_seconds(gathered, data, hbm),
                                          "in": fsdp2.copy_in_seconds(numel, grad_b, red_b, data, hbm)}
        one, e, h = out_of(g["emb"] + g["norm"] + (0 if tied else g["out"]), emb + norm + (0 if tied else out)), \
            out_of(g["emb"], emb), out_of(g["norm"] + g["out"], norm + out)  # under pp the head holds its own copy
        return {"root_out": one["out"], "root_in": one["in"], "emb_out": e["out"], "emb_in": e["in"],
                "head_out": h["out"], "head_in": h["in"]}

    def experts(tp: int, ep: int, etp: int) -> dict[str, float]:
        # a MoE layer's routed experts, their own unit over efsdp: unpadded elements (the table
        # pads each expert tensor on the dim it shards, so never more than its bytes)
        ts = [x for x in tables.layer(tp, ep, etp, 1).tensors if x[2]] if m.is_moe else []
        return {"e_out": fsdp2.copy_out_seconds(sum(n * gb for _, n, _, gb, _ in ts), data, hbm),
                "e_in": fsdp2.copy_in_seconds(sum(n for _, n, *_ in ts), grad_b, red_b, data, hbm)}

    fsdp2_on = (c.sh == SHARDING.index("hsdp")) | ((c.sh == SHARDING.index("zero3"))
                                                   & (t.searched_zero3_engine == "fsdp2"))
    # Megatron FSDP: none (meshplan.comm.fsdp2); hsdp candidates run FSDP2 whatever zero3_engine says
    fsdp2_on &= fsdp2.compute_stream_copies(t.model_copy(update={"zero3_engine": "fsdp2"}))
    on = fsdp2_on & (c.fsdp > 1)
    lay = lookup([c.tp, c.ep, c.etp, c.fsdp], layer, ("out", "in"), dtype=np.float64)
    rt = lookup([c.tp], root, ("root_out", "root_in", "emb_out", "emb_in", "head_out", "head_in"), dtype=np.float64)
    ex = lookup([c.tp, c.ep, c.etp], experts, ("e_out", "e_in"), dtype=np.float64)
    return {**{k: np.where(on, v, 0.0) for k, v in {**lay, **rt}.items()},
            **{k: np.where(fsdp2_on & (c.efsdp > 1), v, 0.0) for k, v in ex.items()}}


def layer_ops(cfg: Config, tt: TimeTables, c: Candidates, moe: bool) -> dict[str, np.ndarray]:
    """Op seconds per block and phase of one layer kind (``f_attn``, ``bw_mlp``...), and
    the embedding, head and GEMM totals, per candidate."""
    # the layer whose costs stand for the kind: 0 for dense, the first MoE layer for MoE (the
    # same layer 0 when every layer is MoE: one call per key for both kinds)
    k = [split(c, Dim.HEADS), split(c, Dim.SEQUENCE), c.mb, c.rc, split(c, Dim.EXPERTS), split(c, Dim.EXPERT_FFN),
         np.full(len(c), cfg.model.dense_layers if moe else 0)]
    return lookup(k, tt.ops, OP_FIELDS + EXTRA_FIELDS + ("head_gemm_peak_s", "head_gemm_s"), dtype=np.float64)


def chains(c: Candidates, o: dict, cm: dict, moe: bool, serial: bool | np.ndarray = False) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) chain of one layer, seconds (module docstring). ``serial`` (per
    candidate): a block's input-gradient TP collective is issued after its weight gradients and
    the next block waits for it (layer_timeline._block_backward without ``Overlap.tp`` or
    ``tp_grad``: torch, with or without tp_comm_overlap), so the two add up; otherwise the collective may
    run beside the weight gradients (the larger of the two)."""
    pre, post = cm["tp_ag"], np.maximum(cm["tp_sp"], cm["tp_ar"])
    e = cm["ep"] if moe else 0.0
    # float8 TP: the casts wait for their amaxes' tp all-reduces (layer_timeline._amax_wait), the
    # forward's again in a replay (full and op-level AC); none in MoE models
    amax_f, amax_b = (0.0, 0.0) if moe else (cm["amax_f"], cm["amax_b"])

    def forward(p, post_mlp=post):
        # CP: the K/V all-gather starts after the K/V projection and the core attention waits
        # for it; only the Q projection runs beside it
        attn = o[f"{p}_attn"] + np.maximum(cm["cp_ag"] - o[f"{p}_cpq"], 0.0)
        blocking = (o[f"{p}_attn_pre"] + pre + attn + post + o[f"{p}_attn_post"]
                    + o[f"{p}_mlp_pre"] + pre + e + o[f"{p}_mlp"] + e + post_mlp + o[f"{p}_mlp_post"])
        # tp_comm_overlap: a block's TP collectives run under its GEMMs, decomposed into pieces
        # (compute.asynctp: each fused op lasts at least its collective and its pieces' GEMMs,
        # at least the whole GEMM's), so the block lasts at least both; the EP combine is issued
        # after the block's compute and still blocks
        overlapped = (o[f"{p}_attn_pre"] + np.maximum(attn, pre + post)
                      + o[f"{p}_attn_post"] + o[f"{p}_mlp_pre"] + np.maximum(o[f"{p}_mlp"], pre + post_mlp) + e
                      + o[f"{p}_mlp_post"])
        return np.where(c.ov > 0, overlapped, blocking) + amax_f
    # op-level selective AC replays its recomputed ops before the layer's backward, as full does
    full = (c.rc == RECOMPUTE.index("full")) | (c.rc == RECOMPUTE.index("op"))
    b = {blk: np.where(full, o[f"bin_{blk}"], o[f"bi_{blk}"]) for blk in LAYER_BLOCKS + ("cpq",)}
    # CP: the dK/dV reduce-scatter starts after the core attention's backward and the K/V
    # projections' input gradients wait for it; only the Q projection's runs beside it
    # tp_comm_overlap: async TP fuses the gathered output gradient with the row-parallel
    # input-gradient GEMM (compute.asynctp), which lasts at least both (pieces' GEMMs at least
    # the whole's); the other input gradients follow it
    gathered = lambda blk: np.where(c.ov > 0, np.maximum(pre, b[blk]), pre + b[blk])
    beside = lambda w, x: np.where(serial, w + x, np.maximum(w, x))
    back = (amax_b + b["mlp_post"] + e + gathered("mlp") + beside(o["bw_mlp"], post + e) + b["mlp_pre"] + b["attn_post"]
            + gathered("attn") + np.maximum(cm["cp_rs"] - b["cpq"], 0.0) + beside(o["bw_attn"], post)
            + b["attn_pre"])
    # torch's full AC replays no MLP closing collective (layer_timeline.replay_scatters); the
    # candidates of one search share the framework, which ``serial`` carries (torch: all True)
    replay = forward("br", np.where(serial, 0.0, post))
    return forward("f"), back + np.where(full, replay, 0.0)


def unit_bounds(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict) -> dict[str, np.ndarray]:
    """Per-stage lower bounds (candidates, pp), seconds: ``f_core``, ``b_core`` (one chunk's
    layers, forward and backward), the embedding's and the head's extra time in their
    chunk's units (``emb_f``, ``emb_b``, ``head_f``, ``head_b``), a gathering pass's extra
    (``f_extra``, ``b_extra``; ``b_extra_head``: a gathering backward of the head's chunk, its
    first gather less the head's backward; ``g_f``, ``g_b`` such passes per step; ``empty_end``:
    the stage's end chunk holds no layer), the extra of each chunk's
    last gradient unit (``b_red``: FSDP2's copy-ins where that unit alone reduces; ``b_wait``: with
    pp > 1 its copy-ins and reductions, which it waits for unless it ends the stage's order), each at
    the stage's shortest chunk, and at its longest (``f_core_hi``, ``b_core_hi``, ``b_red_hi``,
    ``b_wait_hi``; ``n_long``
    chunks of that length, ``f_core0``, ``b_core0`` chunk 0's: the Llama 3 split with vpp > 1), the p2p send
    ``p2p`` (candidates, 1), the last unit's ``tail`` beyond its duration and the stage's ``end``
    (optimizer step, exposed ZeRO-1 all-gather); module docstring."""
    m = cfg.model
    col = lambda a: np.asarray(a)[:, None]
    cm = comm_times(cfg, tt, c)
    od = layer_ops(cfg, tt, c, False)
    # torch: each block's input-gradient TP collective follows its weight gradients, async TP or
    # not (it fuses no such reduce-scatter: compute.asynctp.unfused_overlap); Megatron-LM runs
    # it beside them (Overlap.tp_grad)
    serial = np.full(len(c), cfg.training.framework != "megatron")
    fd, bd = chains(c, od, cm, False, serial)
    if m.is_moe:
        om = layer_ops(cfg, tt, c, True)
        fm, bm = chains(c, om, cm, True, serial)
        f0m, b0m = chains(c, om, {**cm, "ep": np.zeros(len(c))}, True, serial)
        # a stage's collective table may be stage 0's (step_time's older convention for the
        # middle stages) or its own: count the EP all-to-alls only when both hold MoE layers
        ep_on = np.where(st.k < st.k.shape[1] - 1, (st.n_moe[:, :1] > 0) & (st.n_moe > 0), st.n_moe > 0)
        fm, bm = np.where(ep_on, col(fm), col(f0m)), np.where(ep_on, col(bm), col(b0m))
        has_d, has_m = (st.n - st.n_moe) > 0, st.n_moe > 0
        pick = lambda d, x: np.where(has_d & has_m, np.minimum(col(d), x), np.where(has_m, x, col(d)))
        cf, cb = pick(fd, fm), pick(bd, bm)
    else:
        cf, cb = col(fd), col(bd)
    n = st.n_chunk
    # with pp > 1 a unit gathers only when it finds its chunk sharded and reduce-scatters only
    # on the chunk's last gradient unit (comm.collectives.fsdp_gather_flags): no FSDP term in
    # the per-unit cores; the gathering units' extra (``f_extra``, ``b_extra``, reduce-scatters
    # left out) is counted once per gathering pass (``g_f``, ``g_b``) in step_lower_bound
    # MoE models: routed experts gather over efsdp in their own units, which ``fsdp_ag`` (the
    # dense unit's) does not bound from below: no extra counted (measured: pp 4 x dp_shard 2
    # Mixtral-shaped, bound 0.1% above the simulated step with it)
    # pp 1 under training.grad_accumulation (``accumulates``) follows the same flags: a pass
    # gathers only when it finds the units sharded, the last gradient unit alone reduces
    lazy = (c.pp > 1) | accumulates(cfg, c.pp, c.sh)
    piped = col(lazy & (not m.is_moe))
    ag, rs = (col(np.where(lazy, 0.0, cm[k])) for k in ("fsdp_ag", "fsdp_rs"))
    ag_p = col(np.where(lazy, cm["fsdp_ag"], 0.0))
    # reshard_after_forward false: the table has no backward all-gather, so the layers'
    # reduce-scatters queue on the fsdp stream without holding up a gather (they end in the tail)
    keep = col(c.rf > 0)
    ag_b = ag * keep
    pre, post = col(cm["tp_sp"]), col(np.maximum(cm["tp_sp"], cm["tp_ar"]))
    g_f, g_b = gathering_passes(cfg, c, st)
    # a MoE layer's forward that finds its experts sharded waits for their efsdp all-gather,
    # issued when the layer starts (after the previous compute): serial with the chain; with
    # pp 1 every forward gathers, with pp > 1 the gathering passes (``f_extra``)
    e_ag = col(cm["efsdp_ag"]) * _expert_gathers(st, c) if m.is_moe else np.zeros_like(st.n, dtype=np.float64)
    # FSDP2's copies on the compute stream (fsdp_copies): a gathering pass's copy-out before each
    # layer's compute, a reducing pass's copy-in after it; every pass with pp 1 under sync (the
    # backward's copy-out only when it gathers again: reshard_after_forward), else the gathering
    # passes (``f_extra``, ``b_extra``) and the chunk's last gradient unit (``b_red``)
    cp = fsdp_copies(cfg, tt.tables, c)
    co, ci = col(np.where(lazy, 0.0, cp["out"])), col(np.where(lazy, 0.0, cp["in"]))
    co_p, ci_p = col(np.where(lazy, cp["out"], 0.0)), col(np.where(lazy, cp["in"], 0.0))
    # the routed experts' own unit (efsdp > 1): its copy-in after each MoE layer's backward that
    # reduces (grad_reduce._reduce, _perform_reduce_grad), in the chunk with the fewest of them
    moe_n = _expert_gathers(st, c) if m.is_moe else 0
    e_ci, e_ci_p = moe_n * col(np.where(lazy, 0.0, cp["e_in"])), moe_n * col(np.where(lazy, cp["e_in"], 0.0))
    cf_c, cb_c = cf + co, cb + co * keep + ci
    head_b0 = st.last * (col(od["head_b"]) + post)
    # training.reshard_head_after_forward (torchtitan's "always", pp 1 under sync): each backward
    # starts with the [norm, output] unit's all-gather, exposed, then its copy-out before the
    # head's backward; the last layer's prefetched gather queues behind it on the FSDP stream
    # (rank_timeline.backward_unit; test_reshard_policy's backward by hand)
    again = _head_regathers(cfg, c)
    h_co = st.last * col(cp["head_out"]) * again
    head_b = head_b0 + st.last * col(cm["head_ag"]) * again + h_co
    # torchtitan's [norm, output] unit (every pp): its pre-backward prefetches the last layer's
    # all-gather before the head's backward runs (rank_timeline.backward_unit), so a gathering
    # backward pass of the head's chunk exposes its first gather less the head's backward
    # (``b_extra_head``: the head chunk's gathering backwards only, step_lower_bound)
    hb = (head_b0 + h_co) * _head_unit_apart(cfg, c)  # the head's copy-out too: the last layer's gather starts after it
    hb1 = hb * col((c.pp == 1) & (c.vpp == 1))  # pp 1: every backward of the head's chunk gathers (sync)
    # there the head's reduce-scatter, issued after its backward, runs on the FSDP stream between
    # the last layer's prefetched all-gather and the next layer's (every micro-batch under sync)

    # pp > 1 (torch's PipelineStage, grad_reduce._perform_reduce_grad): a chunk's last gradient
    # unit, unless it ends the stage's order, holds the compute stream until its layers' FSDP
    # reductions are done: per layer a copy-in (compute stream), then its reduce-scatter (fsdp
    # stream), then its HSDP all-reduce (dp_replicate stream), each stream serial and the first
    # copy-in after the unit's last backward. n identical jobs through three serial stages take at
    # least the three of one job plus (n - 1) x the longest (a flow shop): ``b_wait``, the unit's
    # time past its compute (at least ``b_red``). Dense models with one schedule run only (the
    # tail's ``fsdp_red`` restriction; with runs > 1 the DAG's last micro-batch is not each run's)
    waits = col((c.pp > 1) & (not m.is_moe or m.dense_layers == 0) & (cfg.training.pp_schedule_runs == 1))
    rs_p, ar_p = col(cm["fsdp_rs"]), col(cm["hsdp_ar"])

    def cores(n):
        # one chunk of n layers: each term grows with n (a longer chunk's bound is never lower);
        # a chunk of none (the embedding or the output layer alone, stage_layers) has no layer term
        h_rs = col(cm["head_rs"]) * (hb1 > 0) * keep * (n >= 2)
        has = n >= 1
        return {"f_core": has * np.maximum(np.maximum(ag + n * cf_c, n * ag + cf_c), n * cf_c + col(~lazy) * e_ag),
                "b_core": has * np.maximum(np.maximum(ag_b - hb1, 0.0) + n * cb_c + e_ci,
                                           n * ag_b + np.maximum(n - 2, 0) * rs * keep + h_rs + cb_c - hb1),
                "b_red": has * (n * ci_p + e_ci_p),
                "b_wait": np.maximum(has * (n * ci_p + e_ci_p), has * waits * (ci_p + rs_p + ar_p + np.maximum(n - 1, 0)
                                                                             * np.maximum(np.maximum(ci_p, rs_p), ar_p)))}

    def extra(n, hb):
        # a gathering pass's extra over its chunk of n >= 1 layers (forward, backward less ``hb``)
        f = np.maximum(piped * (np.maximum(ag_p + n * (cf + co_p), n * ag_p + cf + co_p) - n * cf),
                       col(lazy) * e_ag + n * co_p)
        b = np.maximum(piped * (np.maximum(np.maximum(ag_p - hb, 0.0) + n * (cb + co_p),
                                           n * ag_p + cb + co_p - hb) - n * cb), n * co_p)
        return f, b

    lo, hi = cores(n), cores(st.n_chunk_hi)
    # the Llama 3 split with vpp > 1: ``n_long`` chunks of the stage hold n_chunk_hi layers, the
    # others n_chunk (stage_layers: stage 0's last chunks, the other stages' first ones); chunk
    # 0's units (the fill and the drain) are long on every stage but the first where any is
    n_long = st.n - c.vpp[:, None] * n
    long0 = (n_long > 0) & (st.k > 0)
    out = {**lo, "f_core_hi": hi["f_core"], "b_core_hi": hi["b_core"], "b_red_hi": hi["b_red"], "b_wait_hi": hi["b_wait"], "n_long": n_long,
           "f_core0": np.where(long0, hi["f_core"], lo["f_core"]), "b_core0": np.where(long0, hi["b_core"], lo["b_core"]),
           # at the shortest chunk that holds layers (the passes of an empty one are left out:
           # step_lower_bound); a gathering backward of the head's chunk takes the head's
           # backward off its first gather (``b_extra_head``), the other chunks' do not
           **dict(zip(("f_extra", "b_extra"), extra(np.maximum(n, 1), 0.0))),
           "b_extra_head": extra(np.maximum(n, 1), hb)[1],
           "g_f": g_f, "g_b": g_b, "empty_end": st.n_chunk == 0,
           "emb_f": st.first * (col(od["emb_f"]) + post + col(np.where(lazy, 0.0, cp["root_out"]))),
           "emb_b": st.first * (col(od["emb_bw"]) + col(np.where(lazy, 0.0, cp["root_in"]))),
           "head_f": st.last * (pre + col(od["head_f"]) + col(cm["loss"])),
           "head_b": head_b, "p2p": col(cm["p2p"])}
    one = col(c.vpp) == 1
    b0 = out["b_core0"] + out["emb_b"] + one * out["head_b"]
    out["end"], red = _stage_end(cfg, tt, c, st, s, cm)
    # the last unit issues its chunk's pieces of the per-step reduction: 1/vpp of it
    # the last unit reduces its chunk's FSDP gradients (every unit with pp 1, the chunk's last
    # gradient unit with pp > 1): its first layer's reduce-scatter (and HSDP all-reduce after it)
    # starts when that layer's backward ends, after every layer of the unit (``b_core``); only
    # the embedding's gradient (in ``b0``) still runs beside them. Dense units only: with dense
    # and MoE layers the unit sizes differ
    fsdp_red = col(cm["fsdp_rs"] + cm["hsdp_ar"]) * (not m.is_moe or m.dense_layers == 0)
    # pp 1 under accumulation: the root's copy-out in each forward that gathers it and its copy-in
    # once, in the last unit after its layers' reduce-scatters are issued, which it may overlap:
    # not counted in the tail too (with pp > 1 the root's copies are left out)
    root_in = col(cp["root_in"]) * col(lazy & (c.pp == 1))
    # pp > 1: the end units' copies once per step each (torchtitan's units, or the V's two
    # roots): the first forward finds them sharded (copy-out), perform_reduce_grad copies their
    # gradients in (the embedding's first, [norm, output]'s after the layers'); the embedding's
    # copy-out in a forward that gathers it again is left out
    ends = st.first * col(cp["emb_out"] + cp["emb_in"]) + st.last * col(cp["head_out"] + cp["head_in"])
    out["root_extra"] = root_in + (gathering_passes(cfg, c, st, root=True)[0] * col(cp["root_out"]) * col(lazy)
                                   if st.k.shape[1] == 1 else ends * col(c.pp > 1))
    # chunk 0's pieces of the per-step reduction: its layers' share (grad_reduce.reduce_pieces:
    # S / the stage's layers per layer), 1 / vpp with even chunks
    n0 = np.where(long0, st.n_chunk_hi, n)
    has0 = n0 >= 1  # chunk 0 holds layers (stage 0's may hold the embedding alone)
    out["tail"] = np.maximum(np.maximum(one * out["head_b"] + has0 * (ag_b + cb) + red * n0 / np.maximum(st.n, 1),
                                        one * out["head_b"] + out["b_core0"] + has0 * fsdp_red) - b0 - root_in, 0.0)
    return out


def _head_unit_apart(cfg: Config, c: Candidates) -> np.ndarray:
    """(candidates, 1) 1 where the stage holding the output layer has [norm, output] as an FSDP
    unit of its own (:func:`meshplan.comm.collectives._units`: torchtitan's units, but a tied
    model at pp 1, one unit of both ends; a V's two chunk roots), else 0."""
    t, m = cfg.training, cfg.model
    titan = t.framework == "torch" and t.zero3_engine != "deepspeed-2021"  # TrainingSpec.torchtitan_units
    apart = (c.pp > 1) | (c.vpp > 1) | np.bool_(not m.tied_embeddings)
    return (np.bool_(titan) & apart | (c.vpp > 1))[:, None].astype(np.float64)


def _head_regathers(cfg: Config, c: Candidates) -> np.ndarray:
    """(candidates, 1) 1 where every backward all-gathers the [norm, output] unit again before
    the head's backward (``training.reshard_head_after_forward``, which the search keeps on
    FSDP candidates with ``reshard_after_forward``, :func:`~meshplan.search.space.candidate_config`):
    a unit of its own (:func:`_head_unit_apart`) over more than one rank, pp 1 and vpp 1 under
    ``grad_accumulation = "sync"`` (each micro-batch's backward; with pp > 1 or accumulation only
    the gathering passes do, not counted here: the bound stays below the step), else 0."""
    if not cfg.training.reshard_head_after_forward:
        return np.zeros((len(c), 1))
    on = np.isin(c.sh, FSDP_SHARDINGS) & (c.rf > 0) & (c.fsdp > 1) & (c.pp == 1) & (c.vpp == 1) \
        & ~accumulates(cfg, c.pp, c.sh)
    return on[:, None] * _head_unit_apart(cfg, c)


def _expert_gathers(st: Stages, c: Candidates) -> np.ndarray:
    """MoE layers per chunk (the fewest of the stage's chunks) whose forward waits for an
    efsdp all-gather of the experts, (candidates, pp): none where the stage's collective table
    (:func:`meshplan.plan.table_stage`: its own for the first and last stage, stage 1's for
    the middle ones) has no MoE layer, hence no expert row."""
    p = st.k.shape[1]
    table = np.array([0 if k == 0 else p - 1 if k == p - 1 else 1 for k in range(p)])
    # the other vpp - 1 chunks hold at most the longest chunk's layers each
    fewest = np.maximum(st.n_moe - (c.vpp[:, None] - 1) * st.n_chunk_hi, 0)
    return np.where(st.n_moe[:, table] > 0, fewest, 0)


def gathering_passes(cfg: Config, c: Candidates, st: Stages, root: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward passes per step (candidates, pp) that all-gather their chunk's FSDP
    units on each stage when pp > 1, summed over the stage's chunks: the passes that find the
    chunk sharded (:func:`meshplan.comm.collectives.fsdp_gather_flags`, the rule the collective
    table and the timeline count); with pp 1 the same rule under ``training.grad_accumulation``
    (:func:`~meshplan.search.space.accumulates`: ``no_sync`` reshards after every backward but
    the last, ``no_sync_unsharded`` keeps the units gathered), else 0: every unit gathers
    (``f_core``). ``root``: the root unit's passes, pp 1 only (it never reshards after forward,
    :class:`meshplan.schedule.unit_times.UnitTimes`)."""
    p = st.k.shape[1]
    g = np.zeros((2, len(c), p))
    if p == 1:
        acc = accumulates(cfg, c.pp, c.sh)
        micro, keep = st.m[:, 0], (c.rf > 0) & (not root)
        for mm, r in sorted(set(zip(micro[acc].tolist(), keep[acc].tolist()))):
            rows = acc & (micro == mm) & (keep == r)
            flags = fsdp_gather_flags(candidate_schedule(1), 1, mm, 1, 0, r,
                                      reshard_after_backward=cfg.training.grad_accumulation == "no_sync")
            g[0, rows, 0] = sum(1 for (_, kind, _), on in flags.items() if on and kind == "F")
            g[1, rows, 0] = sum(1 for (_, kind, _), on in flags.items() if on and kind == "B")
        return g[0], g[1]
    m, v, ps, rf = (np.asarray(a, dtype=np.int64) for a in (st.m[:, 0], c.vpp, c.ps, c.rf > 0))
    code = ((m * (int(v.max()) + 1) + v) * (int(ps.max()) + 1) + ps) * 2 + rf  # one int per distinct key
    for key in np.unique(code).tolist():
        rows = code == key
        j = int(np.argmax(rows))
        g[:, rows, :] = _gathers(candidate_schedule(int(v[j]), int(ps[j])), p, int(m[j]), int(v[j]), bool(rf[j]))[:, None, :]
    return g[0], g[1]


@lru_cache(maxsize=None)
def _gathers(schedule, p: int, m: int, v: int, reshard: bool) -> np.ndarray:
    """(2, p): gathering F and B passes per step of each stage (see :func:`gathering_passes`),
    resharding after forward or not (``reshard``): :func:`_gathers_both`'s."""
    return _gathers_both(schedule, p, m, v)[int(reshard)]


@lru_cache(maxsize=None)
def _gathers_both(schedule, p: int, m: int, v: int) -> np.ndarray:
    """(2 reshard, 2, p): gathering F and B passes per step of each stage (see
    :func:`gathering_passes`), without and with resharding after forward:
    :func:`_chunk_gathers` summed over the chunks."""
    return _chunk_gathers(schedule, p, m, v).sum(axis=-1)


@lru_cache(maxsize=None)
def _chunk_gathers(schedule, p: int, m: int, v: int) -> np.ndarray:
    """(2 reshard, 2, p, v): gathering F and B passes per step of each stage's chunks, without
    and with resharding after forward: :func:`~meshplan.comm.collectives.fsdp_gather_flags`'s
    rule on the stage's order as arrays (:func:`~meshplan.pipeline.fast.order_arrays`, one call
    per stage for both): a pass gathers when it is its chunk's first, or follows a forward of
    the chunk that resharded; a backward leaves the chunk gathered."""
    out = np.zeros((2, 2, p, v))
    for s in range(p):
        kind, _, chunk = order_arrays(schedule, p, m, v, s)
        keep = kind < 2  # F and B (a W pass neither gathers nor reshards)
        kind, chunk = kind[keep], chunk[keep]
        if v > 1:
            o = np.argsort(chunk, kind="stable")
            kind, chunk = kind[o], chunk[o]
        first = np.concatenate([[True], chunk[1:] != chunk[:-1]])
        after_f = np.concatenate([[False], kind[:-1] == 0])
        fwd = kind == 0
        for r, gathers in enumerate((first, first | after_f)):
            out[r, 0, s] = np.bincount(chunk[gathers & fwd], minlength=v)
            out[r, 1, s] = np.bincount(chunk[gathers & ~fwd], minlength=v)
    return out


def end_chunk_passes(c: Candidates, st: Stages) -> dict[str, np.ndarray]:
    """Of :func:`gathering_passes`' passes with pp > 1 (candidates, pp): those of each stage's
    first chunk (``f0``, ``b0``) and last chunk (``fl``, ``bl``). The model's first virtual
    stage is stage 0's first chunk, its last the head stage's last chunk (``st.last``): the
    chunks that may hold the embedding or the output layer alone (``st.n_chunk`` 0, the Llama 3
    split at one slot per virtual stage), and the one whose backward runs the head's."""
    p = st.k.shape[1]
    out = {k: np.zeros((len(c), p)) for k in ("f0", "b0", "fl", "bl")}
    if p == 1:
        return out
    m, v, ps, rf = (np.asarray(a, dtype=np.int64) for a in (st.m[:, 0], c.vpp, c.ps, c.rf > 0))
    code = ((m * (int(v.max()) + 1) + v) * (int(ps.max()) + 1) + ps) * 2 + rf  # one int per distinct key
    for key in np.unique(code).tolist():
        rows = code == key
        j = int(np.argmax(rows))
        g = _chunk_gathers(candidate_schedule(int(v[j]), int(ps[j])), p, int(m[j]), int(v[j]))[int(rf[j])]
        for name, kind, chunk in (("f0", 0, 0), ("b0", 1, 0), ("fl", 0, -1), ("bl", 1, -1)):
            out[name][rows] = g[kind, :, chunk][None, :]
    return out


def step_lower_bound(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict) -> np.ndarray:
    """Lower bound of :func:`meshplan.schedule.steptime.step_time` per candidate, seconds; ``st``,
    ``s``: :func:`~meshplan.search.memory.stage_layout` and ``state`` of the same group."""
    u = unit_bounds(cfg, tt, c, st, s)
    v = c.vpp[:, None]
    one = v == 1
    r = u["n_long"]  # chunks of n_chunk_hi layers (the Llama 3 split with vpp > 1; else 0)
    # the gathering passes: none of a chunk without layers (the Llama 3 split at one slot per
    # virtual stage: stage 0's first chunk, the head stage's last), and the head's chunk's
    # backwards apart (the only ones whose first gather runs beside the head's backward)
    ends = end_chunk_passes(c, st)
    empty0, empty_l = st.first & (st.n_chunk == 0), st.last & (st.n_chunk == 0) & ~one
    g_f = u["g_f"] - empty0 * ends["f0"] - empty_l * ends["fl"]
    g_b = u["g_b"] - empty0 * ends["b0"] - empty_l * ends["bl"]
    g_bh = np.where(one, st.last * g_b, st.last * ~empty_l * ends["bl"])
    # the v - 1 chunks that do not end the stage's order wait for their reductions (``b_wait``):
    # whichever chunk ends it, at least r - 1 of those hold n_chunk_hi layers (the wait grows with n)
    w_long = np.maximum(r - 1, 0)
    w_short = v - 1 - w_long
    busy = st.m * ((v - r) * (u["f_core"] + u["b_core"]) + r * (u["f_core_hi"] + u["b_core_hi"])
                   + u["emb_f"] + u["emb_b"] + u["head_f"] + u["head_b"]) \
        + g_f * u["f_extra"] + (g_b - g_bh) * u["b_extra"] + g_bh * u["b_extra_head"] \
        + (v - r) * u["b_red"] + r * u["b_red_hi"] + u["root_extra"] \
        + w_short * (u["b_wait"] - u["b_red"]) + w_long * (u["b_wait_hi"] - u["b_red_hi"])
    f0 = u["f_core0"] + u["emb_f"] + one * u["head_f"]       # chunk 0's forward unit on each stage
    b0 = u["b_core0"] + u["emb_b"] + one * u["head_b"]       # chunk 0's backward unit on each stage
    p2p, tail, end = u["p2p"], u["tail"], u["end"]
    first = f0 + ~empty0 * u["f_extra"]  # micro-batch 0's forward finds every chunk sharded: it gathers
    fill = np.cumsum(first + p2p, axis=1) - (first + p2p)
    drain = np.cumsum(b0 + p2p, axis=1) - (b0 + p2p)
    own = fill + busy + tail + end
    # the copy-ins of the chunk that ends stage k's order (in ``busy``) run after its last unit has
    # sent its gradient on (grad_reduce._perform_reduce_grad, ``tail``): not before the drain
    via0 = fill + busy - np.maximum(u["b_red"], u["b_red_hi"]) + drain + tail[:, :1] + end[:, :1]
    out = np.maximum(own, via0).max(axis=1)
    # 1F1B: micro-batch 0 forward through every stage and back to stage k, then stage k's
    # units after its first backward ((m - 1) B and (m - w) F), then micro-batch m-1's
    # gradient back to stage 0.
    # (stage k's last gradient unit, with its copy-ins ``b_red``, is one of its backward units)
    path = (f0.sum(axis=1, keepdims=True) + b0.sum(axis=1, keepdims=True) + (st.m - 1) * b0
            + (st.m - st.w_step) * f0 + 2 * (st.k.shape[1] - 1) * p2p + u["b_red"])
    # (its copy-ins after its send: not on the way back to stage 0)
    one_f = np.maximum(path - u["b_red"] + tail[:, :1] + end[:, :1], path - drain + tail + end).max(axis=1)
    # V-shaped schedules: stage k still starts after micro-batch 0's chunk-0 forward through
    # stages 0..k-1 and runs every unit, but its last unit is a weight gradient (tail not
    # bounded here) and the gradient's way back runs input gradients only (no drain bound)
    v_out = (fill + busy + end).max(axis=1)
    # one micro-batch's path: micro-batch 0 runs forward through every virtual stage in order
    # (chunk j of stages 0..p-1, then chunk j + 1), each hop one p2p send, then backward through
    # all of them in reverse, and stage 0 ends after its backward of chunk 0: the whole step when
    # m is 1, and what bounds few micro-batches over many chunks (interleaved 1F1B, 1 micro-batch
    # on pp 4 x vpp 8: about 3.5x the fill-busy-drain bound)
    p = st.k.shape[1]
    one_mb = ((v - r) * (u["f_core"] + u["b_core"]) + r * (u["f_core_hi"] + u["b_core_hi"])
              + u["emb_f"] + u["emb_b"] + u["head_f"] + u["head_b"]).sum(axis=1)
    path1 = one_mb + 2 * (p * c.vpp - 1) * p2p[:, 0] + end[:, 0]
    return np.where(st.vshape[:, 0], v_out, np.maximum(np.where(c.vpp == 1, np.maximum(out, one_f), out), path1))


def _stage_end(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict, cm: dict):
    """(optimizer step + ZeRO-1's exposed parameter all-gather, ZeRO-1's gradient
    reduce-scatter) per stage, seconds (:func:`meshplan.schedule.step_end._stage_end`)."""
    t, gpu = cfg.training, cfg.cluster.gpu
    zeroed = np.isin(c.sh, [i for i, k in enumerate(SHARDING) if k in ZEROED_GRAD_BUFFER])[:, None]
    opt = optimizer_step_s(s["params"], s["grads"], s["master"], s["optimizer"], t, optimizer_bandwidth(gpu), zeroed)
    zero1 = (c.sh == SHARDING.index("zero1"))[:, None]
    # zero1 and zero2 gather the updated parameters once per step (Megatron-LM's distributed
    # optimizer, DeepSpeed's all_gather_dp_groups); zero2 reduces in the backward (not counted)
    zero12 = np.isin(c.sh, ZERO12)[:, None]
    # the middle stages' table is stage 0's or their own: the smaller parameter count of the two
    numel = np.where(st.last, s["dense_numel"], np.minimum(s["dense_numel"], s["dense_numel"][:, :1]))
    n = np.broadcast_to(c.fsdp[:, None], numel.shape).ravel()
    stride = np.broadcast_to(c.tp[:, None], numel.shape).ravel()
    gather = coll_times(tt, "all-gather", n, numel.ravel() * dtype_bytes(t.param_dtype), stride).reshape(numel.shape)
    if t.overlap_param_gather:  # Megatron-LM's --overlap-param-gather: the next forward waits for one bucket at least
        # (step_end.param_gather_exposed_s), ceil(numel / B) buckets (collectives._megatron_bucket_rows)
        gather = gather / np.maximum(np.ceil(numel / cfg.memory.bucket_elements(c.fsdp)[:, None]), 1)
    # in the dtype the zero1 plan reduces in (TrainingSpec.zero12_reduce_dtype: grad_reduce_dtype,
    # DeepSpeed's model dtype, else reduce_dtype), the collective table's
    red = coll_times(tt, "reduce-scatter", n, numel.ravel() * dtype_bytes(t.zero12_reduce_dtype),
                     stride).reshape(numel.shape)
    return opt + np.where(zero12, gather, 0.0), np.where(zero1, red, 0.0)


def gemm_efficiency(cfg: Config, tt: TimeTables, c: Candidates) -> np.ndarray:
    """FLOP-weighted efficiency of a step's local GEMMs per candidate: every layer's
    forward, data- and weight-gradient GEMMs and the output layer's, as
    :func:`meshplan.compute.gemm.gemm_model` times them: ``sum (FLOP / peak) / sum seconds``,
    each GEMM against the dense peak of its dtype (float8 Linears: fp8; one dtype: ``sum FLOP
    / (sum seconds x peak)``)."""
    m = cfg.model
    n_moe = m.layers - m.dense_layers if m.is_moe else 0
    od = layer_ops(cfg, tt, c, False)
    ideal = (m.layers - n_moe) * od["gemm_peak_s"] + od["head_gemm_peak_s"]
    secs = (m.layers - n_moe) * od["gemm_s"] + od["head_gemm_s"]
    if n_moe:
        om = layer_ops(cfg, tt, c, True)
        ideal, secs = ideal + n_moe * om["gemm_peak_s"], secs + n_moe * om["gemm_s"]
    return ideal / secs
