"""Issue 11 (newcomer trial 4): ``--calibration cal.toml`` changes plan, step, search and compare
numbers, but no output line named it. Each prints one header line naming the file and the
calibrated links' bandwidths, its ``--json`` document holds it as ``calibration`` (SI), and the
HTML pages carry the line in their header."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshplan.cli import main
from meshplan.report.json_docs import schema_of
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
LINE = "links calibrated from {}: nvlink 450 GB/s, nic 45 GB/s"
MINI, MINI_TP4 = EXAMPLES / "mini_2x4_tp2-dp4.toml", EXAMPLES / "mini_2x4_tp4-dp2.toml"


def _run(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def _expected(path) -> dict:
    """The ``calibration`` entry by hand: 450 and 45 GB/s are 4.5e11 and 4.5e10 B/s, 12 and 25 us."""
    return {"file": str(path), "line": LINE.format(path),
            "links": {"nvlink": {"bandwidth_bytes_per_s": 4.5e11, "latency_s": 1.2e-5,
                                 "source": "nccl-tests all_reduce_perf, 1 node x 8 GPUs"},
                      "nic": {"bandwidth_bytes_per_s": 4.5e10, "latency_s": 2.5e-5,
                              "source": "nccl-tests all_reduce_perf, 2 nodes x 8 GPUs"}}}


@pytest.mark.parametrize("command", ["plan", "step", "compare", "search"])
def test_calibration_is_named_in_text_json_and_html(command, tmp_path, capsys):
    cal = tmp_path / "cal.toml"
    cal.write_text(CAL)
    args = {"plan": ["plan", MINI, "--html", tmp_path / "p.html"], "step": ["step", MINI],
            "compare": ["compare", MINI, MINI_TP4, "--out", tmp_path / "cmp", "--html", tmp_path / "p.html"],
            "search": ["search", MINI, "--top", "1", "--html", tmp_path / "p.html"]}[command]
    rc, out, err = _run([*args, "--calibration", cal, "--json", tmp_path / "doc.json"], capsys)
    assert rc == 0, err
    assert out.splitlines().count(LINE.format(cal)) == 1
    doc = json.loads((tmp_path / "doc.json").read_text())
    assert doc["calibration"] == _expected(cal)
    assert list(jsonschema.Draft202012Validator(schema_of(command)).iter_errors(doc)) == []
    if command != "step":
        assert LINE.format(cal) in (tmp_path / "p.html").read_text()
    # without a calibration: no line, no entry
    (tmp_path / "doc.json").unlink()
    rc, out, err = _run([*args, "--json", tmp_path / "doc.json", "--force"], capsys)
    assert rc == 0 and "links calibrated" not in out
    assert "calibration" not in json.loads((tmp_path / "doc.json").read_text())


def test_the_calibration_changes_the_step_it_names(tmp_path, capsys):
    """The line is there because the numbers move: the mini mesh's step with NVLink at 450 GB/s
    differs from the catalog's."""
    cal = tmp_path / "cal.toml"
    cal.write_text(CAL)
    steps = []
    for extra in ([], ["--calibration", cal]):
        rc, out, err = _run(["step", MINI, "--json", "-", *extra], capsys)
        assert rc == 0, err
        steps.append(json.loads(out)["step_s"])
        assert ("links calibrated" in err) == bool(extra)  # --json -: the rest of the output on stderr
    assert steps[0] != steps[1]
