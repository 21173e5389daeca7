"""``meshplan calibrate``: nccl-tests outputs -> the calibration file ``--calibration`` reads.

Fixtures: tests/data/nccl/all_reduce_perf_8nodes-x1gpu.txt (exact alpha 20 us, beta 40 GB/s,
8 hosts x 1 GPU; see tests/data/nccl/README.md) and the published rows written by
tests/nccl_published.py (S15 8x A100, S3 8x H200, S18 2 x 8 and 2 x 1 A100)."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from nccl_published import DATA, PUBLISHED, published_text
from tests.cli_run import run_cli
from tests.test_cli_json import H100X2

EXACT = DATA / "all_reduce_perf_8nodes-x1gpu.txt"
S15 = DATA / "all_reduce_perf_8xa100_s15.txt"
A100 = "NVIDIA A100-SXM4-80GB"  # what S15's '#  Rank' lines name (cudaDeviceProp.name)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_fixtures_are_the_published_rows(name):
    assert (DATA / name).read_text() == published_text(*PUBLISHED[name])


def test_calibrate_writes_the_file_plan_reads(tmp_path, capsys):
    out = tmp_path / "calib.toml"
    # the exact fixture's rows on A100s (as S15's node): one GPU model, so one calibration file
    exact = tmp_path / EXACT.name
    exact.write_text(EXACT.read_text().replace("NVIDIA H100 80GB HBM3", A100))
    rc, text, err = run_cli(["calibrate", str(exact), str(S15), "--out", str(out)], capsys)
    assert rc == 0, err
    assert f"wrote {out}" in text
    calib = load_calibration(out)
    assert (calib["nic"].gpu, calib["nvlink"].gpu) == (A100, A100)  # the '#  Rank' lines' model, per link class
    # 8 hosts with one GPU each: nic; alpha and beta of the exact fixture (20 us, 40 GB/s)
    assert (calib["nic"].op, calib["nic"].ranks, calib["nic"].points) == ("all-reduce", 8, 62)
    assert calib["nic"].latency_us == pytest.approx(20.0, rel=0.01)
    assert calib["nic"].bandwidth_gb_per_s == pytest.approx(40.0, rel=0.01)
    # one host with 8 GPUs: nvlink; one alpha-beta line through S15's S-shaped curve (9 sizes,
    # out-of-place and in-place) cannot pass every row: rows weigh by relative error, so beta
    # falls between the 128M row (176.9 GB/s) and the 16G plateau (234.9; the line's time there
    # is 12.5% longer than measured), and alpha between the 1M and 32K rows' times
    nv = calib["nvlink"]
    assert (nv.op, nv.ranks, nv.points) == ("all-reduce", 8, 18)
    assert 176.9 < nv.bandwidth_gb_per_s < 234.9 and 43.77 < nv.latency_us < 101.94
    t16 = nv.latency_us * 1e-6 + 1.75 * 16 * 2**30 / (nv.bandwidth_gb_per_s * 1e9)
    assert t16 == pytest.approx(127990e-6, rel=0.15)
    assert "S15" not in nv.source and "all_reduce_perf_8xa100_s15.txt" in nv.source
    # each link's source names its own file only (both named both files)
    assert nv.source == "nccl-tests 2.17.6 all-reduce over 8 ranks on 1 host(s), file all_reduce_perf_8xa100_s15.txt"
    assert calib["nic"].source.endswith("file all_reduce_perf_8nodes-x1gpu.txt") and "s15" not in calib["nic"].source
    # applied to 2 dgx-a100: fabric and NICs from the file, the catalog's curves dropped
    c = apply_calibration(system("dgx-a100", nodes=2), calib)
    assert c.node.fabric.bandwidth_gb_per_s == pytest.approx(nv.bandwidth_gb_per_s)
    assert c.node.nics[0].rate_gbit_per_s == pytest.approx(8 * calib["nic"].bandwidth_gb_per_s)
    # the catalog's curves of the fitted patterns dropped; each class's own logged curve in their place
    # (issue 11 item 2). The send/recv pair is another pattern (calib37): S18's pair curve kept, read at
    # r = this run's busbw at 1 GiB over S18's 2 x 1 all-reduce there: 39.98 (the file's busbw column)
    # / 18.65 = 2.144 x its 15.48 GB/s, via the calibrated NIC rate over the scaled curve's line
    assert set(c.node.busbw) == {"nvlink", "nic", "p2p", "a2a"}
    # all-to-all is not a ring op (trial 28): no alltoall_perf in the files, so it keeps the catalog's
    # ib-hdr-200-8nic curve, its line 200 GB/s x (calibrated rate / catalog 25 GB/s) so that at the calibrated
    # NIC rate it reads the catalog busbw
    a2a = c.node.busbw["a2a"]
    assert a2a.busbw_gb_per_s == system("dgx-a100", nodes=2).node.busbw["nic"].busbw_gb_per_s
    assert a2a.line_gb_per_s == pytest.approx(200.0 * calib["nic"].bandwidth_gb_per_s / 25.0, rel=1e-9)
    p2p = c.node.busbw["p2p"]
    assert p2p.busbw_gb_per_s == [15.48] and p2p.op == "all-to-all" and not p2p.calibrated
    assert c.node.nics[0].rate_gbit_per_s / 8 / p2p.line_gb_per_s == pytest.approx(39.98 / 18.65, rel=1e-6)
    assert c.node.busbw["nvlink"].busbw_gb_per_s == [1.31, 18.0, 72.3, 109.9, 138.5, 176.9, 222.7, 229.0, 234.9]
    assert (c.node.busbw["nic"].ranks, c.node.busbw["nic"].nodes) == (8, 8)

    # the file is not replaced without --force
    rc, _, err = run_cli(["calibrate", str(exact), "--out", str(out)], capsys)
    assert rc == 2 and err.strip().startswith("error: --out:") and "--force" in err and err.count("\n") == 1
    rc, _, err = run_cli(["calibrate", str(exact), "--out", str(out), "--force"], capsys)
    assert rc == 0 and set(load_calibration(out)) == {"nic"}


def test_calibrated_step_reads_the_logged_busbw(tmp_path, capsys):
    """The busbw the step model gives the calibrated 8-GPU all-reduce at a logged size is the
    logged one (S15, by hand from the file's busbw column: 8M 109.90, 128M 176.90, 16G 234.90
    GB/s); at 16 GiB the alpha-beta line alone was 12.5% slow. At the smallest logged size (32 KiB,
    1.31 GB/s: t = 1.75 x 32768 / 1.31 GB/s = 43.7740 us) the logged busbw too (it was 1.05 GB/s, the
    fit's alpha, above that time); below it the time holds at 43.7740 us, latency-bound (the fit's
    alpha exceeds it), so at 16 KiB busbw = 1.75 x 16384 / 43.7740 us = 0.655 GB/s (it was the fit,
    1.75 S / (alpha + 1.75 S / beta) = 0.523 GB/s, slower than the logged 32 KiB). Above the largest
    the curve continues along its last segment (it took the fit there too, 208.86 GB/s at 32 GiB, a
    jump from the logged 234.90 at 16 GiB): t(1G) = 1.75 x 2^30 / 229.0 GB/s = 8205.4506 us,
    t(16G) = 1.75 x 2^34 / 234.9 GB/s = 127989.6597 us, t(32G) = t(16G) + (t(16G) - t(1G)) x 16 / 15
    = 255759.4828 us, busbw 1.75 x 2^35 / t(32G) = 235.102 GB/s."""
    from meshplan.comm.alphabeta import busbw_factor
    from meshplan.comm.nccl_algorithms import collective_time
    from meshplan.comm.nccl_protocols import REFERENCE_STEP_S
    out = tmp_path / "c.toml"
    assert run_cli(["calibrate", str(S15), "--out", str(out)], capsys)[0] == 0
    calib = load_calibration(out)
    c = apply_calibration(system("dgx-a100", nodes=1), calib)
    fabric = c.node.fabric
    scale = fabric.latency_s / REFERENCE_STEP_S["nvlink"]

    def bus(size):
        t = collective_time("all-reduce", 8, size, fabric.bandwidth_bytes_per_s, "nvlink", latency_scale=scale,
                            curves=c.node.busbw, calibrated=True)[1]
        return busbw_factor("all-reduce", 8) * size / t / 1e9

    for size, logged in ((8 * 2**20, 109.90), (128 * 2**20, 176.90), (16 * 2**30, 234.90)):
        assert bus(size) == pytest.approx(logged, rel=1e-9)
    nv = calib["nvlink"]
    t_small = 1.75 * 2**15 / 1.31e9
    assert t_small * 1e6 == pytest.approx(43.7740, abs=1e-4) and nv.latency_us * 1e-6 > t_small
    assert bus(2**15) == pytest.approx(1.31, rel=1e-9)  # the smallest logged point, met exactly
    assert bus(2**14) == pytest.approx(1.75 * 2**14 / t_small / 1e9, rel=1e-9) == pytest.approx(0.655, rel=1e-9)
    assert bus(2**15 - 1) == pytest.approx(1.31, rel=1e-4)  # continuous at the smallest logged size
    t1, t16 = 1.75 * 2**30 / 229.0e9, 1.75 * 2**34 / 234.9e9
    assert (t1 * 1e6, t16 * 1e6) == (pytest.approx(8205.4506, abs=1e-4), pytest.approx(127989.6597, abs=1e-4))
    assert bus(2**35) == pytest.approx(1.75 * 2**35 / (t16 + (t16 - t1) * 16 / 15) / 1e9, rel=1e-9)
    assert bus(2**35) == pytest.approx(235.102, abs=1e-3)
    assert bus(16 * 2**30 + 1) == pytest.approx(234.90, rel=1e-6)  # continuous at the largest logged size


def test_two_gpu_models_are_refused(tmp_path, capsys):
    """Issue 11 (trial 5 item 2): the A100 node's run (S15) beside the H200 node's (S3) gave one
    nvlink fit, the A100's (the slower, 208.91 of 439.95 GB/s), and a file that named no GPU;
    now one line names both models with their files and the fix, and nothing is written."""
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", str(S15), str(DATA / "all_reduce_perf_8xh200_s3.txt"), "--out", str(out)], capsys)
    assert (rc, err) == (2, "error: NCCL_TESTS_OUTPUT: two GPU models, NVIDIA A100-SXM4-80GB "
                            "(all_reduce_perf_8xa100_s15.txt) and NVIDIA H200 (all_reduce_perf_8xh200_s3.txt); a "
                            "calibration file is for one GPU model: calibrate each model's files into its own --out "
                            "and give --calibration the one of the cluster's GPU\n")
    assert not out.exists()
    # across link classes too: the H100 cluster's nic run (8 nodes x 1 H100) beside the A100 node
    rc, _, err = run_cli(["calibrate", str(S15), str(EXACT), "--out", str(out)], capsys)
    assert rc == 2 and "NVIDIA A100-SXM4-80GB (all_reduce_perf_8xa100_s15.txt) and NVIDIA H100 80GB HBM3" in err
    # one run whose ranks name two models (rank 7 on an H100): its own line
    mixed = tmp_path / "mixed.txt"
    lines = S15.read_text().splitlines()
    mixed.write_text("\n".join(ln.replace(A100, "NVIDIA H100 80GB HBM3") if ln.startswith("#  Rank  7") else ln
                               for ln in lines) + "\n")
    rc, _, err = run_cli(["calibrate", str(mixed), "--out", str(out)], capsys)
    assert (rc, err) == (2, f"error: mixed.txt: its ranks ran on 2 GPU models ({A100}, NVIDIA H100 80GB HBM3); a "
                            "calibration file is for one GPU model: measure one model per nccl-tests run\n")


def test_calibration_keeps_the_slowest_all_reduce(tmp_path, capsys):
    """Two one-node runs on A100s: S15 and one written exactly at alpha 15 us, beta 250 GB/s
    (nccl_tests_text): nvlink keeps the slower fit, S15's."""
    from test_calibration import nccl_tests_text
    fast = tmp_path / "fast.txt"
    fast.write_text(nccl_tests_text("all_reduce_perf", ["dgx-a100-01"] * 8, [2 ** k for k in range(10, 31)], 15e-6,
                                    250e9, gpu=A100))
    out = tmp_path / "c.toml"
    rc, text, _ = run_cli(["calibrate", str(S15), str(fast), "--out", str(out)], capsys)
    assert rc == 0
    assert "all_reduce_perf_8xa100_s15.txt" in load_calibration(out)["nvlink"].source
    # the note names the kept and the dropped file with their fits and why (it said '(the slowest of 2 all-reduce
    # fit(s) of 2)'); beta of each fit as the per-file lines print it
    assert ("nvlink: kept all_reduce_perf_8xa100_s15.txt (all-reduce 208.91 GB/s); dropped fast.txt "
            "(all-reduce 250.00 GB/s: faster than the kept one; a collective over every link waits for the slowest)"
            ) in text.splitlines()


def test_an_all_gather_run_beside_the_all_reduce_is_named(tmp_path, capsys):
    """An all-gather run of the same node beside S15's all-reduce: the all-reduce fit is kept as
    the class's rate even though the all-gather's bus bandwidth (150 GB/s, written exactly by
    nccl_tests_text) is lower. It said 'dropped ag.txt (all-gather 150.00 GB/s: the all-reduce fit
    is kept where there is one, as bench comm does)'; since NVLink is calibrated per op
    (tests/test_calibrate_nvlink_ops.py) the run sets the all-gather, and the line says so."""
    from test_calibration import nccl_tests_text
    ag = tmp_path / "ag.txt"
    ag.write_text(nccl_tests_text("all_gather_perf", ["dgx-a100-01"] * 8, [2 ** k for k in range(10, 31)], 15e-6, 150e9,
                                  gpu=A100))
    rc, text, err = run_cli(["calibrate", str(S15), str(ag), "--out", str(tmp_path / "c.toml")], capsys)
    assert rc == 0, err
    assert load_calibration(tmp_path / "c.toml")["nvlink"].op == "all-reduce"
    assert not any("dropped" in line for line in text.splitlines())
    assert any(line.startswith("nvlink: this file sets, on nvlink, all-reduce, reduce-scatter, all-to-all and "
                               "send/recv from the all-reduce fit over 8 ranks (no run of their own); all-gather from "
                               "its own run") and "file ag.txt); except on a node whose all-reduce runs on NVLS" in line
               for line in text.splitlines())


@pytest.mark.parametrize("args, words", [
    (["all_reduce_perf_2x1a100_s18.txt"], "all_reduce_perf_2x1a100_s18.txt: 1 usable size (1073741824 B); measure at "
     "least two sizes"),
    (["all_reduce_perf_8xa100_s15.txt", "--link", "ib"], "--link: unknown link class 'ib'"),
    (["all_reduce_perf_2x8a100_s18.txt", "--link", "nvlink"], "--link: nvlink is a link inside one node, but "
     "all_reduce_perf_2x8a100_s18.txt ran 16 ranks on 2 hosts (its busbw crosses the network); pass --link nic, or "
     "measure one node for nvlink"),
    (["missing.txt"], "NCCL_TESTS_OUTPUT: no such file"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, words):
    argv = ["calibrate", *[str(DATA / a) if a.endswith(".txt") else a for a in args], "--out", str(tmp_path / "c.toml")]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and words in err and err.count("\n") == 1
    assert not (tmp_path / "c.toml").exists()


def test_missing_header_lines_say_what_to_give(tmp_path, capsys):
    """The CLI has no op or n_ranks option: the error names the missing line (it said 'pass op=')."""
    text = EXACT.read_text()
    cut = {"no-test.txt": "\n".join(ln for ln in text.splitlines()
                                    if not ln.startswith(("#  Rank", "# Collective test starting"))),
           "no-ranks.txt": "\n".join(ln for ln in text.splitlines() if not ln.startswith("#  Rank"))}
    want = {"no-test.txt": "error: no-test.txt: no '# Collective test starting' line (e.g. '# Collective test "
                           "starting: all_reduce_perf'; nccl-tests prints it since 2025-06, NVIDIA/nccl-tests "
                           "dafb704), and no result rows under the column header with the '#  Rank' lines to tell "
                           "the collective from; give the whole output of one nccl-tests run, or put that line back "
                           "at its top\n",
            "no-ranks.txt": "error: no-ranks.txt: no '#  Rank <r> Group <g> Pid <p> on <host> device <d> ...' lines, "
                            "which give the ranks; give the whole output of one nccl-tests run, with its '# Using "
                            "devices' block\n"}
    for name, body in cut.items():
        (tmp_path / name).write_text(body)
        rc, _, err = run_cli(["calibrate", str(tmp_path / name), "--out", str(tmp_path / "c.toml")], capsys)
        assert (rc, err) == (2, want[name])
    # the banner alone missing (nccl-tests before dafb704, 2025-06): the rows name all_reduce, the same fit
    (tmp_path / "old.txt").write_text(text.replace("# Collective test starting: all_reduce_perf\n", ""))
    for name, out in (("old.txt", "old.toml"), (EXACT, "new.toml")):
        rc, _, err = run_cli(["calibrate", str(tmp_path / name), "--out", str(tmp_path / out)], capsys)
        assert rc == 0, err
    old, new = load_calibration(tmp_path / "old.toml")["nic"], load_calibration(tmp_path / "new.toml")["nic"]
    assert (old.latency_us, old.bandwidth_gb_per_s, old.op) == (new.latency_us, new.bandwidth_gb_per_s, "all-reduce")


def test_mixed_run_recorded_as_asked(tmp_path, capsys):
    # --link nic records the S18 2 x 8 run: alpha-beta through its three rows (1 KB 35.85 us,
    # 1G 183.82 and 4G 188.18 GB/s busbw); the 4G row's time is within 2% of the fitted line,
    # whose bus bandwidth is the node's: 8 ranks per host, one HDR NIC each, so per NIC / 8
    out = tmp_path / "c.toml"
    rc, _, err = run_cli(["calibrate", str(DATA / "all_reduce_perf_2x8a100_s18.txt"), "--link", "nic", "--out", str(out)],
                     capsys)
    assert rc == 0, err
    nic = load_calibration(out)["nic"]
    assert nic.ranks == 16
    t4g = nic.latency_us * 1e-6 + 1.875 * 4 * 2**30 / (8 * nic.bandwidth_gb_per_s * 1e9)
    assert t4g == pytest.approx(1.875 * 4 * 2**30 / 188.18e9, rel=0.02)
    assert nic.bandwidth_gb_per_s < 25.0  # under an HDR 200 Gb/s NIC's line rate: no warning
    assert "warning" not in err
    # nc61 #7: without --link (refused before) its 2 hosts make it nic, said in one line, the same file
    rc, text, err = run_cli(["calibrate", str(DATA / "all_reduce_perf_2x8a100_s18.txt"), "--out",
                             str(tmp_path / "d.toml")], capsys)
    assert rc == 0, err
    assert text.splitlines()[0] == "all_reduce_perf_2x8a100_s18.txt: link: nic (ranks on 2 hosts; --link to override)"
    assert (tmp_path / "d.toml").read_text() == out.read_text()


H100X16 = DATA / "all_reduce_perf_2x8h100.txt"  # 2 hosts x 8 H100, t = 30 us + 1.875 S / 360 GB/s


def test_a_multi_gpu_node_run_is_split_over_its_nics(tmp_path, capsys):
    """Issue 11: 16 ranks on 2 hosts (all-reduce busbw 360 GB/s) wrote 353.3 GB/s for ONE NIC,
    7x a 400G NIC. A node's ring traffic leaves it over its 8 ranks' 8 NICs: 360 / 8 = 45 GB/s
    per NIC (90% of 50 GB/s); the curve keeps the logged busbw, read against the node's 8 x 45."""
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", str(H100X16), "--link", "nic", "--out", str(out)], capsys)
    assert rc == 0, err
    assert ("all_reduce_perf_2x8h100.txt: 8 ranks per host, each on its own NIC: nic all-reduce 45.00 GB/s per NIC "
            "= 360.00 / 8") in text.splitlines() and "warning" not in text
    nic = load_calibration(out)["nic"]
    assert nic.bandwidth_gb_per_s == pytest.approx(45.0, rel=1e-3) and nic.latency_us == pytest.approx(30.0, rel=1e-2)
    curve = nic.fitted_curve()
    assert (curve.ranks, curve.nodes, curve.line_gb_per_s) == (16, 2, None)  # no line rate in the file: set when applied
    assert curve.busbw_gb_per_s[-1] == 359.76  # the 8 GiB row as logged
    # applied to 2 DGX H100: NICs at 45 x 8 = 360 Gb/s, the curve read against the node's 8 NICs
    cluster = apply_calibration(system("dgx-h100", nodes=2), load_calibration(out))
    assert [n.rate_gbit_per_s for n in cluster.node.nics] == [pytest.approx(360.0, rel=1e-3)] * 8
    assert cluster.node.busbw["nic"].line_gb_per_s == pytest.approx(360.0, rel=1e-3)
    # step on 2 DGX H100 (8 NICs per node): no warning (it said 332 GB/s per NIC)
    cfg = tmp_path / "h100x2.toml"
    cfg.write_text(H100X2)
    rc, text, err = run_cli(["step", str(cfg), "--calibration", str(out)], capsys)
    assert rc == 0 and text.splitlines()[0].endswith("nic 45 GB/s") and "warning" not in text
    # on seed-8x8-2nic (2 NICs per node) the split over 8 NICs is not that node's: said
    seed = DATA.parents[2] / "examples" / "seed-64gpu.toml"
    rc, text, err = run_cli(["step", str(seed), "--calibration", str(out)], capsys)
    assert rc == 0 and text.splitlines()[1].startswith("  nic fitted to all-reduce over 16 ranks on 2 nodes: ") \
        and text.splitlines()[2] == (  # under the header and its origin line (words20's 240cc02)
        f"warning: --calibration {out}: nic was split over 8 NICs per node (one per rank of its 8-GPU-per-node run), "
        "but seed-8x8-2nic has 2: its per-NIC figure is not this node's")


def test_a_nic_fit_above_line_rate_is_warned(tmp_path, capsys):
    """One rank per host at 40 GB/s on A100 nodes, whose catalog NICs (dgx-a100) are HDR 200 Gb/s
    = 25 GB/s: written, with a warning line; a calibration file with one node's 353.3 GB/s on
    its NIC (written before the split) is warned at step against seed-8x8-2nic's 400 Gb/s NICs:
    353.3 x 8 / 400 = 7.1x."""
    a100 = tmp_path / "a100x8.txt"
    a100.write_text(EXACT.read_text().replace("NVIDIA H100 80GB HBM3", A100))
    rc, text, err = run_cli(["calibrate", str(a100), "--out", str(tmp_path / "a.toml")], capsys)
    assert rc == 0, err
    assert ("warning: a100x8.txt: nic 40.00 GB/s per NIC is above the 25 GB/s line rate of dgx-a100's NICs (200 "
            "Gb/s), the fastest catalog NIC for NVIDIA A100-SXM4-80GB: a NIC carries at most its line rate, so each "
            "rank drove several NICs or the nodes' NICs are faster than the catalog's; check the hosts of its "
            "'#  Rank' lines") in text.splitlines()
    old = tmp_path / "old.toml"
    old.write_text('[link.nic]\nlatency_us = 30\nbandwidth_gb_per_s = 353.3\nop = "all-reduce"\nranks = 16\n'
                   'source = "x"\n')
    seed = DATA.parents[2] / "examples" / "seed-64gpu.toml"
    rc, text, err = run_cli(["step", str(seed), "--calibration", str(old)], capsys)
    assert rc == 0 and (f"warning: --calibration {old}: nic 353.3 GB/s per NIC is 7.1x the 400 Gb/s line rate of "
                        "seed-8x8-2nic's NICs: it holds several NICs' traffic; calibrate the run again with its "
                        "'#  Rank' lines (meshplan calibrate splits a node's busbw over its ranks' NICs)"
                        ) in text.splitlines()


def test_unequal_ranks_per_host_are_refused_for_nic(tmp_path, capsys):
    """16 ranks, 12 on dgx-a and 4 on dgx-b: no one split over a node's NICs fits both."""
    text = "\n".join(ln.replace("dgx-b", "dgx-a") if any(ln.startswith(f"#  Rank {r:2d} ") for r in range(12, 16))
                     else ln for ln in H100X16.read_text().splitlines())
    (tmp_path / "uneven.txt").write_text(text)
    rc, _, err = run_cli(["calibrate", str(tmp_path / "uneven.txt"), "--link", "nic", "--out", str(tmp_path / "c.toml")],
                     capsys)
    assert (rc, err) == (2, "error: uneven.txt: 16 ranks on 2 hosts, 4 to 12 per host: its busbw cannot be split over "
                            "the NICs of one node; give a run with the same number of ranks on every host\n")


def test_json_output_reads_the_hosts(tmp_path, capsys):
    # -J JSON of the exact fixture: config.devices lists 8 hostnames node01..node08, one rank each
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", str(DATA / "all_reduce_perf_8nodes-x1gpu.json"), "--out", str(out)], capsys)
    assert rc == 0, err
    nic = load_calibration(out)["nic"]
    assert nic.latency_us == pytest.approx(20.0, rel=0.01) and nic.bandwidth_gb_per_s == pytest.approx(40.0, rel=0.01)
    assert "8 host(s)" in nic.source
    assert nic.gpu == "NVIDIA H100 80GB HBM3"  # config.devices[].device_info


def test_step_with_a_bad_calibration_file_names_the_option_once(tmp_path, capsys):
    """It printed 'error: X.toml: X.toml: not valid TOML': the file twice and no option."""
    seed = DATA.parents[2] / "examples" / "seed-64gpu.toml"
    (tmp_path / "X.toml").write_text("x = [")
    (tmp_path / "Y.toml").write_text("[link.nic]\nlatency_us = -1\nbandwidth_gb_per_s = 5\nsource = 'x'\n")
    rc, out, err = run_cli(["step", str(seed), "--calibration", str(tmp_path / "X.toml")], capsys)
    assert (rc, out) == (2, "")
    assert err == "error: --calibration: X.toml: not valid TOML (Invalid value (at end of document))\n"
    rc, out, err = run_cli(["step", str(seed), "--calibration", str(tmp_path / "Y.toml")], capsys)
    assert (rc, out) == (2, "")
    assert err.startswith("error: --calibration: Y.toml: link.nic.latency_us: ") and err.count("\n") == 1
