"""A lower bound on the predicted step time of many search candidates at once, and the
efficiency of their local GEMMs, as numpy arrays.

The bound uses the same numbers as :func:`meshplan.steptime.step_time`: op times from
:func:`meshplan.compute.layer_cost` (one call per distinct (tp, cp, micro-batch,
recompute, ep, etp)), collective times from :func:`meshplan.comm.ring_time` on the path
:func:`meshplan.collectives.axis_path` gives each axis (one call per distinct (stride,
degree): with the canonical order and node-major placement an axis's groups are ranks
``r0 + i * stride``), with the sizes of :func:`meshplan.collectives.collective_table`.
It keeps only what the simulation (:mod:`meshplan.rank_timeline`, default
:class:`~meshplan.rank_timeline.Overlap`) cannot avoid, so it never exceeds it:

- a layer's **chain**: every compute op in order, the blocking TP collectives before and
  after each block (with SP the all-gather and reduce-scatter, else the all-reduce), the
  blocking EP all-to-alls, the CP exchange as ``max(attention, ring)``, the backward's
  weight-gradient GEMMs as ``max(W, reduce-scatter)``, full recompute's forward replay;
- a **unit** (one micro-batch through a chunk of n layers): ``max(AG + n chain,
  n AG + chain)`` forward, ``max(AG + n chain, n AG + (n-2) RS + chain)`` backward, where
  AG, RS are the FSDP all-gather and reduce-scatter of one layer, serial on their stream
  (FSDP2 prefetches one layer; the layer waits for its gather); plus the embedding and the
  head (and the loss collectives) where the chunk holds them;
- the **pipeline**: stage k cannot start before micro-batch 0 went forward through stages
  0..k-1 (each unit + one p2p send), runs all its units one after another, and stage 0
  cannot end before micro-batch m-1's gradient came back through stages k-1..0; the
  bound is the largest over k of ``fill_k + busy_k`` plus the larger of stage k's own
  end (optimizer step at HBM bandwidth, ZeRO-1's exposed parameter all-gather and its
  gradient reduce-scatter issued after the last unit's first layer) and ``drain_k +`` stage
  0's end.

Middle stages (every stage but the last) use stage 0's collective table, as
:func:`~meshplan.steptime.step_time` does. Tests check ``bound <= step_time`` on every
feasible candidate of small worlds; the search ranks by the exact step time and uses the
bound only to decide what it need not simulate.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .collectives import axis_path
from .comm import NCCL_RING
from .compute import Workload, embedding_cost, head_cost, layer_cost
from .mesh import resolve_mesh
from .placement import place
from .rank_timeline import LAYER_BLOCKS
from .search_memory import Stages, Tables, lookup
from .search_space import RECOMPUTE, SHARDING, Candidates
from .spec.config import Config
from .spec.mesh import MeshSpec
from .tpsplit import local_heads
from .units import dtype_bytes

PHASES = {"f": ("forward", None), "bi": ("backward_input", None), "bin": ("backward_input", False),
          "br": ("backward_input", True), "bw": ("backward_weight", None)}
OP_FIELDS = tuple(f"{p}_{b}" for p in PHASES for b in LAYER_BLOCKS)
EXTRA_FIELDS = ("emb_f", "emb_bw", "head_f", "head_b", "gemm_flops", "gemm_s")


class TimeTables:
    """Op times by workload key and collective paths by (stride, degree), each once."""

    def __init__(self, cfg: Config, tables: Tables):
        self.cfg, self.tables = cfg, tables
        self.world = cfg.cluster.world
        self.placement = place(cfg.cluster, self.world)
        self.ops = lru_cache(maxsize=None)(self._ops)
        self.path = lru_cache(maxsize=None)(self._path)

    def _ops(self, tp: int, cp: int, mb: int, rc: int, ep: int, etp: int, moe: int) -> dict:
        cfg, m = self.cfg, self.cfg.model
        t, gpu = cfg.training, cfg.cluster.gpu
        w = Workload(seq_len=t.seq_len, micro_batch=mb, tp=tp, cp=cp, sp=tp > 1, ep=ep, etp=etp,
                     dtype=t.compute_dtype, recompute=RECOMPUTE[rc], flash=t.flash_attention,
                     vocab_pad_divisor=t.vocab_pad_divisor)
        layer = m.dense_layers if moe else 0
        cost = layer_cost(m, gpu, w, layer=layer)
        out = {f"{p}_{b}": cost.seconds(ph, b, rec) for p, (ph, rec) in PHASES.items() for b in LAYER_BLOCKS}
        emb, head = embedding_cost(m, gpu, w), head_cost(m, gpu, w)
        out.update(emb_f=emb.seconds("forward"), emb_bw=emb.seconds("backward_weight"),
                   head_f=head.seconds("forward"), head_b=head.backward_s)
        gemms = [o for o in cost.ops + head.ops if o.kind == "gemm" and not o.recompute]
        out.update(gemm_flops=sum(o.hardware_flops for o in gemms if o.block != "head"),
                   gemm_s=sum(o.seconds for o in gemms if o.block != "head"),
                   head_gemm_flops=sum(o.hardware_flops for o in gemms if o.block == "head"),
                   head_gemm_s=sum(o.seconds for o in gemms if o.block == "head"))
        return out

    def _path(self, stride: int, degree: int) -> tuple[float, float, float]:
        """(bandwidth bytes/s, network 0/1, latency scale) of an axis of ``degree`` ranks
        ``stride`` apart, from :func:`~meshplan.collectives.axis_path` on a three-axis mesh
        (outer, axis, inner) with the same groups."""
        if degree <= 1:
            return float("inf"), 0.0, 1.0
        outer = self.world // (stride * degree)
        mesh = resolve_mesh(MeshSpec(names=["outer", "axis", "inner"], shape=[outer, degree, stride]), self.world)
        p = axis_path(mesh, self.placement, self.cfg.cluster, "axis")
        return p.bandwidth_bytes_per_s, float(p.kind == "network"), p.latency_scale


def ring_times(op: str, n: np.ndarray, size: np.ndarray, path: dict) -> np.ndarray:
    """:func:`meshplan.comm.ring_time` on arrays (0 where n <= 1 or size <= 0)."""
    n = np.asarray(n, dtype=np.float64)
    if op == "all-reduce":
        factor, steps = 2 * (n - 1) / np.maximum(n, 1), 2 * (n - 1)
    elif op == "send/recv":
        factor, steps = np.ones_like(n), np.ones_like(n)
    else:
        factor, steps = (n - 1) / np.maximum(n, 1), n - 1
    sent = factor * size
    best = None
    for p in NCCL_RING:
        step = np.where(path["net"] > 0, p.step_network_s, p.step_nvlink_s)
        t = p.base_s + steps * path["scale"] * step + sent / (path["bw"] * p.efficiency)
        best = t if best is None else np.minimum(best, t)
    return np.where((n <= 1) | (size <= 0), 0.0, best)


def _paths(tt: TimeTables, stride: np.ndarray, degree: np.ndarray) -> dict:
    """Path arrays (``bw``, ``net``, ``scale``) of axes given by stride and degree."""
    return lookup([stride, degree], lambda s, d: dict(zip(("bw", "net", "scale"), tt.path(s, d))),
                  ("bw", "net", "scale"), dtype=np.float64)


def comm_times(cfg: Config, tt: TimeTables, c: Candidates) -> dict[str, np.ndarray]:
    """Seconds per call of each collective the bound uses, per candidate (sizes of
    :func:`meshplan.collectives.collective_table`)."""
    m, t = cfg.model, cfg.training
    cd, rd = dtype_bytes(t.compute_dtype), dtype_bytes(t.reduce_dtype)
    sp = c.tp > 1
    act = c.mb * (t.seq_len // c.cp) * m.hidden * cd
    tp_path = _paths(tt, np.ones_like(c.tp), c.tp)
    kv_l = np.array([local_heads(m, int(x))[1] for x in c.tp])
    kv = 2 * c.mb * t.seq_len * kv_l * m.d_head * cd
    cp_path = _paths(tt, c.tp, c.cp)
    fs_path = _paths(tt, c.tp, c.fsdp)
    out = {"tp_sp": np.where(sp, ring_times("all-gather", c.tp, act, tp_path), 0.0),
           "tp_ar": np.where(sp, 0.0, ring_times("all-reduce", c.tp, act, tp_path)),
           "loss": 3 * ring_times("all-reduce", c.tp, c.mb * (t.seq_len // c.cp) * 4, tp_path),
           "cp_ag": ring_times("all-gather", c.cp, kv, cp_path),
           "cp_rs": ring_times("reduce-scatter", c.cp, kv, cp_path),
           "p2p": ring_times("send/recv", c.pp, act // np.where(sp, c.tp, 1),
                             _paths(tt, c.dpr * c.dps * c.cp * c.tp, c.pp))}
    on = (c.sh == SHARDING.index("zero3")) | (c.sh == SHARDING.index("hsdp"))
    unit = _padded_unit(tt.tables, c)
    out["fsdp_ag"] = np.where(on, ring_times("all-gather", c.fsdp, unit * cd, fs_path), 0.0)
    out["fsdp_rs"] = np.where(on, ring_times("reduce-scatter", c.fsdp, unit * rd, fs_path), 0.0)
    if m.is_moe:
        a2a = act * m.top_k * c.etp // c.tp
        out["ep"] = ring_times("all-to-all", c.ep, a2a, _paths(tt, c.etp, c.ep))
    else:
        out["ep"] = np.zeros(len(c))
    out["fs_path"] = fs_path
    return out


def _padded_unit(tables: Tables, c: Candidates) -> np.ndarray:
    """Elements of one dense layer's FSDP unit on one rank, dim 0 padded to the shard
    degree (:func:`~meshplan.tpsplit.fsdp_padded_numel`); the dense layer of MoE models
    with dense layers, else the MoE layer's non-expert part."""
    moe = int(tables.model.is_moe and tables.model.dense_layers == 0)

    def padded(tp, ep, etp, shards):
        return sum(-(-r // shards) * shards * (n // r) for r, n, expert in tables.layer(tp, ep, etp, moe).tensors
                   if r and not expert)
    return lookup([c.tp, c.ep, c.etp, c.fsdp], lambda *k: {"n": padded(*k)}, ("n",))["n"]


def layer_ops(cfg: Config, tt: TimeTables, c: Candidates, moe: bool) -> dict[str, np.ndarray]:
    """Op seconds per block and phase of one layer kind (``f_attn``, ``bw_mlp``...), and
    the embedding, head and GEMM totals, per candidate."""
    k = [c.tp, c.cp, c.mb, c.rc, c.ep, c.etp, np.full(len(c), int(moe))]
    return lookup(k, tt.ops, OP_FIELDS + EXTRA_FIELDS + ("head_gemm_flops", "head_gemm_s"), dtype=np.float64)


def chains(c: Candidates, o: dict, cm: dict, moe: bool) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) chain of one layer, seconds (module docstring)."""
    pre, post = cm["tp_sp"], np.maximum(cm["tp_sp"], cm["tp_ar"])
    e = cm["ep"] if moe else 0.0

    def forward(p):
        return (o[f"{p}_attn_pre"] + np.maximum(pre + o[f"{p}_attn"], cm["cp_ag"]) + post + o[f"{p}_attn_post"]
                + o[f"{p}_mlp_pre"] + pre + e + o[f"{p}_mlp"] + e + post + o[f"{p}_mlp_post"])
    full = c.rc == RECOMPUTE.index("full")
    b = {blk: np.where(full, o[f"bin_{blk}"], o[f"bi_{blk}"]) for blk in LAYER_BLOCKS}
    back = (b["mlp_post"] + pre + e + b["mlp"] + np.maximum(o["bw_mlp"], post + e) + b["mlp_pre"] + b["attn_post"]
            + np.maximum(pre + b["attn"], cm["cp_rs"]) + np.maximum(o["bw_attn"], post) + b["attn_pre"])
    return forward("f"), back + np.where(full, forward("br"), 0.0)


def step_lower_bound(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict) -> np.ndarray:
    """Lower bound of :func:`meshplan.steptime.step_time` per candidate, seconds; ``st``,
    ``s``: :func:`~meshplan.search_memory.stage_layout` and ``state`` of the same group."""
    m = cfg.model
    col = lambda a: np.asarray(a)[:, None]
    cm = comm_times(cfg, tt, c)
    od = layer_ops(cfg, tt, c, False)
    fd, bd = chains(c, od, cm, False)
    if m.is_moe:
        om = layer_ops(cfg, tt, c, True)
        fm, bm = chains(c, om, cm, True)
        f0m, b0m = chains(c, om, {**cm, "ep": np.zeros(len(c))}, True)
        # step_time gives every stage but the last stage 0's collective table: the EP
        # all-to-alls exist there only when stage 0 holds MoE layers
        ep_on = np.where(st.k < st.k.shape[1] - 1, st.n_moe[:, :1] > 0, st.n_moe > 0)
        fm, bm = np.where(ep_on, col(fm), col(f0m)), np.where(ep_on, col(bm), col(b0m))
        has_d, has_m = (st.n - st.n_moe) > 0, st.n_moe > 0
        pick = lambda d, x: np.where(has_d & has_m, np.minimum(col(d), x), np.where(has_m, x, col(d)))
        cf, cb = pick(fd, fm), pick(bd, bm)
    else:
        cf, cb = col(fd), col(bd)
    n = st.n_chunk
    ag, rs = col(cm["fsdp_ag"]), col(cm["fsdp_rs"])
    f_core = np.maximum(ag + n * cf, n * ag + cf)
    b_core = np.maximum(ag + n * cb, n * ag + np.maximum(n - 2, 0) * rs + cb)
    pre, post = col(cm["tp_sp"]), col(np.maximum(cm["tp_sp"], cm["tp_ar"]))
    v = col(c.vpp)
    emb_f, emb_b = st.first * (col(od["emb_f"]) + post), st.first * col(od["emb_bw"])
    head_f = st.last * (pre + col(od["head_f"]) + col(cm["loss"]))
    head_b = st.last * (col(od["head_b"]) + post)
    busy = st.m * (v * (f_core + b_core) + emb_f + emb_b + head_f + head_b)
    one = (v == 1)
    f0 = f_core + emb_f + one * head_f       # chunk 0's forward unit on each stage
    b0 = b_core + emb_b + one * head_b       # chunk 0's backward unit on each stage
    p2p = col(cm["p2p"])
    fill = np.cumsum(f0 + p2p, axis=1) - (f0 + p2p)
    drain = np.cumsum(b0 + p2p, axis=1) - (b0 + p2p)
    end, red = _stage_end(cfg, tt, c, st, s, cm)
    tail = np.maximum(one * head_b + ag + cb + red - b0, 0.0)
    own = fill + busy + tail + end
    via0 = fill + busy + drain + tail[:, :1] + end[:, :1]
    out = np.maximum(own, via0).max(axis=1)
    # 1F1B: micro-batch 0 forward through every stage and back to stage k, then stage k's
    # units after its first backward ((m - 1) B and (m - w) F), then micro-batch m-1's
    # gradient back to stage 0.
    path = (f0.sum(axis=1, keepdims=True) + b0.sum(axis=1, keepdims=True) + (st.m - 1) * b0
            + (st.m - st.w) * f0 + 2 * (st.k.shape[1] - 1) * p2p)
    one_f = np.maximum(path + tail[:, :1] + end[:, :1], path - drain + tail + end).max(axis=1)
    return np.where(c.vpp == 1, np.maximum(out, one_f), out)


def _stage_end(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict, cm: dict):
    """(optimizer step + ZeRO-1's exposed parameter all-gather, ZeRO-1's gradient
    reduce-scatter) per stage, seconds (:func:`meshplan.steptime._stage_end`)."""
    t, gpu = cfg.training, cfg.cluster.gpu
    opt = (2 * s["total"] - s["grads"]) / gpu.hbm_bandwidth_bytes_per_s
    zero1 = (c.sh == SHARDING.index("zero1"))[:, None]
    numel = np.where(st.last, s["dense_numel"], s["dense_numel"][:, :1])  # stage 0's table for the others
    n = np.broadcast_to(c.fsdp[:, None], numel.shape).ravel()
    path = {k: np.repeat(v, numel.shape[1]) for k, v in cm["fs_path"].items()}
    gather = ring_times("all-gather", n, numel.ravel() * dtype_bytes(t.param_dtype), path).reshape(numel.shape)
    red = ring_times("reduce-scatter", n, numel.ravel() * dtype_bytes(t.reduce_dtype), path).reshape(numel.shape)
    return opt + np.where(zero1, gather, 0.0), np.where(zero1, red, 0.0)


def gemm_efficiency(cfg: Config, tt: TimeTables, c: Candidates) -> np.ndarray:
    """FLOP-weighted efficiency of a step's local GEMMs per candidate: every layer's
    forward, data- and weight-gradient GEMMs and the output layer's, as
    :func:`meshplan.gemm.gemm_model` times them: ``sum FLOP / (sum seconds x peak)``."""
    m = cfg.model
    peak = cfg.cluster.gpu.peak_flops(cfg.training.compute_dtype)
    n_moe = m.layers - m.dense_layers if m.is_moe else 0
    od = layer_ops(cfg, tt, c, False)
    flops = (m.layers - n_moe) * od["gemm_flops"] + od["head_gemm_flops"]
    secs = (m.layers - n_moe) * od["gemm_s"] + od["head_gemm_s"]
    if n_moe:
        om = layer_ops(cfg, tt, c, True)
        flops, secs = flops + n_moe * om["gemm_flops"], secs + n_moe * om["gemm_s"]
    return flops / (secs * peak)
