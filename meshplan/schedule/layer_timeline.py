"""One transformer layer on the rank timeline: its forward (:func:`forward_layer`) and backward
(:func:`backward_layer`) block by block, with the TP collectives around each block (and async
TP's fused GEMMs, :func:`fused_gemms`), the attention under CP (its K/V gathers and dK/dV
reduce-scatter or torch's ring shifts: :mod:`meshplan.schedule.ring_timeline`), EP's all-to-alls, float8
amax all-reduces and the registered axes' slots, as the module docstring of :mod:`meshplan.schedule.rank_timeline` describes.
"""

from __future__ import annotations

from typing import Optional

from meshplan.comm.deepep import shared_forward_s
from meshplan.compute import asynctp
from meshplan.compute.megatron import COMM_DELAY_OPS
from meshplan.compute.ops import Cost, Workload
from meshplan.compute.recompute import full_ac_replays_whole, shared_replay_seconds
from meshplan.schedule.ring_timeline import cp_attention_backward, cp_attention_forward, cp_parts
from meshplan.schedule.row_groups import FLOAT8_TP
from meshplan.schedule.layer_waits import amax_wait, mla_up_gathers, qkv_gather
from meshplan.schedule.unit_sim import StreamSim
from meshplan.spec.axes.base import At, Block
from meshplan.spec.recompute_modules import layer_parts


#: The blocks of a layer, in forward order (op blocks of :mod:`meshplan.compute.ops`).
LAYER_BLOCKS = ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post")


def _gather_group(s: "StreamSim", phase: str) -> str:
    """Group of a layer block's tp all-gathers of ``phase``: :data:`FLOAT8_TP` when the stage's
    table has float8 rows for them (torchao's float8 TP, the layers'), else ""."""
    return FLOAT8_TP if ("tp", FLOAT8_TP, phase, "all-gather") in s.c.t else ""


def tp_collectives(w: Workload) -> tuple[str, str]:
    """TP collective before and after a block: (all-gather, reduce-scatter) with SP, else
    ("", all-reduce)."""
    return ("all-gather", "reduce-scatter") if w.sp else ("", "all-reduce")


def _block(s: StreamSim, name: str, t: float, phase: str, ep: bool = False, cp: Optional[tuple] = None,
           cp_phase: str = "forward", fused: Optional[dict] = None, tp_ops: tuple = (True, 1, 0),
           shared: float = 0.0) -> None:
    """One forward block; ``cp``: the attention's (K/V proj, Q proj, core, out proj, SDPA calls
    and ring kernels) seconds under CP, run by
    :func:`~meshplan.schedule.ring_timeline.cp_attention_forward`; ``fused``: the block's async-TP GEMMs
    (:func:`fused_gemms`), run as their runtime decomposes them (:func:`_fused_block`);
    ``tp_ops``: (opening collective issued, closing ones, routed outputs' all-gathers) of the
    block (:func:`_mlp_tp`): a dense block's one and one; no closing one in op-level AC's
    replay; an MoE block's as the collective table counts them (none without a shared expert
    where the routed experts issue nothing over tp), the next op waiting for them all; ``shared``: the
    seconds of the block's compute (the shared experts', :func:`meshplan.comm.deepep.shared_forward_s`) run after the EP
    combine is issued, beside it, before the wait for it."""
    opens, closes, routed = tp_ops
    if fused and cp is None and not ep and ("ag" in fused or ("rs" in fused and closes)):
        _fused_block(s, name, t, phase, fused, bool(closes))
        return
    before, after = tp_collectives(s.w)
    pre = s.comm("tp", phase, before, f"tp {before}", _gather_group(s, phase)) if opens else None
    if ep:  # a dropless dispatch's count exchange first (ep_rows._count_rows)
        n = "all-gather" if ("ep", "counts", phase, "all-gather") in s.c.t else "all-to-all"
        pre = s.comm("ep", phase, n, "ep counts", "counts", after=[pre or s.last]) or pre
        pre = s.comm("ep", phase, "all-to-all", "ep dispatch", after=[pre or s.last]) or pre
        pre = s.comm("ep", phase, "all-gather", "etp all-gather", "etp", after=[pre or s.last]) or pre
    post = s.comm("tp", phase, after, f"tp {after}", after=[s.last]) if s.ov.tp and closes else None
    more = [s.comm("tp", phase, after, f"tp {after} (routed and shared apart)", after=[s.last])
            for _ in range(closes - 1)] if s.ov.tp else []
    tp_ov = [x for x in (pre, post, *more) if x] if s.ov.tp else []
    if cp is None:
        s.compute(name, t - shared, [] if s.ov.tp else [pre], tp_ov)
    else:
        cp_attention_forward(s, name, cp, cp_phase, [] if s.ov.tp else [pre], tp_ov)
    if ep:  # Megatron-LM's etp reduce-scatter (none without etp rows) before the combine, on one queue;
        # the next op reads its output through the combine, or directly at ep 1 (no combine): the
        # compute waits for both (NVIDIA/Megatron-LM d98e8a6 token_dispatcher.py 824-833)
        rs = s.comm("ep", phase, "reduce-scatter", "etp reduce-scatter", "etp")
        combine = s.comm("ep", phase, "all-to-all", "ep combine")
        if shared:  # torchtitan's DeepEPMoE: the shared experts beside the combine (comm.deepep.shared_forward_s)
            s.compute(name + " shared experts (beside the combine)", shared)
        s.compute(name + " combine wait", 0.0, [rs, combine])
    # torch at etp 1 without SP: the routed outputs of each rank's tokens all-gathered (tp_rows)
    gathered = [s.comm("tp", phase, "all-gather", "tp all-gather (routed outputs)") for _ in range(routed)]
    if gathered or (not s.ov.tp and closes):
        closing = [s.comm("tp", phase, after, f"tp {after}")] if closes and not s.ov.tp else []
        closing += [s.comm("tp", phase, after, f"tp {after} (routed and shared apart)")
                    for _ in range(closes - 1)] if not s.ov.tp else []
        s.compute(name + " tp wait", 0.0, gathered + closing)


def _fused_block(s: StreamSim, name: str, t: float, phase: str, fused: dict, scatter: bool = True) -> None:
    """A forward block under async TP (:mod:`meshplan.compute.asynctp`): the all-gather fused
    with the column-parallel GEMMs, the block's other ops, the row-parallel GEMM fused with the
    reduce-scatter; ``t``: the block's seconds (pieces' GEMMs and the runtime's copies included).
    ``scatter`` False (op-level AC's replay): no reduce-scatter; a replayed row-parallel GEMM
    runs whole among the block's other ops."""
    ag_s, ag_n = fused.get("ag", (0.0, 0))
    rs_s, rs_n = fused.get("rs", (0.0, 0)) if scatter else (0.0, 0)
    if ag_n:
        s.fused(name + " all-gather+GEMMs", ag_s, s.c.get("tp", phase, "all-gather", _gather_group(s, phase)), ag_n, False)
        s.compute(name, t - ag_s - rs_s)
    else:  # float8 rowwise: the gather blocks as without async TP
        s.compute(name, t - rs_s, [s.comm("tp", phase, "all-gather", "tp all-gather")])
    if scatter and rs_n:
        s.fused(name + " GEMM+reduce-scatter", rs_s, s.c.get("tp", phase, "reduce-scatter"), rs_n, True)
    elif scatter:
        s.compute(name + " tp wait", 0.0, [s.comm("tp", phase, "reduce-scatter", "tp reduce-scatter")])


def fused_gemms(c: Cost, phase: str, recompute: Optional[bool], framework: str, tp: int,
                rowwise: frozenset = frozenset()) -> dict:
    """``{block: {"ag" | "rs": (seconds, pieces)}}`` of the async-TP fused GEMMs among ``c``'s
    ops of ``phase`` and ``recompute`` (a replayed forward GEMM as its forward), summed per side
    (:func:`meshplan.compute.asynctp.pieces`; an all-gather feeds several GEMMs); ``rowwise``:
    the float8 Linears under plain TP (``Workload.plain_tp_float8``), whose gathers do not fuse."""
    out: dict = {}
    for o in c.ops:
        if o.kind != "gemm" or o.phase != phase or recompute not in (None, o.recompute):
            continue
        base = o.name.removesuffix(" (recompute)")
        ph = "forward" if o.recompute else phase
        n = asynctp.pieces(framework, tp, base, ph, base.split(".")[0] in rowwise)
        if n:
            side = "rs" if ph == "forward" and base in asynctp.RS_FORWARD else "ag"
            g, _ = out.setdefault(o.block, {}).get(side, (0.0, n))
            out[o.block][side] = (g + o.seconds, n)
    return out


def _block_backward(s: StreamSim, name: str, t_b: float, t_w: float, ep=False, cp: Optional[tuple] = None,
                    t_w_row: float = 0.0, t_b_col: float = 0.0, fused: Optional[dict] = None,
                    tp_ops: tuple = (True, 1, 0)) -> None:
    """One block's backward; ``cp``: the attention's input-gradient seconds (core incl. wo
    and RoPE, Q proj, K/V proj, SDPA calls) under CP, run by
    :func:`~meshplan.schedule.ring_timeline.cp_attention_backward`. ``t_w_row``: the
    weight gradients of the block's row-parallel linear (wo, w_down) and its bias, computed
    with its input gradient at the block's start (one autograd node, before the core);
    ``t_w``: the rest (the column-parallel linears' wgrad); ``t_b_col``: the column-parallel
    linears' input gradients (the end of ``t_b``).

    ``Overlap.tp_grad`` (Megatron-LM): the input-gradient collective is issued after the
    column-parallel input gradients and runs during their weight gradients; with SP their
    input is all-gathered again first, during their input-gradient GEMM. Otherwise (torch):
    the collective is issued after the weight gradients and the next block waits for it;
    ``Overlap.tp`` overlaps it with the weight gradients whatever the framework.
    ``fused``: async TP's gathered output gradient fused with the row-parallel input-gradient
    GEMM (:func:`fused_gemms`, backward side "ag"), the rest of the input gradients after it.
    ``tp_ops``: the forward's (:func:`_block`), whose mirrors the backward issues: with SP an
    all-gather opening it per forward reduce-scatter (torch's autograd of a reduce-scatter
    all-gathers the gradient; the input gradients wait for them all) and a reduce-scatter
    closing it where the forward opened with an all-gather; without SP an all-reduce per
    forward all-reduce and an all-gather of the input gradient per routed outputs' all-gather,
    closing it."""
    opens, closes, routed = tp_ops
    before, after = tp_collectives(s.w)
    ag_fused = fused.get("ag") if fused and cp is None and not ep and s.w.sp else None
    g = _gather_group(s, "backward")
    pre = None if ag_fused or not closes else s.comm("tp", "backward", before, f"tp {before}", g)
    more = [s.comm("tp", "backward", before, f"tp {before} (routed and shared apart)", g) for _ in range(closes - 1)]
    if ep:
        pre = s.comm("ep", "backward", "all-to-all", "ep combine grad", after=[pre or s.last]) or pre
        pre = s.comm("ep", "backward", "all-gather", "etp all-gather (grad)", "etp", after=[pre or s.last]) or pre
    regather = s.ov.tp_grad and s.w.sp and not ep and t_w > 0
    ag = None
    if ag_fused:
        s.fused(name + " all-gather+dgrad", ag_fused[0], s.c.get("tp", "backward", before, g), ag_fused[1], False)
        s.compute(name + " B", t_b - ag_fused[0] - (t_b_col if regather else 0.0) + t_w_row)
        if regather:
            ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)")
            s.compute(name + " column B", t_b_col)
    elif cp is None:
        s.compute(name + " B", t_b - (t_b_col if regather else 0.0) + t_w_row, [pre, *more])
        if regather:
            ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)")
            s.compute(name + " column B", t_b_col)
    else:
        ag = cp_attention_backward(s, name, cp, t_w_row, pre, regather)
    beside = s.ov.tp or s.ov.tp_grad
    if not beside and t_w > 0:
        s.compute(name + " W", t_w)
    post = s.comm("tp", "backward", after, f"tp {after}") if (opens if s.w.sp else closes) else None
    if ep:
        post = s.comm("ep", "backward", "reduce-scatter", "etp reduce-scatter (grad)", "etp",
                      after=[post or s.last]) or post
        post = s.comm("ep", "backward", "all-to-all", "ep dispatch grad", after=[post or s.last]) or post
    if beside and t_w > 0:
        s.compute(name + " W", t_w, [ag], [post] if s.ov.tp else [])
    gathered = [s.comm("tp", "backward", "all-gather", "tp all-gather (routed input gradients)") for _ in range(routed)]
    s.compute(name + " grad wait", 0.0, [post, *gathered])


def _times(c: Cost, phase: str, recompute: Optional[bool] = None) -> dict:
    return {b: c.seconds(phase, b, recompute) for b in LAYER_BLOCKS}


#: Input-gradient ops of the column-parallel linears (Megatron's ColumnParallelLinear, torch's
#: ColwiseParallel), op names of :mod:`meshplan.compute.ops`.
COLUMN_PARALLEL_DGRAD = ("wq.dgrad", "wk.dgrad", "wv.dgrad", "w_gate.dgrad", "w_up.dgrad",
                         "wq_b.dgrad", "wkv_b.dgrad",  # MLA's up projections (its down projections are replicated)
                         COMM_DELAY_OPS["backward_input"])  # Megatron's kernel after the re-gather's launch


#: Weight-gradient ops of the row-parallel linears (Megatron's RowParallelLinear, torch's
#: RowwiseParallel) and their biases, op names of :mod:`meshplan.compute.ops`.
ROW_PARALLEL_WGRAD = ("wo.wgrad", "w_down.wgrad", "shared_w_down.wgrad", "wo bias grad", "mlp down bias grad")


def _ops_by_block(c: Cost, phase: str, names: tuple, recompute: Optional[bool] = None) -> dict:
    """Seconds per block of the ops of ``phase`` named in ``names``."""
    out = dict.fromkeys(LAYER_BLOCKS, 0.0)
    for o in c.ops:
        if o.phase == phase and o.name in names and recompute in (None, o.recompute):
            out[o.block] += o.seconds
    return out


def _slots(s: StreamSim, phase: Optional[str], at: At, block: Optional[Block] = None) -> None:
    """The calls of the registered axes' slots (:attr:`CommTimes.slots`) of row ``phase``
    at ``at`` ``block``, in registry order, each on its stream after the compute so far;
    the compute waits for a blocking one (its wait is exposed on the stream). ``phase``
    None (a checkpoint's replay): none."""
    if not s.c.slots or phase is None:
        return
    for stream, x in s.c.slots:
        if x.phase == phase and x.at is at and x.block is block:
            ev = s.comm(stream, phase, x.op, f"{stream} {x.op} ({at} {block})" if block else f"{stream} {x.op}")
            if ev is not None and at is not At.OVERLAPPED:
                s.compute(f"{stream} wait", 0.0, [ev])


def _rowwise(w: Workload) -> frozenset:
    """The float8 Linears of ``w`` under plain TP (none unless ``Workload.plain_tp_float8``:
    rowwise, or tensorwise without float8 TP), whose gathers do not fuse."""
    return w.float8_gemms if w.plain_tp_float8 and w.linear_dtype == "fp8" else frozenset()


def replay_scatters(w: Workload, phase: str) -> tuple[bool, bool]:
    """Whether a forward pass of ``phase`` (a replay when not "forward") issues the attention's
    and the MLP's closing TP collective: a replay under op-level AC neither (the policy saved the
    reduce-scatters' outputs), under compiled torch's full AC not the MLP's (its output only feeds the
    next layer: :func:`meshplan.compute.recompute.full_ac_not_replayed`), under Megatron-LM's and eager
    torch's both (:func:`meshplan.compute.recompute.full_ac_replays_whole`: torchtitan's ``early_stop=False``)."""
    if phase == "forward":
        return True, True
    if w.recompute == "op":
        return False, False
    return True, full_ac_replays_whole(w.megatron_ops, w.torch_eager)


def _mlp_tp(w: Workload, moe: bool, phase: str, scatter: bool = True) -> tuple[bool, int, int]:
    """``tp_ops`` of a layer's MLP block (:func:`_block`): (opening collective issued, closing
    ones, routed outputs' all-gathers), a dense block's (True, 1, 0) and an MoE block's from
    ``Workload.moe_tp_ops``, the collective table's rule
    (:func:`meshplan.spec.axes.moe_tp.moe_mlp_tp_ops`). A replay (``phase`` not "forward") issues as
    the table counts it (:func:`meshplan.comm.tp_rows._tp_layer_ops`): ``scatter``
    (:func:`replay_scatters`) False drops the last closing collective (full or per-layer AC:
    all but the layer's last collective; op-level AC, ``recompute = "op"``: none).

    >>> two = Workload(seq_len=8, tp=2, sp=True, moe_tp_ops=("all-gather", "reduce-scatter", "reduce-scatter"),
    ...                recompute="full")
    >>> _mlp_tp(two, True, "forward"), _mlp_tp(two, True, "backward_input", False), _mlp_tp(two, False, "forward")
    ((True, 2, 0), (True, 1, 0), (True, 1, 0))
    >>> _mlp_tp(Workload(seq_len=8, tp=2, sp=True, moe_tp_ops=()), True, "forward")
    (False, 0, 0)
    >>> _mlp_tp(Workload(seq_len=8, tp=2, sp=True, moe_tp_ops=two.moe_tp_ops, recompute="op"), True, "backward_input", False)
    (True, 0, 0)
    """
    before, after = tp_collectives(w)
    ops = w.moe_tp_ops if moe else tuple(o for o in (before, after) if o)
    opens, closes = before in ops, ops.count(after)
    routed = 0 if w.sp else ops.count("all-gather")
    if phase != "forward" and not scatter and w.recompute == "op":
        closes = routed = 0
    elif phase != "forward" and not scatter:  # the last: the closing all-reduce or reduce-scatter, else the routed
        closes, routed = (closes - 1, routed) if closes else (0, max(routed - 1, 0))
    return opens, closes, routed


def forward_layer(s: StreamSim, c: Cost, moe: bool, phase: str = "forward", recompute=None) -> None:
    """Issue one transformer layer's forward on ``s`` (its streams; seconds from ``c``, the
    layer's :class:`Cost`): norms, attention and MLP blocks with their TP/CP/EP collectives and
    the registered axes' slots; ``phase = "backward_input"`` with ``recompute`` replays the
    forward ops a checkpointed layer recomputes before its backward; ``moe``: MoE MLP."""
    scatter, scatter_mlp = replay_scatters(s.w, phase)
    t = s.of(_times, c, phase, recompute)
    f = s.of(fused_gemms, c, phase, recompute, s.w.async_tp, s.w.tp, _rowwise(s.w)) if s.w.async_tp and s.w.sp else {}
    own = "forward" if phase == "forward" else None  # the registered axes' slots: not in a replay
    s.compute("norm", t["attn_pre"])
    p = s.of(cp_parts, c, phase, recompute) if s.w.cp > 1 else None
    _slots(s, own, At.BEFORE, Block.ATTN)
    amax_wait(s, c, "attn", "forward")
    _block(s, "attention", t["attn"], "forward", cp=(p["kv"], p["q"], p["core"], p["out"], p["sdpa"], p["steps"]) if p else None,
           cp_phase="forward" if phase == "forward" else "backward", fused=f.get("attn"), tp_ops=(True, int(scatter), 0))
    qkv_gather(s, "forward" if phase == "forward" else "backward", "all-gather")
    _slots(s, own, At.AFTER, Block.ATTN)
    s.compute("add+norm", t["attn_post"] + t["mlp_pre"])
    _slots(s, own, At.BEFORE, Block.MLP)
    amax_wait(s, c, "mlp", "forward")
    # op-level AC's replay issues no ep all-to-all where the policy saved their outputs (routed_sizes.routed_sizes),
    # again where it did not (238fa99's Qwen3: Workload.op_replays_ep)
    ep = moe and (phase == "forward" or s.w.recompute != "op" or s.w.op_replays_ep)
    shared = s.of(shared_forward_s, c, phase, recompute) if ep and s.w.shared_beside_combine else 0.0
    _block(s, "mlp", t["mlp"], "forward", ep=ep, fused=f.get("mlp"), tp_ops=_mlp_tp(s.w, moe, phase, scatter_mlp),
           shared=shared)
    _slots(s, own, At.AFTER, Block.MLP)
    s.compute("add", t["mlp_post"])
    _slots(s, own, At.OVERLAPPED)


def module_replay(s: StreamSim, c: Cost, moe: bool) -> float:
    """Megatron-LM's selective recompute modules that replay collectives
    (:func:`meshplan.spec.recompute_modules.replayed_tp_ops`), issued before the MLP's backward as
    forward blocks (:func:`_block`, the rows of phase "forward" timing them, as a full replay's):
    ``mlp`` or ``moe`` the MLP block's replay with its tp collectives (and ``moe``'s ep calls), then
    ``shared_experts`` the shared experts' tp pair around their replayed ops
    (:func:`meshplan.compute.recompute.shared_replay_seconds`). Returns the seconds of the MLP
    block's replayed ops run here, which the backward's MLP block leaves out; 0 where no such
    module acts (other recompute policies replay with :func:`forward_layer`)."""
    if s.w.recompute != "selective" or not (parts := layer_parts(s.w.recompute_modules, moe, False)) & REPLAYING:
        return 0.0
    total = c.seconds("backward_input", "mlp", True)
    shared = s.of(shared_replay_seconds, c) if "shared_experts" in parts else 0.0
    if parts & {"mlp", "moe"}:
        _block(s, "mlp (recompute)", total - shared, "forward", ep="moe" in parts, tp_ops=_mlp_tp(s.w, moe, "forward"))
    if shared > 0:  # a dense tp MLP: all-gather and reduce-scatter with SP, all-reduce without
        _block(s, "shared experts (recompute)", shared, "forward")
    return total if parts & {"mlp", "moe"} else shared


#: The selective recompute modules whose replay issues collectives (:func:`module_replay`).
REPLAYING = frozenset({"mlp", "moe", "shared_experts"})


def any_recompute(c: Cost) -> bool:
    """Whether any op of the layer cost ``c`` is recomputed in backward (checkpointed)."""
    return any(o.recompute for o in c.ops)


def backward_layer(s: StreamSim, c: Cost, moe: bool, with_w: bool) -> None:
    """Issue one transformer layer's backward on ``s`` (seconds from ``c``, the layer's
    :class:`Cost`): the recomputed forward first when the layer is checkpointed, then the MLP
    and attention blocks' input gradients, with their weight gradients when ``with_w`` (false:
    deferred, zero-bubble schedules), and their TP/CP/EP collectives; ``moe``: MoE MLP."""
    # a checkpointed layer (full; torchtitan per-layer or op-level AC) replays its forward's
    # recomputed ops, with their collectives, before its backward
    full = s.w.recompute in ("full", "layer", "op") and s.of(any_recompute, c)
    if full:
        forward_layer(s, c, moe, "backward_input", True)
    b = s.of(_times, c, "backward_input", False if full else None)
    w = s.of(_times, c, "backward_weight") if with_w else dict.fromkeys(LAYER_BLOCKS, 0.0)
    row = s.of(_ops_by_block, c, "backward_weight", ROW_PARALLEL_WGRAD) if with_w else dict.fromkeys(LAYER_BLOCKS, 0.0)
    col = s.of(_ops_by_block, c, "backward_input", COLUMN_PARALLEL_DGRAD, False if full else None)
    f = s.of(fused_gemms, c, "backward_input", False if full else None, s.w.async_tp, s.w.tp,
             _rowwise(s.w)) if s.w.async_tp else {}
    s.compute("add grad", b["mlp_post"])
    replayed = 0.0 if full else module_replay(s, c, moe)  # Megatron-LM's mlp, moe, shared_experts
    mlp_row = 0.0 if moe else row["mlp"]          # MoE: the experts' own order (dispatch, combine)
    _slots(s, "backward", At.BEFORE, Block.MLP)
    amax_wait(s, c, "mlp", "backward")
    _block_backward(s, "mlp", b["mlp"] - replayed, w["mlp"] - mlp_row, ep=moe, t_w_row=mlp_row, t_b_col=col["mlp"],
                    fused=f.get("mlp"), tp_ops=_mlp_tp(s.w, moe, "forward"))
    _slots(s, "backward", At.AFTER, Block.MLP)
    s.compute("norm+add grad", b["mlp_pre"] + b["attn_post"])
    p = s.of(cp_parts, c, "backward_input", False if full else None) if s.w.cp > 1 else None
    _slots(s, "backward", At.BEFORE, Block.ATTN)
    amax_wait(s, c, "attn", "backward")
    if not full:  # Megatron-LM's mla_up_proj replay: its up-projections gather their latents again
        mla_up_gathers(s)  # (spec.recompute_modules.mla_up_gathers)
    _block_backward(s, "attention", b["attn"], w["attn"] - row["attn"], cp=(p["core"], p["q"], p["kv"], p["sdpa"], p["replay"], p["steps"], p["replay_steps"]) if p else None,
                    t_w_row=row["attn"], t_b_col=col["attn"], fused=f.get("attn"))
    qkv_gather(s, "backward", "reduce-scatter")
    _slots(s, "backward", At.AFTER, Block.ATTN)
    s.compute("norm grad", b["attn_pre"])
    _slots(s, "backward", At.OVERLAPPED)
