"""DeepSpeed's own ZeRO-1/2 (``training.zero12_engine = "deepspeed"``,
:mod:`meshplan.comm.deepspeed_zero12`): buckets, all-reduces per step, exposed time and bucket
memory, by hand; the DeepSpeed reader and writer carry its keys.

The model: 8 layers, hidden 1024, ffn 4096 (gated), 16 heads of 64, vocab 32000 (a multiple of
128: no padding), untied, RMSNorm; dp 8, bf16, micro-batch 1, global batch 32: m = 4
micro-batches. A rank's parameters (elements), registration order: embedding 32000 x 1024 =
32,768,000; per layer attn_norm 1,024, wq, wk, wv, wo 1,048,576 each, mlp_norm 1,024, w_gate,
w_up, w_down 4,194,304 each: 16,779,264; final_norm 1,024; output 32,768,000. In all
65,536,000 + 1,024 + 8 x 16,779,264 = 199,771,136 = 16 x 12,485,696: no alignment padding
(2 x dp = 16), partitions of 199,771,136 / 8 = 24,971,392.

Bucket B = 20,000,000 (``[memory] grad_bucket_elements``). Gradient-ready order (the reverse):
the output (> B: alone); the final norm and layer 7 (1,024 + 16,779,264 = 16,780,288; layer 6's
w_down would pass B); layers 6..0, one bucket each (16,779,264; the next w_down would pass B);
the embedding (> B: alone). The output lies at 167,003,136..199,771,136: 7,796,608 in partition
6 and 24,971,392 in partition 7; the run passes B only with both: one all-reduce of 32,768,000.
The embedding, at 0..32,768,000: 24,971,392 in partition 0 (passes B: flushed), then 7,796,608.
11 all-reduces per reduction, 199,771,136 elements, x 2 B (bf16).
"""

from __future__ import annotations

import json

import pytest

from meshplan.comm.row import axis_path, path_time
from meshplan.comm.deepspeed_zero12 import allreduce_elements
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.spec.training import TrainingSpec

from tests.test_interop_strict import DSOPTS, _write

LAYER = 4 * 1_048_576 + 3 * 4_194_304 + 2 * 1_024
EMB = 32_000 * 1_024
PARAMS = [EMB] + [1_024, 1_048_576, 1_048_576, 1_048_576, 1_048_576, 1_024, 4_194_304, 4_194_304, 4_194_304] * 8 \
    + [1_024, EMB]
BUCKETS = [EMB, LAYER + 1_024] + [LAYER] * 7 + [24_971_392, 7_796_608]  # elements, issue order (docstring)


def _plan(sharding="zero2", overlap=False, engine="deepspeed", bucket=20_000_000, **training):
    return build_plan(config_from_dict({
        "model": {"layers": 8, "hidden": 1024, "ffn": 4096, "q_heads": 16, "vocab": 32000},
        "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 32, "seq_len": 1024, "micro_batch": 1, "sharding": sharding,
                     "param_dtype": "bf16", "zero12_engine": engine, "overlap_comm": overlap} | training,
        "mesh": {"names": ["dp"], "shape": [8]}, "memory": {"grad_bucket_elements": bucket}}))


def _reduces(plan):
    return [r for r in plan.stage(0).collectives if r.op == "all-reduce"]


def test_buckets_and_bytes_by_hand():
    assert LAYER == 16_779_264 and sum(PARAMS) == 199_771_136
    assert allreduce_elements(PARAMS, 8, 20_000_000) == BUCKETS
    rows = _reduces(_plan())
    got = {int(r.size_bytes): (r.phase, r.dtype, r.per_microbatch, r.per_step, r.group_size) for r in rows}
    assert got == {2 * EMB: ("backward", "bf16", 1, 4, 8), 2 * (LAYER + 1_024): ("backward", "bf16", 1, 4, 8),
                   2 * LAYER: ("backward", "bf16", 7, 28, 8), 2 * 24_971_392: ("backward", "bf16", 1, 4, 8),
                   2 * 7_796_608: ("backward", "bf16", 1, 4, 8)}
    assert sum(r.size_bytes * r.per_microbatch for r in rows) == 2 * 199_771_136
    # then the updated parameters, once per step: the flat group, unpadded here
    [ag] = [r for r in _plan().stage(0).collectives if r.op == "all-gather"]
    assert (ag.phase, ag.size_bytes, ag.per_step) == ("step", 2 * 199_771_136, 1)


def test_stage1_reduces_once_per_step_stage2_every_micro_batch():
    per_step = {(s, o): sum(r.per_step for r in _reduces(_plan(s, o))) for s in ("zero1", "zero2")
                for o in (False, True)}
    assert per_step == {("zero1", False): 11, ("zero1", True): 11, ("zero2", False): 44, ("zero2", True): 44}
    # zero1 with overlap_comm: in the last backward's hooks, the ready order (zero2's buckets)
    assert {int(r.size_bytes): r.per_step for r in _reduces(_plan("zero1", True))} == {
        2 * EMB: 1, 2 * (LAYER + 1_024): 1, 2 * LAYER: 7, 2 * 24_971_392: 1, 2 * 7_796_608: 1}
    assert {r.phase for r in _reduces(_plan("zero1", True))} == {"backward"}
    # zero1 without: after the backward, in registration order: the embedding's two runs first;
    # layer 0 with layer 1's attn_norm, wq, wk, wv (16,779,264 + 1,024 + 3 x 1,048,576 =
    # 19,926,016; wo would pass B); layer 1's wo, mlp_norm, w_gate, w_up, w_down (13,632,512)
    # with layer 2's attn_norm..mlp_norm (1,024 + 4 x 1,048,576 + 1,024 = 4,196,352): 17,828,864;
    # then layer k's w_gate, w_up, w_down (12,582,912) with layer k+1's 4,196,352 = 16,779,264
    # for k = 2..6; layer 7's 12,582,912 with the final norm: 12,583,936; the output, whose run
    # passes B only with both slices: 32,768,000
    seq = allreduce_elements(PARAMS, 8, 20_000_000, registration_order=True)
    assert seq == [24_971_392, 7_796_608, 19_926_016, 17_828_864] + [LAYER] * 5 + [12_583_936, EMB]
    assert sum(seq) == 199_771_136
    rows = _reduces(_plan("zero1"))
    assert {r.phase for r in rows} == {"step"} and all(r.per_microbatch == 0 for r in rows)
    assert {int(r.size_bytes): r.per_step for r in rows} == {2 * k: seq.count(k) for k in seq}


def test_exposed_time_without_overlap_is_the_sum_of_the_bucket_all_reduces():
    plan = _plan()
    cfg = plan.config
    path = axis_path(plan.mesh, plan.placement, cfg.cluster, "fsdp")
    ar = [path_time("all-reduce", 8, 2 * k, path, cfg.cluster)[1] for k in BUCKETS]
    [ag] = [r for r in plan.stage(0).collectives if r.op == "all-gather"]
    st = step_time(plan)
    # every micro-batch's 11 all-reduces block the compute stream, then the all-gather after the step
    assert st.exposed_s["dp"] == pytest.approx(4 * sum(ar) + ag.time_s, rel=1e-9)
    # zero1: the 11 all-reduces once, after the last backward
    one = _plan("zero1")
    seq = allreduce_elements(PARAMS, 8, 20_000_000, registration_order=True)
    ar1 = [path_time("all-reduce", 8, 2 * k, path, cfg.cluster)[1] for k in seq]
    assert step_time(one).exposed_s["dp"] == pytest.approx(sum(ar1) + ag.time_s, rel=1e-9)
    # overlap_comm: on a side stream; the backward waits for the previous bucket and, at its
    # end, for the last (DeepSpeed's epilogue synchronize): some of it exposed, less than all
    over = step_time(_plan(overlap=True))
    assert ag.time_s < over.exposed_s["dp"] < st.exposed_s["dp"]
    backward = [e for e in over.pipeline.events if e.stream == "compute" and e.args["kind"] == "B"]
    for e in backward:
        names = [ie.name for ie in over.units.of_event(e).events if ie.stream == "compute"]
        assert names[-1] == "DeepSpeed epilogue synchronize" and "bucket wait (DeepSpeed overlap_comm)" in names


def test_memory_holds_the_bucket_buffers_in_every_backward():
    # B x 2 B (bf16) buffer, two with overlap_comm, + the flattened bucket (B x 2 B) being reduced
    for sharding in ("zero1", "zero2"):
        for overlap, held in ((False, 80_000_000), (True, 120_000_000)):
            tl = _plan(sharding, overlap).timeline
            buckets = [e for e in tl.events() if e.kind == "grad_buffers" and e.delta_bytes > 0]
            assert [(e.microbatch, e.delta_bytes) for e in buckets] == [(mb, held) for mb in range(4)]
    # a communication_data_type other than the model's adds the cast copy: 20e6 x 4 B
    tl = _plan(grad_reduce_dtype="fp32").timeline
    assert max(e.delta_bytes for e in tl.events() if e.kind == "grad_buffers") == 80_000_000 + 80_000_000


def test_megatron_engine_is_unchanged():
    rows = _plan(engine="megatron").stage(0).collectives
    assert {r.op for r in rows} == {"reduce-scatter", "all-gather"}  # the distributed optimizer's


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="overlap_comm is DeepSpeed's zero_optimization.overlap_comm"):
        TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", overlap_comm=True)
    with pytest.raises(ValueError, match="zero12_engine 'deepspeed' is DeepSpeed's ZeRO stage 1/2"):
        TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero12_engine="deepspeed")
    base = {"model": {"layers": 8, "hidden": 1024, "ffn": 4096, "q_heads": 16, "vocab": 32000},
            "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 32, "seq_len": 1024, "sharding": "zero2", "zero12_engine": "deepspeed"},
            "mesh": {"names": ["pp", "dp"], "shape": [2, 4]}}
    with pytest.raises(ConfigError, match="DeepSpeed's pipeline engine refuses ZeRO-2"):
        build_plan(config_from_dict(base))


def test_deepspeed_config_round_trip(tmp_path):
    d = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
         "zero_optimization": {"stage": 1, "reduce_bucket_size": 200_000_000, "overlap_comm": True},
         "communication_data_type": "fp32", "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    cfg = load_any(_write(tmp_path, "z1.json", json.dumps(d)), opts=DSOPTS)
    t = cfg.training
    assert (t.sharding, t.zero12_engine, t.overlap_comm, t.gradient_reduce_dtype) == ("zero1", "deepspeed", True,
                                                                                       "fp32")
    assert cfg.memory.grad_bucket_elements == 200_000_000
    text, header = export(cfg, "deepspeed", "x")
    back = json.loads(text)
    assert back["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 200_000_000, "overlap_comm": True}
    assert back["communication_data_type"] == "fp32"
    assert not [h for h in header if h.startswith("not expressed")]
    # the older per-rank reduce path is refused by name
    d["zero_optimization"]["use_multi_rank_bucket_allreduce"] = False
    with pytest.raises(ConfigError, match="^zero_optimization.use_multi_rank_bucket_allreduce: false is DeepSpeed"):
        load_any(_write(tmp_path, "z1b.json", json.dumps(d)), opts=DSOPTS)


@pytest.mark.parametrize("stage,precision,accum,grad_dtype,grad_bytes", [
    # Llama 3 8B, 8,030,261,248 parameters over dp 16 (2 DGX H100 nodes): ZeRO-2 keeps the
    # rank's partition, 8,030,261,248 / 16 = 501,891,328 elements, in the model's dtype
    # (stage_1_and_2.py grads_in_partition, dtype=self.dtype), grad_accum_dtype or not
    (2, "bf16", None, "bf16", 501_891_328 * 2),
    (2, "fp16", "fp32", "fp16", 501_891_328 * 2),
    # ZeRO-1 keeps every parameter's gradient: param.grad in the model's dtype, or
    # param.grad_accum in grad_accum_dtype (fp16 model, fp32 accumulation)
    (1, "bf16", None, "bf16", 8_030_261_248 * 2),
    (1, "fp16", "fp32", "fp32", 8_030_261_248 * 4),
])
def test_deepspeed_gradients_live_in_the_model_dtype(tmp_path, stage, precision, accum, grad_dtype, grad_bytes):
    """Imported ZeRO-1/2 configs plan DeepSpeed's gradient dtype (the importer's docstring),
    gradient bytes per rank by hand; before, every one planned fp32 (4 B per element); the
    export writes grad_accum_dtype back where DeepSpeed has the key."""
    d = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
         precision: {"enabled": True}} | ({"data_types": {"grad_accum_dtype": accum}} if accum else {})
    cfg = load_any(_write(tmp_path, "z.json", json.dumps(d)), opts=DSOPTS)
    assert cfg.training.grad_dtype == grad_dtype
    plan = build_plan(cfg)
    assert plan.state[0].params.total == 8_030_261_248
    assert plan.state[0].bytes_of("grads") == grad_bytes
    text, header = export(cfg, "deepspeed", "x")
    assert json.loads(text).get("data_types") == ({"grad_accum_dtype": "fp32"} if grad_dtype == "fp32" else None)
    assert not [h for h in header if h.startswith("not expressed")], header


def test_step_lists_the_bucket_all_reduces():
    """The step's collective list (readiness.timings: first occurrence of each kind) shows the
    ZeRO-2 bucket all-reduces beside the step's parameter all-gather: a user saw only the
    all-gather although the all-reduces were most of the exposed dp time. The first one issued
    lasts one bucket's all-reduce (one of BUCKETS' times); Megatron-LM's ZeRO-1 names its
    per-step reduction a reduce-scatter."""
    from meshplan.schedule.readiness import timings
    plan = _plan()
    cfg = plan.config
    path = axis_path(plan.mesh, plan.placement, cfg.cluster, "fsdp")
    ar = [path_time("all-reduce", 8, 2 * k, path, cfg.cluster)[1] for k in BUCKETS]
    t = {(x.stream, x.phase, x.op): x for x in timings(step_time(plan))}
    assert set(t) == {("dp", "backward", "all-reduce"), ("dp", "step", "all-gather")}
    assert 0 < t["dp", "backward", "all-reduce"].duration_s < sum(ar)
    meg = {(x.stream, x.op) for x in timings(step_time(_plan("zero1", engine="megatron")))}
    assert ("dp", "reduce-scatter") in meg
