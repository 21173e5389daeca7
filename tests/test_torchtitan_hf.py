"""``export --to torchtitan`` of MoE models given as a Hugging Face config.json (issue ttexport).

Fixtures: ``tests/data/hf/qwen3-235b-a22b/config.json`` and ``tests/data/hf/mixtral-8x22b-v0.1/config.json``,
the published configs of Qwen/Qwen3-235B-A22B (hidden_size 4096, 94 layers, 128 experts top 8,
rope_theta 1e6) and mistralai/Mixtral-8x22B-v0.1 (hidden_size 6144, 56 layers, 8 experts top 2).
torchtitan b5bcd76's flavors, read by hand: ``torchtitan/models/qwen3/__init__.py`` 30B-A3B (516-554:
dim 2048, 48 layers, 128 experts top 8) and 235B-A22B (557-595: dim 4096, 94 layers, 128 experts
top 8, theta 5e6); no Mixtral under ``torchtitan/models``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.interop.torchtitan_flavors import flavor_model
from tests.cli_run import run_main

HF = Path(__file__).resolve().parent / "data" / "hf"


def _cfg(config: Path, shape=(256, 8), nodes=32, recompute="full") -> dict:
    return {"model": {"hf_config": str(config)}, "cluster": {"system": "dgx-h100", "nodes": nodes},
            "training": {"global_batch": 1024, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                         "recompute": recompute},
            "mesh": {"names": ["dp_shard", "ep"], "shape": list(shape)}}


def _variant(tmp_path: Path, src: str, **keys) -> Path:
    """A copy of ``src``'s config.json with ``keys`` replaced, in its own folder."""
    d = tmp_path / src
    d.mkdir()
    (d / "config.json").write_text(json.dumps(json.loads((HF / src / "config.json").read_text()) | keys))
    return d / "config.json"


def test_qwen3_235b_config_exports_as_torchtitans_flavor(tmp_path):
    """Before: refused ("has none meshplan can tell: set model.name = \"qwen3\" ..."). Now [model] is
    qwen3 235B-A22B, the header says which four sizes chose it, and the round trip lists the one field
    torchtitan's flavor runs differently: RoPE theta 5e6 (qwen3/__init__.py:591) against the config's 1e6."""
    cfg = config_from_dict(_cfg(HF / "qwen3-235b-a22b" / "config.json"))
    text, head = export(cfg, "torchtitan", "q.toml")
    doc = tomllib.loads(text)
    assert doc["model"] == {"name": "qwen3", "flavor": "235B-A22B"}
    assert (doc["parallelism"]["data_parallel_shard_degree"], doc["parallelism"]["expert_parallel_degree"]) == (256, 8)
    assert ('note: model.name "qwen3", model.flavor "235B-A22B": torchtitan\'s flavor of model_type qwen3_moe with '
            'hidden_size 4096, num_hidden_layers 94, num_experts 128, num_experts_per_tok 8 (torchtitan b5bcd76 '
            'torchtitan/models/qwen3/__init__.py); the model\'s name Qwen/Qwen3-235B-A22B names it too') in head
    assert [h for h in head if h.startswith("not expressed")] == [
        "not expressed in torchtitan: model.rope_theta: 1000000.0 -> 5000000.0"]
    (tmp_path / "q.toml").write_text(text)
    back = load_any(tmp_path / "q.toml", "torchtitan", ImportOptions(cluster="dgx-h100", nodes=32))
    assert back.model.architecture() == flavor_model(("qwen3", "235B-A22B")).architecture()
    assert (back.model.layers, back.model.hidden, back.model.experts, back.model.top_k) == (94, 4096, 128, 8)


def test_sizes_decide_not_the_name(tmp_path):
    """_name_or_path is a hint only: 235B-A22B's sizes under another name are still 235B-A22B (the
    note says the name does not name it); 30B-A3B's name on 94 layers of 2048 is refused."""
    named_30b = _variant(tmp_path, "qwen3-235b-a22b", _name_or_path="Qwen/Qwen3-30B-A3B")
    text, head = export(config_from_dict(_cfg(named_30b)), "torchtitan", "x")
    assert '[model]\nname = "qwen3"\nflavor = "235B-A22B"\n' in text
    assert any(h.endswith("the model's name Qwen/Qwen3-30B-A3B does not name it: the sizes decide") for h in head)


def test_sizes_of_no_flavor_name_the_nearest_and_the_key(tmp_path, capsys):
    """96 layers of Qwen3-235B-A22B's width: no flavor; one line naming 235B-A22B and the key that
    differs (30B-A3B differs in two: hidden_size and num_hidden_layers)."""
    off = _variant(tmp_path, "qwen3-235b-a22b", num_hidden_layers=96)
    with pytest.raises(ConfigError) as e:
        export(config_from_dict(_cfg(off)), "torchtitan", "x")
    assert str(e.value).startswith(
        f"--to: model 'Qwen/Qwen3-235B-A22B' (Hugging Face config {off}, model_type qwen3_moe) has no torchtitan "
        f"[model] name and flavor: model_type qwen3_moe is torchtitan's qwen3, whose flavors are 30B-A3B, 235B-A22B; "
        f"these sizes are none of them: nearest 235B-A22B, which differs in num_hidden_layers 96 (94); "
        f"export --to megatron instead")
    small = _variant(tmp_path, "qwen3-30b-a3b", num_experts=64)
    with pytest.raises(ConfigError, match=r"nearest 30B-A3B, which differs in num_experts 64 \(128\);"):
        export(config_from_dict(_cfg(small, shape=(16, 8), nodes=2)), "torchtitan", "x")


def test_mixtral_8x22b_is_refused_in_one_line_with_megatron_to_use(tmp_path, capsys):
    """torchtitan v0.2.2 and b5bcd76 have no Mixtral (before: pointed at its HF backend "for dense models"); the
    line says so and suggests Megatron-LM, whose export of the same config is written."""
    toml = tmp_path / "mx.toml"
    toml.write_text(f'[model]\nhf_config = "{HF / "mixtral-8x22b-v0.1" / "config.json"}"\n[cluster]\nsystem = '
                    '"dgx-h100"\nnodes = 32\n[training]\nglobal_batch = 1024\nseq_len = 4096\nmicro_batch = 1\n'
                    'sharding = "zero3"\nrecompute = "full"\n[mesh]\nnames = ["dp_shard", "ep"]\nshape = [256, 8]\n')
    assert run_main("export", toml, "--to", "torchtitan", "-o", tmp_path / "tt.toml") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not (tmp_path / "tt.toml").exists()
    # e347b1e (v0.2.2, whose job TOML is written) ls torchtitan/models: deepseek_v3 flux gpt_oss llama3 llama3_ft
    # llama4 moe qwen3; experiments/transformers_modeling_backend/__init__.py:25-37 flavors debugmodel and full only
    assert "torchtitan v0.2.2 (e347b1e, the job TOML's) has no Mixtral model (torchtitan/models: llama3, llama4, " \
           "deepseek_v3, qwen3, gpt_oss, flux)" in err[0] and "runs dense configs only (flavors debugmodel, full)" in err[0]
    assert "nor has b5bcd76, whose full_moe flavor fixes Qwen3-30B-A3B's sizes" in err[0]
    assert err[0].endswith("; export --to megatron instead")
    assert run_main("export", toml, "--to", "megatron", "-o", tmp_path / "mx.args") == 0
    args = (tmp_path / "mx.args").read_text()
    for flag in ("--num-experts 8", "--moe-router-topk 2", "--hidden-size 6144", "--num-layers 56",
                 "--expert-model-parallel-size 8"):
        assert flag in args


def test_search_export_takes_the_flavor_told_by_sizes():
    """``search --export N --to torchtitan`` refused Qwen3-235B-A22B's config.json before the search
    (its check wanted a flavor of the exact fields); now it takes it, and refuses Mixtral-8x22B with
    the same reason as ``export``."""
    from meshplan.interop.search_export import search_export_refusal
    cfgs = {d: config_from_dict({k: v for k, v in _cfg(HF / d / "config.json").items() if k != "mesh"},
                                require_mesh=False)
            for d in ("qwen3-235b-a22b", "mixtral-8x22b-v0.1")}
    assert search_export_refusal(cfgs["qwen3-235b-a22b"], "torchtitan") is None
    why = search_export_refusal(cfgs["mixtral-8x22b-v0.1"], "torchtitan")
    assert "torchtitan v0.2.2 (e347b1e, the job TOML's) has no Mixtral model" in why and why.endswith("; or export --to meshplan or megatron")


def test_llama_config_refusal_names_v022_flavors():
    """A Llama config.json of no flavor's sizes: the refusal names torchtitan's llama3 flavors of
    v0.2.2, whose job TOML the export writes: e347b1e ``torchtitan/models/llama3/__init__.py``'s
    ``llama3_args`` holds debugmodel, 8B, 70B, 405B (debug left out); 1B and 3B are b5bcd76's only.
    Since newcomer trial 27 such a config exports as a llama3 flavor of its own
    (tests/test_torchtitan_custom.py); the refusal is left to one llama3's args cannot state (here qkv
    biases), with why, and no longer says to set a shipped flavor with model.hf_assets_path: meshplan
    reads a shipped flavor first, so that plans the flavor's model, not the config's."""
    from meshplan.interop.torchtitan_write import no_flavor
    from meshplan.spec.model import ModelSpec
    m = ModelSpec(name="l", layers=2, hidden=64, ffn=64, q_heads=4, vocab=8, qkv_bias=True,
                  source="Hugging Face config.json (model_type llama) from /m/l/config.json")
    why = no_flavor(m)
    assert why.startswith("torchtitan knows models by flavor (llama3 8B, 70B, 405B; deepseek_v3 ")
    assert why.endswith("; nor can llama3's TransformerModelArgs state it: qkv_bias: llama3 has no bias in its Linears "
                        "(model.py:204-209 at e347b1e)")
    assert "hf_assets_path" not in why
