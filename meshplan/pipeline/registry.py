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
from meshplan.spec.mesh import Schedule, multi_stage_refusal

SCHEDULES: dict[Schedule, PipelineSchedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZBV,
                                                                 DUALPIPEV)}


def get(schedule: Schedule | str) -> PipelineSchedule:
    """The registered schedule named ``schedule`` (a :class:`Schedule` or its name);
    ConfigError on ``mesh.pp_schedule`` for an unknown name."""
    try:
        return SCHEDULES[Schedule(schedule)]
    except (KeyError, TypeError, ValueError):
        raise ConfigError("mesh.pp_schedule", f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}") from None


def check_chunks(schedule: Schedule | str, v: int) -> None:
    """ConfigError on ``mesh.virtual_stages`` when ``schedule`` runs one chunk per rank and
    ``v > 1`` (the one home of this rule: :func:`meshplan.plan.build_plan` calls it for every
    command, :class:`meshplan.pipeline.simulate.PipelineSpec` for ``step --schedule``); for
    zb_h1, torch's InterleavedZeroBubble, on ``mesh.pp_schedule`` with the words every entry
    point gives (:func:`~meshplan.spec.mesh.multi_stage_refusal`).

    >>> check_chunks("interleaved_1f1b", 2); check_chunks("1f1b", 1)
    >>> check_chunks("1f1b", 2)
    Traceback (most recent call last):
    meshplan.errors.ConfigError: mesh.virtual_stages: v 2 needs schedule interleaved_1f1b or zbv or dualpipev (1f1b runs one chunk per rank); set mesh.pp_schedule to one of them, or virtual_stages = 1
    >>> check_chunks("zb_h1", 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    meshplan.errors.ConfigError: mesh.pp_schedule: InterleavedZeroBubble (zb_h1) with 2 stages per rank is not planned by meshplan: ...
    """
    sched = get(schedule)
    if v > 1 and sched is ZB_H1:
        raise ConfigError("mesh.pp_schedule", multi_stage_refusal(v))
    if v > 1 and not sched.virtual_stages:
        chunked = " or ".join(s.name for s in SCHEDULES.values() if s.virtual_stages)
        raise ConfigError("mesh.virtual_stages", f"v {v} needs schedule {chunked} ({sched.name} runs one chunk per "
                          "rank); set mesh.pp_schedule to one of them, or virtual_stages = 1")


def check_framework(schedule: Schedule | str, framework: str, pp: int, field: str = "mesh.pp_schedule") -> None:
    """ConfigError on ``field`` when ``training.framework`` is megatron, ``pp > 1`` and
    ``schedule`` is not one Megatron-LM runs (``megatron_p2p``: 1F1B, interleaved 1F1B).

    >>> check_framework("interleaved_1f1b", "megatron", 4); check_framework("zbv", "torch", 4)
    >>> check_framework("zbv", "megatron", 4)
    Traceback (most recent call last):
    meshplan.errors.ConfigError: mesh.pp_schedule: zbv is not a Megatron-LM schedule (training.framework "megatron" runs 1f1b, or interleaved_1f1b with virtual stages: get_forward_backward_func in megatron/core/pipeline_parallel/schedules.py); use one of them, or training.framework = "torch"
    """
    if framework != "megatron" or pp <= 1 or get(schedule).megatron_p2p:
        return
    raise ConfigError(field, f"{Schedule(schedule)} is not a Megatron-LM schedule ({_megatron_runs()}); use one of "
                      f"them, or training.framework = \"torch\"")


def _megatron_runs() -> str:
    """What Megatron-LM runs, with the source: the schedules with ``megatron_p2p``."""
    ours = " or ".join(f"{s.name}" + (" with virtual stages" if s.virtual_stages else "")
                       for s in SCHEDULES.values() if s.megatron_p2p)
    return (f"training.framework \"megatron\" runs {ours.replace(' or ', ', or ')}: get_forward_backward_func in "
            f"megatron/core/pipeline_parallel/schedules.py")


def check_searched(schedules, framework: str) -> None:
    """ConfigError on ``search.pp_schedules`` when ``training.framework`` is megatron and the
    list holds schedules Megatron-LM does not run (:func:`check_framework`'s rule, for the
    search's candidates with pp > 1).

    >>> check_searched(["1f1b", "zbv"], "torch")
    >>> check_searched(["1f1b", "zbv", "dualpipev"], "megatron")
    Traceback (most recent call last):
    meshplan.errors.ConfigError: search.pp_schedules: zbv, dualpipev are not Megatron-LM schedules (training.framework "megatron" runs 1f1b, or interleaved_1f1b with virtual stages: get_forward_backward_func in megatron/core/pipeline_parallel/schedules.py); remove them from the list, or set training.framework = "torch"
    """
    foreign = [str(Schedule(s)) for s in schedules if not get(s).megatron_p2p]
    if framework != "megatron" or not foreign:
        return
    one = len(foreign) == 1
    raise ConfigError("search.pp_schedules", f"{', '.join(foreign)} {'is not a' if one else 'are not'} Megatron-LM "
                      f"schedule{'' if one else 's'} ({_megatron_runs()}); remove {'it' if one else 'them'} from the "
                      f"list, or set training.framework = \"torch\"")


def reasons(schedule: Schedule | str, p: int, m: int, v: int, framework: str = "torch") -> tuple[str, ...]:
    """Infeasibility reasons of running ``schedule`` with ``p`` stages, ``m`` micro-batches
    and ``v`` chunks per rank under ``framework`` (``training.framework``; the plan adds them
    to the mesh's validity reasons). A one-chunk schedule with ``v > 1`` runs its ``chunked``
    order, under that order's rules.

    >>> reasons("1f1b", 16, 8, 1), reasons("1f1b", 16, 8, 1, "megatron"), reasons("interleaved_1f1b", 4, 6, 2)
    (('1F1B needs micro-batches (8) >= pp (16) (torch Schedule1F1B)',), (), ())
    """
    return tuple(get(get(schedule).for_chunks(v)).reasons(p, m, v, framework))


def fewest_micro_batches(schedule: Schedule | str, p: int, v: int, framework: str = "torch") -> int:
    """The fewest micro-batches (per schedule run) ``schedule`` runs at ``p`` stages with
    ``v`` chunks per rank under ``framework``: at least ``p`` (below it no stage reaches the
    schedule's steady state, and torch 2.13's ``Schedule1F1B`` refuses it), and then the first
    that the schedule's micro-batch rule (:meth:`~meshplan.pipeline.base.PipelineSchedule.refused`,
    the one formula of its reasons) takes: DualPipeV 2p (``ScheduleDualPipeV``), the looped
    schedules a multiple of torch's rounds (p itself: one round). 1 without a pipeline.

    >>> [fewest_micro_batches(s, 2, v) for s, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2))]
    [2, 2, 2, 4]
    >>> fewest_micro_batches("dualpipev", 4, 2), fewest_micro_batches("1f1b", 1, 1)
    (8, 1)
    """
    if p <= 1:
        return 1
    rule = get(get(schedule).for_chunks(v))
    return next(m for m in range(p, 4 * p + 1) if not rule.refused(p, m, framework))
