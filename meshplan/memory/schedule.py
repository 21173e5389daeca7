"""Order of forward and backward passes on one pipeline stage during one training step.

An op is ``(phase, chunk, microbatch)``: the forward or backward pass of model chunk
``chunk`` (virtual stage; 0 without interleaving) of this stage for one micro-batch.

The order is the schedule's own (:mod:`meshplan.pipeline`, one module per schedule, where
each cites its source): GPipe holds all m micro-batches, 1F1B stage k ``min(m, pp - k)``,
interleaved 1F1B its warm-up + 1 chunk passes
(:meth:`~meshplan.pipeline.interleaved.Interleaved1F1B.warmup`). A one-chunk schedule given
vpp > 1 is walked in its ``chunked`` order (1F1B and ZB-H1: interleaved 1F1B).

ZB-H1 splits the backward into input (B) and weight (W) gradients and delays W on later
stages; its peak over all stages stays 1F1B's (the first stage's ``pp`` micro-batches).
Its F/B order is 1F1B's and W is folded into B here: the first stage is exact; on stage
k > 0 the inputs of the weight-gradient GEMMs of up to k delayed W passes are not counted
(an underestimate there, bounded by stage 0's peak).

>>> stage_ops("1f1b", stage=2, pp=4, m=3)
[('forward', 0, 0), ('forward', 0, 1), ('backward', 0, 0), ('forward', 0, 2), ('backward', 0, 1), ('backward', 0, 2)]
>>> [max_in_flight(stage_ops("1f1b", k, 4, 8)) for k in range(4)], max_in_flight(stage_ops("gpipe", 0, 4, 8))
([4, 3, 2, 1], 8)
>>> max_in_flight(stage_ops("interleaved_1f1b", 0, 4, 8, vpp=2)), max_in_flight(stage_ops("interleaved_1f1b", 3, 4, 8, vpp=2))
(11, 5)
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
    (a split schedule's W units are folded into their B, see the module docstring)."""
    sched = get(get(schedule).for_chunks(vpp))
    phase = {"F": "forward", "B": "backward"}
    return [(phase[u.kind], u.chunk, u.mb) for u in sched.order(pp, m, vpp, stage) if u.kind in phase]


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

    >>> [a.tolist() for a in stage_op_arrays("zb_h1", stage=1, pp=3, m=3)]
    [[0, 0, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 0, 2, 1, 2]]
    """
    kind, mb, chunk = order_arrays(get(schedule).for_chunks(vpp), pp, m, vpp, stage)
    keep = kind < 2  # W units fold into their B
    return kind[keep].astype(np.int64), chunk[keep].astype(np.int64), mb[keep].astype(np.int64)
