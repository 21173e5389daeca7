"""DeepSpeed ZeRO-3's prefetch in the step (newcomer, zero3knobs item 1): ``[memory]
deepspeed_prefetch_elements`` (``stage3_prefetch_bucket_size``) 0 turns the coordinator's prefetch
off (``partitioned_param_coordinator.py:452``, ``if self.__prefetch_bucket_sz > 0``), so every
all-gather is issued when its module needs it and the compute waits for all of it; any other
bucket lets the frontier run ahead to ``stage3_max_live_parameters``
(:func:`meshplan.spec.deepspeed_memory.deepspeed_prefetch_ahead`).

A tiny Llama-style model: 4 layers, hidden 1024, gated FFN 4096, 8 heads, vocab 1024, on 2
dgx-a100 (dp_shard 16), seq 512, global batch 16 (one micro-batch per step), bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.comm_times import CommTimes, nccl_sm_share
from meshplan.schedule.overlap_policy import plan_overlap
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.spec.deepspeed_memory import deepspeed_prefetch_ahead

TOML = """
[model]
name = "tiny"
layers = 4
hidden = 1024
ffn = 4096
gated_mlp = true
q_heads = 8
vocab = 1024

[cluster]
system = "dgx-a100"
nodes = 2

[training]
global_batch = 16
seq_len = 512
micro_batch = 1
sharding = "zero3"
zero3_engine = "deepspeed"
param_dtype = "bf16"
compute_dtype = "bf16"
recompute = "none"

[mesh]
names = ["dp_shard"]
shape = [16]
"""

#: a layer: 4 x 1024^2 (q, k, v, o) + 3 x 1024 x 4096 (gate, up, down) + 2 x 1024 (norms) parameters, 2 B each
LAYER_BYTES = (4 * 1024 ** 2 + 3 * 1024 * 4096 + 2 * 1024) * 2


def _plan(tmp_path, bucket):
    f = tmp_path / "tiny.toml"
    f.write_text(TOML)
    cfg = load_config(f)
    return build_plan(replace(cfg, memory=cfg.memory.model_copy(update={"deepspeed_prefetch_elements": bucket})))


def _forward(plan):
    """The forward unit of stage 0's one micro-batch, with the overlap the step uses."""
    rows = plan.stage(0).collectives
    w = workload_of(plan, False)
    comm = CommTimes.from_rows(rows, len(plan.stages[0][0]), nccl_sm_share(plan.config.cluster))
    return forward_unit(chunk_costs(plan, w)[0][0], comm, w, plan_overlap(plan.config, rows)), rows


def test_bucket_zero_exposes_every_forward_all_gather(tmp_path):
    """Bucket 0: nothing is prefetched, each gather is issued when its unit starts and the compute
    waits for it: the forward exposes exactly the sum of its all-gathers, the embedding's, the 4
    layers' and the [norm, output] unit's (33,558,528 B per layer: 4 x 1024^2 + 3 x 1024 x 4096 +
    2 x 1024 parameters x 2 B). Any bucket (1 element) prefetches: max live 1e9 elements (2e9 B)
    holds (2e9 - 33,558,528) / 33,558,528 = 58.6 layers past the one computed, so all 4 are issued
    behind the embedding's gather and the forward exposes less."""
    plan = _plan(tmp_path, 0)
    unit, rows = _forward(plan)
    gathers = [r for r in rows if r.phase == "forward" and r.op == "all-gather"]
    assert [r.size_bytes for r in gathers if r.cadence == "every layer"] == [LAYER_BYTES]
    every = sum(r.time_s * r.per_microbatch for r in gathers)
    assert unit.exposed_s["fsdp"] == pytest.approx(every, rel=1e-12)
    assert deepspeed_prefetch_ahead((2, 2 * 10**9), LAYER_BYTES) == pytest.approx((2e9 - LAYER_BYTES) / LAYER_BYTES)
    ahead, _ = _forward(_plan(tmp_path, 1))
    assert ahead.exposed_s["fsdp"] < every / 2


def test_bucket_zero_steps_slower_than_a_prefetching_bucket(tmp_path):
    """The whole step: bucket 0 exposes more than 1 and 5e7 (DeepSpeed's default), which prefetch
    alike (both run ahead to max live); the step difference is at least the forward's gathers
    hidden. Before this change the step always prefetched one layer, and bucket 0 was the fastest
    (no coalesced copy-out at all)."""
    s0, s1, s_default = (step_time(_plan(tmp_path, b)) for b in (0, 1, None))
    assert s0.exposed_s["fsdp"] > s1.exposed_s["fsdp"] and s0.step_s > s1.step_s
    assert s1.step_s <= s_default.step_s  # the default's coalesced prefetches copy out more (torch.cat)


def test_step_names_the_prefetch_it_models(tmp_path, capsys):
    """``meshplan step`` says which prefetch it modelled: none at bucket 0; at DeepSpeed's default
    (5e7, max live 1e9) the 58.75 layers past the one computed: max live's 2e9 B less the layer,
    58 layers and 20,046,848 B, run on to the end of the up projection that reaches it (2 x 2,048 +
    4 x 2,097,152 + 2 x 8,388,608 = 25,169,920 B into the layer; coordinator :457), 58.60 before
    that run was modelled."""
    from tests.cli_run import run_main
    f = tmp_path / "tiny.toml"
    f.write_text(TOML)
    run_main("step", str(f))
    assert ("note: DeepSpeed ZeRO-3 prefetch (stage3_prefetch_bucket_size 5e7, max live 1e9 elements): 58.75 layers "
            "gathered past the one computed") in capsys.readouterr().out
    f.write_text(TOML.replace("[mesh]", "[memory]\ndeepspeed_prefetch_elements = 0\n\n[mesh]"))
    run_main("step", str(f))
    assert "note: DeepSpeed ZeRO-3 prefetch: none (stage3_prefetch_bucket_size 0)" in capsys.readouterr().out
