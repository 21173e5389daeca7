"""torch's context-parallel ring attention on the rank timeline (``training.cp_attention =
"ring"``, the rows of :func:`meshplan.spec.axes.cp.ring_rows`): the attention block's core as the
ring's ``cp`` steps, each ``1/cp`` of its SDPA calls and ring kernels (:data:`RING_OPS`), with
the K/V all-gather beside the first and the fp32 dK/dV shifts beside the next
(:func:`ring_forward`, :func:`ring_backward`), called by :mod:`meshplan.schedule.layer_timeline`.
"""

from __future__ import annotations

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

