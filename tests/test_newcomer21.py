"""Findings of newcomer trial 21 (inputs and words): each test failed on main before its fix."""

import json
from pathlib import Path

import pytest
from cli_run import run_main as _main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
HF = ROOT / "tests" / "data" / "hf"


def _dsv3_job(tmp_path: Path, drop: str) -> Path:
    """The DeepSeek-V3 example with its model read from DeepSeek-V3's config.json less ``drop``."""
    cfg = json.loads((HF / "deepseek-v3" / "config.json").read_text())
    del cfg[drop]
    (tmp_path / "dsv3").mkdir()
    (tmp_path / "dsv3" / "config.json").write_text(json.dumps(cfg))
    toml = (EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml").read_text()
    job = tmp_path / "job.toml"
    job.write_text(toml.replace('catalog = "deepseek-v3"', 'hf_config = "dsv3/config.json"'))
    return job


@pytest.mark.parametrize("key, null_means", [("n_routed_experts", "a dense model"),
                                             ("n_shared_experts", "no shared experts"),
                                             ("first_k_dense_replace", "no dense layers")])
def test_a_deepseek_config_without_an_expert_count_names_the_key(tmp_path, capsys, key, null_means):
    # was: n_routed_experts left out read as a dense model ("infeasible: ep 64 on a dense model"),
    # n_shared_experts and first_k_dense_replace as 0 (DeepseekV3Config's defaults are 1 and 3)
    job = _dsv3_job(tmp_path, key)
    assert _main("plan", job) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: model.hf_config: {key}: missing from {tmp_path / 'dsv3' / 'config.json'} (model_type "
        f"deepseek_v3); it is required to size the model (give null for {null_means})")
