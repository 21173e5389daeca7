"""Llama 3.1's RoPE scaling (issue 11): ``model.rope_scaling`` read from a Hugging Face
config.json, carried through Megatron-LM's arguments (``--use-rope-scaling``,
``--rope-scaling-factor``; NVIDIA/Megatron-LM d98e8a6 arguments.py), noted in the plan only
past the original context, and of no cost."""

import json
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.cli import main
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.megatron import parse_args
from meshplan.interop.megatron_model import model_flags, model_table
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.spec.hf import model_from_hf_config
from meshplan.spec.model import ModelSpec
from meshplan.spec.rope import RopeScaling

DATA = Path(__file__).parent / "data" / "hf"
LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)


def test_llama31_config_json_carries_its_scaling():
    """meta-llama/Llama-3.1-8B's config.json: Llama 3 8B's sizes (8,030,261,248 parameters, the
    catalog's llama3-8b) with 131,072 positions and rope_scaling llama3 (8, 1, 4, 8192); Llama 3's
    config.json (rope_scaling null) and DeepSeek-V3's yarn scaling carry none."""
    spec = model_from_hf_config(DATA / "llama-3.1-8b")
    assert spec.rope_scaling == LLAMA31 and spec.max_position == 131072 and spec.rope_theta == 500000.0
    assert spec.param_count() == catalog.model("llama3-8b").param_count() == 8_030_261_248
    assert model_from_hf_config(DATA / "meta-llama-3-8b").rope_scaling is None
    assert model_from_hf_config(DATA / "deepseek-v3").rope_scaling is None


def test_yarn_scaling_is_not_read_and_the_model_says_so():
    """DeepSeek-V3's config.json rope_scaling (type yarn: factor 40, original 4,096 positions,
    beta_fast 32, beta_slow 1, mscale and mscale_all_dim 1.0): RopeScaling holds Llama 3.1's
    alone, so it is not read, and the model's "not modelled" list (which plan prints) names it
    with its fields and says it changes RoPE's frequencies and the softmax scale, not FLOPs or
    memory: the parameters are the same 671,026,404,352 either way (no size: the catalog's
    deepseek-v3), as for the config without the key."""
    import json

    cfg = json.loads((DATA / "deepseek-v3" / "config.json").read_text())
    v3, bare = model_from_hf_config(cfg), model_from_hf_config({k: v for k, v in cfg.items() if k != "rope_scaling"})
    assert v3.rope_scaling is None and v3.param_count() == bare.param_count() == 671_026_404_352
    assert catalog.model("deepseek-v3").param_count() == 671_026_404_352
    assert ("rope_scaling yarn (beta_fast 32, beta_slow 1, factor 40, mscale 1.0, mscale_all_dim 1.0, "
            "original_max_position_embeddings 4096) not read: meshplan's model spec carries Llama 3.1's llama3 "
            "scaling only; yarn changes RoPE's frequencies and the attention softmax scale (mscale), not the FLOPs or "
            "memory the plan counts") in v3.source
    assert "rope_scaling" not in bare.source
    linear = model_from_hf_config(cfg | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert "rope_scaling linear (factor 2.0) not read: meshplan's model spec carries Llama 3.1's llama3 scaling only; " \
           "linear changes RoPE's frequencies, not the FLOPs" in linear.source


def test_catalog_405b_is_llama31():
    """The catalog's llama3-405b is read from meta-llama/Llama-3.1-405B's config.json."""
    assert catalog.model("llama3-405b").rope_scaling == LLAMA31
    assert catalog.model("llama3-8b").rope_scaling is None  # Meta-Llama-3-8B: rope_scaling null


@pytest.mark.parametrize("scaling, field", [({"rope_type": "llama3", "factor": "8"}, "rope_scaling.factor"),
                                            ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0}, "rope_scaling.original_max_position_embeddings")])
def test_bad_llama3_scaling_names_the_key(scaling, field):
    cfg = json.loads((DATA / "llama-3.1-8b" / "config.json").read_text()) | {"rope_scaling": scaling}
    with pytest.raises(ConfigError, match=rf"^{field}: must be a number > 0 in a llama3 rope_scaling"):
        model_from_hf_config(cfg)


def test_spec_checks():
    with pytest.raises(ValueError, match="high_freq_factor 1 must be more than low_freq_factor 1"):
        RopeScaling(factor=8.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="rope_scaling is set on a model without RoPE"):
        ModelSpec(layers=1, hidden=64, ffn=64, q_heads=4, vocab=8, position_embedding="learned", max_position=16,
                  rope_scaling=RopeScaling())


def test_megatron_flags_round_trip():
    """Export writes --use-rope-scaling --rope-scaling-factor 8 for llama3-405b, which reads back
    as the catalog model exactly; without them the arguments still read as llama3-405b, with a
    note naming the flags to add; another factor is carried, another low/high/original (which
    Megatron-LM fixes in RotaryEmbedding._apply_scaling) refused by name."""
    m = catalog.model("llama3-405b")
    flags = model_flags(m, 8192)
    assert flags[flags.index("--use-rope-scaling") + 1] == "--rope-scaling-factor 8"
    notes: list[str] = []
    assert model_table(parse_args(" ".join(flags)), ImportOptions(), notes) == {"catalog": "llama3-405b"}
    assert notes == ["the model flags give catalog model llama3-405b exactly"]
    notes = []
    bare = " ".join(f for f in flags if "rope-scaling" not in f)
    assert model_table(parse_args(bare), ImportOptions(), notes) == {"catalog": "llama3-405b"}
    assert notes == ["the model flags give catalog model llama3-405b but not --use-rope-scaling (Megatron-LM's "
                     "default: off; llama3-405b: Llama 3.1's RoPE scaling, factor 8): planned as llama3-405b (the same "
                     "costs); add --use-rope-scaling --rope-scaling-factor 8 to train it"]
    x16 = model_table(parse_args(bare + " --use-rope-scaling --rope-scaling-factor 16"), ImportOptions(), [])
    assert x16["rope_scaling"] == {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position": 8192}
    assert model_table(parse_args(bare + " --use-rope-scaling"), ImportOptions(), [])["catalog"] == "llama3-405b"
    with pytest.raises(ConfigError, match=r"^--rope-scaling-factor: 'x' is not a RoPE scaling factor"):
        model_table(parse_args(bare + " --use-rope-scaling --rope-scaling-factor x"), ImportOptions(), [])
    odd = m.model_copy(update={"rope_scaling": LLAMA31.model_copy(update={"original_max_position": 4096})})
    with pytest.raises(ConfigError, match=r"^--to: model.rope_scaling original_max_position 4096: Megatron-LM fixes"):
        model_flags(odd, 8192)


def _cfg(scaling, seq_len=16384):
    model = {"catalog": "llama3-8b", "max_position": 131072} | ({"rope_scaling": scaling} if scaling else {})
    return config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 8, "seq_len": seq_len, "sharding": "zero3",
                                          "recompute": "full"},
                             "mesh": {"names": ["dp_shard"], "shape": [8]}})


def test_no_time_or_memory():
    """Llama 3 8B at 16K on one node with and without the scaling: the same peak and step."""
    with_, without = build_plan(_cfg({"factor": 8.0})), build_plan(_cfg(None))
    assert with_.timeline.peak.total_bytes == without.timeline.peak.total_bytes
    assert step_time(with_).step_s == step_time(without).step_s


def test_plan_notes_it_only_past_the_original_context(tmp_path, capsys):
    note = ("RoPE scaled as Llama 3.1 (factor 8, low/high frequency factors 1/4, original 8192 positions): "
            "training.seq_len 16384 goes past the original 8192 on the scaled frequencies; no time or memory of "
            "note (a precomputed frequency table)")
    for seq, shown in ((16384, True), (8192, False)):
        path = tmp_path / f"s{seq}.toml"
        path.write_text(f"""[model]
catalog = "llama3-8b"
max_position = 131072
rope_scaling = {{factor = 8.0}}

[cluster]
system = "dgx-h100"
nodes = 1

[training]
global_batch = 8
seq_len = {seq}
sharding = "zero3"
recompute = "full"

[mesh]
names = ["dp_shard"]
shape = [8]
""")
        with pytest.raises(SystemExit):
            main(["plan", str(path)])
        out = " ".join(capsys.readouterr().out.split())
        assert (note.replace("16384", str(seq)) in out) == shown


def test_meshplan_export_writes_the_scaling_whole():
    """``export --to meshplan`` of the imported Llama 3.1 8B writes [model.rope_scaling] with all
    four fields (not ``{}``, whose defaults would also read back as Llama 3.1's) and reads back
    the same model."""
    import tomllib

    from meshplan.interop.tomlout import dumps, meshplan_tables
    cfg = config_from_dict({"model": {"hf_config": str(DATA / "llama-3.1-8b" / "config.json")},
                            "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 8192, "sharding": "zero3"},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    text = dumps(meshplan_tables(cfg))
    assert ("[model.rope_scaling]\nfactor = 8.0\nlow_freq_factor = 1.0\nhigh_freq_factor = 4.0\n"
            "original_max_position = 8192\n") in text
    assert config_from_dict(tomllib.loads(text)).model == cfg.model
