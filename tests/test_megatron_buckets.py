"""Megatron-LM's DDP buffer buckets (meshplan.comm.megatron_buckets) against Megatron-LM's own code
(NVIDIA/Megatron-LM d98e8a6): the bucket cap counts the cp ranks."""

from __future__ import annotations

from meshplan.config import config_from_dict
from meshplan.plan import build_plan

TRAINING = {"global_batch": 64, "seq_len": 8192, "micro_batch": 1, "sharding": "zero1", "recompute": "selective",
            "param_dtype": "bf16", "compute_dtype": "bf16", "grad_reduce_dtype": "fp32", "framework": "megatron",
            "overlap_grad_reduce": True, "flash_attention": True}


def test_bucket_cap_counts_the_cp_ranks_as_megatron_lm_resolves_it():
    """``get_model`` resolves ``bucket_size = max(40_000_000, 1_000_000 x |dp_cp|)``
    (megatron/training/training.py ``resolve_ddp_bucket_size``, lines 2179-2193, called at 2497 with
    ``pg_collection.dp_cp``) before DDP's own default over dp alone could apply. Llama 3 8B, dp_shard 8
    x cp 8 x tp 2 on 128 H100 (pp 1: stage 0's one chunk, bucketed): B = max(4e7, 1e6 x 64) = 6.4e7
    elements (dp alone, 8, would give 4e7: 100 buckets). The rank's elements: 8,030,261,248 less the
    replicated norms (32 x 2 x 4096 + 4096 = 266,240) halved over tp 2, plus the norms:
    4,014,997,504 + 266,240 = 4,015,263,744 = 62 x 6.4e7 + 47,263,744. Reduce-scatters in fp32
    (4 B): 62 of 256,000,000 B and one of 189,054,976 B; the all-gathers in bf16 (2 B): 62 of
    128,000,000 B and one of 94,527,488 B."""
    mesh = {"names": ["dp_shard", "cp", "tp"], "shape": [8, 8, 2], "sequence_parallel": True}
    plan = build_plan(config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 16},
                                        "training": TRAINING, "mesh": mesh}))
    rows = {(r.op, r.size_bytes, r.per_step) for r in plan.collectives["stage 0"]
            if r.phase == "step" and r.axis == "fsdp"}
    assert rows == {("reduce-scatter", 256_000_000, 62), ("reduce-scatter", 189_054_976, 1),
                    ("all-gather", 128_000_000, 62), ("all-gather", 94_527_488, 1)}


def test_zero2_buckets_split_by_the_same_cap():
    """ZeRO-2's per-micro-batch reduce-scatters (comm.dp_rows._zero2_rows) split the stage's gradients
    with the same cap and split as Megatron's buckets (megatron_buckets.bucket_cap, split_buckets):
    Llama 3 8B over dp_shard 8 (8 H100, tp 1): B = max(4e7, 1e6 x 8) = 4e7; 8,030,261,248 elements =
    200 x 4e7 + 30,261,248, reduced in fp32 (4 B): 200 of 160,000,000 B and one of 121,044,992 B, each
    in every micro-batch."""
    training = {**TRAINING, "framework": "torch", "sharding": "zero2", "overlap_grad_reduce": False,
                "reduce_dtype": "fp32"}
    del training["grad_reduce_dtype"]
    plan = build_plan(config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                                        "training": training, "mesh": {"names": ["dp_shard"], "shape": [8]}}))
    rows = {(r.size_bytes, r.per_microbatch) for r in plan.collectives["stage 0"]
            if r.op == "reduce-scatter" and r.phase == "backward" and r.axis == "dp_shard"}
    assert rows == {(160_000_000, 200), (121_044_992, 1)}
