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

from meshplan.pipeline.base import PipelineSchedule, Unit
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

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        """1F1B on stage ``s`` (one chunk; v is ignored)."""
        return warmup_pairs_drain(int(self.warmup(p, m, 1, s)), m)

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
