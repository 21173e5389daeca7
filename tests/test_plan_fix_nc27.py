"""Newcomer trial 27 (256 A100 80GB, torchtitan, a dense ~30B model): the memory ``fix:`` line
(:func:`meshplan.plan_fix.memory_fix`). #A: under DDP (sharding none) it offers sharding; #B: it
offers re-splitting HSDP's data axes and never offers a variant over usable memory as a fix; #C: a
fitting variant with under 15% of usable memory free is marked tight and listed after those that
keep it (the search's headroom rule, :func:`meshplan.memory.headroom.tight`). Each printed peak and
step is the plan (and ``step``) of the config edited by hand, as tests/test_plan_fix.py checks."""

from __future__ import annotations

from dataclasses import replace

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.schedule.steptime import step_time
from meshplan.units import GiB

#: The trial's 30B model (its hsdp_full.toml): 60 layers, hidden 7168, ffn 20480, 56 q / 8 kv heads.
MODEL30 = {"name": "llama-30b-ish", "layers": 60, "hidden": 7168, "ffn": 20480, "gated_mlp": True, "q_heads": 56,
           "kv_heads": 8, "head_dim": 128, "vocab": 128256, "tied_embeddings": False, "norm": "rmsnorm",
           "position_embedding": "rope", "max_position": 8192}


def _gib(plan) -> str:
    return f"{plan.timeline.peak.total_bytes / GiB:.1f} GiB"


def _step(plan) -> str:
    return f"step {step_time(plan).step_s:.1f} s"


def _ddp(framework: str = "torch", **mesh):
    return config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 4},
        "training": {"global_batch": 64, "seq_len": 2048, "micro_batch": 1, "sharding": "none", "recompute": "full",
                     "framework": framework},
        "mesh": mesh or {"names": ["dp_replicate"], "shape": [32]}})


def test_ddp_over_memory_is_offered_sharding_over_every_data_rank():
    """#A, the trial's ddp4.toml: Llama-3-8B (8.03e9 parameters) under DDP over dp_replicate 32 on 4
    dgx-a100 peaks at 121.8 GiB (> 71.3 usable: the A100 80GB's runtime total 79.25 GiB x 0.9 = 71.325 GiB). The line said nothing fits on up to 4
    nodes: its zero3 variant kept dp_replicate, a replica axis, and sharded nothing. ZeRO-3 over the 32
    data ranks holds 1/32 of fp32 parameters, gradients and Adam's two moments, 16 B x 8.03e9 / 32 =
    4.0e9 B = 3.7 GiB of state a rank: the trial's own fsdp4.toml (dp_shard 32, zero3), whose plan the
    user printed at 8.73 GiB. torch has no zero1 engine (has_zero1_engine): zero3 alone is offered."""
    cfg = _ddp()
    p = build_plan(cfg)
    assert not p.feasible and _gib(p) == "121.8 GiB" and p.timeline.usable_bytes == 79.25 * 2**30 * 0.9
    z3 = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["dp_shard"]}),
                            training=cfg.training.model_copy(update={"sharding": "zero3"})))
    assert z3.feasible and round(z3.timeline.peak.total_bytes / GiB, 2) == 8.73
    assert memory_fix(p) == f"fix: sharding zero3 (dp_shard 32) -> peak 8.7 GiB (fits; {_step(z3)}) (usable 71.3 GiB)"


def test_megatron_ddp_is_offered_its_distributed_optimizer_too():
    """Under framework megatron, zero1 (Megatron-LM's distributed optimizer) runs too: both fit,
    zero3 (the state all sharded) and zero1 (optimizer state and master copy sharded, bf16 parameters
    and gradients whole), the faster first; each peak the plan of the config edited by hand."""
    cfg = _ddp("megatron")
    p = build_plan(cfg)
    z1, z3 = (build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["dp_shard"]}),
                                 training=cfg.training.model_copy(update={"sharding": s}))) for s in ("zero1", "zero3"))
    assert z1.feasible and z3.feasible and z3.timeline.peak.total_bytes < z1.timeline.peak.total_bytes
    first, second = sorted((z1, z3), key=lambda q: step_time(q).step_s)
    words = {id(z1): "sharding zero1 (dp_shard 32)", id(z3): "sharding zero3 (dp_shard 32)"}
    assert memory_fix(p) == (f"fix: {words[id(first)]} -> peak {_gib(first)} (fits; {_step(first)}); "
                             f"{words[id(second)]} -> peak {_gib(second)} (fits; {_step(second)}) (usable 71.3 GiB)")


def test_hsdp_over_memory_is_offered_its_data_axes_re_split_and_no_variant_over_usable():
    """#B, the trial's hsdp_full.toml: the 30B model at dp_replicate 32 x dp_shard 8 on 32 dgx-a100,
    seq 8192, recompute full, peaks at 81.0 GiB. The line offered tp x2 (dp_replicate 32 x dp_shard 4
    x tp 2) at 73.6 GiB, over the usable (67.1 GiB then; 79.25 x 0.9 = 71.3 GiB now), then 64 nodes. dp_replicate 16 x dp_shard 16 (the same
    256 ranks, the state sharded 16 ways, not 8) fits on the same 32 nodes: the trial's hsdp16.toml."""
    cfg = config_from_dict({
        "model": MODEL30, "cluster": {"system": "dgx-a100", "nodes": 32},
        "training": {"global_batch": 512, "seq_len": 8192, "micro_batch": 1, "sharding": "hsdp", "recompute": "full",
                     "memory_reserve": 0.10},
        "mesh": {"names": ["dp_replicate", "dp_shard"], "shape": [32, 8]}})
    p = build_plan(cfg)
    assert not p.feasible and _gib(p) == "81.0 GiB"
    tp2 = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["dp_replicate", "dp_shard", "tp"],
                                                                    "shape": [32, 4, 2], "sequence_parallel": True})))
    assert not tp2.feasible and _gib(tp2) == "73.6 GiB"
    r16 = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [16, 16]})))
    assert r16.feasible
    line = memory_fix(p)
    assert line == (f"fix: dp_replicate 16 x dp_shard 16 (the data axes re-split on the same nodes) -> peak {_gib(r16)} "
                    f"(fits; {_step(r16)}) (usable 71.3 GiB)")
    assert "73.6" not in line


def test_a_tight_variant_is_marked():
    """#C: Llama-3-8B at seq 8192, micro-batch 2, dp_shard 8 on one dgx-h100 peaks at 106.4 GiB. Its
    micro-batch 1 variant fits at 63.1 GiB of 71.20 usable (the H100's runtime total 79.11 GiB x 0.9):
    71.20 - 63.12 = 8.08 GiB = 11.3% free, under the search's 15% (tight, marked; 3.94 GiB = 5.9% of the
    datasheet's 67.06 GiB before); recompute full fits with more than 15% free (unmarked). The
    line keeps its order, the fastest first."""
    cfg = config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 16, "seq_len": 8192, "micro_batch": 2, "sharding": "zero3", "recompute": "none"},
        "mesh": {"names": ["dp_shard"], "shape": [8]}})
    p = build_plan(cfg)
    mb1 = build_plan(replace(cfg, training=cfg.training.model_copy(update={"micro_batch": 1})))
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    assert not p.feasible and mb1.feasible and full.feasible
    usable = 79.11 * 2**30 * 0.9
    free = usable - mb1.timeline.peak.total_bytes
    assert (round(free / GiB, 2), round(free / usable, 3)) == (8.08, 0.113)
    assert full.timeline.peak.total_bytes < 0.85 * usable
    line = memory_fix(p)
    mine = f"micro_batch 1 -> peak 63.1 GiB (fits; {_step(mb1)}; tight: 8.1 GiB = 11.3% of the usable 71.2 GiB free, under 15%)"
    assert mine in line and f"recompute full -> peak {_gib(full)} (fits; {_step(full)})" in line
    first, _ = sorted((mb1, full), key=lambda q: step_time(q).step_s)
    assert line.startswith("fix: micro_batch 1" if first is mb1 else "fix: recompute full")
