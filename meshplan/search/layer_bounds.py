"""The bound's building blocks, per candidate: a layer's op times (:func:`layer_ops`), its chain
of compute and blocking collectives (:func:`chains`), the unit bounds of each stage
(:func:`unit_bounds`: forward and backward units, their FSDP gathers and reductions, the
embedding and head, p2p, tail and stage end) and the FLOP-weighted GEMM efficiency
(:func:`gemm_efficiency`). The module docstring of :mod:`meshplan.search.timing` states what
they keep.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from meshplan.compute.ops import framework_kernels
from meshplan.compute.recompute import op_replays_ep
from meshplan.config import Config
from meshplan.schedule.layer_timeline import LAYER_BLOCKS
from meshplan.schedule import workload  # its dtensor_host_s through the module: one home, one override
from meshplan.search.comm_bounds import comm_times, fsdp_copies
from meshplan.search.gather_passes import (deepspeed_backward_shares, expert_gathers, head_regathers, head_unit_apart,
                                           gathering_passes)
from meshplan.search.memory import Stages, lookup, split
from meshplan.search.columns import bound_recompute
from meshplan.search.layer_replays import extra_replays, layer_rows, more_replays, replayed_layers
from meshplan.search.space import RECOMPUTE, Candidates, accumulates
from meshplan.search.step_end_bound import final_reduce_tail, fsdp2_rs_wait, reduce_flow_shop_s, stage_end_bound
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
    ring = np.asarray(x) > 0
    # Transformer Engine's p2p ring (ring_timeline.p2p_steps): each send beside one step of s seconds
    # exposes max(send - s, 0); forward cp - 1 K/V sends, backward one K/V, cp - 2 K/V with dK/dV,
    # one dK/dV, and a selective recompute's replay (steps of r seconds) cp - 1 K/V sends again
    kv, kv2, n = cm.get("cp_kv", 0.0), cm.get("cp_kv2", 0.0), np.maximum(c.cp - 1, 0)
    te_ag = cm.get("cp_te_ag", 0.0)  # Megatron-LM's all-gather CP: no Q projection apart, TE's gathers exposed
    p2p = lambda send, step, k: k * np.maximum(send - step, 0.0)

    def forward(p, post_mlp=post_mlp_tp, post_attn=post, ep_in=e, ep_out=e_out):
        # CP: the K/V all-gather starts after the K/V projection and the core attention waits
        # for it; only the Q projection runs beside it (the ring: only its first SDPA step; TE's: nothing)
        attn = (o[f"{p}_attn"] + np.maximum(cm["cp_ag"] - np.where(ring, o[f"{p}_cps"], o[f"{p}_cpq"] * (1 - te_ag)), 0.0)
                + p2p(kv, o[f"{p}_cps"], n))
        mlp_out = np.maximum(o[f"{p}_mlp"], ep_out) if shared_beside else o[f"{p}_mlp"] + ep_out
        blocking = (o[f"{p}_attn_pre"] + pre + attn + post_attn + o[f"{p}_attn_post"]
                    + o[f"{p}_mlp_pre"] + pre_mlp + ep_in + mlp_out + post_mlp + o[f"{p}_mlp_post"])
        # tp_comm_overlap: a block's TP collectives run under its GEMMs, decomposed into pieces
        # (compute.asynctp: each fused op lasts at least its collective and its pieces' GEMMs,
        # at least the whole GEMM's), so the block lasts at least both; the EP combine is issued
        # after the block's compute and still blocks
        mlp_tp = np.maximum(o[f"{p}_mlp"], pre_mlp + post_mlp)
        overlapped = (o[f"{p}_attn_pre"] + np.maximum(attn, pre + post_attn) + o[f"{p}_attn_post"] + o[f"{p}_mlp_pre"]
                      + (np.maximum(mlp_tp, ep_out) if shared_beside else mlp_tp + ep_out) + o[f"{p}_mlp_post"])
        return np.where(c.ov > 0, overlapped, blocking) + amax_f + qkv_ag
    # op-level selective AC replays its recomputed ops before the layer's backward, as full does
    full = (c.rc == RECOMPUTE.index("full")) | (c.rc == RECOMPUTE.index("op"))
    b = {blk: np.where(full, o[f"bin_{blk}"], o[f"bi_{blk}"]) for blk in LAYER_BLOCKS + ("cpq", "cps", "cpr")}
    # CP: the dK/dV reduce-scatter starts after the core attention's backward and the K/V projections'
    # input gradients wait for it; only the Q projection's runs beside it (TE's all-gather CP: nothing,
    # and its backward's own gather and a selective replay's, cpr > 0, exposed too). The ring
    # (schedule.ring_timeline.ring_backward): its gather beside the first of cp steps of s seconds,
    # each of cp - 1 shifts X beside the next step, the last exposed: max(AG - s, 0) + (cp - 1) max(X - s, 0) + X
    # (compiled, the timeline waits the gather and every shift at once, AG + cp X: ring_timeline.compiled_ring_backward;
    # this eager order's exposure stays a lower bound on it)
    cp_b = np.where(ring, np.maximum(cm["cp_ag"] - b["cps"], 0.0) + cm.get("cp_n", 0) * np.maximum(x - b["cps"], 0.0)
                    + x, np.maximum(cm["cp_rs"] - b["cpq"] * (1 - te_ag), 0.0)
                    + te_ag * cm["cp_ag"] * (1 + (b["cpr"] > 0)))
    cp_b = cp_b + (p2p(kv, b["cps"], 2 * (c.cp > 1)) + p2p(kv2, b["cps"], np.maximum(n - 1, 0))
                   + p2p(kv, b["cpr"], np.where(b["cpr"] > 0, n, 0)))
    # tp_comm_overlap: async TP fuses the gathered output gradient with the row-parallel
    # input-gradient GEMM (compute.asynctp), which lasts at least both (pieces' GEMMs at least
    # the whole's); the other input gradients follow it
    gathered = lambda blk, g=pre: np.where(c.ov > 0, np.maximum(g, b[blk]), g + b[blk])
    beside = lambda w, x: np.where(serial, w + x, np.maximum(w, x))
    back = (amax_b + b["mlp_post"] + e + gathered("mlp", pre_mlp) + beside(o["bw_mlp"], post_mlp_tp + e_out)
            + b["mlp_pre"] + b["attn_post"]
            + gathered("attn") + cp_b + beside(o["bw_attn"], post)
            + b["attn_pre"] + qkv_rs)
    # compiled torch's full AC replays no MLP closing collective (layer_timeline.replay_scatters; eager torch's
    # does, torchtitan's early_stop=False: left out here, a lower bound still); the
    # candidates of one search share the framework, which ``serial`` carries (torch: all True).
    # op-level AC's replay issues neither block's closing TP collective nor the EP all-to-alls
    # (their outputs saved: layer_timeline.replay_scatters, forward_layer), only the TP all-gathers
    op = c.rc == RECOMPUTE.index("op")
    op_replay = forward("br", 0.0, 0.0, e, e_out) if op_ep else forward("br", 0.0, 0.0, 0.0, 0.0)
    replay = np.where(op, op_replay, forward("br", np.where(serial, 0.0, post_mlp_tp)))
    return forward("f"), back + np.where(full, replay, 0.0)


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
    cf, cb = stage_chains(cfg, tt, c, st, cm, serial)
    # torchtitan's per-layer AC (``layer``): a layer replayed in full costs at least full's chain,
    # the others none's; per layer the lower of the two (``cf``, ``cb``) and, on the chunk's
    # replayed layers (replayed_layers), the replay's extra (``df``, ``db``; 0 on other rows)
    df, db = np.zeros_like(cf), np.zeros_like(cb)
    if (c.rc == RECOMPUTE.index("layer")).any():
        ff, fb = stage_chains(cfg, tt, replace(c, rc=bound_recompute(c.rc, "full")), st, cm, serial)
        df, db = np.maximum(ff - cf, 0.0), np.maximum(fb - cb, 0.0)
        cf, cb = np.minimum(cf, ff), np.minimum(cb, fb)
    # a chunk of n layers adds its replays' extra to n per-layer lower chains (``plus``: a chunk
    # that replays one more than the fewest, layer_replays); 0.0 on other rows
    replays_f = lambda n, plus=0: replayed_layers(c, n, plus) * df
    replays_b = lambda n, plus=0: replayed_layers(c, n, plus) * db
    n = st.n_chunk
    # with pp > 1 a unit gathers only when it finds its chunk sharded and reduce-scatters only
    # on the chunk's last gradient unit (comm.fsdp_rows.fsdp_gather_flags): no FSDP term in
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
    # DeepSpeed ZeRO-3 at pp 1: its backward gathers what stage3_max_reuse_distance did not keep
    # (none of a kept layer, twice a layer under full recompute at a short distance): the
    # shares summed (``ds_n``, for n) and the last layer's (``ds_1``, the first exposed)
    ds_tot, ds_last = deepspeed_backward_shares(cfg, c)
    ds_n = lambda n: np.where(np.isnan(ds_tot), n, ds_tot)
    ds_1 = np.where(np.isnan(ds_last), 1.0, ds_last)
    pre, post = col(cm["tp_sp"]), col(np.maximum(cm["tp_sp"], cm["tp_ar"]))
    g_f, g_b = gathering_passes(cfg, c, st)
    # a MoE layer's forward that finds its experts sharded waits for their efsdp all-gather where
    # nothing prefetched it: the chunk's first layer's, issued when it starts (the others go out
    # beside the next layer's and may hide: rank_timeline.forward_unit), counted where every layer
    # is MoE (the chunk's first one then is); with pp 1 every forward gathers, with pp > 1 the
    # gathering passes (``f_extra``)
    first = np.minimum(expert_gathers(st, c), 1) if m.is_moe and m.dense_layers == 0 else 0
    e_ag = col(cm["efsdp_ag"]) * first if m.is_moe else np.zeros_like(st.n, dtype=np.float64)
    # FSDP2's copies on the compute stream (fsdp_copies): a gathering pass's copy-out before each
    # layer's compute, a reducing pass's copy-in after it; every pass with pp 1 under sync (the
    # backward's copy-out only when it gathers again: reshard_after_forward), else the gathering
    # passes (``f_extra``, ``b_extra``) and the chunk's last gradient unit (``b_red``)
    cp = fsdp_copies(cfg, tt.tables, c)
    co, ci = col(np.where(lazy, 0.0, cp["out"])), col(np.where(lazy, 0.0, cp["in"]))
    co_p, ci_p = col(np.where(lazy, cp["out"], 0.0)), col(np.where(lazy, cp["in"], 0.0))
    # the routed experts' own unit (efsdp > 1): its copy-in after each MoE layer's backward that
    # reduces (grad_reduce.unit_reduce, _perform_reduce_grad), in the chunk with the fewest of them
    moe_n = expert_gathers(st, c) if m.is_moe else 0
    e_ci, e_ci_p = moe_n * col(np.where(lazy, 0.0, cp["e_in"])), moe_n * col(np.where(lazy, cp["e_in"], 0.0))
    cf_c, cb_c = cf + co, cb + co * keep + ci
    head_b0 = st.last * (col(od["head_b"]) + post)
    # training.reshard_head_after_forward (torchtitan's "always", pp 1 under sync): each backward
    # starts with the [norm, output] unit's all-gather, exposed, then its copy-out before the
    # head's backward; the last layer's prefetched gather queues behind it on the FSDP stream
    # (rank_timeline.backward_unit; test_reshard_policy's backward by hand)
    again = head_regathers(cfg, c)
    h_co = st.last * col(cp["head_out"]) * again
    head_b = head_b0 + st.last * col(cm["head_ag"]) * again + h_co
    # torchtitan's [norm, output] unit (every pp): its pre-backward prefetches the last layer's
    # all-gather before the head's backward runs (rank_timeline.backward_unit), so a gathering
    # backward pass of the head's chunk exposes its first gather less the head's backward
    # (``b_extra_head``: the head chunk's gathering backwards only, step_lower_bound)
    hb = (head_b0 + h_co) * head_unit_apart(cfg, c)  # the head's copy-out too: the last layer's gather starts after it
    hb1 = hb * col((c.pp == 1) & (c.vpp == 1))  # pp 1: every backward of the head's chunk gathers (sync)
    # there the head's reduce-scatter, issued after its backward, runs on the FSDP stream between
    # the last layer's prefetched all-gather and the next layer's (every micro-batch under sync)

    # pp > 1 (torch's PipelineStage, grad_reduce.perform_reduce_grad): a chunk's last gradient
    # unit, unless it ends the stage's order, holds the compute stream until its layers' FSDP
    # reductions are done: per layer a copy-in (compute stream), then its reduce-scatter (fsdp
    # stream), then its HSDP all-reduce (dp_replicate stream), each stream serial and the first
    # copy-in after the unit's last backward. n identical jobs through three serial stages take at
    # least the three of one job plus (n - 1) x the longest (a flow shop,
    # step_end_bound.reduce_flow_shop_s; FSDP2's copy-in waits for the previous reduce-scatter,
    # rs_wait: copy-in and reduce-scatter one stage): ``b_wait``, the unit's time past its compute (at least
    # ``b_red``). Dense models with one schedule run only (the tail's ``fsdp_red`` restriction; with
    # runs > 1 the DAG's last micro-batch is not each run's)
    waits = col((c.pp > 1) & (not m.is_moe or m.dense_layers == 0) & (cfg.training.pp_schedule_runs == 1))
    rs_p, ar_p = col(cm["fsdp_rs"]), col(cm["hsdp_ar"])
    rs_wait = col(fsdp2_rs_wait(cfg, c))

    def cores(n, plus=0):
        # one chunk of n layers: each term grows with n (a longer chunk's bound is never lower);
        # a chunk of none (the embedding or the output layer alone, stage_layers) has no layer term
        h_rs = col(cm["head_rs"]) * (hb1 > 0) * keep * (n >= 2)
        has = n >= 1
        nf_c, nb_c = n * cf_c + replays_f(n, plus), n * cb_c + replays_b(n, plus)
        return {"f_core": has * np.maximum(np.maximum(ag + nf_c, n * ag + cf_c), nf_c + col(~lazy) * e_ag),
                "b_core": has * np.maximum(np.maximum(ag_b * ds_1 - hb1, 0.0) + nb_c + e_ci,
                                           ds_n(n) * ag_b + np.maximum(n - 2, 0) * rs * keep + h_rs + cb_c - hb1),
                "b_red": has * (n * ci_p + e_ci_p),
                "b_wait": np.maximum(has * (n * ci_p + e_ci_p), waits * reduce_flow_shop_s(n, ci_p, rs_p, ar_p, rs_wait))}

    def extra(n, hb):
        # a gathering pass's extra over its chunk of n >= 1 layers (forward, backward less ``hb``);
        # it shrinks as the chunk's replays grow: at one more than the fewest, valid for any chunk
        # of n (per-layer AC: the lower of the short and the long chunk's, below)
        rf, rb = replays_f(n, 1), replays_b(n, 1)
        f = np.maximum(piped * (np.maximum(ag_p + n * (cf + co_p) + rf, n * ag_p + cf + co_p) - (n * cf + rf)),
                       col(lazy) * e_ag + n * co_p)
        b = np.maximum(piped * (np.maximum(np.maximum(ag_p - hb, 0.0) + n * (cb + co_p) + rb,
                                           n * ag_p + cb + co_p - hb) - (n * cb + rb)), n * co_p)
        return f, b

    lo, hi = cores(n), cores(st.n_chunk_hi)
    lay = layer_rows(c) > 0
    # the Llama 3 split with vpp > 1: ``n_long`` chunks of the stage hold n_chunk_hi layers, the
    # others n_chunk (stage_layers: stage 0's last chunks, the other stages' first ones); chunk
    # 0's units (the fill and the drain) are long on every stage but the first where any is
    n_long = st.n - c.vpp[:, None] * n
    # per-layer AC rows: the lower of the short and the long chunk's extra (each chunk's own
    # replays may make the long one's the lower); other rows at the shortest chunk
    extra_lo = lambda n, hb: extra(n, hb) if not lay.any() else tuple(
        np.where(lay, np.minimum(e, e_hi), e) for e, e_hi in zip(extra(n, hb), extra(np.maximum(st.n_chunk_hi, 1), hb)))
    long0 = (n_long > 0) & (st.k > 0)
    out = {**lo, "f_core_hi": hi["f_core"], "b_core_hi": hi["b_core"], "b_red_hi": hi["b_red"], "b_wait_hi": hi["b_wait"], "n_long": n_long,
           "f_core0": np.where(long0, hi["f_core"], lo["f_core"]), "b_core0": np.where(long0, hi["b_core"], lo["b_core"]),
           # at the shortest chunk that holds layers (the passes of an empty one are left out:
           # step_lower_bound); a gathering backward of the head's chunk takes the head's
           # backward off its first gather (``b_extra_head``), the other chunks' do not
           **dict(zip(("f_extra", "b_extra"), extra_lo(np.maximum(n, 1), 0.0))),
           "b_extra_head": extra_lo(np.maximum(n, 1), hb)[1],
           "g_f": g_f, "g_b": g_b, "empty_end": st.n_chunk == 0,
           "emb_f": st.first * (col(od["emb_f"]) + post + col(np.where(lazy, 0.0, cp["root_out"]))),
           "emb_b": st.first * (col(od["emb_bw"]) + col(np.where(lazy, 0.0, cp["root_in"]))),
           "head_f": st.last * (pre + col(od["head_f"]) + col(cm["loss"])),
           "head_b": head_b, "p2p": col(cm["p2p"])}
    if lay.any():  # per-layer AC: the cores of a chunk with one replay more (``_x``, layer_replays)
        lo_x, hi_x = cores(n, 1), cores(st.n_chunk_hi, 1)
        out |= {"f_core_x": lo_x["f_core"], "b_core_x": lo_x["b_core"], "f_core_hi_x": hi_x["f_core"],
                "b_core_hi_x": hi_x["b_core"]}
    # the roots' copy-outs a forward may run under the host's issue: on the stages holding them
    # (pp 1's root unit, the embedding's on stage 0, [norm, output]'s on the head's stage)
    roots = (st.first | st.last) * col(cp["root_out"]) + st.first * col(cp["emb_out"]) + st.last * col(cp["head_out"])
    host_pace_floor(cfg, c, st, out, roots)
    # the stage's chunks that replay one layer more than their length's fewest
    out["more_replays"] = np.zeros(st.n.shape)
    if lay.any():
        more = {k[:-2]: out.pop(k) for k in ("f_core_x", "b_core_x", "f_core_hi_x", "b_core_hi_x")}
        out["more_replays"] = more_replays(out, more, extra_replays(c, st.n, n, n_long), n, n_long, c.vpp)
    one = col(c.vpp) == 1
    b0 = out["b_core0"] + out["emb_b"] + one * out["head_b"]
    out["end"], red = stage_end_bound(cfg, tt, c, st, s, cm)
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
    # pp > 1: the unit that ends the stage's order (chunk 0's) reduces its layers after its end
    out["tail"] = np.maximum(out["tail"], has0 * waits * final_reduce_tail(n0, ci_p, rs_p, ar_p, rs_wait))
    return out


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


def host_pace_floor(cfg: Config, c: Candidates, st: Stages, out: dict, roots_s: np.ndarray) -> None:
    """Raise ``out``'s chunk cores (``f_core``, ``b_core``, their ``_hi`` and ``0`` forms, and
    per-layer AC's ``_x`` forms, a chunk with one replay more: :mod:`~meshplan.search.layer_replays`; in
    place) to eager DTensor TP's host pace (:func:`meshplan.schedule.workload.dtensor_host_s`
    per candidate's tp): a unit's layers cannot end before the host has issued them
    (:meth:`meshplan.schedule.unit_sim.StreamSim.host_pace`, its clock from the unit's start).
    A forward unit of n layers lasts at least n x the forward pace, then its head; what runs
    before or beside its layers may run under the host's issue: the embedding, the roots'
    copy-outs (``roots_s``, per stage). A backward unit: n x the backward pace (plus the
    forward's under full recompute, which replays every layer, and on per-layer AC's replayed
    layers, :func:`replayed_layers`), the head's backward under it,
    the embedding's gradient after. The extras step_lower_bound adds to a core (a gathering
    pass's ``f_extra``, ``b_extra``, ``b_extra_head``; a last gradient unit's ``b_red``,
    ``b_wait``) may run under the host's issue too: each is lowered by its core's raise (the
    larger of the short and the long chunk's for the single-length extras, and of a chunk's with
    one replay more), so a core and its
    extra together are at most the larger of the unit's device bound and its pace: the bound
    stays a lower bound."""
    tp = split(c, Dim.HEADS)
    hf, hb = np.zeros(len(c)), np.zeros(len(c))
    for t in np.unique(tp).tolist():
        hf[tp == t], hb[tp == t] = workload.dtensor_host_s(cfg, int(t))
    if not hf.any():
        return
    hb = hb + hf * (c.rc == RECOMPUTE.index("full"))
    col = lambda a: np.asarray(a)[:, None]
    raise_f, raise_b = {}, {}
    for key, n, plus in (("", st.n_chunk, 0), ("_hi", st.n_chunk_hi, 0), ("_x", st.n_chunk, 1),
                         ("_hi_x", st.n_chunk_hi, 1)):
        if "f_core" + key not in out:  # no per-layer AC row: no ``_x`` cores
            continue
        fk, bk, has = "f_core" + key, "b_core" + key, n >= 1
        f = np.maximum(out[fk], has * (n * col(hf) - out["emb_f"] - roots_s))
        # per-layer AC: its replayed layers issue their forward again too
        b = np.maximum(out[bk], has * (n * col(hb) + replayed_layers(c, n, plus) * col(hf) - out["head_b"]))
        raise_f[key], raise_b[key] = f - out[fk], b - out[bk]
        out[fk], out[bk] = f, b
    for key in ("", "_hi"):  # a chunk's last gradient unit, whichever its replays
        for extra in ("b_red", "b_wait"):
            out[extra + key] = np.maximum(out[extra + key] - np.maximum(raise_b[key], raise_b.get(key + "_x", 0.0)), 0.0)
    rf, rb = (np.maximum.reduce(list(r.values())) for r in (raise_f, raise_b))
    out["f_extra"] = np.maximum(out["f_extra"] - rf, 0.0)
    out["b_extra"] = np.maximum(out["b_extra"] - rb, 0.0)
    out["b_extra_head"] = np.maximum(out["b_extra_head"] - rb, 0.0)
    long0 = (out["n_long"] > 0) & (st.k > 0)
    out["f_core0"] = np.where(long0, out["f_core_hi"], out["f_core"])
    out["b_core0"] = np.where(long0, out["b_core_hi"], out["b_core"])
