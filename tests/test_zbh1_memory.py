"""ZB-H1's weight-gradient lag in the memory timeline (nc56 #3/#7 follow-up, meshplan.memory.wlag):
torch 2.13's ``stage_backward_input`` (the schedule's B) frees no saved activation and keeps the output
gradient of every weighted op until ``stage_backward_weight`` (W). So a micro-batch's activations are
held from F to W, and the micro-batches whose W lags their B also hold those output gradients.

The tiny case: the 8-layer model of tests/test_search.py (h 2048, ffn 5632 gated, 16 query and 4 KV
heads of 128) on pp 4 x tp 2 with SP (2 layers a stage), micro-batch 1, seq 2048, 8 micro-batches."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.memory.schedule import max_in_flight, stage_ops
from meshplan.memory.wlag import weight_grad_output_bytes
from meshplan.pipeline.registry import get
from meshplan.plan import build_plan
from test_schedule_registry import torch_order
from test_search import SMALL

P, M = 4, 8

#: One dense layer's output gradients on a tp rank (tp 2, SP, s 2048, b 1, 2 bytes), by hand:
#: norm outputs 2 x (2048 / 2) x 2048 = 4,194,304; q, k, v outputs 2048 x (8 x 128 + 2 x 2 x 128) =
#: 3,145,728; wo and w2 outputs (row-parallel, the whole local output) 2 x 2048 x 2048 = 8,388,608;
#: w1 and w3 outputs 2 x 2048 x 5632 / 2 = 11,534,336; 27,262,976 elements x 2 B.
LAYER_WGRAD = 54_525_952


def _lags(ops) -> tuple[int, int]:
    """(most micro-batches from F to W, most with I done and W not) along torch's (kind, mb, stage) list."""
    live = lag = top_live = top_lag = 0
    for kind, _, _ in ops:
        live += kind == "F"
        lag += kind == "I"
        if kind == "W":
            top_lag = max(top_lag, lag)  # this W's own output gradients are still held as it runs
            live, lag = live - 1, lag - 1
        top_live = max(top_live, live)
    return top_live, top_lag


def test_torchs_order_holds_p_micro_batches_and_s_plus_1_lagging_w_on_stage_s():
    """torch's ScheduleInterleavedZeroBubble (one stage per rank) at p 4, m 8, rank 2:
    F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 ...: before W0 it has run F0..F3 (4 held) and I0..I2 (3 lagging);
    in general p - s - 1 warm-up forwards, then F/I pairs, W of j after I of j + s: 4 held on every
    rank, s + 1 lagging. meshplan's counts (ZBH1.in_flight, lagging_weights) and the timeline's op list
    (stage_ops: the backward at W) say the same; 1F1B holds p - s from F to its full backward."""
    zb = get("zb_h1")
    ops = torch_order(zb, P, M, 1, 2)
    assert [f"{k}{mb}" for k, mb, _ in ops[:11]] == "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1".split()
    for s in range(P):
        assert _lags(torch_order(zb, P, M, 1, s)) == (4, s + 1), s
        assert (int(zb.in_flight(P, M, 1, s)), int(zb.lagging_weights(P, M, 1, s))) == (4, s + 1)
        assert max_in_flight(stage_ops("zb_h1", s, P, M)) == 4
        assert max_in_flight(stage_ops("1f1b", s, P, M)) == P - s


def test_layer_output_gradients_by_hand():
    assert weight_grad_output_bytes(s=2048, b=1, h=2048, a=16, g=4, d=128, f=5632, gated=True, act_bytes=2,
                                    tp=2, sp=True) == LAYER_WGRAD
    # without SP the two norm outputs are whole: + 2 x 1024 x 2048 elements x 2 B
    assert weight_grad_output_bytes(s=2048, b=1, h=2048, a=16, g=4, d=128, f=5632, gated=True, act_bytes=2,
                                    tp=2, sp=False) == LAYER_WGRAD + 8_388_608


def _plan(schedule: str):
    return build_plan(config_from_dict({
        "model": SMALL, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": M, "seq_len": 2048, "micro_batch": 1, "recompute": "none"},
        "mesh": {"names": ["pp", "tp"], "shape": [P, 2], "sequence_parallel": True, "pp_schedule": schedule}}))


@pytest.fixture(scope="module")
def plans():
    return _plan("1f1b"), _plan("zb_h1")


def test_timeline_holds_p_micro_batches_and_the_lagging_output_gradients(plans):
    """On the middle stages (no embedding, no head) the activations' largest running total is, under
    1F1B, (p - s) micro-batches of the stage's saved activations A_s; under ZB-H1, 4 of them (held till
    W) plus the s + 1 lagging W passes' output gradients of its 2 layers, (s + 1) x 2 x LAYER_WGRAD."""
    one, zb = plans
    for s in (1, 2):
        a1, az = (p.timelines[s].max_by_kind["activations"] for p in (one, zb))
        saved = a1 // (P - s)
        assert saved * (P - s) == a1
        assert az == 4 * saved + (s + 1) * 2 * LAYER_WGRAD, s
        held = [e.delta_bytes for e in zb.timelines[s].events() if e.label.startswith("output gradients held")]
        assert set(held) == {(s + 1) * 2 * LAYER_WGRAD} and len(held) == M  # one per W
    assert not [e for e in one.timelines[2].events() if e.label.startswith("output gradients held")]


def test_peaks_move_and_the_note_says_why(plans):
    one, zb = plans
    for s in range(P):
        assert zb.timelines[s].peak.total_bytes > one.timelines[s].peak.total_bytes, s
    assert any("lagging W passes" in n and "till the weight-gradient pass" in n for n in zb.timelines[1].notes)


def test_head_stage_holds_the_final_norms_output_gradient_too(plans):
    """Stage 3 (the head's, lag min(8, 3 + 1) = 4): each lagging W also keeps the final norm's output
    gradient, SP's 1024 tokens x h 2048 x 2 B = 4,194,304 B (meshplan.memory.wlag.head_norm_grad_bytes;
    measured on torch in tests/test_wlag_layers.py)."""
    _, zb = plans
    held = {e.delta_bytes for e in zb.timelines[3].events() if e.label.startswith("output gradients held")}
    assert held == {4 * (2 * LAYER_WGRAD + 1024 * 2048 * 2)}
