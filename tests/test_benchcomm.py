"""``meshplan bench comm`` (issue 6 item 3): a real 4-rank gloo run under torchrun with small
sizes, read back with meshplan.comm.nccl_tests' parser, fitted, and applied to a
cluster; on the netns testbed 2 nodes x 1 NIC and 2 nodes x 2 NICs (each rank on its NIC); plus
the pure helpers (sizes, groups, rank -> NIC, nccl-tests text, fast domains).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest

from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.calibration_notes import calibration_line
from meshplan.comm.nccl_tests import parse_nccl_tests_text
from meshplan.catalog import system
from meshplan.comm.alphabeta import busbw_factor
from meshplan.errors import ConfigError
from meshplan.runtime.bench import comm as B
from meshplan.runtime.bench import comm_results as R
from meshplan.runtime.testbed.nics import ADDRS_ENV, apply_local_nic

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def test_sizes_and_groups():
    assert B.parse_sizes("1K..64M")[:3] == [1024, 2048, 4096] and B.parse_sizes("1K..64M")[-1] == 64 << 20
    assert B.parse_sizes("4096,1K, 1M") == [1024, 4096, 1 << 20]
    for bad in ("2G", "1K..x", "8K..1K", "0", ""):
        with pytest.raises(ConfigError, match="--sizes"):
            B.parse_sizes(bad)
    assert B.chunked(1 << 20, 3) == (87381 * 3, 87381 * 12)
    assert B.bench_groups([0, 0, 0, 0]) == [("nvlink", (0, 1, 2, 3))]
    assert B.bench_groups([0, 1]) == [("nic", (0, 1))]
    assert B.bench_groups([0, 0, 1, 1, 2, 2]) == [("nvlink", (0, 1)), ("nic", (0, 2, 4))]
    # testbed with 2 NICs per node: local rank i on nic<i mod 2>, one nic group per NIC
    nics = [apply_local_nic({ADDRS_ENV: "nic0=a,nic1=b", "LOCAL_RANK": str(r % 3)})["nic"] for r in range(6)]
    assert nics == ["nic0", "nic1", "nic0"] * 2
    assert B.bench_groups([0, 0, 0, 1, 1, 1], nics) == [("nvlink", (0, 1, 2)), ("nic", (0, 3)), ("nic", (1, 4))]
    assert B.bench_groups([0, 1], ["nic0", "nic0"]) == [("nic", (0, 1))]
    assert apply_local_nic({}) is None                      # not on a testbed: nothing set


def test_two_nics_get_their_own_files_and_the_slowest_goes_to_calibration(tmp_path):
    raw = _raw("all-reduce", 4, [])
    raw["ranks"] = [dict(r, node=r["rank"] // 2, nic=f"nic{r['rank'] % 2}",
                         addr=f"10.77.{r['rank'] % 2}.{r['rank'] // 2 + 1}") for r in raw["ranks"]]
    sizes = B.parse_sizes("64K..1M")
    raw["collectives"] = [{"op": "all-reduce", "link": "nic", "ranks": [k, k + 2], "nic": f"nic{k}", "rows": [
        {"size_bytes": s, "count": s // 4, "time_s": 1e-4 + s / (25e6 / (k + 1)), "iters": 5, "wrong": 0}
        for s in sizes]} for k in (0, 1)]
    raw["pairs"] = {"size_bytes": 10 ** 6, "iters": 3, "one_way_s": [[0 if i == j else 1e-3 if i // 2 == j // 2
                                                                      else 4e-2 for j in range(4)] for i in range(4)]}
    blocks, fits, notes = R.write_results(tmp_path, raw, "test")
    assert sorted(p.name for p in tmp_path.glob("*_perf.*")) == ["all_reduce_perf.nic.nic0.txt",
                                                                 "all_reduce_perf.nic.nic1.txt"]
    text1 = (tmp_path / "all_reduce_perf.nic.nic1.txt").read_text()
    assert ("link class nic (gloo: TCP over the testbed's veth links, not an RDMA NIC) on nic1 of every node" in text1
            and "[node 1 nic1]" in text1)
    assert [(f.link, f.n_ranks) for f in fits] == [("nic", 2)]
    assert fits[0].bandwidth_bytes_per_s == pytest.approx(12.5e6, rel=0.01)      # nic1's, the slower
    assert any("slowest of 2 NICs" in n and "nic1" in n for n in notes)
    assert load_calibration(tmp_path / "calibration.toml")["nic"].bandwidth_gb_per_s == pytest.approx(0.0125, rel=0.01)
    assert "# NIC of rank: 0 nic0 10.77.0.1, 1 nic1 10.77.1.1, 2 nic0 10.77.0.2, 3 nic1 10.77.1.2" in blocks[-1]
    assert json.loads((tmp_path / "pairs.json").read_text())["nic_of_rank"] == ["nic0", "nic1", "nic0", "nic1"]


def test_a_gloo_run_is_labelled_and_refused_for_a_gpu_link(tmp_path):
    # what bench comm on a CPU host wrote as [link.nvlink] at 1.169 GB/s: loopback TCP
    rows = [{"size_bytes": s, "count": s // 4, "time_s": 50e-6 + 1.5 * s / 1.169e9, "iters": 5, "wrong": 0}
            for s in B.parse_sizes("64K..8M")]
    raw = _raw("all-reduce", 4, rows)
    raw["pairs"] = {"size_bytes": 10 ** 6, "iters": 3, "one_way_s": [[0 if i == j else 1e-3 for j in range(4)]
                                                                     for i in range(4)]}
    blocks, fits, notes = R.write_results(tmp_path, raw, "test")
    text = (tmp_path / "all_reduce_perf.nvlink.txt").read_text()
    assert "link class nvlink (gloo: loopback TCP inside one host, not NVLink)" in text
    assert "all-reduce over nvlink (gloo: loopback TCP inside one host, not NVLink) (4 ranks)" in notes[0]
    toml = (tmp_path / "calibration.toml").read_text()
    assert 'backend = "gloo"' in toml and "# measured with gloo over TCP, no GPU" in toml
    calib = load_calibration(tmp_path / "calibration.toml")
    assert calib["nvlink"].bandwidth_gb_per_s == pytest.approx(1.169, rel=1e-3)
    # no GPU recorded for a gloo run (its ranks' device is "cpu"); the header line says so
    assert calib["nvlink"].gpu is None and "gpu =" not in toml
    assert calibration_line("c.toml", calib) == "links calibrated from c.toml (gloo, no GPU): nvlink 1.169 GB/s"
    with pytest.raises(ConfigError) as err:
        apply_calibration(system("dgx-h100", nodes=1), calib)
    assert str(err.value) == ("--calibration: link.nvlink: measured with gloo (loopback TCP inside one host, 1.169 "
                              "GB/s), not with nccl on the 1x dgx-h100 nvlink; calibrate the GPUs (nccl-tests + "
                              "meshplan calibrate, or bench comm on a GPU host) or plan a gloo cluster")
    from meshplan.runtime.testbed.cpu import cpu_cluster
    gloo = apply_calibration(cpu_cluster(4)[0], calib)  # the CPU testbed's own links: taken
    assert gloo.node.fabric.bandwidth_gb_per_s == pytest.approx(1.169, rel=1e-3) and gloo.node.fabric.calibrated


def _raw(op, n, rows):
    ranks = [{"rank": r, "host": "h", "pid": 100 + r, "node": 0, "device": "cpu"} for r in range(n)]
    return {"backend": "gloo", "world": n, "ranks": ranks, "iters": 5, "warmup": 1,
            "collectives": [{"op": op, "link": "nvlink", "ranks": list(range(n)), "rows": rows}]}


@pytest.mark.parametrize("op", OPS)
def test_nccl_tests_text_parses_back_exactly(op):
    # t = 50 us + factor * S / 2 GB/s: the fit recovers alpha and beta from the printed text
    rows = [{"size_bytes": s, "count": s // 4, "time_s": 50e-6 + busbw_factor(op, 4) * s / 2e9, "iters": 5,
             "wrong": 0} for s in B.parse_sizes("1K..64M")]
    text = R.nccl_tests_text(_raw(op, 4, rows)["collectives"][0], _raw(op, 4, rows))
    got = parse_nccl_tests_text(text)
    assert [(r.op, r.n_ranks, r.size_bytes) for r in got] == [(op, 4, r["size_bytes"]) for r in rows]
    assert all(r.busbw_bytes_per_s == pytest.approx(r.algbw_bytes_per_s * busbw_factor(op, 4), rel=0.01, abs=1e7)
               for r in got)
    from meshplan.comm.linkfit import fit_alpha_beta

    fit = fit_alpha_beta(got, "nvlink")
    assert fit.latency_s == pytest.approx(50e-6, rel=0.01) and fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=0.01)


def test_fit_past_a_rate_limiter_burst_finds_the_sustained_rate():
    # tbf-like link: messages up to 64 KiB pass in the burst (flat 300-310 us), larger ones at 25 MB/s
    from meshplan.comm.nccl_tests import BenchRow

    rows = [BenchRow("all-reduce", 2, s, 300e-6 + (s / 25e6 if s > 65536 else s * 1e-10), 0, 0)
            for s in B.parse_sizes("4K..1M")]
    assert R.knee_sizes(rows)[0] == 131072                  # 0.31 ms -> 5.5 ms for 2x the bytes
    fit, note = R.fit_link(rows, "nic")
    assert fit.bandwidth_bytes_per_s == pytest.approx(25e6, rel=0.01)
    assert fit.latency_s == pytest.approx(300e-6, rel=0.01)
    assert "sizes >= 131072 B" in note and fit.points == len(rows)
    smooth = [BenchRow("all-reduce", 2, r.size_bytes, 300e-6 + r.size_bytes / 25e6, 0, 0) for r in rows]
    assert R.knee_sizes(smooth) == [] and R.fit_link(smooth, "nic")[1] == "all sizes"
    noisy = [BenchRow(r.op, 2, r.size_bytes, 2e-3 if r.size_bytes == 8192 else r.time_s, 0, 0) for r in rows]
    assert R.knee_sizes(noisy)[0] == 8192                   # a stalled small call makes a false knee ...
    fit, note = R.fit_link(noisy, "nic")                    # ... which the residual rules out
    assert "sizes >= 131072 B" in note and fit.bandwidth_bytes_per_s == pytest.approx(25e6, rel=0.01)
    # the burst ends two sizes before the largest: no knee with three sizes past it, so the fit
    # falls back to all sizes and says it is poor and what to measure (the CI failure of 2026-12-01)
    short = [r for r in rows if r.size_bytes <= 262144]
    fit, note = R.fit_link(short, "nic")
    assert fit.rms_residual > R.POOR_FIT_RMS and "a poor fit" in note and "--sizes" in note


def test_fast_domains_against_nodes():
    raw = _raw("all-reduce", 4, [])
    raw["ranks"] = [dict(r, node=r["rank"] // 2) for r in raw["ranks"]]
    fast, slow = 1e-3, 4e-2                                  # one-way seconds for 1 MB
    raw["pairs"] = {"size_bytes": 10 ** 6, "iters": 3, "one_way_s": [
        [0, fast, slow, slow], [fast, 0, slow, slow], [slow, slow, 0, fast], [slow, slow, fast, 0]]}
    text, bw = R.pairs_text(raw)
    assert bw[0][1] == pytest.approx(1e9) and bw[0][2] == pytest.approx(2.5e7) and bw[0][0] == 0
    assert "fast domains (split at a >= 4x gap between pair bandwidths): [[0, 1], [2, 3]]" in text and "agrees" in text


SIZES = "64K..8M"


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_four_rank_gloo_run_gives_nccl_tests_files_a_fit_and_a_pair_matrix(tmp_path):
    # Sizes up to 8 MiB: with 4 ranks on 2 shared cores the fastest of 5 small calls still
    # takes 2-5 ms, so below 1 MiB the transfer (~2 ms at 1 MiB) drowns in scheduling noise and
    # the all-reduce slope came out non-positive in 1 run of 6; from 2 MiB the time grows.
    t0 = time.monotonic()
    lines = []
    fits = B.run_bench(4, B.parse_sizes(SIZES), tmp_path, iters=5, warmup=1, budget_s=0.05, timeout_s=90,
                       echo=lines.append)
    elapsed = time.monotonic() - t0
    for op in OPS:
        path = tmp_path / f"{R.BENCH_OPS[op]}.nvlink.txt"
        rows = parse_nccl_tests_text(path.read_text())            # nccl-tests text, read back
        assert [r.size_bytes for r in rows] == B.parse_sizes(SIZES)
        assert {(r.op, r.n_ranks) for r in rows} == {(op, 4)} and all(r.time_s > 0 for r in rows)
        for r in rows:                                             # printed with 2 decimals in GB/s
            assert r.busbw_bytes_per_s == pytest.approx(r.algbw_bytes_per_s * busbw_factor(op, 4), abs=0.011e9)
        assert "# Out of bounds values : 0 OK" in path.read_text()  # every result checked on known values
        assert path.read_text() in "\n".join(lines)                 # and printed
    assert [(f.link, f.op, f.n_ranks) for f in fits] == [("nvlink", "all-reduce", 4)]
    assert fits[0].bandwidth_bytes_per_s > 0 and fits[0].latency_s >= 0, "\n".join(lines[-5:])
    pairs = json.loads((tmp_path / "pairs.json").read_text())
    bw = pairs["bandwidth_bytes_per_s"]
    assert len(bw) == 4 and all(len(row) == 4 for row in bw)
    assert all(bw[i][i] == 0 for i in range(4)) and all(bw[i][j] > 0 for i in range(4) for j in range(4) if i != j)
    assert all(bw[i][j] == bw[j][i] for i in range(4) for j in range(4))
    assert "agrees" in (tmp_path / "pairs.txt").read_text()        # one node: every pair is loopback
    # the CPU testbed's own hardware description: the fitted loopback feeds meshplan's cluster model
    calib = load_calibration(tmp_path / "calibration.toml")
    assert set(calib) == {"nvlink"} and calib["nvlink"].ranks == 4 and calib["nvlink"].op == "all-reduce"
    assert calib["nvlink"].bandwidth_gb_per_s == pytest.approx(fits[0].bandwidth_bytes_per_s / 1e9, rel=1e-3)
    from meshplan.runtime.testbed.cpu import cpu_cluster
    cluster = apply_calibration(cpu_cluster(4)[0], calib)
    assert cluster.node.fabric.bandwidth_gb_per_s == calib["nvlink"].bandwidth_gb_per_s
    assert "meshplan bench comm" in cluster.node.fabric.source
    assert calib["nvlink"].backend == "gloo" and B.GLOO_HEADLINE in lines  # said, and refused for NVLink:
    with pytest.raises(ConfigError, match=r"link.nvlink: measured with gloo \(loopback TCP inside one host"):
        apply_calibration(system("dgx-h100", nodes=1), calib)
    assert elapsed < 60, f"bench took {elapsed:.1f} s"


RATE_MBIT = 200


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_testbed_two_nodes_show_the_throttled_link_in_pairs_and_fit(tmp_path):
    from meshplan.runtime.testbed import netns as T

    ok, why = T.testbed_available()
    if not ok and os.environ.get("MESHPLAN_REQUIRE_TESTBED") == "1":
        pytest.fail(f"MESHPLAN_REQUIRE_TESTBED=1 but the testbed is unavailable: {why}")
    if not ok:
        pytest.skip(f"testbed unavailable here: {why}")
    prefix = f"bc{os.getpid() % 10**6}"
    try:
        T.testbed_up(prefix, 2, 1, RATE_MBIT, state_dir=tmp_path / "state")
        # the tbf burst is 10 ms of traffic (250 KB at 200 Mbit/s): 4 sizes past it (512K..4M), so
        # that the sustained-rate fit has at least three (with 16K..1M only two were, and the
        # fit over all sizes, burst included, came out 2.4x the rate on a loaded machine)
        fits = B.run_bench(2, B.parse_sizes("16K..4M"), tmp_path / "out", testbed=prefix, iters=5, warmup=1,
                           budget_s=0.1, timeout_s=120, testbed_state_dir=tmp_path / "state", echo=lambda s: None)
    finally:
        T.testbed_down(prefix, state_dir=tmp_path / "state")
    rate = RATE_MBIT * 1e6 / 8                                     # tbf rate, bytes/s
    bw = json.loads((tmp_path / "out" / "pairs.json").read_text())["bandwidth_bytes_per_s"]
    assert all(0.5 * rate < bw[i][j] < 1.6 * rate for i in (0, 1) for j in (2, 3)), bw   # across namespaces
    assert bw[0][1] > 10 * rate and bw[2][3] > 10 * rate                                # loopback in a node
    assert "[[0, 1], [2, 3]]: agrees" in (tmp_path / "out" / "pairs.txt").read_text()
    by_link = {f.link: f for f in fits}
    # the throttled link is what this test is about; the in-node loopback fit over 16K..1M on a
    # loaded 2-core machine can come out non-positive (it is checked with larger sizes in the
    # 4-rank test), so it may be missing here
    assert set(by_link) <= {"nvlink", "nic"} and by_link["nic"].n_ranks == 2
    assert 0.5 * rate < by_link["nic"].bandwidth_bytes_per_s < 1.6 * rate               # sustained, past the burst
    calib = load_calibration(tmp_path / "out" / "calibration.toml")
    assert calib["nic"].bandwidth_gb_per_s * 8 == pytest.approx(RATE_MBIT / 1000, rel=0.6)


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_testbed_with_two_nics_measures_each_rail(tmp_path):
    # 2 nodes x 2 NICs, 2 ranks per node: local rank i on nic<i>, so each NIC has its own nic
    # group and carries its ranks' pairs (those to the other rail cross the spine)
    from meshplan.runtime.testbed import netns as T

    ok, why = T.testbed_available()
    if not ok:
        pytest.skip(f"testbed unavailable here: {why}")
    prefix, state, lines = f"bn{os.getpid() % 10**6}", tmp_path / "state", []
    try:
        tb = T.testbed_up(prefix, 2, 2, RATE_MBIT, state_dir=state)
        before = T.read_counters(tb)
        fits = B.run_bench(2, B.parse_sizes("16K..4M"), tmp_path / "out", testbed=prefix, iters=5, warmup=1,
                           budget_s=0.1, timeout_s=120, testbed_state_dir=state, echo=lines.append)
        moved = T.counter_delta(before, T.read_counters(tb))
    finally:
        T.testbed_down(prefix, state_dir=state)
    out = tmp_path / "out"
    pairs = json.loads((out / "pairs.json").read_text())
    assert pairs["nic_of_rank"] == ["nic0", "nic1", "nic0", "nic1"]
    assert "# NIC of rank: 0 nic0 10.77.0.1, 1 nic1 10.77.1.1, 2 nic0 10.77.0.2, 3 nic1 10.77.1.2" in "\n".join(lines)
    # every NIC of both nodes sent and received at least its ranks' cross-node pairs (6 x 1 MiB each way)
    assert all(tx > 4 * 2**20 and rx > 4 * 2**20 for tx, rx in moved.values()), moved
    rate, bw = RATE_MBIT * 1e6 / 8, pairs["bandwidth_bytes_per_s"]
    assert all(0.5 * rate < bw[i][j] < 1.6 * rate for i in (0, 1) for j in (2, 3)), bw   # same rail and across
    for k in (0, 1):
        text = (out / f"all_reduce_perf.nic.nic{k}.txt").read_text()
        assert f"on nic{k} of every node" in text and "# Out of bounds values : 0 OK" in text
    nic = {f.link: f for f in fits}["nic"]
    assert nic.n_ranks == 2 and 0.5 * rate < nic.bandwidth_bytes_per_s < 1.6 * rate


def test_calibrate_of_a_gloo_bench_file_keeps_backend_gloo(tmp_path):
    from meshplan.comm.calibrate import calibrate
    from meshplan.comm.calibration import calibration_toml
    rows = [{"size_bytes": s, "count": s // 4, "time_s": 50e-6 + 1.5 * s / 1.169e9, "iters": 5, "wrong": 0}
            for s in B.parse_sizes("64K..8M")]
    raw = _raw("all-reduce", 4, rows)
    path = tmp_path / "all_reduce_perf.nvlink.txt"
    path.write_text(R.nccl_tests_text(raw["collectives"][0], raw))
    fits, _, source = calibrate([path])
    assert [(f.link, f.backend) for f in fits] == [("nvlink", "gloo")]
    (tmp_path / "c.toml").write_text(calibration_toml(fits, source))
    assert load_calibration(tmp_path / "c.toml")["nvlink"].backend == "gloo"


def test_a_gpu_run_records_its_gpu_model(tmp_path):
    """Under NCCL each rank's device is its GPU model (torch.cuda.get_device_name, the name
    nccl-tests prints): the text's '#  Rank' lines carry it and calibration.toml records it."""
    rows = [{"size_bytes": s, "count": s // 4, "time_s": 20e-6 + 1.75 * s / 400e9, "iters": 5, "wrong": 0}
            for s in B.parse_sizes("64K..64M")]
    raw = _raw("all-reduce", 8, rows)
    raw["backend"] = "nccl"
    raw["ranks"] = [dict(r, device="NVIDIA H100 80GB HBM3") for r in raw["ranks"]]
    raw["pairs"] = {"size_bytes": 10 ** 6, "iters": 3, "one_way_s": [[0 if i == j else 1e-5 for j in range(8)]
                                                                     for i in range(8)]}
    R.write_results(tmp_path, raw, "test")
    text = (tmp_path / "all_reduce_perf.nvlink.txt").read_text()
    assert "device  0 [node 0] NVIDIA H100 80GB HBM3 (global rank 0)" in text
    calib = load_calibration(tmp_path / "calibration.toml")
    assert calib["nvlink"].gpu == "NVIDIA H100 80GB HBM3" and calib["nvlink"].backend == "nccl"
    assert calib["nvlink"].bandwidth_gb_per_s == pytest.approx(400, rel=0.01)
