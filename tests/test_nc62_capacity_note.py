"""Newcomer trial nc62 #8: framework torch (torchtitan) with ``training.moe_capacity_factor`` set
planned and stepped a capacity-bound run with no line saying that torchtitan's MoE has none
(token-choice routing, every routed copy computed: pytorch/torchtitan 08dc75a
torchtitan/models/moe/moe.py; meshplan's torchtitan import plans it dropless). plan and step now
carry the same note (:func:`meshplan.plan_runtime.capacity_factor_warning`); megatron, which has
--moe-expert-capacity-factor, and a dropless torch run get none."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_run import run_main

MIXTRAL = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"
NOTE = "training.moe_capacity_factor 1.25 under framework torch: torchtitan's MoE has no capacity factor"


def _job(tmp_path, extra: str) -> Path:
    path = tmp_path / "mixtral_cf.toml"
    path.write_text(MIXTRAL.read_text().replace('recompute = "full"', f'recompute = "full"\n{extra}'))
    return path


@pytest.mark.parametrize("command", ["plan", "step"])
def test_torch_capacity_factor_is_noted(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "400")  # each note on one line
    assert run_main(command, _job(tmp_path, "moe_capacity_factor = 1.25")) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert NOTE in out
    # C = ceil(f T top_k / experts): the cap is 1.25 x the even share T top_k / experts
    assert "each expert capped at 1.25 x its even share, the overflow dropped" in out


def test_dropless_torch_run_has_no_capacity_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert run_main("plan", _job(tmp_path, "")) == 0  # the example: dropless, as torchtitan runs
    assert "torchtitan's MoE has no capacity factor" not in " ".join(capsys.readouterr().out.split())
