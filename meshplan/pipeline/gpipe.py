"""GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism"): every forward, then every backward in micro-batch order; a stage
holds all ``m`` micro-batches. Bubble ``(p - 1) / m``. torch: ``ScheduleGPipe``.

>>> " ".join(u.label() for u in GPIPE.order(4, 3, 1, 2))
'F0 F1 F2 B0 B1 B2'
>>> GPIPE.warmup(4, 3, 1, 2), GPIPE.bubble(4, 8)
(3, 0.375)
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import PipelineSchedule, Unit
from meshplan.pipeline.pair_orders import pairs
from meshplan.spec.mesh import Schedule


class GPipe(PipelineSchedule):
    name = Schedule.GPIPE
    title = "GPipe"
    torch_class = "ScheduleGPipe"
    torch_waits = True

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        """All forwards, then all backwards in micro-batch order (one chunk; v is ignored)."""
        return [Unit("F", i) for i in range(m)] + [Unit("B", i) for i in range(m)]

    def torch_p2p_calls(self, p: int, m: int, v: int, s: int, length: int):
        """:meth:`~.base.PipelineSchedule.torch_p2p_calls` of torch 2.13's
        ``ScheduleGPipe._step_microbatches`` (torch/distributed/pipelining/schedules.py, lines
        of the 2.13.0 wheel): each unit's receive is posted right before it and waited there
        (``fwd_recv`` 908-910, ``bwd_recv`` 936-938: lead 1); every output is sent without a
        wait (``fwd_send`` 917-918, ``bwd_send`` 948-949) but the last forward's and the last
        backward's: the forward sends are waited right after the last forward (927-928), the
        backward sends at the step's end (954-955), a wait the last send's transfer ends (the
        earlier ones went to the same stage before it). The last forward's send waited and then
        the first backward's receive posted and waited are one call here (two one after the
        other in torch; the gradient cannot arrive before that send's transfer ends). Not
        modelled: the earlier sends' own transfers held at those waits (the receiver took each
        before its unit).

        >>> [x.astype(int).tolist() for x in GPIPE.torch_p2p_calls(2, 3, 1, 0, 6)]  # F0 F1 F2 B0 B1 B2
        [[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]]
        """
        unwaited = pairs(np.array([[m]]), m)[1][0] < m - 1  # the order as arrays (all m forwards first)
        return (np.zeros(length, dtype=np.int64), np.ones(length, dtype=np.int64), unwaited,
                np.zeros(length, dtype=bool))

    def warmup(self, p, m, v, s):
        """Every forward runs before the first backward: ``m``."""
        return m


GPIPE = GPipe()
