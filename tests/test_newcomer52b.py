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


def test_train_time_days(tmp_path, capsys):
    """#2: a capacity planner asks how long N tokens take. ``step --tokens 15e12`` prints it and --json has
    it in seconds. By hand from the --json: tokens/s = global batch 2016 x seq 8192 = 16,515,072 tokens per
    step / step_s (53.94 s when written: 306,188 tokens/s), so 15e12 tokens take 15e12 x step_s / 16,515,072
    s (567.0 days at 53.94 s); with interruptions, wall = that / goodput, the goodput
    ``meshplan reliability`` prints for the same config at the same storage and restart defaults
    (2000 GB/s, 600 s; 98.81% when written, 573.9 days). With ``[reliability] checkpoint_interval_steps =
    100`` the goodput is the job's interval's (``job_interval.goodput`` of reliability --json)."""
    code, out, err = run_cli(["step", DATA / "b_h200.toml", "--tokens", "15e12", "--json", tmp_path / "s.json"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "s.json").read_text())
    tt, step_s = doc["train_time"], doc["step_s"]
    assert abs(tt["compute_s"] - 15e12 * step_s / (2016 * 8192)) < 1e-6 * tt["compute_s"]
    code, _, err = run_cli(["reliability", DATA / "b_h200.toml", "--json", tmp_path / "r.json"], capsys)
    rel = json.loads((tmp_path / "r.json").read_text())
    assert tt["goodput"] == rel["goodput"] and tt["wall_s"] == tt["compute_s"] / rel["goodput"]
    line = next(x for x in out.splitlines() if x.startswith("train time:"))
    assert f"{tt['compute_s'] / 86400:.1f} days of steps ({tt['wall_s'] / 86400:.1f} days at goodput" in line
    job = _with(tmp_path, "job", "[mesh]", "[reliability]\ncheckpoint_interval_steps = 100\n[mesh]")
    run_cli(["step", job, "--tokens", "15e12", "--json", tmp_path / "j.json"], capsys)
    run_cli(["reliability", job, "--json", tmp_path / "rj.json"], capsys)
    got = json.loads((tmp_path / "j.json").read_text())["train_time"]
    assert got["goodput"] == json.loads((tmp_path / "rj.json").read_text())["job_interval"]["goodput"]
    assert "job's interval (100 steps" in got["goodput_at"]
    code, out, err = run_cli(["step", DATA / "b_h200.toml", "--tokens", "0"], capsys)
    assert code == 2 and "--tokens" in err and len(err.strip().splitlines()) == 1
