"""GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism"): every forward, then every backward in micro-batch order; a stage
holds all ``m`` micro-batches. Bubble ``(p - 1) / m``. torch: ``ScheduleGPipe``.

>>> " ".join(u.label() for u in GPIPE.order(4, 3, 1, 2))
'F0 F1 F2 B0 B1 B2'
>>> GPIPE.warmup(4, 3, 1, 2), GPIPE.bubble(4, 8)
(3, 0.375)
"""

from __future__ import annotations

from meshplan.pipeline.base import PipelineSchedule, Unit
from meshplan.spec.mesh import Schedule


class GPipe(PipelineSchedule):
    name = Schedule.GPIPE
    title = "GPipe"
    torch_class = "ScheduleGPipe"

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        """All forwards, then all backwards in micro-batch order (one chunk; v is ignored)."""
        return [Unit("F", i) for i in range(m)] + [Unit("B", i) for i in range(m)]

    def warmup(self, p, m, v, s):
        """Every forward runs before the first backward: ``m``."""
        return m


GPIPE = GPipe()
