"""Output contracts: ``--json`` on every command, each document valid
against its JSON Schema file shipped under ``meshplan/schemas/`` (package data), with values
that are the plan's, and for a mesh that does not fit the verdict in the document."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest
import typer.main

from meshplan.cli import app, main
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.json_docs import COMMANDS, schema_name, schema_of
from meshplan.schedule.steptime import step_time
from tests.cli_run import run_cli

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "examples" / "mini_2x4_tp2-dp4.toml"
MINI_TP4 = ROOT / "examples" / "mini_2x4_tp4-dp2.toml"
NCCL = ROOT / "tests" / "data" / "nccl"
OOM = """[model]
catalog = "llama3-70b"
[cluster]
system = "dgx-h100"
nodes = 1
[training]
global_batch = 8
seq_len = 8192
[mesh]
names = {names}
shape = {shape}
"""
H100X2 = """[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-h100"
nodes = 2
[training]
global_batch = 32
seq_len = 4096
[mesh]
names = ["dp_shard", "tp"]
shape = [2, 8]
"""


def run(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.err


def validate(command: str, doc: dict) -> list[str]:
    v = jsonschema.Draft202012Validator(schema_of(command))
    return [f"{list(e.path)}: {e.message}" for e in v.iter_errors(doc)]


def test_every_command_takes_json():
    # every leaf command, a group's as <group>-<command> (bench-gemm, testbed-up)
    cmd = typer.main.get_command(app)
    leaves = {}
    for name, c in cmd.commands.items():
        for sub, leaf in (c.commands.items() if hasattr(c, "commands") else [(None, c)]):
            leaves[f"{name}-{sub}" if sub else name] = any("--json" in p.opts for p in leaf.params)
    assert sorted(leaves) == sorted(COMMANDS) and all(leaves.values())


def test_schema_files_are_valid_and_shipped():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "schemas/*.json" in data["meshplan"]
    files = sorted(p.name for p in (ROOT / "meshplan" / "schemas").glob("*.json"))
    assert files == sorted(f"{c}.v1.schema.json" for c in COMMANDS + ("error",))  # error: any command's refusal
    for c in COMMANDS + ("error",):
        s = schema_of(c)
        jsonschema.Draft202012Validator.check_schema(s)
        assert s["properties"]["schema"] == {"const": schema_name(c)}


def test_the_validator_rejects_a_broken_document():
    doc = {"schema": "meshplan.groups/v1", "meshplan_version": "0.1.0", "config": None, "feasible": True,
           "reasons": [], "rank": 0, "names": ["tp"], "shape": [2], "strides": {"tp": 1}, "coordinates": {"tp": 0},
           "group_of_rank": {"tp": [0, 1]}, "groups": {"tp": [[0, 1]]}}
    assert validate("groups", doc) == []
    assert validate("groups", {**doc, "feasible": "yes"}) == ["['feasible']: 'yes' is not of type 'boolean'"]
    assert validate("groups", {k: v for k, v in doc.items() if k != "groups"}) == \
        ["[]: 'groups' is a required property"]
    assert validate("groups", {**doc, "schema": "meshplan.step/v1"}) != []
    assert validate("groups", {**doc, "extra": 1}) != []


@pytest.mark.parametrize("argv", [
    ["groups", MINI, "--rank", 3], ["memory", MINI, "--out", "{tmp}"], ["step", MINI],
    ["reliability", MINI, "--write-gbps", 100, "--read-gbps", 100, "--restart-overhead-s", 60],
    ["place", MINI], ["catalog", "node"], ["plan", MINI],
    ["calibrate", NCCL / "all_reduce_perf_8nodes-x1gpu.txt", "--out", "{tmp}/cal.toml"],
], ids=lambda a: a[0])
def test_json_of_each_command_is_valid(argv, tmp_path, capsys):
    out = tmp_path / "doc.json"
    argv = [str(a).replace("{tmp}", str(tmp_path)) for a in argv]
    rc, err = run(argv + ["--json", out], capsys)
    assert rc == 0, err
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    doc = json.loads(out.read_text())
    assert validate(argv[0], doc) == []
    if argv[0] == "groups":  # dp_shard 4 x tp 2, row-major: rank 3 = (1, 1)
        assert doc["coordinates"] == {"dp_shard": 1, "tp": 1}
        assert (doc["group_of_rank"]["tp"], doc["group_of_rank"]["dp_shard"]) == ([2, 3], [1, 3, 5, 7])
        assert doc["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    if argv[0] == "step":
        plan = build_plan(load_config(MINI))
        st = step_time(plan)
        assert doc["step_s"] == pytest.approx(st.step_s) and doc["mfu"] == pytest.approx(st.mfu)
        # the step's parts on the critical stage add up to it (pp 1: no bubble, no pp)
        parts = doc["step_parts_s"]
        assert parts["step"] == doc["step_s"] and parts["bubble"] == 0 and "exposed pp" not in parts
        assert doc["schedule"] is None and doc["stages"] == 1  # the text's "no pipeline", not "1f1b"
        assert sum(v for k, v in parts.items() if k != "step") == pytest.approx(doc["step_s"], rel=1e-12)
        assert validate("step", {**doc, "step_parts_s": {"step": 1.0, "compute": 1.0}}) != []  # bubble required
        # bytes one rank sends per step on tp: ring of 2 sends half of each buffer
        tp = sum(r.size_bytes * (1 if r.op == "all-reduce" else 0.5) * r.per_step
                 for r in plan.stage(0).collectives if r.axis == "tp")
        assert doc["sent_bytes_per_step"]["tp"] == pytest.approx(tp)
    if argv[0] == "place":
        assert doc["weights_unit"] == "sent_bytes_per_step" and doc["rank_to_gpu"] == list(range(8))


def test_nccl_check_json_lists_the_difference(tmp_path, capsys):
    cfg = tmp_path / "h100x2.toml"
    cfg.write_text(H100X2)
    out = tmp_path / "doc.json"
    rc, _ = run(["nccl-check", cfg, NCCL / "dgx-h100x2_world16_dp2_rank5-wrong-nic.log", "--json", out], capsys)
    doc = json.loads(out.read_text())
    assert rc == 1 and validate("nccl-check", doc) == [] and doc["matched"] is False
    assert doc["differences"] == ["comm 0x1b5e90c2d4f75855 (2 ranks): rank 5 used mlx5_0 but the placement meant "
                                  "mlx5_9"]
    assert doc["cannot_check"] == []  # every channel line of the log is inside its communicator's init


@pytest.mark.parametrize("shape", [8, 3], ids=["over-memory", "unresolved"])
@pytest.mark.parametrize("command", ["plan", "groups", "memory", "step", "reliability", "place"])
def test_json_of_a_mesh_that_does_not_fit_carries_the_verdict(command, shape, tmp_path, capsys):
    """dp_shard 8 over memory; unresolved: ep 3 does not divide dp_shard 8 (degrees that do not
    make the world are input errors instead, exit 2: tests/test_handed_cli.py)."""
    cfg = tmp_path / "oom.toml"
    cfg.write_text(OOM.format(names='["dp_shard"]', shape="[8]") if shape == 8 else
                   OOM.format(names='["dp_shard", "ep"]', shape="[8, 3]"))
    out = tmp_path / "doc.json"
    extra = {"memory": ["--out", tmp_path],
             "reliability": ["--write-gbps", 100, "--read-gbps", 100, "--restart-overhead-s", 60]}.get(command, [])
    argv = [command, cfg, "--json", out] + extra
    rc, err = run(argv, capsys)
    doc = json.loads(out.read_text())
    assert rc == 1 and validate(command, doc) == []
    assert doc["feasible"] is False and doc["reasons"] and f"infeasible: {doc['reasons'][0]}" in err
    if command == "step":
        assert doc["step_s"] is None and ("would_be_step_s" in doc) == (shape == 8)
        assert doc.get("schedule") is None  # pp 1: no pipeline (unresolved: no step at all)
    if command == "place":  # placed when the mesh resolved, the verdict alone when it did not
        assert ("rank_to_gpu" in doc) == (shape == 8)
        errors = validate("place", {**doc, "feasible": True})  # a feasible mesh must have its placement
        assert (errors == []) == (shape == 8) and all("not valid under any of the given schemas" in e for e in errors)


def test_step_json_names_the_schedule_of_a_pipeline(tmp_path, capsys):
    """Issue 11 (newcomer trial 5) item 3: ``step --json`` carried ``"schedule": "1f1b"`` at pp 1,
    where the text says ``no pipeline``; null there now, the schedule's name where pp > 1."""
    cfg = tmp_path / "pp2.toml"
    cfg.write_text(H100X2.replace('["dp_shard", "tp"]', '["pp", "tp"]'))
    rc, err = run(["step", cfg, "--json", tmp_path / "doc.json"], capsys)
    doc = json.loads((tmp_path / "doc.json").read_text())
    assert rc == 0 and validate("step", doc) == [], err
    assert (doc["schedule"], doc["stages"]) == ("1f1b", 2)
    assert validate("step", {**doc, "schedule": None}) == [] and validate("step", {**doc, "schedule": 1}) != []


def test_existing_json_is_refused_before_the_work(tmp_path, capsys):
    out = tmp_path / "doc.json"
    out.write_text("mine")
    rc, err = run(["step", MINI, "--json", out], capsys)
    assert rc == 2 and err.startswith("error: --json:") and out.read_text() == "mine"


@pytest.mark.slow
def test_compare_and_search_json_are_valid(tmp_path, capsys):
    out = tmp_path / "compare.json"
    rc, err = run(["compare", MINI, MINI_TP4, "--out", tmp_path / "cmp", "--json", out], capsys)
    doc = json.loads(out.read_text())
    assert rc == 0 and validate("compare", doc) == []
    assert (doc["winner"], doc["a"]["name"]) == ("mini_2x4_tp2-dp4", "mini_2x4_tp2-dp4")
    out = tmp_path / "search.json"
    rc, err = run(["search", MINI, "--top", "2", "--json", out], capsys)
    doc = json.loads(out.read_text())
    assert rc == 0 and validate("search", doc) == [] and len(doc["top"]) == 2
    assert sum(doc["counts"].values()) == doc["candidates"]


@pytest.mark.parametrize("command", ["memory", "plan", "search", "step"])
def test_json_followed_by_an_option_is_one_line_naming_json(command, tmp_path, capsys):
    """Newcomer trial 27 #F: ``memory X --json --out DIR`` took ``--out`` for --json's path and then
    refused ``DIR`` as an extra argument. --json takes a path: an option given as its value is one
    line naming --json and the fix, exit 2, before any planning and with nothing written."""
    rc, out, err = run_cli([command, MINI, "--json", "--out", tmp_path / "d"], capsys)
    assert (rc, out) == (2, "")
    assert err == ("error: --json: takes a path (--json PATH), got the option --out: give the file right after "
                   "--json (--json out.json --out ...)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["plan", "search"])
def test_json_followed_by_a_short_option_is_one_line_naming_json(command, tmp_path, capsys):
    """As trial 27 #F with a short option: ``search X --json -o FILE`` took ``-o`` for --json's path
    (a file named ``-o``) and refused FILE as an extra argument. Refused as ``--out`` is, with nothing
    written; ``--json -`` (stdout) stays a path (tests/test_calibration_header.py runs ``step --json -``)."""
    with pytest.raises(SystemExit) as done:
        main([command, str(MINI), "--json", "-o", str(tmp_path / "x.toml")])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err == ("error: --json: takes a path (--json PATH), got the option -o: give the file right after "
                   "--json (--json out.json -o ...)\n")
    assert list(tmp_path.iterdir()) == []


def test_readme_names_the_json_path():
    """The README's command table writes ``--json PATH`` (it takes a path), never a bare ``--json``."""
    rows = [r for r in (ROOT / "README.md").read_text().splitlines() if r.startswith("| `") and "--json" in r]
    assert rows and all("`--json`" not in r and "`--json PATH`" in r for r in rows)
