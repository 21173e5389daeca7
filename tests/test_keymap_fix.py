"""review36: the memory fix's builder takes a foreign format's key map (:mod:`meshplan.interop.keymaps`)
and prints the file's keys itself, where ``plan`` used to print meshplan's words and rewrite them
(:func:`meshplan.interop.file_words.file_words`). Llama-3-70B at dp 4 x tp 2 on one dgx-h100,
ZeRO-1, micro-batch 2, no recompute, seq 8192: every knob of the fix applies (recompute, half the
micro-batch, ZeRO-3, tp x2, pp x2), so every kind of word is printed in each format's keys."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import config_from_dict
from meshplan.interop.file_words import file_words
from meshplan.interop.keymaps import keymap_of
from meshplan.interop.megatron_write import sharding_flags
from meshplan.keymap import OWN
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix


@pytest.fixture(scope="module")
def plan():
    cfg = config_from_dict({
        "model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 8, "seq_len": 8192, "micro_batch": 2, "recompute": "none", "sharding": "zero1"},
        "mesh": {"names": ["dp", "tp"], "shape": [4, 2], "sequence_parallel": True}})
    p = build_plan(cfg)
    assert not p.feasible
    return p


def _fix(plan, origin: str) -> tuple[str, str]:
    """(memory_fix with the format's key map, memory_fix in meshplan's words rewritten by file_words)."""
    p = replace(plan, config=replace(plan.config, origin=origin))
    return memory_fix(p, keymap_of(p.config)) or "", file_words(p.config, memory_fix(p) or "")


def test_meshplan_toml_keeps_meshplan_words(plan):
    assert keymap_of(plan.config) is OWN
    line = memory_fix(plan)
    assert line == memory_fix(plan, OWN)
    # nothing fits: the variants close the line, after its fix, as no fix alone (newcomer trial 27 #B)
    assert "no fix alone: recompute full -> peak " in line and "; micro_batch 1 -> peak " in line
    assert "; sharding zero3 -> peak " in line and "; tp x2 (dp 2 x tp 4) -> peak " in line
    assert "; pp x2 (pp 2 x dp 2 x tp 2) -> peak " in line


def test_megatron_fix_is_built_in_its_flags(plan):
    built, rewritten = _fix(plan, "megatron")
    assert built == rewritten
    assert ("no fix alone: --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "-> peak ") in built
    assert "; --micro-batch-size 1 -> peak " in built
    assert f"; {' '.join(sharding_flags('zero3'))} -> peak " in built
    assert ("; --tensor-model-parallel-size x2 (dp 2 x --tensor-model-parallel-size 4) -> peak " in built
            and "; --pipeline-model-parallel-size x2 (--pipeline-model-parallel-size 2 x dp 2 x "
                "--tensor-model-parallel-size 2) -> peak " in built)
    for words in ("recompute full", "micro_batch", "sharding zero3", " tp ", " pp "):
        assert words not in built


@pytest.mark.parametrize("origin", ["torchtitan", "deepspeed"])
def test_torchtitan_and_deepspeed_fix_built_as_rewritten(plan, origin):
    """The builder's words and file_words' agree line for line; DeepSpeed has no tp or pp key (its
    degrees keep meshplan's names), torchtitan no ZeRO-1 (``sharding zero3`` stays)."""
    built, rewritten = _fix(plan, origin)
    assert built == rewritten
    if origin == "deepspeed":
        assert "train_micro_batch_size_per_gpu 1 -> peak " in built and "; tp x2 (dp 2 x tp 4) -> peak " in built
        assert ("no fix alone: the HF Trainer's --gradient_checkpointing (import --gradient-checkpointing), or "
                "deepspeed.checkpointing on every block in other model code ") in built  # no JSON key (nc52d)
    else:
        assert "; training.local_batch_size 1 -> peak " in built and "; sharding zero3 -> peak " in built
        assert "; tensor_parallel_degree x2 (dp 2 x tensor_parallel_degree 4) -> peak " in built


@pytest.mark.parametrize("origin", ["torchtitan", "megatron", "deepspeed"])
def test_split_fix_is_built_in_the_file_keys(tmp_path, origin):
    """DeepSeek-V3's 61 layers at pp 16 under torch (tests/test_plan_split_fix.py: [3, 4 x 13, 3, 3]):
    torchtitan's line names its pp degree and split keys, Megatron-LM's its pp flag, DeepSpeed's
    keeps meshplan's names; each equal to file_words' rewrite of meshplan's line."""
    from pathlib import Path

    from meshplan.config import load_config
    from meshplan.plan_fix_rules import split_fix
    data = Path(__file__).parent / "data" / "deepseek-v3_512xh100_megatron.toml"
    f = tmp_path / "ds.toml"
    f.write_text(data.read_text().replace('framework = "megatron"', 'framework = "torch"')
                 + '\n[mesh]\nnames = ["pp", "dp_shard", "ep"]\nshape = [16, 32, 8]\n')
    cfg = replace(load_config(f), origin=origin)
    p = build_plan(cfg, memory=False)
    built = split_fix(p, keymap_of(cfg))
    assert built == file_words(cfg, split_fix(p) or "")
    split = [3] + [4] * 13 + [3, 3]
    if origin == "torchtitan":  # torchtitan has no key of layer counts (nc58 #3b): the counts of its own cut.
        # 16 parts of 61 + first + last slots, 3 a part with 14 left over for parts 0-13 (so 62 slots,
        # first + last = 1); part 0 holds 4 - first = 3 (first 1), part 15 3 - last = 3 (last 0); parts
        # 1-13 hold 4, part 14 3: the split (torchtitan b5bcd76 _generate_llm_fqn_per_model_part)
        assert built == ("fix: 61 layers over pipeline_parallel_degree 16: give "
                         "parallelism.pipeline_parallel_first_stage_less_layers = 1, "
                         f"parallelism.pipeline_parallel_last_stage_less_layers = 0 (layers per stage {split})")
        return
    pp = {"megatron": "--pipeline-model-parallel-size", "deepspeed": "pp"}[origin]
    assert built == (f"fix: 61 layers over {pp} 16: give mesh.pp_layer_split = {split} (torchtitan's "
                     f"module_fqns_per_model_part, which export --to torchtitan writes)")


#: Handed case C6's heads (40 q, 10 KV) at tp 4 on one dgx-h100 (8 GPUs): tp 1 and 2 pass the heads
#: rule (tests/test_handed_cli.py); the data axis takes the ranks tp gives up.
C6 = {"layers": 2, "hidden": 5120, "ffn": 20480, "q_heads": 40, "kv_heads": 10, "head_dim": 128, "vocab": 32000}
HEADS = "fix: tp must divide q_heads 40 and divide or be a multiple of kv_heads 10 (of the divisors of the world 8): "


@pytest.mark.parametrize("mesh, origin, choices", [
    # both degrees change: torchtitan sets both keys
    ({"names": ["dp_shard", "tp"], "shape": [2, 4]}, "torchtitan",
     "tensor_parallel_degree 1 (parallelism.data_parallel_shard_degree = 8, parallelism.tensor_parallel_degree = 1); "
     "or tensor_parallel_degree 2 (parallelism.data_parallel_shard_degree = 4, parallelism.tensor_parallel_degree = 2)"),
    # Megatron-LM has no dp_shard flag: the mesh keeps meshplan's words beside its tp flag
    ({"names": ["dp_shard", "tp"], "shape": [2, 4]}, "megatron",
     "--tensor-model-parallel-size 1 (mesh.shape [8, 1]); or --tensor-model-parallel-size 2 (mesh.shape [4, 2])"),
    # the data axis inferred (-1): tp alone changes, said once as the setting
    ({"names": ["dp_shard", "tp"], "shape": [-1, 4]}, "torchtitan",
     "parallelism.tensor_parallel_degree = 1; or parallelism.tensor_parallel_degree = 2"),
    ({"names": ["dp_shard", "tp"], "shape": [-1, 4]}, "megatron",
     "--tensor-model-parallel-size 1; or --tensor-model-parallel-size 2"),
    ({"names": ["dp_shard", "tp"], "shape": [2, 4]}, "deepspeed", "tp 1 (mesh.shape [8, 1]); or tp 2 (mesh.shape [4, 2])"),
    ({"order": "tp-dp", "degrees": {"tp": 4, "dp": 2}}, "torchtitan",
     "tensor_parallel_degree 1 (mesh.degrees {'tp': 1, 'dp': 8}); or tensor_parallel_degree 2 (mesh.degrees "
     "{'tp': 2, 'dp': 4})"),
])
def test_heads_fix_is_built_in_the_file_keys(mesh, origin, choices):
    """review37: heads_fix takes the key map as split_fix does; each line equal to file_words' rewrite
    of meshplan's line, which ``plan`` printed before."""
    from meshplan.plan_fix_rules import heads_fix
    cfg = replace(config_from_dict({"model": C6, "cluster": {"system": "dgx-h100", "nodes": 1},
                                    "training": {"global_batch": 64, "seq_len": 4096}, "mesh": mesh}), origin=origin)
    p = build_plan(cfg)
    built = heads_fix(p, keymap_of(cfg))
    assert built == HEADS + choices
    assert built == file_words(cfg, heads_fix(p) or "")
