"""The cool-down lag of the V-shaped schedules (issue 11, zero-bubble follow-up): how many chunk
passes have run their input-gradient pass (torch's I) and not their weight-gradient pass (W) at once,
on meshplan's order and on torch 2.13's own ``pipeline_order`` (built on CPU, not run), and the output
gradients they hold (meshplan.memory.wlag.cooldown_lag_bytes), by hand."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.memory.wlag import cooldown_lag_bytes, head_norm_grad_bytes, layer_weight_grad_bytes
from meshplan.pipeline.registry import get
from meshplan.plan import build_plan
from test_schedule_registry import torch_order
from test_search import SMALL


def _lag(ops) -> int:
    """Most (micro-batch, virtual stage) pairs with I done and W not, at each W (its own included)."""
    done, top = set(), 0
    for kind, mb, j in ops:
        if kind == "I":
            done.add((mb, j))
        elif kind == "W":
            top = max(top, len(done))
            done.discard((mb, j))
    return top


@pytest.mark.parametrize("name, p, m", [("zbv", 2, 4), ("zbv", 3, 9), ("zbv", 4, 8), ("zbv", 4, 16), ("zbv", 8, 16),
                                        ("zbv", 4, 5), ("zbv", 2, 1), ("dualpipev", 2, 4), ("dualpipev", 3, 6),
                                        ("dualpipev", 4, 8), ("dualpipev", 4, 16), ("dualpipev", 8, 16)])
def test_lag_matches_torchs_order(name, p, m):
    """torch's order (a FULL_BACKWARD as I then W at once, tests/test_schedule_registry.torch_order)
    and meshplan's lagging_weights agree on every rank; at m >= 2p, by hand from the orders' cool-downs:
    ZB-V rank s runs s pairs B(chunk 0), B(chunk 1), then B(chunk 0) W(chunk 0): 2s + 1 at that first W;
    DualPipeV's rank s splits the backwards from the middle of its s + 1 pairs on, then W, B(chunk 0)
    p - s - 1 times: s + 1."""
    sched = get(name)
    lags = [int(sched.lagging_weights(p, m, 2, s)) for s in range(p)]
    assert lags == [_lag(torch_order(sched, p, m, 2, s)) for s in range(p)]
    if m >= 2 * p:
        assert lags == [2 * s + 1 if name == "zbv" else s + 1 for s in range(p)]


def _plan(schedule: str):
    return build_plan(config_from_dict({
        "model": SMALL, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 8, "seq_len": 2048, "micro_batch": 1, "recompute": "none"},
        "mesh": {"names": ["pp", "tp"], "shape": [4, 2], "sequence_parallel": True, "pp_schedule": schedule,
                 "virtual_stages": 2}}))


def test_cooldown_bytes_by_hand():
    """ZB-V at pp 4 x tp 2 (SP), 8 layers in 8 chunks of 1, m 8: rank 3's cool-down holds 7 chunk passes
    of one layer each, 7 x 54,525,952 B (tests/test_zbh1_memory.LAYER_WGRAD: one layer's output gradients
    at tp 2 with SP, by hand there); rank 0 (lag 1) the chunk that ends the model: its layer plus the final
    norm's 1024 x 2048 x 2 B = 4,194,304."""
    plan = _plan("zbv")
    c = plan.config
    layer = layer_weight_grad_bytes(c.model, c.training, plan.mesh)
    assert layer == 54_525_952 and head_norm_grad_bytes(c.model, c.training, plan.mesh) == 4_194_304
    held = [cooldown_lag_bytes(c.model, c.training, plan.mesh, "zbv", s, 4, 8, 2, plan.stages[s]) for s in range(4)]
    assert held[3] == 7 * layer
    assert held[0] == layer + 4_194_304
    note = [n for n in plan.timelines[3].notes if "cool-down" in n]
    assert len(note) == 1 and "up to 7 at once" in note[0] and "364.00 MiB" in note[0]  # 7 x 52 MiB
