"""DeepSpeed ZeRO-3 of 2021 (training.zero3_engine = "deepspeed-2021", meshplan.comm.deepspeed):
collective counts per micro-batch derived by hand from DeepSpeed v0.3.13's stage3.py and
partition_parameters.py (tag v0.3.13, 12a53b4), NCCL's ring latency at 1,536 ranks from the S20
constants, the host time of the list-based calls, the gradient buckets' all-reduces, the
persistent parameters' gather every step, and the SC'21 ZeRO-3 scaling (Narayanan et al. Table 2)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.comm import deepspeed
from meshplan.comm.nccl_algorithms import collective_time
from meshplan.comm.row import path_time
from meshplan.compute.megatron import stage_param_tensors
from meshplan.compute.measured import kernel_data
from meshplan.config import config_from_dict, load_config
from meshplan.errors import ConfigError
from meshplan.plan import build_plan, table_key
from meshplan.schedule.steptime import step_time

ZERO3 = Path(__file__).resolve().parent.parent / "benchmarks" / "zero3"
H = 12288


def _layer(i: int = 0) -> list[tuple[str, int]]:
    """One GPT-3 175B layer as Megatron-LM holds it (tp 1: fused QKV), names and elements."""
    return [(n, k) for n, k, _ in stage_param_tensors(catalog.model("megatron-175b"), 1, 51200, [i], False, False, 1)]


def test_one_layer_as_megatron_holds_it():
    # 6 modules x (weight, bias); only the four weights reach the persistence threshold (1e5)
    names = [n for n, _ in _layer()]
    assert names == ["attn_norm", "attn_norm_bias", "query_key_value", "query_key_value_bias", "wo", "wo_bias",
                     "mlp_norm", "mlp_norm_bias", "w_up", "w_up_bias", "w_down", "w_down_bias"]
    big = {n: k for n, k in _layer() if k >= deepspeed.PERSISTENCE_THRESHOLD}
    assert big == {"query_key_value": 3 * H * H, "wo": H * H, "w_up": 4 * H * H, "w_down": 4 * H * H}


def test_calls_per_microbatch_of_one_layer_full_recompute():
    # forward: 4 weight gathers; backward: the checkpoint replay gathers the 4 again and the
    # backward hooks gather 3 (w_down is used again at once: 0 elements in between < 1e9; w_up
    # has w_down's 2 x (4 h^2 + h) = 1.208e9 elements between its replay and its backward);
    # every one of the 12 parameters is reduce-scattered once
    calls = deepspeed.layer_calls(_layer(), recompute=True)
    assert [sum(c[k] for c in calls.values()) for k in range(3)] == [4, 7, 12]
    assert 2 * (4 * H * H + H) == 1_207_984_128 > deepspeed.MAX_REUSE_DISTANCE


def test_calls_without_recompute_depend_on_what_follows_the_layer():
    # a middle layer: the rest of the model lies between a weight's forward and its backward
    calls = deepspeed.layer_calls(_layer(), recompute=False, after_numel=10 ** 10)
    assert [sum(c[k] for c in calls.values()) for k in range(3)] == [4, 4, 12]
    # the last layer with nothing after it: w_down is kept from its forward to its backward
    calls = deepspeed.layer_calls(_layer(), recompute=False, after_numel=0)
    assert [sum(c[k] for c in calls.values()) for k in range(3)] == [4, 3, 12]


@pytest.fixture(scope="module")
def plan_1536():
    return build_plan(load_config(ZERO3 / "gpt3-175b_1536xa100_zero3-deepspeed_mb1.toml"))


def test_table_counts_1536(plan_1536):
    rows = plan_1536.collectives[table_key(0)]
    per = Counter()
    for r in rows:
        per[(r.phase, r.op)] += r.per_microbatch or r.per_step
    # 96 layers x (4, 7) gathers + the root: word embedding gathered twice in forward (embedding
    # and the tied logits), once in backward; position embedding once each; final norm weight
    # and bias persistent. Gradients in 5e8-element buckets (contiguous_gradients false):
    # 96 x 5 layer buckets + the head's and the word embedding's (test_gradient_buckets_1536);
    # once per step the persistent parameters' gather
    assert per == {("forward", "all-gather"): 96 * 4 + 3, ("backward", "all-gather"): 96 * 7 + 2,
                   ("backward", "all-reduce"): 96 * 5 + 2, ("step", "all-gather"): 1}
    # each gathered parameter padded to a multiple of the world: QKV 3 h^2 = 452,984,832 = 1536 x 294,912
    sizes = {r.size_bytes for r in rows if r.phase == "forward"}
    assert 3 * H * H * 2 in sizes and all(s % (1536 * 2) == 0 for s in sizes)
    assert all(r.dtype == "fp16" for r in rows)  # DeepSpeed reduces param.grad: the fp16 gradient
    # NCCL 2.8-2.9: AG on rings only; the all-reduce of a bucket across 192 nodes on the tree
    assert {r.algorithm for r in rows if r.op == "all-gather"} == {"ring"}
    assert {r.algorithm for r in rows if r.op == "all-reduce"} == {"tree"}


def test_gradient_buckets_1536(plan_1536):
    """Backward order (v0.3.13 hooks): final norm bias, weight, then each layer from the last
    (w_down bias, w_down, w_up bias, w_up, norm bias, norm, wo bias, wo, QKV bias, QKV, norm
    bias, norm), then position and word embedding. A gradient that would take the bucket past
    5e8 elements flushes it first: w_down and w_up (4 h^2 = 603,979,776) and the word embedding
    (629,145,600) go alone; [w_up bias]; [norms, wo, biases] = h^2 + 6 h; [QKV, norm, the next
    layer's w_down bias] = 3 h^2 + 3 h (layer 0's with the position embedding instead,
    3 h^2 + 2 h + 2048 h); the head's [final norm x 2, w_down bias of layer 95] = 3 h."""
    rows = {(r.size_bytes, r.per_microbatch, r.cadence.split("flushed at module ")[1][:-1])
            for r in plan_1536.collectives[table_key(0)] if r.op == "all-reduce"}
    # each flushed by the next gradient's module (its hook): w_down's bucket by w_up's bias, w_up's
    # by the MLP norm's bias, [norms, wo] by QKV, [QKV, norm] by the next layer's w_down (layer 0's
    # by the word embedding), the head's by layer 95's w_down; the word embedding's at the end
    assert rows == {(4 * H * H * 2, 96, "w_up"), (4 * H * H * 2, 96, "mlp_norm"), (4 * H * 2, 96, "w_up"),
                    ((H * H + 6 * H) * 2, 96, "query_key_value"), ((3 * H * H + 3 * H) * 2, 95, "w_down"),
                    ((3 * H * H + 2 * H + 2048 * H) * 2, 1, "word_embedding"), (3 * H * 2, 1, "w_down"),
                    (51200 * H * 2, 1, "backward end")}
    data = kernel_data("a100-sxm-80gb")
    for r in plan_1536.collectives[table_key(0)]:
        if r.op == "all-reduce":
            # no list of partitions: host independent of the world, a flat all-reduce plus the
            # flatten, div_ and copy back (6 x the bucket's bytes at Triad 1.70 TB/s)
            k = int(r.cadence.split("bucket of ")[1].split()[0])
            assert r.host_s == pytest.approx((3 + 2 * k) * 4.7e-6 + 6 * k * 2e-6, rel=1e-12)
            _, t = path_time("all-reduce", 1536, r.size_bytes, r.path, plan_1536.config.cluster, nccl_era="2021")
            assert r.time_s == pytest.approx(t + 6 * r.size_bytes / 1.70e12, rel=1e-9)
    assert deepspeed.bucket_host_seconds(1, data) == pytest.approx(35.5e-6)


def test_host_time_of_a_list_based_call(plan_1536):
    # 1536 partition views through Python (2 us, S21), each with the loop's get_rank(group) call
    # (0.45 of a view: 0.9 us, benchmarks/get_rank_cost.py) + 1536 copies issued (4.7 us,
    # kernels.toml) + the zero fill of the gathered buffer the host waits for (its bytes at Triad
    # 1.70 TB/s): QKV 905,969,664 B: 1536 x 7.6 us = 11.6736 + 0.5329 ms
    data = kernel_data("a100-sxm-80gb")
    assert data.kernel_issue_s == pytest.approx(4.7e-6)
    gathers = [r for r in plan_1536.collectives[table_key(0)] if r.op == "all-gather" and r.phase != "step"]
    for r in gathers:
        assert r.host_s == pytest.approx(1536 * 7.6e-6 + r.size_bytes / 1.70e12, rel=1e-12)
        assert r.copy_s == 0  # the list copies are in time_s; copy_s is FSDP2's copy kernels only
    qkv = next(r for r in gathers if r.size_bytes == 3 * H * H * 2)
    assert qkv.host_s == pytest.approx(11.6736e-3 + 0.53292e-3, rel=1e-4)


def test_persistent_parameters_gathered_every_step(plan_1536):
    """stage3.py _post_step -> partition_parameters.py _allgather_params (v0.3.13): the 770
    persistent tensors (8 per layer: 2 norms x 2 + 4 biases; the final norm's 2), 15,360,000
    elements = 30.72 MB of fp16, one list-based all-gather, then 770 x 1536 copies issued one
    by one (narrow, view, narrow: 3 x 2 us; copy_ 4.7 us): 12.655 s, + 770 x 10.7 us of this
    rank's slices and buffers, + the call's 10.29 ms = 12.674 s; the step waits for it after the
    optimizer step (the host issues the copies long after the 1.2 ms all-gather ends)."""
    step = [r for r in plan_1536.collectives[table_key(0)] if r.phase == "step"]
    assert len(step) == 1 and (step[0].op, step[0].per_step, step[0].size_bytes) == ("all-gather", 1, 30_720_000)
    host = 1536 * 6.7e-6 + 770 * 10.7e-6 + 770 * 1536 * 10.7e-6
    assert step[0].host_s == pytest.approx(host, rel=1e-12) and host == pytest.approx(12.6737, abs=1e-4)
    assert step[0].time_s < 0.01
    st = step_time(plan_1536)
    gather = next(e for e in st.post_events if e.name == "param all-gather (per step)")
    assert gather.end_s - gather.start_s == pytest.approx(host, rel=1e-12)


def test_ring_latency_of_1536_ranks_from_nccl_constants():
    # S20: ring LL base 6.6 us + 1535 network steps x 2.7 us = 4151.1 us (LL the fastest
    # protocol at any latency-bound size); with unlimited bandwidth the time is the latency
    alg, t = collective_time("all-gather", 1536, 1.0, 1e30, "network", nodes=192, intra_bandwidth_bytes_per_s=1e30,
                             nccl_era="2021")
    assert (alg, t) == ("ring", pytest.approx(4151.1e-6, rel=1e-9))
    # the hierarchical algorithm NCCL 2.8-2.9 did not have for all-gather: ring over 192 nodes
    # (191 network steps) and over 8 GPUs (7 steps, NVLink latency scaled as the network's here)
    alg, t = collective_time("all-gather", 1536, 1.0, 1e30, "network", nodes=192, intra_bandwidth_bytes_per_s=1e30)
    assert alg == "hierarchical" and t < 1e-3


def test_sc21_collapse_comes_out_of_the_model():
    # Narayanan et al. Table 2: 768 -> 1536 GPUs at global batch 1536, TFLOP/s per GPU 88 -> 44
    # (the step stays 66.7 s). DeepSpeed-2021's step does not halve: 39.5 -> 43.5 s, +10.1%
    # (+8.4% before the all-gather loop's get_rank calls, which grow with n; +1.8% then without
    # the 26.5 ms per layer that w_down's bucket waits at 1,536 GPUs behind the
    # next layer's gathers, which the timeline holds as one prefetched unit:
    # deepspeed_layer.ds_backward_layer); FSDP2's per-layer gathers halve it.
    steps = {}
    for engine in ("deepspeed-2021", "fsdp2"):
        for n, mb in ((768, 2), (1536, 1)):
            cfg = load_config(ZERO3 / f"gpt3-175b_{n}xa100_zero3-deepspeed_mb{mb}.toml")
            cfg = replace(cfg, training=cfg.training.model_copy(update={"zero3_engine": engine}))
            steps[(engine, n)] = step_time(build_plan(cfg)).step_s
    assert 1.0 < steps[("deepspeed-2021", 1536)] / steps[("deepspeed-2021", 768)] < 1.15
    assert steps[("fsdp2", 1536)] / steps[("fsdp2", 768)] < 0.6


def test_engine_needs_zero3():
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "mesh": {"names": ["dp"], "shape": [8]}}
    with pytest.raises(ConfigError, match="zero3_engine 'deepspeed-2021' is DeepSpeed's ZeRO stage 3"):
        config_from_dict({**base, "training": {"global_batch": 8, "seq_len": 1024, "sharding": "zero2",
                                               "zero3_engine": "deepspeed-2021"}})
    with pytest.raises(ConfigError, match="remove grad_accumulation"):
        config_from_dict({**base, "training": {"global_batch": 16, "seq_len": 1024, "zero3_engine": "deepspeed-2021",
                                               "grad_accumulation": "no_sync"}})


def test_verdict_cause_offers_no_fsdp2_knob():
    # the FSDP2 knobs (grad_accumulation, reshard_after_forward) do nothing to DeepSpeed 2021's
    # per-parameter calls: the cause names the engine and offers FSDP2's coalesced calls and a
    # doubled micro-batch (global_batch 1024 / (2 x 1 x 512) = 1)
    from meshplan.schedule.verdict import _fsdp_cause

    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 64},
                            "training": {"global_batch": 1024, "seq_len": 256, "micro_batch": 1, "sharding": "zero3",
                                         "zero3_engine": "deepspeed-2021", "recompute": "full"},
                            "mesh": {"names": ["dp"], "shape": [512]}})
    line = _fsdp_cause(build_plan(cfg, memory=False), "fsdp", None)
    assert line == ("cause: DeepSpeed ZeRO-3 (2021) all-gathers every parameter tensor in forward and again in "
                    "backward and all-reduces every gradient in buckets, each micro-batch, 2 micro-batches per step; fewer with "
                    'training.zero3_engine = "fsdp2" (per-layer coalesced calls, as DeepSpeed >= v0.5.5) or '
                    "training.micro_batch = 2")
    # contiguous_gradients: the cause names the per-gradient reduce-scatters
    cfg = replace(cfg, training=cfg.training.model_copy(update={"contiguous_gradients": True}))
    assert "backward and reduce-scatters every gradient, each micro-batch" in _fsdp_cause(
        build_plan(cfg, memory=False), "fsdp", None)


def test_engine_refuses_pipeline_parallelism():
    # DeepSpeed's PipelineEngine refuses ZeRO stages 2 and 3 (runtime/pipe/engine.py; DeepSpeed
    # issue 1110): a deepspeed-2021 mesh with pp > 1 is a config error naming the field, not a plan
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 256, "micro_batch": 1, "sharding": "zero3",
                                         "zero3_engine": "deepspeed-2021"},
                            "mesh": {"names": ["pp", "dp"], "shape": [2, 8]}})
    with pytest.raises(ConfigError, match="'deepspeed-2021' with pp 2") as e:
        build_plan(cfg)
    assert e.value.field == "training.zero3_engine"


def test_search_keeps_the_engine_to_zero3_with_pp_1():
    # a search under zero3_engine deepspeed-2021 rejects the zero3 candidates DeepSpeed cannot run
    # (pp > 1: its pipeline engine refuses ZeRO 3; parameters kept gathered: an FSDP2 knob) by the
    # rule 'engine', and plans zero1 / hsdp candidates with FSDP2 (a note says so)
    import numpy as np

    from meshplan.search.settings_notes import settings_notes
    from meshplan.search.space import CODE, OK, SHARDING, candidate_config, enumerate_candidates, first_reason

    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 2},
                            "training": {"global_batch": 32, "seq_len": 1024, "sharding": "zero3",
                                         "zero3_engine": "deepspeed-2021"}}, require_mesh=False)
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    z3 = c.sh == SHARDING.index("zero3")
    bad = z3 & ((c.pp > 1) | (c.cp > 1) | (c.rf == 0))
    assert bad.any() and (~bad & z3).any()
    # never OK; 'engine' unless an axis rule found earlier (build_plan's order) rejects it first
    assert (code[bad] != OK).all() and (code[bad] == CODE["engine"]).any()
    assert not (code[~bad] == CODE["engine"]).any()
    i = int(np.flatnonzero(c.sh == SHARDING.index("hsdp"))[0])
    assert candidate_config(cfg, c, i).training.zero3_engine == "fsdp2"
    j = int(np.flatnonzero(~bad & z3)[0])
    assert candidate_config(cfg, c, j).training.zero3_engine == "deepspeed-2021"
    assert any("zero3_engine 'deepspeed-2021' applies to zero3 candidates with pp 1" in n for n in settings_notes(cfg, c))


@pytest.mark.parametrize("names,shape,msg", [
    (["dp_replicate", "dp_shard"], [2, 8], "'deepspeed-2021' with dp_replicate 2: ZeRO-3 of 2021 partitions"),
    (["dp_shard", "cp"], [8, 2], "'deepspeed-2021' with cp 2: DeepSpeed of 2021 has no context parallelism"),
])
def test_engine_refuses_axes_it_did_not_have(names, shape, msg):
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 256, "micro_batch": 1, "sharding": "zero3",
                                         "zero3_engine": "deepspeed-2021"},
                            "mesh": {"names": names, "shape": shape}})
    with pytest.raises(ConfigError, match=msg):
        build_plan(cfg)


def test_gradient_partition_in_the_model_dtype_by_hand():
    """DeepSpeed's ZeRO-3 keeps each rank's gradient partition in the model's dtype (v0.3.13
    ``grads_in_partition`` torch.half; edaa722 ``stage3.py:742-744`` in
    ``gradient_accumulation_dtype``, unset the model's dtype) and reduces in it. Model: 2 layers
    of h 64, ffn 256 (GeLU), 4 heads, vocab 256, untied: a layer 64 x 192 + 64 x 64 + 2 x 64 x 256
    + 2 x 64 = 49,280 elements, embedding and output 16,384 each, final norm 64: 131,392 in all,
    16,424 per rank over dp 8, so 32,848 B of fp16 gradients (65,696 B as fp32 before)."""
    tiny = {"layers": 2, "hidden": 64, "ffn": 256, "gated_mlp": False, "q_heads": 4, "vocab": 256}
    base = {"model": tiny, "cluster": {"system": "dgx-a100", "nodes": 1}, "mesh": {"names": ["dp"], "shape": [8]}}
    training = {"global_batch": 8, "seq_len": 64, "sharding": "zero3", "zero3_engine": "deepspeed-2021",
                "param_dtype": "fp16", "compute_dtype": "fp16"}
    plan = build_plan(config_from_dict({**base, "training": training}))
    assert plan.config.training.grad_dtype == "fp16"
    assert plan.state[0].params.total == 2 * 49_280 + 2 * 16_384 + 64 == 131_392
    assert plan.state[0].bytes_of("grads") == 131_392 // 8 * 2 == 32_848
    assert {r.dtype for r in plan.collectives[table_key(0)] if r.op == "all-reduce"} == {"fp16"}
    # a given grad_dtype stays (DeepSpeed's data_types.grad_accum_dtype)
    fp32 = build_plan(config_from_dict({**base, "training": {**training, "grad_dtype": "fp32"}}))
    assert fp32.state[0].bytes_of("grads") == 131_392 // 8 * 4 == 65_696


def test_bucket_size_is_reduce_bucket_size():
    # [memory] grad_bucket_elements is DeepSpeed's reduce_bucket_size: at 1 element every
    # gradient is reduced alone, 96 x 12 + 4 root tensors = 1,156 all-reduces per micro-batch
    cfg = load_config(ZERO3 / "gpt3-175b_1536xa100_zero3-deepspeed_mb1.toml")
    cfg = replace(cfg, memory=cfg.memory.model_copy(update={"grad_bucket_elements": 1}))
    rows = [r for r in build_plan(cfg, memory=False).collectives[table_key(0)] if r.op == "all-reduce"]
    assert sum(r.per_microbatch for r in rows) == 96 * 12 + 4
    assert all("gradient bucket of 1 flattened" in r.cadence for r in rows)


@pytest.fixture(scope="module")
def contiguous_1536():
    cfg = load_config(ZERO3 / "gpt3-175b_1536xa100_zero3-deepspeed_mb1.toml")
    cfg = replace(cfg, training=cfg.training.model_copy(update={"contiguous_gradients": True}))
    return build_plan(cfg, memory=False)


def test_contiguous_gradients_reduce_scatter_each_gradient(contiguous_1536):
    """contiguous_gradients true (DeepSpeed's default from v0.4.3; stage3.py reduce_ipg_grads ->
    average_tensor -> reduce_gradients_at_owner): the same 5e8-element buckets as the
    all-reduce path (96 x 5 + 2 = 482, test_gradient_buckets_1536), each gradient
    reduce-scattered on its own: 96 x 12 + 4 = 1,156 list-based reduce-scatters, no all-reduce."""
    rows = contiguous_1536.collectives[table_key(0)]
    grads = [r for r in rows if r.phase == "backward" and r.op != "all-gather"]
    assert {r.op for r in grads} == {"reduce-scatter"}
    assert sum(r.per_microbatch for r in grads) == 96 * 12 + 4
    assert sum(r.per_microbatch for r in grads if "first of its bucket" in r.cadence) == 96 * 5 + 2
    # the gathers and the persistent gather are the all-reduce path's
    assert sum(r.per_microbatch for r in rows if r.op == "all-gather" and r.phase != "step") == 96 * 11 + 5


def test_contiguous_gradients_times_by_hand(contiguous_1536):
    """w_up and w_down (4 h^2 = 603,979,776 elements > 5e8, 1,207,959,552 B of fp16) each alone in
    its bucket: NCCL's reduce-scatter, the 1536 list copies (2 x its bytes), the div_ of the
    whole 5e8-element ipg buffer (2 x 1e9 B) and of the gradient itself (2 x its bytes), at
    Triad 1.70 TB/s: + 4.02 ms; host 1536 x 6.7 us + 3 issued (4.7 us) + 5 Python ops (2 us) =
    10.3153 ms. A norm weight (h = 12,288, 24,576 B), not first of its bucket: no div_; host
    10.2912 ms + 2 x 4.7 + 8 x 2 us + its copy into the buffer (49 KB, 0.03 us) = 10.3166 ms."""
    cluster = contiguous_1536.config.cluster
    rows = contiguous_1536.collectives[table_key(0)]
    bigs = [r for r in rows if r.size_bytes == 4 * H * H * 2 and r.op == "reduce-scatter"]
    assert [r.per_microbatch for r in bigs] == [96, 96]  # w_down's flushed at w_up, w_up's at the MLP norm
    big = bigs[0]
    assert "past the bucket" in big.cadence and "first of its bucket" in big.cadence
    _, t = path_time("reduce-scatter", 1536, big.size_bytes, big.path, cluster, nccl_era="2021")
    assert big.time_s == pytest.approx(t + (4 * big.size_bytes + 2e9) / 1.70e12, rel=1e-9)
    assert big.host_s == pytest.approx(1536 * 6.7e-6 + 3 * 4.7e-6 + 5 * 2e-6, rel=1e-12)
    assert big.host_s == pytest.approx(10.3153e-3, rel=1e-5)
    smalls = [r for r in rows if r.size_bytes == 2 * H and "layer" in r.cadence and "first" not in r.cadence]
    # 6 h-sized tensors a layer, one first of its bucket (the MLP norm bias), the 5 others in rows
    # by the module that flushes their bucket
    assert sum(r.per_microbatch for r in smalls) == 96 * 5
    small = smalls[0]
    _, t = path_time("reduce-scatter", 1536, small.size_bytes, small.path, cluster, nccl_era="2021")
    assert small.time_s == pytest.approx(t + 2 * small.size_bytes / 1.70e12, rel=1e-9)
    assert small.host_s == pytest.approx(1536 * 6.7e-6 + 2 * 4.7e-6 + 8 * 2e-6 + 4 * H / 1.70e12, rel=1e-12)


def test_contiguous_gradients_from_and_to_deepspeed_json(tmp_path):
    """Import reads zero_optimization.contiguous_gradients and reduce_bucket_size at stage 3;
    a deepspeed-2021 plan exports both as it models them (false and 5e8 when unset: the
    plan's, not DeepSpeed v0.4.3+'s default true)."""
    import json

    from meshplan.interop.common import ImportOptions
    from meshplan.interop.export import export
    from meshplan.interop.foreign import load_any

    doc = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
           "zero_optimization": {"stage": 3, "contiguous_gradients": True, "reduce_bucket_size": 2e8}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    opts = ImportOptions(cluster="dgx-a100", nodes=1, model="llama3-8b", seq_len=1024)
    cfg = load_any(path, opts=opts)
    assert (cfg.training.contiguous_gradients, cfg.memory.grad_bucket_elements) == (True, 200_000_000)
    ds = replace(cfg, training=cfg.training.model_copy(update={"zero3_engine": "deepspeed-2021"}))
    rows = [r for r in build_plan(ds, memory=False).collectives[table_key(0)] if r.phase == "backward"
            and r.op != "all-gather"]
    assert {r.op for r in rows} == {"reduce-scatter"} and all("reduce_bucket_size 200,000,000" in r.cadence for r in rows)
    text, _ = export(ds, "deepspeed", "x")
    assert json.loads(text)["zero_optimization"] == {"stage": 3, "contiguous_gradients": True,
                                                     "reduce_bucket_size": 200_000_000}
    plain = load_config(ZERO3 / "gpt3-175b_1536xa100_zero3-deepspeed_mb1.toml")
    text, head = export(plain, "deepspeed", "x")
    assert json.loads(text)["zero_optimization"] == {"stage": 3, "contiguous_gradients": False,
                                                     "reduce_bucket_size": 500_000_000}
    assert not [h for h in head if "memory" in h and "grad_bucket" in h]
    path.write_text(json.dumps(doc | {"zero_optimization": {"stage": 3, "contiguous_gradients": "yes"}}))
    with pytest.raises(ConfigError, match="zero_optimization.contiguous_gradients: must be true or false"):
        load_any(path, opts=opts)


def test_contiguous_gradients_is_zero3s():
    with pytest.raises(ConfigError, match="contiguous_gradients is DeepSpeed's zero_optimization.contiguous_gradients "
                       r"\(sharding zero3, or zero1/zero2 with zero12_engine = \"deepspeed\"\); sharding 'zero2' under "
                       "zero12_engine 'megatron': remove it"):
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 1},
                          "training": {"global_batch": 8, "seq_len": 256, "sharding": "zero2",
                                       "contiguous_gradients": True},
                          "mesh": {"names": ["dp"], "shape": [8]}})


def _layer_events(plan, layer: str) -> dict:
    st = step_time(plan)
    for sim in st.units.cache.values():
        names = {e.name: e for e in getattr(sim, "events", ()) if e.name.startswith((f"{layer} ", f"fsdp AR {layer} "))}
        if f"{layer} w_up grad" in names:
            return names
    raise AssertionError(f"no backward of {layer}")


def test_bucket_reductions_placed_by_hook_order(plan_1536):
    """v0.3.13 stage3.py, overlap_comm true (stage 3's default): a bucket is all-reduced on the
    reduction stream from the hook of the gradient that overflows it, once that module's GEMMs
    are enqueued (beside them); the next flush waits on the host for the bucket before
    (reduce_ipg_grads, line 1691); each gathered module's fetch synchronizes the device (line
    491); the host runs ahead of the GPU between those waits. Layer 50 of GPT-3 at 1,536 GPUs:
    w_up's hooks flush w_down's bucket (17.42 ms) and [w_up bias] (0.12 ms) beside w_up's 20 ms
    of GEMMs; the host waits for them, then the MLP norm's bias flushes w_up's bucket (17.42 ms)
    at 17.54 ms, while w_up's GEMMs still run; wo's fetch waits for its end: 34.96 ms of
    all-reduces against 20.0 + 0.28 ms of compute, 14.7 ms exposed (at 384 GPUs, micro-batch
    4, w_up's 79 ms of GEMMs hide all three). QKV's hook flushes [norms, wo, biases] (4.45 ms),
    hidden by QKV's 15 ms of GEMMs. (nc52fixC: the all-reduces cross nodes and hold NCCL's network
    rings while they run, one thread block a channel (row_shares.nccl_net_channels): the DGX A100's 8 HDR
    NICs, 2 x 8 = 16 rings (no sm90 doubling), of the A100's 108 SMs, s = 16/108; a kernel runs at 1 - s
    beside a ring issued before it (unit_events._rates). w_up's GEMMs (20.00 ms alone) run beside
    [w_down's, w_up bias] bucket for its whole 17.54 ms, issued before them (mlp_norm's flush comes later
    and does not slow them): 20.00 + 17.54 x 16/108 = 22.60 ms; the MLP norm's 0.28 ms beside mlp_norm's
    bucket: 0.28 / (1 - 16/108) = 0.33 ms. Exposed 34.96 - 22.60 - 0.33 = 12.03 ms, was 14.7.)"""
    rows = {(r.size_bytes, r.cadence.split("flushed at module ")[1][:-1]): r.time_s
            for r in plan_1536.collectives[table_key(0)] if r.op == "all-reduce"}
    ev = _layer_events(plan_1536, "L50")
    w_up, norm, qkv = ev["fsdp AR L50 (w_up)"], ev["fsdp AR L50 (mlp_norm)"], ev["fsdp AR L50 (query_key_value)"]
    b2, b3, b4 = rows[(4 * H * H * 2, "w_up")], rows[(4 * H * 2, "w_up")], rows[(4 * H * H * 2, "mlp_norm")]
    assert w_up.end_s - w_up.start_s == pytest.approx(b2 + b3, rel=1e-9) and b2 == pytest.approx(17.42e-3, abs=1e-5)
    assert w_up.start_s == ev["L50 w_up grad"].start_s  # beside the module's GEMMs
    assert ev["L50 mlp_norm grad"].start_s == max(ev["L50 w_up grad"].end_s, w_up.end_s)
    assert norm.start_s == w_up.end_s and norm.end_s - norm.start_s == pytest.approx(b4, rel=1e-9)
    compute = sum(ev[f"L50 {p} grad"].end_s - ev[f"L50 {p} grad"].start_s for p in ("w_up", "mlp_norm"))
    exposed = ev["L50 wo fetch sync (DeepSpeed)"].end_s - ev["L50 mlp_norm grad"].end_s
    from meshplan.schedule.deepspeed_layer import _ds_pieces
    from meshplan.schedule.workload import chunk_costs, workload_of
    own = _ds_pieces(chunk_costs(plan_1536, workload_of(plan_1536))[0][0].layers[50], True)
    s = 16 / 108  # 2 x 8 HDR NICs' rings of the A100's 108 SMs
    assert round(own["w_up"] * 1e3, 2) == 20.00 and round(own["mlp_norm"] * 1e3, 2) == 0.28
    assert compute == pytest.approx(own["w_up"] + (w_up.end_s - w_up.start_s) * s + own["mlp_norm"] / (1 - s), rel=1e-9)
    assert exposed == pytest.approx(b2 + b3 + b4 - compute, rel=1e-9) and exposed == pytest.approx(12.03e-3, abs=0.01e-3)
    assert qkv.start_s == ev["L50 query_key_value grad"].start_s and qkv.end_s < ev["L50 query_key_value grad"].end_s
    assert qkv.end_s - qkv.start_s == pytest.approx(rows[((H * H + 6 * H) * 2, "query_key_value")], rel=1e-9)


def test_backward_pieces_are_the_layers_ops(plan_1536):
    """The module pieces of a layer's backward hold every op the block timeline runs, once:
    w_down's are its two GEMMs, its bias gradient and its bias's main-gradient add."""
    from meshplan.schedule.deepspeed_layer import _ds_pieces
    from meshplan.schedule.layer_timeline import LAYER_BLOCKS
    from meshplan.schedule.workload import chunk_costs, workload_of

    c = chunk_costs(plan_1536, workload_of(plan_1536))[0][0].layers[50]
    pieces = _ds_pieces(c, True)
    total = sum(c.seconds("backward_input", b, False) + c.seconds("backward_weight", b) for b in LAYER_BLOCKS)
    assert sum(pieces.values()) == pytest.approx(total, rel=1e-12)
    w_down = sum(o.seconds for o in c.ops if o.name in ("w_down.dgrad", "w_down.wgrad", "mlp down bias grad",
                                                         "w_down_bias main_grad add"))
    assert pieces["w_down"] == pytest.approx(w_down, rel=1e-12) and w_down == pytest.approx(19.91e-3, abs=0.01e-3)


def test_search_drops_contiguous_gradients_outside_zero3():
    # a DeepSpeed ZeRO-3 config searched over other shardings: their candidates leave the field
    # (ZeRO-3's gradient path) at false with the engine at fsdp2, as TrainingSpec requires
    from meshplan.search.space import SHARDING, candidate_config, enumerate_candidates

    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 64, "seq_len": 2048, "sharding": "zero3",
                                         "zero3_engine": "deepspeed-2021", "contiguous_gradients": True},
                            "search": {"sharding": ["zero1", "zero3"], "pp": [1], "micro_batch": [1]}},
                           require_mesh=False)
    c = enumerate_candidates(cfg)
    seen = set()
    for i in range(len(c)):
        t = candidate_config(cfg, c, i).training
        seen.add((SHARDING[c.sh[i]], t.zero3_engine, t.contiguous_gradients))
    assert {x for x in seen if x[0] == "zero1"} == {("zero1", "fsdp2", False)}
    assert ("zero3", "deepspeed-2021", True) in seen


def test_gradient_buffers_in_the_memory_timeline_by_hand():
    """DeepSpeed v0.3.13 (stage3.py at 12a53b4) during each backward of GPT-3 175B in fp16 at 384
    GPUs (reduce_bucket_size 5e8): with ``contiguous_gradients`` the two fp16 ipg buffers
    (``torch.empty(reduce_bucket_size, dtype=torch.half)`` twice under stage 3's default
    overlap_comm), 2 x 5e8 x 2 B = 2 GB; without (v0.3.13's default) the largest flattened
    bucket, the word embedding's 51,200 x 12,288 = 629,145,600 fp16 gradients (past 5e8: a
    bucket of its own), 1,258,291,200 B. Each allocated at the backward's start and freed at its
    end, in every micro-batch; the peak (a backward) differs by their difference."""
    events, peaks = {}, {}
    for contiguous in (False, True):
        cfg = load_config(ZERO3 / "gpt3-175b_384xa100_zero3-deepspeed_mb4.toml")
        cfg = replace(cfg, training=cfg.training.model_copy(update={"contiguous_gradients": contiguous}))
        tl = build_plan(cfg).timeline
        events[contiguous] = [(e.phase, e.microbatch, e.kind, e.delta_bytes, e.label) for e in tl.events()
                              if "bucket" in e.label]
        peaks[contiguous] = tl.peak.by_kind["grad_buffers"]
    assert events[True] == [
        ("backward", 0, "grad_buffers", 2_000_000_000,
         "DeepSpeed ZeRO-3 ipg buffers (2 x reduce_bucket_size, fp16; contiguous_gradients)"),
        ("backward", 0, "grad_buffers", -2_000_000_000, "gradient bucket freed")]
    assert events[False] == [
        ("backward", 0, "grad_buffers", 51_200 * 12_288 * 2,
         "DeepSpeed ZeRO-3 flattened gradient bucket being all-reduced (largest bucket)"),
        ("backward", 0, "grad_buffers", -51_200 * 12_288 * 2, "gradient bucket freed")]
    assert peaks[True] - peaks[False] == 2_000_000_000 - 1_258_291_200
