"""Fused attention calls shorter than the catalog's rows (meshplan.compute.attention_points.below_rows):
the row's 512 edge x the shape model's ratio at the call's own batch and heads, by hand from the H100
FA3 d128 rows (kernels.toml ``[gpu.h100-sxm5-80gb.attention]``: forward causal 292 TFLOP/s at S 512,
S7c; backward 316 at 512, S8) and H100's 132 SMs (gpus.toml). Before, every such call read the 512
rate itself."""

from __future__ import annotations

import pytest

from meshplan.compute.measured import attention_seconds, kernel_data
from meshplan.compute.shapes import Attention

H100 = kernel_data("h100-sxm5-80gb")


def test_short_call_on_few_heads_reads_half_the_edge_rate():
    """b 1, 8 q heads, 256 x 256 causal: forward one block per 128 queries, 8 x 2 = 16 blocks in one
    wave of 132 SMs (16/132 busy) against the 512 edge's 8 x 4 = 32 (32/132): ratio 0.5, the loops'
    last blocks full both (256 = 2 x 128). Forward FLOP 4 x 8 x 256^2 x 128 / 2 = 134,217,728 at
    292 x 0.5 = 146 TFLOP/s: 0.9193 us; backward (blocks per 128 keys, the same count) 2.5 x that
    FLOP at 316 x 0.5 = 158: 2.1237 us. At the 512 rates before: 0.4596 and 1.0619 us."""
    a = Attention(1, 8, 8, 256, 256, 128)
    fwd = 4 * 8 * 256 ** 2 * 128 / 2
    assert fwd == 134_217_728
    f, b, how = attention_seconds(H100, a)
    assert (round(f * 1e6, 4), round(b * 1e6, 4)) == (0.9193, 2.1237)
    assert (f, b) == pytest.approx((fwd / 146e12, 2.5 * fwd / 158e12), rel=1e-12)
    assert "x0.500 (shape model: 16 blocks" in how and "edge (292)" in how


def test_full_gpu_keeps_the_edge_rate_and_partial_loops_lose_their_share():
    """The benchmark's own (32, 512) at 16 heads has 32 x 16 x 4 = 2,048 blocks in 16 waves
    (2048 / 2112 busy); at 256 tokens the same heads give 1,024 blocks in 8 waves (1024 / 1056): the
    same share, ratio 1, the 292 rate. A forward of 512 queries over 200 keys (8 heads: 32 blocks both)
    loops over two blocks of 128 of which 200 / 256 = 0.78125 are keys: 292 x 0.78125 = 228.125 TFLOP/s."""
    full = Attention(32, 16, 16, 256, 256, 128)
    f, _, _ = attention_seconds(H100, full)
    assert f == pytest.approx(4 * 32 * 16 * 256 ** 2 * 128 / 2 / 292e12, rel=1e-12)
    part = Attention(1, 8, 8, 512, 200, 128)
    f, _, how = attention_seconds(H100, part, lengths=(200, 512))
    assert f == pytest.approx(4 * 8 * 512 * 200 * 128 / 2 / 228.125e12, rel=1e-12)
    assert "x0.781" in how
