"""Newcomer trial 55 #8: a command given ``--json`` writes, when it refuses its input (exit 2),
the ``meshplan.error/v1`` document (meshplan/cli/error_doc.py) to that path or stdout, valid
against meshplan/schemas/error.v1.schema.json, never over a file the user did not allow."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from meshplan.report.json_docs import schema_of
from tests.cli_run import run_cli

ROOT = Path(__file__).resolve().parents[1]
MINI = (ROOT / "examples" / "mini_2x4_tp2-dp4.toml").read_text()


def _valid(doc: dict) -> list[str]:
    v = jsonschema.Draft202012Validator(schema_of("error"))
    return [e.message for e in v.iter_errors(doc)]


def _misspelt(tmp_path: Path) -> Path:
    """The mini example with ``global_batch`` misspelt ``global_bach`` in [training]."""
    cfg = tmp_path / "typo.toml"
    cfg.write_text(MINI.replace("global_batch = 64", "global_bach = 64"))
    return cfg


def test_a_misspelt_key_writes_the_error_document(tmp_path, capsys):
    out = tmp_path / "o.json"
    code, _, err = run_cli(["step", _misspelt(tmp_path), "--json", out], capsys)
    assert code == 2
    doc = json.loads(out.read_text())
    assert _valid(doc) == []
    # the stderr line split by ConfigError's "<field>: <what is wrong>; <fix>": the line is the one printed
    assert doc["command"] == "step" and doc["exit_code"] == 2 and doc["errors"] == [doc["error"]]
    e = doc["error"]
    assert e["line"] == err.strip() and e["line"] == f"error: {e['field']}: {e['message']}; {e['fix']}"
    assert (e["field"], e["message"]) == ("training.global_bach", "unknown key in [training]")
    assert e["fix"].startswith("did you mean global_batch?")


def test_stdout_holds_the_document_alone(tmp_path, capsys):
    code, out, err = run_cli(["plan", tmp_path / "missing.toml", "--json", "-"], capsys)
    doc = json.loads(out)  # nothing else on stdout
    assert code == 2 and _valid(doc) == [] and doc["command"] == "plan"
    assert doc["error"]["field"] == "config" and "no such file" in doc["error"]["message"]
    assert err.startswith("error: config: ")


def test_a_usage_error_too(tmp_path, capsys):
    # `--nodes abc`: click's refusal, exit 2 as every malformed input
    cfg = tmp_path / "mini.toml"
    cfg.write_text(MINI)
    code, out, _ = run_cli(["plan", cfg, "--nodes", "abc", "--json", "-"], capsys)
    doc = json.loads(out)
    assert code == 2 and _valid(doc) == [] and doc["error"]["field"] == "--nodes"
    assert doc["error"]["fix"].endswith("plan --help")


def test_a_group_command_is_named_group_dash_command(capsys):
    code, out, _ = run_cli(["bench", "gemm", "--max-elements", "abc", "--json", "-"], capsys)
    doc = json.loads(out)
    assert code == 2 and _valid(doc) == [] and (doc["command"], doc["error"]["field"]) == ("bench-gemm", "--max-elements")


def test_no_file_is_replaced_without_force(tmp_path, capsys):
    out = tmp_path / "o.json"
    out.write_text("mine")
    code, _, _ = run_cli(["step", _misspelt(tmp_path), "--json", out], capsys)
    assert code == 2 and out.read_text() == "mine"
    code, _, _ = run_cli(["step", _misspelt(tmp_path), "--json", out, "--force"], capsys)
    assert code == 2 and json.loads(out.read_text())["error"]["field"] == "training.global_bach"


def test_an_input_is_never_replaced(tmp_path, capsys):
    cfg = _misspelt(tmp_path)
    before = cfg.read_text()
    code, _, _ = run_cli(["step", cfg, "--json", cfg, "--force"], capsys)
    assert code == 2 and cfg.read_text() == before


def test_an_error_about_json_itself_writes_nothing(tmp_path, capsys):
    cfg = tmp_path / "mini.toml"
    cfg.write_text(MINI)
    code, out, err = run_cli(["plan", cfg, "--json", tmp_path / "nodir" / "o.json"], capsys)
    assert code == 2 and out == "" and err.startswith("error: --json: ")
    assert not (tmp_path / "nodir").exists()


def test_no_json_asked_no_document(tmp_path, capsys):
    code, out, _ = run_cli(["step", _misspelt(tmp_path)], capsys)
    assert code == 2 and "schema" not in out and sorted(p.name for p in tmp_path.iterdir()) == ["typo.toml"]
