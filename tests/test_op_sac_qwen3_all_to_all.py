"""torchtitan 238fa99's Qwen3 op-level SAC save list (models/qwen3/infra/parallelize.py:39-54) has no
``all_to_all_single``: the MoE dispatch and combine (and the per-expert counts' exchange) are replayed
by the backward's recompute and their outputs not kept; deepseek_v3's list (line 41) and llama4's
(line 59) save it, as b5bcd76's one list does (activation_checkpoint.py _get_default_save_ops 31-94).
meshplan takes an MoE model without MLA or shared experts as Qwen3's
(meshplan.compute.recompute.op_sac_saves_all_to_all, op_replays_ep).

Mixtral-8x7B (32 MoE layers, h 4096, 8 experts top 2, no shared expert) at seq 4096, global batch 32
on 4 dgx-h100, dp_shard 32 x ep 8, recompute op: one micro-batch of 4096 tokens per rank; each
dispatch and combine moves 4096 x 2 x 4096 x 2 B = 64 MiB (balanced routing).
"""

from __future__ import annotations

import pytest

from meshplan.compute.recompute import op_replays_ep
from meshplan.config import config_from_dict
from meshplan.interop.tomlout import resolved
from meshplan.memory import workingset
from meshplan.memory.routed_sizes import routed_sizes
from meshplan.plan import build_plan
from meshplan.schedule import workload
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap


def _cfg(policy: str, model: str = "mixtral-8x7b", nodes: int = 4, shape=(32, 8)):
    return config_from_dict({
        "model": {"catalog": model}, "cluster": {"system": "dgx-h100", "nodes": nodes},
        "training": {"global_batch": 32, "seq_len": 4096, "recompute": "op", "op_sac_policy": policy,
                     "torch_compile": True},
        "mesh": {"names": ["dp_shard", "ep"], "shape": list(shape)}})


def _ep(plan):
    return {(r.phase, r.cadence.split(" (")[-1]): (r.per_microbatch, r.size_bytes)
            for r in plan.collectives["stage 0"] if r.axis == "ep" and r.op == "all-to-all"}


def test_rule_by_model_and_policy():
    """Mixtral (Qwen3's shape) at 238fa99: replayed; at b5bcd76: saved; DeepSeek-V2-Lite (MLA, shared
    experts) saved at both; no replay outside recompute op."""
    mix, ds = _cfg("238fa99"), _cfg("238fa99", "deepseek-v2-lite", 1, (8, 8))
    assert op_replays_ep(mix.model, mix.training)
    assert not op_replays_ep(mix.model, _cfg("b5bcd76").training)
    assert not op_replays_ep(ds.model, ds.training)
    assert not op_replays_ep(mix.model, mix.training.model_copy(update={"recompute": "full"}))


def test_table_replays_dispatch_combine_and_counts():
    """Backward all-to-alls per micro-batch: each MoE layer's dispatch and combine gradients, 32 x 2 =
    64, and at 238fa99 their replay, 32 x 2 more = 128, each 64 MiB; the counts' exchange (64 B: 8
    experts x int64) 32 forward, and 32 replayed at 238fa99, none at b5bcd76."""
    old, new = _ep(build_plan(_cfg("238fa99"))), _ep(build_plan(_cfg("b5bcd76")))
    mib64 = 4096 * 2 * 4096 * 2
    assert old[("backward", "every MoE layer")] == (128, mib64) and new[("backward", "every MoE layer")] == (64, mib64)
    assert old[("forward", "dispatch, combine)")] == new[("forward", "dispatch, combine)")] == (64, mib64)
    counts = "per-expert token counts, before the dispatch)"
    assert old[("backward", counts)] == (32, 64) and ("backward", counts) not in new


def test_kept_activations_drop_the_all_to_all_outputs(monkeypatch):
    """Per MoE layer, 238fa99 keeps none of the exchanged rows; with them saved (the rule patched to
    b5bcd76's) it keeps routed_sizes' last term, the dispatch's and combine's outputs: 2 x 64 MiB."""
    cfg = _cfg("238fa99")
    mesh = resolved(cfg)
    kept = workingset.layer_act_sizes(cfg.model, cfg.training, mesh, cfg.memory, moe=True).saved
    monkeypatch.setattr(workingset, "op_replays_ep", lambda model, training: False)
    saved = workingset.layer_act_sizes(cfg.model, cfg.training, mesh, cfg.memory, moe=True).saved
    exchanged = routed_sizes(cfg.model, cfg.training, mesh, 4096, 1, True)[3]
    assert exchanged == 2 * 4096 * 2 * 4096 * 2 and saved - kept == exchanged


def test_step_replays_them(monkeypatch):
    """The 238fa99 step is longer than the same plan with the all-to-alls saved, by at most the replayed
    calls' own seconds: 32 layers x (dispatch + combine + counts) per micro-batch, the table's row times."""
    plan = build_plan(_cfg("238fa99"))
    rows = {r.size_bytes: r.time_s for r in plan.collectives["stage 0"] if r.axis == "ep"}
    new = step_time(plan, Overlap()).step_s
    monkeypatch.setattr(workload, "op_replays_ep", lambda model, training: False)
    old = step_time(plan, Overlap()).step_s
    assert 0 < new - old <= 32 * (2 * rows[4096 * 2 * 4096 * 2] + rows[64]) * (1 + 1e-9)
