"""Context parallelism's attention block on the rank timeline, called by
:mod:`meshplan.schedule.layer_timeline`: the block's seconds by part (:func:`cp_parts`), its
forward and backward under CP (:func:`cp_attention_forward`, :func:`cp_attention_backward`):
all-gather CP's K/V all-gather after the K/V projections and its dK/dV reduce-scatter beside
the Q and K/V projections' input gradients, or torch's ring attention (``training.cp_attention
= "ring"``, the rows of :func:`meshplan.spec.axes.cp.ring_rows`): the attention block's core as
the ring's ``cp`` steps, each ``1/cp`` of its SDPA calls and ring kernels (:data:`RING_OPS`),
with the K/V all-gather beside the first and the fp32 dK/dV shifts beside the next
(:func:`ring_forward`, :func:`ring_backward`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.ops import Cost
from meshplan.compute.ring_attention import GRAD_ACCUMULATION, MERGE
from meshplan.schedule.unit_sim import StreamSim

#: The ops of torch's ring attention that run as its ``cp`` steps (:mod:`meshplan.compute.ring_attention`):
#: the SDPA calls and the ring's merge and gradient accumulation kernels.
RING_OPS = ("attention", MERGE, GRAD_ACCUMULATION)

#: Name suffixes of the compute events of torch's ring attention (:func:`ring_cp`) that a cp
#: collective runs beside: a forward SDPA call, a backward one (each ``1/cp`` of the calls' seconds).
RING_CALL, RING_CALL_B = " ring call", " ring call B"
#: Name of the last dK/dV shift of a layer's ring backward, which nothing overlaps.
LAST_SHIFT = "cp dK/dV last shift"


def ring_cp(s: StreamSim) -> bool:
    """Whether the stage's table has torch's ring attention rows (the dK/dV shifts,
    :func:`meshplan.spec.axes.cp.ring_rows`): the timeline issues what the table counts."""
    return s.c.get("cp", "backward", "send/recv") > 0


def ring_forward(s: StreamSim, name: str, phase: str, core: float, sdpa: float) -> None:
    """The forward (``phase`` "forward", or "backward": a checkpointed layer's replay) core of
    block ``name`` (``core`` seconds, ``sdpa`` of them the ring's steps), after the Q, K and V
    projections: ``_templated_ring_attention`` issues the K/V all-gather before its first SDPA
    call and waits for it before the second."""
    ring = s.comm("cp", phase, "all-gather", "cp K/V all-gather", after=[s.last])
    s.compute(name + RING_CALL, sdpa / s.w.cp)
    s.compute(name + " core", core - sdpa / s.w.cp, [ring])


def ring_backward(s: StreamSim, name: str, sdpa: float) -> None:
    """torch's ring attention backward (:func:`meshplan.spec.axes.cp.ring_rows`): its own K/V
    all-gather issued before the first of ``cp`` SDPA backward calls (``sdpa``: their seconds and
    the ring's accumulation kernels, ``1/cp`` each) and waited for before the second; after each
    call the fp32 dK/dV shift to the next rank, waited for after the next call; the last one
    after the loop, exposed."""
    cp, step = s.w.cp, sdpa / s.w.cp
    ring = s.comm("cp", "backward", "all-gather", "cp K/V all-gather", after=[s.last])
    s.compute(name + RING_CALL_B, step)
    shift = s.comm("cp", "backward", "send/recv", "cp dK/dV shift" if cp > 1 else LAST_SHIFT, after=[s.last])
    for k in range(1, cp):
        s.compute(name + RING_CALL_B, step, [ring])
        s.compute("dK/dV wait", 0.0, [shift])
        shift = s.comm("cp", "backward", "send/recv", LAST_SHIFT if k == cp - 1 else "cp dK/dV shift", after=[s.last])
    s.compute("dK/dV wait", 0.0, [shift])


_CP_PART = {"wk": "kv", "wv": "kv", "wq": "q", "wq_a": "q", "wq_b": "q", "wkv_a": "kv", "wkv_b": "kv"}


def cp_parts(c: Cost, phase: str, recompute: Optional[bool]) -> dict:
    """Seconds of the attention block's ops of ``phase`` by part: ``kv`` (wk, wv, and RoPE and
    torch's repeat_kv in forward; MLA: wkv_a, wkv_b), ``q`` (wq; MLA: wq_a, wq_b), ``out`` (wo in forward), ``core``
    (the rest; in backward also wo's input gradient and RoPE, which precede dK/dV), and ``sdpa``, the
    part of ``core`` torch's ring attention runs as its steps
    (:data:`~meshplan.schedule.ring_timeline.RING_OPS`). Op names from :mod:`meshplan.compute.ops`."""
    fwd = phase == "forward" or recompute
    out = dict.fromkeys(("kv", "q", "core", "out", "sdpa"), 0.0)
    for o in c.ops:
        if o.block != "attn" or o.phase != phase or recompute not in (None, o.recompute):
            continue
        base = o.name.split(" ")[0].split(".")[0]
        part = _CP_PART.get(base, "core")
        if fwd and base in ("rope", "repeat_kv", "wo"):
            part = "out" if base == "wo" else "kv"
        out[part] += o.seconds
        ring = o.name.removesuffix(" (recompute)") in RING_OPS and bool(o.recompute) == bool(recompute)
        out["sdpa"] += o.seconds if ring else 0.0  # not a recomputed core's forward before the backward's steps
    return out


def cp_attention_forward(s: StreamSim, name: str, cp: tuple, cp_phase: str, waits: list, tp_ov: list) -> None:
    """The attention block ``name``'s forward under CP (``cp``: its K/V proj, Q proj, core, out
    proj, SDPA calls and ring kernels seconds, :func:`cp_parts`; ``cp_phase``: the cp rows' phase,
    "backward" for a checkpointed layer's replay): the K/V projections first (after ``waits``,
    the tp all-gather opening the block unless TP overlaps), then torch's ring (wq, then the
    gather beside the first SDPA call, :func:`ring_forward`) or all-gather CP's K/V all-gather
    issued beside the Q projection, the core waiting for it; the out projection last, the
    block's overlapped tp collectives ``tp_ov`` beside it."""
    kv, q, core, out, sdpa = cp
    s.compute(name + " K/V proj", kv, waits)
    if ring_cp(s):
        s.compute(name + " Q proj", q)
        ring_forward(s, name, cp_phase, core, sdpa)
    else:
        ring = s.comm("cp", cp_phase, "all-gather", "cp K/V all-gather", after=[s.last])
        s.compute(name + " Q proj", q)
        s.compute(name + " core", core, [ring])
    s.compute(name + " out proj", out, [], tp_ov)


def cp_attention_backward(s: StreamSim, name: str, cp: tuple, t_w_row: float, pre, regather: bool):
    """The attention block ``name``'s input gradients under CP (``cp``: core incl. wo and RoPE,
    Q proj, K/V proj and the SDPA calls' seconds; ``t_w_row``: wo's weight gradient, computed
    with its input gradient before the core; ``pre``: the tp collective opening the block):
    torch's ring backward (:func:`ring_backward`) between the core and the projections, or
    all-gather CP's dK/dV reduce-scatter issued after the core, the K/V projections' input
    gradients waiting for it. With ``regather`` (Megatron-LM's SP re-gather for the weight
    gradients) all-gather CP issues the tp all-gather after the reduce-scatter and returns it;
    None otherwise (the ring issues none)."""
    core, q, kv, sdpa = cp
    if ring_cp(s):
        s.compute(name + " core B", core - sdpa + t_w_row, [pre])
        ring_backward(s, name, sdpa)
        s.compute(name + " Q proj B", q)
        s.compute(name + " K/V proj B", kv)
        return None
    s.compute(name + " core B", core + t_w_row, [pre])
    rs = s.comm("cp", "backward", "reduce-scatter", "cp dK/dV reduce-scatter", after=[s.last])
    ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)") if regather else None
    s.compute(name + " Q proj B", q)
    s.compute(name + " K/V proj B", kv, [rs])
    return ag
