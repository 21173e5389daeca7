"""The in-run collective probe's plan side (meshplan.runtime.validation.probe): which collectives it
times, on which groups, and how the measured times enter the step-time model. The worker
side runs in tests/test_validate.py (probe.json of a real 4-rank gloo run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.plan import build_plan
from meshplan.runtime.validation.probe import PROBED_OPS, calibrated_plan, probe_spec
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.scaling import scale_config
from meshplan.config import load_config
from meshplan.schedule.steptime import step_time

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plan():
    opt = Options(worlds=(4,), hidden_div=64, seq_len=128, vocab=128)
    cfg, _ = scale_config(load_config(ROOT / "examples" / "mini_2x4_tp2-dp4.toml"), 4, opt)
    return build_plan(cfg)


def test_spec_lists_each_distinct_collective_once_with_every_group_of_its_axis(plan):
    spec = probe_spec(plan)
    kinds = {(r.axis, r.op, int(r.size_bytes)) for rows in plan.collectives.values() for r in rows
             if r.op in PROBED_OPS}
    assert [(e["axis"], e["op"], e["size_bytes"]) for e in spec] == sorted(kinds)
    # names ["dp_shard", "tp"], shape [2, 2] at 4 ranks: tp is the fast axis
    groups = {e["axis"]: e["groups"] for e in spec}
    assert groups == {"tp": [[0, 1], [2, 3]], "dp_shard": [[0, 2], [1, 3]]}
    assert {e["op"] for e in spec if e["axis"] == "dp_shard"} == {"all-gather", "reduce-scatter"}


def test_calibrated_plan_takes_the_measured_time_per_call_and_changes_only_those(plan):
    spec = probe_spec(plan)
    probe = {"rows": [dict(axis=e["axis"], op=e["op"], size_bytes=e["size_bytes"], time_s=2e-3 if e["axis"] == "tp"
                           else 5e-3) for e in spec]}
    cplan, lines = calibrated_plan(plan, probe)
    assert len(lines) == len(spec)
    assert all(("measured 2 ms" if ln.startswith("tp ") else "measured 5 ms") in ln for ln in lines), lines
    for stage, rows in cplan.collectives.items():
        for old, new in zip(plan.collectives[stage], rows):
            want = {"tp": 2e-3, "dp_shard": 5e-3}.get(old.axis, old.time_s) if old.op in PROBED_OPS else old.time_s
            assert new.time_s == want and new.size_bytes == old.size_bytes and new.per_step == old.per_step
    # slower collectives, same compute: the predicted step can only grow
    assert step_time(cplan).step_s > step_time(plan).step_s
    assert calibrated_plan(plan, {"rows": []}) == (None, [])
