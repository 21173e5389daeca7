"""Findings of the nc51 newcomer trial (a capacity planner: Llama-3-405B on H100 IB, H200 RoCE and
A100 clusters under Megatron-LM), one test each; the trial's H200 config is
``tests/data/nc52b/b_h200.toml`` (192 nodes x 8 H200, pp 16 x dp 12 x tp 8, framework megatron)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli_run import run_cli

DATA = Path(__file__).parent / "data" / "nc52b"


def _with(tmp_path, name: str, old: str, new: str) -> Path:
    """``b_h200.toml`` with ``old`` replaced by ``new``, written to ``tmp_path/NAME.toml``."""
    text = (DATA / "b_h200.toml").read_text(encoding="utf-8")
    assert old in text
    out = tmp_path / f"{name}.toml"
    out.write_text(text.replace(old, new), encoding="utf-8")
    return out


def test_megatron_runtime_said(tmp_path, capsys):
    """#1: ``framework = "megatron"`` with ``megatron_runtime`` unset models Megatron-LM 2022 (2755bcb)
    without saying so. Now plan and step print one line naming it, the other generation, and the key;
    the --json carries it. The trial's model is Llama 3 405B (catalog: RoPE, SwiGLU, 8 KV heads of 128),
    none of which Megatron-LM 2022 has (``git grep`` of ``rotary``, ``swiglu``, ``num-query-groups`` under
    ``megatron/`` at 2755bcb finds nothing), so the line names them, in the model's order: RoPE, SwiGLU,
    GQA (8 of 128 heads); sharding zero1 is not listed (2755bcb ``megatron/arguments.py:785`` has
    ``--use-distributed-optimizer``). With ``megatron_runtime = "core"`` the line names Megatron Core at
    d98e8a6, set, and no feature."""
    code, out, err = run_cli(["plan", DATA / "b_h200.toml", "--json", tmp_path / "p.json"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "p.json").read_text())["megatron_runtime"]
    assert (doc["runtime"], doc["set"]) == ("2022", False)
    assert doc["core_only_features"] == ["RoPE (--position-embedding-type rope)", "SwiGLU (--swiglu)",
                                         "GQA (--num-query-groups 8 of 128 heads)"]
    assert "2755bcb" in doc["revision"] and doc["other"]["runtime"] == "core" and "d98e8a6" in doc["other"]["revision"]
    said = " ".join(out.split())  # rich wraps the line
    assert "megatron runtime: Megatron-LM 2022 (NVIDIA/Megatron-LM 2755bcb" in said
    assert 'set training.megatron_runtime = "core" to model it' in said
    core = _with(tmp_path, "core", 'framework = "megatron"', 'framework = "megatron"\nmegatron_runtime = "core"')
    code, out, err = run_cli(["step", core, "--json", tmp_path / "s.json"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "s.json").read_text())["megatron_runtime"]
    assert (doc["runtime"], doc["set"], doc["core_only_features"]) == ("core", True, [])
    line = next(x for x in out.splitlines() if x.startswith("megatron runtime:"))
    assert 'Megatron Core (NVIDIA/Megatron-LM d98e8a6) (training.megatron_runtime = "core")' in line
    assert 'set training.megatron_runtime = "2022" to model it' in line
    torch = _with(tmp_path, "torch", 'framework = "megatron"', 'framework = "torch"')
    code, out, err = run_cli(["plan", torch, "--json", tmp_path / "t.json"], capsys)
    assert json.loads((tmp_path / "t.json").read_text())["megatron_runtime"] is None
    assert "megatron runtime:" not in out

