"""The check a search test makes of one candidate against its exact plan (tests/test_search_vshape.py's
V schedules, tests/test_search_zbh1.py's ZB-H1): the search's memory bounds hold the plan's timeline
peak, its step bound is at most the exact step, and its verdict is the plan's."""

from __future__ import annotations

from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.space import CODE, OK, REASONS

#: Relative slack of a bound against the exact value (float rounding only).
EPS = 1e-9


def check_exact(r, i: int, plan, checked: dict) -> None:
    """Candidate ``i`` of search result ``r`` against ``plan`` (build_plan of its config): its peak
    within ``r.est``'s memory bounds; feasible, its step bound at most step_time's step and its code
    OK (or the GEMM-efficiency rule's); infeasible, over memory by the plan's first reason and by the
    search's code. Counts the verdict in ``checked["feasible"]`` or ``checked["memory"]``."""
    label = r.candidates.label(i)
    peak = max(tl.peak.total_bytes for tl in plan.timelines)
    assert r.est.peak_lo[i] <= peak * (1 + EPS) and peak <= r.est.peak_hi[i] * (1 + EPS), label
    if plan.feasible:
        assert r.est.step_lo[i] <= step_time(plan, Overlap()).step_s * (1 + EPS), label
        assert r.code[i] in (OK, CODE["gemm"]), (label, REASONS[r.code[i]])
        checked["feasible"] += 1
    else:
        assert r.code[i] == CODE["memory"] and plan.reasons[0].startswith("peak"), (label, plan.reasons)
        checked["memory"] += 1
