"""One layer's lower-bound chain, per candidate: its op times (:func:`layer_ops`), its chain of
compute and blocking collectives (:func:`chains`; per stage: :func:`stage_chains`) and the
FLOP-weighted GEMM efficiency of a step (:func:`gemm_efficiency`). The unit bounds built on
them are :mod:`meshplan.search.layer_bounds`'s; the module docstring of
:mod:`meshplan.search.timing` states what they keep.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from meshplan.compute.kernel_choices import framework_kernels
from meshplan.compute.recompute import op_replays_ep
from meshplan.config import Config
from meshplan.schedule.layer_timeline import LAYER_BLOCKS
from meshplan.search.columns import bound_recompute
from meshplan.search.memory import Stages, lookup, split
from meshplan.search.space import RECOMPUTE, Candidates
from meshplan.search.time_tables import EXTRA_FIELDS, OP_FIELDS, TimeTables
from meshplan.spec.axes.base import Dim

def layer_ops(cfg: Config, tt: TimeTables, c: Candidates, moe: bool) -> dict[str, np.ndarray]:
    """Op seconds per block and phase of one layer kind (``f_attn``, ``bw_mlp``...), and
    the embedding, head and GEMM totals, per candidate."""
    # the layer whose costs stand for the kind: 0 for dense, the first MoE layer for MoE (the
    # same layer 0 when every layer is MoE: one call per key for both kinds)
    # (per-layer AC, ``layer``, as ``none``: no layer replayed; unit_bounds asks again with
    # ``full`` for the layers it replays)
    k = [split(c, Dim.HEADS), split(c, Dim.SEQUENCE), c.mb, bound_recompute(c.rc, "none"), split(c, Dim.EXPERTS),
         split(c, Dim.EXPERT_FFN), np.full(len(c), cfg.model.dense_layers if moe else 0)]
    return lookup(k, tt.ops, OP_FIELDS + EXTRA_FIELDS + ("head_gemm_peak_s", "head_gemm_s"), dtype=np.float64)


class _Terms(NamedTuple):
    """The collectives' seconds in one layer's chain, per candidate (:func:`_terms`): ``pre`` /
    ``post`` the attention block's opening (all-gather) and closing (reduce-scatter or all-reduce)
    tp collectives, ``pre_mlp`` / ``post_mlp`` the MLP block's; ``e`` / ``e_out`` the EP calls
    before and after the expert GEMMs; ``amax_f`` / ``amax_b`` float8 TP's amax all-reduces;
    ``qkv_ag`` / ``qkv_rs`` Megatron's QKV sub-sharding collectives; ``cp_ag`` / ``cp_rs`` the K/V
    all-gather and dK/dV reduce-scatter; ``x`` the ring attention's dK/dV shift (``ring`` where >
    0; ``cp_n`` shifts); ``kv`` / ``kv2`` Transformer Engine's p2p ring sends, ``n`` = cp - 1 of
    them; ``te_ag`` 1 under Megatron-LM's all-gather CP; ``kvs`` torch's ring K/V shift under
    ``cp_rotate = "alltoall"``, ``n`` of them in forward each beside one step (ring_timeline.a2a_forward)."""

    pre: np.ndarray
    post: np.ndarray
    pre_mlp: np.ndarray
    post_mlp: np.ndarray
    e: np.ndarray | float
    e_out: np.ndarray | float
    amax_f: np.ndarray | float
    amax_b: np.ndarray | float
    qkv_ag: np.ndarray | float
    qkv_rs: np.ndarray | float
    cp_ag: np.ndarray
    cp_rs: np.ndarray
    cp_n: np.ndarray | float
    x: np.ndarray | float
    ring: np.ndarray
    kv: np.ndarray | float
    kv2: np.ndarray | float
    n: np.ndarray
    te_ag: np.ndarray | float
    kvs: np.ndarray | float = 0.0


def _terms(c: Candidates, cm: dict, moe: bool) -> _Terms:
    """:class:`_Terms` from the candidates' collective seconds ``cm``
    (:func:`~meshplan.search.comm_bounds.comm_times`)."""
    pre, post = cm["tp_ag"], np.maximum(cm["tp_sp"], cm["tp_ar"])
    pre_mlp, post_mlp_tp = (pre * cm["moe_mlp_tp"], post * cm["moe_mlp_tp"]) if moe else (pre, post)
    # the EP calls before the expert GEMMs (dispatch, etp all-gather) and after them (etp
    # reduce-scatter, combine: comm_bounds.comm_times)
    e, e_out = (cm["ep"], cm["ep_out"]) if moe else (0.0, 0.0)
    # float8 TP: the casts wait for their amaxes' tp all-reduces (layer_waits.amax_wait), the
    # forward's again in a replay (full and op-level AC); none in MoE models
    amax_f, amax_b = (0.0, 0.0) if moe else (cm["amax_f"], cm["amax_b"])
    # Megatron's QKV sub-sharding (tp > kv_heads): its all-gather and reduce-scatter block the
    # compute stream, with or without tp_comm_overlap (layer_waits.qkv_gather)
    qkv_ag, qkv_rs = cm.get("tp_qkv_ag", 0.0), cm.get("tp_qkv_rs", 0.0)
    x = cm.get("cp_x", 0.0)  # torch's ring attention's dK/dV shift (schedule.ring_timeline), 0 under all-gather CP
    # Transformer Engine's p2p ring (ring_timeline.p2p_steps): each send beside one step of s seconds
    # exposes max(send - s, 0); forward cp - 1 K/V sends, backward one K/V, cp - 2 K/V with dK/dV,
    # one dK/dV, and a selective recompute's replay (steps of r seconds) cp - 1 K/V sends again
    kv, kv2, n = cm.get("cp_kv", 0.0), cm.get("cp_kv2", 0.0), np.maximum(c.cp - 1, 0)
    te_ag = cm.get("cp_te_ag", 0.0)  # Megatron-LM's all-gather CP: no Q projection apart, TE's gathers exposed
    return _Terms(pre, post, pre_mlp, post_mlp_tp, e, e_out, amax_f, amax_b, qkv_ag, qkv_rs, cm["cp_ag"],
                  cm["cp_rs"], cm.get("cp_n", 0), x, np.asarray(x) > 0, kv, kv2, n, te_ag, cm.get("cp_kvs", 0.0))


def _p2p(send, step, k):
    """Seconds ``k`` ring sends of ``send`` seconds expose, each beside one step of ``step``
    seconds: ``k max(send - step, 0)`` (ring_timeline.p2p_steps)."""
    return k * np.maximum(send - step, 0.0)


def chains(c: Candidates, o: dict, cm: dict, moe: bool, serial: bool | np.ndarray = False,
           shared_beside: bool = False, op_ep: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) chain of one layer, seconds (module docstring). ``serial`` (per
    candidate): a block's input-gradient TP collective is issued after its weight gradients and
    the next block waits for it (layer_timeline._block_backward without ``Overlap.tp`` or
    ``tp_grad``: torch, with or without tp_comm_overlap), so the two add up; otherwise the collective may
    run beside the weight gradients (the larger of the two). An MoE layer's MLP block opens and
    closes with the tp collectives only where ``cm["moe_mlp_tp"]`` (1/0 per candidate,
    :func:`~meshplan.search.comm_bounds.comm_times`: as the rank timeline issues them). ``shared_beside``: the
    shared experts run beside the forward's EP combine (torchtitan's DeepEPMoE,
    :func:`meshplan.comm.deepep.shared_forward_s`): the block lasts ``(mlp - shared) + max(shared,
    combine)``, at least ``max(mlp, combine)``, which stands for ``mlp + combine``. ``op_ep``: an op-level
    SAC replay issues the EP all-to-alls again (:func:`meshplan.compute.recompute.op_replays_ep`)."""
    k = _terms(c, cm, moe)
    forward = lambda p, post_mlp=k.post_mlp, post_attn=k.post, ep_in=k.e, ep_out=k.e_out: _forward_chain(
        c, o, k, shared_beside, p, post_mlp, post_attn, ep_in, ep_out)
    # op-level selective AC replays its recomputed ops before the layer's backward, as full does
    full = (c.rc == RECOMPUTE.index("full")) | (c.rc == RECOMPUTE.index("op"))
    b = {blk: np.where(full, o[f"bin_{blk}"], o[f"bi_{blk}"]) for blk in LAYER_BLOCKS + ("cpq", "cps", "cpr")}
    back = _backward_chain(c, o, k, b, serial)
    # compiled torch's full AC replays no MLP closing collective (layer_timeline.replay_scatters; eager torch's
    # does, torchtitan's early_stop=False: left out here, a lower bound still); the
    # candidates of one search share the framework, which ``serial`` carries (torch: all True).
    # op-level AC's replay issues no block's closing TP collective (layer_timeline.replay_scatters), only
    # the TP all-gathers, and the EP all-to-alls only where the policy saves no all-to-all output (``op_ep``:
    # compute.recompute.op_replays_ep, 238fa99's Qwen3 list; layer_timeline.forward_layer)
    op = c.rc == RECOMPUTE.index("op")
    op_replay = forward("br", 0.0, 0.0, k.e, k.e_out) if op_ep else forward("br", 0.0, 0.0, 0.0, 0.0)
    replay = np.where(op, op_replay, forward("br", np.where(serial, 0.0, k.post_mlp)))
    return forward("f"), back + np.where(full, replay, 0.0)


def _forward_chain(c: Candidates, o: dict, k: _Terms, shared_beside: bool, p: str, post_mlp, post_attn, ep_in,
                   ep_out) -> np.ndarray:
    """One layer's forward (``p`` "f") or its replay (``p`` "br") chain, seconds per candidate,
    with the blocks' closing tp collectives (``post_mlp``, ``post_attn``) and the EP calls
    (``ep_in``, ``ep_out``) that pass issues (a replay issues fewer: :func:`chains`). CP: the K/V
    all-gather starts after the K/V projection and the core attention waits for it; only the Q
    projection runs beside it (the ring: only its first SDPA step; TE's: nothing)."""
    attn = (o[f"{p}_attn"] + np.maximum(k.cp_ag - np.where(k.ring, o[f"{p}_cps"], o[f"{p}_cpq"] * (1 - k.te_ag)), 0.0)
            + _p2p(k.kv + k.kvs, o[f"{p}_cps"], k.n))
    mlp_out = np.maximum(o[f"{p}_mlp"], ep_out) if shared_beside else o[f"{p}_mlp"] + ep_out
    blocking = (o[f"{p}_attn_pre"] + k.pre + attn + post_attn + o[f"{p}_attn_post"]
                + o[f"{p}_mlp_pre"] + k.pre_mlp + ep_in + mlp_out + post_mlp + o[f"{p}_mlp_post"])
    # tp_comm_overlap: a block's TP collectives run under its GEMMs, decomposed into pieces
    # (compute.asynctp: each fused op lasts at least its collective and its pieces' GEMMs,
    # at least the whole GEMM's), so the block lasts at least both; the EP combine is issued
    # after the block's compute and still blocks
    mlp_tp = np.maximum(o[f"{p}_mlp"], k.pre_mlp + post_mlp)
    overlapped = (o[f"{p}_attn_pre"] + np.maximum(attn, k.pre + post_attn) + o[f"{p}_attn_post"] + o[f"{p}_mlp_pre"]
                  + (np.maximum(mlp_tp, ep_out) if shared_beside else mlp_tp + ep_out) + o[f"{p}_mlp_post"])
    return np.where(c.ov > 0, overlapped, blocking) + k.amax_f + k.qkv_ag


def _backward_chain(c: Candidates, o: dict, k: _Terms, b: dict, serial: bool | np.ndarray) -> np.ndarray:
    """One layer's backward chain without its replay, seconds per candidate; ``b``: the blocks'
    input-gradient seconds under each candidate's recompute. CP: the dK/dV reduce-scatter starts
    after the core attention's backward and the K/V projections' input gradients wait for it; only
    the Q projection's runs beside it (TE's all-gather CP: nothing, and its backward's own gather
    and a selective replay's, cpr > 0, exposed too). The ring (schedule.ring_timeline.ring_backward):
    its gather beside the first of cp steps of s seconds, each of cp - 1 shifts X beside the next
    step, the last exposed: max(AG - s, 0) + (cp - 1) max(X - s, 0) + X (compiled, the timeline
    waits the gather and every shift at once, AG + cp X: ring_timeline.compiled_ring_backward; this
    eager order's exposure stays a lower bound on it). Under tp_comm_overlap async TP fuses the
    gathered output gradient with the row-parallel input-gradient GEMM (compute.asynctp), which
    lasts at least both (pieces' GEMMs at least the whole's); the other input gradients follow it."""
    cp_b = np.where(k.ring, np.maximum(k.cp_ag - b["cps"], 0.0) + k.cp_n * np.maximum(k.x - b["cps"], 0.0)
                    + k.x, np.maximum(k.cp_rs - b["cpq"] * (1 - k.te_ag), 0.0)
                    + k.te_ag * k.cp_ag * (1 + (b["cpr"] > 0)))
    cp_b = cp_b + (_p2p(k.kv, b["cps"], 2 * (c.cp > 1)) + _p2p(k.kv2, b["cps"], np.maximum(k.n - 1, 0))
                   + _p2p(k.kv, b["cpr"], np.where(b["cpr"] > 0, k.n, 0)))
    gathered = lambda blk, g=k.pre: np.where(c.ov > 0, np.maximum(g, b[blk]), g + b[blk])
    beside = lambda w, x: np.where(serial, w + x, np.maximum(w, x))
    return (k.amax_b + b["mlp_post"] + k.e + gathered("mlp", k.pre_mlp) + beside(o["bw_mlp"], k.post_mlp + k.e_out)
            + b["mlp_pre"] + b["attn_post"]
            + gathered("attn") + cp_b + beside(o["bw_attn"], k.post)
            + b["attn_pre"] + k.qkv_rs)


def stage_chains(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, cm: dict,
                 serial: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) chain of one layer per stage (candidates, pp), seconds, under each
    row's recompute (``layer`` as ``none``: :func:`layer_ops`): a dense model's one kind; with
    MoE layers the lower of the kinds the stage holds, the EP all-to-alls counted only where the
    stage's collective table has them (``cm``: :func:`~meshplan.search.comm_bounds.comm_times`;
    ``serial``: :func:`chains`)."""
    col = lambda a: np.asarray(a)[:, None]
    fd, bd = chains(c, layer_ops(cfg, tt, c, False), cm, False, serial)
    if not cfg.model.is_moe:
        return col(fd), col(bd)
    om = layer_ops(cfg, tt, c, True)
    shared = framework_kernels(cfg.training)["shared_beside_combine"]  # the timeline's one rule
    # the timeline's rule at recompute op (the rows' own recompute is c.rc; op_replays_ep reads the policy)
    op_ep = op_replays_ep(cfg.model, cfg.training.model_copy(update={"recompute": "op"}))
    fm, bm = chains(c, om, cm, True, serial, shared, op_ep)
    f0m, b0m = chains(c, om, {**cm, "ep": np.zeros(len(c)), "ep_out": np.zeros(len(c))}, True, serial, shared, op_ep)
    # a stage's collective table may be stage 0's (step_time's older convention for the
    # middle stages) or its own: count the EP all-to-alls only when both hold MoE layers
    ep_on = np.where(st.k < st.k.shape[1] - 1, (st.n_moe[:, :1] > 0) & (st.n_moe > 0), st.n_moe > 0)
    fm, bm = np.where(ep_on, col(fm), col(f0m)), np.where(ep_on, col(bm), col(b0m))
    has_d, has_m = (st.n - st.n_moe) > 0, st.n_moe > 0
    pick = lambda d, x: np.where(has_d & has_m, np.minimum(col(d), x), np.where(has_m, x, col(d)))
    return pick(fd, fm), pick(bd, bm)


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
