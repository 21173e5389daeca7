"""Transformer Engine's p2p ring step by step (meshplan.compute.te_ring, schedule.ring_timeline.p2p_steps):
each step's own call and TE's correction kernels, read in NVIDIA/TransformerEngine d0067d0
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``
(``AttnFuncWithCPAndKVP2P``): the forward's softmax_lse corrections per step (lines 1913-1968) and
output corrections after the loop (1980-2025, ``flash_attn_fwd_out_correction_init``,
``flash_attn_fwd_out_correction``, ``flash_attn_fwd_second_half_out_correction``, lines 139-195);
the backward's reversed steps (sections at lines 2577-2620) and dQ, dK and dV accumulation (2643-2690,
2721-2811). Before, every step was an equal 1/cp share of the rank's calls and TE's kernels were not
counted."""

from __future__ import annotations

import pytest

from meshplan.compute.te_ring import backward_calls, backward_kernels, forward_kernels
from meshplan.compute.ring_attention import ring_calls
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.rank_timeline import backward_unit, forward_unit
from meshplan.schedule.unit_sim import Overlap
from tests.test_cp_p2p import _one_layer


def test_te_kernel_bytes_by_hand_cp4_rank1():
    """cp 4, rank 1, n_o = 1,000 output elements, 10 lse rows (fp32), bf16 tensors. Forward: step 1
    clones step 0's lse (4 + 4 B a row: 80), step 2 corrects the lse with step 1's (1 <= rank: read
    both, write one, 12 B a row: 120), step 3 with step 2's second half (2 > rank: 6 B a row over all
    rows: 60); after the last call step 3's (60), then the output: init (read step 0's output, write
    ``out``: 4 n_o, + two lse reads 8 rows = 4,080), step 1 whole (read ``out`` and the step's output,
    write ``out``: 6 n_o + 8 rows = 6,080), steps 2 and 3 the second half (3 n_o + 4 rows = 3,040).
    Backward, j = cp - 1 - rank = 2: steps 0, 1 the upper triangle (L/2 x L), step 2 the lower
    (L x L/2), step 3 the diagonal. dQ (n_dq 1,000): step 0 its second half copied (2 B x 2 over half:
    2,000), step 1 added to it (3 x 2 B over half: 3,000), step 2 (i == j) first half copied and second
    added (2,000 + 3,000), step 3 the whole added (6,000). dK (100) and dV (200) each, after the wait:
    step 0 copied whole (4 n), step 1 added whole (6 n), step 2 its first half added (3 n), step 3 (the
    diagonal, rank != 0) added whole (6 n)."""
    assert forward_kernels(1000, 10, 4, 1) == [([], []), ([80], []), ([120], []), ([60], [60, 4080, 6080, 3040, 3040])]
    assert backward_kernels(1000, 100, 200, 4, 1) == [
        ([2000], [400, 800]), ([3000], [600, 1200]), ([2000, 3000], [300, 600]), ([6000], [600, 1200])]
    assert backward_calls(4, 8, 1) == [(4, 8, False), (4, 8, False), (8, 4, False), (8, 8, True)]
    assert sorted(backward_calls(4, 8, 1)) == sorted(ring_calls(4, 8, 1))   # the forward's calls, reversed


def test_steps_time_their_own_calls_and_agree_with_the_table_cp4():
    """Llama-3-8B, cp 4 x dp_shard 4 over two DGX H100 nodes, s 8192, full recompute (tests/test_cp_p2p.py
    ``_one_layer``): L = 2,048, 32 q heads, d 128, pair = 2 x 2048^2 x 32 x 128 = 3.4360e10 FLOP a call.
    Rank 0 (the slowest): forward step 0 the causal diagonal at FA3's 521 TFLOP/s (S7c, S 2048):
    0.065949 ms; steps 1-3 the upper triangle over 2,048 keys unmasked at 625: 0.054976 ms each, each
    with the lse correction of the step before beside it (at most 12 x 65,536 rows = 0.8 MB: the 4.7 us
    issue floor). Each K/V send, 8,388,608 B (X = 0.187416 ms, one NIC between the nodes), runs beside
    steps 0-2: exposed (X - 0.065949) + 2 (X - 0.054976 - 0.0047) = 0.376947 ms (an equal quarter of
    the steps' 0.297 ms would have hidden 3 x 0.0742 of them). The rank timeline issues what the table
    counts: forward 3 sends a layer; backward the replayed forward's 3 and the backward's 4 (K/V, 2 K/V
    with dK/dV, dK/dV)."""
    w, one, cost, rows = _one_layer(4, recompute="full")
    pair = 2 * 2048 ** 2 * 32 * 128
    x = rows[0].time_s
    assert round(x * 1e3, 6) == 0.187416
    calls = next(o for o in cost.ops if o.name == "attention" and o.phase == "forward").steps
    assert [a for a, _ in calls] == pytest.approx([pair / 521e12] + [pair / 625e12] * 3, rel=1e-12)
    comm = CommTimes.from_rows(rows, layers=1)
    f = forward_unit(one, comm, w, Overlap())
    ring = [e.end_s - e.start_s for e in f.events if e.name.endswith(" ring call")]
    assert ring == pytest.approx([pair / 521e12] + [pair / 625e12 + 4.7e-6] * 3, rel=1e-9)
    want = (x - pair / 521e12) + 2 * (x - pair / 625e12 - 4.7e-6)
    assert round(want * 1e3, 6) == 0.376947
    assert f.exposed_s["cp"] == pytest.approx(want, rel=1e-9)
    table = {ph: sum(r.per_layer for r in rows if r.phase == ph) for ph in ("forward", "backward")}
    b = backward_unit("B", one, comm, w, Overlap())
    timeline = {"forward": sum(e.stream == "cp" for e in f.events), "backward": sum(e.stream == "cp" for e in b.events)}
    assert table == timeline == {"forward": 3, "backward": 7}
    # the backward's dK/dV accumulation runs after each step's wait, its dQ beside the send
    names = [e.name for e in b.events if e.stream == "compute"]
    steps = names[names.index("attention ring call B"):]
    assert [n for n in steps if "ring" in n or n == "K/V wait"] == [
        "attention ring call B", "K/V wait", "attention ring step after its wait"] * 4
