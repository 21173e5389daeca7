"""DeepSpeed leftovers of issue 11 (deepspeedai/DeepSpeed edaa722): ZeRO-1/2 without
``contiguous_gradients`` holds no ipg buffer; a stage 0 config searches the stages a DeepSpeed user
can switch to. Llama 3 8B, 2 x 8 H100, seq 4096, global batch 256, micro-batch 1, bf16."""

from __future__ import annotations

import json

import pytest

from meshplan.interop.deepspeed_carry import not_planned
from meshplan.interop.export import export
from meshplan.plan import build_plan

from tests.test_deepspeed_zero3_knobs import OPTS, _load  # noqa: E402 (the same DeepSpeed JSON writer)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_zero12_without_contiguous_gradients_holds_no_ipg_buffer(tmp_path, stage, overlap):
    """stage_1_and_2.py setup_buckets (2493-2516) allocates the ipg buffer, torch.empty(reduce_bucket_size)
    in the model dtype, and a second one under overlap_comm, only with contiguous_gradients (DeepSpeed's
    default true); without it reduce_ipg_grads reduces the bucket through buffered_reduce_fallback, whose
    allreduce_bucket flattens it (kept). Both peaks are in a backward, where the buffers are held: the
    peak drops by exactly 5e8 x 2 B = 1e9 B (bf16, the default bucket), 2e9 B with overlap_comm."""
    on = _load(tmp_path, stage, "on", overlap_comm=overlap)
    off = _load(tmp_path, stage, "off", overlap_comm=overlap, contiguous_gradients=False)
    assert (on.training.contiguous_gradients, on.training.contiguous_grads, off.training.contiguous_grads) == (
        None, True, False)
    p_on, p_off = build_plan(on), build_plan(off)
    buffers = 500_000_000 * 2 * (2 if overlap else 1)
    assert p_on.timeline.peak.total_bytes - p_off.timeline.peak.total_bytes == buffers
    # at the peak: the flattened bucket, min(5e8, 8,030,261,248 parameters) x 2 B, and the buffers on top
    kinds = p_on.timeline.peak.by_kind["grad_buffers"], p_off.timeline.peak.by_kind["grad_buffers"]
    assert kinds == (1_000_000_000 + buffers, 1_000_000_000)
    labels = {e.label for e in p_off.timeline.events() if e.kind == "grad_buffers"}
    assert labels == {"DeepSpeed bucket being reduced, flattened (contiguous_gradients false: no ipg buffer)",
                      "gradient bucket freed"}
    # read at stages 1 and 2 (no longer listed as unused) and written back as given
    assert "zero_optimization.contiguous_gradients" not in not_planned(
        {"zero_optimization": {"stage": stage, "contiguous_gradients": False}})
    back = json.loads(export(off, "deepspeed", "x")[0])["zero_optimization"]
    assert back["contiguous_gradients"] is False
    assert "contiguous_gradients" not in json.loads(export(on, "deepspeed", "x")[0])["zero_optimization"]


def _grads(plan, layer, what: str) -> int:
    """Bytes the first backward's events of ``layer`` (None: the root) allocate under labels with ``what``."""
    return sum(e.delta_bytes for e in plan.timeline.events() if e.phase == "backward" and e.microbatch == 0
               and e.layer == layer and e.kind == "grad_buffers" and what in e.label and e.delta_bytes > 0)


@pytest.mark.parametrize("bucket, layer_held", [(None, 0), (50_000_000, 3 * 58_720_256 * 2)])
def test_zero3_gradients_in_the_ipg_buffer_are_not_counted_again(tmp_path, bucket, layer_held):
    """DeepSpeed ZeRO-3 (edaa722 stage3.py:1543-1568 __add_grad_to_ipg_bucket) copies each gradient
    of at most reduce_bucket_size elements into the ipg buffer held from init and points param.grad
    at it: a layer's unsharded gradients were counted twice, in that buffer and as the layer's
    grad_buffers (Llama 3 8B: 218,112,000 x 2 B = 436,224,000 B a layer). Now a layer holds only its
    tensors of more elements: none at the default 5e8; at 5e7 its three MLP weights, 14336 x 4096 =
    58,720,256 elements each. The root's embedding and output, 128,256 x 4096 = 525,336,576 > 5e8
    elements each, keep their gradients (2 x 525,336,576 x 2 B); its final norm's 4096 are in the buffer.
    The reduce-scatter's input (the bucket concatenated, reduce_scatter_coalesced) is still counted:
    436,224,000 B a layer. contiguous_gradients false (no buffer) keeps every gradient."""
    zero = {} if bucket is None else {"reduce_bucket_size": bucket}
    on, off = _load(tmp_path, 3, "on", **zero), _load(tmp_path, 3, "off", contiguous_gradients=False, **zero)
    p_on, p_off = build_plan(on), build_plan(off)
    assert _grads(p_on, 5, "unsharded gradient") == layer_held
    assert _grads(p_off, 5, "unsharded gradient") == 218_112_000 * 2
    assert _grads(p_on, 5, "reduce-scatter input") == _grads(p_off, 5, "reduce-scatter input") == 218_112_000 * 2
    assert _grads(p_on, None, "unsharded gradient") == 2 * 525_336_576 * 2
    assert _grads(p_off, None, "unsharded gradient") == (2 * 525_336_576 + 4096) * 2


def _load16(tmp_path, stage: int, name: str):
    """:func:`_load`'s config in fp16 (DeepSpeed's FP16_Optimizer at stage 0, no BF16_Optimizer)."""
    from meshplan.interop.foreign import load_any
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": stage}, "fp16": {"enabled": True}}))
    return load_any(path, opts=OPTS)


def test_stage0_config_searches_the_stages_a_deepspeed_user_switches_to(tmp_path):
    """A stage 0 JSON (DeepSpeed's engine without ZeRO: training.zero0_engine "deepspeed") searched
    ZeRO-3 only, under FSDP2. Now it searches zero1, zero2 and zero3 as a stage 1, 2 or 3 JSON does
    (the stage 2 search's 72 rows: dp 16 only, 4 micro-batches x 3 recompute policies, none of them
    torchtitan's op, for zero1, zero2, and zero3 resharded or kept gathered, each at DeepSpeed ZeRO++
    hpZ g 1 and 8, the node's GPUs: the data axis is the world of 2 nodes, search/space.py
    hpz_applies; 12 + 12 + 48), every row under the
    engine DeepSpeed runs at that stage, the same plan as the stage 2 config's row; a note says stage
    0 itself is no search row. The field belongs to sharding none only. Both configs in fp16: bf16 at
    stage 0 is DeepSpeed's BF16_Optimizer (sharding zero1, test_bf16_optimizer.py), not its engine
    without ZeRO, and zero0_engine with bf16 is refused."""
    from meshplan.spec.training import TrainingSpec

    with pytest.raises(ValueError, match="zero0_engine 'deepspeed' is DeepSpeed's engine without ZeRO"):
        TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero0_engine="deepspeed")
    from meshplan.search.driver import search
    from meshplan.search.space import SHARDING, candidate_config, enumerate_candidates
    from meshplan.schedule.steptime import step_time

    z0, z2 = _load16(tmp_path, 0, "z0"), _load16(tmp_path, 2, "z2")
    assert (z0.training.sharding, z0.training.zero0_engine) == ("none", "deepspeed")
    assert z0.search.sharding == z2.search.sharding == ["zero1", "zero2", "zero3"]
    c0, c2 = enumerate_candidates(z0), enumerate_candidates(z2)
    assert len(c0) == len(c2) == 72 and (c0.sh == c2.sh).all() and (c0.mb == c2.mb).all() and (c0.hz == c2.hz).all()
    assert sorted(c0.hz[c0.sh == SHARDING.index("zero3")].tolist()) == [1] * 24 + [8] * 24
    for sh in ("zero1", "zero2", "zero3"):
        i = int((c0.sh == SHARDING.index(sh)).nonzero()[0][0])
        a, b = candidate_config(z0, c0, i), candidate_config(z2, c2, i)
        engine = (a.training.zero12_engine, a.training.zero3_engine, a.training.zero0_engine, a.training.grad_dtype)
        assert engine == (b.training.zero12_engine, b.training.zero3_engine, "ddp", b.training.grad_dtype), sh
        assert engine[:2] == {"zero3": ("megatron", "deepspeed")}.get(sh, ("deepspeed", "fsdp2")), sh
        pa, pb = build_plan(a), build_plan(b)
        assert pa.timeline.peak.total_bytes == pb.timeline.peak.total_bytes, sh
        assert step_time(pa).step_s == pytest.approx(step_time(pb).step_s, rel=1e-12), sh
    notes = search(z0.__class__(**{**z0.__dict__, "search": z0.search.model_copy(update={"top": 2})}), workers=1).notes
    assert any(n.startswith("training.zero0_engine 'deepspeed' (DeepSpeed without ZeRO, stage 0) is not a search row")
               for n in notes)


def _gathered(plan, layer: int) -> list[tuple[int, str]]:
    """The first forward's gathered-parameter events of ``layer`` (bytes, label)."""
    return [(e.delta_bytes, e.label) for e in plan.timeline.events() if e.phase == "forward" and e.microbatch == 0
            and e.layer == layer and e.kind == "gathered_params"]


#: the default max live (1e9 x 2 B) past a layer: 2e9 - 436,224,000 = 1,563,776,000 B, 3 layers and 255,104,000 B,
#: which end in w_up (a Llama 3 8B layer in bf16: norm 8,192, wq 33,554,432, wk and wv 8,388,608, wo 33,554,432,
#: norm 8,192, w_gate, w_up and w_down 117,440,512 B): the prefetch runs on to its end (coordinator :457),
#: 318,783,488 B into the layer (was 255,104,000 before that run was modelled)
AHEAD = 3 * 436_224_000 + 318_783_488
#: max live 2.5e8: (2.5e8 - 218,112,000) x 2 = 63,776,000 B past the layer end in wo: 83,894,272 B (was 63,776,000)
PART = 83_894_272


@pytest.mark.parametrize("zero, pieces, copied", [
    ({}, [AHEAD - 3 * 436_224_000, 4 * 436_224_000 - AHEAD], 50_000_000 * 2),  # bucket 5e7, the default
    ({"stage3_prefetch_bucket_size": 20_000_000}, [AHEAD - 3 * 436_224_000, 4 * 436_224_000 - AHEAD], 20_000_000 * 2),
    ({"stage3_max_live_parameters": 250_000_000}, [PART], PART),
    ({"stage3_max_live_parameters": 200_000_000}, [], 0),
])
def test_zero3_prefetch_bucket_and_max_live_parameters_bound_the_gathered_parameters(tmp_path, zero, pieces, copied):
    """DeepSpeed ZeRO-3's coordinator (edaa722 partitioned_param_coordinator.py:452-480) prefetches,
    after fetching a module, the parameters next in the trace up to min(max_live_parameters - the
    parameters available, prefetch_bucket_size) elements, so the frontier runs to max live: the
    layer computed and max live - layer past it (spec.deepspeed_memory.deepspeed_ahead_bytes, the
    step's too). Llama 3 8B on 16 ranks, a layer of 218,112,000 parameters (bf16, 2 B): at the
    default max live 1e9 (2e9 B), 1,563,776,000 B past the layer, 3 layers and 255,104,000 B, run on
    to the end of the parameter reaching it (w_up, 318,783,488 B into the layer): layer 6 gets
    318,783,488 B during layer 2 and its rest, 117,440,512 B (w_down), during layer 3 (whatever the
    bucket beyond 0), nothing on demand. (Before: the timeline prefetched one bucket of the next layer only,
    5e7 x 2 B = 1e8 B, or 2e7 x 2 B, and gathered the rest on demand.) With max_live_parameters 2.5e8
    only 2.5e8 - 218,112,000 = 31,888,000 elements, run on to the end of wo (41,947,136 elements),
    during layer 5, the rest on demand; with 2e8,
    below one layer, none. What is gathered on demand is gathered one parameter at a time, the
    parameters views of the buffer (partition_parameters.py:1339-1376, one copy); of the prefetched
    part one bucket (min(bucket, max live - layer)) is counted as coalesced, copied out by
    torch.cat at its wait (:750-784) and its buffer freed: the layer holds 436,224,000 B once after
    the wait, never FSDP2's output plus copy-out."""
    cfg = _load(tmp_path, 3, "z3", **zero)
    plan = build_plan(cfg)
    rest = 218_112_000 * 2 - sum(pieces)
    prefetch = "layer 6: prefetched by DeepSpeed's coordinator: all-gather buffer"
    want = [(b, prefetch) for b in pieces] + (
        [(rest, "layer 6: all-gathered, the parameters views of the buffer (the rest)")] if rest else []) + [
            (copied, "layer 6: prefetched part copied out of the buffer (torch.cat)"),
            (-copied, "layer 6: coalesced all-gather buffer freed after its wait"),
            (-436_224_000, "layer 6: released (partitioned again) after forward")] if pieces else [
            (436_224_000, "layer 6: all-gathered, the parameters views of the buffer"),
            (-436_224_000, "layer 6: released (partitioned again) after forward")]
    assert _gathered(plan, 6) == want
    assert sum(b for b, _ in want[:-1]) == 436_224_000
    back = json.loads(export(cfg, "deepspeed", "x")[0])["zero_optimization"]
    assert {k: back[k] for k in zero} == zero and not not_planned({"zero_optimization": {"stage": 3, **zero}})
