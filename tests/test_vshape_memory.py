"""The V-shaped schedules' weight-gradient lag in the memory timeline (issue 11 item 3 residue): torch
2.13's input-gradient pass (B) frees no saved activation and keeps every weighted op's output gradient
till the weight-gradient pass (W) (meshplan.memory.wlag), so under ZB-V and DualPipeV a chunk pass's
activations are held from F to W and each backward pass (standing at its W) holds the output gradients
of the chunk passes whose B is done and W not, its own included (wlag.cooldown_lag_levels).

The case by hand: the 8-layer model of tests/test_search.py (h 2048, ffn 5632 gated, 16 query and 4 KV
heads of 128, vocab 32000) on pp 4 x tp 2 with SP, vpp 2 (8 one-layer chunks: stage s holds layers s and
7 - s), micro-batch 1, seq 2048, bf16, recompute none, ZB-V, 8 micro-batches."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.memory import schedule as mem_schedule
from meshplan.memory import timeline as mem_timeline
from meshplan.memory.wlag import cooldown_lag_bytes, cooldown_lag_levels, layer_weight_grad_bytes
from meshplan.pipeline.registry import get
from meshplan.plan import build_plan
from test_search import SMALL
from test_zbh1_memory import LAYER_WGRAD

P, M = 4, 8
#: The final norm's output gradient on the head's chunk (SP: 1024 tokens x 2048 x 2 B), by hand in
#: tests/test_vshape_lag.py.
HEAD_NORM = 1024 * 2048 * 2
#: One layer's saved activations on a tp rank (meshplan.memory.activations' terms, torch framework:
#: gated MLP keeping each op's inputs, flash attention, no dropout), by hand, bytes:
#: [r] (SP, / 2): attention-norm input, QKV input, MLP-norm input, w_in input 4 x 2 x 2048 x 2048 / 2
#: = 16,777,216; Q and context 2 x (2 x 2048 x 8 x 128) = 8,388,608; K and V 2 x (2 x 2048 x 2 x 128)
#: = 2,097,152; flash statistics 4 x 8 x 2048 = 65,536; MLP 8 x 2048 x 2816 = 46,137,344.
A = 16_777_216 + 8_388_608 + 2_097_152 + 65_536 + 46_137_344
#: What the first backward step (MLP w_out) frees before the peak step (the activation's working
#: set): w_out's input, 2 x 2048 x 2816 B.
W2_IN = 2 * 2048 * 2816


def _plan(schedule: str):
    return build_plan(config_from_dict({
        "model": SMALL, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": M, "seq_len": 2048, "micro_batch": 1, "recompute": "none"},
        "mesh": {"names": ["pp", "tp"], "shape": [P, 2], "world": 2 * P, "sequence_parallel": True,
                 "pp_schedule": schedule, "virtual_stages": 2}}))


@pytest.fixture(scope="module")
def plans():
    """(before, after) for ZB-V: before, the model this change replaced (W folded into B: the
    backward pass at B, no lag held), rebuilt by patching its two switches back."""
    after = _plan("zbv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mem_schedule, "frees_at_w", lambda sched: bool(sched.frees_at_weight))
        mp.setattr(mem_timeline, "_v_lag", lambda *a: None)
        before = _plan("zbv")
    return before, after


def test_hand_sizes():
    assert A == 73_465_856
    c = _plan("zbv").config
    assert layer_weight_grad_bytes(c.model, c.training, _plan("zbv").mesh) == LAYER_WGRAD == 54_525_952


def test_levels_per_w_by_hand(plans):
    """Stage 3's order (meshplan.pipeline.zbv): 9 Ws in step with their Bs (W0.c1 ... W4.c1, each holding
    only its own chunk pass: 1 layer), then B4.c0 B5.c1 B5.c0 B6.c1 B6.c0 B7.c1 B7.c0 and the Ws of the
    cool-down W4.c0 W5.c1 W6.c1 W7.c1 W5.c0 W6.c0 W7.c0 holding 7, 6, ..., 1 of them."""
    _, zb = plans
    c = zb.config
    held = lambda s: [e.delta_bytes for e in zb.timelines[s].events()  # noqa: E731
                      if e.label.startswith("output gradients held")]
    assert held(3) == [LAYER_WGRAD * k for k in [1] * 9 + [7, 6, 5, 4, 3, 2, 1]]
    levels, most = cooldown_lag_levels(c.model, c.training, zb.mesh, "zbv", 3, P, M, 2, zb.stages[3])
    assert levels.tolist() == held(3) and int(levels.max()) == 7 * LAYER_WGRAD and most == 7
    # every stage: the largest level is the note's cool-down figure (order_lag of torch's order)
    for s in range(P):
        lv, most = cooldown_lag_levels(c.model, c.training, zb.mesh, "zbv", s, P, M, 2, zb.stages[s])
        assert int(lv.max()) == cooldown_lag_bytes(c.model, c.training, zb.mesh, "zbv", s, P, M, 2, zb.stages[s])
        assert most == int(get("zbv").lagging_weights(P, M, 2, s)) == 2 * s + 1
    # stage 0: chunk 1 (layer 7) ends the model, each of its 8 Ws holds its layer's and the final norm's; chunk 0
    # (layer 0) is the first virtual stage, whose input-gradient pass torch skips (its W a full backward): none
    assert held(0) == [LAYER_WGRAD + HEAD_NORM] * M


def test_peaks_move_by_the_lag_by_hand(plans):
    """Per stage, the peak before -> after and why (every other kind at the peak unchanged):

    - stage 3: before, the steady state's first backward (layer 4, micro-batch 0) with 8 chunk passes in
      flight, 8 A - W2_IN at its MLP activation step; after, the cool-down's first W (W4.c0, layer 3):
      7 chunk passes held (F of micro-batches 4..7 on both chunks less W4.c1 done), 7 A - W2_IN, and 7
      lagging chunk passes (micro-batches 4..7 of layer 3, 5..7 of layer 4) of LAYER_WGRAD: + 7 g - A.
    - stage 2: its cool-down's first W (W4.c0, after B4.c0 B6.c1 B5.c0 B7.c1 B6.c0) holds 6 chunk passes
      and 2s + 1 = 5 lagging (micro-batches 4..6 of chunk 0, 6..7 of chunk 1): 6 A + 5 g against 8 A:
      + 5 g - 2 A.
    - stage 1: the cool-down (5 A + 3 g) stays under the steady state, whose backward now holds its own
      chunk pass's output gradients: 8 A + g: + g.
    - stage 0: lag 1; the head chunk's W (micro-batch 0) holds its own layer 7's and the final norm's
      output gradients: + g + HEAD_NORM (before, that point tied the head's forward, the peak then)."""
    before, after = plans
    g = LAYER_WGRAD
    moved = [a.peak.total_bytes - b.peak.total_bytes for b, a in zip(before.timelines, after.timelines)]
    assert moved == [g + HEAD_NORM, g, 5 * g - 2 * A, 7 * g - A]
    assert moved == [58_720_256, 54_525_952, 125_698_048, 308_215_808]
    b3, a3 = before.timelines[3].peak, after.timelines[3].peak
    assert b3.by_kind["activations"] == 8 * A - W2_IN and a3.by_kind["activations"] == 7 * A + 7 * g - W2_IN
    assert {k: v for k, v in a3.by_kind.items() if k != "activations"} == \
        {k: v for k, v in b3.by_kind.items() if k != "activations"}
    assert (b3.where(), a3.where()) == ("backward of layer 4 (micro-batch 0)", "backward of layer 3 (micro-batch 4)")
    assert after.timelines[0].peak.where() == "backward of the head (micro-batch 0)"
    note = [n for n in after.timelines[3].notes if "cool-down" in n]
    assert len(note) == 1 and "up to 7 at once" in note[0] and "counted in this peak" in note[0]


def test_dualpipev_moves_by_its_own_chunk_pass():
    """DualPipeV (lag s + 1): its cool-down holds fewer chunk passes (stage 3's first lagging W, W6.c1:
    4 in flight and 4 lagging, 4 A + 4 g) than its steady state (9 A, 2p + 1 in flight), whose backward
    now holds its own chunk pass's output gradients: every peak + g (stage 0: + g + the final norm's, its
    head chunk's W). The activations' largest running total likewise."""
    d = _plan("dualpipev")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mem_schedule, "frees_at_w", lambda sched: bool(sched.frees_at_weight))
        mp.setattr(mem_timeline, "_v_lag", lambda *a: None)
        old = _plan("dualpipev")
    g = LAYER_WGRAD
    assert [a.peak.total_bytes - b.peak.total_bytes for b, a in zip(old.timelines, d.timelines)] == \
        [g + HEAD_NORM, g, g, g]
    assert [tl.max_by_kind["activations"] for tl in d.timelines][1:] == [9 * A + g] * 3


def test_forwards_never_run_while_a_w_lags():
    """What lets the lag ride on the backward passes only: on both V orders no F comes between a B and
    its W (pp 2-8, m from under 2p to 4p)."""
    for name in ("zbv", "dualpipev"):
        sched = get(name)
        for p, m in ((2, 4), (3, 9), (4, 5), (4, 8), (4, 16), (8, 16)):
            if sched.reasons(p, m, 2):
                continue
            for s in range(p):
                pending = set()
                for u in sched.order(p, m, 2, s):
                    assert u.kind != "F" or not pending, (name, p, m, s)
                    (pending.add if u.kind == "B" else pending.discard)((u.mb, u.chunk))


def test_no_lag_on_other_schedules():
    p = _plan("interleaved_1f1b")
    c = p.config
    assert cooldown_lag_levels(c.model, c.training, p.mesh, "interleaved_1f1b", 1, P, M, 2, p.stages[1]) is None
    assert not [e for e in p.timelines[1].events() if e.label.startswith("output gradients held")]
    assert not [n for n in p.timelines[1].notes if "cool-down" in n]  # (it had one, "up to 0 at once", before)
    phase, _, _ = mem_schedule.stage_op_arrays("zbv", 1, P, M, 2)
    assert int(phase.sum()) == 2 * M and len(phase) == 4 * M  # one backward (at its W) per chunk pass
