"""The search's rule ``zbv-fsdp``: under framework torch a ZB-V row with FSDP2 over a data axis is
rejected (torch 2.13's ScheduleZBVZeroBubble never reduce-scatters one of pp rank 0's layer units:
:data:`meshplan.pipeline.zbv.FSDP2_DEFECT`, measured by ``meshplan validate``), counted, named in
the no-feasible-mesh verdict with its fix; DualPipeV rows and ZB-V without a data axis are kept.
The rule is the plan's warning over the search's columns (one formula:
:meth:`meshplan.pipeline.zbv.ZBVZeroBubble.fsdp2_defect`).

The space (8 GPUs, the 8-layer model of tests/test_search.py, micro-batch 4, no recompute, zero3,
cp 1, dp_replicate 1, tp 1 or 2, pp 2 or 4, reshard_after_forward both ways, the V schedules on):
meshes pp 2 x dp_shard 4, pp 2 x dp_shard 2 x tp 2, pp 4 x dp_shard 2 and pp 4 x tp 2. pp 2 has
vpp 1, 2, 4 (8 layers / 2 stages = 4 a chunk count divides) and ZB-V and DualPipeV at vpp 2: 5
rows; pp 4 has vpp 1, 2 and the two V rows: 4. The three meshes with dp_shard > 1 take both
reshard_after_forward values, pp 4 x tp 2 (FSDP shards nothing) one: 2 x 5 x 2 + 4 x 2 + 4 = 32
candidates, of which the ZB-V rows of the three sharded meshes, 3 x 2 = 6, break the rule; the ZB-V
row of pp 4 x tp 2 does not."""

from __future__ import annotations

import pytest

from meshplan.pipeline.zbv import FSDP2_DEFECT, ZBV
from meshplan.plan_runtime import config_warnings
from meshplan.report.search import count_lines
from meshplan.report.search_fix import infeasible_line
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import PIPELINE
from meshplan.search.driver import search
from meshplan.search.reasons import CODE, ZBV_FSDP_REFUSED, first_reason
from meshplan.search.space import enumerate_candidates
from test_search import config

SPACE = dict(micro_batch=[4], recompute=["none"], sharding=["zero3"], reshard_after_forward=[True, False], tp=[1, 2],
             cp=[1], dp_replicate=[1], pp=[2, 4], tp_comm_overlap=[False], uneven_stages=[False],
             pp_schedules=["1f1b", "zbv", "dualpipev"])
ZBV_NO_DATA = "pp 4 x tp 2, mb 4, none, vpp 2, zero3, zbv"


def _labels(c, rows) -> set[str]:
    return {c.label(i) for i in range(len(c)) if rows[i]}


def test_rule_rejects_the_zbv_rows_with_a_data_axis():
    cfg = config(1, 80.0, **SPACE)
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    zbv = c.ps == PIPELINE.index("zbv")
    assert len(c) == 32 and int(zbv.sum()) == 7 and int((code == CODE["zbv-fsdp"]).sum()) == 6
    assert _labels(c, code == CODE["zbv-fsdp"]) == _labels(c, zbv) - {ZBV_NO_DATA}
    assert (code[c.ps == PIPELINE.index("dualpipev")] != CODE["zbv-fsdp"]).all()


def test_fsdp2_defect_condition():
    """framework torch, pp > 1 and FSDP2 over a data axis, all three."""
    assert bool(ZBV.fsdp2_defect("torch", 2, True)) and not ZBV.fsdp2_defect("megatron", 2, True)
    assert not ZBV.fsdp2_defect("torch", 1, True) and not ZBV.fsdp2_defect("torch", 4, False)


def test_rule_is_the_plans_warning_for_every_candidate():
    """zero3 and hsdp, dp_replicate 1 or 2: a row's plan warns of FSDP2_DEFECT exactly where the rule
    holds on its columns (an hsdp row with dp_shard 1 is rule 'replicate''s first, yet warned too: FSDP2
    replicates over dp_replicate, the warning's condition)."""
    cfg = config(1, 80.0, **{**SPACE, "sharding": ["zero3", "hsdp"], "dp_replicate": [1, 2], "tp": [1],
                             "reshard_after_forward": [True]})
    c = enumerate_candidates(cfg)
    rule = (c.ps == PIPELINE.index("zbv")) & ZBV.fsdp2_defect("torch", c.pp, c.fsdp2_over_data)
    warned = [any(FSDP2_DEFECT in w for w in config_warnings(candidate_config(cfg, c, i))) for i in range(len(c))]
    assert warned == rule.tolist() and sum(warned) == 4  # zbv at pp 2 x ds 4, 2 x 2 (hsdp), 4 x 2, pp 4 x dpr 2
    code = first_reason(cfg, c)
    assert int((code == CODE["zbv-fsdp"]).sum()) == 3 and int((rule & (code == CODE["replicate"])).sum()) == 1


@pytest.fixture(scope="module")
def v_search():
    return search(config(1, 80.0, **SPACE, top=40), workers=1)


def test_counted_and_dualpipev_still_offered(v_search):
    r = v_search
    assert r.counts()["zbv-fsdp"] == 6
    assert f"  rejected, {ZBV_FSDP_REFUSED}: 6" in count_lines(r)
    shown = [r.candidates.label(e.index) for e in r.top]
    assert any(s.endswith("dualpipev") and "dp_shard" in s for s in shown)  # FSDP2 over dp_shard, V-shaped
    assert not any(s.endswith("zbv") and "dp_shard" in s for s in shown)


def test_verdict_names_the_rule_when_it_is_the_reason():
    """Only zbv searched (pp > 1 only under it) at pp 2, tp 1: the one mesh pp 2 x dp_shard 4, both
    reshard_after_forward values: 2 candidates, both rule zbv-fsdp's."""
    r = search(config(1, 80.0, **{**SPACE, "tp": [1], "pp": [2], "pp_schedules": ["zbv"]}), workers=1)
    assert not r.top and len(r.candidates) == 2
    assert infeasible_line(r) == (f"no feasible mesh: of 2 candidates rule 'zbv-fsdp' rejected 2 ({ZBV_FSDP_REFUSED}); "
                                  "fix: drop zbv from search.pp_schedules or let search.pp include 1")
