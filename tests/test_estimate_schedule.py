"""The first peak estimate (meshplan.memory.constraints.estimate: the capacity and context rows, the
axis reasons) counts the pipeline schedule's own micro-batches in flight, not 1F1B's (issue 11,
zero-bubble follow-up): GPipe holds all m, ZB-H1 min(m, p) on every stage (its W lags), DualPipeV
2p + 1 half-stage chunks.

The 8-layer model of tests/test_search.py (h 2048, 16 query and 4 KV heads of 128, ffn 5632) on
pp 4 x tp 2 with SP, 2 layers a stage, micro-batch 1, seq 2048, m 8, no recompute."""

from __future__ import annotations

from meshplan.config import config_from_dict
from meshplan.memory.activations import layer_bytes
from meshplan.memory.constraints import estimate
from meshplan.memory.layer_dims import LayerDims
from meshplan.mesh.layers import balanced_split, stage_layers
from meshplan.plan import build_plan
from test_search import SMALL


def _config(schedule: str = "1f1b", vpp: int = 1):
    mesh = {"names": ["pp", "tp"], "shape": [4, 2], "sequence_parallel": True, "pp_schedule": schedule}
    if vpp > 1:
        mesh["virtual_stages"] = vpp
    return config_from_dict({"model": SMALL, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 8, "seq_len": 2048, "micro_batch": 1, "recompute": "none"},
                             "mesh": mesh})


def _stage_acts(schedule: str) -> dict:
    """Activation bytes of the estimate's most loaded stage under ``schedule``, with that stage."""
    plan = build_plan(_config(schedule), memory=False)
    c = plan.config
    stages = stage_layers(8, 4, split=balanced_split(8, 4))
    e = estimate(c.model, c.training, plan.mesh, stages, 8, schedule)
    return {"stage": e.stage, "act": e.activation_bytes}


#: One layer's activations at tp 2 with SP, no recompute, flash (Korthikanti's terms, memory.activations.layer_bytes,
#: tested there); the embedding's int64 token ids 8 x 2048 = 16,384 B; the head's: final-norm and output-layer inputs
#: 2 x 2048 x 2048 / 2 x 2 B = 8,388,608, fp32 logits 4 x 2048 x 32,000 / 2 = 131,072,000, loss terms 13 x 2048 =
#: 26,624: 139,487,232 B.
EMB, HEAD = 16_384, 139_487_232


def _one() -> int:
    dims = LayerDims.from_model(build_plan(_config(), memory=False).config.model, 2048, 1)
    return layer_bytes(dims, recompute="none", tp=2, sp=True, flash=True)


def test_schedules_own_in_flight_by_hand():
    """1F1B: stage 0 the most loaded, 4 micro-batches x 2 layers + the embedding's (stage 3 holds 1 x 2 + the
    head's, less). ZB-H1: 4 x 2 on every stage, so the head's stage 3 leads with 8 layers + the head's. GPipe:
    all 8 micro-batches x 2 layers on every stage, stage 3 again: 16 layers + the head's."""
    one = _one()
    a1, az, ag = _stage_acts("1f1b"), _stage_acts("zb_h1"), _stage_acts("gpipe")
    assert a1 == {"stage": 0, "act": 8 * one + EMB}
    assert az == {"stage": 3, "act": 8 * one + HEAD}
    assert ag == {"stage": 3, "act": 16 * one + HEAD}


def test_plans_estimate_uses_its_schedule():
    """The plan's annotated estimate (plan.constraints.estimate) is its schedule's: GPipe's as above."""
    e = build_plan(_config("gpipe")).constraints.estimate
    assert (e.stage, e.activation_bytes) == (3, 16 * _one() + HEAD)
