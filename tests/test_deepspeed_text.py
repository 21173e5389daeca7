"""A DeepSpeed user's view. ``export --to deepspeed`` of a plan read from a DeepSpeed JSON keeps the
user's keys meshplan does not plan (``steps_per_print``, ``optimizer``, ``scheduler``, ZeRO-3's
bucket sizes, the checkpointing section's own keys), as a torchtitan export keeps the job's other
sections; to another format they are listed, in one line, as not carried. And the plan, memory
and step text speak DeepSpeed's words (meshplan.spec.wording)."""

from __future__ import annotations

import json

import pytest

from meshplan.cli import main
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, user_source
from meshplan.interop.foreign import load_any
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
    # stage 3 reads overlap_comm (its streams) and stage3_prefetch_bucket_size ([memory]) and writes them back;
    # the persistence sizes stay
    assert doc["zero_optimization"] == ZERO3["zero_optimization"]
    # recompute full (the section's presence) written back with the section's own keys
    assert doc["activation_checkpointing"] == ZERO3["activation_checkpointing"]
    assert (f"carried unchanged from {path}: "
            "zero_optimization.stage3_param_persistence_threshold, "
            "optimizer.type, optimizer.params.lr, optimizer.params.betas, scheduler.type, "
            "scheduler.params.warmup_num_steps, activation_checkpointing.partition_activations, "
            "activation_checkpointing.contiguous_memory_optimization, steps_per_print, wall_clock_breakdown") in head
    assert not [h for h in head if h.startswith("not expressed")]


def test_to_another_format_lists_what_is_not_carried(tmp_path):
    path = _zero3(tmp_path)
    cfg = load_any(path, opts=OPTS)
    _, head = export(cfg, "torchtitan", str(path), user_source(path))
    assert [h for h in head if h.startswith("not carried")] == [
        "not carried to torchtitan: the DeepSpeed settings meshplan does not plan: "
        "zero_optimization.stage3_param_persistence_threshold, "
        "optimizer.type, optimizer.params.lr, optimizer.params.betas, scheduler.type, "
        "scheduler.params.warmup_num_steps, activation_checkpointing.partition_activations, "
        "activation_checkpointing.contiguous_memory_optimization, steps_per_print, wall_clock_breakdown"]


def test_a_meshplan_toml_has_nothing_to_carry(tmp_path):
    assert user_source(EXAMPLES / "seed-64gpu.toml") is None


# The text of a DeepSpeed plan in DeepSpeed's words (meshplan.spec.wording): activation
# checkpointing, ZeRO stage N partitioning over the data-parallel group; never Megatron-LM's
# recompute flags nor "sharded over fsdp".

def _out(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    assert not done.value.code
    return " ".join(capsys.readouterr().out.split())  # rich wraps long lines


DS_OPTS = ["--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b", "--seq-len", "4096"]


def test_zero3_plan_memory_and_step_speak_deepspeed(tmp_path, capsys):
    path = _zero3(tmp_path)
    plan = _out(["plan", path, *DS_OPTS], capsys)
    assert ("sharding zero3 (DeepSpeed ZeRO stage 3: partitions the optimizer states, gradients and parameters "
            "over the data-parallel group), recompute full (DeepSpeed activation checkpointing "
            "(deepspeed.checkpointing.checkpoint on every transformer layer") in plan
    assert "ZeRO stage 3 partitions over the data-parallel group" in plan
    assert plan.count("data-parallel group (16)") == 4  # params, grads, master, optimizer
    assert "Megatron-LM full recompute" not in plan and "fsdp (16)" not in plan
    memory = _out(["memory", path, *DS_OPTS, "--out", tmp_path / "mem"], capsys)
    assert "activations: DeepSpeed activation checkpointing" in memory and "Megatron-LM" not in memory
    step = _out(["step", path, *DS_OPTS], capsys)
    assert "recompute: DeepSpeed activation checkpointing (deepspeed.checkpointing.checkpoint" in step


def test_zero2_example_speaks_deepspeed(capsys):
    plan = _out(["plan", EXAMPLES / "deepspeed_zero2_16xh100.json", *DS_OPTS], capsys)
    assert "sharding zero2 (DeepSpeed ZeRO stage 2: partitions the optimizer states and gradients" in plan
    assert "recompute none (no activation checkpointing)" in plan  # the JSON has no activation_checkpointing
    # stage 2 keeps the parameters whole on every rank
    assert plan.count("data-parallel group (16)") == 3 and "not partitioned" in plan
    assert "Megatron-LM selective recompute" not in plan and "fsdp (16)" not in plan


def test_megatron_deepspeed_keeps_megatrons_recompute_words():
    """Megatron-LM with DeepSpeed's ZeRO-1/2 engine (Megatron-DeepSpeed): its flags choose the
    recompute, DeepSpeed partitions the state."""
    from meshplan.spec.training import TrainingSpec
    from meshplan.spec.recompute_words import recompute_words
    from meshplan.spec.wording import runtime, state_cell
    t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed", framework="megatron",
                     recompute="full")
    assert recompute_words(t, runtime(t)).startswith("Megatron-LM full recompute")
    assert state_cell(t, "fsdp", 8) == "data-parallel group (8)"
    torch = t.model_copy(update={"framework": "torch", "zero12_engine": "megatron"})
    assert state_cell(torch, "fsdp", 8) == "fsdp (8)" and torch.recompute_name == recompute_words(torch, "torch")
