"""Order of forward and backward passes on one pipeline stage during one training step.

An op is ``(phase, chunk, microbatch)``: the forward or backward pass of model chunk
``chunk`` (virtual stage; 0 without interleaving) of this stage for one micro-batch.

The order is the schedule's own (:mod:`meshplan.pipeline`, one module per schedule, where
each cites its source): GPipe holds all m micro-batches, 1F1B stage k ``min(m, pp - k)``,
interleaved 1F1B its warm-up + 1 chunk passes
(:meth:`~meshplan.pipeline.interleaved.Interleaved1F1B.warmup`). A one-chunk schedule given
vpp > 1 is walked in its ``chunked`` order (1F1B and ZB-H1: interleaved 1F1B).

ZB-H1 splits the backward into input (B) and weight (W) gradients and delays W on later
stages (W of j after B of j + s on stage s). torch 2.13 runs its B as ``stage_backward_input``, an
``autograd.grad`` with ``retain_graph=True`` that frees no saved activation; they go with the W
(:mod:`meshplan.memory.wlag`). So under ZB-H1 (``frees_at_weight``) the backward op, which frees a
micro-batch's activations, is placed at its W and its B is dropped: stage s holds ``min(m, p)``
micro-batches (1F1B: ``min(m, p - s)``); the output gradients the lagging W passes hold are the
timeline's ``w_lag`` bytes (:func:`meshplan.memory.wlag.lag_hold_bytes`). ZB-V and DualPipeV run
the same torch passes, so their backward op stands at the W too (every ``splits_backward`` schedule:
:func:`frees_at_w`): their F-to-W count equals their F-to-B count on every rank (torch's orders at p 4,
m 8: 8 on ZB-V's, 9 on DualPipeV's), and no forward runs while a W lags, but their cool-down's lagging
W passes (``lagging_weights``: 2s + 1 on ZB-V's rank s, s + 1 on DualPipeV's, as torch's order) hold
their chunks' activations and output gradients past B: each backward pass holds the output gradients
of the chunk passes whose B is done and W not at its W, its own included
(:func:`meshplan.memory.wlag.cooldown_lag_levels`, the timeline's per-pass lag level).

>>> stage_ops("1f1b", stage=2, pp=4, m=3)
[('forward', 0, 0), ('forward', 0, 1), ('backward', 0, 0), ('forward', 0, 2), ('backward', 0, 1), ('backward', 0, 2)]
>>> [max_in_flight(stage_ops("1f1b", k, 4, 8)) for k in range(4)], max_in_flight(stage_ops("gpipe", 0, 4, 8))
([4, 3, 2, 1], 8)
>>> max_in_flight(stage_ops("interleaved_1f1b", 0, 4, 8, vpp=2)), max_in_flight(stage_ops("interleaved_1f1b", 3, 4, 8, vpp=2))
(11, 5)
>>> [max_in_flight(stage_ops("zb_h1", k, 4, 8)) for k in range(4)]
[4, 4, 4, 4]
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.fast import order_arrays
from meshplan.pipeline.registry import get
from meshplan.spec.mesh import Schedule

Op = tuple[str, int, int]


def stage_ops(schedule: Schedule | str, stage: int, pp: int, m: int, vpp: int = 1) -> list[Op]:
    """Passes of stage ``stage`` in execution order: the registered schedule's order
    (:meth:`meshplan.pipeline.base.PipelineSchedule.order`; for vpp > 1 that of
    ``for_chunks(vpp)``), its F units as forward passes, its B units as backward passes
    (a split schedule's, :func:`frees_at_w`, W units as the backward passes, its B units dropped:
    see the module docstring)."""
    sched = get(get(schedule).for_chunks(vpp))
    phase = {"F": "forward", "W" if frees_at_w(sched) else "B": "backward"}
    return [(phase[u.kind], u.chunk, u.mb) for u in sched.order(pp, m, vpp, stage) if u.kind in phase]


def frees_at_w(sched) -> bool:
    """Whether the timeline frees a chunk pass's activations at its W (the schedule's
    ``frees_at_weight``, ZB-H1, or any other ``splits_backward`` one: ZB-V, DualPipeV; torch's
    input-gradient pass frees none, :mod:`meshplan.memory.wlag`), not at its B.

    >>> [frees_at_w(get(get(n).for_chunks(v))) for n, v in (("zb_h1", 1), ("zbv", 2), ("1f1b", 1), ("zb_h1", 2))]
    [True, True, False, False]
    """
    return bool(sched.frees_at_weight or sched.splits_backward)


def max_in_flight(ops: list[Op]) -> int:
    """Most chunk passes forwarded and not yet backwarded at any point of ``ops``."""
    live = top = 0
    for phase, _, _ in ops:
        live += 1 if phase == "forward" else -1
        top = max(top, live)
    return top


def stage_op_arrays(schedule: Schedule | str, stage: int, pp: int, m: int,
                    vpp: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`stage_ops` as arrays (phase: 0 forward, 1 backward; chunk; micro-batch), from
    the schedule's array order (:func:`meshplan.pipeline.fast.order_arrays`).

    >>> [a.tolist() for a in stage_op_arrays("zb_h1", stage=1, pp=3, m=3)]  # F0 F1 B0 F2 B1 W0 B2 W1 W2
    [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 2, 0, 1, 2]]
    """
    sched = get(get(schedule).for_chunks(vpp))
    kind, mb, chunk = order_arrays(sched.name, pp, m, vpp, stage)
    back = 2 if frees_at_w(sched) else 1  # the unit that frees: W (split backward) or B (full backward)
    keep = (kind == 0) | (kind == back)
    return np.minimum(kind[keep], 1).astype(np.int64), chunk[keep].astype(np.int64), mb[keep].astype(np.int64)
