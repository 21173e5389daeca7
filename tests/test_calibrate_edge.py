"""A calibrated curve is continuous at its largest logged size (small leftovers 42, item 5).

``meshplan calibrate`` of an nccl-tests log writes the logged busbw at every size beside an
alpha-beta fit; ``--calibration`` read the log's curve between its smallest and largest size and
the fit outside them. The fit is a least-squares line over every row, weighted by 1 / t, not a
line through the last row: one byte past the largest logged size the predicted busbw jumped
(S15, 8 A100: 234.9 GB/s logged at 16 GiB, the fit's 208.8 one byte above). Above the largest
size the curve now continues along its last segment, as a catalog curve does
(:func:`meshplan.comm.alphabeta.measured_time`)."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import apply_calibration, load_calibration
from meshplan.comm.row import axis_path, path_time
from meshplan.mesh.resolve import resolved_mesh
from meshplan.placement.assign import place
from meshplan.spec.mesh import MeshSpec
from nccl_published import G, M, published_text
from tests.cli_run import run_cli

#: A hand-written all_reduce_perf over 8 GPUs of one host: (size B, busbw GB/s), busbw still rising at
#: 1 GiB, so the fit (least squares over the four rows) is no line through the last one.
ROWS = [(M, 40.0), (64 * M, 200.0), (256 * M, 300.0), (G, 350.0)]


def _calibrated_path(tmp_path, capsys):
    """dgx-h100 calibrated on the log (its nvlink class), and the path of a tp group of its 8 GPUs."""
    log, out = tmp_path / "all_reduce_perf_8xh100_edge.txt", tmp_path / "c.toml"
    log.write_text(published_text("all_reduce_perf", ["h100-0"] * 8, "NVIDIA H100 80GB HBM3", ROWS, "hand-written"))
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
