"""``export --to deepspeed`` of a plan read from a DeepSpeed JSON keeps the user's keys meshplan
does not plan (``steps_per_print``, ``optimizer``, ``scheduler``, ZeRO-3's bucket sizes, the
checkpointing section's own keys), as a torchtitan export keeps the job's other sections; to
another format they are listed, in one line, as not carried."""

from __future__ import annotations

import json

import pytest

from meshplan.cli import main
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import export, load_any, user_source
from tests.conftest import EXAMPLES

OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)

ZERO3 = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
         "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": 50000000,
                               "stage3_param_persistence_threshold": 100000},
         "bf16": {"enabled": True}, "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 0.0003, "betas": [0.9, 0.95]}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
         "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
         "steps_per_print": 10, "wall_clock_breakdown": False}


def _zero3(tmp_path):
    path = tmp_path / "ds_zero3.json"
    path.write_text(json.dumps(ZERO3))
    return path


def test_zero2_example_keeps_steps_per_print(tmp_path, capsys):
    src = EXAMPLES / "deepspeed_zero2_16xh100.json"
    out = tmp_path / "ds.json"
    with pytest.raises(SystemExit) as done:
        main(["export", str(src), "--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b", "--seq-len",
              "4096", "--to", "deepspeed", "-o", str(out)])
    assert not done.value.code
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["steps_per_print"] == 10  # was dropped
    assert f"carried unchanged from {src}: steps_per_print" in text
    assert "not expressed" not in text  # the carried key changes nothing meshplan plans
    user = json.loads(src.read_text())
    assert {k: doc[k] for k in user} == user  # every key of the example, with the values it had


def test_zero3_carries_every_key_meshplan_does_not_plan(tmp_path):
    path = _zero3(tmp_path)
    cfg = load_any(path, opts=OPTS)
    text, head = export(cfg, "deepspeed", str(path), user_source(path))
    doc = json.loads(text)
    for key in ("optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown"):
        assert doc[key] == ZERO3[key], key
    # stage 3 does not read overlap_comm (ZeRO-1/2's engine does): the user's value stays
    assert doc["zero_optimization"] == ZERO3["zero_optimization"]
    # recompute full (the section's presence) written back with the section's own keys
    assert doc["activation_checkpointing"] == ZERO3["activation_checkpointing"]
    assert (f"carried unchanged from {path}: zero_optimization.overlap_comm, "
            "zero_optimization.stage3_prefetch_bucket_size, zero_optimization.stage3_param_persistence_threshold, "
            "optimizer.type, optimizer.params.lr, optimizer.params.betas, scheduler.type, "
            "scheduler.params.warmup_num_steps, activation_checkpointing.partition_activations, "
            "activation_checkpointing.contiguous_memory_optimization, steps_per_print, wall_clock_breakdown") in head
    assert not [h for h in head if h.startswith("not expressed")]


def test_to_another_format_lists_what_is_not_carried(tmp_path):
    path = _zero3(tmp_path)
    cfg = load_any(path, opts=OPTS)
    _, head = export(cfg, "torchtitan", str(path), user_source(path))
    assert [h for h in head if h.startswith("not carried")] == [
        "not carried to torchtitan: the DeepSpeed settings meshplan does not plan: zero_optimization.overlap_comm, "
        "zero_optimization.stage3_prefetch_bucket_size, zero_optimization.stage3_param_persistence_threshold, "
        "optimizer.type, optimizer.params.lr, optimizer.params.betas, scheduler.type, "
        "scheduler.params.warmup_num_steps, activation_checkpointing.partition_activations, "
        "activation_checkpointing.contiguous_memory_optimization, steps_per_print, wall_clock_breakdown"]


def test_a_meshplan_toml_has_nothing_to_carry(tmp_path):
    assert user_source(EXAMPLES / "seed-64gpu.toml") is None
