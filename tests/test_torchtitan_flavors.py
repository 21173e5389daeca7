"""torchtitan's MoE flavors (issue ttmoe): ``import torchtitan`` maps the flavors torchtitan
b5bcd76 ships (``torchtitan/models/<name>/__init__.py``) to meshplan models, and
``export --to torchtitan`` writes ``model.name``/``model.flavor`` back for a plan of one of them,
with a round trip that ``compare`` calls identical. The expected dims are torchtitan's args,
read by hand from b5bcd76 (file:line in each case)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.interop.roundtrip import differences
from meshplan.interop.torchtitan_flavors import flavor_model, flavor_of, flavor_refusal
from meshplan.spec.hf import model_from_hf_config
from tests.cli_run import run_main

ROOT = Path(__file__).resolve().parents[1]
H100x2 = ImportOptions(cluster="dgx-h100", nodes=2)

#: (name, flavor) -> torchtitan's args at b5bcd76, as meshplan fields: deepseek_v3/__init__.py:395-425
#: (16B), 465-496 (236B), 539-571 (671B); qwen3/__init__.py:520-545 (30B-A3B), 557-595 (235B-A22B). Shared experts:
#: one FFN of moe_hidden_dim x num_shared_experts (make_ffn_config, hidden_dim=...).
ARGS = {
    ("deepseek_v3", "16B"): dict(hidden=2048, layers=27, vocab=102400, q_heads=16, q_lora_rank=None,
                                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                 ffn=10944, dense_layers=1, experts=64, top_k=6, expert_ffn=1408,
                                 shared_expert_ffn=2 * 1408),
    ("deepseek_v3", "236B"): dict(hidden=5120, layers=60, vocab=102400, q_heads=128, q_lora_rank=1536,
                                  kv_lora_rank=512, ffn=12288, dense_layers=1, experts=160, top_k=6,
                                  expert_ffn=1536, shared_expert_ffn=2 * 1536),
    ("deepseek_v3", "671B"): dict(hidden=7168, layers=61, vocab=129280, q_heads=128, q_lora_rank=1536,
                                  kv_lora_rank=512, ffn=18432, dense_layers=3, experts=256, top_k=8,
                                  expert_ffn=2048, shared_expert_ffn=2048),
    ("qwen3", "30B-A3B"): dict(hidden=2048, layers=48, vocab=151936, q_heads=32, kv_heads=4, head_dim=128,
                               qk_norm=True, dense_layers=0, experts=128, top_k=8, expert_ffn=768,
                               rope_theta=1e6, shared_experts=0),
    # qwen3/__init__.py:557-595 (235B-A22B): theta 5e6 at :591, 40,960 positions at :590
    ("qwen3", "235B-A22B"): dict(hidden=4096, layers=94, vocab=151936, q_heads=64, kv_heads=4, head_dim=128,
                                 qk_norm=True, dense_layers=0, experts=128, top_k=8, expert_ffn=1536,
                                 rope_theta=5e6, max_position=40960, shared_experts=0),
}


@pytest.mark.parametrize("key", list(ARGS))
def test_each_flavor_has_torchtitans_args(key):
    """The meshplan model a flavor maps to has every arg torchtitan's flavor sets, and is found
    again from its own fields."""
    arch = flavor_model(key).architecture()
    assert {k: arch[k] for k in ARGS[key]} == ARGS[key]
    assert flavor_of(flavor_model(key).model_copy(update={"name": "x", "source": ""})) == key


def test_hugging_face_configs_are_the_flavors():
    """The config.json of each Hugging Face model is its flavor's model: DeepSeek-V2-Lite is
    deepseek_v3 16B, Qwen3-30B-A3B is qwen3 30B-A3B; Mixtral is none."""
    hf = ROOT / "tests" / "data" / "hf"
    found = {d: flavor_of(model_from_hf_config(hf / d / "config.json"))
             for d in ("deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b-v0.1")}
    assert found == {"deepseek-v2-lite": ("deepseek_v3", "16B"), "deepseek-v2": ("deepseek_v3", "236B"),
                     "deepseek-v3": ("deepseek_v3", "671B"), "qwen3-30b-a3b": ("qwen3", "30B-A3B"),
                     "mixtral-8x7b-v0.1": None}


JOB = ('[model]\nname = "deepseek_v3"\nflavor = "16B"\n[training]\nlocal_batch_size = 4\nseq_len = 4096\n'
       '[parallelism]\ndata_parallel_shard_degree = -1\nexpert_parallel_degree = 8\n'
       '[activation_checkpoint]\nmode = "full"\n')


def test_deepseek_v3_16b_round_trip_is_identical(tmp_path, capsys):
    """torchtitan deepseek_v3 16B at ep 8 on 2 dgx-h100 (dp_shard 16): imported as the catalog's
    deepseek-v2-lite (no --model), exported as name/flavor again (before: refused, "torchtitan
    knows models by flavor (llama3 ...)"), imported back to the same config; ``compare`` says
    identical."""
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    assert run_main("import", "torchtitan", job, "--cluster", "dgx-h100", "--nodes", "2", "-o", tmp_path / "a.toml") == 0
    a = load_any(tmp_path / "a.toml")
    assert (a.model.name, a.mesh.names, a.mesh.shape) == ("deepseek-v2-lite", ["dp_shard", "ep"], [-1, 8])
    text, _ = export(a, "torchtitan", "a.toml")
    assert '[model]\nname = "deepseek_v3"\nflavor = "16B"\n' in text
    assert "expert_parallel_degree = 8\n" in text and "data_parallel_shard_degree = 16\n" in text
    (tmp_path / "b.toml").write_text(text)
    assert run_main("import", "torchtitan", tmp_path / "b.toml", "--cluster", "dgx-h100", "--nodes", "2",
                    "-o", tmp_path / "c.toml") == 0
    c = load_any(tmp_path / "c.toml")
    assert differences(a, c) == []
    capsys.readouterr()
    assert run_main("compare", tmp_path / "a.toml", tmp_path / "c.toml") == 0
    assert "verdict: identical plans" in capsys.readouterr().out


def test_export_of_a_model_off_by_one_field_names_the_nearest_flavor():
    """DeepSeek-V2-Lite with 26 layers is no torchtitan flavor: the export is refused naming
    deepseek_v3 16B and the one field (before: "model ... has none", no flavor named)."""
    model = catalog.model("deepseek-v2-lite").model_dump() | {"name": "lite26", "layers": 26}
    cfg = config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 4},
                            "mesh": {"names": ["dp_shard", "ep"], "shape": [16, 8]}})
    with pytest.raises(ConfigError) as e:
        export(cfg, "torchtitan", "x")
    assert str(e.value).startswith("--to: torchtitan knows models by flavor (llama3 8B, 70B, 405B; deepseek_v3 16B, "
                                   "236B, 671B; qwen3 30B-A3B, 235B-A22B); model 'lite26' is none of them: nearest deepseek_v3 "
                                   "16B, which differs in layers 26 (27)")
    assert flavor_refusal(cfg.model).endswith("layers 26 (27)")


def test_qwen3_moe_config_exports_as_its_flavor(tmp_path):
    """A meshplan config of Qwen3-30B-A3B's config.json exports as qwen3 30B-A3B, and the job
    imports back to the same model fields."""
    cfg = config_from_dict({"model": {"hf_config": str(ROOT / "tests/data/hf/qwen3-30b-a3b/config.json")},
                            "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 32, "seq_len": 4096, "micro_batch": 2, "recompute": "full",
                                         "moe_dropless": True},
                            "mesh": {"names": ["dp_shard", "ep"], "shape": [16, 8]}})
    text, _ = export(cfg, "torchtitan", "q")
    assert '[model]\nname = "qwen3"\nflavor = "30B-A3B"\n' in text
    (tmp_path / "q.toml").write_text(text)
    again = load_any(tmp_path / "q.toml", "torchtitan", H100x2)
    assert again.model.architecture() == cfg.model.architecture()
