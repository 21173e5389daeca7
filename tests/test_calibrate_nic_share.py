"""A NIC curve of 8 ranks per host, read for one rank per host, at equal bytes per NIC (newcomer trial 29).

The trial's all_gather_perf log over 2 x 8 H200 (tests/data/nccl/all_gather_perf_2x8h200_nc29.txt) raised
the cp all-gather of a dp_shard 4 x cp 8 x tp 8 job (8 ranks, one per node, each on its own NIC, S =
67,108,864 B) from 1,272.3 to 1,594.0 us: the curve was read at the same S, where the logged run's 8
NICs per host each carried an eighth of the bytes the cp rank's one NIC carries (7.5 MiB against 56 MiB),
on the curve's slow part (64 MiB: busbw 247.36 GB/s, 30.9 per NIC). Read at S x line / bandwidth = 8 S
(meshplan.comm.alphabeta), where each logged NIC carried what the cp rank's does."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.row import path_time
from nccl_published import DATA, ndr_ring_s, nic_path
from tests.cli_run import run_cli

LOG = DATA / "all_gather_perf_2x8h200_nc29.txt"
S = 67_108_864  # the cp all-gather's buffer: K and V of 8 ranks, 8 MiB each


def test_cp_all_gather_one_rank_per_node_reads_the_log_at_equal_bytes_per_nic(tmp_path, capsys):
    out = tmp_path / "cal.toml"
    rc, _, err = run_cli(["calibrate", LOG, "--op", "all-gather", "--link", "nic", "--out", out], capsys)
    assert rc == 0, err
    nic = load_calibration(out)["nic"]
    assert (nic.latency_us, nic.bandwidth_gb_per_s, nic.op, nic.ranks) == (43.58, 42.78, "all-gather", 16)
    catalog = system("dgx-h200", nodes=8)
    cluster = apply_calibration(catalog, {"nic": nic})
    assert "nic1" not in cluster.node.busbw  # no one-rank-per-node curve: the cp ring reads the logged one
    alpha = 43.58e-6 / 15  # the fit's alpha per call over its 15 ring steps, per step
    # The logged pattern itself (16 ranks, 8 per host on the host's 8 NICs) at 512 MiB: its logged time,
    # 15/16 x 2^29 / 345.67 GB/s = 1,456.06 us (the log's 1456.1), alpha for 15 steps being the fit's own.
    t512 = 15 / 16 * 2**29 / 345.67e9
    assert path_time("all-gather", 16, 2**29, nic_path(cluster, 2, 8), cluster)[1] == pytest.approx(t512, rel=1e-9)
    # The cp all-gather: 7 steps at alpha, then 7/8 x S = 56 MiB through the rank's one 42.78 GB/s NIC. The
    # log's run put that many bytes on each of its NICs at 8 S = 512 MiB (15/16 x 2^29 / 8 = 60 MiB per NIC;
    # 8 S keeps nccl-tests' same-size convention across rank counts, 15/16 against 7/8): its bandwidth term
    # there, 1,456.06 - 42.41 = 1,413.65 us (the latency: the log's smallest time, 1 MiB at 23.18 GB/s,
    # 15/16 x 2^20 / 23.18 GB/s = 42.409 us, below the fit's 43.58 us alpha, which the measurement bounds:
    # alphabeta.measured_time, per step 42.409 / 15 = 2.827 us), for 15/16 x 2^29 bus bytes over 8 NICs, is for
    # 7/8 x 2^26 through one NIC 1,413.65 x (7/8 x 8) / (15/16 x 8) = 1,319.41 us; with 7 x 2.827 = 19.79 us of
    # latency: 1,339.20 us (the user's 43.2 GB/s per NIC at 512 MiB gave about 1.37 ms; before, read at 64 MiB:
    # 1,594.0 us; at the fit's alpha, above the 1 MiB row's time: 1,338.65 us).
    algo, t = path_time("all-gather", 8, S, nic_path(cluster, 8, 1), cluster)
    t1 = 15 / 16 * 2**20 / 23.18e9
    assert t1 < 43.58e-6 and round(t1 * 1e6, 3) == 42.409
    expected = 7 * t1 / 15 + (t512 - t1) * (7 / 8) / (15 / 16)
    assert algo == "ring" and t == pytest.approx(expected, rel=1e-9)
    assert round(t * 1e6, 2) == 1339.20
    # The reduce-scatter of dK and dV: the same bytes, the same time (one ring, nccl-tests' one busbw).
    assert path_time("reduce-scatter", 8, S, nic_path(cluster, 8, 1), cluster)[1] == pytest.approx(t, rel=1e-12)
    # Uncalibrated, the catalog's 8-NIC curve (ib-ndr-400-8nic: 376 GB/s at 8 GiB, one point, so any read size
    # gives one beta): 1.875 x 2^33 / 376 GB/s = 42,835.4 us less NCCL's LL latency for its 30 steps, 6.6 +
    # 30 x 2.7 = 87.6 us: beta 1.875 x 2^33 / 42,747.8 us = 376.77 GB/s, 47.10 per NIC; the cp ring, LL's
    # 6.6 + 7 x 2.7 = 25.5 us + 7/8 x 2^26 / 47.10 GB/s = 1,272.3 us. Calibrated: 1,339.20 / 1,272.3 = +5.3%
    # (at the fit's alpha +5.2%), not +25%.
    t8g = 1.875 * 2**33 / 376e9
    beta = 1.875 * 2**33 / (t8g - 87.6e-6) / 8
    _, t_cat = path_time("all-gather", 8, S, nic_path(catalog, 8, 1), catalog)
    assert t_cat == pytest.approx(25.5e-6 + 7 / 8 * S / beta, rel=1e-9) == ndr_ring_s(8, 1, S)  # the shared helper's
    assert round(t_cat * 1e6, 1) == 1272.3 and round(t / t_cat - 1, 3) == 0.053
