"""Small and narrow GEMM shapes from the catalog's measured points (meshplan.compute.measured
gemm_tflops, issue 11 item 1): the A100 small cubes measured in Triton's matmul tutorial (kernels
toml "TT"), and below every GPU's measured points the box edge's rate scaled by the shape
model's compute efficiency (meshplan.compute.gemm.compute_efficiency), capped at 1."""

from __future__ import annotations

from math import log2

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan import catalog
from meshplan.compute.gemm import compute_efficiency, gemm_time
from meshplan.compute.gemm_points import gemm_tflops
from meshplan.compute.measured import kernel_data

A100 = "a100-sxm-80gb"
GPUS = [g for g in catalog.names("gpu") if kernel_data(g) is not None]


def _eff(gpu_name: str, dtype: str = "bf16"):
    gpu = catalog.gpu(gpu_name)
    return lambda m, n, k: compute_efficiency(gpu, m, n, k, dtype)


def _shepard(pts, q):
    """Shepard by hand: 4 nearest points in log2 (M, N, K), weights 1 / d^2."""
    dist = sorted((sum((log2(a) - log2(b)) ** 2 for a, b in zip(q, p[:3])) ** 0.5, p[3]) for p in pts)[:4]
    return sum(v / d ** 2 for d, v in dist) / sum(1 / d ** 2 for d, _ in dist)


def test_a100_audited_small_shapes_by_hand():
    """The audit's three A100 shapes (main gave 153.8, 143.4, 168.1 TFLOP/s: flat from 1024^3).

    - 256^3 and 512^3 are measured now ("TT": torch.matmul fp16 in Triton's matmul tutorial,
      median of three published runs): 3.28 and 21.85 TFLOP/s (1.1% and 7.0% of 312).
    - 128x1024x8192: M 128 is below every A100 point (smallest M 256), N and K are inside, so
      the edge is (256, 1024, 8192): Shepard over the 4 nearest points there, times the shape
      model's ratio. The ratio: 108 SMs; at M 128 the best tile is 128x128, 1 x 8 = 8 tiles in
      one wave; at M 256, 2 x 8 = 16 tiles, still one wave of the same length (128x256 or 256x128
      tiles give 4 or 8 tiles of twice the length): the same time for twice the FLOP, ratio 0.5.
    """
    d = kernel_data(A100)
    eff = _eff(A100)
    assert gemm_tflops(d, 256, 256, 256, "bf16", eff) == (3.28, "measured 3.28 TFLOP/s at 256x256x256 [TT]")
    assert gemm_tflops(d, 512, 512, 512, "bf16", eff)[0] == 21.85
    assert eff(128, 1024, 8192) / eff(256, 1024, 8192) == 0.5
    edge = _shepard(d.gemm["bf16"], (256, 1024, 8192))
    rate, how = gemm_tflops(d, 128, 1024, 8192, "bf16", eff)
    assert rate == pytest.approx(0.5 * edge) and "below the measured M" in how
    assert 60 < rate < 75  # 68.0: 22% of peak, where main read 168.1 (54%)


def test_a100_small_cube_nodes_are_the_median_of_three_runs():
    """kernels.toml "TT": cuBLAS column of triton issue 3551 and of issue 7085's triton 3.2 and
    3.3 runs, TFLOP/s at 256^3 .. 896^3; the node is the median of the three."""
    runs = {256: (2.978909, 3.28, 3.28), 384: (11.0592, 10.05, 11.06), 512: (21.845333, 23.83, 21.85),
            640: (39.384616, 36.57, 39.38), 768: (63.195428, 58.98, 58.98), 896: (73.943582, 73.94, 70.25)}
    nodes = {p[0]: p[3] for p in kernel_data(A100).gemm["bf16"] if p[4] == "TT"}
    assert set(nodes) == set(runs)
    for s, vals in runs.items():
        assert nodes[s] == pytest.approx(sorted(vals)[1], abs=0.005)


@pytest.mark.parametrize("gpu_name", GPUS)
def test_every_measured_point_is_returned_at_its_own_shape(gpu_name):
    """A measured shape returns its own value exactly, for every GPU and dtype of the catalog
    (none of them is below the measured box: each point is its own edge)."""
    d = kernel_data(gpu_name)
    for dtype, pts in d.gemm.items():
        eff = _eff(gpu_name, dtype)
        for m, n, k, v, _ in pts:
            assert gemm_tflops(d, m, n, k, dtype, eff)[0] == v, (gpu_name, dtype, m, n, k)


@pytest.mark.parametrize("gpu_name", GPUS)
def test_the_rule_meets_the_table_at_the_edge_and_never_exceeds_it(gpu_name):
    """Below the box the rate is the edge's times a ratio capped at 1: at the edge it is the
    table's own value, below it never more."""
    d = kernel_data(gpu_name)
    for dtype, pts in d.gemm.items():
        eff = _eff(gpu_name, dtype)
        lo = [min(p[i] for p in pts) for i in range(3)]
        for n, k in ((4096, 4096), (lo[1], 8192), (1024, lo[2])):
            at_edge = gemm_tflops(d, lo[0], n, k, dtype, eff)[0]
            assert gemm_tflops(d, lo[0] // 2, n, k, dtype, eff)[0] <= at_edge
            assert gemm_tflops(d, 1, n, k, dtype, eff)[0] <= at_edge


@settings(max_examples=60, deadline=None, derandomize=True)
@given(gpu_name=st.sampled_from(GPUS), n=st.integers(1, 1 << 16), k=st.integers(1, 1 << 16))
def test_efficiency_does_not_fall_as_m_doubles_up_to_the_measured_points(gpu_name, n, k):
    """At fixed N, K, the rate is non-decreasing as M doubles from 1 up to the smallest measured M
    (the rule below the box: the edge's rate x the model's compute efficiency, which at M = 2^i
    cannot fall: more rows fill more tiles of the same wave, or more waves of the same fill).

    Not tested above the smallest measured M, because it is not true there: Shepard's
    interpolation between measured points of different sources is not monotone in M (A100 at N
    128, K 512: 77.1 TFLOP/s at M 16384, 66.1 at 262144, where the point measured is the
    non-flash attention's batched GEMMs, "D S7a"); the table is what was measured."""
    d = kernel_data(gpu_name)
    for dtype, pts in d.gemm.items():
        eff = _eff(gpu_name, dtype)
        top = min(p[0] for p in pts)
        rates = [gemm_tflops(d, 1 << i, n, k, dtype, eff)[0] for i in range(top.bit_length()) if 1 << i <= top]
        assert all(a <= b * (1 + 1e-12) for a, b in zip(rates, rates[1:])), (dtype, rates)


def test_h100_narrow_m_below_its_points_by_hand():
    """H100 SXM5's smallest measured M is 256 (S4). 128x1024x8192: edge (256, 1024, 8192), Shepard
    there, times 0.5 (132 SMs: 8 against 16 tiles of 128x128, one wave each): 143.8 TFLOP/s,
    14.5% of peak, where main read 287.6 flat from 256x2048x4096 (288.3)."""
    d = kernel_data("h100-sxm5-80gb")
    eff = _eff("h100-sxm5-80gb")
    assert eff(128, 1024, 8192) / eff(256, 1024, 8192) == 0.5
    rate = gemm_tflops(d, 128, 1024, 8192, "bf16", eff)[0]
    assert rate == pytest.approx(0.5 * _shepard(d.gemm["bf16"], (256, 1024, 8192)))
    assert rate == pytest.approx(143.8, abs=0.05)


def test_small_k_is_bound_by_its_bytes_not_scaled_twice():
    """K below the points scales by 1 (the tiles' waves do not depend on K) and the memory
    roofline at Triad then times the GEMM: A100 8192x8192x16, 2 (M K + K N + M N) B at 1.70 TB/s."""
    e = gemm_time(catalog.gpu(A100), 8192, 8192, 16, "bf16")
    assert e.seconds == pytest.approx(2 * (8192 * 16 * 2 + 8192 * 8192) / 1.70e12)
    assert "memory-bound" in e.explanation and "below the measured K" in e.explanation
