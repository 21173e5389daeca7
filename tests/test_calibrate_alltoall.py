"""``meshplan calibrate`` of an all-to-all over 16 hosts x 8 GPUs (newcomer 25, item 2).

nccl-tests' alltoall busbw is per rank, algbw x (n - 1) / n (doc/PERFORMANCE.md), and each rank
drives its own NIC on a DGX H100, so the per-NIC figure is the busbw's share that leaves the
host, (n - g) / (n - 1), not busbw / g. Fixture: tests/data/nccl/alltoall_perf_16x8h100.txt
(tests/nccl_alltoall.py: t = 250 us + (127/128) S / 37.8 GB/s)."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.calibration_kinds import per_nic
from meshplan.comm.row import path_time
from nccl_alltoall import FILE, alltoall_text
from nccl_published import nic_path
from tests.cli_run import run_cli

PER_NIC = 37.8 * (128 - 8) / (128 - 1)  # 35.7165 GB/s: the share of a rank's busbw that leaves its host


def test_fixture_is_the_written_run():
    assert FILE.read_text() == alltoall_text()


@pytest.fixture
def cal(tmp_path, capsys):
    out = tmp_path / "a2a.toml"
    rc, text, err = run_cli(["calibrate", FILE, "--link", "nic", "--system", "dgx-h100", "--out", out], capsys)
    assert rc == 0, err
    return out, text


def test_all_to_all_busbw_per_nic_is_its_share_leaving_the_host(cal):
    """37.80 x 120 / 127 = 35.72 GB/s per NIC (it said 4.73 = 37.81 / 8), said with its formula."""
    out, text = cal
    assert ("alltoall_perf_16x8h100.txt: 8 ranks per host over 8 NICs (dgx-h100's, --system): nic all-to-all "
            "35.72 GB/s per NIC = 37.80 x (128 - 8) / (128 - 1) (the share of its bytes that leaves the host, each "
            "rank on its own NIC)") in text.splitlines()
    assert "warning" not in text  # 35.72 is under the 50 GB/s of a 400G NIC
    nic = load_calibration(out)["nic"]
    assert nic.bandwidth_gb_per_s == pytest.approx(PER_NIC, rel=1e-3)
    assert nic.latency_us == pytest.approx(250.0, rel=1e-3)


def test_step_times_the_logged_all_to_all_at_its_own_time(cal):
    """Applied to 16 DGX H100, the pairwise all-to-all over the 128 ranks (8 per node, each on
    its own NIC) takes the logged 1 GiB time: 250 us + 127/128 x 2^30 B / 37.8 GB/s = 28,433.9 us,
    read on the file's own all-to-all curve ("a2a") against the catalog NIC rate: 50 GB/s per
    NIC x 8 NICs / (8 x 120 / 127) = 52.92 GB/s, so at a rank's 50 GB/s NIC share its 120/128 of
    the buffer takes the logged time; the NVLink part (7/128 of the buffer at 450 GB/s, 0.13 ms)
    hides under it. Per op (trial 28): an alltoall_perf log sets all-to-all only, so the NIC rate
    stays the catalog's 400 Gb/s and the ring ops keep the catalog's ib-ndr-400-8nic curve (this
    test once asserted the NIC rate at the all-to-all's 35.72 GB/s per NIC and the ring ops on the
    all-to-all curve)."""
    out, _ = cal
    cluster = apply_calibration(system("dgx-h100", nodes=16), load_calibration(out))
    nic_bw = cluster.node.nics[0].bandwidth_bytes_per_s
    assert nic_bw == 50e9 and not cluster.network[0].calibrated  # 400 Gb/s / 8
    path = nic_path(cluster, 16, 8)
    algo, t = path_time("all-to-all", 128, 2**30, path, cluster)
    assert algo == "pairwise"
    assert t * 1e6 == pytest.approx(250 + 127 / 128 * 2**30 / 37.8e3, rel=2e-4)  # 28,433.9 us; busbw logged 2 dp
    a2a = cluster.node.busbw["a2a"]
    assert a2a.op == "all-to-all" and a2a.line_gb_per_s == pytest.approx(50 * 8 / (8 * 120 / 127), rel=1e-9)
    assert cluster.node.busbw["nic"] == system("dgx-h100", nodes=16).node.busbw["nic"]  # the catalog's, untouched
