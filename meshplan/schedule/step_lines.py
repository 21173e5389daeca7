"""The printable summary of a predicted step (:func:`summary_lines`, what
:meth:`meshplan.schedule.step_summary.StepTime.lines` prints): step time and schedule, the
bubble as the schedule's fraction with its closed form for uniform stages, the FSDP waits, the
exposed communication, the parts that add up to the step, the host, offload and recompute
lines, tokens/s, MFU and HFU with what parts HFU above MFU, and each framework's own figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.schedule.contention_line import contention_line
from meshplan.schedule.fsdp_waits import WAITS_BUSY, fsdp_wait_line
from meshplan.schedule.offload_step import offload_line
from meshplan.schedule.stage_balance import closed_form, imbalance_clause, uniform_line
from meshplan.spec.mesh_words import schedule_words

if TYPE_CHECKING:
    from meshplan.schedule.step_summary import StepTime


def _other_stage_clause(st: StepTime) -> str:
    """Where the bubble ratios' stage (the busiest: the schedule's bubble is measured against
    the most work) is not the critical one (where the step ends, which :meth:`~meshplan.schedule.step_summary.StepTime.parts_line`
    splits), the clause that ties them, with the critical stage's idle as a fraction of the
    step and of its busy time, from the same simulated timeline as the parts: ``; the step's
    parts below are on stage 0, where the step ends: bubble 32991.72 ms is its idle, 0.7137 of
    the step (2.4933 as idle/ideal)`` (DeepSeek-V3 example, whose schedule's bubble is 0.1217
    idle/ideal on stage 7); else empty."""
    s = st.critical_stage
    if st.pipeline.busiest_stage == s:
        return ""
    shown = st.shown_ms()
    idle, step = float(shown["bubble"]), float(shown["step"])
    return (f"; the step's parts below are on stage {s}, where the step ends: bubble "
            f"{shown['bubble']} ms is its idle, {idle / step:.4f} of the step ({idle / (step - idle):.4f} as "
            f"idle/ideal)")


def _closed_form_bubble(st: StepTime) -> str:
    """The schedule's closed-form bubble for uniform stages without p2p time, beside the
    simulated one (handed case C11: 1F1B at p 4, m 8 gives 0.375 idle/ideal, 0.2727
    idle/total); only where it does not depend on the F, B, W unit times (schedules that
    do not split the backward), else empty (:func:`~meshplan.schedule.stage_balance.closed_form`);
    then, where the measured idle exceeds it by more than twice, the longest stage
    (:func:`~meshplan.schedule.stage_balance.imbalance_clause`)."""
    x = closed_form(st.pipeline.spec)
    if x is None:
        return ""
    return f"; closed form for uniform stages: {x:.4f} idle/ideal, {x / (1 + x):.4f} idle/total" + \
        imbalance_clause(st)


def summary_lines(st: StepTime) -> list[str]:
    """``st``'s printable summary with the definitions named (:meth:`~meshplan.schedule.step_summary.StepTime.lines`)."""
    p, shown = st.pipeline, st.shown_ms()
    exp = ", ".join(f"{st.named(k)} {shown['exposed ' + k]} ms" for k, v in sorted(st.exposed_s.items())
                    if v > 0) or "none"
    most = st.most_exposed_stage()
    other = [] if most is None else [
        f"most exposed communication: stage {most[0]} (not the critical stage; its units): "
        + ", ".join(f"{st.named(k)} {v * 1e3:.2f} ms" for k, v in sorted(most[1].items()) if v > 0)]
    runs = f" x {st.runs} runs" if st.runs > 1 else ""
    sched = schedule_words(p.spec.schedule, p.spec.p) + (f", p {p.spec.p}" if p.spec.p > 1 else "")
    # pp 1 has no pipeline: no bubble line (its idle/ideal would print 0.0000 for a schedule that is not run)
    bubble = [] if p.spec.p == 1 else [
        f"bubble {p.bubble:.4f} as idle/ideal, {p.bubble_of_total:.4f} as idle/total "
        f"(the schedule's bubble fraction, on the busiest stage {p.busiest_stage}, pipeline only{', each run' if st.runs > 1 else ''}"
        f"{WAITS_BUSY if st.without_fsdp_waits() is not None else ''}{_other_stage_clause(st)})"
        f"{_closed_form_bubble(st)}"]
    return [f"step {shown['step']} ms ({sched}, m {p.spec.m}{runs}{f', v {p.spec.v}' if p.spec.p > 1 else ''}); "
            f"critical stage {st.critical_stage}" + (f"; mesh {st.mesh_text}" if st.mesh_text else "")] + \
        bubble + fsdp_wait_line(st) + uniform_line(p.spec) + [
            f"exposed communication on stage {st.critical_stage}: {exp}", st.parts_line()] + st.host_line() + offload_line(st) + other + [
            st.recompute_line(),
            f"tokens/s {st.tokens_per_s:,.0f}; MFU {st.mfu:.1%} (model FLOP: per-op, causal-half "
            f"attention, no recompute); HFU {st.hfu:.1%} (executed FLOP, recompute included{_gap_text(st)}); "
            f"of the "
            f"{st.peak_flops / 1e12:,.0f} TFLOP/s {st.peak_dtype} dense peak per GPU".rstrip()
            + _compute_peak_text(st)] + \
        st.torchtitan_line() + st.megatron_line() + [f"note: {n}" for n in st.notes] + contention_line(st)


def _compute_peak_text(st: StepTime) -> str:
    """Where MFU's peak is the float8 Linears' (``TrainingSpec.peak_dtype`` fp8) and the compute dtype's
    differs: what that peak counts (every model FLOP, those of the GEMMs left in the compute dtype too:
    attention's, and the routed experts' grouped GEMMs, which torchtitan's float8 Linear converter does not
    convert) and MFU against the compute dtype's peak (newcomer trial 50 #9); "" otherwise."""
    if not st.compute_peak_flops or st.compute_peak_flops == st.peak_flops:
        return ""
    mfu = st.model_flops / (st.step_s * st.world * st.compute_peak_flops)
    return (f" (the float8 Linears' peak, which every model FLOP is divided by, those left in the compute dtype "
            f"too: attention's, and routed experts' grouped GEMMs where the float8 converter leaves them; MFU "
            f"{mfu:.1%} of the {st.compute_peak_flops / 1e12:,.0f} TFLOP/s {st.compute_dtype} dense peak)")


def _gap_text(st: StepTime) -> str:
    """``; above MFU by: flash backward recomputes QK^T 1.1 pp``: each cause of
    :attr:`~meshplan.schedule.step_summary.StepTime.flop_gap` in percentage points of HFU (so HFU above MFU with recompute none says why)."""
    den = st.step_s * st.world * st.peak_flops
    parts = [f"{c} {f / den * 100:.1f} pp" for c, f in st.flop_gap if f / den >= 5e-4]
    return "; above MFU by: " + ", ".join(parts) if parts else ""
