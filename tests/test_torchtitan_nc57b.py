"""Newcomer trial 57's remaining findings on torchtitan Python configs (#4, #9): a b5bcd76-named
registry's batch error and note in its own keys and units (tokens), the did-you-mean of --config,
``model_spec.max_context_length``, the reshard note's revision, the unused list, the vpp hint's split.
tests/data/nc57b/llama3/config_registry.py.txt is the trial's new_registry.py (torchtitan b5bcd76's
names, upstream ``torchtitan/models/llama3/config_registry.py``'s shape): llama3_8b (tp 2, 128 x 8192
tokens a step, 2 x 8192 a micro-batch per dp rank), llama3_70b (pp 2 Interleaved1F1B x tp 8, 256 x
8192 a step, 8192 a micro-batch, num_pp_microbatches 8), llama3_8b_ctx (lengths from model_spec)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import read_foreign
from meshplan.plan import build_plan
from meshplan.schedule.bubble_hint import _split_words
from meshplan.schedule.reshard_note import reshard_default_note

DATA = Path(__file__).parent / "data" / "nc57b"
NEW = DATA / "llama3" / "config_registry.py.txt"


def _file(tmp_path: Path, old: str = "", new: str = "", model: str = "llama3") -> Path:
    folder = tmp_path / model
    folder.mkdir(exist_ok=True)
    path = folder / "config_registry.py"
    text = NEW.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return path


def _read(path: Path, name: str, nodes: int):
    return read_foreign(path, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=nodes, job_config=name))


def _error(path: Path, name: str, nodes: int) -> str:
    with pytest.raises(ConfigError) as e:
        _read(path, name, nodes)
    return str(e.value)


def test_b5bcd76_batch_error_names_the_token_keys(tmp_path):
    """m/n4.py: llama3_8b with num_tokens_per_train_step=100 * 8192 on 2 dgx-h100: tp 2, so dp 16 / 2
    = 8; 2 x 8192 tokens a micro-batch per dp rank = 2 sequences, 2 x 8 = 16 sequences = 131072 tokens a
    gradient-accumulation step; 100 % 16 = 4: torchtitan refuses it. The multiples of 16 around 100 are
    96 and 112 sequences: 96 x 8192 = 786432 and 112 x 8192 = 917504 tokens."""
    line = _error(_file(tmp_path, "num_tokens_per_train_step=128 * 8192", "num_tokens_per_train_step=100 * 8192"),
                  "llama3_8b", 2)
    assert line == ("training.num_tokens_per_train_step: 819200 (100 x 8192) is not divisible by "
                    "training.num_tokens_per_microbatch_per_dp_rank 16384 x dp 8 = 131072; use a multiple of 131072 "
                    "(786432 or 917504)")
    assert (96 * 8192, 112 * 8192, 16 * 8192) == (786432, 917504, 131072)


def test_b5bcd76_batch_error_and_note_with_pp(tmp_path):
    """llama3_70b on 8 dgx-h100: pp 2 x tp 8, dp 64 / 16 = 4; 8192 tokens = 1 sequence a micro-batch,
    num_pp_microbatches 8: 8 x 4 = 32 sequences (262144 tokens) a schedule run. 256 x 8192 tokens is 256 /
    32 = 8 runs: the note in the file's keys. 100 x 8192: 100 % 32 = 4, 96 or 128 sequences = 786432 or
    1048576 tokens."""
    imp = _read(NEW, "llama3_70b", 8)
    assert ("training.num_tokens_per_train_step 2097152 = 8 x num_tokens_per_microbatch_per_dp_rank 8192 x "
            "num_pp_microbatches 8 x dp 4: torchtitan runs 8 gradient-accumulation steps, each a pipeline schedule "
            "of 8 micro-batches: training.pp_schedule_runs = 8") in imp.notes
    assert 256 * 8192 == 2097152 and imp.tables["training"]["pp_schedule_runs"] == 8
    assert not any("global_batch_size" in n or "local_batch_size" in n for n in imp.notes)
    line = _error(_file(tmp_path, "num_tokens_per_train_step=256 * 8192", "num_tokens_per_train_step=100 * 8192"),
                  "llama3_70b", 8)
    assert line == ("training.num_tokens_per_train_step: 819200 (100 x 8192) is not divisible by "
                    "training.num_tokens_per_microbatch_per_dp_rank 8192 x parallelism.num_pp_microbatches 8 x dp 4 = "
                    "262144; use a multiple of 262144 (786432 or 1048576)")


def test_mixed_names_name_the_old_key_beside_the_new_one(tmp_path):
    """m/mix.py: 9810191's local_batch_size / global_batch_size (training) and pipeline_parallel_microbatch_size
    (parallelism) beside b5bcd76's max_context_length (training): the line names an old key of the same
    table, training.global_batch_size (sorted first of training's)."""
    path = _file(tmp_path, "num_tokens_per_microbatch_per_dp_rank=8192,\n            max_context_length=8192,\n"
                 "            num_tokens_per_train_step=256 * 8192,",
                 "local_batch_size=8,\n            global_batch_size=256,\n            max_context_length=8192,")
    path.write_text(path.read_text().replace("num_pp_microbatches=8", "pipeline_parallel_microbatch_size=1"))
    assert _error(path, "llama3_70b", 8).startswith("training.global_batch_size: torchtitan 9810191's name beside "
                                                    "b5bcd76's training.max_context_length")


def test_config_did_you_mean_lists_every_equally_close_name():
    """llama3_80b is one edit from llama3_8b (delete 0) and from llama3_70b (8 -> 7); llama3_8b_ctx is 4."""
    assert _error(NEW, "llama3_80b", 1) == (f"--config: 'llama3_80b' is not a function of {NEW}; did you mean "
                                            "llama3_8b or llama3_70b?")


def test_max_context_length_from_model_spec(tmp_path):
    """llama3_8b_ctx: max_context_length=model_spec.max_context_length with model_spec = model_registry("8B")
    of the llama3 folder: every llama3 flavor's RoPE length is 131072 (b5bcd76 models/llama3/__init__.py:267
    for 8B), so 1 x 131072 tokens = 1 sequence of 131072, with a note. In a qwen3 folder meshplan holds no
    length: the line asks for the literal."""
    imp = _read(NEW, "llama3_8b_ctx", 1)
    t = imp.tables["training"]
    assert (t["seq_len"], t["micro_batch"]) == (131072, 1)
    assert any(n.startswith("model_spec.max_context_length read as 131072") for n in imp.notes)
    line = _error(_file(tmp_path, model="qwen3"), "llama3_8b_ctx", 1)
    assert "'1 * model_spec.max_context_length' is not read without running the file" in line


def test_unused_fields_optimizer_lr_and_cuda_graphs(tmp_path):
    """llama3_70b: default_adamw(lr=1.5e-4)'s lr is AdamW's (b5bcd76 components/optimizer/optimizer.py:378-398),
    which meshplan does not read: listed; disable_cuda_graphs=True is read by the pp check: not listed.
    OptimizersContainer.Config(lr=3e-4) (9810191's class, no name: AdamW) alike, with no 'not read' note
    (before: a note that it was not read, and lr not listed)."""
    imp = _read(NEW, "llama3_70b", 8)
    assert "optimizer.lr" in imp.unused and "training.disable_cuda_graphs" not in imp.unused
    path = _file(tmp_path, "optimizer=default_adamw(lr=3e-4)", "optimizer=OptimizersContainer.Config(lr=3e-4)")
    imp = _read(path, "llama3_8b", 1)
    assert "optimizer.lr" in imp.unused and not any(n.startswith("optimizer ") for n in imp.notes)
    assert imp.tables["training"]["optimizer"] == "adamw"
    # a keyword that is not a literal (param_groups naming the optimizer) is said not read, AdamW planned
    path.write_text(path.read_text().replace("Config(lr=3e-4)", "Config(lr=3e-4, param_groups=[ParamGroupConfig("
                                             "optimizer_name=\"Muon\")])"))
    assert "optimizer OptimizersContainer.Config's param_groups not read: planned as AdamW" in _read(
        path, "llama3_8b", 1).notes


def _plan(**training):
    data = tomllib.loads((DATA / "tt_70b_asynctp.toml").read_text())
    data["training"] |= training
    return build_plan(config_from_dict(data))


def test_reshard_note_cites_the_revision_planned():
    """pp 2 with fsdp_reshard_after_forward left at "default": planned false. As b5bcd76 runs it the rule is
    distributed/fsdp.py:124-133; as 238fa99 (9810191's names) models/llama3/infra/parallelize.py:324-327
    (``case "default": reshard_after_forward = not pp_enabled``)."""
    assert "torchtitan b5bcd76 distributed/fsdp.py:124-133" in reshard_default_note(_plan())
    note = reshard_default_note(_plan(op_sac_policy="238fa99", recompute="full"))
    assert "torchtitan 238fa99 models/llama3/infra/parallelize.py:324-327" in note and "b5bcd76" not in note


def test_vpp_hint_says_the_split_changes_form():
    """The config's split [20, 21, 20, 19] is per virtual stage (pp 2 x v 2); stage 0 holds virtual stages 0
    and 2 (20 + 20 = 40), stage 1 1 and 3 (21 + 19 = 40): the hint's per-stage [40, 40] says so."""
    assert _split_words(_plan()) == (", mesh.pp_layer_split [40, 40] (layers per stage, each stage's split into the "
                                     "chunks evenly; the config's [20, 21, 20, 19] is per virtual stage)")
