"""The registered pipeline schedules: :data:`SCHEDULES` maps each
:class:`~meshplan.spec.mesh.Schedule` to its object; :func:`get` parses a name.

>>> get("interleaved_1f1b").torch_class, get(Schedule.ZB_H1).splits_backward
('ScheduleInterleaved1F1B', True)
>>> [str(s) for s in SCHEDULES]
['gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1', 'zbv', 'dualpipev']
"""

from __future__ import annotations

from meshplan.errors import ConfigError
from meshplan.pipeline.base import PipelineSchedule
from meshplan.pipeline.gpipe import GPIPE
from meshplan.pipeline.interleaved import INTERLEAVED
from meshplan.pipeline.one_f_one_b import ONE_F_ONE_B
from meshplan.pipeline.zb_h1 import ZB_H1
from meshplan.pipeline.zbv import ZBV
from meshplan.pipeline.dualpipev import DUALPIPEV
from meshplan.spec.mesh import Schedule

SCHEDULES: dict[Schedule, PipelineSchedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZBV,
                                                                 DUALPIPEV)}


def get(schedule: Schedule | str) -> PipelineSchedule:
    """The registered schedule named ``schedule`` (a :class:`Schedule` or its name);
    ConfigError on ``mesh.pp_schedule`` for an unknown name."""
    try:
        return SCHEDULES[Schedule(schedule)]
    except (KeyError, TypeError, ValueError):
        raise ConfigError("mesh.pp_schedule", f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}") from None


def reasons(schedule: Schedule | str, p: int, m: int, v: int) -> tuple[str, ...]:
    """Infeasibility reasons of running ``schedule`` with ``p`` stages, ``m`` micro-batches
    and ``v`` chunks per rank (the plan adds them to the mesh's validity reasons)."""
    return tuple(get(schedule).reasons(p, m, v))
