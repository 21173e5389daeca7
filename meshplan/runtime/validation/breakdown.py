"""Where the step's time went: the profiled step of one rank split into GEMM kernels,
attention kernels, waits on collectives and the rest, against the same split of the
prediction, so that a step-time error can be traced to its part of the model.

Measured (the rank's ``trace.json``, one profiled step, CPU op events of every thread):

- ``GEMM kernels``: the wall time covered by the innermost ``aten::mm``, ``aten::addmm``,
  ``aten::bmm`` and ``aten::baddbmm`` events (forward and backward; :func:`leaves`: a DTensor
  op's event holds its redistribution and its local op's event, and only the latter is the
  kernel), overlapping events counted once (:func:`covered_s`);
- ``attention kernels``: the innermost fused attention ops and their backward
  (``aten::_scaled_dot_product_*``, without the ``aten::scaled_dot_product_attention``
  wrapper that holds them);
- ``waits on collectives``: ``_c10d_functional::wait_tensor`` (DTensor's TP/SP collectives
  and FSDP2's reduce-scatter wait there); FSDP2's all-gather waits run inside its
  ``FSDP::*`` annotations and are not in this figure, so it is a lower bound;
- ``the rest``: the profiled step minus the time covered by any of the three above
  (elementwise ops, framework and Python time, the optimizer, FSDP2's own waits). Parts
  that ran at the same time on different threads overlap, so the four can sum to a little
  more than the step.

Predicted (:func:`meshplan.schedule.workload.chunk_costs` for the rank's pipeline stage, every
micro-batch, with the measured GEMM table): the ``gemm`` and ``attention`` ops of the layer,
embedding and head costs (forward, backward and recompute); waits = the exposed
communication of :func:`meshplan.schedule.steptime.step_time`; the rest = step minus those. On a GPU
the trace's CPU ops time the launches, not the kernels: the split is meaningful on CPU runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import chunk_costs, workload_of

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_PREFIX = "aten::_scaled_dot_product_"
WAIT_OPS = ("_c10d_functional::wait_tensor",)
PARTS = ("GEMM kernels", "attention kernels", "waits on collectives", "the rest")


def covered_s(events: list[dict]) -> float:
    """Seconds of wall time covered by ``events`` (Chrome trace "X" events, microseconds),
    counting once the time where events nest or overlap, on any thread: DTensor's
    ``aten::mm`` holds the local ``aten::mm`` it dispatches, and both are in the trace.

    >>> covered_s([{"ts": 0, "dur": 10}, {"ts": 2, "dur": 5}, {"ts": 12, "dur": 4}])
    1.4e-05
    """
    total, end = 0.0, float("-inf")
    for a, b in sorted((float(e.get("ts", 0)), float(e.get("ts", 0)) + e.get("dur", 0)) for e in events):
        if b > end:
            total += b - max(a, end)
            end = b
    return total * 1e-6


def leaves(events: list[dict]) -> list[dict]:
    """The events of ``events`` that hold no other of them on their thread: a DTensor op's
    event holds its sharding propagation, any redistribution (a collective under SP) and the
    local op's event; only the local op is the kernel.

    >>> [e["name"] for e in leaves([{"name": "outer", "tid": 1, "ts": 0, "dur": 10},
    ...                             {"name": "inner", "tid": 1, "ts": 4, "dur": 2},
    ...                             {"name": "other thread", "tid": 2, "ts": 1, "dur": 2}])]
    ['inner', 'other thread']
    """
    by_tid: dict = {}
    for e in events:
        by_tid.setdefault(e.get("tid"), []).append(e)
    out = []
    for evs in by_tid.values():
        evs = sorted(evs, key=lambda e: (e.get("ts", 0), -e.get("dur", 0)))
        for i, e in enumerate(evs):
            end = e.get("ts", 0) + e.get("dur", 0)
            inner = next((f for f in evs[i + 1:] if f.get("ts", 0) < end), None)
            if inner is None or inner.get("ts", 0) + inner.get("dur", 0) > end:
                out.append(e)
    return out


def measured_parts(trace: Path, step_s: float) -> dict[str, float]:
    """Seconds per part of :data:`PARTS` in one rank's profiled step (module docstring)."""
    events = [e for e in json.loads(trace.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    total = lambda pred: covered_s(leaves([e for e in events if pred(str(e.get("name", "")))]))
    named = lambda n: n in GEMM_OPS or n.startswith(ATTENTION_PREFIX) or n in WAIT_OPS
    gemm = total(lambda n: n in GEMM_OPS)
    att = total(lambda n: n.startswith(ATTENTION_PREFIX))
    wait = total(lambda n: n in WAIT_OPS)
    return dict(zip(PARTS, (gemm, att, wait, max(step_s - total(named), 0.0))))


def _stage_ops(plan, table) -> list:
    """Every op of stage 0's chunks for one micro-batch (layers, embedding, head)."""
    costs = []
    for ch in chunk_costs(plan, workload_of(plan), table)[0]:
        costs += list(ch.layers) + [c for c in (ch.embed, ch.head) if c is not None]
    return [o for c in costs for o in c.ops]


def predicted_parts(plan, table) -> dict[str, float]:
    """Seconds per part of :data:`PARTS` for stage 0 of ``plan`` (module docstring)."""
    st = step_time(plan, table=table)
    ops = _stage_ops(plan, table)
    by_kind = lambda kind: plan.micro_batches * sum(o.seconds for o in ops if o.kind == kind)
    gemm, att, wait = by_kind("gemm"), by_kind("attention"), sum(st.exposed_s.values())
    return dict(zip(PARTS, (gemm, att, wait, st.step_s - gemm - att - wait)))


def per_step_notes(plan, table) -> dict[str, str]:
    """How the predicted GEMM and attention parts are counted: per step, the calls of stage 0
    over every micro-batch times each call's time (for a ``validate`` run the measured
    per-call times of the staged evidence's local kernels table, its ``measured`` column; its
    ``predicted`` column is the kernel-efficiency model, which the step does not use), and
    what the measured part holds. Newcomer trial 21 read ``attention forward 24 us vs 321 us``
    (per call: that model against the timed call) beside ``attention kernels 2.47 vs 1.26 ms``
    (per step: 2 layers x (321 + 912 us) against the profiled step's SDPA ops)."""
    ops = _stage_ops(plan, table)
    m = plan.micro_batches
    gemm = [o for o in ops if o.kind == "gemm"]
    att = [o for o in ops if o.kind == "attention"]
    fwd = [o for o in att if o.phase == "forward"]
    bwd = [o for o in att if o.phase != "forward"]
    us = lambda sel: f"{sel[0].seconds * 1e6:.0f} us" if sel else "0 us"
    return {
        "GEMM kernels": f"per step: {m * len(gemm)} GEMM calls (forward, data and weight gradient) x their "
                        "per-call times (local kernels table, measured column); measured: the profiled step's "
                        "aten::mm/addmm/bmm/baddbmm",
        "attention kernels": f"per step: {m * len(fwd)} forward x {us(fwd)} + {m * len(bwd)} backward x {us(bwd)} "
                             "per call (local kernels table, measured column: its predicted column is the "
                             "kernel-efficiency model, not used here); measured: the profiled step's "
                             "aten::_scaled_dot_product_* ops alone (the timed call also holds autograd's overhead)"}


def breakdown_rows(plan, table, folder: Path, rank: int, step_s: float) -> list[dict]:
    """Rows ``step part: <part>`` (seconds) for ``rank``'s profiled step, measured against
    predicted; none when the trace is missing or the prediction fails."""
    trace = folder / f"rank{rank}" / "trace.json"
    if not trace.exists():
        return []
    try:
        pred, how = predicted_parts(plan, table), per_step_notes(plan, table)
    except Exception:  # the step-time model is optional here, as in evidence.predicted_times
        return []
    meas = measured_parts(trace, step_s)
    return [dict(quantity=f"step part: {p}", unit="s", predicted=pred[p], measured=meas[p], measured_min=None,
                 rank=rank, error=(meas[p] / pred[p] - 1) if pred[p] else None,
                 note=f"profiled step of rank {rank} ({step_s * 1e3:.1f} ms)" + (f"; {how[p]}" if p in how else ""))
            for p in PARTS]


#: Kinds of the local kernels table (``staged.json`` ``kernels``) -> the step part holding them.
KERNEL_PARTS = {"gemm": "GEMM kernels", "attention forward": "attention kernels",
                "attention backward": "attention kernels"}
#: The pre-launch kernel times are marked suspect where the profiled step's differ by more than this factor.
SUSPECT_FACTOR = 2.0


def in_step_ratios(rows) -> dict[str, tuple[float, float, float]]:
    """Per kernel part (GEMM, attention), (pre-launch per step, in the profiled step, in-step /
    pre-launch) from a world's ``predicted_vs_measured`` rows (``rows``). The ``step part``
    rows' predicted GEMM and attention seconds are the local kernels table's measured per-call
    times (timed in the validate process before the launch) x the calls per step
    (:func:`per_step_notes`); their measured seconds are the same kernels in the profiled step
    (:func:`measured_parts`). A ratio off by more than :data:`SUSPECT_FACTOR` marks that
    pre-launch timing suspect (newcomer trial 54 #4: attention 36.84 ms before the launch against
    0.43 ms in the step, 8 ranks on 2 cores).

    >>> rows = [dict(quantity="step part: GEMM kernels", predicted=0.02093, measured=0.00135),
    ...         dict(quantity="step part: attention kernels", predicted=0.001, measured=0.0012)]
    >>> {k: round(v[2], 4) for k, v in in_step_ratios(rows).items()}
    {'GEMM kernels': 0.0645, 'attention kernels': 1.2}
    """
    out = {}
    for r in rows:
        part = str(r.get("quantity", "")).removeprefix("step part: ")
        if part in KERNEL_PARTS.values() and r.get("predicted") and r.get("measured") is not None:
            out[part] = (r["predicted"], r["measured"], r["measured"] / r["predicted"])
    return out


def suspect(ratio: float) -> bool:
    """Whether an in-step / pre-launch ratio is off by more than :data:`SUSPECT_FACTOR` either way."""
    return not 1 / SUSPECT_FACTOR <= ratio <= SUSPECT_FACTOR
