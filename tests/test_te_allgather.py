"""Transformer Engine's all-gather CP (Megatron-LM ``--cp-comm-type all_gather``): two calls per
layer per rank, each rated at its own shape, in series under FA3 and on two streams otherwise
(meshplan.compute.te_allgather), by hand from NVIDIA/TransformerEngine d0067d0
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``
(``AttnFuncWithCPAndKVAllGather``: chunks ``[rank, 2 cp - rank - 1]`` line 3254, keys ``[0, (c + 1)
L / 2)`` from ``get_kv_seq_info_after_all_gather`` lines 2976-3010, FA3's
``wait_stream`` lines 3341-3345 and 3847-3853) and the catalog's attention rows
(kernels.toml: H100 FA3 fwd causal d128 [292, 423, 521, 579, 602, 616] (S7c), FA3 bwd any d128
[316, 424, 501, 542, 559, 561] (S8); A100 FA2 fwd+bwd causal d128 [99, 133, 155, 173, 182, 189]
(S7a), at S = 512 ... 16,384, linear in log2 S between them, clamped at the ends)."""

from __future__ import annotations

from math import log2

import pytest

from meshplan import catalog
from meshplan.compute import te_allgather
from meshplan.compute.attention import flash_ops
from meshplan.compute.measured import kernel_data
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import Attention

H100_FWD = [292, 423, 521, 579, 602, 616]
H100_BWD = [316, 424, 501, 542, 559, 561]
A100_FWD_BWD = [99, 133, 155, 173, 182, 189]
S = [512, 1024, 2048, 4096, 8192, 16384]


def _rate(row: list[int], x: float) -> float:
    """The rows' rate at length x, typed from their rule: linear in log2 S, clamped."""
    if x >= S[-1]:
        return row[-1]
    i = max(k for k in range(len(S)) if S[k] <= x)
    return row[i] + (log2(x) - log2(S[i])) * (row[i + 1] - row[i])


def test_each_rank_two_calls_cover_the_causal_rank_shape():
    """cp 4, L = 8 (chunks of 4, 2 cp = 8 chunks): rank r holds chunks r and 7 - r, so its calls
    are 4 queries under 4 (r + 1) and 4 (8 - r) keys. Bottom-right causal pairs q k - q^2 / 2:
    rank 0: (4 x 4 - 8) + (4 x 32 - 8) = 8 + 120 = 128; rank 2: (48 - 8) + (96 - 8) = 128; each
    rank's two calls hold L s / 2 = 8 x 32 / 2 = 128 pairs, the one (L, s) causal call's."""
    assert te_allgather.calls(4, 8, 0) == [(4, 4), (4, 32)]
    assert te_allgather.calls(4, 8, 2) == [(4, 12), (4, 24)]
    for cp in (2, 4, 8):
        for r in range(cp):
            assert sum(te_allgather.causal_pairs(q, k) for q, k in te_allgather.calls(cp, 8, r)) == 8 * 8 * cp / 2


def test_h100_fa3_calls_run_in_series_by_hand():
    """Llama-shaped heads, b 1, 8 q heads of d 128, s 16,384, cp 2: L = 8,192, chunks of 4,096.
    FA3 (H100's first kernel) waits call 1 on call 0 (TE 3341-3345): the pass is their sum.
    Rank 0, chunks 0 and 3: the 4,096 square (pairs 8,388,608, FLOP 2 x 8 x pairs x 256 =
    34.36 GFLOP) at S 4,096 fwd 579, bwd 542: 59.343 us and 2.5 x 34.36e9 / 542e12 = 158.486 us;
    4,096 x 16,384 (pairs 67,108,864 - 8,388,608 = 58,720,256, 240.52 GFLOP) forward read at 2
    pairs / q = 28,672 (clamped: 616): 390.452 us; backward at 2 pairs / k = 7,168, 542 + 17
    log2(7168 / 4096) = 555.725: 1,082.002 us. Forward 449.795 us, backward 1,240.488 us, 1,690.283
    in all. Rank 1, chunks 1 and 2 (4,096 x 8,192 and x 12,288): forward 168.930 + 278.894,
    backward 466.891 + 774.524: 1,689.240 in all, less: rank 0 is counted."""
    h100 = catalog.gpu("h100-sxm5-80gb")
    att = Attention(1, 8, 8, 8192, 16384, 128)
    w = Workload(seq_len=16384, cp=2, framework="megatron")
    r = te_allgather.te_allgather_rank(h100, att, w, kernel_data("h100-sxm5-80gb"))
    assert (r.rank, r.calls, r.serial) == (0, ((4096, 4096), (4096, 16384)), True)
    flop0, flop1 = 2 * 8 * 8_388_608 * 256, 2 * 8 * 58_720_256 * 256
    assert r.forward == pytest.approx((flop0 / 579e12, flop1 / 616e12), rel=1e-12)
    assert r.backward == pytest.approx((2.5 * flop0 / 542e12, 2.5 * flop1 / (_rate(H100_BWD, 7168) * 1e12)), rel=1e-12)
    assert [round(x * 1e6, 3) for x in r.seconds] == [449.795, 1240.488]
    assert r.seconds == pytest.approx((sum(r.forward), sum(r.backward)), rel=1e-12)


def test_a100_fa2_calls_share_the_sms_by_hand():
    """Llama 3 8B's 32 q heads of d 128, b 1, s 8,192, cp 8: L = 1,024, chunks of 512; A100 (108
    SMs) runs FA2 (fwd+bwd causal row, forward factor 1, backward 2.5), the two calls on two
    streams at once. Forward grids: 32 x 512 / 128 = 128 blocks each, 2 waves of 108 (busy
    128 / 216 = 0.5926); together 256 blocks, 3 waves (256 / 324 = 0.7901): the pair takes
    max(t0, t1, 0.75 (t0 + t1)). Rank 7 (chunks 7 and 8): 512 x 4,096 (pairs 2,097,152 - 131,072 =
    1,966,080; FLOP 2 x 32 x pairs x 256 = 32.21 GFLOP) at 2 pairs / q =
    7,680: 173 + 9 log2(7680 / 4096) = 181.162 -> 177.809 us; 512 x 4,608 (2,228,224 pairs,
    36.51 GFLOP) at 8,704: 182 + 7 log2(8704 / 8192) = 182.612 -> 199.917 us; together 0.75 x
    377.726 = 283.294 us, against 377.726 in series. The slowest rank by forward + backward is
    rank 0 (chunks 0 and 15: the 512 square at the 99 TFLOP/s edge and 512 x 8,192): forward
    352.831 us (the long call alone outlasts 0.75 x 374.523), backward 1,350.635 us."""
    a100 = catalog.gpu("a100-sxm-80gb")
    data = kernel_data("a100-sxm-80gb")
    att = Attention(1, 32, 8, 1024, 8192, 128)
    w = Workload(seq_len=8192, cp=8, framework="megatron")
    t7 = [te_allgather.rated_call(data, att, q, k, ())[0] for q, k in te_allgather.calls(8, 1024, 7)]
    assert t7 == pytest.approx([2 * 32 * 1_966_080 * 256 / (_rate(A100_FWD_BWD, 7680) * 1e12),
                                2 * 32 * 2_228_224 * 256 / (_rate(A100_FWD_BWD, 8704) * 1e12)], rel=1e-12)
    assert round(te_allgather.together(108, 32, (t7[0], t7[1]), (512, 512), False) * 1e6, 3) == 283.294
    r = te_allgather.te_allgather_rank(a100, att, w, data)
    assert (r.rank, r.serial, r.calls) == (0, False, ((512, 512), (512, 8192)))
    assert [round(x * 1e6, 3) for x in r.seconds] == [352.831, 1350.635]
    assert r.seconds[0] == max(r.forward)


def test_flash_ops_take_the_pair_under_megatron_allgather_only():
    """The attention ops of flash_ops under Megatron all-gather CP carry the pair's seconds (the
    replay the forward's); torch's all-gather CP (meshplan's runtime: one SDPA call of (L, s)) and
    TE's p2p ring are not these two calls."""
    h100 = catalog.gpu("h100-sxm5-80gb")
    att = Attention(1, 8, 8, 8192, 16384, 128)
    mg = Workload(seq_len=16384, cp=2, framework="megatron")
    ops = {(o.phase, o.recompute): o.seconds for o in flash_ops(h100, att, mg, recompute=True) if o.kind == "attention"}
    assert [round(ops[k] * 1e6, 3) for k in (("forward", False), ("backward_input", False), ("backward_input", True))] == [
        449.795, 1240.488, 449.795]
    torch_ops = [o for o in flash_ops(h100, att, Workload(seq_len=16384, cp=2), recompute=False) if o.kind == "attention"]
    assert "TE all-gather" not in torch_ops[0].note and round(torch_ops[0].seconds * 1e6, 3) != 449.795
    assert not te_allgather.applies(Workload(seq_len=16384, cp=2, framework="megatron", te_ring_attention=True))
    assert not te_allgather.applies(Workload(seq_len=16384, cp=1, framework="megatron"))
