"""Newcomer trial 54 (a performance engineer calibrating on a 32 x 8 H100 RoCE cluster), the
calibration findings 1, 5, 6 and 7.

Fixtures: tests/data/nc54/, copied from the trial (/work/nc54/mine): nccl-tests 2.17.6-format logs
of a 2 x 8 H100 run (all_reduce_2n.txt, all_gather_2n.txt), bad_gbit_ar_2n.txt (all_reduce_2n.txt
with its algbw and busbw columns x 8: Gb/s written as GB/s, sizes and times unchanged),
bad_ar_header_ag_rows_2n.txt (an all_reduce_perf banner over all_gather_perf rows), calib.toml (the
trial's calibration of its good logs: nic 41.38 GB/s per NIC), o_bad_gbit_ar_2n.toml (what calibrate
wrote from bad_gbit_ar_2n.txt before this fix: its curve from the x8 busbw column), job70b.toml
(dgx-h100, [cluster] nic = roce at 400 Gb/s) and bad_units_nic50.toml (the same at 50 Gb/s: GB/s
typed in the Gb/s field)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.comm.nccl_rows import row_error
from meshplan.comm.nccl_tests import read_nccl_tests
from meshplan.errors import ConfigError
from tests.cli_run import run_cli

D = Path(__file__).parent / "data" / "nc54"


def test_a_log_with_bandwidth_columns_x8_is_refused_naming_its_row(tmp_path, capsys):
    """nccl-tests prints algbw = size / time and busbw = algbw x 2(n-1)/n from the time it prints
    (src/common.cu BenchTime, doc/PERFORMANCE.md). bad_gbit_ar_2n.txt's last row (line 56, 8 GiB,
    in-place): 8589934592 B / 47679 us = 180.16 GB/s, printed algbw 1441.28 = 8.00 x that; busbw
    180.16 x 1.875 (16 ranks) = 337.80, printed 2702.40. The trial's calibrate wrote a curve from the
    busbw column (334.94 GB/s per NIC on 50 GB/s NICs) with rc 0; now one line, exit 2, nothing written."""
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", D / "bad_gbit_ar_2n.txt", "--link", "nic", "--out", out], capsys)
    assert rc == 2 and not out.exists() and len(err.strip().splitlines()) == 1
    assert err.startswith("error: bad_gbit_ar_2n.txt:56: algbw 1441.28 GB/s is 8.00x size / time (8.00 GiB / "
                          "47679 us = 180.16 GB/s; busbw 2702.40 GB/s against 337.80")
    assert "an 8x gap is Gb/s written in nccl-tests' GB/s columns" in err
    rows = read_nccl_tests(D / "all_reduce_2n.txt")  # the log it came from reads: every row agrees
    last = rows[-1]  # its 8 GiB in-place row: 2702.40 / 8 = 337.80 GB/s busbw, 8589934592 B in 47679 us
    assert len(rows) == 62 and last.busbw_bytes_per_s == pytest.approx(337.80e9)
    assert last.size_bytes / last.time_s * 1.875 == pytest.approx(337.80e9, rel=1e-3)


def test_a_busbw_column_edited_alone_is_named_too():
    """A row whose algbw is size / time but whose busbw is not algbw x factor: the 8 GiB row of
    all_reduce_2n.txt, 8589934592 B / 48087 us = 178.63 GB/s algbw, busbw 178.63 x 1.875 = 334.94;
    printed as 669.88 (x 2) it is named as busbw, 2.00x; the row as printed (334.94) passes; a 1 us row
    of 8 B (0.008 GB/s) printed 0.00 / 0.01 passes (the 0.01 GB/s rounding slack)."""
    why, ratio = row_error(8589934592, 48087e-6, 178.63e9, 669.88e9, "all-reduce", 16)
    assert why.startswith("busbw 669.88 GB/s is 2.00x size / time x factor") and ratio == pytest.approx(2.0, abs=1e-3)
    assert row_error(8589934592, 48087e-6, 178.63e9, 334.94e9, "all-reduce", 16) is None
    assert row_error(8, 1e-6, 0.0, 0.01e9, "all-reduce", 16) is None


def test_a_banner_over_another_tests_rows_names_the_test_they_fit():
    """bad_ar_header_ag_rows_2n.txt: banner all_reduce_perf, rows redop none, root -1 and busbw /
    algbw 0.938 = 15/16 = (n-1)/n over 16 ranks: all_gather_perf's or alltoall_perf's, where
    all_reduce's is 2 x 15/16 = 1.875. The error once blamed the rank count."""
    with pytest.raises(ConfigError) as err:
        read_nccl_tests(D / "bad_ar_header_ag_rows_2n.txt")
    assert str(err.value) == ("bad_ar_header_ag_rows_2n.txt: its banner names all_reduce_perf, but its rows (redop "
                              "none, root -1, busbw/algbw 0.938 over 16 ranks) fit all_gather_perf or alltoall_perf: "
                              "the banner and the rows are of two runs; pass the whole output of one nccl-tests run, "
                              "unmodified")


def test_file_test_on_a_log_with_its_banner(tmp_path, capsys):
    """FILE:TEST is for a log without the '# Collective test starting' line. all_gather_2n.txt names
    all_gather_perf: ':reduce_scatter' conflicts (exit 2, one line naming FILE:TEST), ':all_gather'
    is noted as not used and the file is read as before (all-gather over 16 ranks)."""
    out = tmp_path / "c.toml"
    rc, _, err = run_cli(["calibrate", f"{D / 'all_gather_2n.txt'}:reduce_scatter", "--link", "nic", "--out", out],
                         capsys)
    assert rc == 2 and not out.exists()
    assert err.strip() == ("error: all_gather_2n.txt:reduce_scatter: the log names all_gather_perf in its '# "
                           "Collective test starting' line (or -J JSON's args), which reads it; FILE:TEST is for a "
                           "log without that line: drop ':reduce_scatter'")
    rc, text, _ = run_cli(["calibrate", f"{D / 'all_gather_2n.txt'}:all_gather", "--link", "nic", "--out", out], capsys)
    assert rc == 0 and out.exists()
    assert text.splitlines()[0] == ("all_gather_2n.txt:all_gather: not used: the log names its test (all_gather_perf) "
                                    "in its '# Collective test starting' line (or -J JSON's args), which reads it")
    assert "nic all-gather over 16 ranks" in text


def test_a_nic_rate_typed_in_gb_per_s_is_warned_and_read_with_the_calibration(capsys):
    """bad_units_nic50.toml: rate_gbit_per_s 50 on dgx-h100, whose catalog NICs are 400 Gb/s: 50 x 8 =
    400, the GB/s slip, warned naming the field's unit. With calib.toml (nic 41.38 GB/s per NIC): 41.38
    x 8 / 50 = 6.6x the config's line rate, warned (the trial saw none: the check read the catalog's 400
    Gb/s); the replaced line reads the catalog curve against the config's 6.25 GB/s: 376 of 400 GB/s at
    8 GiB (ib-ndr-400-8nic) x 6.25 = 5.875 -> 5.88, 'line rate 6.25'. job70b.toml (400 Gb/s) gets
    neither warning and keeps 'catalog 47.00 (... line rate 50)' (376 / 8)."""
    rc, text, err = run_cli(["plan", D / "bad_units_nic50.toml", "--calibration", D / "calib.toml"], capsys)
    both = text + err
    assert ("warning: cluster.nic: rate_gbit_per_s 50 Gb/s (6.25 GB/s per NIC) is 1/8 of dgx-h100's catalog NICs "
            "(400 Gb/s): the field is in gigabits per second, and 50 GB/s is 400 Gb/s") in both
    assert ("nic 41.38 GB/s per NIC is 6.6x the 50 Gb/s line rate of dgx-h100's NICs as the config's [cluster] nic "
            "sets them (catalog 400 Gb/s): it holds several NICs' traffic, or that rate is not the NICs'; check "
            "[cluster] nic's rate_gbit_per_s, in gigabits per second (400 Gb/s = 50 GB/s)") in both
    assert ("catalog 5.88 (ib-ndr-400-8nic at 8.00 GiB; line rate 6.25 = the config's 50 Gb/s NICs, not the "
            "catalog's 400 Gb/s)") in both
    rc, text, err = run_cli(["plan", D / "job70b.toml", "--calibration", D / "calib.toml"], capsys)
    assert "line rate of dgx-h100's NICs" not in text + err
    assert "catalog 47.00 (ib-ndr-400-8nic at 8.00 GiB; line rate 50)" in text + err
    assert "cluster.nic: rate_gbit_per_s" not in text + err


def test_a_curve_point_above_the_line_rate_is_warned_when_the_fit_is_not(capsys):
    """o_bad_gbit_ar_2n.toml (calibrate's output from the x8 log before the refusal): its fit 42.43 GB/s
    per NIC (339.45 / 8, from the time column) is under the 50 GB/s of a 400 Gb/s NIC, but its curve,
    from the busbw column, logs 2708.56 GB/s at 1 GiB (its highest: line 53's slower, out-of-place column,
    beside 2729.68 in place) = 338.57 per NIC over the
    8 NICs of a 2 x 8 run; 14 of its 27 points (411.84 at 1 MiB and up, 2^20..2^33 B) pass 8 x 50 = 400 GB/s busbw."""
    rc, text, err = run_cli(["plan", D / "job70b.toml", "--calibration", D / "o_bad_gbit_ar_2n.toml"], capsys)
    line = next(x for x in (text + err).splitlines() if "curve reaches" in x)
    assert line.startswith("warning: --calibration ") and line.split(": nic ")[1].startswith(
        "all-reduce curve reaches 338.57 GB/s per NIC at 1.00 GiB (busbw 2708.56 over 8 NICs; 14 of its 27 points "
        "above the line), above the 400 Gb/s line rate of dgx-h100's NICs, which a NIC cannot pass")


def test_calibrate_warns_a_curve_point_above_the_line_rate(tmp_path, capsys):
    """all_reduce_2n.txt with its 1 GiB row (line 53) at 4793.5 us both ways, consistent as nccl-tests
    prints it: 1073741824 B / 4793.5 us = 224.00 GB/s algbw, x 1.875 = 420.00 busbw; over 8 NICs per host
    52.50 GB/s per NIC, above the 50 GB/s of dgx-h100's 400 Gb/s NICs (the fastest catalog NIC of an H100),
    while the fit (one row of 62 moved) stays under it: warned, the file written."""
    lines = (D / "all_reduce_2n.txt").read_text().splitlines(keepends=True)
    size, count = lines[52].split()[:2]
    assert size == "1073741824"
    lines[52] = (f"{size:>12}  {count:>12}     float     sum      -1   4793.5  224.00  420.00      0   4793.5  224.00  "
                 "420.00      0\n")
    log = tmp_path / "ar_fast_1g.txt"
    log.write_text("".join(lines))
    rc, text, err = run_cli(["calibrate", log, "--link", "nic", "--out", tmp_path / "c.toml"], capsys)
    assert rc == 0, err
    assert ("warning: ar_fast_1g.txt: its nic curve reaches 52.50 GB/s per NIC (busbw 420.00 / 8 NICs), above the "
            "50 GB/s line rate of dgx-h100's NICs (400 Gb/s), which a NIC cannot pass; check that size's row"
            ) in text.splitlines()
