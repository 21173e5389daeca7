"""The TP-overlap lines of ``plan`` and ``step``: what ``training.tp_comm_overlap``
(:func:`tp_overlap_line`) or ``step --overlap-tp`` (:func:`ideal_tp_overlap_line`) saves or
costs on the critical stage against blocking TP collectives, and why a saving is 0 ms.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from meshplan.compute import asynctp
from meshplan.compute.measured import host_pace_label
from meshplan.plan import Plan
from meshplan.schedule.step_summary import StepTime


def tp_overlap_line(plan: Plan, st: StepTime, step_fn: Callable[[Plan], StepTime]) -> str:
    """With ``training.tp_comm_overlap`` on and tp > 1: one line naming what the step model runs
    (:func:`meshplan.compute.asynctp.model_name`) and what it saves and costs on the critical
    stage, against the same plan with the overlap off (TP collectives blocking): exposed tp,
    compute (the pieces' smaller GEMMs and the runtime's copies) and the step, each as
    :meth:`StepTime.shown_ms` prints it; ``st``: the plan's step, ``step_fn``: how the caller
    predicts a step (its other options kept). Else empty. Only the step model reads the field
    (the table, memory and placement do not), so the plan is reused with it off."""
    t = plan.config.training
    if not t.tp_comm_overlap or plan.mesh.degree("tp") < 2:
        return ""
    off = step_fn(replace(plan, config=replace(plan.config, training=t.model_copy(update={"tp_comm_overlap": False}))))
    return _overlap_versus_blocking("training.tp_comm_overlap", asynctp.model_name(t.framework,
                                                                                   plan.mesh.sequence_parallel), st, off)


#: What ``step --overlap-tp`` (``Overlap.tp`` without ``training.tp_comm_overlap``) runs: each
#: block's TP collectives on their own stream beside its whole GEMMs
#: (``_block`` in :mod:`meshplan.schedule.layer_timeline`), no GEMM decomposed and no copy, the
#: GEMMs slowed only by the SMs the NCCL kernels hold while they run
#: (:func:`~meshplan.schedule.comm_times.nccl_sm_share`), the next block waiting for them. A what-if,
#: not a bound: a collective longer than the block it runs beside stays exposed, where the config's
#: knob models the runtimes' decomposed GEMMs, whose pieces hide it (newcomer trial 49: Llama-3-70B
#: at tp 8 with SP on 128 dgx-h100, exposed tp 528.78 ms under --overlap-tp against 356.91 ms under
#: TE's modelled userbuffers, tests/test_newcomer49b.py).
IDEAL_TP_OVERLAP = ("whole-GEMM overlap, a what-if, not a bound (each block's TP collectives run on their own "
                    "stream beside its whole GEMMs, which slow only by the SMs NCCL holds, the next block waiting for "
                    "them; it can expose more tp than training.tp_comm_overlap, which models the runtime's "
                    "decomposed GEMMs)")


def ideal_tp_overlap_line(plan: Plan, st: StepTime, blocking: StepTime) -> str:
    """``step --overlap-tp`` on a config without ``training.tp_comm_overlap`` and tp > 1: the
    line :func:`tp_overlap_line` prints for the knob, labelled :data:`IDEAL_TP_OVERLAP`; ``st``:
    the step with ``Overlap.tp``, ``blocking``: the same step without it. Else empty."""
    if plan.config.training.tp_comm_overlap or plan.mesh.degree("tp") < 2:
        return ""
    return _overlap_versus_blocking("--overlap-tp", IDEAL_TP_OVERLAP, st, blocking)


def _overlap_versus_blocking(source: str, what: str, on: StepTime, off: StepTime) -> str:
    """The TP-overlap line: exposed tp, compute and step of ``on`` against ``off`` (blocking),
    each as :meth:`StepTime.shown_ms` prints it, and the milliseconds saved (or cost) per step."""
    on_ms, off_ms = on.shown_ms(), off.shown_ms()
    saved = round(off.step_s * 1e5) - round(on.step_s * 1e5)
    return (f"tp overlap ({source}): {what}; "
            f"exposed tp {on_ms.get('exposed tp', '0.00')} ms (blocking: {off_ms.get('exposed tp', '0.00')} ms), "
            f"compute {on_ms['compute']} ms (blocking: {off_ms['compute']} ms), step {on_ms['step']} ms (blocking: "
            f"{off_ms['step']} ms): {'saves' if saved >= 0 else 'costs'} {abs(saved) / 100:.2f} ms per step"
            f"{_why_nothing_saved(on, off) if saved == 0 else ''}")


def _why_nothing_saved(on: StepTime, off: StepTime) -> str:
    """Why a TP overlap saves 0 ms (:func:`_overlap_versus_blocking`): the critical stage's
    compute stream waits on another stream either way (the one with the most exposed seconds
    in ``on``, named with them), so the tp time hidden turns into waits for it; or, where the
    compute stream's wait for the host's issue (eager DTensor TP, :meth:`StepTime.host_wait_s`)
    grows by what the overlap hides, the host's pace; else the compute slowed by the SMs NCCL
    holds cancels the exposed tp saved; empty when tp exposed nothing."""
    on_ms, off_ms = on.shown_ms(), off.shown_ms()
    host_on, host_off = on.host_wait_s(), off.host_wait_s()
    if round((host_on - host_off) * 1e5) > 0:
        src = host_pace_label(on.units.w.dtensor_host_source)
        return (f": the step is bound by the host's issue of eager DTensor TP's blocks ({src}): the tp "
                f"time hidden becomes waiting for the host ({host_off * 1e3:.2f} -> {host_on * 1e3:.2f} ms per step; "
                f"training.torch_compile = true removes it)")
    others = {k: v for k, v in on.exposed_s.items() if k != "tp" and v > 0}
    if others:
        worst = max(others, key=lambda k: others[k])
        return (f": the step is bound by the {worst} stream (exposed {worst} {on_ms['exposed ' + worst]} ms on "
                f"stage {on.critical_stage}), which the compute stream waits for either way: the tp time hidden "
                f"becomes {worst} wait")
    if "exposed tp" in off_ms:
        return (f": the compute slowed by the SMs NCCL holds ({off_ms['compute']} -> {on_ms['compute']} ms) "
                f"offsets the exposed tp hidden")
    return ""
