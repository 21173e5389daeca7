"""One source of truth for the fast (vectorised search) and the exact (plan) model (issue 10,
item 3): the formulas both use exist once, and the search's arrays give the plan's numbers.

Each shared formula is called by the plan on one value and by the search on arrays of
candidates; here the two paths are compared on real candidates (8 GPUs, the small model of
``test_search``, bf16 gradients reduced in fp32 so that the gradient bucket is not empty), and a
source scan checks that the formulas' literals live in their one home.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from test_search import SMALL, gpu

from meshplan.compute.kernel_time import optimizer_bandwidth
from meshplan.config import config_from_dict
from meshplan.memory import constraints as cons
from meshplan.plan import build_plan
from meshplan.schedule.optimizer_step import optimizer_step_s
from meshplan.schedule.step_end import _optimizer_s
from meshplan.search.buffer_bounds import bucket_bytes as _bucket
from meshplan.search.driver import search
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.space import candidate_config

ROOT = Path(__file__).resolve().parents[1] / "meshplan"


@pytest.fixture(scope="module")
def planned():
    """The 8-GPU search (bf16 gradients, fp32 reduction) and 12 of its candidates planned."""
    cfg = config_from_dict({"model": SMALL, "cluster": {"system": "dgx-h100", "nodes": 1, "gpu": gpu(6.0)},
                            "training": {"global_batch": 64, "seq_len": 2048, "grad_dtype": "bf16"},
                            "search": {"micro_batch": [1, 2], "settle_max": 1_000_000}}, require_mesh=False)
    r = search(cfg, workers=1)
    valid = np.flatnonzero(np.isfinite(r.est.step_lo))
    pick = valid[np.linspace(0, len(valid) - 1, 12).astype(int)]
    constraints = cons.constraints(cfg.model, cfg.training, cfg.cluster, cfg.cluster.world)
    plans = {int(i): build_plan(candidate_config(cfg, r.candidates, int(i)),
                                constraints if candidate_config(cfg, r.candidates, int(i)).training == cfg.training
                                else None) for i in pick}
    return cfg, r, plans


def _rows(cfg, r, i: int):
    """The search's per-stage arrays of candidate ``i`` alone: (candidates, state)."""
    c = r.candidates.take([i])
    st = stage_layout(cfg, c, int(c.pp[0]))
    return c, state(cfg, Tables(cfg), c, st)


def test_optimizer_step_same_in_search_and_plan(planned):
    """The optimizer-step time the search's bound adds per stage equals step_time's, because
    both call optimizer_step_s on the same persistent state (the search's state arrays equal
    the plan's memory.state)."""
    cfg, r, plans = planned
    bw = optimizer_bandwidth(cfg.cluster.gpu)  # the catalog's measured Triad (issue 11 item 1)
    for i, plan in plans.items():
        _, s = _rows(cfg, r, i)
        zeroed = plan.config.training.sharding in ("none", "zero1", "zero2")
        fast = optimizer_step_s(s["params"], s["grads"], s["master"], s["optimizer"], cfg.training, bw, zeroed)[0]
        exact = [_optimizer_s(plan, k) for k in range(len(plan.stages))]
        assert fast == pytest.approx(exact, rel=1e-12), r.candidates.label(i)
        # by hand on the plan's state: norm + clip 3 g, Adam 2 (master + moments) + g, the master
        # copy master + params, the zeroed gradient buffer g unless FSDP2 (zero3/hsdp) frees it;
        # torch's default fp32 parameters (no master): Adam 2 (params + moments) + g, no copy
        st = plan.state[0]
        g, p, mst, o = (st.bytes_of(k) for k in ("grads", "params", "master", "optimizer"))
        zero = g if zeroed else 0
        assert mst == 0 and plan.config.training.param_dtype == "fp32"
        assert exact[0] == pytest.approx((3 * g + 2 * (p + o) + g + zero) / bw, rel=1e-12)


def test_gradient_bucket_same_in_search_and_plan(planned):
    """The bucket the search's upper bound adds without FSDP equals the one the timeline gets
    (MemoryOptions.grad_bucket_bytes on the plan's fsdp degree and stage parameters):
    min(max(40e6, 1e6 x dp), params) x 4 B (fp32 reduction of bf16 gradients)."""
    cfg, r, plans = planned
    seen = 0
    for i, plan in plans.items():
        c, s = _rows(cfg, r, i)
        fast = _bucket(cfg, c, s)[0]
        for k, st in enumerate(plan.state):
            exact = cfg.memory.grad_bucket_bytes(plan.config.training, plan.mesh.degree("fsdp"), st.params.total)
            assert fast[k] == exact == min(max(40_000_000, 1_000_000 * plan.mesh.degree("fsdp")),
                                           st.params.total) * 4, r.candidates.label(i)
            seen += exact > 0
    assert seen


def test_usable_memory_one_value(planned):
    cfg, r, plans = planned
    usable = cons.usable_bytes(cfg.cluster, cfg.training)
    assert usable == 6.0e9 * (1 - 0.10) == r.usable_bytes
    assert all(tl.usable_bytes == usable for p in plans.values() for tl in p.timelines)


#: a formula's tell-tale text -> the one file (under meshplan/) allowed to hold it
HOMES = {
    r"40_000_000": "spec/memory_buckets.py",                          # Megatron's bucket floor
    r"\*\s*\(\s*1\s*-\s*[\w.]*reserve\)": "memory/constraints.py",   # usable HBM: x * (1 - reserve)
    r"2\s*\*\s*\(updated \+ optimizer\)": "schedule/optimizer_step.py",   # optimizer step bytes (Adam's pass)
    r"optimizer_temp_states\s*\*": "spec/memory.py",                  # optimizer temporaries
    r"PARTIAL_GRAD_READS\s*=": "comm/tp_grads.py",                    # Partial grads' all-reduces per AdamW step
    r"\.transpose\(rest \+ idx\)": "mesh/layout.py",                  # group enumeration
    r"-\(-\w+ // shards\) \* shards": "mesh/tpsplit.py",              # FSDP2 padding
}


@pytest.mark.parametrize("pattern", sorted(HOMES))
def test_formula_lives_in_one_module(pattern):
    found = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if re.search(pattern, p.read_text()))
    assert found == [HOMES[pattern]], found
