"""Async TP's GEMMs beside torch's copy-engine pulls (issue 11, nc55 #5): measured on the part of
torchtitan's async TP runs, the 96 GB HBM2e H100 at 500 W (catalog ``h100-hbm2e-96gb-500w``).

Source: yifuwang/symm-mem-recipes ``symm_mem_recipes/README.md`` (00db684), "8xH100 (special
version with HBM2e, at 500W) with NVSwitch": a persistent Triton bf16 GEMM fed by an all-gather
whose shards the backend stream pulls from each peer's symmetric buffer (``Tensor.copy_``, the
copy engine, as torch's ``fused_all_gather_matmul`` pulls), against the same kernel with the
data in place ("triton mm only"), us:

=====  ======  =====  =====
model  M       alone  fused
=====  ======  =====  =====
70B    4096    483    543
70B    8192    849    948
70B    16384   1655   1846
105B   4096    1595   1776
105B   8192    2953   3243
105B   16384   5948   6538
=====  ======  =====  =====

(70B: N 3584, K 8192; 105B: N 6656, K 16384.) Seven pulls of M / 8 x K bf16 at the NVLink ring
step's 364 GB/s take 20-39% of each GEMM (70B, M 16384: 7 x 2048 x 8192 x 2 B = 234.9 MB, 645 us
of 1655), so the kernel never waits for data: the difference is the pulls' contention and the
call's synchronisation. Least squares by hand (sums over the six: x = alone, y = fused):
n = 6, Sx = 13,483, Sy = 14,894, Sxx = 50,336,053, Sxy = 55,419,574 (the test recomputes them);
slope = (n Sxy - Sx Sy) / (n Sxx - Sx^2) = (332,517,444 - 200,815,802) / (302,016,318 - 181,791,289)
= 131,701,642 / 120,225,029 = 1.09546, intercept = (Sy - slope Sx) / n = (14,894 - 14,770.1) / 6
= 20.65 us: catalog 0.0955 and 20.7 us.
"""

from __future__ import annotations


import pytest

from meshplan.compute import asynctp
from meshplan.compute.measured import kernel_data
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from bench_module import bench

PART = "h100-hbm2e-96gb-500w"
README = [(483, 543), (849, 948), (1655, 1846), (1595, 1776), (2953, 3243), (5948, 6538)]


def _bench():
    return bench('torchtitan_h100', 'torchtitan_h100_ce')


def test_catalog_terms_are_the_readmes_least_squares():
    n = len(README)
    sx, sy = sum(x for x, _ in README), sum(y for _, y in README)
    sxx, sxy = sum(x * x for x, _ in README), sum(x * y for x, y in README)
    assert (sx, sy, sxx, sxy) == (13483, 14894, 50_336_053, 55_419_574)
    slope = (n * sxy - sx * sy) / (n * sxx - sx ** 2)
    intercept_us = (sy - slope * sx) / n
    assert slope == pytest.approx(1.0955, abs=5e-5) and intercept_us == pytest.approx(20.7, abs=0.05)
    assert kernel_data(PART).copy_engine_gemm == (0.0955, 2.07e-5)
    # every row within 13 us of the line (the fit holds over a 12x range of GEMM times)
    assert max(abs(y - (1.0955 * x + 20.7)) for x, y in README) < 13


def test_terms_only_where_measured():
    """torch's bf16 pieces on the measured part; not float8 GEMMs, not TE's userbuffers, not the
    700 W SXM5 (no measurement there: nothing added, as before)."""
    part, sxm = kernel_data(PART), kernel_data("h100-sxm5-80gb")
    assert asynctp.copy_engine_terms("torch", False, part) == (0.0955, 2.07e-5)
    assert asynctp.copy_engine_terms("torch", True, part) == (0.0, 0.0)
    assert asynctp.copy_engine_terms("megatron", False, part) == (0.0, 0.0)
    assert asynctp.copy_engine_terms("torch", False, sxm) == (0.0, 0.0)
    assert asynctp.copy_engine_terms("torch", False, None) == (0.0, 0.0)


def test_fused_seconds_by_hand():
    """8 pieces of 1 ms beside 0.5 ms pulls: 1 + 7 x 1.0955 + 0.0207 = 8.6892 ms (8 ms without);
    pull-bound (2 ms pulls): 1 + 7 x 2 + 0.0207 = 15.0207 ms, the slowdown hidden by the pulls.
    Zeroing the slowdown gives the old 8 ms back (a mutation the first assert catches)."""
    assert asynctp.fused_seconds(8e-3, 0.5e-3, 8, slowdown=0.0955, call_s=20.7e-6) == pytest.approx(8.6892e-3, abs=1e-9)
    assert asynctp.fused_seconds(8e-3, 2e-3, 8, slowdown=0.0955, call_s=20.7e-6) == pytest.approx(15.0207e-3, abs=1e-9)
    assert asynctp.fused_seconds(8e-3, 0.5e-3, 8) == pytest.approx(8e-3, abs=1e-12)


@pytest.mark.slow
def test_a70_mlp_gather_fused_op_by_hand(tmp_path):
    """torchtitan's A70 bf16 async run (Llama 3 70B, tp 8, 16 sequences of 8,192: M = 131,072):
    the MLP's fused all-gather feeds w_gate and w_up, 8 pieces of 16,384 x 3,584 x 8,192 each. The
    catalog rates that shape at 573.9 TFLOP/s on the part (H100 SXM5's S4 points x 0.797):
    2 x 16384 x 3584 x 8192 = 962.07 GFLOP -> 1.6763 ms (the README's cuBLAS column measures 1672
    us at exactly this shape on this part), so g = 2 x 1.6763 = 3.3527 ms a piece. Each pull is one
    7th of the 2.15 GB all-gather, 0.732 ms: the GEMMs are longer, so every step is 1.0955 g:
    3.3527 + 7 x 1.0955 x 3.3527 + 0.0207 = 3.3527 + 25.7103 + 0.0207 = 29.0837 ms (26.821 ms,
    8 g, before: 2.26 ms more a fused op, counted as exposed tp)."""
    b = _bench()
    r = next(x for x in b.ROWS if x.id == "A70 bf16 async")
    f = tmp_path / "row.toml"
    f.write_text(b.toml_of(r))
    st = step_time(build_plan(b.load_row(f, r)))
    unit = next(e for e in st.pipeline.stage_events(0) if e.stream == "compute" and e.name.startswith("F"))
    ev = [e for e in st.units.of_event(unit).events if e.name == "mlp all-gather+GEMMs" and e.stream == "compute"]
    pull = [e for e in st.units.of_event(unit).events if e.name == "tp mlp all-gather+GEMMs (8 pieces)"]
    assert len(ev) == 80 and (pull[0].end_s - pull[0].start_s) / 7 == pytest.approx(0.732e-3, abs=1e-6)
    g = 2 * (2 * 16384 * 3584 * 8192) / 573.9e12
    assert g == pytest.approx(3.3527e-3, abs=1e-7)
    assert ev[0].end_s - ev[0].start_s == pytest.approx(g + 7 * 1.0955 * g + 20.7e-6, rel=2e-4)
    assert ev[0].end_s - ev[0].start_s == pytest.approx(29.0837e-3, rel=2e-4)
