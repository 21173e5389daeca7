"""torch's context-parallel ring attention: the merge and fp32 gradient kernels around its SDPA
calls (meshplan.compute.ring_attention), counted by hand from torch's _templated_ring_attention."""

import pytest

from meshplan import catalog
from meshplan.compute import ring_attention
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import SDPA_KERNELS
from meshplan.compute.ring_attention import GRAD_ACCUMULATION, MERGE, ring_bytes, slowest_rank
from meshplan.compute.shapes import attention_shape

LLAMA8B = catalog.model("llama3-8b")
H100_500W = catalog.gpu("h100-hbm2e-96gb-500w")


def test_eager_counts_by_hand_at_cp4():
    # one element of Q, two of K and V together, cp 4 (cp rank 3: three full later steps)
    # forward: Q 6 (first cast) + 3 x (6 + 12 + 8 + 12) + 6 (cast back) = 126; K/V 4 x 4 = 16 each
    # backward: Q 4 (zeros) + 4 x 10 + 6 = 50; K/V 4 + 4 + 10 + 3 x 13 + 3 x 4 + 4 x 8 + 6 = 107 each
    assert ring_bytes(1, 2, 4, eager=True, rank=3) == (126 + 2 * 16, 50 + 2 * 107)
    # cp rank 0: three half-Q steps (torch i > rank, partial): forward Q 6 + 3 x (19 + 8 cat) + 6 = 93;
    # backward Q 4 + 10 + 3 x (5 + 8 cat) + 6 = 59; K/V 4 + 4 + 10 + 3 x 10 (whole add) + 3 x 4 + 4 x 8 + 6 = 98
    assert ring_bytes(1, 2, 4, eager=True, rank=0) == (93 + 2 * 16, 59 + 2 * 98)


def test_compiled_counts_at_torchtitan_t2_cp8():
    # T2 cp8 256k: one sequence, 32 heads (K, V repeated to 32), local 32,768 tokens, d 128
    n_q = 32 * 32768 * 128
    assert n_q == 134_217_728
    # cp rank 7: forward Q 6 + 7 x 10 + 6 = 82, K/V 4; backward Q 82, K/V 6 + 7 x 9 (a half dK/dV
    # added: fp32 read 4 + written 4 over the whole, bf16 2 over half) + 6 + 4 = 79 (86 when the
    # half-K steps were counted at the whole-K 10 B)
    fwd, bwd = ring_bytes(n_q, 2 * n_q, 8, eager=False, rank=7)
    assert fwd == 134_217_728 * 82 + 268_435_456 * 4 == 12_079_595_520
    assert bwd == 134_217_728 * 82 + 268_435_456 * 79 == 32_212_254_720
    # cp rank 0: Q 6 + 7 x 9 (half-Q merge: the kept half copied 4 + 5) + 6 = 75; K/V 6 + 7 x 10 + 6 + 4 = 86
    assert ring_bytes(n_q, 2 * n_q, 8, eager=False, rank=0) == (
        134_217_728 * 75 + 268_435_456 * 4, 134_217_728 * 75 + 268_435_456 * 86)


def test_no_ring_at_cp1_and_compiled_below_eager():
    assert ring_bytes(10, 20, 1, eager=False, rank=0) == (0, 0)
    for cp in (2, 4, 8):
        for rank in range(cp):
            e, c = ring_bytes(10, 20, cp, True, rank), ring_bytes(10, 20, cp, False, rank)
            assert c[0] < e[0] and c[1] < e[1]


def _w(**kw) -> Workload:
    # torchtitan's T2 rows ran 9dec370 (Dec 2024), whose llama repeats K and V to the q heads before SDPA
    # (repeat_kv): [memory] kv_expanded true, the K/V these by-hand counts take
    base = dict(seq_len=65536, micro_batch=1, cp=2, recompute="full", torch_ring_attention=True, kv_expanded=True)
    return Workload(**{**base, **kw})


def _ring(cost):
    return {(o.name, o.phase): o for o in cost.ops if o.name.startswith(("cp ring",))}


def test_layer_ops_t2_cp2_compiled_with_full_ac():
    # local Q 32 x 32,768 x 128 = 134,217,728 elements, K and V twice that (repeat_kv). Both ranks'
    # SDPA calls are rated at S 16,384 (the rows end there), and compiled their ring bytes tie
    # (rank 0: forward 12 + 9 Q + 4 K/V = 29 Q, backward 21 Q + (16 + 10) K/V = 73 Q; rank 1: 30 and
    # 72 Q): the lower rank, 0. forward 29 x 134,217,728 = 3,892,314,112 B; backward 73 x = 9,797,894,144 B
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w()))
    assert ops[(MERGE, "forward")].size_bytes == 3_892_314_112
    assert ops[(GRAD_ACCUMULATION, "backward_input")].size_bytes == 9_797_894_144
    # timed at the part's measured streaming bandwidth, 2.117 TB/s (kernels.toml S12)
    assert ops[(MERGE, "forward")].seconds == pytest.approx(3_892_314_112 / 2.117e12)
    # full AC replays the forward's merge
    assert ops[(MERGE + " (recompute)", "backward_input")].size_bytes == 3_892_314_112
    assert set(ops) == {(MERGE, "forward"), (GRAD_ACCUMULATION, "backward_input"),
                        (MERGE + " (recompute)", "backward_input")}


def test_op_sac_saves_the_merged_output():
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w(recompute="op")))
    assert set(ops) == {(MERGE, "forward"), (GRAD_ACCUMULATION, "backward_input")}


def test_eager_layer_uses_eager_count():
    # eager cp 2: rank 1 merges the whole Q (12 + 38 Q + 8 K/V = 66 Q) against rank 0's half (12 + 27
    # + 16 = 55 Q); SDPA the same on both (S 16,384 rows): rank 1
    n_q = 32 * 32768 * 128
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w(torch_eager=True)))
    assert ops[(MERGE, "forward")].size_bytes == n_q * (12 + 38) + 2 * n_q * 8


@pytest.mark.parametrize("kw", [dict(cp=1), dict(torch_ring_attention=False), dict(flash=False)])
def test_no_ring_ops_without_torch_cp(kw):
    w = _w(**kw)
    assert not ring_attention.applies(w)
    assert _ring(layer_cost(LLAMA8B, H100_500W, w)) == {}


def test_megatron_has_no_torch_ring():
    from meshplan.compute.kernel_choices import framework_kernels
    from meshplan.spec.training import TrainingSpec
    assert framework_kernels(TrainingSpec(global_batch=8, seq_len=16))["torch_ring_attention"] is True
    megatron = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", grad_dtype="fp32")
    assert framework_kernels(megatron)["torch_ring_attention"] is False


def test_selective_recompute_replays_the_merge_with_the_core():
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w(recompute="selective")))
    assert ops[(MERGE + " (recompute)", "backward_input")].size_bytes == 3_892_314_112  # rank 0 (test above)
    assert len(ops) == 3


def test_ring_calls_cp4_load_balanced_from_torch_source():
    # torch _templated_ring_attention, cp 4, causal, load-balanced, L = s / cp local tokens:
    # step 0 IS_CAUSAL on the whole local Q, K, V (L x L); step i <= rank: Q against
    # key.chunk(2)[0] (L x L/2); step i > rank: query.chunk(2)[1] against K (L/2 x L); all unmasked
    L = 8192
    assert ring_attention.ring_calls(4, L, 0) == [(L, L, True)] + [(L // 2, L, False)] * 3
    assert ring_attention.ring_calls(4, L, 3) == [(L, L, True)] + [(L, L // 2, False)] * 3
    assert ring_attention.ring_calls(4, L, 2) == [(L, L, True), (L, L // 2, False), (L, L // 2, False),
                                                  (L // 2, L, False)]
    # every call is L^2 / 2 query-key pairs; together cp L^2 / 2 = the causal (L, s = 4 L) half
    for rank in range(4):
        pairs = [sq * sk / (2 if causal else 1) for sq, sk, causal in ring_attention.ring_calls(4, L, rank)]
        assert pairs == [L * L / 2] * 4
        assert sum(pairs) == L * (4 * L) / 2


def test_rate_lengths_forward_keys_backward_queries():
    # FA2: forward grid over query blocks, loop over keys; backward grid over key blocks, loop over queries
    assert ring_attention.rate_lengths(8192, 4096) == (4096, 8192)
    assert ring_attention.rate_lengths(4096, 8192) == (8192, 4096)


def test_ring_seconds_by_hand_h100_cp4_32k():
    from meshplan.compute.measured import kernel_data
    from meshplan.compute.shapes import Attention
    d = kernel_data("h100-sxm5-80gb")
    att = Attention(1, 32, 8, 8192, 32768, 128)  # cp 4 at 32k: L 8,192, 32 q heads, d 128
    pair_flop = 2 * 32 * 8192 * 8192 * 256 / 2   # every call: L^2 / 2 pairs x 4 d FLOP x 32 heads
    assert pair_flop == 549_755_813_888
    f, b, how = ring_attention.ring_seconds(d, att, 4, 0, ("FA2",))
    # rank 0: fwd causal 8192 at FA2 333 TFLOP/s, 3 x 4096x8192 unmasked at S 8192 (370);
    # bwd causal at S 8192 (318), 3 x at S 4096 queries (310); kernels.toml S7c / S8 FA2 columns
    assert f == pytest.approx(pair_flop / 333e12 + 3 * pair_flop / 370e12)
    assert b == pytest.approx(2.5 * pair_flop / 318e12 + 3 * 2.5 * pair_flop / 310e12)
    assert how.endswith("(cp rank 0: 1 causal 8192x8192, 3 of 4096x8192)")
    assert how.startswith("fwd FA2 fwd causal d128 333 TFLOP/s at S 8192")  # the first call's rows
    # rank 3: fwd 333 + 3 x 368 (S 4096 keys), bwd 318 + 3 x 318 (S 8192 queries): faster
    f3, b3, how3 = ring_attention.ring_seconds(d, att, 4, 3, ("FA2",))
    assert f3 + b3 == pytest.approx(pair_flop / 333e12 + 3 * pair_flop / 368e12 + 2.5 * pair_flop / 318e12 * 4)
    assert f + b > f3 + b3
    assert how3.endswith("(cp rank 3: 1 causal 8192x8192, 3 of 8192x4096)")


H100 = catalog.gpu("h100-sxm5-80gb")


def _small(cp: int, eager: bool, kv_expanded: bool = True) -> dict:
    """Llama 3 8B at seq 4,096 on the H100 SXM (Triad 2.97 TB/s, FA2 rows of kernels.toml S7c / S8), cp ``cp``;
    K and V repeated to the 32 q heads (``kv_expanded``, torchtitan before ff0829c) unless told otherwise."""
    w = Workload(seq_len=4096, micro_batch=1, cp=cp, recompute="none", torch_ring_attention=True,
                 torch_eager=eager, attention_kernels=SDPA_KERNELS, kv_expanded=kv_expanded)
    return {(o.name, o.phase): o for o in layer_cost(LLAMA8B, H100, w).ops
            if o.block == "attn" and (o.kind == "attention" or o.name.startswith("cp ring"))}


def test_small_cp4_block_is_one_rank_by_hand():
    # cp 4, L 1,024: n_q = 32 x 1024 x 128 = 4,194,304, n_kv = 2 n_q; every call 2^33 FLOP forward
    n_q, call = 4_194_304, 2 ** 33
    # SDPA, TFLOP/s: rank 0 fwd causal 260 (S 1024) + 3 x 512x1024 unmasked at 1024 keys 350;
    # bwd causal 260 + 3 x at 512 queries 214. Rank 3: fwd 260 + 3 x at 512 keys 309; bwd 4 x 260
    f0, b0 = call * (1 / 260 + 3 / 350) / 1e12, 2.5 * call * (1 / 260 + 3 / 214) / 1e12
    f3, b3 = call * (1 / 260 + 3 / 309) / 1e12, 2.5 * call * 4 / 260 / 1e12
    assert (f0 + b0) - (f3 + b3) == pytest.approx(4.37e-5, rel=1e-2)   # rank 0's SDPA is slower
    # ring bytes in Q elements (ring_bytes). Compiled: rank 0 forward 12 + 3 x 9 + 4 x 2 = 47, backward
    # 12 + 3 x 9 + (16 + 3 x 10) x 2 = 131; rank 3 forward 12 + 3 x 10 + 8 = 50, backward 42 + (16 + 27) x 2
    # = 128: a tie (178), so rank 0, the slower SDPA, is the block: its calls and its bytes
    ops = _small(4, eager=False)
    assert ops[("attention", "forward")].seconds == pytest.approx(f0)
    assert ops[("attention", "backward_input")].seconds == pytest.approx(b0)
    assert ops[(MERGE, "forward")].size_bytes == 47 * n_q == 197_132_288
    assert ops[(GRAD_ACCUMULATION, "backward_input")].size_bytes == 131 * n_q == 549_453_824
    # eager: rank 0 forward 12 + 3 x 27 + 4 x 4 x 2 = 125, backward 20 + 3 x 13 + (24 + 3 x 10 + 12 + 32) x 2
    # = 255; rank 3 forward 12 + 3 x 38 + 32 = 158, backward 50 + 107 x 2 = 264: 42 Q more, 42 x 4,194,304 B
    # / 2.97 TB/s = 59.3 us > rank 0's 43.7 us of SDPA: rank 3 is the block, its calls and its bytes
    assert 42 * n_q / 2.97e12 == pytest.approx(5.93e-5, rel=1e-2)
    ops = _small(4, eager=True)
    assert ops[("attention", "forward")].seconds == pytest.approx(f3)
    assert ops[("attention", "backward_input")].seconds == pytest.approx(b3)
    assert ops[(MERGE, "forward")].size_bytes == 158 * n_q
    assert ops[(GRAD_ACCUMULATION, "backward_input")].size_bytes == 264 * n_q
    assert ops[(MERGE, "forward")].note.startswith("cp rank 3: ")


def test_small_cp2_block_is_one_rank_by_hand():
    # cp 2, L 2,048: n_q = 32 x 2048 x 128 = 8,388,608; every call 2^35 FLOP forward
    n_q, call = 8_388_608, 2 ** 35
    # rank 0: fwd causal 298 (S 2048) + 1024x2048 at 2048 keys 362; bwd 291 + at 1024 queries 260
    # rank 1: fwd 298 + 2048x1024 at 1024 keys 350; bwd 291 + at 2048 queries 291
    f0, b0 = call * (1 / 298 + 1 / 362) / 1e12, 2.5 * call * (1 / 291 + 1 / 260) / 1e12
    f1, b1 = call * (1 / 298 + 1 / 350) / 1e12, 2.5 * call * 2 / 291 / 1e12
    assert (f0 + b0) - (f1 + b1) == pytest.approx(3.19e-5, rel=1e-2)
    # compiled: rank 0 forward 12 + 9 + 8 = 29, backward 21 + 26 x 2 = 73; rank 1 30 and 22 + 25 x 2 = 72: tie
    ops = _small(2, eager=False)
    assert (ops[("attention", "forward")].seconds, ops[("attention", "backward_input")].seconds) == (
        pytest.approx(f0), pytest.approx(b0))
    assert ops[(MERGE, "forward")].size_bytes == 29 * n_q
    assert ops[(GRAD_ACCUMULATION, "backward_input")].size_bytes == 73 * n_q
    # eager: rank 0 forward 12 + 27 + 16 = 55, backward 33 + 54 x 2 = 141; rank 1 66 and 30 + 57 x 2 = 144:
    # 14 Q more, 14 x 8,388,608 B / 2.97 TB/s = 39.5 us > 31.9 us: rank 1
    ops = _small(2, eager=True)
    assert (ops[("attention", "forward")].seconds, ops[("attention", "backward_input")].seconds) == (
        pytest.approx(f1), pytest.approx(b1))
    assert ops[(MERGE, "forward")].size_bytes == 66 * n_q
    assert ops[(GRAD_ACCUMULATION, "backward_input")].size_bytes == 144 * n_q


def test_small_blocks_at_the_kv_heads_by_hand():
    """The default, ``[memory] kv_expanded`` false (torchtitan ff0829c and later: enable_gqa, no repeat_kv):
    the ring's K/V are the 8 KV heads', n_kv = 8 x L x 256 = n_q / 2 (n_q = 32 x L x 128), a quarter of the
    repeated K/V of the tests above; the SDPA calls are the same (the q heads' FLOP). Ring bytes in Q
    elements (ring_bytes), r = rank, p = cp - 1 - r.
    cp 4 (n_q 4,194,304), compiled: rank 0 forward 12 + 3 x 9 + 4 x 1/2 = 41, backward 39 + (16 + 3 x 10) / 2
    = 62 (103); rank 3 44 and 42 + (16 + 27) / 2 = 63.5 (107.5): 4.5 Q more, 6.4 us, against rank 0's
    43.7 us more SDPA: rank 0. Eager: rank 0 forward 93 + 16 / 2 = 101, backward 59 + (24 + 30 + 12 + 32) / 2
    = 108 (209); rank 3 126 + 8 = 134 and 50 + (24 + 39 + 44) / 2 = 103.5 (237.5): 28.5 Q more, 28.5 x
    4,194,304 B / 2.97 TB/s = 40.2 us < 43.7 us: rank 0 now (rank 3 with the repeated K/V).
    cp 2 (n_q 8,388,608), compiled: rank 0 21 + 4 / 2 = 23 and 21 + 26 / 2 = 34; rank 1 24 and 22 + 25 / 2 =
    34.5: rank 0. Eager: rank 0 39 + 8 / 2 = 43 and 33 + (24 + 10 + 4 + 16) / 2 = 60 (103); rank 1 54 and
    30 + 57 / 2 = 58.5 (112.5): 9.5 Q more, 26.8 us < rank 0's 31.9 us more SDPA: rank 0."""
    assert 28.5 * 4_194_304 / 2.97e12 == pytest.approx(4.02e-5, rel=1e-2)
    assert 9.5 * 8_388_608 / 2.97e12 == pytest.approx(2.68e-5, rel=1e-2)
    for cp, n_q, want in ((4, 4_194_304, {False: (41, 62), True: (101, 108)}),
                          (2, 8_388_608, {False: (23, 34), True: (43, 60)})):
        for eager, (f, b) in want.items():
            ops = _small(cp, eager, kv_expanded=False)
            assert ops[(MERGE, "forward")].size_bytes == f * n_q
            assert ops[(GRAD_ACCUMULATION, "backward_input")].size_bytes == b * n_q
            assert ops[(MERGE, "forward")].note.startswith("cp rank 0: ")


@pytest.mark.parametrize("kv_expanded", [False, True])
def test_slowest_rank_considers_every_rank(kv_expanded):
    # the choice is the argmax over all cp ranks of SDPA + ring kernels. A middle rank is never strictly the
    # slowest: rank r runs r calls of L x L/2 and cp - 1 - r of L/2 x L, and its ring bytes are a + b r
    # (ring_bytes), so each term is affine in r under a max (issue floor, memory_kernel_seconds' floor):
    # convex, its maximum at rank 0 or cp - 1. This test cannot tell the loop over every rank from one
    # over those two; it checks the argmax and the convexity that makes them the same.
    from meshplan.compute.kernel_time import issue_floor, memory_op_seconds
    from meshplan.compute.measured import kernel_data
    from meshplan.compute.shapes import Attention
    d = kernel_data("h100-sxm5-80gb")
    att = Attention(1, 32, 8, 1024, 4096, 128)
    n_kv = 8_388_608 if kv_expanded else 2_097_152  # 32 q heads x 1,024 x 256, or the 8 KV heads'
    for eager in (False, True):
        w = Workload(seq_len=4096, cp=4, torch_ring_attention=True, torch_eager=eager, attention_kernels=SDPA_KERNELS,
                     kv_expanded=kv_expanded)
        totals = []
        for rank in range(4):
            f, b, _ = ring_attention.ring_seconds(d, att, 4, rank, SDPA_KERNELS)
            fb, bb = ring_bytes(4_194_304, n_kv, 4, eager, rank)
            totals.append(issue_floor(H100, f) + issue_floor(H100, b) + memory_op_seconds(H100, fb)
                          + memory_op_seconds(H100, bb))
        chosen = ring_attention.slowest_rank(H100, att, w, d)
        assert totals[chosen.rank] == pytest.approx(max(totals))
        assert chosen.rank == (3 if eager and kv_expanded else 0)  # test_small_blocks_at_the_kv_heads_by_hand
        assert all(totals[r] <= (totals[r - 1] + totals[r + 1]) / 2 * (1 + 1e-12) for r in (1, 2))  # convex in r


def test_t2_cp8_layer_attention_by_hand():
    # T2 cp8 256k on the 500 W part: L 32,768, every call 32 x 32768^2 x 256 FLOP; rows past 16k
    # held at 16k: FA2 fwd causal 335, unmasked 370, bwd 322 TFLOP/s, x 0.797 (kernels.toml attention_scale)
    pair_flop = 32 * 32768 ** 2 * 256
    assert pair_flop == 8_796_093_022_208
    cost = layer_cost(LLAMA8B, H100_500W, _w(seq_len=262144, cp=8, attention_kernels=SDPA_KERNELS))  # torch: FA2
    att = {(o.name, o.phase): o.seconds for o in cost.ops if o.kind == "attention"}
    assert att[("attention", "forward")] == pytest.approx(pair_flop / (335e12 * 0.797) + 7 * pair_flop / (370e12 * 0.797))
    assert att[("attention", "backward_input")] == pytest.approx(8 * 2.5 * pair_flop / (322e12 * 0.797))


def test_mla_ring_accumulates_dq_at_qs_head_dim():
    """MLA's Q (and dQ, torch's ``grad_query = zeros_like(query, dtype=float32)``) has d_qk = 128 +
    64 = 192 per head, its output d_v = 128. DeepSeek-V2-Lite at tp 2 (8 local heads), cp 2, s 4096,
    b 1: L 2048; output 8 x 2048 x 128 = 2,097,152 elements, Q 8 x 2048 x 192 = 3,145,728, K and V
    8 x 2048 x 320 = 5,242,880. Eager, no rates: rank 1 holds the most ring bytes (forward 50 n_q
    against 39 n_q, the K/V terms equal; backward 30 n_dq + 57 n_kv against 33 n_dq + 54 n_kv).
    Its backward: 30 x 3,145,728 + 57 x 5,242,880 = 94,371,840 + 298,844,160 = 393,216,000 B (dQ
    at d_v would give 361,758,720); forward 50 x 2,097,152 + 8 x 5,242,880 = 146,800,640 B."""
    model = catalog.model("deepseek-v2-lite")
    att = attention_shape(model, 2, 2, 1, 4096)
    assert (att.q_heads, att.seq_q, att.head_dim, att.d_v) == (8, 2048, 192, 128)
    w = Workload(seq_len=4096, cp=2, torch_ring_attention=True, torch_eager=True)
    chosen = slowest_rank(catalog.gpu("h100-sxm5-80gb"), att, w)
    assert (chosen.rank, chosen.forward_bytes, chosen.backward_bytes) == (1, 146_800_640, 393_216_000)
