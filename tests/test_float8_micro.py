"""torchao's float8 microbenchmark (benchmarks/float8_micro.py, its table
benchmarks/float8_micro/torchao_readme_h100.toml) and the component it corrected: float8 backward
GEMMs without fast accumulation (kernels.toml ``fp8_no_fast_accum_slowdown``,
:func:`meshplan.compute.kernel_time.no_fast_accum_factor`)."""

from __future__ import annotations

import statistics

import pytest

from bench_module import bench
from meshplan import catalog
from meshplan.compute.gemm import gemm_time
from meshplan.compute.kernel_time import gemm_ops
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import Gemm

fm = bench("float8_micro", "float8_micro_bench")
PART = "h100-hbm2e-96gb-500w"

# Constants of the part, each from its catalog source (kernels.toml [gpu.h100-hbm2e-96gb-500w]):
STREAM = 2.117e12  # B/s: S12, fused AdamW on the part, 14 B a parameter / 3.564 ms
NORM_FIXED, NORM_BW = 6.9e-6, 2.1706e12  # S11 Liger RMSNorm fit on SXM5 (6.9 us + B / 3.045 TB/s), bw x 0.7128
BF16_1K = 246.7e12 * 0.797  # S4 bf16 1024^3 x the part's bf16 ratio 0.797
FP8_1K, FP8_4K = 274.1e12 * 0.840, 1216.9e12 * 0.840  # S3 cuBLASLt fp8 1024^3, 4096^3 x 0.840
SLOW = 1.286  # fp8_no_fast_accum_slowdown


def _common(m: int, k: int, n: int) -> float:
    """LayerNorm forward (4 B an M x K element) and backward (6 B) as the fitted norm, sigmoid
    forward (4 B an M x N element) and backward (6 B) at the part's streaming bandwidth."""
    return (2 * NORM_FIXED + (4 + 6) * m * k / NORM_BW) + (4 + 6) * m * n / STREAM


def _rowwise_casts(m: int, k: int, n: int) -> float:
    """Rowwise compiled casts (float8.activation_kernels / weight_kernels / rescale_kernels):
    input and output gradient 5 + 3 B an element, weight 3 + 4 + 3 B, the weight gradient's
    rescale 4 B of its N x K output; all at streaming bandwidth."""
    return (8 * m * k + 8 * m * n + 10 * k * n + 4 * n * k) / STREAM


def test_table_as_published():
    # 36 rows x 6 N (M, K, N 1024..32768) of ao fdddb2c's rowwise heat map, and the README's two
    # tensorwise cells; spot values read off docs/static/fp8-rowwise-perf.png.
    cells = {(c.m, c.k, c.n, c.recipe): c.speedup for c in fm.cells()}
    assert sum(r == "rowwise" for *_, r in cells) == 216
    assert cells[(1024, 1024, 1024, "rowwise")] == 0.42
    assert cells[(16384, 32768, 32768, "rowwise")] == 1.72
    assert cells[(32768, 32768, 32768, "rowwise")] == 1.52
    assert cells[(8192, 4096, 4096, "rowwise")] == 1.00
    assert cells[(1024, 2048, 1024, "tensorwise")] == 0.80
    assert cells[(4096, 8192, 16384, "tensorwise")] == 1.39


def test_predicted_speedup_1024_cube_by_hand():
    # M = K = N = 1024, rowwise, LayerNorm -> Linear -> Sigmoid on the 500 W part. Every GEMM is a
    # measured point: bf16 2 x 1024^3 FLOP / 196.62 TFLOP/s = 10.922 us (x3 = 32.766 us); fp8 at
    # 230.24 TFLOP/s = 9.327 us forward, x 1.286 = 11.994 us each backward GEMM (33.316 us). The
    # module: LayerNorm 6.9 + 1.932 us and 6.9 + 2.899 us, sigmoid 1.981 + 2.972 us = 23.583 us.
    # Casts: (8 + 8 + 10 + 4) B x 1,048,576 / 2.117 TB/s = 14.860 us. bf16 56.349 us, float8
    # 71.759 us: 0.785 (published 0.42).
    m = k = n = 1024
    flop = 2.0 * m * k * n
    bf16 = _common(m, k, n) + 3 * flop / BF16_1K
    fp8 = _common(m, k, n) + flop / FP8_1K * (1 + 2 * SLOW) + _rowwise_casts(m, k, n)
    assert bf16 == pytest.approx(56.349e-6, rel=1e-3) and fp8 == pytest.approx(71.759e-6, rel=1e-3)
    assert fm.predicted(PART, fm.Cell(m, k, n, "rowwise", 0.42)) == pytest.approx(bf16 / fp8, rel=1e-3)
    assert bf16 / fp8 == pytest.approx(0.785, abs=1e-3)


def test_predicted_speedup_4096_cube_by_hand():
    # M = K = N = 4096, rowwise. fp8 4096^3 is a measured point: 1.374e11 FLOP / 1022.2 TFLOP/s =
    # 134.455 us forward, 172.909 us each backward (x 1.286): 480.273 us. bf16 4096^3 is not: its
    # 4 nearest points in log2 (M, N, K) (kernels.toml S4 x 0.797) are 4096x2048x4096 608.99 (d 1),
    # 2048x4096x2048 571.85 (d sqrt 2), 4096x4096x1024 542.84 (d 2), 2048x1024x4096 525.30 (d sqrt 5),
    # weights 1 / d^2: (608.99 + 571.85 / 2 + 542.84 / 4 + 525.30 / 5) / 1.95 = 582.40 TFLOP/s,
    # 235.99 us each (707.96 us). Module: LayerNorm 37.818 + 53.277 us, sigmoid 31.700 + 47.550 us
    # (170.345 us). Casts: 30 B x 16,777,216 / 2.117 TB/s = 237.75 us. bf16 878.31 us, float8
    # 888.37 us: 0.989 (published 0.84).
    m = k = n = 4096
    flop = 2.0 * m * k * n
    bf16_rate = (608.988 + 571.8475 / 2 + 542.8367 / 4 + 525.3027 / 5) / 1.95 * 1e12
    bf16 = _common(m, k, n) + 3 * flop / bf16_rate
    fp8 = _common(m, k, n) + flop / FP8_4K * (1 + 2 * SLOW) + _rowwise_casts(m, k, n)
    assert bf16 == pytest.approx(878.31e-6, rel=1e-3) and fp8 == pytest.approx(888.37e-6, rel=1e-3)
    assert fm.predicted(PART, fm.Cell(m, k, n, "rowwise", 0.84)) == pytest.approx(bf16 / fp8, rel=1e-3)


def test_catalog_slowdown_is_the_tables_derivation():
    # kernels.toml's 1.286 is the median over the rowwise cells with M, K, N all >= 8192 of the
    # backward-GEMM factor that makes each planned float8 time the published one (the benchmark's
    # --derive); a change to the planned casts or GEMM rows moves it, and this says so.
    large = [c for c in fm.cells() if c.recipe == "rowwise" and min(c.m, c.k, c.n) >= 8192]
    assert len(large) == 27
    median = statistics.median(fm.implied_factor(PART, c)[0] for c in large)
    assert round(median, 3) == SLOW == catalog.kernel_data(PART)["fp8_no_fast_accum_slowdown"]


def test_backward_fp8_gemms_take_the_factor():
    # A float8 Linear of Llama 3 8B's w_up shape (M 8192 tokens, N 14336, K 4096) on the part: its
    # forward GEMM at the catalog's fp8 rate, its data- and weight-gradient GEMMs 1.286 x theirs
    # (torchao: no fast accumulation there); on the SXM5 (no factor measured) all at the catalog's.
    w = Workload(seq_len=8192, micro_batch=1, linear_dtype="fp8", float8_gemms=frozenset({"w_up"}))
    g = Gemm("w_up", 8192, 14336, 4096)
    shapes = [(8192, 14336, 4096), (8192, 4096, 14336), (14336, 4096, 8192)]
    for name, factors in ((PART, (1.0, SLOW, SLOW)), ("h100-sxm5-80gb", (1.0, 1.0, 1.0))):
        gpu = catalog.gpu(name)
        ops = gemm_ops(gpu, g, "mlp", w, None)
        want = [gemm_time(gpu, *s, "fp8").seconds * f for s, f in zip(shapes, factors)]
        assert [op.seconds for op in ops] == pytest.approx(want, rel=1e-9)
    bf16 = Workload(seq_len=8192, micro_batch=1)
    ops = gemm_ops(catalog.gpu(PART), g, "mlp", bf16, None)
    assert [op.seconds for op in ops] == pytest.approx([gemm_time(catalog.gpu(PART), *s, "bf16").seconds
                                                        for s in shapes], rel=1e-9)
