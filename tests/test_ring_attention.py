"""torch's context-parallel ring attention: the merge and fp32 gradient kernels around its SDPA
calls (meshplan.compute.ring_attention), counted by hand from torch's _templated_ring_attention."""

import pytest

from meshplan import catalog
from meshplan.compute import ring_attention
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
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
