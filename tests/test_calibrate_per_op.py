"""A calibration sets each collective from a run of its own op (newcomer trial 28).

The trial's alltoall_perf log over 2 DGX H100 (tests/data/nccl/alltoall_perf_2x8h100_trial28.txt)
once set every cross-node collective: the NIC rate became its 34.66 GB/s per NIC, so the expert
data-parallel reduce-scatter fell from 46.7 to 34.0 GB/s busbw and the pipeline send/recv from
46.3 to 34.2, though ring collectives reach 46-48 GB/s per NDR NIC (NVIDIA/nccl-tests issue #290):
34.66 is all-to-all's own efficiency. All-reduce, all-gather and reduce-scatter run on NCCL's
ring with busbw defined as the same per-link figure (nccl-tests doc/PERFORMANCE.md), so one's log
stands for the three; all-to-all and send/recv only from their own."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.calibration_notes import fit_origin_lines
from meshplan.comm.row import path_time
from nccl_alltoall import alltoall_text
from nccl_published import DATA, nic_path
from tests.cli_run import run_cli

A2A, AR = DATA / "alltoall_perf_2x8h100_trial28.txt", DATA / "all_reduce_perf_2x8h100.txt"
#: The log's 4 GiB row, out of place (the slower busbw of the two columns): 62339.0 us, busbw 64.59 GB/s
#: = algbw 68.90 x 15/16; the curve's time there, 15/16 x 2^32 B / 64.59 GB/s = 62,339.4 us.
T_4G = 15 / 16 * 2**32 / 64.59e9


def _calibrate(tmp_path, capsys, *logs):
    out = tmp_path / "cal.toml"
    rc, text, err = run_cli(["calibrate", *logs, "--link", "nic", "--system", "dgx-h100", "--out", out], capsys)
    assert rc == 0, err
    return load_calibration(out), text


def test_an_alltoall_log_sets_all_to_all_only(tmp_path, capsys):
    calib, text = _calibrate(tmp_path, capsys, A2A)
    assert ("nic: this file sets, across nodes, all-to-all (its own logged curve: nccl-tests all-to-all over 16 "
            "ranks on 2 host(s), file alltoall_perf_2x8h100_trial28.txt); all-reduce, all-gather and reduce-scatter "
            "keep the catalog's curves (an all_reduce_perf, all_gather_perf or reduce_scatter_perf log sets the "
            "three); send/recv keeps the catalog's curve (a sendrecv_perf log (or alltoall_perf over 2 ranks on 2 "
            "hosts) sets it)") in text.splitlines()
    curve = calib["nic"].curve[0]
    assert curve.sizes_bytes[-1] == 2**32 and curve.busbw_gb_per_s[-1] == 64.59
    catalog = system("dgx-h100", nodes=64)
    cluster = apply_calibration(catalog, calib)
    # the NIC rate (400 Gb/s), the network latency and the ring curve stay the catalog's
    assert cluster.node.nics[0].rate_gbit_per_s == 400.0 and not cluster.network[0].calibrated
    assert cluster.node.busbw["nic"] == catalog.node.busbw["nic"]
    # all-to-all over the logged 2 x 8 ranks at 4 GiB: its logged time (NCCL's latency for 15 steps on both
    # sides cancels), the curve read at 50 GB/s x 8 / (8 x 8 / 15) = 93.75 so a rank's 8/16 of the buffer at
    # its own NIC's 50 GB/s takes 15/16 x 2^32 / 64.59 GB/s
    assert cluster.node.busbw["a2a"].line_gb_per_s == pytest.approx(93.75, rel=1e-12)
    algo, t = path_time("all-to-all", 16, 2**32, nic_path(cluster, 2, 8), cluster)
    assert algo == "pairwise" and t == pytest.approx(T_4G, rel=1e-9)  # 62,339.4 us
    # the ring ops and send/recv across nodes: the catalog's time, not the all-to-all's 34.66 GB/s per NIC
    # (the trial's efsdp reduce-scatter over 8 nodes, 160 MB: 46.7 GB/s busbw before and after, not 34.0)
    for op, n, nodes, g, size in [("reduce-scatter", 8, 8, 1, 160e6), ("all-reduce", 16, 2, 8, 2**30),
                                  ("all-gather", 8, 8, 1, 2**28), ("send/recv", 2, 2, 1, 25165824)]:
        assert path_time(op, n, size, nic_path(cluster, nodes, g), cluster) == \
            path_time(op, n, size, nic_path(catalog, nodes, g), catalog), op


def test_an_all_reduce_and_an_alltoall_log_set_each_its_own_ops(tmp_path, capsys):
    """Both logs in one call: the all-reduce fit (45 GB/s per NIC, t = 30 us + 1.875 S / 360 GB/s, the
    file's README) sets the NIC rate and the ring ops; the all-to-all reads its own log."""
    calib, text = _calibrate(tmp_path, capsys, AR, A2A)
    said = next(line for line in text.splitlines() if line.startswith("nic: this file sets"))
    assert said.startswith("nic: this file sets, across nodes, all-reduce, all-gather and reduce-scatter (the "
                           "all-reduce fit over 16 ranks")
    assert "and all-to-all (its own logged curve: nccl-tests all-to-all over 16 ranks on 2 host(s), file " \
           "alltoall_perf_2x8h100_trial28.txt)" in said
    assert not any("dropped" in line for line in text.splitlines())  # the alltoall run is not a rival fit
    cluster = apply_calibration(system("dgx-h100", nodes=2), calib)
    assert cluster.node.nics[0].rate_gbit_per_s == pytest.approx(45.0 * 8, rel=1e-3)
    assert cluster.node.busbw["nic"].op == "all-reduce" and cluster.network[0].calibrated
    # the all-to-all curve read against the calibrated rate: 45 x 8 / (64 / 15) = 84.375; at a rank's 45 GB/s
    # NIC its 8/16 of the buffer again takes the logged 4 GiB time
    nic = calib["nic"].bandwidth_gb_per_s
    assert cluster.node.busbw["a2a"].line_gb_per_s == pytest.approx(nic * 8 * 15 / 64, rel=1e-12)
    algo, t = path_time("all-to-all", 16, 2**32, nic_path(cluster, 2, 8), cluster)
    assert algo == "pairwise" and t == pytest.approx(T_4G, rel=1e-9)
    # send/recv is no ring op and no file measures it: dgx-h100's catalog has no pair curve, so it keeps the
    # catalog "nic" curve it read before, scaled as the catalog pair curves are (calib37) by the logged busbw per
    # NIC over the catalog's at 8 GiB: (359.76 / 8) / (376.0 x 50 / 400) = 44.97 / 47.00 = 0.9568 (it read the
    # all-reduce fit's own curve before)
    catalog = system("dgx-h100", nodes=2)
    r = (359.76 / 8) / (376.0 * 50 / 400)
    t_cal = path_time("send/recv", 2, 2**33, nic_path(cluster, 2, 1), cluster)[1]
    t_cat = path_time("send/recv", 2, 2**33, nic_path(catalog, 2, 1), catalog)[1]
    # within 0.2%: the curve's 30-step reference latency (LL: 6.6 + 30 x 2.7 = 87.6 us at NCCL's per-step
    # latency, 12 us at the fit's 1 us per step) comes off its 8 GiB time 1.875 x 2^33 / 376 GB/s = 42.8 ms
    assert t_cat / t_cal == pytest.approx(r, rel=2e-3)
    assert cluster.node.busbw["p2p"].busbw_gb_per_s == catalog.node.busbw["nic"].busbw_gb_per_s


def test_a_file_without_curves_still_sets_every_op(tmp_path):
    """Backward compatible: a calibration file of before per-op curves applies its fit as before (the NIC
    rate for every op, all-to-all on the fit) and the origin line says so."""
    old = tmp_path / "old.toml"
    old.write_text('[link.nic]\nlatency_us = 37.74\nbandwidth_gb_per_s = 34.66\nop = "all-to-all"\nranks = 16\n'
                   'source = "nccl-tests all-to-all over 16 ranks on 2 host(s)"\n')
    cluster = apply_calibration(system("dgx-h100", nodes=2), load_calibration(old))
    assert cluster.node.nics[0].rate_gbit_per_s == pytest.approx(34.66 * 8) and cluster.network[0].calibrated
    assert "a2a" not in cluster.node.busbw and "nic" not in cluster.node.busbw
    # the origin line under plan's / step's header says the one fit stands for every op, and how to set each
    assert fit_origin_lines(load_calibration(old)) == [
        "  nic fitted to all-to-all over 16 ranks: rows not recorded, size range not recorded; source: nccl-tests "
        "all-to-all over 16 ranks on 2 host(s); sets every op across nodes: no logged curve in the file (written "
        "before per-op calibration), so its all-to-all fit stands for all; run meshplan calibrate on the logs again "
        "to set each op from its own run"]


def test_a_log_without_its_banner_takes_the_test_as_op(tmp_path, capsys):
    """Trial 28 #B: nccl-tests before 2025-06 never printed '# Collective test starting'; alltoall and
    all_gather rows look alike (redop none, root -1, busbw/algbw 15/16 = 0.938 over 16 ranks), so the
    error names --op, which reads such a log of any version, and --op alltoall reads it as the banner did."""
    old = tmp_path / "old.log"
    old.write_text("\n".join(ln for ln in A2A.read_text().splitlines() if not ln.startswith("# Collective test")))
    base = ["calibrate", old, "--link", "nic", "--system", "dgx-h100", "--out", tmp_path / "c.toml"]
    rc, _, err = run_cli(base, capsys)
    assert rc == 2 and err.strip().endswith("its rows (redop none, root -1, busbw/algbw 0.938 over 16 ranks) fit "
                                            "all_gather_perf and alltoall_perf alike; name the test that wrote it: "
                                            "old.log:all_gather or old.log:alltoall for this file alone, or --op "
                                            "(e.g. --op alltoall) for every such log; each reads the log of every "
                                            "nccl-tests version")  # FILE:op since nc34 #6
    rc, text, err = run_cli([*base, "--op", "alltoall"], capsys)
    assert rc == 0, err
    assert load_calibration(tmp_path / "c.toml")["nic"].curve[0].busbw_gb_per_s[-1] == 64.59
    assert any(line.startswith("nic: this file sets, across nodes, all-to-all") for line in text.splitlines())
    rc, _, err = run_cli([*base, "--op", "all_to_all", "--force"], capsys)
    assert rc == 2 and err.startswith("error: --op: test 'all_to_all' is not one meshplan models; use one of ")


def test_an_alltoall_log_of_one_rank_per_host_sets_all_to_all(tmp_path, capsys):
    """alltoall_perf over 4 hosts x 1 GPU (``mpirun -npernode 1``; written by tests/nccl_alltoall.py from
    t = 250 us + (3/4) S / 37.8 GB/s): one rank a host sends all its (n - 1) / n = 3/4 of the buffer through its
    own NIC, as each rank of several a host does (all_to_all_time reads one curve for both), so the log sets
    all-to-all. It was read as the one-rank-per-node ring pattern "nic1": alone, calibrate stopped with an
    IndexError (it set no op); beside an all-reduce log, it became the "nic1" all-reduce curve."""
    log = tmp_path / "alltoall_perf_4x1.txt"
    log.write_text(alltoall_text(hosts=4, gpus=1))
    calib, text = _calibrate(tmp_path, capsys, log)
    assert any(line.startswith("nic: this file sets, across nodes, all-to-all (its own logged curve: nccl-tests "
                               "2.17.6 all-to-all over 4 ranks on 4 host(s)") for line in text.splitlines())
    cluster = apply_calibration(system("dgx-h100", nodes=4), calib)
    # read against the catalog NIC's 50 GB/s x 1 NIC / host share 1 x (4 - 1) / (4 - 1) = 50 GB/s
    assert cluster.node.busbw["a2a"].line_gb_per_s == 50.0 and not cluster.network[0].calibrated
    # at 4 GiB the logged time, 250 us + 3/4 x 2^32 / 37.8 GB/s = 85.468 ms (busbw printed 37.69 to 4 digits)
    algo, t = path_time("all-to-all", 4, 2**32, nic_path(cluster, 4, 1), cluster)
    assert algo == "pairwise" and t == pytest.approx(250e-6 + 0.75 * 2**32 / 37.8e9, rel=1e-4)
    (tmp_path / "both").mkdir()
    both = apply_calibration(system("dgx-h100", nodes=4), _calibrate(tmp_path / "both", capsys, AR, log)[0])
    assert both.node.busbw["a2a"].op == "all-to-all" and "nic1" not in both.node.busbw  # dgx-h100 has no nic1
