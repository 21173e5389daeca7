"""Full AC under eager torch replays the whole block, its closing TP collective too: torchtitan wraps
each block with ``ptd_checkpoint_wrapper(..., early_stop=False)`` since 25413d2 (#1580): 238fa99
``config/job_config.py``:675 ``early_stop: bool = False`` passed at ``distributed/activation_checkpoint.py``
45, 135, 154; b5bcd76 ``activation_checkpoint.py``:180 and 285 pass ``early_stop=False``. torch 2.13
``utils/checkpoint.py`` 1128-1131 stop the recompute early only when the frame's ``early_stop`` is set.
Compiled, AOTAutograd's partitioner keeps only what the backward reads (the MLP's closing collective
and w_down go); Megatron-LM's CheckpointFunction re-runs everything
(meshplan.compute.recompute.full_ac_replays_whole, the one rule).

Llama 3 8B (32 layers), dp_shard 2 x tp 4 without sequence parallelism (each block closes with an
all-reduce: 2 a layer forward), seq 8192, global batch 8 on one dgx-h100 (1 micro-batch per rank).
"""

from __future__ import annotations

from meshplan.compute.ops import Workload
from meshplan.compute.recompute import full_ac_not_replayed, full_ac_replays_whole
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule import layer_timeline
from meshplan.schedule.layer_timeline import replay_scatters
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap


def _plan(compiled: bool, model: str = "llama3-8b", names=("dp_shard", "tp"), shape=(2, 4), nodes: int = 1):
    return build_plan(config_from_dict({
        "model": {"catalog": model}, "cluster": {"system": "dgx-h100", "nodes": nodes},
        "training": {"global_batch": 8, "seq_len": 8192, "recompute": "full", "torch_compile": compiled},
        "mesh": {"names": list(names), "shape": list(shape)}}))


def test_the_rule():
    """Eager torch and Megatron-LM replay the whole layer; compiled torch leaves out w_down, the async-TP
    partial sum after it and the scatter's layout copy (was: eager left out the copy and the partial
    sum, torch's default early stop)."""
    assert full_ac_replays_whole(True, False) and full_ac_replays_whole(False, True)
    assert not full_ac_replays_whole(False, False)
    assert full_ac_not_replayed(Workload(seq_len=8, torch_eager=True)) == ()
    assert full_ac_not_replayed(Workload(seq_len=8)) == ("SP layout copy (scatter, mlp)",
                                                        "async-TP partial sum (w_down)", "w_down")
    eager, compiled = Workload(seq_len=8, recompute="full", torch_eager=True), Workload(seq_len=8, recompute="full")
    assert replay_scatters(eager, "backward_input") == (True, True)
    assert replay_scatters(compiled, "backward_input") == (True, False)


def test_table_counts_the_replayed_closing_all_reduce():
    """Per micro-batch, backward tp all-reduces: each layer mirrors its 2 forward ones and replays
    them, compiled all but the MLP's closing one: 32 x (2 + 1) + 1 = 97, eager 32 x (2 + 2) + 1 = 129
    (the +1 outside the layers, as the forward's 65 = 32 x 2 + 1)."""
    def rows(compiled):
        return {r.phase: r.per_microbatch for r in _plan(compiled).collectives["stage 0"]
                if r.axis == "tp" and r.op == "all-reduce"}
    assert rows(True)["forward"] == rows(False)["forward"] == 65
    assert rows(True)["backward"] == 97 and rows(False)["backward"] == 129


def test_eager_step_replays_one_all_reduce_more_a_layer(monkeypatch):
    """Llama 3 70B (80 layers) dp_shard 4 x tp 8 on 4 dgx-h100, eager full AC, 2 micro-batches per
    rank: the timeline with the replayed closing all-reduce (128 MiB: 8192 x 8192 x 2 B) against the
    same timeline under the earlier rule (eager stops early) is longer, by at most the 80 x 2 extra
    all-reduces' own seconds (each the table's row time; some of it may hide behind other streams)."""
    plan = _plan(False, "llama3-70b", shape=(4, 8), nodes=4)
    (ar,) = [r for r in plan.collectives["stage 0"] if r.axis == "tp" and r.op == "all-reduce" and r.phase == "backward"]
    assert ar.size_bytes == 8192 * 8192 * 2
    new = step_time(plan, Overlap()).step_s
    monkeypatch.setattr(layer_timeline, "full_ac_replays_whole", lambda megatron, eager: megatron)
    old = step_time(plan, Overlap()).step_s
    assert 0 < new - old <= 80 * 2 * ar.time_s * (1 + 1e-9)


def test_compiled_unchanged(monkeypatch):
    """Compiled torch keeps its replay: the step is the same under the earlier rule (only eager moved)."""
    plan = _plan(True, "llama3-70b", shape=(4, 8), nodes=4)
    new = step_time(plan, Overlap()).step_s
    monkeypatch.setattr(layer_timeline, "full_ac_replays_whole", lambda megatron, eager: megatron)
    assert step_time(plan, Overlap()).step_s == new
