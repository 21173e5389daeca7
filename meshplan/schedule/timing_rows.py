"""The plan's collective-table rows a ``step`` readiness row stands for (:func:`timing_rows`): ``step
--json``'s ``collectives[].plan_rows``, each with the size, axis, group and busbw ``plan --json`` gives
(newcomer trial 54 #10: step's rows held only times)."""

from __future__ import annotations

from meshplan.schedule.comm_streams import DATA_STEP_AXES, comm_kind, step_stream


def timing_rows(plan, t, stage: int = 0) -> list:
    """The rows of ``stage``'s collective table that the readiness row ``t`` (a
    :class:`~meshplan.schedule.readiness.Timing`: the first occurrence of a (stream, phase, op)) stands
    for: on phase ``step`` those the stream shows (:func:`~meshplan.schedule.comm_streams.step_stream`,
    as :func:`~meshplan.schedule.readiness.step_rows`); else those of its op and phase whose stream is
    ``t.stream``: the data axes' on ``fsdp`` (FSDP's units), another axis's on its own name or its
    kind's (:func:`~meshplan.schedule.comm_streams.comm_kind`: ``loss``, ``tp_async``, ``pp_gather``),
    a per-step row of phase ``backward`` too (FSDP2's SP norm all-reduces at pp > 1, issued in the last
    backward).

    >>> from types import SimpleNamespace as R
    >>> from meshplan.schedule.readiness import Timing
    >>> rows = [R(axis="tp", phase="backward", op="all-reduce", cadence="every norm (SP weight gradients)",
    ...           per_microbatch=True, per_step=False),
    ...         R(axis="dp_shard", phase="backward", op="all-gather", cadence="every layer", per_microbatch=True,
    ...           per_step=False)]
    >>> plan = R(stage=lambda s: R(collectives=rows))
    >>> [r.axis for r in timing_rows(plan, Timing("fsdp", "backward", "all-gather", 0.0, 1.0, 0.5))]
    ['dp_shard']
    >>> [r.cadence for r in timing_rows(plan, Timing("tp", "backward", "all-reduce", 0.0, 1.0, 0.5))]
    ['every norm (SP weight gradients)']
    """
    rows = plan.stage(stage).collectives
    if t.phase == "step":
        return [r for r in rows if r.phase == "step" and r.op == t.op and step_stream(r) == t.stream]
    same = [r for r in rows if r.op == t.op and r.phase == t.phase]
    return [r for r in same if (t.stream == "fsdp" and r.axis in DATA_STEP_AXES) or r.axis == t.stream
            or comm_kind(r) == t.stream]
