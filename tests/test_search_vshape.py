"""The search with the V-shaped pipeline schedules (``[search] pp_schedules``): candidates
with pp > 1 and vpp 2 are also planned under ZB-V and DualPipeV; every such candidate's
verdict equals build_plan's, its memory bounds hold around the exact timeline peak and its
step-time lower bound stays at or under the exact step (8 GPUs, the 8-layer model of
tests/test_search.py, 6 GB of HBM so that memory decides some, micro-batches of 8 so that
DualPipeV's m >= 2 pp rejects some: pp 4 x dp 2 runs 64 / 16 = 4 < 8)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.errors import ConfigError
from meshplan.memory import constraints as cons
from meshplan.pipeline.vshape import RESHARD_DEFECT
from meshplan.plan import build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.search.driver import search
from meshplan.search.space import CODE, PIPELINE, candidate_config
from meshplan.spec.mesh import Schedule
from search_verdicts import check_exact
from test_search import config



@pytest.fixture(scope="module")
def v_search():
    cfg = config(1, 6.0, micro_batch=[1, 8], recompute=["selective", "full"], pp_schedules=["1f1b", "zbv", "dualpipev"],
                 top=8)
    return cfg, search(cfg, workers=1)


@pytest.mark.slow
def test_v_candidates_bounds_and_verdicts_equal_the_exact_plan(v_search):
    cfg, r = v_search
    c = r.candidates
    v_rows = np.flatnonzero(c.ps > 0)
    assert set(c.vpp[v_rows]) == {2} and set(c.pp[v_rows]) == {2, 4} and set(c.ps[v_rows]) == {1, 2}
    checked = {"feasible": 0, "memory": 0, "dualpipev": 0, "v-reshard": 0}
    constraints = {}
    for i in v_rows:
        cc = candidate_config(cfg, c, int(i))
        assert cc.mesh.pp_schedule is Schedule(PIPELINE[c.ps[i]]) and cc.mesh.virtual_stages == 2
        if cc.training not in constraints:
            constraints[cc.training] = cons.constraints(cc.model, cc.training, cc.cluster, cc.cluster.world)
        plan = build_plan(cc, constraints[cc.training])
        if r.code[i] in (CODE["framework"], CODE["replicate"]):  # zero1, ddp under torch: the search's own rules, no bound
            continue
        if r.code[i] == CODE["v-reshard"]:  # the search's own rule, no bound: the plan carries its warning
            assert any(RESHARD_DEFECT in n for n in plan.notes), c.label(i)
            checked["v-reshard"] += 1
            continue
        if r.code[i] == CODE["dualpipev"]:
            assert not plan.feasible and plan.reasons[0].startswith("DualPipeV needs micro-batches")
            checked["dualpipev"] += 1
            continue
        assert plan.stages[0][1][-1] == cfg.model.layers - 1  # stage 0 holds the last layer (a V)
        check_exact(r, int(i), plan, checked)
    assert min(checked.values()) > 0, checked


@pytest.mark.slow
def test_v_candidates_planned_exactly_are_reported_with_their_schedule(v_search):
    """Every V candidate the search planned exactly carries build_plan + step_time's step and
    is reported with its schedule (JSON ``pp_schedule``, the knobs column)."""
    from meshplan.report.search import knobs, row

    cfg, r = v_search
    v_exact = [e for i, e in r.exact.items() if r.candidates.ps[i] > 0 and e.feasible]
    assert v_exact
    for e in v_exact[:3]:
        plan = build_plan(candidate_config(cfg, r.candidates, e.index))
        assert e.step_s == pytest.approx(step_time(plan, Overlap()).step_s, rel=1e-12)
        d = row(r, e)
        assert d["pp_schedule"] == str(plan.spec.pp_schedule) in ("zbv", "dualpipev")
        assert d["pp_schedule"] in knobs(d)


def test_pp_schedules_is_strict_and_can_leave_the_looped_family_out():
    with pytest.raises(ConfigError, match="search.pp_schedules"):
        config(1, pp_schedules=["gpipe"])
    with pytest.raises(ConfigError, match="search.pp_schedules"):
        config(1, pp_schedules=[])
    cfg = config(1, micro_batch=[1], recompute=["selective"], pp_schedules=["zbv"], pp=[1, 2])
    from meshplan.search.space import enumerate_candidates

    c = enumerate_candidates(cfg)
    assert set(c.ps[c.pp > 1]) == {1} and set(c.vpp[c.pp > 1]) == {2} and (c.pp == 1).any()
