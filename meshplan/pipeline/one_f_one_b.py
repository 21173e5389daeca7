"""1F1B (Narayanan et al. SC'21, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", 2.2.1; PipeDream-Flush): stage s runs ``min(p - s - 1, m)``
warm-up forwards, then alternates one forward and one backward, then drains the backwards;
it holds ``min(m, p - s)`` micro-batches at its peak. Bubble ``(p - 1) / m``. torch:
``Schedule1F1B``, which refuses fewer micro-batches than stages (:meth:`OneFOneB.reasons`);
Megatron-LM runs any m (warm-up ``min(p - s - 1, m)``). With ``v > 1`` chunks per rank a
stage runs the interleaved order.

>>> " ".join(u.label() for u in ONE_F_ONE_B.order(4, 5, 1, 1))
'F0 F1 F2 B0 F3 B1 F4 B2 B3 B4'
>>> [int(ONE_F_ONE_B.in_flight(4, 8, 1, s)) for s in range(4)]
[4, 3, 2, 1]
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import PipelineSchedule, Unit
from meshplan.pipeline.pair_orders import KINDS, pairs
from meshplan.spec.mesh import Schedule


def warmup_pairs_drain(w: int, m: int) -> list[Unit]:
    """``w`` warm-up forwards, ``m - w`` F/B pairs, the remaining backwards."""
    out = [Unit("F", i) for i in range(w)]
    for i in range(m - w):
        out += [Unit("F", w + i), Unit("B", i)]
    return out + [Unit("B", i) for i in range(m - w, m)]


class OneFOneB(PipelineSchedule):
    name = Schedule.ONE_F_ONE_B
    title = "1F1B"
    torch_class = "Schedule1F1B"
    chunked = Schedule.INTERLEAVED_1F1B
    megatron_p2p = True
    torch_waits = True

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        """1F1B on stage ``s`` (one chunk; v is ignored)."""
        return warmup_pairs_drain(int(self.warmup(p, m, 1, s)), m)

    def torch_p2p_calls(self, p: int, m: int, v: int, s: int, length: int):
        """:meth:`~.base.PipelineSchedule.torch_p2p_calls` of torch 2.13's
        ``Schedule1F1B._step_microbatches`` (torch/distributed/pipelining/schedules.py, lines
        cited from the 2.13.0 wheel) on stage ``s``, ``w = min(m, p - s)`` warm-up forwards
        (line 1052; meshplan's order is the same units: its ``p - s - 1`` and the first pair's F):

        - every receive is posted in the call right before its unit and waited there (lead 1):
          the warm-up's ``fwd_recv`` (1067) and the cool-down's ``bwd_recv`` (1153) alone, the
          steady state's inside the fused calls;
        - the output of forward ``i < w - 1`` is sent without a wait in its call
          (``send_work``, 1087), waited after the next forward (1081);
        - the last warm-up forward's and every steady-state forward's output go with the next
          backward's receive in one ``batch_isend_irecv`` waited at once
          (``fwd_send_bwd_recv``, 1105), as a steady-state backward's with the next forward's
          (``bwd_send_fwd_recv``, 1127): one call, both transfers with the same neighbour, whose
          matching call on that neighbour is also one fused call;
        - the output of backward ``m - w <= j < m - 1`` (the last of the steady state, 1147, and
          the cool-down's, 1168) is sent without a wait, waited after the next backward (1164);
          the last backward's is waited right after it, at the step's end (1172).

        Not modelled: those later waits of an unwaited send (its transfer must end before the
        unit after the next one starts); they bind only when the receiver posts more than the
        next unit's duration less one transfer after the sender.

        >>> [x.astype(int).tolist() for x in ONE_F_ONE_B.torch_p2p_calls(4, 6, 1, 1, 12)]  # F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5
        [[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
        """
        w = min(m, p - s)
        kind, mb = (x[0] for x in pairs(np.array([[min(p - s - 1, m)]]), m))  # the order as arrays: no Unit per unit
        unwaited = np.where(kind == KINDS.index("F"), mb < w - 1, (m - w <= mb) & (mb < m - 1))
        return (np.zeros(length, dtype=np.int64), np.ones(length, dtype=np.int64), unwaited,
                np.zeros(length, dtype=bool))

    def refused(self, p, m, framework: str = "torch"):
        """torch 2.13's ``Schedule1F1B.__init__`` raises when ``n_microbatches <
        num_stages`` (p with one stage per rank; torch/distributed/pipelining/schedules.py);
        Megatron-LM's ``forward_backward_pipelining_without_interleaving`` warms up
        ``min(p - s - 1, m)`` and runs any m. Ints or arrays.

        >>> bool(ONE_F_ONE_B.refused(16, 8)), bool(ONE_F_ONE_B.refused(16, 8, "megatron")), bool(ONE_F_ONE_B.refused(4, 4))
        (True, False, False)
        """
        return (m < p) & (framework == "torch")

    def reasons(self, p: int, m: int, v: int, framework: str = "torch") -> list[str]:
        if v > 1 or not m or not self.refused(p, m, framework):  # v > 1: the interleaved order's own rule
            return []
        return [f"1F1B needs micro-batches ({m}) >= pp ({p}) (torch Schedule1F1B)"]


ONE_F_ONE_B = OneFOneB()
