"""The search's rule ``v-reshard``: under framework torch a V-shaped row (ZB-V or DualPipeV) with FSDP2
over a data axis and ``reshard_after_forward`` true is rejected (torch 2.13 computes no weight gradient
for a layer unit resharded after its forward where the schedule splits its backward:
:data:`meshplan.pipeline.vshape.RESHARD_DEFECT`, measured by tests/test_zbv_fsdp_torch.py and
``meshplan validate``), counted, named in the no-feasible-mesh verdict with its fix
(``reshard_after_forward = false``, torchtitan's default under pp); the same rows with
``reshard_after_forward`` false and V rows without a data axis are kept. The rule is the plan's warning
over the search's columns (one formula: :func:`meshplan.pipeline.vshape.reshard_defect`).

The space (8 GPUs, the 8-layer model of tests/test_search.py, global batch 64, micro-batch 4, no
recompute, zero3, cp 1, dp_replicate 1, tp 1 or 2, pp 2 or 4, reshard_after_forward both ways, the V
schedules on): meshes pp 2 x dp_shard 4, pp 2 x dp_shard 2 x tp 2, pp 4 x dp_shard 2 and pp 4 x tp 2.
pp 2 has vpp 1, 2, 4 (8 layers / 2 stages = 4 a chunk count divides) and ZB-V and DualPipeV at vpp 2: 5
rows; pp 4 has vpp 1, 2 and the two V rows: 4. The three meshes with dp_shard > 1 take both
reshard_after_forward values, pp 4 x tp 2 (FSDP shards nothing) one: 2 x 5 x 2 + 4 x 2 + 4 = 32
candidates, 7 ZB-V and 7 DualPipeV rows. The rule takes the V rows of the three sharded meshes at
reshard_after_forward true: 3 x 2 = 6 (DualPipeV's own rule, m >= 2 pp, takes none first: m = 64 / (4 x
dp) is 4 at pp 2 x dp_shard 4, 8 at dp_shard 2, against 2 pp = 4 and 8)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.pipeline.registry import get
from meshplan.pipeline.vshape import RESHARD_DEFECT, VShaped, reshard_defect
from meshplan.plan_runtime import config_warnings
from meshplan.report.search import count_lines
from meshplan.report.search_fix import infeasible_line
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import PIPELINE
from meshplan.search.driver import search
from meshplan.search.reasons import CODE, OK, V_RESHARD_REFUSED, first_reason
from meshplan.search.space import enumerate_candidates
from test_search import config

SPACE = dict(micro_batch=[4], recompute=["none"], sharding=["zero3"], reshard_after_forward=[True, False], tp=[1, 2],
             cp=[1], dp_replicate=[1], pp=[2, 4], tp_comm_overlap=[False], uneven_stages=[False],
             pp_schedules=["1f1b", "zbv", "dualpipev"])
V_NO_DATA = {"pp 4 x tp 2, mb 4, none, vpp 2, zero3, zbv", "pp 4 x tp 2, mb 4, none, vpp 2, zero3, dualpipev"}
FIX = ("let search.reshard_after_forward include false (training.reshard_after_forward = false, torchtitan's default "
       "under pp), or drop zbv, dualpipev and zb_h1 from search.pp_schedules")


def _labels(c, rows) -> set[str]:
    return {c.label(i) for i in range(len(c)) if rows[i]}


def _v(c) -> np.ndarray:
    return (c.ps == PIPELINE.index("zbv")) | (c.ps == PIPELINE.index("dualpipev"))


def test_rule_rejects_the_v_rows_resharded_after_forward_over_a_data_axis():
    cfg = config(1, 80.0, **SPACE)
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    v, rule = _v(c), code == CODE["v-reshard"]
    assert len(c) == 32 and int((c.ps == PIPELINE.index("zbv")).sum()) == 7 and int(v.sum()) == 14
    assert int(rule.sum()) == 6 and int((rule & (c.ps == PIPELINE.index("dualpipev"))).sum()) == 3
    assert _labels(c, rule) == _labels(c, v & (c.rf == 1)) - V_NO_DATA
    assert (code[v & (c.rf == 0)] != CODE["v-reshard"]).all() and int((v & (c.rf == 0)).sum()) == 6
    assert not rule[c.ps == 0].any()  # 1F1B and interleaved rows, resharded or not


def test_condition_is_all_four():
    """framework torch, pp > 1, FSDP2 over a data axis and reshard_after_forward true: drop any one
    and it does not hold."""
    assert bool(reshard_defect("torch", 2, True, True))
    assert not reshard_defect("megatron", 2, True, True) and not reshard_defect("torch", 1, True, True)
    assert not reshard_defect("torch", 2, False, True) and not reshard_defect("torch", 2, True, False)
    assert [isinstance(get(s), VShaped) for s in ("1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")] \
        == [False, False, False, True, True]


def test_rule_is_the_plans_warning_for_every_candidate():
    """zero3 and hsdp, dp_replicate 1 or 2, reshard_after_forward true: a row's plan warns of
    RESHARD_DEFECT exactly where the rule holds on its columns. Meshes (tp 1): pp 2 x dp_shard 4,
    pp 2 x dp_replicate 2 x dp_shard 2 (hsdp), pp 4 x dp_shard 2, pp 4 x dp_replicate 2 (hsdp, shards
    nothing: rule 'replicate' first, yet warned: FSDP2 replicates over dp_replicate, the warning's
    condition); each with a ZB-V and a DualPipeV row: 8 warned, 6 rule v-reshard's first, 2 replicate's."""
    cfg = config(1, 80.0, **{**SPACE, "sharding": ["zero3", "hsdp"], "dp_replicate": [1, 2], "tp": [1],
                             "reshard_after_forward": [True]})
    c = enumerate_candidates(cfg)
    rule = _v(c) & reshard_defect("torch", c.pp, c.fsdp2_over_data, c.rf)
    warned = [any(RESHARD_DEFECT in w for w in config_warnings(candidate_config(cfg, c, i))) for i in range(len(c))]
    assert warned == rule.tolist() and sum(warned) == 8
    code = first_reason(cfg, c)
    assert int((code == CODE["v-reshard"]).sum()) == 6 and int((rule & (code == CODE["replicate"])).sum()) == 2


@pytest.fixture(scope="module")
def v_search():
    return search(config(1, 80.0, **SPACE, top=40), workers=1)


def test_counted_and_kept_gathered_v_rows_offered(v_search):
    """The 6 V rows of the sharded meshes with reshard_after_forward false pass every rule but memory
    (80 GB: none is memory's) and are ranked."""
    r = v_search
    assert r.counts()["v-reshard"] == 6
    assert f"  rejected, rule 'v-reshard' ({V_RESHARD_REFUSED}): 6" in count_lines(r)
    c = r.candidates
    kept = _v(c) & (c.rf == 0)
    assert (r.code[kept] == OK).all() and int(kept.sum()) == 6


@pytest.mark.parametrize("rf, want", [([True], 2), ([True, False], 0)])
def test_verdict_names_the_rule_and_its_fix(rf, want):
    """Only the V schedules (pp > 1 only under them) at pp 2, tp 1: the one mesh pp 2 x dp_shard 4, a
    ZB-V and a DualPipeV row per reshard_after_forward value. Resharded only: both rows rule
    v-reshard's, no feasible mesh, the fix names reshard_after_forward false; with false searched too
    the two kept-gathered rows are feasible."""
    r = search(config(1, 80.0, **{**SPACE, "tp": [1], "pp": [2], "pp_schedules": ["zbv", "dualpipev"],
                                  "reshard_after_forward": rf}), workers=1)
    assert len(r.candidates) == 2 * len(rf) and r.counts().get("v-reshard", 0) == 2
    if want:
        assert not r.top
        assert infeasible_line(r) == (f"no feasible mesh: of 2 candidates rule 'v-reshard' rejected 2 "
                                      f"({V_RESHARD_REFUSED}); fix: {FIX}")
    else:
        assert r.top and not r.candidates.rf[r.top[0].index]
