"""DeepSpeed ZeRO-3's prefetch in the memory timeline agrees with the step's (dsmemprefetch): both
read :func:`meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes`. The coordinator's
``__n_available_params`` (deepspeedai/DeepSpeed edaa722 ``partitioned_param_coordinator.py``)
counts every parameter gathered on demand or prefetched, from its issue to its module's release,
and each fetch tops the prefetch up to ``stage3_max_live_parameters``: the layer computed plus
the layers prefetched hold max live at once (bucket > 0 and max live above a layer), one layer
without prefetch.

The tiny Llama-style model of ``test_deepspeed_prefetch_step`` (4 layers of 33,558,528 B =
16,779,264 bf16 parameters, dp_shard 16): the largest sum of the layers' gathered-parameter
events held while a layer computes in the first forward, by hand (the torch.cat copy at a
prefetched layer's wait is a transient beside it, DeepSpeed's count of ``ds_numel`` leaves it out).
The embedding's fetch, the first, prefetches max live less the embedding (2,097,152 B)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.overlap_policy import plan_overlap
from tests.test_deepspeed_prefetch_step import LAYER_BYTES, TOML

L = LAYER_BYTES  # 33,558,528 B
N = LAYER_BYTES // 2  # 16,779,264 parameters a layer


def _plan(tmp_path, bucket: int, live: int):
    """The tiny model at ``bucket`` and ``live`` elements, ``stage3_max_reuse_distance`` 0: the
    prefetch window alone (DeepSpeed's default 1e9 keeps every layer of this model gathered from
    its forward to its backward, tests/test_deepspeed_reuse_step.py)."""
    f = tmp_path / "tiny.toml"
    f.write_text(TOML)
    cfg = load_config(f)
    upd = {"deepspeed_prefetch_elements": bucket, "deepspeed_max_live_elements": live, "deepspeed_max_reuse_elements": 0}
    return build_plan(replace(cfg, memory=cfg.memory.model_copy(update=upd)))


def _layer_events(plan) -> list:
    return [e for e in plan.timeline.events() if e.phase == "forward" and e.microbatch == 0
            and e.kind == "gathered_params" and e.layer is not None]


def _held_max(plan) -> int:
    """The most gathered parameters (every unit's) held while a layer computes: the running sum of
    the first forward's gathered-parameter events just before each layer's release."""
    held, top = 0, 0
    for e in plan.timeline.events():
        if e.phase != "forward" or e.microbatch != 0 or e.kind != "gathered_params":
            continue
        if e.layer is not None and e.label.endswith("released (partitioned again) after forward"):
            top = max(top, held)
        held += e.delta_bytes
    return top


@pytest.mark.parametrize("bucket, live, ahead, held, cat", [
    # bucket 0 (coordinator :452, no prefetch): each layer gathered on demand, one layer held, no torch.cat
    (0, 4 * N, 0, L, None),
    # max live one layer (16,779,264 elements): no room past the layer computed
    (5 * 10**7, N, 0, L, None),
    # max live 2 layers, bucket 5e6: the next layer gathered (2 x 33,558,528 = 67,117,056 B);
    # torch.cat copies one bucket, 5e6 x 2 B, of each prefetched layer
    (5 * 10**6, 2 * N, 1, 2 * L, 10**7),
    # max live 4 layers: 3 ahead, 4 x 33,558,528 = 134,234,112 B, whatever the bucket beyond 0
    (5 * 10**6, 4 * N, 3, 4 * L, 10**7),
    # bucket 5e8 (1e9 B): the same 4 layers; its copy-out counted as a whole layer, min(L, 1e9, 3 L)
    (5 * 10**8, 4 * N, 3, 4 * L, L),
])
def test_memory_holds_what_the_steps_prefetch_holds(tmp_path, bucket, live, ahead, held, cat):
    plan = _plan(tmp_path, bucket, live)
    rows = plan.stage(0).collectives
    overlap = plan_overlap(plan.config, rows)
    assert (overlap.fsdp_prefetch, overlap.fsdp_ahead if overlap.fsdp_prefetch else 0.0) == (ahead > 0, ahead)
    assert _held_max(plan) == held == L * (1 + ahead)
    cats = {e.delta_bytes for e in _layer_events(plan) if "(torch.cat)" in e.label}
    assert cats == ({cat} if cat else set())


def test_a_part_of_a_layer_ahead_holds_max_live(tmp_path):
    """Max live 1.5 layers (25,168,896 elements): the step and the memory read the same part of a
    layer gathered past the one computed (the step's window slides during the layer: the next layer's
    gather is issued during this one, ``Overlap.fsdp_slide``), the memory holds it at once: the
    layer computed and the next one's parameters up to the one that reaches max live (coordinator
    :457 checks the limit before taking one): half a layer, 16,779,264 B, ends inside the gate
    projection (norm 2,048 + q, k, v, o 4 x 2,097,152 + norm 2,048 = 8,392,704 B before it), so
    the gate's 8,388,608 B are taken whole: 16,781,312 B past, 50,339,840 B held (was 0.5 layer,
    50,337,792 B, before the run past max live was modelled)."""
    plan = _plan(tmp_path, 5 * 10**6, 3 * N // 2)
    assert plan_overlap(plan.config, plan.stage(0).collectives).fsdp_ahead == 16_781_312 / L
    assert _held_max(plan) == L + 16_781_312 == 50_339_840


def test_memory_caption_names_the_prefetch_modelled(tmp_path):
    """The memory table's caption: none at bucket 0, else the live cap the prefetch runs up to."""
    from meshplan.report.memory import _prefetch
    for bucket, want in ((0, "prefetch none (stage3_prefetch_bucket_size 0), "),
                         (5 * 10**6, "prefetch up to 33,558,528 parameters live (stage3_max_live_parameters; "
                                     "stage3_prefetch_bucket_size 5,000,000), ")):
        cfg = _plan(tmp_path, bucket, 2 * N).config
        assert _prefetch(cfg.training, cfg.memory) == want
