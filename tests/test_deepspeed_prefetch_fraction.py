"""DeepSpeed ZeRO-3 with ``stage3_max_live_parameters`` under two layers (ds20): the step and the
memory read one fractional number, :func:`meshplan.spec.deepspeed_memory.deepspeed_prefetch_ahead`
= (max live - layer) / layer. ``fetch_sub_module`` (deepspeedai/DeepSpeed edaa722
``partitioned_param_coordinator.py:353-490``) tops the prefetch up to ``min(max_live - available,
bucket)`` at every module's fetch and ``release_sub_module`` frees each module's parameters after
it runs, so at any fetch the module computed and the parameters ahead of it hold max live (one
parameter over at most): at a layer's start only (max live - layer) of the next is gathered, and
as the layer's modules are released the window slides on, issuing the rest of the next layer's
gather during this one (the step's ``Overlap.fsdp_slide``).

The tiny model of ``test_deepspeed_prefetch_step`` (4 layers of L = 33,558,528 B, N = 16,779,264
bf16 parameters, dp_shard 16), bucket 5e6 elements, max live 1.14 and 2.5 layers:

- 1.14 layers: int(1.14 N) = 19,128,360 elements = 38,256,720 B; ahead (38,256,720 - L) / L =
  4,698,192 / 33,558,528 = 0.14 of a layer. Memory: the layer computed plus that part, max live,
  38,256,720 B. Forward step: the embedding's gather is exposed (nothing before it); its fetch
  prefetches max live less the embedding (2,097,152 B), (38,256,720 - 2,097,152) / L = 1.08
  layers, as the memory's: the first layer and 0.08 of the second, issued behind the embedding
  and waited for by the first layer; each next layer's rest is issued at the start of the one
  before (the slide) and arrives within that layer's compute, as does the head's: exposed =
  t(embedding) + t(layer). With the fractional ahead and no slide, each of
  the 3 later layers would wait for its on-demand 0.86: + 3 x (1 - 0.14) x t(layer).
- 2.5 layers: 41,948,160 elements = 83,896,320 B; ahead 1.5 layers (the slide adds nothing, the
  lead is already past a layer). Memory: 2.5 L = 83,896,320 B. Forward step: (83,896,320 -
  2,097,152) / L = 2.44 layers issued behind the embedding, the first layer's first: exposed =
  t(embedding) + t(layer) again.

``t``: the plan's forward all-gather rows' ``time_s`` (which hold DeepSpeed's ``torch.cat``
copy-out of a prefetched part, min(L, bucket, ahead bytes): 4,698,192 B at 1.14, 1e7 B at 2.5, so
t(layer) differs between the two)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.schedule.comm_times import CommTimes, nccl_sm_share
from meshplan.schedule.overlap_policy import plan_overlap
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.spec.deepspeed_memory import deepspeed_ahead_bytes, deepspeed_prefetch_ahead
from tests.test_deepspeed_prefetch_memory import L, N, _held_max, _plan

BUCKET = 5 * 10**6


def _forward(plan, slide=True):
    rows = plan.stage(0).collectives
    w = workload_of(plan, False)
    comm = CommTimes.from_rows(rows, len(plan.stages[0][0]), nccl_sm_share(plan.config.cluster))
    ov = replace(plan_overlap(plan.config, rows), fsdp_slide=slide)
    return forward_unit(chunk_costs(plan, w)[0][0], comm, w, ov), rows


def _gather_s(rows, cadence):
    (r,) = [r for r in rows if r.phase == "forward" and r.op == "all-gather" and r.cadence == cadence]
    return r.time_s


def _layer_compute_s(unit, i):
    """The compute of layer ``i`` in the forward: from its ``L{i}`` marker to the next marker."""
    names = [e.name for e in unit.events if e.stream == "compute"]
    starts = {e.name: e.start_s for e in unit.events if e.stream == "compute" and e.name.startswith("L")}
    nxt = f"L{i + 1}" if f"L{i + 1}" in names else "head"
    end = next(e.start_s for e in unit.events if e.stream == "compute" and e.name == nxt)
    return end - starts[f"L{i}"]


#: the tiny layer's parameters in trace order, bytes: norm, q, k, v, o, norm, gate, up, down
PARAMS = (2048,) + (2_097_152,) * 4 + (2048,) + (8_388_608,) * 3


# The prefetch runs on to the end of the parameter that reaches max live (coordinator :457): 1.14
# layers leave 4,698,192 B past the layer, which end in wv (norm + wq + wk = 4,196,352 B before it):
# 6,293,504 B (was 4,698,192, 0.14 layer, before the run past max live was modelled); 2.5 layers
# leave 1.5, which end in the gate (8,392,704 B before it): L + 16,781,312 B (was 1.5 layers). Behind
# the embedding's (2,097,152 B) and the head's (2,099,200 B) fetches max live less that unit, run on
# likewise: L + 4,196,352 (2,601,040 and 2,598,992 B into the next layer end in wk) and
# 2 L + 16,781,312 (14,682,112 and 14,680,064 B end in the gate).
@pytest.mark.parametrize("live, live_bytes, ahead_bytes, start_bytes", [
    (19_128_360, 38_256_720, 6_293_504, 33_558_528 + 4_196_352),  # 1.14 layers
    (41_948_160, 83_896_320, 33_558_528 + 16_781_312, 2 * 33_558_528 + 16_781_312),  # 2.5 layers
])
def test_step_and_memory_read_one_fractional_ahead(tmp_path, live, live_bytes, ahead_bytes, start_bytes):
    assert live == int(live_bytes / 2) and L == 33_558_528 == sum(PARAMS) and N == 16_779_264
    ahead = ahead_bytes / L
    plan = _plan(tmp_path, BUCKET, live)
    rows = plan.stage(0).collectives
    # the one number: the step's ahead is the memory's bytes past the layer computed, in layers
    ov = plan_overlap(plan.config, rows)
    assert ov.fsdp_ahead == pytest.approx(ahead, rel=1e-12) and ov.fsdp_slide
    assert ov.fsdp_start == pytest.approx((start_bytes / L, start_bytes / L), rel=1e-12)
    assert deepspeed_prefetch_ahead((2 * BUCKET, live_bytes), L, PARAMS) * L == pytest.approx(
        deepspeed_ahead_bytes((2 * BUCKET, live_bytes), L, PARAMS), rel=1e-12)
    # memory: the layer computed and the part ahead, max live and the rest of the parameter reaching it
    assert _held_max(plan) == L + ahead_bytes
    # step: the embedding's and the first layer's gathers exposed, every later one hidden
    unit, _ = _forward(plan)
    t_emb, t_layer = _gather_s(rows, "per root (embedding)"), _gather_s(rows, "every layer")
    assert t_layer < min(_layer_compute_s(unit, i) for i in range(3))  # what lets the slide hide them
    assert unit.exposed_s["fsdp"] == pytest.approx(t_emb + t_layer, rel=1e-9)


def test_without_the_slide_a_part_ahead_waits_for_the_rest(tmp_path):
    """Max live 1.14 layers, the fractional ahead taken as the whole lead (no slide): each of the
    3 layers after the first waits for its on-demand rest, 1 - 6,293,504 / L = 0.81 (the run on to
    the end of wv past max live; was 0.86 before it was modelled), what DeepSpeed's
    module-by-module top-up avoids."""
    plan = _plan(tmp_path, BUCKET, 19_128_360)
    rows = plan.stage(0).collectives
    a = 6_293_504 / 33_558_528
    t_emb, t_layer = _gather_s(rows, "per root (embedding)"), _gather_s(rows, "every layer")
    unit, _ = _forward(plan, slide=False)
    assert unit.exposed_s["fsdp"] == pytest.approx(t_emb + t_layer + 3 * (1 - a) * t_layer, rel=1e-9)


def test_step_note_says_the_fraction(tmp_path, capsys):
    """``meshplan step`` names the fractional ahead, the one the memory holds (0.19 at 1.14 layers:
    6,293,504 B past the layer, above; 0.14 before the run past max live was modelled)."""
    from tests.cli_run import run_main
    from tests.test_deepspeed_prefetch_step import TOML
    f = tmp_path / "tiny.toml"
    f.write_text(TOML.replace("[mesh]", "[memory]\ndeepspeed_prefetch_elements = 5000000\n"
                              "deepspeed_max_live_elements = 19128360\n\n[mesh]"))
    run_main("step", str(f))
    assert ("prefetch (stage3_prefetch_bucket_size 5e6, max live 1.91e7 elements): 0.19 layers gathered past "
            "the one computed at its start, up to max live, the window sliding module by module") \
        in capsys.readouterr().out
