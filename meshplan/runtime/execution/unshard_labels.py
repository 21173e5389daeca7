"""The phase the plan gives each FSDP all-gather a torch pipeline schedule's ``UNSHARD`` issues
(:func:`unshard_phases`), for :func:`meshplan.runtime.execution.pipelined_recorder.label_unshard`.

torch 2.13's multi-stage schedules lower each rank's order with ``_add_unshard_reshard``
(``torch/distributed/pipelining/schedules.py`` 1285-1365, a window of 3 local stages,
:mod:`meshplan.pipeline.unshard_window`): an ``UNSHARD`` of a stage is a prefetch for that
stage's next compute action. The plan counts the all-gather on that pass
(:func:`meshplan.comm.fsdp_rows.fsdp_gather_flags` with the window): ``forward`` before an F,
``backward`` before a backward (B, I or W: a chunk evicted from the window at vpp > 3 and
unsharded again for its backward).
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as S

_COMPUTE = (S.FORWARD, S.FULL_BACKWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT)


def unshard_phases(actions, stage_index: int) -> tuple[str, ...]:
    """Phase of each ``UNSHARD`` of virtual stage ``stage_index`` in one rank's lowered actions
    (``schedule.pipeline_order_with_comms[rank]``), in order: that of the stage's next compute
    action (an ``OVERLAP_F_B`` read as its sub-actions, in order, as torch runs them)."""
    out: list[str] = []
    pending = 0
    for a in actions:
        if a is None:
            continue
        for x in (a.sub_actions if a.computation_type == S.OVERLAP_F_B and a.sub_actions else (a,)):
            if x.stage_index != stage_index:
                continue
            if x.computation_type == S.UNSHARD:
                pending += 1
            elif x.computation_type in _COMPUTE and pending:
                out += ["forward" if x.computation_type == S.FORWARD else "backward"] * pending
                pending = 0
    return tuple(out)


def stage_unshard_phases(runner, stage) -> tuple[str, ...]:
    """:func:`unshard_phases` of ``stage`` (a ``PipelineStage``) under ``runner.sched``, or
    ``("forward",)`` where there is no multi-stage schedule (a single-stage schedule issues no
    ``UNSHARD``; a test's runner without one)."""
    order = getattr(getattr(runner, "sched", None), "pipeline_order_with_comms", None)
    if stage is None or not order:
        return ("forward",)
    return unshard_phases(order.get(stage.group_rank, ()), stage.stage_index) or ("forward",)
