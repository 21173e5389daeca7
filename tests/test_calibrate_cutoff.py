"""``meshplan calibrate`` on an nccl-tests log cut off at a row boundary (newcomer 25, item 1).

Fixtures: tests/data/nccl/all_reduce_perf_2x8h100_cut16k.txt and _cut64m.txt, the 2 x 8 H100
sample (t = 30 us + 1.875 S / 360 GB/s) without its trailer, cut after the 16 KiB and the
64 MiB rows (tests/data/nccl/README.md)."""

from __future__ import annotations

import re

import pytest

from meshplan.comm.calibration import load_calibration
from meshplan.comm.linkfit import LinkFit, bandwidth_bound_bytes, latency_bound_reason
from nccl_published import DATA
from tests.cli_run import run_cli

FULL = DATA / "all_reduce_perf_2x8h100.txt"
CUT16K = DATA / "all_reduce_perf_2x8h100_cut16k.txt"
CUT64M = DATA / "all_reduce_perf_2x8h100_cut64m.txt"


def test_the_bandwidth_bound_size_is_alpha_beta_over_the_bus_factor():
    """The sample's true line: 30 us x 360 GB/s / (2 x 15 / 16) = 5,760,000 B (5.49 MiB); the
    bound is tight: a largest size of exactly that sets beta, one byte less does not."""
    fit = LinkFit("nic", "all-reduce", 16, 30e-6, 360e9, 0.0, 0.0, 10)
    assert bandwidth_bound_bytes(fit) == pytest.approx(5_760_000)
    assert latency_bound_reason(fit, 5_760_000) is None
    assert latency_bound_reason(fit, 5_759_999).startswith("its largest size 5.49 MiB is below 5.49 MiB")
    clamped = LinkFit("nic", "all-reduce", 16, 0.0, 360e9, 0.0, 0.0, 10)  # alpha 0: every size sets beta
    assert bandwidth_bound_bytes(clamped) == 0 and latency_bound_reason(clamped, 1024) is None


def test_a_log_cut_at_16k_does_not_set_beta(tmp_path, capsys):
    """Ten rows of 1-16 KiB (30.01-30.09 us) fitted beta ~350 GB/s from latency alone and were
    written; now refused in one line naming the file, the size it stops at, the bound from its
    own fit and the fix, and nothing is written."""
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", CUT16K, "--link", "nic", "--out", out], capsys)
    assert rc == 2 and not out.exists() and len(err.strip().splitlines()) == 1
    line = err.strip()
    assert line.startswith("error: all_reduce_perf_2x8h100_cut16k.txt: its largest size 16.00 KiB is below ")
    assert line.endswith("(the log has no nccl-tests trailer line: cut off); pass the whole output, or rerun "
                         "nccl-tests up to 1 GiB or more (-e 1G)")
    bound, alpha, beta = re.search(r"below ([0-9.]+) MiB = alpha ([0-9.]+) us x beta ([0-9.]+) GB/s / 1.875",
                                   line).groups()
    assert float(bound) == pytest.approx(float(alpha) * 1e-6 * float(beta) * 1e9 / 1.875 / 2**20, abs=0.01)
    assert float(alpha) == pytest.approx(30.0, abs=0.1)  # the rows' 30.01-30.09 us


def test_a_cut_log_beside_a_whole_one_is_left_out(tmp_path, capsys):
    """With the whole log given too, the cut one is named as not used and the class keeps the
    whole log's 360 / 8 = 45 GB/s per NIC, its curve alone."""
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", CUT16K, FULL, "--link", "nic", "--out", out], capsys)
    assert rc == 0, err
    assert any(ln.startswith("all_reduce_perf_2x8h100_cut16k.txt: not used: its largest size 16.00 KiB is below ")
               for ln in text.splitlines())
    nic = load_calibration(out)["nic"]
    assert nic.bandwidth_gb_per_s == pytest.approx(45.0, rel=1e-3)
    assert [c.source.rsplit("file ", 1)[1] for c in nic.curve] == ["all_reduce_perf_2x8h100.txt"]


def test_a_log_cut_past_the_bound_is_warned_and_used(tmp_path, capsys):
    """Cut after 64 MiB (above the 5.49 MiB bound): the fit stands (45 GB/s per NIC), and one
    warning line names the file, where it stops and the 8 GiB its header asked for."""
    out = tmp_path / "c.toml"
    rc, text, err = run_cli(["calibrate", CUT64M, "--link", "nic", "--out", out], capsys)
    assert rc == 0, err
    assert ("warning: all_reduce_perf_2x8h100_cut64m.txt: no '# Avg bus bandwidth' or '# Collective test concluded' "
            "line, which nccl-tests prints after its last row, so the log was cut off after its 64.00 MiB row of the "
            "8.00 GiB its header's maxBytes names; pass the whole output of the run") in text.splitlines()
    assert load_calibration(out)["nic"].bandwidth_gb_per_s == pytest.approx(45.0, rel=1e-3)


def test_a_whole_log_has_no_cut_warning(tmp_path, capsys):
    rc, text, err = run_cli(["calibrate", FULL, "--link", "nic", "--out", tmp_path / "c.toml"], capsys)
    assert rc == 0 and "cut off" not in text and "not used" not in text
