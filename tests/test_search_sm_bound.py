"""The forward unit's SM-contention bound (:mod:`meshplan.search.sm_bound`): a hand example of its
formula, and Llama-3-70B's dp_shard 16 x tp 8 on 16 dgx-h100 (FSDP2 over the network at pp 1),
where it holds the forward's core bound, against the exact forward unit."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.memory import constraints as cons
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.candidate import candidate_config
from meshplan.search.layer_bounds import unit_bounds
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.sm_bound import SmTerms, backward_sm_bound, forward_sm_bound, gather_chain, pair_rate
from meshplan.search.space import OK, RECOMPUTE, enumerate_candidates, first_reason
from meshplan.search.time_tables import TimeTables
from tests.test_search_bound_holds import _example


def test_hand_example():
    """3 layers, all-gather 10 ms, kernels 8 ms, copy-out 0.5 ms, blocking tp 2 ms a layer, SM share
    0.1 (module docstring): AG_0 idle 10, kernels 3 x 8.5 = 25.5, AG_1 and AG_2 beside later kernels
    0.1 x 2 x 10 = 2, the tp waits' idle 0.9 x 3 x 2 = 5.4: 42.9 ms; the flow shop's
    max(10 + 3 x 10.5, 3 x 10 + 10.5) = 41.5 ms; the gather chain 3 x 10 + 2 x 0.5 + 10.5 = 41.5 ms."""
    col = lambda x: np.array([[x]])
    sm = SmTerms(col(8e-3), col(2e-3), col(0.1))
    assert forward_sm_bound(sm, col(10e-3), col(0.5e-3), col(3))[0, 0] == pytest.approx(42.9e-3, rel=1e-12)
    assert gather_chain(10e-3, 0.5e-3, 10.5e-3, 3) == pytest.approx(41.5e-3, rel=1e-12)
    # no share (not FSDP2, or off the network): no bound; no layer: none
    off = SmTerms(col(8e-3), col(2e-3), col(0.0))
    assert forward_sm_bound(off, col(10e-3), col(0.5e-3), col(3))[0, 0] == 0.0
    assert forward_sm_bound(sm, col(10e-3), col(0.5e-3), col(0))[0, 0] == 0.0


def test_backward_hand_example():
    """3 layers, backward kernels 8 ms, copy-out and copy-in 0.5 ms each, blocking tp 2 ms a layer,
    all-gather 6 ms and reduce-scatter 10 ms (NIC demands 0.9 each: together at most 1 + 0.1 / 0.9 =
    1.111 of their speed per second), SM share 0.1: W = 3 x 9 = 27, Q = 2 x (6 + 10) = 32, P = 27 +
    0.1 x 32 + 0.8 x 3 x 2 = 35.0 >= Q: 35.0 ms. With a 20 ms reduce-scatter Q = 52, P = 37.0 < Q: the
    two meet at T2 = (52 - 37) / (0.1 x 0.889 + 0.111) = 75 ms, 52 - 0.111 x 75 = 43.667 ms."""
    col = lambda x: np.array([[x]])
    rho = pair_rate(col(0.9), col(0.9))
    assert rho[0, 0] == pytest.approx(1 + 0.1 / 0.9, rel=1e-12)
    sm = SmTerms(col(0.0), col(0.0), col(0.0), col(8e-3), col(2e-3), col(0.1), rho)
    half = col(0.5e-3)
    assert backward_sm_bound(sm, col(6e-3), col(10e-3), half, half, col(3))[0, 0] == pytest.approx(35.0e-3, rel=1e-12)
    assert backward_sm_bound(sm, col(6e-3), col(20e-3), half, half, col(3))[0, 0] == pytest.approx(
        (52 - 75 / 9) * 1e-3, rel=1e-12)


def _dp16_tp8(recompute: str):
    """Llama-3-70B dp_shard 16 x tp 8, one micro-batch, resharded, at ``recompute``: its unit bounds
    (unit_bounds' dict, one candidate, pp 1) and its exact step (build_plan + step_time)."""
    tables = _example("llama3-70b_128xh100_dp16-tp8.toml", pp=[1], cp=[1], tp=[8], dp_replicate=[1],
                      micro_batch=[1], recompute=[recompute], reshard_after_forward=[True])
    cfg = config_from_dict(tables, require_mesh=False)
    c = enumerate_candidates(cfg)
    ok = np.flatnonzero(first_reason(cfg, c) == OK)
    i = int(next(j for j in ok if c.dps[j] == 16 and c.rc[j] == RECOMPUTE.index(recompute)))
    g = c.take(np.array([i]))
    tt = TimeTables(cfg, Tables(cfg))
    st = stage_layout(cfg, g, 1)
    cc = candidate_config(cfg, c, i)
    plan = build_plan(cc, cons.Constraints((), cons.usable_bytes(cc.cluster, cc.training)), memory=False, reports=False)
    return unit_bounds(cfg, tt, g, st, state(cfg, tt.tables, g, st)), step_time(plan, Overlap())


def test_the_70b_forward_unit():
    """Llama-3-70B, dp_shard 16 x tp 8, no recompute, one micro-batch: the bound of its forward's
    80 layers is the SM one, 409.98 ms (tests/test_search_bound_holds.py's docstring derives it),
    and the exact forward unit (embedding and head included, which the bound's emb_f and head_f add)
    is longer."""
    u, res = _dp16_tp8("none")
    keys, _ = res.units.index(res.pipeline.flat)
    assert round(float(u["f_core"][0, 0]) * 1e3, 2) == 409.98
    fwd = res.units.by_key(next(k for k in keys if k[2] == "F"))
    assert fwd.duration_s >= float((u["f_core"] + u["emb_f"] + u["head_f"])[0, 0])
    # the window the proof bounds: from layer 0's all-gather's start to the last layer's last kernel
    ag0 = next(e for e in fwd.events if e.name == "fsdp AG L0")
    head = next(e for e in fwd.events if e.stream == "compute" and e.name == "head")
    assert head.start_s - ag0.start_s >= float(u["f_core"][0, 0])


def test_the_70b_backward_window():
    """Llama-3-70B, dp_shard 16 x tp 8 at full recompute: the backward's 80 layers bound by the SM
    one (sm_bound.backward_sm_bound): kernels a layer 9.804 ms (input gradients 4.003, the replayed
    forward 3.214, weight gradients 2.588), copy-out 0.144 and copy-in 0.216, blocking tp 7 x 0.341 =
    2.385 ms (4 in the backward, 3 in the replay), all-gather 4.306 and reduce-scatter 8.565 ms (NIC
    demands 0.932, 0.937: rho 1.073), s 16 / 132: W = 80 x 10.164 = 813.15, Q = 79 x 12.870 =
    1016.76, P = 813.15 + 123.24 + 0.758 x 80 x 2.385 = 1080.95 ms >= Q. The exact window, from the
    last layer's copy-out to layer 0's copy-in, is longer (1.190 s, read from the model)."""
    u, res = _dp16_tp8("full")
    w, q = 80 * (9.804 + 0.144 + 0.216), 79 * (4.306 + 8.565)
    assert round(w + q * 16 / 132 + (1 - 32 / 132) * 80 * 7 * 0.341, 0) == 1081  # rounded inputs
    assert round(float(u["b_core"][0, 0]) * 1e3, 2) == 1080.95
    keys, _ = res.units.index(res.pipeline.flat)
    back = res.units.by_key(next(k for k in keys if k[2] == "B"))
    ev = [e for e in back.events if e.stream == "compute"]
    first = next(e for e in ev if e.name == "L79")
    last = [e for e in ev if "copy-in L0" in e.name][-1]
    assert last.end_s - first.start_s >= float(u["b_core"][0, 0])
    assert back.duration_s >= float((u["b_core"] + u["head_b"] + u["emb_b"])[0, 0])
