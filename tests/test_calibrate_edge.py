"""A calibrated curve is continuous at its largest logged size (small leftovers 42, item 5).

``meshplan calibrate`` of an nccl-tests log writes the logged busbw at every size beside an
alpha-beta fit; ``--calibration`` read the log's curve between its smallest and largest size and
the fit outside them. The fit is a least-squares line over every row, weighted by 1 / t, not a
line through the last row: one byte past the largest logged size the predicted busbw jumped
(S15, 8 A100: 234.9 GB/s logged at 16 GiB, the fit's 208.8 one byte above). Above the largest
size the curve now continues along its last segment, as a catalog curve does
(:func:`meshplan.comm.alphabeta.measured_time`). Likewise at the smallest logged size (small
leftovers 43, item 4): below it the fit timed it, and where the fit's alpha exceeds the smallest
logged time even that point was missed (S15's 32 KiB: 1.05 GB/s against 1.31 logged); now the curve
is read there too, latency-bound: from the alpha at S = 0, held at the smallest logged time where
the alpha exceeds it."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.row import axis_path, path_time
from meshplan.mesh.resolve import resolved_mesh
from meshplan.placement.assign import place
from meshplan.spec.mesh import MeshSpec
from nccl_published import G, M, published_text
from tests.cli_run import run_cli

#: A hand-written all_reduce_perf over 8 GPUs of one host: (size B, busbw GB/s), busbw still rising at
#: 1 GiB, so the fit (least squares over the four rows) is no line through the last one.
ROWS = [(M, 40.0), (64 * M, 200.0), (256 * M, 300.0), (G, 350.0)]


def _calibrated_path(tmp_path, capsys, rows=ROWS):
    """dgx-h100 calibrated on the log of ``rows`` (its nvlink class), and the path of a tp group of its 8 GPUs."""
    log, out = tmp_path / "all_reduce_perf_8xh100_edge.txt", tmp_path / "c.toml"
    log.write_text(published_text("all_reduce_perf", ["h100-0"] * 8, "NVIDIA H100 80GB HBM3", rows, "hand-written"))
    rc, _, err = run_cli(["calibrate", log, "--link", "nvlink", "--out", out], capsys)
    assert rc == 0, err
    cluster = apply_calibration(system("dgx-h100", nodes=1), load_calibration(out))
    mesh = resolved_mesh(MeshSpec(names=["dp", "tp"], shape=[1, 8]), cluster.world)
    path = axis_path(mesh, place(cluster, cluster.world), cluster, "tp")
    assert (path.kind, path.calibrated) == ("nvlink", True)
    return cluster, path


def _busbw_gb_per_s(cluster, path, size: float) -> float:
    """Predicted busbw of an all-reduce of ``size`` bytes over the 8 GPUs: 1.75 S / t."""
    alg, t = path_time("all-reduce", 8, size, path, cluster)
    assert alg == "ring"  # a calibrated class runs the ring alone
    return 1.75 * size / t / 1e9


def test_the_largest_logged_size_is_met_from_both_sides(tmp_path, capsys):
    """At 1 GiB the logged 350.00 GB/s exactly; one byte above, the same to 1e-6 (before: the fit's beta,
    304.08 GB/s: the fit weighs the 1 MiB row's 40 GB/s as much as the others)."""
    cluster, path = _calibrated_path(tmp_path, capsys)
    assert _busbw_gb_per_s(cluster, path, G) == pytest.approx(350.0, rel=1e-12)
    assert _busbw_gb_per_s(cluster, path, G + 1) == pytest.approx(350.0, rel=1e-6)
    assert _busbw_gb_per_s(cluster, path, G - 1) == pytest.approx(350.0, rel=1e-6)


def test_above_the_largest_size_the_last_segment_continues(tmp_path, capsys):
    """2 GiB, along the line through the 256 MiB and 1 GiB rows' times:
    t(256 MiB) = 1.75 x 2^28 / 300 GB/s = 1565.8735 us, t(1 GiB) = 1.75 x 2^30 / 350 GB/s = 5368.7091 us;
    t(2 GiB) = 5368.7091 + (5368.7091 - 1565.8735) x (2^31 - 2^30) / (2^30 - 2^28) = 5368.7091 + 3802.8356 x 4/3
    = 10439.1566 us, busbw 1.75 x 2^31 / 10439.1566 us = 360.00 GB/s. 64 GiB: 5368.7091 + 3802.8356 x 63 x 4/3
    = 324806.90 us, busbw 1.75 x 2^36 / 324806.90 us = 370.25 GB/s, below the segment's own rate
    1.75 x 768 MiB / 3802.8356 us = 370.59 GB/s, which it approaches."""
    cluster, path = _calibrated_path(tmp_path, capsys)
    _, t = path_time("all-reduce", 8, 2 * G, path, cluster)
    assert t * 1e6 == pytest.approx(10439.1566, abs=1e-3)
    assert _busbw_gb_per_s(cluster, path, 2 * G) == pytest.approx(360.00, abs=5e-3)
    assert _busbw_gb_per_s(cluster, path, 64 * G) == pytest.approx(370.25, abs=5e-3)


#: A hand-written all_reduce_perf whose smallest size is 32 KiB at 1.31 GB/s (S15's first row): the
#: least-squares fit's alpha (weighted by 1 / t, pulled up by the larger rows) lands above its time.
SMALL = [(32 * 1024, 1.31), (64 * 1024, 2.2), (M, 25.0), (16 * M, 150.0), (G, 350.0)]


def _alpha_us(tmp_path) -> float:
    return load_calibration(tmp_path / "c.toml")["nvlink"].latency_us


def test_the_smallest_logged_size_is_met_and_held_below(tmp_path, capsys):
    """t(32 KiB) = 1.75 x 32768 / 1.31 GB/s = 43.7740 us, below the fit's alpha (51.7 us): at 32 KiB the
    logged 1.31 GB/s (before: 1.1087, the alpha); below it the collective is latency-bound, no smaller
    buffer slower than the logged one nor faster than the latency the log bounds: held at 43.7740 us
    (1 KiB: 1.75 x 1024 / 43.7740 us = 0.0409 GB/s; before: the fit, 51.73 us, and 51.90 us one byte
    below 32 KiB, slower than at 32 KiB itself). 64 KiB: its own logged 2.2 GB/s."""
    cluster, path = _calibrated_path(tmp_path, capsys, SMALL)
    t1 = 1.75 * 32768 / 1.31e9
    assert t1 * 1e6 == pytest.approx(43.7740, abs=1e-4) and _alpha_us(tmp_path) * 1e-6 > t1
    assert _busbw_gb_per_s(cluster, path, 32768) == pytest.approx(1.31, rel=1e-12)
    assert _busbw_gb_per_s(cluster, path, 65536) == pytest.approx(2.2, rel=1e-12)
    for size in (1024, 16384, 32767):
        assert path_time("all-reduce", 8, size, path, cluster)[1] == pytest.approx(t1, rel=1e-12)
    assert _busbw_gb_per_s(cluster, path, 1024) == pytest.approx(0.0409, abs=1e-4)
    assert _busbw_gb_per_s(cluster, path, 32769) == pytest.approx(1.31, rel=1e-4)


def test_below_the_smallest_size_from_the_fits_alpha_when_it_is_lower(tmp_path, capsys):
    """ROWS: t(1 MiB) = 1.75 x 2^20 / 40 GB/s = 45.8752 us, above the fit's alpha a: below 1 MiB the
    time runs linearly from a at S = 0 to 45.8752 us (the catalog curves' rule), e.g. 512 KiB at
    (a + 45.8752 us) / 2; at 1 MiB the logged 40 GB/s."""
    cluster, path = _calibrated_path(tmp_path, capsys)
    t1, a = 1.75 * M / 40e9, _alpha_us(tmp_path) * 1e-6
    assert t1 * 1e6 == pytest.approx(45.8752, abs=1e-4) and a < t1
    assert path_time("all-reduce", 8, M // 2, path, cluster)[1] == pytest.approx((a + t1) / 2, rel=1e-12)
    assert _busbw_gb_per_s(cluster, path, M) == pytest.approx(40.0, rel=1e-12)
