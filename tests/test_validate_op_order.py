"""``validate``'s executed per-rank pipeline op order against the plan's (nc56 #7,
meshplan.runtime.validation.op_order). Here without a run: the evidence a pp 2 x dp_shard 2 run leaves
(``rank<r>/timings.json``, its recorded step's ``ops``) written from torch's own schedule IR
(tests/test_schedule_registry.py ``torch_order``, torch 2.13's classes on fake stages); the real runs'
orders are checked in tests/test_validate_pipeline.py (``test_validate_prints_the_executed_op_order``)."""

from __future__ import annotations

import json

import pytest

from meshplan.config import config_from_dict
from meshplan.pipeline.registry import get
from meshplan.plan import build_plan
from meshplan.runtime.validation.op_order import executed_ops, first_difference, op_order, order_lines, planned_ops
from test_schedule_registry import torch_order


def _torch_ops(schedule: str, p: int, m: int, v: int, rank: int) -> list[list]:
    """torch's (kind, micro-batch, stage) of ``rank`` as the runtime records them: the registry test
    splits a full backward of a split schedule into I and W; the recorder keeps torch's B."""
    return [[k, mb, st] for k, mb, st in torch_order(get(schedule), p, m, v, rank)]


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2),
                                             ("zbv", 2, 4, 2), ("dualpipev", 2, 4, 2)])
def test_the_plans_order_is_torchs(schedule, p, m, v):
    for rank in range(p):
        assert executed_ops(_torch_ops(schedule, p, m, v, rank), schedule, v) == planned_ops(schedule, p, m, v, rank)


def test_1f1b_by_hand_and_two_runs():
    """1F1B at p 2, m 4: stage 0 warms up with p - s - 1 = 1 forward, then one forward and one backward
    in turn, then the last backward; stage 1 alternates from the start. Two schedule runs repeat it."""
    assert planned_ops("1f1b", 2, 4, 1, 0) == "F0 F1 B0 F2 B1 F3 B2 B3".split()
    assert planned_ops("1f1b", 2, 4, 1, 1) == "F0 B0 F1 B1 F2 B2 F3 B3".split()
    assert planned_ops("1f1b", 2, 2, 1, 1, runs=2) == "F0 B0 F1 B1 F0 B0 F1 B1".split()
    assert first_difference(["F0", "B0"], ["F0", "B0", "F1"]) == "2 ops ran where the plan has 3"


def _plan():
    return build_plan(config_from_dict({
        "model": {"name": "tiny", "layers": 4, "hidden": 256, "ffn": 512, "q_heads": 4, "kv_heads": 2, "vocab": 512},
        "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 8, "seq_len": 32, "micro_batch": 1},
        "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 2], "world": 4, "pp_schedule": "1f1b"}}, require_mesh=True))


def _write(folder, ops_of_rank):
    for r, ops in ops_of_rank.items():
        (folder / f"rank{r}").mkdir(parents=True, exist_ok=True)
        steps = [{"kind": "recorded", "pipeline_stages": [r // 2], "ops": ops}, {"kind": "measured"}]
        (folder / f"rank{r}" / "timings.json").write_text(json.dumps({"steps": steps}))


def test_op_order_as_planned_then_one_rank_swapped(tmp_path):
    """pp 2 x dp_shard 2 (ranks 0, 1 stage 0; 2, 3 stage 1), 8 / (1 x 2) = 4 micro-batches."""
    plan = _plan()
    assert plan.run_micro_batches == 4 and plan.world == 4
    ops = {r: _torch_ops("1f1b", 2, 4, 1, r // 2) for r in range(4)}
    _write(tmp_path, ops)
    got = op_order(plan, tmp_path)
    assert got["differences"] == [] and got["line"] == "pipeline op order as planned on all 4 ranks"
    assert got["ranks"]["0"]["ran"] == "F0 F1 B0 F2 B1 F3 B2 B3".split()
    lines = order_lines(got)
    assert lines[2:4] == ["- ranks 0,1 (stage 0): F0 F1 B0 F2 B1 F3 B2 B3",
                          "- ranks 2,3 (stage 1): F0 B0 F1 B1 F2 B2 F3 B3"]
    ops[3][1], ops[3][2] = ops[3][2], ops[3][1]  # rank 3 runs F1 before B0
    _write(tmp_path, ops)
    got = op_order(plan, tmp_path)
    assert got["differences"] == ["pipeline op order, rank 3 (stage 1): op 2 ran F1 where the plan has B0"]
    assert got["line"] == "pipeline op order differs from the plan on 1 of 4 ranks"
    assert "- rank 3 (stage 1): F0 F1 B0 B1 F2 B2 F3 B3; differs: op 2 ran F1 where the plan has B0" in order_lines(got)


def test_no_order_without_a_pipeline_run(tmp_path):
    plan = _plan()
    for r in range(4):
        (tmp_path / f"rank{r}").mkdir()
        (tmp_path / f"rank{r}" / "timings.json").write_text(json.dumps({"steps": [{"kind": "recorded"}]}))
    assert op_order(plan, tmp_path) is None
