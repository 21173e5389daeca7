"""report's HTML cluster row names a [cluster] nic override, transport and rate, as plan's text
does (newcomer trial 54 #8: 'RoCE' appeared 0 times in the report of a RoCE cluster)."""

import html
from pathlib import Path

from tests.cli_run import run_captured

DATA = Path(__file__).resolve().parent / "data" / "nc54b"


def test_report_and_plan_name_the_nic_override(tmp_path):
    """job70b.toml: system dgx-h100 (8 NICs a node, catalog InfiniBand 400 Gb/s) with nic = {
    transport roce, rate_gbit_per_s 400 }; bad_units_nic50.toml the same with 50.0 (GB/s typed in
    a Gb/s field, nc54 #5), which the row must show as 50 Gb/s."""
    for name, rate in (("job70b.toml", "400"), ("bad_units_nic50.toml", "50")):
        words = f"8 NIC(s)/node RoCEv2 at {rate} Gb/s ([cluster] nic"
        out = tmp_path / f"{name}.html"
        assert run_captured("report", DATA / name, "--out", out).returncode == 0
        page = html.unescape(out.read_text())
        assert f"32 nodes x 8 h100-sxm5-80gb (79.1 GiB), {words}), world 256" in page
        text = run_captured("plan", DATA / name).stdout
        assert f"(79.1 GiB HBM), {words}; step notes how they are timed), world 256" in text


def test_a_catalog_node_without_override_keeps_its_words(tmp_path):
    """examples/mini_2x4_tp2-dp4.toml: a catalog dgx-h100, no [cluster] nic: the count alone."""
    out = tmp_path / "mini.html"
    assert run_captured("report", "examples/mini_2x4_tp2-dp4.toml", "--out", out).returncode == 0
    assert "1 node x 8 h100-sxm5-80gb (79.1 GiB), 8 NIC(s)/node, world 8" in html.unescape(out.read_text())
