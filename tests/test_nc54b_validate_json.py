"""validate --json: each world carries its `reliable` flag and why not (newcomer trial 54 #10;
only comparison.json and validate.json had it). The worlds are nc54's own (tests/data/nc54b/val:
job70b.toml validated at worlds 8 and 16 on a 2-core host)."""

import json
from pathlib import Path

import jsonschema

from meshplan.report.json_docs import schema_of, validate_doc

VAL = Path(__file__).resolve().parent / "data" / "nc54b" / "val"


def test_each_world_says_whether_its_times_are_reliable():
    """nc54's comparison.json files: world 8 ran 8 ranks on 2 cores, world 16 16 on 2 (host.why,
    meshplan.runtime.validation.host: ranks over cores time-share them): both unreliable; a world
    that failed at its plan (no host record) is null, neither."""
    res = [json.loads((VAL / f"world{w}_comparison.json").read_text()) for w in (8, 16)]
    res.append({"world": 32, "ok": False, "stage": "plan", "message": "no plan"})
    doc = validate_doc("job70b.toml", 1, res, "val", 0)
    jsonschema.Draft202012Validator(schema_of("validate")).validate(doc)
    got = [(w["world"], w["reliable"], w["unreliable_because"]) for w in doc["worlds"]]
    assert got == [(8, False, ["8 ranks on 2 cores: ranks time-share cores"]),
                   (16, False, ["16 ranks on 2 cores: ranks time-share cores"]), (32, None, [])]
    res[0]["host"] = {**res[0]["host"], "reliable": True, "why": []}
    assert validate_doc("job70b.toml", 0, res[:1], "val", 0)["worlds"][0]["reliable"] is True


def test_local_kernels_marked_suspect_against_the_profiled_step():
    """nc54's world 8 (job70b reduced, 8 ranks on 2 cores): the step part rows hold, per step,
    the pre-launch kernel times x calls against the same kernels in rank 5's profiled step: GEMM
    20.93 ms vs 1.35 ms (1.3472 / 20.9306 = 0.064x), attention 36.84 ms vs 0.43 ms (0.43495 /
    36.8361 = 0.012x): both more than 2x apart, so every row is SUSPECT and the section says the
    prediction used the pre-launch column. At 0.6x (inside 2x) a row is not marked."""
    from meshplan.runtime.validation.summary import kernel_lines, world_lines

    comp = json.loads((VAL / "world8_comparison.json").read_text())["comparison"]
    lines = world_lines(comp["staged"], None, comp["predicted_vs_measured"])
    rows = [x for x in lines if x.startswith("| gemm |") or x.startswith("| attention")]
    assert len(rows) == 15 and all(x.endswith(": SUSPECT |") for x in rows)
    assert rows[0] == "| gemm | 4x256x64 | 190 us | 61 us | -68% | 0.064x (1.35 of 20.93 ms a step): SUSPECT |"
    assert rows[-1].endswith("| 0.012x (0.43 of 36.84 ms a step): SUSPECT |")
    assert any(x.startswith("SUSPECT: the pre-launch kernel times differ") and "GEMM kernels 0.064x, attention "
               "kernels 0.012x" in x and "the prediction used the pre-launch (measured) column" in x for x in lines)
    ok = kernel_lines(comp["staged"]["kernels"][:1], {"GEMM kernels": (0.010, 0.006, 0.6)})
    assert ok[-1].endswith("| 0.6x (6.00 of 10.00 ms a step) |") and not any("SUSPECT:" in x for x in ok)
