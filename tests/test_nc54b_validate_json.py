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
