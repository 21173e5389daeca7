"""A calibration times each NVLink op on a run of its own, and an all-to-all curve at its own alpha.

NCCL does not run every op of an NVSwitch node alike (all-reduce on NVLS, the others on the ring: the
catalog's h100-nvlink4-nvls 478.87 GB/s busbw at 8 GiB against h100-nvlink4-ring 368.0), so an
all-reduce log no longer sets the all-gather on nvlink where the file has an all-gather run; and a
logged curve is read at its run's own fitted alpha, not NCCL's latency model (meshplan.comm.alphabeta
own_alpha)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.nccl_protocols import REFERENCE_STEP_S
from meshplan.comm.row import Path as CommPath, path_time
from nccl_alltoall import FILE as A2A
from nccl_published import DATA, nic_path
from test_calibration import nccl_tests_text
from tests.cli_run import run_cli

S15 = DATA / "all_reduce_perf_8xa100_s15.txt"  # 8 x A100 on one host, all_reduce_perf (stas00/ml-engineering)
A100 = "NVIDIA A100-SXM4-80GB"


def _nvlink(cluster) -> CommPath:
    """A group of the node's 8 GPUs on its calibrated NVLink."""
    fabric = cluster.node.fabric
    return CommPath("nvlink", fabric.bandwidth_bytes_per_s, fabric.name, fabric.latency_s / REFERENCE_STEP_S["nvlink"],
                    calibrated=fabric.calibrated)


def test_two_nvlink_ops_two_calibrated_rates(tmp_path, capsys):
    """S15's all-reduce beside an all-gather run of the same 8 A100 written exactly at t = 15 us +
    (7/8) S / 150 GB/s (nccl_tests_text). Each op reads its own log at 1 GiB: all-reduce S15's
    229.00 GB/s busbw, all-gather 0.875 x 2^30 / (15 us + 0.875 x 2^30 / 150 GB/s) = 149.64 GB/s
    (before: the all-gather run was dropped and the all-gather read the all-reduce's 229.00)."""
    ag = tmp_path / "ag.txt"
    ag.write_text(nccl_tests_text("all_gather_perf", ["dgx-a100-01"] * 8, [2 ** k for k in range(10, 31)], 15e-6,
                                  150e9, gpu=A100))
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", S15, ag, "--out", out], capsys)
    assert rc == 0, err
    assert not any("dropped" in line for line in text.splitlines())  # another op's run is no rival
    assert ("nvlink: this file sets, on nvlink, all-reduce, reduce-scatter, all-to-all and send/recv from the "
            "all-reduce fit over 8 ranks (no run of their own); all-gather from its own run (its logged curve at its "
            "fitted alpha: nccl-tests 2.17.6 all-gather over 8 ranks on 1 host(s), file ag.txt); except on a node "
            "whose all-reduce runs on NVLS (fabric nvls: dgx-h100, h200): there all-gather and reduce-scatter keep "
            "the catalog's ring curve (the all-reduce log timed NVLS's all-reduce, not them; an all_gather_perf or reduce_scatter_perf log sets "
            "them)") in text.splitlines()  # reduce-scatter: dgx-a100 has no NVLS, the fit sets it there
    calib = load_calibration(out)
    cluster = apply_calibration(system("dgx-a100", nodes=1), calib)
    path, gib = _nvlink(cluster), 2 ** 30
    assert path.calibrated and cluster.node.busbw["nvlink all-gather"].op == "all-gather"
    t_ar, t_ag = (path_time(op, 8, gib, path, cluster)[1] for op in ("all-reduce", "all-gather"))
    hand = 0.875 * gib / (15e-6 + 0.875 * gib / 150e9) / 1e9
    assert round(hand, 2) == 149.64
    assert 1.75 * gib / t_ar / 1e9 == pytest.approx(229.00, abs=0.005)  # S15's 1 GiB row
    assert 0.875 * gib / t_ag / 1e9 == pytest.approx(hand, abs=0.005)  # within the log's 2 decimals
    # the all-gather's own alpha: the file's fit of ag.txt, 15 us (as written), above the log's smallest
    # time as printed (1 KiB at busbw 0.06: 0.875 x 1024 / 0.06 GB/s = 14.933 us), which bounds it
    # (alphabeta.measured_time): over 4 ranks at 1 MiB, 3 of its 7 steps, 3 x 14.933 / 7 = 6.40 us, then
    # the log's 1 MiB bandwidth term (busbw 43.45 as printed: 0.875 x 2^20 / (15 us + 0.875 x 2^20 / 150 GB/s)
    # = 43.449) over that latency, at 0.75 / 0.875 of the bytes
    alpha = next(c for c in calib["nvlink"].curve if c.op == "all-gather").latency_us
    assert alpha == pytest.approx(15.0, rel=1e-3)
    t_meas, t_1 = 0.875 * 2 ** 20 / 43.45e9, 0.875 * 1024 / 0.06e9
    assert t_1 < alpha * 1e-6 and round(t_1 * 1e6, 3) == 14.933
    t4 = 3 * t_1 / 7 + 0.75 / 0.875 * (t_meas - t_1)
    assert path_time("all-gather", 4, 2 ** 20, path, cluster)[1] == pytest.approx(t4, rel=1e-9)


def test_an_alltoall_curve_is_read_at_its_own_alpha(tmp_path, capsys):
    """tests/data/nccl/alltoall_perf_16x8h100.txt (t = 250 us + (127/128) S / 37.8 GB/s over 16 x 8 H100)
    as the only log: over 2 nodes x 8 at 1 MiB the all-to-all's network part pays 15 of the fit's 127 steps,
    15 x 250 / 127 = 29.5 us, and half the buffer through each rank's 50 GB/s NIC at the logged busbw
    (3.75 GB/s at 1 MiB) read against the NIC's share of it, the curve's line 50 x 8 / (8 x 120 / 127)
    = 52.92 GB/s: 44.2 us. Before, NCCL's latency: LL's 6.6 + 15 x 2.7 = 47.1 us, its 127-step
    reference (349.5 us) above the logged 277.4 us, so 47.1 us at every size up to it."""
    out = tmp_path / "c.toml"
    rc, _, err = run_cli(["calibrate", A2A, "--link", "nic", "--system", "dgx-h100", "--out", out], capsys)
    assert rc == 0, err
    calib = load_calibration(out)
    alpha = calib["nic"].curve[0].latency_us * 1e-6
    assert alpha == pytest.approx(250e-6, rel=1e-3)
    cluster = apply_calibration(system("dgx-h100", nodes=2), calib)
    path = nic_path(cluster, 2, 8)
    size, f = 2 ** 20, 127 / 128
    t_meas = f * size / 3.75e9
    line = 50 * 8 / (8 * 120 / 127)
    assert round(line, 2) == 52.92 and cluster.node.busbw["a2a"].line_gb_per_s == pytest.approx(line, rel=1e-12)
    hand = 15 * alpha / 127 + size / 2 * line * (t_meas - alpha) / (f * size * 50)
    assert round(hand * 1e6, 1) == 44.2
    algo, t = path_time("all-to-all", 16, size, path, cluster)
    assert algo == "pairwise" and t == pytest.approx(hand, rel=1e-9)


NC33 = Path(__file__).parent / "data" / "nc33" / "all_reduce_1node.txt"  # a newcomer's 8 x H100 all_reduce_perf


def test_nvls_all_reduce_log_leaves_ring_ops_on_the_catalog(tmp_path, capsys):
    """An 8 x H100 all_reduce_perf log (NCCL ran it on NVLS: 460.66 GB/s busbw at 8 GiB, above the
    ring's 368.0 of h100-nvlink4-ring) fits 468.84 GB/s. On dgx-h100 (fabric nvls) NCCL runs
    all-gather and reduce-scatter on the ring, so they stay on the catalog's ring curve: over 4
    ranks at 1 GiB the catalog plan's busbw is 0.75 x 2^30 / 2204.2 us = 365.3 GB/s and the
    calibrated one's within 1% of it (the fit's alpha in place of NCCL's latency: 2196.8 us);
    before, the fit's 468 GB/s line gave them 434.7 GB/s busbw at 64 MiB (115.8 us against the
    catalog's 154.6). The all-reduce itself stays on the fit (above 440 GB/s)."""
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", NC33, "--out", out], capsys)
    assert rc == 0, err
    line = next(x for x in text.splitlines() if x.startswith("nvlink:"))
    assert "all-reduce, all-gather, reduce-scatter, all-to-all and send/recv from the all-reduce fit" in line
    assert "NVLS (fabric nvls: dgx-h100, h200): there all-gather and reduce-scatter keep the catalog's ring" in line
    base = system("dgx-h100", nodes=1)
    cluster = apply_calibration(base, load_calibration(out))
    gib = 2 ** 30
    for op in ("all-gather", "reduce-scatter"):
        t_cat = path_time(op, 4, gib, _nvlink(base), base)[1]
        t_cal = path_time(op, 4, gib, _nvlink(cluster), cluster)[1]
        assert round(0.75 * gib / t_cat / 1e9, 1) == 365.3
        assert t_cal == pytest.approx(t_cat, rel=0.01)
    assert 1.5 * gib / path_time("all-reduce", 4, gib, _nvlink(cluster), cluster)[1] / 1e9 > 440
