"""The search with ZB-H1 (``[search] pp_schedules = ["1f1b", "zb_h1"]``, newcomer trial nc56 #3):
candidates with pp > 1 and vpp 1 are also planned under ZB-H1 (torch ``ScheduleInterleavedZeroBubble``
with one stage per rank). Every such candidate's verdict equals build_plan's (feasible, memory, torch's
rounds rule, the reshard defect), its memory bounds hold around the exact timeline peak and its step-time
lower bound stays at or under the exact step; a row the search planned exactly carries plan + step's
step and peak (8 GPUs, the 8-layer model of tests/test_search.py, 6 GB of HBM so that memory decides
some; micro-batches of 1 and 8: with global batch 64, pp 4 x dp 2 at micro-batch 8 runs 64 / 16 = 4
micro-batches, pp 2 x dp 2 runs 64 / 16 = 4, and pp 2 x dp 4 at micro-batch 8 runs 64 / 32 = 2 micro-batches:
torch's rounds max(1, 2 // 2) = 1, accepted; no 8-GPU row breaks the rounds rule, which
test_zb_h1_rounds_rule_matches_torchs checks on columns)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.memory import constraints as cons
from meshplan.pipeline.zb_h1 import RESHARD_DEFECT, ZB_H1
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.driver import search
from meshplan.search.space import CODE, PIPELINE, candidate_config, enumerate_candidates
from meshplan.spec.mesh import Schedule
from search_verdicts import check_exact
from test_search import config

ZB = PIPELINE.index("zb_h1")


@pytest.fixture(scope="module")
def zb_search():
    cfg = config(1, 6.0, micro_batch=[1, 8], recompute=["none", "full"], pp_schedules=["1f1b", "zb_h1"], top=8)
    return cfg, search(cfg, workers=1)


def test_zb_h1_rows_are_vpp_1_with_pp_above_1_and_keep_the_other_codes():
    """ZB-H1 is appended to PIPELINE (zbv 1 and dualpipev 2 keep their codes); its rows have pp > 1
    and vpp 1 (one stage per rank: torch's class with more stages per rank is refused by the plan),
    the Llama-3 split included; leaving 1f1b out keeps only those at pp > 1."""
    assert PIPELINE.index("zbv") == 1 and PIPELINE.index("dualpipev") == 2 and ZB == 3
    cfg = config(1, micro_batch=[1], recompute=["full"], pp_schedules=["1f1b", "zb_h1"])
    c = enumerate_candidates(cfg)
    zb = c.ps == ZB
    assert zb.any() and set(c.vpp[zb]) == {1} and set(c.pp[zb]) == {2, 4, 8}
    # every 1F1B row at pp > 1 and vpp 1 has its ZB-H1 twin right after it
    one = np.flatnonzero((c.ps == 0) & (c.pp > 1) & (c.vpp == 1))
    assert len(one) == int(zb.sum()) and (c.ps[one + 1] == ZB).all() and (c.pp[one + 1] == c.pp[one]).all()
    only = enumerate_candidates(config(1, micro_batch=[1], recompute=["full"], pp_schedules=["zb_h1"]))
    assert set(only.ps[only.pp > 1]) == {ZB} and set(only.vpp[only.pp > 1]) == {1} and (only.pp == 1).any()


def test_zb_h1_rounds_rule_matches_torchs():
    """Rule ``zb_h1`` is torch's ``ScheduleInterleavedZeroBubble.__init__`` check, m a multiple of
    its rounds max(1, m // pp), by hand at global batch 36, micro-batch 1, 8 GPUs: pp 8 runs 36,
    rounds 36 // 8 = 4, 36 % 4 = 0: kept; pp 4 x dp 2 runs 18, rounds 4, 18 % 4 = 2: rejected;
    pp 2 x dp 4 runs 9, rounds 4, 9 % 4 = 1: rejected; pp 2 x dp 2 (tp 2) runs 18, rounds 9: kept;
    pp 4 (tp 2) runs 36, rounds 9: kept."""
    from meshplan.search.reasons import first_reason

    cfg = config(1, micro_batch=[1], recompute=["full"], pp_schedules=["zb_h1"], training={"global_batch": 36})
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    micro = 36 // c.dp
    zb = (c.ps == ZB) & (code != CODE["batch"])
    want = (micro % np.maximum(1, micro // c.pp)) != 0
    assert (code[zb] == CODE["zb_h1"]).tolist() == want[zb].tolist()
    assert set(zip(c.pp[zb & want].tolist(), c.dp[zb & want].tolist())) == {(4, 2), (2, 4)}
    assert ZB_H1.refused(4, 18) and not ZB_H1.refused(8, 36)


@pytest.mark.slow
def test_zb_h1_candidates_bounds_and_verdicts_equal_the_exact_plan(zb_search):
    cfg, r = zb_search
    c = r.candidates
    rows = np.flatnonzero(c.ps == ZB)
    assert set(c.vpp[rows]) == {1} and set(c.pp[rows]) == {2, 4, 8}
    checked = {"feasible": 0, "memory": 0, "v-reshard": 0}
    constraints = {}
    for i in rows:
        cc = candidate_config(cfg, c, int(i))
        assert cc.mesh.pp_schedule is Schedule.ZB_H1 and cc.mesh.virtual_stages == 1
        if cc.training not in constraints:
            constraints[cc.training] = cons.constraints(cc.model, cc.training, cc.cluster, cc.cluster.world)
        plan = build_plan(cc, constraints[cc.training])
        if r.code[i] in (CODE["framework"], CODE["replicate"], CODE["batch"]):
            continue
        if r.code[i] == CODE["v-reshard"]:  # torch 2.13's I/W split drops weight gradients: the plan warns
            assert any(RESHARD_DEFECT in n for n in plan.notes), c.label(i)
            checked["v-reshard"] += 1
            continue
        # 1F1B's chunk map (no V): the layers in stage order (the Llama 3 split may leave an end stage none)
        assert [x for st in plan.stages for ch in st for x in ch] == list(range(cfg.model.layers)), plan.stages
        check_exact(r, int(i), plan, checked)
    assert min(checked.values()) > 0, checked


@pytest.mark.slow
def test_zb_h1_rows_planned_exactly_carry_the_plans_step_and_peak(zb_search):
    """Every ZB-H1 row the search planned exactly: its step is build_plan + step_time's and its peak
    the plan's timeline peak (the verdict a user gets from ``plan``/``step`` of the exported row), and
    it is reported with its schedule (JSON ``pp_schedule``, the knobs column)."""
    from meshplan.report.search import knobs, row

    cfg, r = zb_search
    exact = [e for i, e in r.exact.items() if r.candidates.ps[i] == ZB and e.feasible]
    assert exact
    for e in exact[:4]:
        plan = build_plan(candidate_config(cfg, r.candidates, e.index))
        assert e.step_s == pytest.approx(step_time(plan, Overlap()).step_s, rel=1e-12)
        assert e.peak_bytes == max(tl.peak.total_bytes for tl in plan.timelines)
        d = row(r, e)
        assert d["pp_schedule"] == str(plan.spec.pp_schedule) == "zb_h1"
        assert "zb_h1" in knobs(d)
