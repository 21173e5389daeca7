"""``meshplan calibrate --link nic`` with two ring runs of different ops and node counts (newcomer
trial 51 #3: tests/data/nc52a/all_gather_4node_roce.txt, all_gather_perf over 4 hosts x 8 H200 on
RoCE, and all_reduce_2node_roce.txt, all_reduce_perf over 2 x 8; both written by the trial's
generator at about 290 and 300 GB/s busbw). NCCL runs the three ring ops on one ring and nccl-tests
doc/PERFORMANCE.md defines one busbw for them, so the nic class keeps one fit for the three: the
all-reduce's where there is one (bench comm's rule), whatever the order of the files. The output
named only the kept file's 'this file sets' line: which fit set the all-gather was not said, nor
that the all-gather's curve, written to the file, times nothing. Now a 'nic: kept ...; dropped
...' line names both with their fitted busbw per NIC and their difference."""

from __future__ import annotations

from meshplan.comm.calibration import load_calibration
from tests.cli_run import run_cli
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data" / "nc52a"
AG, AR = DATA / "all_gather_4node_roce.txt", DATA / "all_reduce_2node_roce.txt"


def test_the_kept_ring_fit_is_named_with_both_busbw_in_either_order(tmp_path, capsys):
    """Per-file fits, as calibrate prints them: all-gather 290.73 GB/s busbw over 32 ranks, 8 a host,
    so 290.73 / 8 = 36.34 GB/s per NIC; all-reduce 298.52 / 8 = 37.32 GB/s per NIC. The all-reduce
    is kept (the all-gather is slower by 290.73 / 298.52 - 1 = -2.6%, but the all-reduce fit wins
    where there is one), in both orders, and the two files written are the same bytes."""
    lines = {}
    for name, files in (("ag_ar", (AG, AR)), ("ar_ag", (AR, AG))):
        rc, out, err = run_cli(["calibrate", "--link", "nic", *files, "--out", tmp_path / f"{name}.toml"], capsys)
        assert rc == 0, err
        (lines[name],) = [x for x in out.splitlines() if x.startswith("nic: kept")]
    assert lines["ag_ar"] == lines["ar_ag"] == (
        "nic: kept all_reduce_2node_roce.txt (all-reduce over 16 ranks on 2 hosts, 37.32 GB/s per NIC); dropped "
        "all_gather_4node_roce.txt (all-gather over 32 ranks on 4 hosts, 36.34 GB/s per NIC: the all-reduce fit is "
        "kept where there is one, as bench comm does; -2.6% against it; NCCL runs the three ring ops on one ring, one "
        "busbw (nccl-tests doc/PERFORMANCE.md), so one fit times them: its curve is written to the file but times "
        "nothing: all_reduce_2node_roce.txt's fit and curve time all-reduce, all-gather and reduce-scatter across "
        "nodes; to time them from all_gather_4node_roce.txt, pass it without all_reduce_2node_roce.txt)")
    assert (tmp_path / "ag_ar.toml").read_bytes() == (tmp_path / "ar_ag.toml").read_bytes()
    nic = load_calibration(tmp_path / "ag_ar.toml")["nic"]
    assert (nic.op, nic.ranks, nic.bandwidth_gb_per_s) == ("all-reduce", 16, 37.32)
    assert [(c.op, c.ranks, c.nodes) for c in nic.curve] == [("all-reduce", 16, 2), ("all-gather", 32, 4)]


def test_the_all_gather_alone_sets_the_ring_ops(tmp_path, capsys):
    """What the line tells the user to do: the all-gather log alone is the nic fit (36.34 GB/s per NIC)
    and sets the three ring ops; one run, no 'kept' line."""
    rc, out, err = run_cli(["calibrate", "--link", "nic", AG, "--out", tmp_path / "ag.toml"], capsys)
    assert rc == 0, err
    assert not [x for x in out.splitlines() if x.startswith("nic: kept")]
    assert any(x.startswith("nic: this file sets, across nodes, all-reduce, all-gather and reduce-scatter (the "
                            "all-gather fit over 32 ranks") for x in out.splitlines())
    nic = load_calibration(tmp_path / "ag.toml")["nic"]
    assert (nic.op, nic.bandwidth_gb_per_s) == ("all-gather", 36.34)
