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
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.rank_timeline import forward_unit
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
    with the lse correction of the step before beside it on TE's other flash stream (lines 1678,
    1700, 1919: at most 12 x 65,536 rows = 0.8 MB, 0.26 us at Triad; the host's two kernels 2 x 4.7
    us): hidden by the 55 us call, which was 4.7 us longer with the correction in series. Each K/V
    send, 8,388,608 B (X = 0.187416 ms, one NIC between the nodes), runs beside steps 0-2, the sends
    back to back (X above every call): exposed (X - 0.065949) + 2 (X - 0.054976) = 0.386347 ms (an
    equal quarter of the steps' 0.297 ms would have hidden 3 x 0.0742 of them). The rank timeline issues what the table
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
    assert ring == pytest.approx([pair / 521e12] + [pair / 625e12] * 3, rel=1e-9)
    want = (x - pair / 521e12) + 2 * (x - pair / 625e12)
    assert round(want * 1e3, 6) == 0.386347
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


def test_forward_send_waits_for_the_call_two_steps_back():
    """TE's forward issues the send of step i from flash stream i % 2 (lines 1700-1715), whose last
    work is call i - 2, so the send waits for the previous send and that call, not for call i - 1
    (:func:`meshplan.schedule.ring_timeline.p2p_steps` with ``two_streams``); the backward's one
    stream waits for everything before. cp 4, the K/V send of tests above (X = 0.187416 ms, no SMs
    held: compute runs at full speed beside it), steps by hand: call 0 0.3 ms, calls 1-3 0.05 ms.
    One stream: send 1 after call 0 (0.3 -> 0.487416), call 2 at 0.487416, send 2 after it
    (-> 0.674832), call 3 at 0.674832, end 0.724832 ms, exposed (0.487416 - 0.35) + (0.674832 -
    0.537416) = 0.274832. Two streams: send 1 after send 0 (0.187416 -> 0.374832), call 1 0.3-0.35,
    call 2 at 0.374832, send 2 after send 1 and call 0 (-> 0.562248), call 3 at 0.562248, end
    0.612248 ms, exposed (0.374832 - 0.35) + (0.562248 - 0.424832) = 0.162248 ms."""
    from meshplan.schedule.ring_timeline import p2p_sends, p2p_steps
    from meshplan.schedule.unit_sim import StreamSim
    w, _, _, rows = _one_layer(4, recompute="full")
    comm = CommTimes.from_rows(rows, layers=1)
    assert round(rows[0].time_s * 1e3, 6) == 0.187416 and comm.sm_share("cp", "forward", "send/recv") == 0.0
    steps = ((0.3e-3, 0.0),) + ((0.05e-3, 0.0),) * 3
    got = {}
    for two in (False, True):
        s = StreamSim(comm, w, Overlap())
        p2p_steps(s, "a ring call", "forward", 0.45e-3, p2p_sends(4, "forward"), steps, two_streams=two)
        u = s.finish()
        got[two] = (max(e.end_s for e in u.events), u.exposed_s["cp"])
    assert got[False] == pytest.approx((0.724832e-3, 0.274832e-3), abs=1e-9)
    assert got[True] == pytest.approx((0.612248e-3, 0.162248e-3), abs=1e-9)


def test_te_kernel_bytes_by_hand_cp4_last_rank():
    """cp 4, rank 3 (the last; same sizes as the rank 1 case above), which takes branches rank 1 does
    not. Forward: every step ``i - 1 <= rank``, so the lse corrections are whole (12 B a row: 120)
    after step 1's clone (80), and every output correction is whole (6 n_o + 8 rows = 6,080) after
    the init (4,080). Backward, j = cp - 1 - rank = 0: step 0 is the lower triangle (L x L/2) with
    i == j at rank cp - 1, so dQ is copied whole (4 n_dq = 4,000, context_parallel.py's ``if rank ==
    (cp_size - 1): dq.copy_(dq_)``) and dK/dV's first half copied (``i == 0 and rank == (cp_size -
    1)``: 2 n = 200, 400); steps 1, 2 (lower) add dQ whole (6,000) and dK/dV's first half (3 n = 300,
    600); step 3, the diagonal at a rank other than 0, adds all three whole (6,000; 600, 1,200)."""
    assert forward_kernels(1000, 10, 4, 3) == [
        ([], []), ([80], []), ([120], []), ([120], [120, 4080, 6080, 6080, 6080])]
    assert backward_kernels(1000, 100, 200, 4, 3) == [
        ([4000], [200, 400]), ([6000], [300, 600]), ([6000], [300, 600]), ([6000], [600, 1200])]
    assert backward_calls(4, 8, 3) == [(8, 4, False)] * 3 + [(8, 8, True)]

def test_slowest_rank_memoised_per_shape_as_rated_uncached():
    """te_rank memoises per shape (te_ring._slowest, keyed on the GPU's name, kernel files and HBM
    bandwidth, the shape, cp and the kernel preference): the search asks the same shapes for many
    candidates. Llama-3-70B's cp 8 rank shape at 96k tokens (tp 8: 8 q heads, 1 KV head; L = 12,288):
    a second call returns the first's object, and it equals the uncached rating (_slowest_rank) field
    by field; kernel data other than the GPU's own (a copy) is rated uncached, to the same values;
    another cp is another entry (cp 4 rates its own ranks: 4 forward calls, not 8)."""
    from dataclasses import replace

    from meshplan import catalog
    from meshplan.compute import te_ring
    from meshplan.compute.kernel_fragment import kernel_data
    from meshplan.compute.ops import Workload
    from meshplan.compute.shapes import Attention

    h100 = catalog.gpu("h100-sxm5-80gb")
    att = Attention(1, 8, 1, 12_288, 98_304, 128)
    w = Workload(seq_len=98_304, cp=8, attention_kernels=("FA3",))
    data = kernel_data(h100)
    first = te_ring.te_rank(h100, att, w, data)
    assert te_ring.te_rank(h100, att, w, data) is first
    assert first == te_ring._slowest_rank(h100, att, 8, ("FA3",), data)
    other = te_ring.te_rank(h100, att, w, replace(data))
    assert other == first and other is not first
    assert len(first.calls[0]) == 8 and len(te_ring.te_rank(h100, att, replace(w, cp=4), data).calls[0]) == 4
    assert te_ring.te_rank(h100, att, w) == te_ring._slowest_rank(h100, att, 8, ("FA3",), None)
