"""Sizes of many search candidates at once, as numpy arrays: per-rank parameter counts,
exact persistent state per pipeline stage, the layers and in-flight passes of each stage,
and the NCCL communicators. The bounds on the memory-timeline peak built from them are in
:mod:`meshplan.search.bounds`.

Sizes come from the functions the plan uses, called once per distinct key and broadcast
(:func:`lookup`): per-rank parameter counts of a layer by (tp, ep, etp)
(:func:`~meshplan.mesh.tpsplit.local_numel`), activation sizes by (tp, cp, micro-batch,
recompute, ep, etp) (:func:`~meshplan.memory.workingset.layer_act_sizes`, ``head_sizes``).
State is :func:`~meshplan.memory.state.state_bytes` exactly: per stage and parameter group,
``ceil(numel / shard degree) x bytes`` for every kind the sharding shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from meshplan.compute.routing import RoutingOptions
from meshplan.config import Config
from meshplan.memory.deepep_buffers import rank_buffer
from meshplan.memory import te_fp8
from meshplan.memory.workingset import head_sizes, layer_act_sizes
from meshplan.memory.wlag import head_norm_grad_bytes, layer_weight_grad_bytes
from meshplan.memory.offload import gpu_offloaded_kinds
from meshplan.memory.state import SHARDED_KINDS
from meshplan.mesh.layers import balanced_split, stage_layers
from meshplan.mesh.resolve import resolved_mesh
from meshplan.mesh.tpsplit import experts_apart_degrees, local_dim1, local_numel, local_rows, padded_vocab
from meshplan.pipeline.registry import get
from meshplan.search.candidate import megatron_split, sharding_training, stage_split, titan_split
from meshplan.search.key_codes import distinct_rows
from meshplan.search.columns import RECOMPUTE, SHARDING, V_CODES, ZB_H1_CODE, Candidates, candidate_schedule
from meshplan.spec.axes.base import Dim
from meshplan.spec.axes.registry import AXES, Axis, divisor, search_axes
from meshplan.spec.axes.tp_kv import qkv_gathered
from meshplan.spec.mesh import MeshSpec, Schedule
from meshplan.units import dtype_bytes

ACT_FIELDS = ("saved", "rework", "fwd_temp", "bwd_temp")
HEAD_FIELDS = ("embedding_saved", "head_saved", "logits_temp", "logits_grad_temp", "dy")


@dataclass(frozen=True)
class LayerNumel:
    """One layer kind on one rank: ``nonnorm`` (StageParams' layer count, experts included),
    ``norm``, ``expert`` elements; ``tensors``: (rows, elements, expert, gather bytes per
    element, dim 1 of a routed expert (:func:`~meshplan.mesh.tpsplit.local_dim1`, else 0)) per
    weight, local; ``dense_gather``, ``expert_gather``: the groups' bytes in the
    dtype FSDP2 all-gathers each weight in (``training.gather_dtype``: 1 for float8 Linear
    weights under ``fp8_all_gather``, else the compute dtype's); ``fp8``: the elements of
    Transformer Engine's fp8 weights (:func:`meshplan.memory.te_fp8.is_weight`, dense)."""

    nonnorm: int
    norm: int
    expert: int
    tensors: tuple
    dense_gather: int = 0
    expert_gather: int = 0
    fp8: int = 0

    @property
    def dense(self) -> int:
        """Elements of the dense group (norms included)."""
        return self.nonnorm + self.norm - self.expert


class Tables:
    """Per-config sizes by key, each computed once (see the module docstring)."""

    def __init__(self, cfg: Config):
        self.cfg, self.model, self.t = cfg, cfg.model, cfg.training
        m = self.model
        self.layer = lru_cache(maxsize=None)(self._layer)
        self.acts = lru_cache(maxsize=None)(self._acts)
        self.roots = lru_cache(maxsize=None)(self._roots)
        self.roots_gather = lru_cache(maxsize=None)(self._roots_gather)
        self.mesh = lru_cache(maxsize=None)(self._mesh)
        self.heads = lru_cache(maxsize=None)(self._heads)

    def _layer(self, tp: int, ep: int, etp: int, moe: bool) -> LayerNumel:
        m = self.model
        idx = m.dense_layers if moe else 0
        nonnorm = norm = expert = fp8 = 0
        tensors, gather = [], {False: 0, True: 0}
        for t in m.layer_tensors(idx):
            n, gb = local_numel(t, m, tp, ep, etp, self.t.framework), dtype_bytes(self.t.gather_dtype(t))
            tensors.append((local_rows(t, m, tp, ep, self.t.framework) or 0, n, t.expert, gb, local_dim1(t, etp)))
            gather[t.expert] += n * gb
            if "norm" in t.name:
                norm += n
            else:
                nonnorm += n
            expert += n if t.expert else 0
            fp8 += n if te_fp8.is_weight(self.t, t) and not t.expert else 0
        return LayerNumel(nonnorm, norm, expert, tuple(tensors), gather[False], gather[True], fp8)

    def _roots(self, tp: int) -> tuple:
        """(embedding elements, head norm elements, output elements, embedding tensors,
        head tensors) on one rank: tensors as (rows, elements, tied)."""
        m = self.model
        pv = padded_vocab(m.vocab, self.t.vocab_pad_divisor, tp)
        emb = [(local_rows(t, m, tp) or 0, local_numel(t, m, tp), False) for t in m.embedding_tensors(pv)]
        head = [(local_rows(t, m, tp) or 0, local_numel(t, m, tp), t.tied) for t in m.head_tensors(pv)]
        norm = sum(n for (_, n, _), t in zip(head, m.head_tensors(pv)) if "norm" in t.name)
        out = sum(n for (_, n, _), t in zip(head, m.head_tensors(pv)) if "norm" not in t.name)
        return sum(n for _, n, _ in emb), norm, out, tuple(emb), tuple(head)

    def _roots_gather(self, tp: int) -> dict[str, int]:
        """Bytes one rank all-gathers of the roots' tensors (``emb``, head ``norm`` and ``out``)
        in their gather dtypes (``training.gather_dtype``; :meth:`_roots`' element counts)."""
        m = self.model
        pv = padded_vocab(m.vocab, self.t.vocab_pad_divisor, tp)
        size = lambda ts: sum(local_numel(t, m, tp) * dtype_bytes(self.t.gather_dtype(t)) for t in ts)
        head = m.head_tensors(pv)
        return {"emb": size(m.embedding_tensors(pv)), "norm": size(t for t in head if "norm" in t.name),
                "out": size(t for t in head if "norm" not in t.name)}

    def _mesh(self, tp: int, cp: int, ep: int, etp: int):
        """A resolved mesh with these degrees (dp_shard 2 ep etp: FSDP on, every MoE axis fits)."""
        names, shape = ["dp_shard", "cp", "tp"], [2 * ep * etp, cp, tp]
        if self.model.is_moe:
            names, shape = names + ["ep", "etp"], shape + [ep, etp]
        return resolved_mesh(MeshSpec(names=names, shape=shape, sequence_parallel=tp > 1), 2 * ep * etp * cp * tp)

    def _heads(self, tp: int, cp: int, mb: int, ep: int, etp: int) -> dict:
        """:func:`~meshplan.memory.workingset.head_sizes` of a workload key (the recompute policy
        does not change them: one call for every policy)."""
        t = self.t.model_copy(update={"micro_batch": mb, "sharding": "zero3"})
        return head_sizes(self.model, t, self.mesh(tp, cp, ep, etp), self.cfg.memory)

    def _acts(self, tp: int, cp: int, mb: int, rc: int, ep: int, etp: int) -> dict:
        """Activation and head sizes of one workload key, bytes, flat: per layer kind
        (prefix ``d_`` dense, ``m_`` MoE) ``saved``, ``rework``, ``fwd``, ``bwd``, ``single``
        (1: one backward step holding the whole unsharded gradient), ``peak0`` and ``peakg``
        (largest running total of the layer's backward steps, without and with the weight
        gradients they write when the layer is FSDP-sharded), every ``head_sizes`` entry, ``d_wgrad`` and ``m_wgrad``:
        the output gradients a lagging W of a dense and an MoE layer holds (:func:`meshplan.memory.wlag.layer_weight_grad_bytes`),
        ``h_wgrad`` the final norm's (:func:`~meshplan.memory.wlag.head_norm_grad_bytes`)."""
        m = self.model
        mesh = self.mesh(tp, cp, ep, etp)
        # FSDP2's unsharded gradients, all of them (a DeepSpeed ZeRO-3 row moves most into its ipg
        # buffer: the lower bound leaves them out there, search.bounds._layer_peak)
        t = self.t.model_copy(update={"micro_batch": mb, "recompute": RECOMPUTE[rc], "sharding": "zero3",
                                      "zero3_engine": "fsdp2", "recompute_num_layers": None})
        opts = self.cfg.memory
        dense = layer_act_sizes(m, t, mesh, opts)
        moe = layer_act_sizes(m, t, mesh, opts, moe=True) if m.is_moe else dense
        out = dict(self.heads(tp, cp, mb, ep, etp), d_wgrad=layer_weight_grad_bytes(m, t, mesh),
                   m_wgrad=layer_weight_grad_bytes(m, t, mesh, moe=m.is_moe), h_wgrad=head_norm_grad_bytes(m, t, mesh))
        for prefix, a in (("d_", dense), ("m_", moe)):
            steps = tuple(getattr(a, "steps", ()) or ())
            peak0 = peakg = a.bwd_temp
            if steps:
                peak0, peakg, grads, freed = -1, -1, 0, 0
                for st in steps:
                    grads += st.grads
                    peak0, peakg = max(peak0, st.work - freed), max(peakg, st.work + grads - freed)
                    freed += st.frees
            out.update({prefix + "saved": a.saved, prefix + "rework": a.rework, prefix + "fwd": a.fwd_temp,
                        prefix + "bwd": a.bwd_temp, prefix + "single": int(not steps), prefix + "peak0": peak0,
                        prefix + "peakg": peakg})
        return out


def split(c: Candidates, dim: Dim) -> np.ndarray:
    """Ways ``dim`` is split on each candidate (int64, (candidates,)): the product of the
    degree columns of the searched axes that divide it (:func:`meshplan.spec.axes.registry.divisor`
    over the columns; the vectorised :func:`meshplan.compute.shapes.local_split`). ``sequence
    (SP)`` is not asked here: the search runs SP exactly where tp > 1."""
    cols = {str(a): col.column for a, col in search_axes()}
    ways = divisor(dim, lambda a: c.degree(cols[a]) if a in cols else 1)
    return np.broadcast_to(np.asarray(ways, dtype=np.int64), (len(c),))


def lookup(keys: list[np.ndarray], fn, fields: tuple[str, ...], dtype=np.int64) -> dict[str, np.ndarray]:
    """``fn(*key)`` once per distinct row of ``keys``, its attributes (or dict items)
    ``fields`` broadcast back to one array per field (distinct keys and each row's place:
    :func:`~meshplan.search.key_codes.distinct_rows`)."""
    at, inv = distinct_rows(keys)
    vals = [fn(*k) for k in at]
    rows = [[v[f] for f in fields] if isinstance(v, dict) else [getattr(v, f) for f in fields] for v in vals]
    table = np.array(rows, dtype=dtype).reshape(len(vals), len(fields)).T  # (fields, distinct keys)
    return {f: table[i][inv] for i, f in enumerate(fields)}


@dataclass
class Stages:
    """Per-stage arrays (candidates, pp) of one group of candidates with the same pp."""

    k: np.ndarray          # stage index
    first: np.ndarray      # stage 0 (embedding)
    last: np.ndarray       # the output layer's stage (head): pp-1, or 0 under a V
    n: np.ndarray          # layers of the stage
    n_moe: np.ndarray      # MoE layers of the stage
    n_chunk: np.ndarray    # layers of the stage's shortest chunk (virtual stage): n // vpp
    n_chunk_hi: np.ndarray  # layers of its longest chunk: ceil(n / vpp) (the Llama 3 split's uneven chunks)
    w: np.ndarray          # chunk passes in flight at the first backward (of one schedule run: memory)
    m: np.ndarray          # micro-batches per step (per candidate, broadcast)
    m_run: np.ndarray      # micro-batches per schedule run (training.pp_schedule_runs; m with one run)
    w_step: np.ndarray     # w of one schedule over all m micro-batches (the step-time bounds': valid for runs)
    vshape: np.ndarray     # a split-backward schedule, whose bounds keep the order-free terms only: the
    #                        V-shaped ZB-V, DualPipeV, and ZB-H1 (per candidate, broadcast)
    lag: np.ndarray        # ZB-H1: most micro-batches whose W lags their B (ZBH1.lagging_weights), else 0
    v_lag: np.ndarray      # ZB-V, DualPipeV: most chunk passes whose W lags their B (VShaped.lagging_weights), else 0


def stage_layout(cfg: Config, c: Candidates, p: int) -> Stages:
    """Layers, MoE layers and in-flight passes per stage of candidates with pp = ``p``
    (:func:`~meshplan.mesh.layers.stage_layers`; at vpp 1 the default split,
    :func:`~meshplan.search.candidate.stage_split`: balanced, Megatron-LM's first/last cut under
    ``framework = "megatron"``; :func:`~meshplan.mesh.layers.ends_short_split` where ``us`` (at vpp 1
    torchtitan's cut for a torchtitan file, :func:`~meshplan.search.candidate.torchtitan_cut`), with
    vpp > 1 too)."""
    L, D = cfg.model.layers, (cfg.model.dense_layers if cfg.model.is_moe else cfg.model.layers)
    k = np.arange(p)[None, :]
    v = c.vpp[:, None]
    n = np.full((len(c), p), L // p, dtype=np.int64)  # even chunks (vpp > 1 where pp divides the layers)
    # vpp 1: the candidate's default split (balanced, Megatron-LM's cut under megatron); past one
    # stage a layer (rule 'layers' rejects it) the balanced one
    split = stage_split(L, p, 1, first_last=megatron_split(cfg)) if p <= L else balanced_split(L, p)
    if split is not None:
        n = np.where(v == 1, np.array(split, dtype=np.int64)[None, :], n)
    for vv in np.unique(c.vpp[c.us > 0]).tolist():  # the Llama 3 split where the candidate has it
        short = stage_split(L, p, int(vv), True, megatron_split(cfg), titan_split(cfg))  # Llama 3's, torchtitan's
        if short is not None:
            n = np.where(((c.us > 0) & (c.vpp == vv))[:, None], np.array(short, dtype=np.int64)[None, :], n)
    start = np.cumsum(n, axis=1) - n
    ps = c.ps[:, None]
    if np.all(v == 1):
        n_dense = np.clip(D - start, 0, n)
    elif D >= L:
        n_dense = n
    else:
        n_dense = _dense_of_chunks(cfg, c, p)
    m = (cfg.training.global_batch // (c.mb * c.dp))[:, None]
    # training.pp_schedule_runs: memory is one run's (each starts from sharded parameters); a
    # single schedule over all m is never slower than the runs, so the time bounds keep it
    mr = np.maximum(m // (cfg.training.pp_schedule_runs if p > 1 else 1), 1)

    def in_flight(mm):
        # chunk passes in flight: the candidate's schedule's own count (1F1B with vpp 1, else
        # interleaved, or the V-shaped one its ps names)
        w = np.where(v == 1, get(candidate_schedule(1)).in_flight(p, mm, 1, k),
                     get(candidate_schedule(2)).in_flight(p, mm, v, k))
        for i in V_CODES:
            w = np.where(ps == i, get(candidate_schedule(2, i)).in_flight(p, mm, 2, k), w)
        # ZB-H1 (vpp 1): held from F to W, as the timeline counts it (meshplan.memory.schedule):
        # min(m, p) on every stage (ZBH1.in_flight)
        return np.where(ps == ZB_H1_CODE, get(candidate_schedule(1, ZB_H1_CODE)).in_flight(p, mm, 1, k), w)

    w = in_flight(mr)
    w_step = w if p == 1 or cfg.training.pp_schedule_runs == 1 else in_flight(m)
    # the output layer's stage: the last, or stage 0 under a V (the schedule's last_stage)
    last = np.where(np.isin(ps, V_CODES), k == 0, k == p - 1)
    return Stages(k=np.broadcast_to(k, n.shape), first=np.broadcast_to(k == 0, n.shape),
                  last=np.broadcast_to(last, n.shape), n=n, n_moe=n - n_dense, n_chunk=n // v,
                  n_chunk_hi=-(-n // v), w=w,
                  m=np.broadcast_to(m, n.shape), m_run=np.broadcast_to(mr, n.shape), w_step=w_step,
                  vshape=np.broadcast_to(ps > 0, n.shape),
                  lag=np.where(ps == ZB_H1_CODE, get(Schedule.ZB_H1).lagging_weights(p, mr, 1, k), 0),
                  v_lag=_v_lag(c.ps, mr[:, 0], p))


def _v_lag(ps: np.ndarray, mr: np.ndarray, p: int) -> np.ndarray:
    """(candidates, p) chunk passes whose W lags their B at once on each stage of the V-shaped rows
    (:meth:`~meshplan.pipeline.vshape.VShaped.lagging_weights` of the schedule's order, one schedule
    run of ``mr`` micro-batches: the timeline's lag, :func:`meshplan.memory.wlag.cooldown_lag_levels`),
    once per (schedule, micro-batches); 0 on the others and at pp 1."""
    out = np.zeros((len(ps), p), dtype=np.int64)
    for code in V_CODES if p > 1 else ():
        rows = ps == code
        for mm in np.unique(mr[rows]).tolist():
            out[rows & (mr == mm)] = _stage_lags(candidate_schedule(2, code), p, int(mm))
    return out


@lru_cache(maxsize=None)
def _stage_lags(schedule, p: int, m: int) -> tuple[int, ...]:
    """:func:`_v_lag` of one (schedule, pp, micro-batches): each stage's lagging chunk passes."""
    return tuple(int(get(schedule).lagging_weights(p, m, 2, s)) for s in range(p))


def _dense_of_chunks(cfg: Config, c: Candidates, p: int) -> np.ndarray:
    """Dense layers per stage (candidates, p) with vpp > 1: :func:`~meshplan.mesh.layers.stage_layers`
    of each distinct (vpp, schedule, split) key, its chunks in the schedule's virtual-stage map
    (the plan's own assignment), counted below the model's dense layers."""
    L, D = cfg.model.layers, cfg.model.dense_layers
    out = np.zeros((len(c), p), dtype=np.int64)
    keys = np.stack([c.vpp, c.ps, c.us], axis=1)
    for vv, ps, us in np.unique(keys, axis=0).tolist():
        rows = (c.vpp == vv) & (c.ps == ps) & (c.us == us)
        chunks = stage_layers(L, p, vv, stage_split(L, p, vv, bool(us), megatron_split(cfg), titan_split(cfg)),
                              virtual_stage=get(candidate_schedule(vv, ps)).virtual_stage)
        if isinstance(chunks, str):  # rejected by the layers rule: nothing to count
            continue
        out[rows] = [sum(1 for ch in st for layer in ch if layer < D) for st in chunks]
    return out


def _ceil_div(a, b):
    return -(-a // b)


def _kind_bytes(t) -> dict[str, int]:
    """Bytes per element of each state kind (:mod:`meshplan.memory.state`)."""
    per = {"params": dtype_bytes(t.param_dtype), "grads": dtype_bytes(t.grad_dtype),
           "master": t.master_bytes, "optimizer": t.optimizer_states * dtype_bytes(t.optimizer_dtype)}
    return {k: 0 if k in gpu_offloaded_kinds(t) else b for k, b in per.items()}  # ZeRO-Offload: on the host


def state(cfg: Config, tables: Tables, c: Candidates, st: Stages) -> dict[str, np.ndarray]:
    """Exact persistent state per stage (bytes, (candidates, pp)): ``total`` (with ``BF16_Optimizer``'s
    bf16 gradients where a row runs it), ``params``, ``grads``, ``master``, ``optimizer``, ``params_numel``, the two groups' element counts and
    ``chunk0_dense_numel_min``, the fewest dense elements the stage's first chunk can hold."""
    m, t = cfg.model, cfg.training
    col = lambda a: a[:, None]
    fields = ("nonnorm", "norm", "expert", "dense", "fp8")
    dl = lookup([c.tp, c.ep, c.etp, np.zeros_like(c.tp)], tables.layer, fields)
    ml = lookup([c.tp, c.ep, c.etp, np.ones_like(c.tp)], tables.layer, fields) \
        if m.is_moe else {k: np.zeros_like(v) for k, v in dl.items()}
    rt = lookup([c.tp], lambda tp: dict(zip(("emb", "norm", "out"), tables.roots(tp)[:3])), ("emb", "norm", "out"))
    n_d = st.n - st.n_moe
    out_on = col(rt["out"]) * ((not m.tied_embeddings) or (st.k.shape[1] > 1))
    dense = (n_d * col(dl["dense"]) + st.n_moe * col(ml["dense"]) + st.first * col(rt["emb"])
             + st.last * (col(rt["norm"]) + out_on))
    expert = st.n_moe * col(ml["expert"])
    # chunk 0's dense elements at least: its fewest layers at the smaller kind's and stage 0's embedding
    layer_min = np.minimum(dl["dense"], ml["dense"]) if m.is_moe else dl["dense"]
    chunk0 = st.n_chunk * col(layer_min) + st.first * col(rt["emb"])
    # bytes per element under each row's own training (a DeepSpeed config's hsdp rows keep
    # FSDP2's fp32 gradients, its zero1/zero2 rows DeepSpeed's: search.candidate.sharding_training)
    per_sh = [_kind_bytes(sharding_training(t, s)) for s in SHARDING]
    per = {kind: col(np.array([p[kind] for p in per_sh])[c.sh]) for kind in per_sh[0]}
    sharded = np.array([SHARDED_KINDS[s] for s in SHARDING], dtype=object)
    out = {"total": 0, "params": 0, "grads": 0, "master": 0, "optimizer": 0, "grads_dense": 0, "grads_expert": 0,
           "dense_numel": dense, "expert_numel": expert, "chunk0_dense_numel_min": chunk0,
           "params_numel": dense + expert}
    divs = {"dense": col(c.fsdp), "expert": col(c.efsdp)}
    for group, numel in (("dense", dense), ("expert", expert)):
        for kind, b in per.items():
            if not b.any():
                continue
            on = col(np.array([kind in s for s in sharded])[c.sh])
            size = _ceil_div(numel, np.where(on, divs[group], 1)) * b
            out["total"] = out["total"] + size
            out[kind] = out[kind] + size
            if kind == "grads":
                out[f"grads_{group}"] = size
    # DeepSpeed's BF16_Optimizer rows: the bf16 gradients beside the fp32 ones, whole (memory.buffers.bf16_lp_grad_bytes)
    lp = col(np.array([sharding_training(t, s).bf16_optimizer for s in SHARDING])[c.sh])
    out["total"] = out["total"] + lp * (dense + expert) * dtype_bytes(t.param_dtype)
    if te_fp8.applies(t):  # TE's fp8 weights: parameters at 1 B under --fp8-param-gather, and their cache
        saved, cache = te_fp8.stage_bytes(n_d * col(dl["fp8"]) + st.n_moe * col(ml["fp8"]), fp8_param_rows(cfg, c)[:, None],
                                          dtype_bytes(t.param_dtype), cfg.cluster.gpu.cuda_sm)
        out |= {"params": out["params"] - saved, "total": out["total"] - saved + cache}
    return out


def fp8_param_rows(cfg: Config, c: Candidates) -> np.ndarray:
    """Whether each candidate keeps Transformer Engine's fp8 weights as fp8 parameters
    (``--fp8-param-gather``, :mod:`meshplan.memory.te_fp8`): the config's, on its zero1 rows
    (:func:`meshplan.search.candidate._training_knobs` turns it off on the others)."""
    t = cfg.training
    return (c.sh == SHARDING.index("zero1")) & (t.fp8_param_gather and te_fp8.applies(t))


def comm_axes(cfg: Config, c: Candidates) -> np.ndarray:
    """NCCL communicators per rank: distinct axis names with collective rows in the plan's
    stage tables (:func:`meshplan.comm.collectives.collective_table`, named as
    :meth:`meshplan.mesh.resolve.Mesh.display_name` names them: fsdp is ``dp_shard`` or ``cp``
    when it stands for one axis; ``kv_replica`` when tp > kv_heads), one more for each
    searched axis of degree > 1 that builds its own rows (:attr:`~meshplan.spec.axes.base.AxisDef.rows`)."""
    moe = cfg.model.is_moe
    fsdp_name = np.where((c.dps > 1) & (c.cp > 1), 3, np.where(c.dps > 1, 2, 1))  # fsdp / dp_shard / cp
    n = (c.tp > 1).astype(np.int64) + (c.pp > 1) + (c.ep > 1)
    n += (c.cp > 1) | ((c.fsdp > 1) & (fsdp_name == 1))
    n += (c.fsdp > 1) & (fsdp_name != 1)
    # the experts' own rows over efsdp, only where they are apart from their layer (ep > 1, or
    # efsdp not fsdp's group: mesh.tpsplit.experts_apart_degrees), under every engine: FSDP2
    # gathers them with the layer, Megatron-LM's DDP buffers reduce them with the dense ones
    n += moe & (c.efsdp > 1) & experts_apart_degrees(c.ep, c.efsdp, c.fsdp)
    n += (c.sh == SHARDING.index("hsdp")) & (c.dpr > 1)
    # Megatron-LM's etp all-gather and reduce-scatter of the dispatched tokens run over its own
    # expert tensor-parallel group (_EXPERT_TENSOR_PARALLEL_GROUP, megatron/core/parallel_state.py:1381 at
    # d98e8a6; comm.ep_rows._etp_rows), even where its ranks are tp's
    t = cfg.training
    megatron, deepep = moe & (t.framework == "megatron"), t.moe_dispatcher == "deepep"
    n += megatron & (not deepep) & (c.etp > 1)
    # and at ep 1 where etp > 1 the tp_ep group's (_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP,
    # parallel_state.py:1388-1396; the table's ep rows): the dropless count exchange's, or DeepEP's
    # dispatch and combine (comm.ep_rows._count_rows, _deepep_rows)
    n += megatron & (deepep or RoutingOptions.of(t).dropless) & (c.ep == 1) & (c.etp > 1)
    kv = cfg.model.n_kv_heads  # KV heads replicated: the kv_replica all-reduces' groups (not Megatron's, tp_kv)
    n += (c.tp > kv) & ~qkv_gathered(cfg.training.framework, c.tp, kv)
    for axis, col in search_axes():  # an axis with its own row builder (cp's are counted above): its rows' group
        if AXES[axis].rows is not None and axis != Axis.CP:
            n += c.degree(col.column) > 1
    return n


def deepep_bytes(cfg: Config, c: Candidates, st: Stages) -> np.ndarray:
    """DeepEP's buffer, bytes (candidates, pp), held from init on the stages with MoE layers under
    ``training.moe_dispatcher = "deepep"`` (:func:`meshplan.memory.deepep_buffers.rank_buffer`: one
    per ep x etp group size); 0 elsewhere and where DeepEP has no config for the size (the ep axis's
    ``deepep_group`` rule drops those rows)."""
    t, m = cfg.training, cfg.model
    if t.moe_dispatcher != "deepep" or not m.is_moe:
        return np.zeros_like(st.n_moe)

    def one(ep: int, etp: int) -> int:
        b = rank_buffer(m, t, ep, etp, True)
        return b.total_bytes if b is not None else 0
    sizes = {k: one(*k) for k in set(zip(c.ep.tolist(), c.etp.tolist()))}
    per_row = np.array([sizes[k] for k in zip(c.ep.tolist(), c.etp.tolist())], dtype=np.int64)
    return np.where(st.n_moe > 0, per_row[:, None], 0)
