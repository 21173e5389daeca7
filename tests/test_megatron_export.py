"""What ``export`` and ``compare`` report about a Megatron-LM plan (newcomer findings, s22):
a difference only where the effective value differs, and files that end in a newline."""

from __future__ import annotations

from meshplan import catalog
from meshplan.config import config_from_dict
from meshplan.interop.export import export
from meshplan.interop.roundtrip import differences

#: GPT-3 175B from the catalog (head_dim unset: 12288 / 96 = 128) as Megatron-LM runs it.
TABLES = {"model": {"catalog": "megatron-175b"}, "cluster": {"system": "dgx-a100", "nodes": 128},
          "training": {"global_batch": 1536, "seq_len": 2048, "sharding": "zero1", "framework": "megatron",
                       "grad_reduce_dtype": "fp32"},
          "mesh": {"names": ["pp", "dp", "tp"], "shape": [16, 8, 8], "sequence_parallel": True},
          "memory": {"dropout": True}}


def test_export_reports_no_difference_for_the_default_head_dim():
    cfg = config_from_dict(TABLES)
    assert catalog.model("megatron-175b").head_dim is None  # --kv-channels 128 comes back as head_dim 128
    text, header = export(cfg, "megatron", "gpt3")
    assert "--kv-channels 128" in text.splitlines()
    assert [h for h in header if h.startswith("not expressed")] == []
    # a real difference is still reported: head_dim 64 (q projection 96 x 64 wide) is not the default 128
    other = cfg.model.model_copy(update={"head_dim": 64})
    assert differences(cfg, config_from_dict(TABLES | {"model": other.model_dump()})) == \
        ["model.head_dim: 128 -> 64"]


def test_compare_treats_an_explicit_even_split_as_unset():
    """A split equal to the even one the mesh gets anyway is no knob that differs (it printed
    ``mesh.pp_layer_split unset against [6, ..., 6]``); an uneven one still is."""
    from meshplan.compare.sides import check_workload
    from meshplan.plan import build_plan
    a = build_plan(config_from_dict(TABLES))
    even = build_plan(config_from_dict(TABLES | {"mesh": TABLES["mesh"] | {"pp_layer_split": [6] * 16}}))
    uneven_split = [5] + [6] * 14 + [7]
    uneven = build_plan(config_from_dict(TABLES | {"mesh": TABLES["mesh"] | {"pp_layer_split": uneven_split}}))
    assert check_workload(a, even).knobs == ()
    assert check_workload(a, uneven).knobs == (("mesh.pp_layer_split", None, uneven_split),)


def test_exported_files_end_with_a_newline():
    cfg = config_from_dict(TABLES)
    for to in ("meshplan", "megatron"):
        text, _ = export(cfg, to, "gpt3")
        assert text.endswith("\n") and not text.endswith("\n\n"), to
