"""Issue 11 (newcomer trial 4): ``--calibration cal.toml`` changes plan, step, search and compare
numbers, but no output line named it. Each prints one header line naming the file and the
calibrated links' bandwidths, its ``--json`` document holds it as ``calibration`` (SI), and the
HTML pages carry the line in their header."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from meshplan.report.json_docs import schema_of
from tests.cli_run import run_cli
from tests.conftest import EXAMPLES

CAL = '''[link.nvlink]
latency_us = 12.0
bandwidth_gb_per_s = 450.0
source = "nccl-tests all_reduce_perf, 1 node x 8 GPUs"

[link.nic]
latency_us = 25.0
bandwidth_gb_per_s = 45.0
source = "nccl-tests all_reduce_perf, 2 nodes x 8 GPUs"
'''
LINE = "links calibrated from {} (GPU not recorded): nvlink 450 GB/s, nic 45 GB/s"  # a file without gpu =
MINI, MINI_TP4 = EXAMPLES / "mini_2x4_tp2-dp4.toml", EXAMPLES / "mini_2x4_tp4-dp2.toml"


def _expected(path) -> dict:
    """The ``calibration`` entry by hand: 450 and 45 GB/s are 4.5e11 and 4.5e10 B/s, 12 and 25 us."""
    return {"file": str(path), "line": LINE.format(path),
            "links": {"nvlink": {"bandwidth_bytes_per_s": 4.5e11, "latency_s": 1.2e-5,
                                 "source": "nccl-tests all_reduce_perf, 1 node x 8 GPUs", "gpu": None},
                      "nic": {"bandwidth_bytes_per_s": 4.5e10, "latency_s": 2.5e-5,
                              "source": "nccl-tests all_reduce_perf, 2 nodes x 8 GPUs", "gpu": None}},
            # trial 28: what each table sets; a nic table without logged curves (a file from before per-op
            # calibration) still sets every op, as it did, and says so
            "origin": ["  nvlink fitted to op and ranks not recorded: rows not recorded, size range not recorded; "
                       "source: nccl-tests all_reduce_perf, 1 node x 8 GPUs; sets all-reduce, all-gather, "
                       "reduce-scatter and all-to-all on nvlink",
                       "  nic fitted to op and ranks not recorded: rows not recorded, size range not recorded; "
                       "source: nccl-tests all_reduce_perf, 2 nodes x 8 GPUs; sets every op across nodes: no logged "
                       "curve in the file (written before per-op calibration), so its unrecorded fit stands for "
                       "all; run meshplan calibrate on the logs again to set each op from its own run"],
            # newcomer 25: the catalog figure each fit replaced on dgx-h100, by hand from nccl.toml: NVLink
            # ring 368.0 GB/s at 8 GiB on its 450 line; NDR 8-NIC 376.0 at 8 GiB x 50 / 400 = 47.00 per NIC
            "replaced": ["  nvlink busbw 450.00 GB/s calibrated fit, catalog 368.00 (h100-nvlink4-ring at 8.00 GiB; "
                         "line rate 450)",
                         "  nic busbw 45.00 GB/s per NIC calibrated fit, catalog 47.00 (ib-ndr-400-8nic at 8.00 GiB; "
                         "line rate 50)"],
            # newcomer 54 #10: the same as fields (no logged curve in this file: logged null)
            "replaced_links": [
                {"link": "nvlink", "op": None, "calibrated_bytes_per_s": 4.5e11, "per_nic": False, "logged": None,
                 "catalog": {"curve": "h100-nvlink4-ring", "size_bytes": 2 ** 33, "bytes_per_s": pytest.approx(368e9),
                             "line_rate_bytes_per_s": 450e9, "line_rate_from": "catalog"}},
                {"link": "nic", "op": None, "calibrated_bytes_per_s": 4.5e10, "per_nic": True, "logged": None,
                 "catalog": {"curve": "ib-ndr-400-8nic", "size_bytes": 2 ** 33, "bytes_per_s": pytest.approx(47e9),
                             "line_rate_bytes_per_s": 50e9, "line_rate_from": "catalog"}}],
            "warnings": []}


@pytest.mark.parametrize("command", ["plan", "step", "compare", "search"])
def test_calibration_is_named_in_text_json_and_html(command, tmp_path, capsys):
    cal = tmp_path / "cal.toml"
    cal.write_text(CAL)
    args = {"plan": ["plan", MINI, "--html", tmp_path / "p.html"], "step": ["step", MINI],
            "compare": ["compare", MINI, MINI_TP4, "--out", tmp_path / "cmp", "--html", tmp_path / "p.html"],
            "search": ["search", MINI, "--top", "1", "--html", tmp_path / "p.html"]}[command]
    rc, out, err = run_cli([*args, "--calibration", cal, "--json", tmp_path / "doc.json"], capsys)
    assert rc == 0, err
    assert out.splitlines().count(LINE.format(cal)) == 1
    doc = json.loads((tmp_path / "doc.json").read_text())
    assert doc["calibration"] == _expected(cal)
    assert list(jsonschema.Draft202012Validator(schema_of(command)).iter_errors(doc)) == []
    if command != "step":
        assert LINE.format(cal) in (tmp_path / "p.html").read_text()
    # without a calibration: no line, no entry
    (tmp_path / "doc.json").unlink()
    rc, out, err = run_cli([*args, "--json", tmp_path / "doc.json", "--force"], capsys)
    assert rc == 0 and "links calibrated" not in out
    assert "calibration" not in json.loads((tmp_path / "doc.json").read_text())


def test_the_calibration_changes_the_step_it_names(tmp_path, capsys):
    """The line is there because the numbers move: the mini mesh's step with NVLink at 450 GB/s
    differs from the catalog's."""
    cal = tmp_path / "cal.toml"
    cal.write_text(CAL)
    steps = []
    for extra in ([], ["--calibration", cal]):
        rc, out, err = run_cli(["step", MINI, "--json", "-", *extra], capsys)
        assert rc == 0, err
        steps.append(json.loads(out)["step_s"])
        assert ("links calibrated" in err) == bool(extra)  # --json -: the rest of the output on stderr
    assert steps[0] != steps[1]


A100_CAL = CAL.replace('source = "nccl-tests all_reduce_perf, 1 node x 8 GPUs"\n',
                       'source = "nccl-tests all_reduce_perf, 1 node x 8 GPUs"\ngpu = "NVIDIA A100-SXM4-80GB"\n')
A100_LINE = "links calibrated from {}: nvlink 450 GB/s on NVIDIA A100-SXM4-80GB, nic 45 GB/s (GPU not recorded)"
#: MINI's cluster is a dgx-h100 (h100-sxm5-80gb); the file's nvlink table names an A100.
#: Both GPUs in the catalog's ids (issue 11, trial 6 item 7: a device name against a catalog id read as two kinds).
A100_WARNING = ("--calibration {}: nvlink measured on NVIDIA A100-SXM4-80GB (catalog a100-sxm-80gb), but cluster 1x "
                "dgx-h100 has "
                "h100-sxm5-80gb: these are another machine's links; calibrate on this cluster's GPUs (nccl-tests + "
                "meshplan calibrate) or plan a cluster of the measured GPU")


@pytest.mark.parametrize("command", ["plan", "step", "compare", "search"])
def test_a_calibration_of_another_gpu_is_named_with_a_warning(command, tmp_path, capsys):
    """Issue 11 (trial 5 item 2): an A100 NVLink fit applied to an H100 cluster said nothing.
    The header names each table's GPU (or 'GPU not recorded'), and one warning line names both
    GPUs, in the text and in the --json document; the numbers are still the file's (a warning,
    not a refusal: README)."""
    cal = tmp_path / "a100.toml"
    cal.write_text(A100_CAL)
    args = {"plan": ["plan", MINI], "step": ["step", MINI], "search": ["search", MINI, "--top", "1"],
            "compare": ["compare", MINI, MINI_TP4, "--out", tmp_path / "cmp"]}[command]
    rc, out, err = run_cli([*args, "--calibration", cal, "--json", tmp_path / "doc.json"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines.count(A100_LINE.format(cal)) == 1 and lines.count("warning: " + A100_WARNING.format(cal)) == 1
    doc = json.loads((tmp_path / "doc.json").read_text())
    assert doc["calibration"]["warnings"] == [A100_WARNING.format(cal)]
    assert doc["calibration"]["links"]["nvlink"]["gpu"] == "NVIDIA A100-SXM4-80GB"
    assert doc["calibration"]["links"]["nic"]["gpu"] is None
    assert list(jsonschema.Draft202012Validator(schema_of(command)).iter_errors(doc)) == []
    if command != "step":  # the HTML page's header carries both lines
        rc, out, err = run_cli([*args, "--calibration", cal, "--html", tmp_path / "p.html", "--force"], capsys)
        page = (tmp_path / "p.html").read_text()
        assert rc == 0 and A100_LINE.format(cal) in page and "warning: --calibration" in page
    # an H100 fit on the H100 cluster: named, no warning
    cal.write_text(A100_CAL.replace("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"))
    rc, out, err = run_cli([*args, "--calibration", cal, "--json", tmp_path / "doc.json", "--force"], capsys)
    assert rc == 0 and "warning: --calibration" not in out
    assert "nvlink 450 GB/s on NVIDIA H100 80GB HBM3, nic 45 GB/s (GPU not recorded)" in out
    assert json.loads((tmp_path / "doc.json").read_text())["calibration"]["warnings"] == []


def test_compare_evidence_names_the_calibration(tmp_path, capsys):
    """Issue 11 (trial 5 item 5): compare --calibration's evidence folder did not name the
    calibration. summary.md carries the header line and the GPU warning, comparison.json the
    whole ``calibration`` entry, as compare --json does."""
    cal = tmp_path / "a100.toml"
    cal.write_text(A100_CAL)
    rc, out, err = run_cli(["compare", MINI, MINI_TP4, "--out", tmp_path / "cmp", "--calibration", cal,
                         "--json", tmp_path / "doc.json"], capsys)
    assert rc == 0, err
    (folder,) = (tmp_path / "cmp").iterdir()  # rejected-<name>
    summary = (folder / "summary.md").read_text().splitlines()
    line = A100_LINE.format(cal)  # its own words, not "Links: links calibrated from ..." (trial 6 item 7)
    assert f"{line[0].upper()}{line[1:]}." in summary and not any(x.startswith("Links:") for x in summary)
    assert f"Warning: {A100_WARNING.format(cal)}." in summary
    evidence = json.loads((folder / "comparison.json").read_text())
    assert evidence["calibration"] == json.loads((tmp_path / "doc.json").read_text())["calibration"]
    assert evidence["calibration"]["file"] == str(cal)
    # without --calibration: neither file speaks of one
    rc, out, err = run_cli(["compare", MINI, MINI_TP4, "--out", tmp_path / "plain"], capsys)
    assert rc == 0, err
    (folder,) = (tmp_path / "plain").iterdir()
    assert "calibrat" not in (folder / "summary.md").read_text().lower()
    assert "calibration" not in json.loads((folder / "comparison.json").read_text())


FITTED = '''[link.nic]
latency_us = 30.0
bandwidth_gb_per_s = 37.32
op = "all-reduce"
ranks = 16
residual = 0.02
points = 3
source = "nccl-tests 2.17.6 all-reduce over 16 ranks on 2 host(s), file ar.txt"

[[link.nic.curve]]
op = "all-reduce"
ranks = 16
nodes = 2
line_gb_per_s = 298.6
sizes_bytes = [1048576, 67108864, 4294967296]
busbw_gb_per_s = [5.1, 30.2, 37.0]
source = "nccl-tests 2.17.6 all-reduce over 16 ranks on 2 host(s), file ar.txt"
'''


def test_plan_says_where_the_fit_came_from(tmp_path, capsys):
    """Newcomer words20: ``links calibrated from ...: nic 37.32 GB/s`` alone did not say which run the
    fit came from. The next line gives the file's op, ranks, the nodes and logged sizes of its
    curve (1 MiB = 1048576 B, 4 GiB = 4294967296 B), its rows and its source."""
    cal = tmp_path / "fit.toml"
    cal.write_text(FITTED)
    rc, out, err = run_cli(["plan", MINI, "--calibration", cal], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    i = lines.index(f"links calibrated from {cal} (GPU not recorded): nic 37.32 GB/s")
    assert lines[i + 1] == ("  nic fitted to all-reduce over 16 ranks on 2 nodes: 3 nccl-tests rows, logged sizes "
                            "1.00 MiB to 4.00 GiB; source: nccl-tests 2.17.6 all-reduce over 16 ranks on 2 host(s), "
                            "file ar.txt; sets all-reduce, all-gather and reduce-scatter across nodes; all-to-all "
                            "stays on the catalog curve; send/recv on the catalog curve scaled by this run's busbw "
                            "per NIC over the catalog's")


def test_two_calibration_files_of_two_link_classes(tmp_path, capsys):
    """A newcomer's 1-node file (nvlink, 468.8 GB/s) and 2-node file (nic, 46.22 GB/s per NIC) given
    as two --calibration options: the last alone was applied, silently (header 'links calibrated from
    calib_nvl.toml ...: nvlink 468.8 GB/s'). Both now apply, the header names both; a class in two
    files is refused in one line naming both files."""
    import shutil

    from meshplan.cli import main

    data = Path(__file__).parent / "data" / "nc33"
    cfg = data / "dsv2lite_ep8.toml"
    nic, nvl = data / "calib_nic.toml", data / "calib_nvl.toml"
    with pytest.raises(SystemExit) as done:
        main(["step", str(cfg), "--calibration", str(nic), "--calibration", str(nvl)])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert f"links calibrated from {nic} + {nvl} on NVIDIA H100 80GB HBM3: nic 46.22 GB/s, nvlink 468.8 GB/s" in out
    again = tmp_path / "again.toml"
    shutil.copyfile(nic, again)
    with pytest.raises(SystemExit) as done:
        main(["step", str(cfg), "--calibration", str(nic), "--calibration", str(again)])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert "error: --calibration: link.nic: set by both calib_nic.toml and again.toml" in err and err.count("\n") == 1
    # the same file twice: named as given twice (was 'set by both calib_nic.toml and calib_nic.toml')
    with pytest.raises(SystemExit) as done:
        main(["step", str(cfg), "--calibration", str(nic), "--calibration", str(nic)])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err == f"error: --calibration: {nic} given twice; give each file once\n"


def test_report_and_place_take_calibration(tmp_path, capsys):
    """README calls report the same as plan --html, but report had no --calibration or --topology
    ('No such option'; newcomer nc33: report 2561.47 ms against plan --html --calibration 2579.75 ms),
    and place --choose scored its candidates on the catalog links. Both now take the file: report's
    page equals plan --html's with the same file, and place prints the calibrated header."""
    import re

    from meshplan.cli import main

    data = Path(__file__).parent / "data" / "nc33"
    cfg, nvl = data / "dsv2lite_ep8.toml", data / "calib_nvl.toml"
    steps = []
    for argv in (["report", str(cfg), "--calibration", str(nvl), "--out", str(tmp_path / "r.html")],
                 ["plan", str(cfg), "--calibration", str(nvl), "--html", str(tmp_path / "p.html")]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        html = Path(argv[-1]).read_text()
        assert "links calibrated from" in html
        steps.append(re.search(r"step ([0-9.]+) ms", html).group(1))
    assert steps[0] == steps[1]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["place", str(cfg), "--calibration", str(nvl)])
    assert "links calibrated from" in capsys.readouterr().out
