"""``meshplan calibrate --link nic --nics-per-host N`` / ``--system NODE``: a multi-rank-per-host
nccl-tests run's busbw split over the NICs its hosts' ranks drove, not one per rank.

The logs are written by hand with :func:`test_calibration.nccl_tests_text`: an all-reduce at
exactly t = 30 us + busbw_factor x S / 80 GB/s, 1 KiB to 1 GiB, so every fit below is alpha
30 us, busbw 80 GB/s. Per NIC, by hand: 80 / 8 = 10 GB/s (one NIC per rank, 8 ranks per host),
80 / 4 = 20 (--nics-per-host 4), 80 / 2 = 40 (seed-8x8-2nic's 2 NICs), 80 / 1 = 80 (above a
400 Gb/s = 50 GB/s NIC's line rate). The curve is read against the node's rate: 80 GB/s."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.comm.calibration import load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from tests.cli_run import run_cli
from tests.test_calibrate_cli import DATA
from tests.test_calibration import nccl_tests_text
from tests.test_cli_json import H100X2

SIZES = [2 ** k for k in range(10, 31)]


def _log(tmp_path, hosts: int, per_host: int, name: str = "x.txt"):
    """The hand-written log: ``hosts`` hosts of ``per_host`` H100 ranks each, busbw 80 GB/s."""
    path = tmp_path / name
    names = [f"node{h:02d}" for h in range(hosts) for _ in range(per_host)]
    path.write_text(nccl_tests_text("all_reduce_perf", names, SIZES, 30e-6, 80e9))
    return path


def _warnings(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("warning:")]


def _calibrate(capsys, log, out, *opts):
    return run_cli(["calibrate", str(log), "--link", "nic", "--out", str(out), *opts], capsys)


def test_nics_per_host_divides_the_busbw_by_the_given_nics(tmp_path, capsys):
    out = tmp_path / "c.toml"
    rc, text, err = _calibrate(capsys, _log(tmp_path, 2, 8), out, "--nics-per-host", "4")
    assert rc == 0, err
    assert ("x.txt: 8 ranks per host over 4 NICs (--nics-per-host): nic all-reduce 20.00 GB/s per NIC = 80.00 / 4"
            in text.splitlines()) and not _warnings(text)  # 20 GB/s is under a 400G NIC's 50
    nic = load_calibration(out)["nic"]
    assert (nic.bandwidth_gb_per_s, nic.nics_per_node) == (pytest.approx(20.0, rel=1e-3), 4)
    assert nic.latency_us == pytest.approx(30.0, rel=1e-2)
    assert nic.fitted_curve().line_gb_per_s is None and "line_gb_per_s" not in out.read_text()  # set when applied
    # applied to 2 DGX H100: every NIC at 20 x 8 = 160 Gb/s, the curve read against the run's 4 NICs
    # (4 x 20 = 80 GB/s; one per rank would have read it against 8 x 20 = 160)
    cluster = apply_calibration(system("dgx-h100", nodes=2), load_calibration(out))
    assert [n.rate_gbit_per_s for n in cluster.node.nics] == [pytest.approx(160.0, rel=1e-3)] * 8
    assert cluster.node.busbw["nic"].line_gb_per_s == pytest.approx(80.0, rel=1e-3)
    # step on 2 DGX H100 (8 NICs per node) names the file's 4
    cfg = tmp_path / "h100x2.toml"
    cfg.write_text(H100X2)
    rc, text, err = run_cli(["step", str(cfg), "--calibration", str(out)], capsys)
    assert rc == 0 and text.splitlines()[1].startswith("  nic fitted to all-reduce over 16 ranks on 2 nodes: ") \
        and text.splitlines()[2] == (  # under the header and its origin line (words20's 240cc02)
        f"warning: --calibration {out}: nic was split over 4 NICs per node (nics_per_node, of its 8-GPU-per-node "
        "run), but dgx-h100 has 8: its per-NIC figure is not this node's")


def test_one_nic_per_rank_given_writes_what_the_default_writes(tmp_path, capsys):
    log = _log(tmp_path, 2, 8)
    assert _calibrate(capsys, log, tmp_path / "a.toml")[0] == 0
    rc, text, _ = _calibrate(capsys, log, tmp_path / "b.toml", "--nics-per-host", "8")
    assert rc == 0 and (tmp_path / "a.toml").read_text() == (tmp_path / "b.toml").read_text()
    assert "nics_per_node" not in (tmp_path / "a.toml").read_text()
    assert load_calibration(tmp_path / "a.toml")["nic"].bandwidth_gb_per_s == pytest.approx(10.0, rel=1e-3)
    assert ("x.txt: 8 ranks per host over 8 NICs (--nics-per-host): nic all-reduce 10.00 GB/s per NIC = 80.00 / 8"
            in text.splitlines())


def test_system_gives_the_catalog_nodes_nic_count(tmp_path, capsys):
    """seed-8x8-2nic has 2 NICs (nodes.toml): 80 / 2 = 40 GB/s per NIC, under its 50 GB/s
    line rate; step on the seed (the same node) then warns of no split."""
    out = tmp_path / "c.toml"
    rc, text, err = _calibrate(capsys, _log(tmp_path, 2, 8), out, "--system", "seed-8x8-2nic")
    assert rc == 0, err
    assert ("x.txt: 8 ranks per host over 2 NICs (seed-8x8-2nic's, --system): nic all-reduce 40.00 GB/s per NIC "
            "= 80.00 / 2") in text.splitlines() and not _warnings(text)
    nic = load_calibration(out)["nic"]
    assert (nic.bandwidth_gb_per_s, nic.nics_per_node) == (pytest.approx(40.0, rel=1e-3), 2)
    rc, text, _ = run_cli(["step", str(DATA.parents[2] / "examples" / "seed-64gpu.toml"), "--calibration", str(out)],
                      capsys)
    assert rc == 0 and not _warnings(text) and text.splitlines()[0].endswith("nic 40 GB/s")
    # a node with more NICs than the log's ranks per host: one per rank (dgx-h100's 8 for 4 ranks)
    rc, text, err = _calibrate(capsys, _log(tmp_path, 2, 4, "y.txt"), tmp_path / "d.toml", "--system", "dgx-h100")
    assert rc == 0, err
    assert ("y.txt: 4 ranks per host over 4 NICs (4 of dgx-h100's 8, --system: a rank drives one): nic all-reduce "
            "20.00 GB/s per NIC = 80.00 / 4") in text.splitlines()
    assert load_calibration(tmp_path / "d.toml")["nic"].nics_per_node is None  # 4 = one per rank


def test_the_line_rate_warning_compares_the_per_nic_figure(tmp_path, capsys):
    """One NIC per host (--nics-per-host 1, winning over --system's 2): 80 GB/s per NIC, above
    seed-8x8-2nic's 400 Gb/s = 50 GB/s; one per rank (10 GB/s) is not warned."""
    log = _log(tmp_path, 2, 8)
    rc, text, _ = _calibrate(capsys, log, tmp_path / "a.toml", "--nics-per-host", "1", "--system", "seed-8x8-2nic")
    assert rc == 0 and (
        "warning: x.txt: nic 80.00 GB/s per NIC is above the 50 GB/s line rate of seed-8x8-2nic's NICs (400 Gb/s), "
        "the node --system names: a NIC carries at most its line rate, so each host's 8 ranks drove more than 1 NIC "
        "or the nodes' NICs are faster than the catalog's; check --nics-per-host and the hosts of its '#  Rank' "
        "lines") in text.splitlines()
    rc, text, _ = _calibrate(capsys, log, tmp_path / "b.toml")
    assert rc == 0 and not _warnings(text)


@pytest.mark.parametrize("hosts, per_host, opts, line", [
    (2, 8, ["--nics-per-host", "0"], "error: --nics-per-host: 0 NICs per host; give the NICs each host's ranks "
     "drove, a divisor of its ranks per host (they share NICs evenly), or leave it out for one NIC per rank"),
    (2, 8, ["--nics-per-host", "-2"], "error: --nics-per-host: -2 NICs per host; give the NICs each host's ranks "
     "drove, a divisor of its ranks per host (they share NICs evenly), or leave it out for one NIC per rank"),
    (2, 8, ["--nics-per-host", "9"], "error: --nics-per-host: 9 NICs per host, but x.txt ran 8 ranks per host and a "
     "rank drives one NIC; give 1, 2, 4 or 8 (the divisors of 8), or leave it out for one NIC per rank"),
    # 8 ranks cannot share 3 NICs evenly (finding 2 of newcomer trial 13: it was taken, 80 / 3 per NIC)
    (2, 8, ["--nics-per-host", "3"], "error: --nics-per-host: 3 NICs per host, but x.txt ran 8 ranks per host, "
     "which share a host's NICs evenly (8 / 3 is not whole); give 1, 2, 4 or 8 (the divisors of 8), or leave it out "
     "for one NIC per rank"),
    # seed-8x8-2nic's 2 NICs under 3 ranks per host: neither one per rank nor an even share
    (2, 3, ["--system", "seed-8x8-2nic"], "error: --system: the node's 2 NICs, but x.txt ran 3 ranks per host, which "
     "share a host's NICs evenly (3 / 2 is not whole); pass --nics-per-host with 1 or 3 (the divisors of 3), the NICs "
     "each host's ranks drove"),
    (8, 1, ["--nics-per-host", "2"], "error: --nics-per-host: 2 NICs per host, but x.txt ran 1 rank per host and a "
     "rank drives one NIC; give 1, or leave it out for one NIC per rank"),
    (2, 8, ["--system", "dgx-h999"], "error: --system: unknown node 'dgx-h999'; known: dgx-a100, dgx-a100-40gb, dgx-b200, "
     "dgx-h100, dgx-h200, gb200-nvl72-tray, grand-teton-h100, hgx-h800, mi300x-azure-nd-v5, seed-8x8-2nic"),
])
def test_a_bad_nic_count_is_one_line(tmp_path, capsys, hosts, per_host, opts, line):
    out = tmp_path / "c.toml"
    rc, text, err = _calibrate(capsys, _log(tmp_path, hosts, per_host), out, *opts)
    assert (rc, text, err) == (2, "", line + "\n") and not out.exists()


def test_nics_per_host_without_a_nic_run_is_refused(tmp_path, capsys):
    one_host = _log(tmp_path, 1, 8)
    rc, _, err = run_cli(["calibrate", str(one_host), "--nics-per-host", "4", "--out", str(tmp_path / "c.toml")], capsys)
    assert (rc, err) == (2, "error: --nics-per-host: no file is recorded as nic (a run over several hosts, or --link "
                            "nic); drop it, or pass --link nic\n")


def test_both_options_say_which_count_was_used(tmp_path, capsys):
    """--nics-per-host 4 and --system dgx-h100 (8 NICs): split over 4 (80 / 4 = 20 GB/s per NIC),
    and the note names the option that won; dgx-h100's 8 alone would give 80 / 8 = 10."""
    out = tmp_path / "c.toml"
    rc, text, err = _calibrate(capsys, _log(tmp_path, 2, 8), out, "--nics-per-host", "4", "--system", "dgx-h100")
    assert rc == 0, err
    assert ("x.txt: 8 ranks per host over 4 NICs (--nics-per-host, not --system dgx-h100's 8: the explicit option "
            "wins): nic all-reduce 20.00 GB/s per NIC = 80.00 / 4") in text.splitlines()
    assert load_calibration(out)["nic"].bandwidth_gb_per_s == pytest.approx(20.0, rel=1e-3)


def test_a_system_of_another_gpu_is_warned(tmp_path, capsys):
    """The log's ranks name NVIDIA H100 80GB HBM3; dgx-a100 holds a100-sxm-80gb (nodes.toml):
    one warning naming both. seed-8x8-2nic holds H100s: none."""
    log = _log(tmp_path, 2, 8)
    rc, text, err = _calibrate(capsys, log, tmp_path / "a.toml", "--system", "dgx-a100")
    assert rc == 0, err
    assert [w for w in _warnings(text) if "--system" in w] == [
        "warning: --system dgx-a100 holds a100-sxm-80gb GPUs, but the '#  Rank' lines of x.txt name NVIDIA H100 80GB "
        "HBM3: its NIC count and line rate may not be the measured nodes'; pass the catalog node the runs ran on, or "
        "--nics-per-host"]
    rc, text, err = _calibrate(capsys, log, tmp_path / "b.toml", "--system", "seed-8x8-2nic")
    assert rc == 0 and not _warnings(text)


def test_a_run_over_several_hosts_defaults_to_nic(tmp_path, capsys):
    """nc61 #7: an ordinary 2 x 8 all_reduce_perf log without --link was refused (exit 2) until --link nic.
    Its ranks name 2 hosts, so it is read as nic with one line saying so, and gives the same file as
    --link nic: 80 / 8 = 10 GB/s per NIC (one NIC per rank, 8 ranks per host, module docstring)."""
    rc, out, err = run_cli(["calibrate", str(_log(tmp_path, 2, 8)), "--out", str(tmp_path / "c.toml")], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "x.txt: link: nic (ranks on 2 hosts; --link to override)"
    assert "x.txt: 8 ranks per host, each on its own NIC: nic all-reduce 10.00 GB/s per NIC = 80.00 / 8" in lines
    rc, text, err = _calibrate(capsys, _log(tmp_path, 2, 8), tmp_path / "d.toml")
    assert rc == 0 and "link: nic" not in text  # --link given: no default to announce
    assert (tmp_path / "c.toml").read_text() == (tmp_path / "d.toml").read_text()
    # where it stays ambiguous: unequal ranks per host (no one split over a node's NICs)
    path = tmp_path / "u.txt"
    path.write_text(nccl_tests_text("all_reduce_perf", ["a"] * 8 + ["b"] * 4, SIZES, 30e-6, 80e9))
    rc, out, err = run_cli(["calibrate", str(path), "--out", str(tmp_path / "u.toml")], capsys)
    assert (rc, out) == (2, "")
    assert err.startswith("error: u.txt: 12 ranks on 2 hosts, 4 to 8 per host: its busbw cannot be split")