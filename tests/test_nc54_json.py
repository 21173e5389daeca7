"""Newcomer trial 54 findings 10 and 12: calibrate --json's ``runs`` (every fit, kept or dropped, as
fields), step --json's collectives with their plan rows, ``calibration.replaced_links``, and the step
edge-load table saying what its capacities are. Fixtures: tests/data/nc54/ (test_nc54_calibration.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.comm.calibrate_table import DROP_OTHER_OP
from tests.cli_run import run_cli

D = Path(__file__).parent / "data" / "nc54"


def test_calibrate_json_lists_every_run_with_its_per_nic_split_and_catalog_line(tmp_path, capsys):
    """all_reduce_2n.txt and all_gather_2n.txt: 16 ranks on 2 hosts, 8 per host, each on its own NIC
    (--link nic): each fit's busbw / 8 per NIC. The all-reduce one is kept (a ring op's, all-reduce
    first), the all-gather one dropped (one busbw for the ring ops on nic) with why; both are checked
    against the fastest catalog NIC of an H100 node, dgx-h100's NDR 400 Gb/s = 50e9 B/s. The per-NIC
    figures are those the notes print ('= 339.45 / 8', trial 54)."""
    js = tmp_path / "c.json"
    rc, text, err = run_cli(["calibrate", D / "all_reduce_2n.txt", D / "all_gather_2n.txt", "--link", "nic",
                             "--out", tmp_path / "c.toml", "--json", js], capsys)
    assert rc == 0, err
    runs = {r["file"]: r for r in json.loads(js.read_text())["runs"]}
    ar, ag = runs["all_reduce_2n.txt"], runs["all_gather_2n.txt"]
    assert (ar["role"], ag["role"], ag["why"]) == ("kept", "dropped", DROP_OTHER_OP)
    for r in (ar, ag):
        assert (r["link"], r["ranks"], r["hosts"], r["ranks_per_host"], r["nics_per_host"]) == ("nic", 16, 2, 8, 8)
        assert r["per_nic_bytes_per_s"] == pytest.approx(r["busbw_bytes_per_s"] / 8)
        assert (r["catalog_line_per_nic_bytes_per_s"], r["catalog_node"]) == (50e9, "dgx-h100")
        said = f"{r['file']}: 8 ranks per host, each on its own NIC: nic {r['op']} {r['per_nic_bytes_per_s'] / 1e9:.2f}"
        assert any(line.startswith(said) for line in text.splitlines())
    assert ar["busbw_bytes_per_s"] / 1e9 == pytest.approx(339.45, abs=0.005)  # the trial's 'beta 339.45 GB/s'


def test_step_json_collectives_carry_their_plan_rows_and_replaced_links(tmp_path, capsys):
    """job70b.toml (Llama-3-70B, dp_shard 32 x tp 8, SP) with calib.toml. The fsdp stream's first
    forward all-gather stands for the dp_shard rows 'every layer': per tp rank (q 8192^2 + k, v 2 x
    8192 x 1024 + o 8192^2 + MLP 3 x 8192 x 28672) / 8 + 2 norms x 8192 (replicated over tp) =
    106,971,136 parameters, gathered in bf16: 213,942,272 B over a group of 32, the row plan --json
    gives (same busbw). replaced_links: nic calibrated 41.38 GB/s per NIC (the file's), logged at 8 GiB
    328.62 / 8 NICs = 41.0775, catalog ib-ndr-400-8nic 376 of 400 GB/s at 8 GiB over 8 NICs of 50 =
    47.0, line rate 50e9 from the catalog."""
    js, pj = tmp_path / "s.json", tmp_path / "p.json"
    rc, _, err = run_cli(["step", D / "job70b.toml", "--calibration", D / "calib.toml", "--json", js], capsys)
    assert rc == 0, err
    doc = json.loads(js.read_text())
    first = next(c for c in doc["collectives"] if (c["stream"], c["phase"], c["op"]) == ("fsdp", "forward", "all-gather"))
    row = next(r for r in first["plan_rows"] if r["cadence"] == "every layer")
    assert (row["axis"], row["size_bytes"], row["group_size"]) == ("dp_shard", 213_942_272, 32)
    rc, _, err = run_cli(["plan", D / "job70b.toml", "--calibration", D / "calib.toml", "--json", pj], capsys)
    plan_row = next(r for r in json.loads(pj.read_text())["collectives"]["stage 0"]
                    if (r["axis"], r["phase"], r["op"], r["cadence"]) == ("dp_shard", "forward", "all-gather", "every layer"))
    assert row["busbw_bytes_per_s"] == pytest.approx(plan_row["busbw_bytes_per_s"]) and plan_row["dtype"] == "bf16"
    nic = next(e for e in doc["calibration"]["replaced_links"] if e["link"] == "nic")
    assert nic["calibrated_bytes_per_s"] == pytest.approx(41.38e9) and nic["per_nic"]
    assert nic["logged"]["size_bytes"] == 2 ** 33 and nic["logged"]["per_nic_bytes_per_s"] == pytest.approx(41.0775e9)
    assert nic["catalog"] == {"curve": "ib-ndr-400-8nic", "size_bytes": 2 ** 33, "bytes_per_s": pytest.approx(47e9),
                              "line_rate_bytes_per_s": 50e9, "line_rate_from": "catalog"}


def test_replaced_links_read_the_config_nic_rate(tmp_path, capsys):
    """bad_units_nic50.toml: [cluster] nic at 50 Gb/s = 6.25e9 B/s per NIC; the catalog curve read
    against it: 376 / 400 x 6.25 = 5.875e9, line_rate_from 'config'."""
    js = tmp_path / "p.json"
    rc, _, err = run_cli(["plan", D / "bad_units_nic50.toml", "--calibration", D / "calib.toml", "--json", js], capsys)
    nic = next(e for e in json.loads(js.read_text())["calibration"]["replaced_links"] if e["link"] == "nic")
    assert nic["catalog"]["line_rate_bytes_per_s"] == 6.25e9 and nic["catalog"]["line_rate_from"] == "config"
    assert nic["catalog"]["bytes_per_s"] == pytest.approx(5.875e9)


def test_the_edge_load_table_says_what_its_capacities_are(capsys):
    """Without a calibration the capacities are line rates: dgx-h100's NVLink 4, 450 GB/s per GPU, and
    NDR 400 Gb/s NICs, 50 GB/s. With calib.toml they are the fits (nvlink 361.6, nic 41.38 GB/s per NIC,
    the file's bandwidth_gb_per_s), each with the line rate it replaced."""
    rc, text, _ = run_cli(["step", D / "job70b.toml"], capsys)
    assert "  capacities: nvlink4 450 GB/s per GPU and each NIC 50 GB/s, line rates" in text.splitlines()
    rc, text, _ = run_cli(["step", D / "job70b.toml", "--calibration", D / "calib.toml"], capsys)
    assert ("  capacities: nvlink4 361.6 GB/s per GPU (the calibrated busbw fit, line rate 450 GB/s) and each NIC "
            "41.38 GB/s (the calibrated busbw fit per NIC, line rate 50 GB/s): a calibrated link's capacity is its "
            "busbw fit, what NCCL's collectives reached on it, not its line rate") in text.splitlines()


def test_the_report_page_names_the_capacities_too(tmp_path, capsys):
    """The HTML page's link-load note carries the same capacities line as step (calibrated fits here)."""
    page = tmp_path / "r.html"
    rc, _, err = run_cli(["report", D / "job70b.toml", "--calibration", D / "calib.toml", "--out", page], capsys)
    assert rc == 0, err
    assert ("capacities: nvlink4 361.6 GB/s per GPU (the calibrated busbw fit, line rate 450 GB/s) and each NIC 41.38 "
            "GB/s (the calibrated busbw fit per NIC, line rate 50 GB/s)") in page.read_text()
