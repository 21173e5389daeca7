"""torch's context-parallel ring attention: the merge and fp32 gradient kernels around its SDPA
calls (meshplan.compute.ring_attention), counted by hand from torch's _templated_ring_attention."""

import pytest

from meshplan import catalog
from meshplan.compute import ring_attention
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import SDPA_KERNELS, Workload
from meshplan.compute.ring_attention import GRAD_ACCUMULATION, MERGE, ring_bytes

LLAMA8B = catalog.model("llama3-8b")
H100_500W = catalog.gpu("h100-hbm2e-96gb-500w")


def test_eager_counts_by_hand_at_cp4():
    # one element of Q, two of K and V together, cp 4 (cp rank 3: three full later steps)
    # forward: Q 6 (first cast) + 3 x (6 + 12 + 8 + 12) + 6 (cast back) = 126; K/V 4 x 4 = 16 each
    # backward: Q 4 (zeros) + 4 x 10 + 6 = 50; K/V 4 + 4 + 10 + 3 x 13 + 3 x 4 + 4 x 8 + 6 = 107 each
    assert ring_bytes(1, 2, 4, eager=True) == (126 + 2 * 16, 50 + 2 * 107)


def test_compiled_counts_at_torchtitan_t2_cp8():
    # T2 cp8 256k: one sequence, 32 heads (K, V repeated to 32), local 32,768 tokens, d 128
    n_q = 32 * 32768 * 128
    assert n_q == 134_217_728
    fwd, bwd = ring_bytes(n_q, 2 * n_q, 8, eager=False)
    assert fwd == 134_217_728 * 82 + 268_435_456 * 4 == 12_079_595_520
    assert bwd == 134_217_728 * 82 + 268_435_456 * 86 == 34_091_302_912


def test_no_ring_at_cp1_and_compiled_below_eager():
    assert ring_bytes(10, 20, 1, eager=False) == (0, 0)
    for cp in (2, 4, 8):
        e, c = ring_bytes(10, 20, cp, True), ring_bytes(10, 20, cp, False)
        assert c[0] < e[0] and c[1] < e[1]


def _w(**kw) -> Workload:
    base = dict(seq_len=65536, micro_batch=1, cp=2, recompute="full", torch_ring_attention=True)
    return Workload(**{**base, **kw})


def _ring(cost):
    return {(o.name, o.phase): o for o in cost.ops if o.name.startswith(("cp ring",))}


def test_layer_ops_t2_cp2_compiled_with_full_ac():
    # local Q 32 x 32,768 x 128 = 134,217,728 elements, K and V twice that (repeat_kv)
    # forward 22 Q + 4 K/V = 4,026,531,840 B; backward 22 Q + 26 K/V = 9,932,111,872 B
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w()))
    assert ops[(MERGE, "forward")].size_bytes == 4_026_531_840
    assert ops[(GRAD_ACCUMULATION, "backward_input")].size_bytes == 9_932_111_872
    # timed at the part's measured streaming bandwidth, 2.117 TB/s (kernels.toml S12)
    assert ops[(MERGE, "forward")].seconds == pytest.approx(4_026_531_840 / 2.117e12)
    # full AC replays the forward's merge
    assert ops[(MERGE + " (recompute)", "backward_input")].size_bytes == 4_026_531_840
    assert set(ops) == {(MERGE, "forward"), (GRAD_ACCUMULATION, "backward_input"),
                        (MERGE + " (recompute)", "backward_input")}


def test_op_sac_saves_the_merged_output():
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w(recompute="op")))
    assert set(ops) == {(MERGE, "forward"), (GRAD_ACCUMULATION, "backward_input")}


def test_eager_layer_uses_eager_count():
    n_q = 32 * 32768 * 128
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w(torch_eager=True)))
    assert ops[(MERGE, "forward")].size_bytes == n_q * (12 + 38) + 2 * n_q * 8


@pytest.mark.parametrize("kw", [dict(cp=1), dict(torch_ring_attention=False), dict(flash=False)])
def test_no_ring_ops_without_torch_cp(kw):
    w = _w(**kw)
    assert not ring_attention.applies(w)
    assert _ring(layer_cost(LLAMA8B, H100_500W, w)) == {}


def test_megatron_has_no_torch_ring():
    from meshplan.compute.ops import framework_kernels
    from meshplan.spec.training import TrainingSpec
    assert framework_kernels(TrainingSpec(global_batch=8, seq_len=16))["torch_ring_attention"] is True
    megatron = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", grad_dtype="fp32")
    assert framework_kernels(megatron)["torch_ring_attention"] is False


def test_selective_recompute_replays_the_merge_with_the_core():
    ops = _ring(layer_cost(LLAMA8B, H100_500W, _w(recompute="selective")))
    assert ops[(MERGE + " (recompute)", "backward_input")].size_bytes == 4_026_531_840
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
    f, b, how = ring_attention.ring_seconds(d, att, 4, ("FA2",))
    # rank 0 (the slower): fwd causal 8192 at FA2 333 TFLOP/s, 3 x 4096x8192 unmasked at S 8192 (370);
    # bwd causal at S 8192 (318), 3 x at S 4096 queries (310); kernels.toml S7c / S8 FA2 columns
    assert f == pytest.approx(pair_flop / 333e12 + 3 * pair_flop / 370e12)
    assert b == pytest.approx(2.5 * pair_flop / 318e12 + 3 * 2.5 * pair_flop / 310e12)
    # rank 3: fwd 333 + 3 x 368 (S 4096 keys), bwd 318 + 3 x 318 (S 8192 queries): faster
    r3 = pair_flop / 333e12 + 3 * pair_flop / 368e12 + 2.5 * pair_flop / 318e12 * 4
    assert f + b > r3
    assert how.endswith("(cp rank 0: 1 causal 8192x8192, 3 of 4096x8192)")
    assert how.startswith("fwd FA2 fwd causal d128 333 TFLOP/s at S 8192")  # the first call's rows


def test_t2_cp8_layer_attention_by_hand():
    # T2 cp8 256k on the 500 W part: L 32,768, every call 32 x 32768^2 x 256 FLOP; rows past 16k
    # held at 16k: FA2 fwd causal 335, unmasked 370, bwd 322 TFLOP/s, x 0.797 (kernels.toml attention_scale)
    pair_flop = 32 * 32768 ** 2 * 256
    assert pair_flop == 8_796_093_022_208
    cost = layer_cost(LLAMA8B, H100_500W, _w(seq_len=262144, cp=8, attention_kernels=SDPA_KERNELS))  # torch: FA2
    att = {(o.name, o.phase): o.seconds for o in cost.ops if o.kind == "attention"}
    assert att[("attention", "forward")] == pytest.approx(pair_flop / (335e12 * 0.797) + 7 * pair_flop / (370e12 * 0.797))
    assert att[("attention", "backward_input")] == pytest.approx(8 * 2.5 * pair_flop / (322e12 * 0.797))
