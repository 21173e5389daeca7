"""Calibration from nccl-tests: text and -J JSON parsing, the alpha-beta fit, the TOML file
and applying it to a cluster.

The sample files under tests/data/nccl/ were written by :func:`nccl_tests_text` (and the
matching JSON) from alpha = 20 us, beta = 40 GB/s for an all-reduce over 8 nodes x 1 GPU,
in the layout of NVIDIA/nccl-tests src/util.cu (format strings copied: "%12li  %12li  %8s
 %6s  %6s" preamble, getFloatStr widths 7/6/6, JSON version 2 keys).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.comm.calibration import CalibratedLink, calibration_toml, load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.linkfit import fit_alpha_beta
from meshplan.comm.nccl_tests import BenchRow, float_str, parse_nccl_tests_json, parse_nccl_tests_text, read_nccl_tests
from meshplan.catalog import system
from meshplan.comm.alphabeta import busbw_factor
from meshplan.errors import ConfigError
from tests.cli_run import run_cli

DATA = Path(__file__).parent / "data" / "nccl"
TXT = DATA / "all_reduce_perf_8nodes-x1gpu.txt"
JSON = DATA / "all_reduce_perf_8nodes-x1gpu.json"




def nccl_tests_rows(op, n, sizes, alpha_s, beta_bytes_per_s):
    """(size, time s, algbw B/s, busbw B/s) from t = alpha + busbw_factor * size / beta."""
    out = []
    for s in sizes:
        t = alpha_s + busbw_factor(op, n) * s / beta_bytes_per_s
        out.append((s, t, s / t, s / t * busbw_factor(op, n)))
    return out


#: nccl-tests' column header: "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
HEAD = "# " + "  ".join("{:>%d}" % w for w in (10, 12, 8, 6, 6, 7, 6, 6, 6, 7, 6, 6, 6)) + " "


def nccl_tests_text(program, hosts, sizes, alpha_s, beta_bytes_per_s, cmd="", gpu="NVIDIA H100 80GB HBM3"):
    """nccl-tests stdout for one process per host (one GPU each), on ``gpu`` (its
    ``cudaDeviceProp.name``)."""
    op = {"all_reduce_perf": "all-reduce", "all_gather_perf": "all-gather"}[program]
    redop = "sum" if op == "all-reduce" else "none"
    lines = ([f"$ {cmd}"] if cmd else []) + [
        "# nccl-tests version 2.17.6 nccl-headers=22703 nccl-library=22703",
        f"# Collective test starting: {program}",
        f"# nThread 1 nGpus 1 minBytes {sizes[0]} maxBytes {sizes[-1]} step: 2(factor) warmup iters: 5 "
        "iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0", "#", "# Using devices"]
    lines += [f"#  Rank {r:2d} Group {0:2d} Pid {41233 + 17 * r:6d} on {h:>10s} device {0:2d} [0000:18:00] "
              f"{gpu}" for r, h in enumerate(hosts)]
    lines += ["#", f"# {'':>10s}  {'':>12s}  {'':>8s}  {'':>6s}  {'':>6s}           out-of-place"
                   "                       in-place          ",
              HEAD.format("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
                          "algbw", "busbw", "#wrong"),
              HEAD.format("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                          "(GB/s)", "")]
    rows = nccl_tests_rows(op, len(hosts), sizes, alpha_s, beta_bytes_per_s)
    for s, t, a, b in rows:
        body = f"  {float_str(t * 1e6, 7)}  {float_str(a / 1e9, 6)}  {float_str(b / 1e9, 6)}  {0:6g}"
        lines.append(f"{s:12d}  {s // 4:12d}  {'float':>8s}  {redop:>6s}  {-1:6d}" + body + body)
    avg = sum(b for *_, b in rows) / len(rows) / 1e9
    lines += [f"# {'Out of bounds values':<20s} : 0 OK", f"# {'Avg bus bandwidth':<20s} : {avg:g} ", "#",
              f"# Collective test concluded: {program}", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- parsing


def test_text_sample_rows():
    rows = read_nccl_tests(TXT)
    assert len(rows) == 62  # 31 sizes, out-of-place and in-place
    first, last = rows[0], rows[-1]
    assert (first.op, first.n_ranks, first.size_bytes, first.in_place) == ("all-reduce", 8, 8, False)
    assert first.time_s == pytest.approx(20.0e-6)  # printed "  20.00"
    assert rows[1].in_place and rows[1].size_bytes == 8
    assert last.size_bytes == 8 * 2**30
    # 8 GiB: 20 us + 1.75 * 8589934592 / 40e9 s = 375,829.9 us, printed "%7.0f" -> 375830
    assert last.time_s == pytest.approx(375830e-6)
    assert last.algbw_bytes_per_s == pytest.approx(22.86e9) and last.busbw_bytes_per_s == pytest.approx(40.00e9)


def test_json_sample_matches_text():
    js, tx = read_nccl_tests(JSON), read_nccl_tests(TXT)
    assert len(js) == len(tx) == 62
    assert {(r.op, r.n_ranks) for r in js} == {("all-reduce", 8)}  # 8 devices x nthreads 1 x ngpus 1
    for a, b in zip(js, tx):
        assert a.size_bytes == b.size_bytes and a.in_place == b.in_place
        assert a.time_s == pytest.approx(b.time_s, rel=2e-3, abs=6e-9)  # text rounds to 0.01 us


@pytest.mark.parametrize("path", [TXT, JSON])
def test_fit_recovers_alpha_beta(path):
    fit = fit_alpha_beta(read_nccl_tests(path), "nic")
    assert fit.latency_s == pytest.approx(20e-6, rel=0.01)
    assert fit.bandwidth_bytes_per_s == pytest.approx(40e9, rel=0.01)
    assert fit.rms_residual < 1e-3 and fit.points == 62 and not fit.clamped
    assert fit.predict(2**30) == pytest.approx(20e-6 + 1.75 * 2**30 / 40e9, rel=0.01)


def test_fit_all_gather_16_ranks_synthesized():
    hosts = [f"gpu{k}" for k in range(16)]
    text = nccl_tests_text("all_gather_perf", hosts, [2**k for k in range(10, 31)], 35e-6, 360e9)
    rows = parse_nccl_tests_text(text)
    assert rows[0].op == "all-gather" and rows[0].n_ranks == 16
    fit = fit_alpha_beta(rows, "nvlink")
    assert fit.latency_s == pytest.approx(35e-6, rel=0.01)
    assert fit.bandwidth_bytes_per_s == pytest.approx(360e9, rel=0.01)


def test_negative_alpha_is_clamped():
    rows = [BenchRow("all-reduce", 2, s, s / 10e9 - 1e-6, 0, 0) for s in (2**20, 2**24, 2**28)]
    fit = fit_alpha_beta(rows, "pcie")
    assert fit.clamped and fit.latency_s == 0.0
    assert fit.bandwidth_bytes_per_s == pytest.approx(10e9, rel=0.01)


@pytest.mark.parametrize("rows, words", [
    ([BenchRow("all-reduce", 8, 8, 1e-5, 0, 0)], "measure at least two sizes"),
    ([BenchRow("all-reduce", 8, 8, 2e-5, 0, 0), BenchRow("all-reduce", 8, 16, 1e-5, 0, 0)], "does not grow"),
    ([BenchRow("all-reduce", 8, 8, 2e-5, 0, 0), BenchRow("all-gather", 8, 16, 3e-5, 0, 0)], "one (op, ranks)"),
])
def test_fit_errors(rows, words):
    with pytest.raises(ConfigError) as err:
        fit_alpha_beta(rows, "nic")
    assert words in str(err.value)
    with pytest.raises(ConfigError, match="unknown link class 'ib'"):
        fit_alpha_beta(rows, "ib")


def test_text_errors():
    text = TXT.read_text()
    lines = text.splitlines()
    assert lines[19].split()[0] == "16"
    lines[19] = "          16             4     float     sum      -1"
    with pytest.raises(ConfigError, match=r"^short.txt:20: 5 fields for 13 columns"):
        parse_nccl_tests_text("\n".join(lines), source="short.txt")
    # without the banner (nccl-tests before dafb704, 2025-06): the rows tell all_reduce (sum, -1, 2 x 7/8 = 1.75)
    no_banner = text.replace("# Collective test starting: all_reduce_perf", "#")
    assert parse_nccl_tests_text(no_banner) == parse_nccl_tests_text(text)
    assert parse_nccl_tests_text(no_banner, op="all-reduce")
    with pytest.raises(ConfigError, match="busbw/algbw = 1.750 but all-reduce over 4 ranks gives 1.500"):
        parse_nccl_tests_text(text, n_ranks=4)
    with pytest.raises(ConfigError, match="not one meshplan models"):
        parse_nccl_tests_text(text.replace("all_reduce_perf", "hypercube_perf"))


def test_json_errors():
    with pytest.raises(ConfigError, match=r"bad.json:1: invalid JSON"):
        parse_nccl_tests_json("{", source="bad.json")
    with pytest.raises(ConfigError, match=r"results\[0\].out_of_place: needs numeric"):
        parse_nccl_tests_json('{"args": ["all_reduce_perf"], "config": {"devices": [1, 2]}, '
                              '"results": [{"size": 8, "out_of_place": {"time": "x"}}]}')


# --------------------------------------------------------------------------- file + apply


def test_toml_round_trip_and_apply(tmp_path):
    fit = fit_alpha_beta(read_nccl_tests(TXT), "nic")
    nv = fit_alpha_beta([BenchRow("all-reduce", 8, s, 15e-6 + 1.75 * s / 370e9, 0, 0) for s in (8, 2**20, 2**30)],
                        "nvlink")
    path = tmp_path / "calib.toml"
    path.write_text(calibration_toml([fit, nv], "nccl-tests all_reduce_perf 2026-03-02, 8 nodes x 1 GPU"))
    calib = load_calibration(path)
    assert set(calib) == {"nic", "nvlink"}
    nic = calib["nic"]
    assert nic.latency_us == pytest.approx(20.0, rel=0.01) and nic.bandwidth_gb_per_s == pytest.approx(40.0, rel=0.01)
    assert (nic.op, nic.ranks, nic.points) == ("all-reduce", 8, 62)
    assert nic.step_latency_us == pytest.approx(20.0 / 14, rel=0.01)  # ring all-reduce over 8: 2(8-1) steps

    base = system("dgx-h100", nodes=2)
    new = apply_calibration(base, calib)
    assert new is not base and base.node.fabric.bandwidth_gb_per_s == 450.0  # the input is unchanged
    assert new.node.fabric.bandwidth_gb_per_s == pytest.approx(370.0, rel=1e-3)
    assert new.node.fabric.latency_us == pytest.approx(15.0 / 14, rel=1e-3)
    assert new.node.pcie == base.node.pcie
    assert [n.rate_gbit_per_s for n in new.node.nics] == [pytest.approx(320.0, rel=0.01)] * 8  # 40 GB/s x 8
    assert [t.latency_us for t in new.network] == [pytest.approx(20.0 / 14, rel=0.01)] * len(base.network)
    assert [n.name for n in new.node.nics] == [n.name for n in base.node.nics]
    assert "calibrated" in new.node.fabric.source and "nccl-tests" in new.source


CAL = "--calibration: c.toml"  # the option and the file, each once


@pytest.mark.parametrize("text, where", [
    ("[link.ib]\nlatency_us = 1\nbandwidth_gb_per_s = 1\nsource = 'x'\n", f"{CAL}: link.ib"),
    ("[link.nic]\nlatency_us = 1\nbandwidth_gb_per_s = 0\nsource = 'x'\n", f"{CAL}: link.nic.bandwidth_gb_per_s"),
    ("[link.nic]\nlatency_us = 1\nbandwidth_gb_per_s = 1\nsource = 'x'\nspeed = 3\n", f"{CAL}: link.nic.speed"),
    ("[link.nic]\nlatency_us = 1\nbandwidth_gb_per_s = 1\n", f"{CAL}: link.nic.source"),
    ("[link.nic]\nlatency_us = 1\nbandwidth_gb_per_s = 1\nsource = 'x'\nop = 'allreduce'\n", f"{CAL}: link.nic.op"),
    ("[nic]\nlatency_us = 1\n", CAL),
    ("[link.nic\n", "--calibration"),
])
def test_calibration_file_errors(tmp_path, text, where):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_calibration(path)
    assert err.value.field == where and "\n" not in str(err.value) and str(err.value).count("c.toml") == 1


# --------------------------------------------------------------------------- calibrated links are never beaten


def _calibrated_h100(nodes: int = 1):
    """dgx-h100 with the newcomer's fit: nvlink all-reduce over 8 ranks, alpha 28.0 us per call,
    busbw 424.4 GB/s (nccl-tests max 437 GB/s in the fitted log)."""
    link = CalibratedLink(latency_us=28.0, bandwidth_gb_per_s=424.4, op="all-reduce", ranks=8, source="made up")
    nic = CalibratedLink(latency_us=42.0, bandwidth_gb_per_s=40.0, op="all-reduce", ranks=2, source="made up")
    return apply_calibration(system("dgx-h100", nodes=nodes), {"nvlink": link, "nic": nic})


def _path(cluster, shape, names=("outer", "axis")):
    from meshplan.comm.row import axis_path
    from meshplan.mesh.resolve import resolved_mesh
    from meshplan.placement.assign import place
    from meshplan.spec.mesh import MeshSpec
    mesh = resolved_mesh(MeshSpec(names=list(names), shape=shape), cluster.world)
    return axis_path(mesh, place(cluster, cluster.world), cluster, "axis")


def test_calibrated_nvlink_is_the_fit_at_the_measured_op_and_ranks():
    from meshplan.comm.row import path_time
    cluster = _calibrated_h100()
    path = _path(cluster, [1, 8])
    assert (path.kind, path.calibrated) == ("nvlink", True)
    # 16 KiB tp all-reduce: 28.0 us + 1.75 * 16384 B / 424.4 GB/s = 28.0 + 0.0676 = 28.0676 us
    # (before: NCCL's LL base 6.6 us + 14 steps x 0.6 us x (2.0 / 3.4) = 11.5 us, below the fit)
    alg, t = path_time("all-reduce", 8, 16384, path, cluster)
    assert alg == "ring" and t * 1e6 == pytest.approx(28.0676, abs=1e-4)
    # 16 GB all-reduce: 28 us + 1.75 * 16e9 / 424.4e9 = 65.9755 ms, busbw 424.22 GB/s: no NVLS
    # (uncalibrated dgx-h100 picks NVLS at ~480 GB/s, more than the log ever measured)
    alg, t = path_time("all-reduce", 8, 16e9, path, cluster)
    assert alg == "ring" and t * 1e3 == pytest.approx(66.0035, abs=1e-3)
    assert 1.75 * 16e9 / t / 1e9 == pytest.approx(424.22, abs=0.01)
    # another rank count: alpha per step 28 / 14 = 2 us; all-reduce over 4 ranks, 6 steps:
    # 12 us + 1.5 * 1 MB / 424.4 GB/s = 12 + 3.5344 = 15.5344 us. (It read an all-gather over 4 ranks,
    # 6 + 0.75 * 1 MB / 424.4 GB/s = 7.7672 us, until an all-reduce fit on an NVLS node stopped setting
    # the ring's all-gather: tests/test_calibrate_nvlink_ops.py)
    path4 = _path(cluster, [2, 4])
    assert path_time("all-reduce", 4, 1e6, path4, cluster)[1] * 1e6 == pytest.approx(15.5344, abs=1e-4)


def test_calibrated_nic_has_no_tree_below_its_fit():
    from meshplan.comm.row import path_time
    cluster = _calibrated_h100(nodes=2)
    path = _path(cluster, [2, 8], ("axis", "inner"))  # one rank per node: the fitted configuration
    assert (path.kind, path.calibrated, path.ranks_per_node) == ("network", True, 1)
    # all-reduce over 2 nodes, 8 KB: alpha 42 us (2 steps of 21 us) + 1.0 * 8000 / 40e9 = 42.2 us;
    # NCCL's tree would have given 2 steps of its own latency, below the fitted 42 us
    alg, t = path_time("all-reduce", 2, 8000, path, cluster)
    assert alg == "ring" and t * 1e6 == pytest.approx(42.2, abs=1e-6)


def test_no_banner_the_rows_tell_the_collective_or_say_what_is_missing():
    """nccl-tests prints the same column header for every program (NVIDIA/nccl-tests src/util.cu
    at a0b82b2: size count type redop root ...), and the '# Collective test starting' banner only
    since dafb704 (2025-06-03). Without it the rows decide: all_gather over 8 ranks prints redop
    none, root -1 and busbw/algbw 7/8 = 0.875, as alltoall does, so it is refused naming both;
    all_reduce (sum, 1.75) is read."""
    sizes = [2 ** k for k in range(10, 31)]
    hosts = [f"node{i:02d}" for i in range(8)]
    ag = nccl_tests_text("all_gather_perf", hosts, sizes, 20e-6, 40e9).replace(
        "# Collective test starting: all_gather_perf\n", "")
    with pytest.raises(ConfigError) as err:
        parse_nccl_tests_text(ag, source="ag.txt")
    assert str(err.value) == ("ag.txt: no '# Collective test starting' line (e.g. '# Collective test starting: "
                              "all_reduce_perf'; nccl-tests prints it since 2025-06, NVIDIA/nccl-tests dafb704); its "
                              "rows (redop none, root -1, busbw/algbw 0.875 over 8 ranks) fit all_gather_perf and "
                              "alltoall_perf alike; name the test that wrote it: ag.txt:all_gather or ag.txt:alltoall for "
                              "this file alone, or --op (e.g. --op alltoall) for every such log; each reads the log "
                              "of every nccl-tests version")  # FILE:op since nc34 #6
    ar = nccl_tests_text("all_reduce_perf", hosts, sizes, 20e-6, 40e9)
    rows = parse_nccl_tests_text(ar.replace("# Collective test starting: all_reduce_perf\n", ""))
    assert rows == parse_nccl_tests_text(ar) and {r.op for r in rows} == {"all-reduce"}


def test_step_says_which_links_are_uncalibrated(capsys):
    """Issue 11 item 2: mi300x-azure-nd-v5 has no published rccl-tests curve, so step says its
    Infinity Fabric (448 GB/s) and NICs (400 Gb/s) run at line rate; dgx-b200 now has S16's
    NVLink5 curves and only its NICs are named; dgx-a100 (S15, S18 curves) has no note."""
    from meshplan.catalog import system
    from meshplan.comm.calibration_notes import uncalibrated_note
    assert uncalibrated_note(system("dgx-a100", nodes=2)) is None
    assert uncalibrated_note(system("dgx-b200", nodes=1)) is None
    assert uncalibrated_note(system("dgx-b200", nodes=2)).startswith("note: links uncalibrated: dgx-b200 NIC "
                                                                      "(400 Gb/s) has no measured busbw curve")
    rc, out, _ = run_cli(["step", "examples/torchtitan_llama3-8b_8xh100.toml", "--cluster", "mi300x-azure-nd-v5",
                          "--nodes", "1"], capsys)
    assert rc == 0
    assert ("note: links uncalibrated: mi300x-azure-nd-v5 infinity-fabric-mesh (448 GB/s) has no measured busbw "
            "curve in the catalog") in out
