"""The search's rule ``split-op``: under framework torch a row with pp > 1, recompute ``op`` (torchtitan's
op-level selective AC) and a schedule that splits the backward (zbv, dualpipev, zb_h1) is rejected, since
torch 2.13 raised in W: ``stage_backward_weight`` runs one autograd.grad per parameter group and selective
checkpointing's cache serves one recompute ("Trying to backward an extra time ... selective activation
checkpoint", measured on CPU with two runtime Blocks; AReaL PR #916 disables op-level AC for V-style
schedules for the same reason). :data:`meshplan.pipeline.split_backward_ac.OP_AC_RAISES`.

The space (8 GPUs, the 8-layer model of tests/test_search.py, global batch 64, micro-batch 4, zero3 kept
gathered after forward so that rule ``v-reshard`` takes nothing, tp 1, cp 1, pp 2, so dp_shard 4):
per recompute, 1F1B at vpp 1, interleaved at vpp 2 and 4 (8 layers / 2 stages = 4, divided by 2 and 4),
ZB-V at vpp 2 and ZB-H1 at vpp 1: 5 rows; recompute op and full: 10. Micro-batches m = 64 / (4 x 4) = 4:
ZB-H1's rule (m a multiple of max(1, m // pp) = 2) and 1F1B's (m >= pp) take none. The rule takes the
op rows under zbv and zb_h1, 2; the op rows under 1f1b and interleaved (whole backward) and every full
row are not its. plan and step of such a mesh plan it and warn, naming the rule and its fix
(:data:`meshplan.pipeline.split_backward_ac.SPLIT_OP_FIX`)."""

from __future__ import annotations

import pytest

from meshplan.pipeline.registry import SCHEDULES
from meshplan.pipeline.split_backward_ac import OP_AC_RAISES, op_ac_raises, split_backward_ac_warning
from meshplan.plan import build_plan
from meshplan.plan_runtime import config_warnings
from meshplan.report.search import count_lines
from meshplan.report.search_fix import infeasible_line
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import PIPELINE, RECOMPUTE
from meshplan.search.driver import search
from meshplan.search.reasons import CODE, REASONS, first_reason
from meshplan.search.space import enumerate_candidates
from meshplan.spec.training import TrainingSpec
from test_search import config, refused

SPACE = dict(micro_batch=[4], recompute=["op", "full"], sharding=["zero3"], reshard_after_forward=[False], tp=[1],
             cp=[1], dp_replicate=[1], pp=[2], tp_comm_overlap=[False], uneven_stages=[False],
             pp_schedules=["1f1b", "zbv", "zb_h1"])
OP_SPLIT = {"pp 2 x dp_shard 4, mb 4, op, vpp 2, zero3, zbv", "pp 2 x dp_shard 4, mb 4, op, vpp 1, zero3, zb_h1"}


def test_rule_rejects_exactly_the_op_rows_under_a_split_backward():
    cfg = config(1, 80.0, **SPACE)
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    rule = code == CODE["split-op"]
    assert len(c) == 10
    assert {c.label(i) for i in range(len(c)) if rule[i]} == OP_SPLIT
    op = c.rc == RECOMPUTE.index("op")
    assert int((op & (c.ps == 0)).sum()) == 3 and not rule[c.ps == 0].any()  # 1F1B, interleaved vpp 2 and 4
    zbv_full = (c.rc == RECOMPUTE.index("full")) & (c.ps == PIPELINE.index("zbv"))
    assert int(zbv_full.sum()) == 1 and not rule[zbv_full].any()
    assert not (code == CODE["v-reshard"]).any()


def test_predicate_needs_all_four():
    """framework torch, pp > 1, a split backward and recompute op: drop any one and it does not hold."""
    assert bool(op_ac_raises("torch", 2, True, True))
    assert not op_ac_raises("megatron", 2, True, True) and not op_ac_raises("torch", 1, True, True)
    assert not op_ac_raises("torch", 2, False, True) and not op_ac_raises("torch", 2, True, False)


def test_counted_and_named_with_its_fix_when_nothing_else_is_left():
    """Only the op rows under zbv and zb_h1 in the space: both rejected, the verdict names the rule, its
    measured reason and its fix (recompute full or none, or 1f1b / interleaved)."""
    r = search(config(1, 80.0, **dict(SPACE, recompute=["op"], pp_schedules=["zbv", "zb_h1"])), workers=1)
    c = r.candidates
    # 1f1b not in pp_schedules: the two rows are ZB-V at vpp 2 and ZB-H1 at vpp 1, nothing else
    assert len(c) == 2 and set(c.ps.tolist()) == {PIPELINE.index("zbv"), PIPELINE.index("zb_h1")}
    assert (r.code == CODE["split-op"]).all() and r.counts()["split-op"] == 2 and not r.top
    assert refused(r, 0) and refused(r, 1)  # the search's own rule (build_plan warns only), as test_search knows
    assert dict(REASONS)["split-op"] == OP_AC_RAISES and "raised in W" in OP_AC_RAISES
    assert "  rejected, rule 'split-op' (" + OP_AC_RAISES + "): 2" in count_lines(r)
    line = infeasible_line(r)
    assert "split-op" in line and "recompute to full or none" in line


def test_plan_and_step_warn_naming_the_rule_the_search_rejects_the_mesh_by():
    """One verdict everywhere: the space at zbv alone holds one row per recompute, pp 2 x dp_shard 4 at vpp 2
    (8 layers / 2 stages / 2 chunks, the one ZB-V chunking of the space). At recompute op the search rejects
    it, rule split-op; its config still plans (build_plan warns only), and the warning plan prints in its
    notes and step prints from config_warnings names that rule and its fix (recompute full or layer, or a
    schedule that does not split the backward). At recompute full the same mesh is kept and its warning
    names no rule (torch runs it, reported slower)."""
    for rc, rejected in (("op", True), ("full", False)):
        cfg = config(1, 80.0, **dict(SPACE, recompute=[rc], pp_schedules=["zbv"]))
        r = search(cfg, workers=1)
        c = r.candidates
        assert len(c) == 1 and c.label(0) == f"pp 2 x dp_shard 4, mb 4, {rc}, vpp 2, zero3, zbv"
        assert bool(r.code[0] == CODE["split-op"]) is rejected
        row = candidate_config(cfg, c, 0)
        line, = config_warnings(row)
        assert line in build_plan(row).notes
        assert ("meshplan search rejects this mesh (rule 'split-op')" in line) is rejected
        assert ('set recompute = "full" or "layer"' in line and "(1f1b, interleaved_1f1b)" in line) is rejected


@pytest.mark.parametrize("framework", ["torch", "megatron"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("pp", [1, 2])
def test_the_warning_names_the_rule_exactly_where_the_predicate_holds(framework, schedule, pp):
    """At recompute op the warning exists, and names rule split-op, exactly where op_ac_raises holds
    (torch, pp > 1, zb_h1 / zbv / dualpipev), the predicate the search evaluates: 2 x 6 x 2 cases, 3 of them."""
    t = TrainingSpec(global_batch=8, seq_len=16, recompute="op", framework=framework)
    line = split_backward_ac_warning(t, schedule, pp)
    raises = bool(op_ac_raises(framework, pp, SCHEDULES[schedule].splits_backward, True))
    assert raises is (framework == "torch" and pp == 2 and schedule in ("zb_h1", "zbv", "dualpipev"))
    assert bool(line) is raises and any("rule 'split-op'" in x for x in line) is raises
