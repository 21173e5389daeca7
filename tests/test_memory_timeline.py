"""Memory timeline (issue 3): hand-derived events of a tiny model, pipeline in-flight counts,
FSDP prefetch and resharding, recompute, buckets, the peak and the infeasibility reason,
the [memory] table, the seed example and the CLI.

Tiny model T (every number below by hand): 2 layers, hidden 16, ffn 64 (GeLU, not gated),
4 heads (head dim 4), vocab 128 (padded 128 at tp 1), RMSNorm, no biases, untied.
Per layer: norms 16 + 16, q/k/v/o 4 x 256, w_in 1024, w_out 1024 = 3104 elements;
embedding 128 x 16 = 2048; head: final norm 16 + output 2048 = 2064; stage total 10320.
Training: seq 8, micro-batch 1, global batch 4, fp32 params (no master), bf16 compute,
fp32 grads and reduce, Adam fp32, recompute none, flash attention, no dropout.
Mesh dp_shard 2 (world 2): zero3 shards everything 2 ways -> 5160 elements per rank:
params 5160 x 4 = 20640 B, grads 20640 B, optimizer 5160 x 8 = 41280 B.
[memory]: NCCL 1000 B x 2 channels x 2 peers = 4000 B per communicator (one: dp_shard),
workspace 500 B.
"""

import re

import numpy as np
import pytest

from meshplan.memory.inflight import in_flight_chunks
from meshplan.memory.schedule import max_in_flight, stage_ops
from meshplan.memory.timeline import KINDS, UNTRACKED_KINDS, tracker_to_kinds
from meshplan.plan import build_plan
from meshplan.config import config_from_dict
from meshplan.units import GiB
from meshplan.errors import ConfigError

from tests.cli_run import run_cli
from tests.conftest import EXAMPLES
from tests.configs import TP4_MB2

TINY = dict(layers=2, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=128)
# cross_entropy stated (the default): the by-hand numbers below take Megatron's in-place loss (fp32
# logits kept, no other logits-sized tensor); torch's eager and compiled losses: tests/test_loss_memory.py
MEM = dict(nccl_buffsize_bytes=1000, nccl_channels=2, nccl_peers=2, workspace_bytes=500, cross_entropy="megatron")

# Activations of T per micro-batch (Korthikanti Table 2 terms, s 8, b 1, h 16, a 4, f 64):
# attention: norm input 2sbh 256, qkv input 256, q 256, k 256, v 256, flash softmax
# statistics 4*a*s*b 128, context 256 = 1664; MLP: norm input 256, w_in input 256,
# GeLU input 2sbf 1024, w_out input 1024 = 2560.
LAYER = 1664 + 2560
EMBED = 8 * 8              # token ids, int64
HEAD = 256 + 256 + 4 * 8 * 128 + 13 * 8  # final norm in, output in, fp32 logits, loss
DY = 2 * 8 * 16
# FSDP2 units as torchtitan wraps them (TrainingSpec.torchtitan_units): the embedding (resharded
# after forward as the layers are), each layer, and [final norm, output] (kept gathered
# from its forward to its backward); bf16 unsharded: 4096, 6208, 4128
GATHER = {"embedding": 2048 * 2, "layer": 3104 * 2, "head": 2064 * 2}
INIT = 20640 + 41280 + 4000 + 500        # params, optimizer, NCCL, workspace
# Backward of a layer, step by step (H = 2sbh = 256, F = 2sbf = 1024, Q = 2s*a*d = 256):
# (working set, weight gradient bf16, activations freed)
STEPS = [(1024, 1024 * 2, 1024),      # mlp w_out: dX of w_out F; w_down; its input F
         (2048, 0, 1024),             # mlp activation (GeLU): 2F; the GeLU input F
         (1024 + 256, 1024 * 2, 256),  # mlp w_in: F + H; w_up; its input H
         (256, 16 * 2, 256),          # mlp norm: its dX H; mlp_norm weight; its input
         (256, 256 * 2, 256),         # attention w_o: d(context) Q; wo; context
         (1024, 0, 3 * 256 + 128),    # attention core: 2Q + 2KV; q, k, v, flash statistics
         (1024, 3 * 256 * 2, 256),    # attention w_qkv: Q + 2KV + H; wq, wk, wv; their input
         (256, 16 * 2, 256)]          # attn norm


def plan_of(model=TINY, mesh=None, memory=MEM, system=None, **training):
    t = {**dict(global_batch=4, seq_len=8, micro_batch=1, sharding="zero3", param_dtype="fp32",
                recompute="none"), **training}
    cfg = {"model": model, "cluster": system or {"system": "dgx-h100", "nodes": 1}, "training": t,
           "mesh": mesh or dict(names=["dp_shard"], shape=[2], world=2), "memory": memory}
    return build_plan(config_from_dict(cfg))


def running(tl, kind=None):
    r = tl.running()
    return r.sum(axis=1) if kind is None else r[:, KINDS.index(kind)]


def test_tiny_zero3_every_number_by_hand():
    p = plan_of(optimizer_impl="foreach")  # the step's temporary below: torch's foreach AdamW
    tl = p.timeline
    assert p.micro_batches == 2 and len(p.timelines) == 1
    # init: params, optimizer, one NCCL communicator, workspace (FSDP grads come later)
    assert [(e[1], e[2]) for e in tl.templates[0]] == [("params", 20640), ("optimizer", 41280),
                                                       ("comm_buffers", 4000), ("workspace", 500)]
    # forward of micro-batch 0 (FSDP2): each unit's all-gather output, then its copy-out; the
    # output is kept until the next unit's copy-out, the last one (the head's) until the model
    # returns the logits (the root's post-forward); the embedding and the layers are resharded
    # after their forward, the head is not
    e, lay, h = GATHER["embedding"], GATHER["layer"], GATHER["head"]
    f0 = [(e_[1], e_[2]) for e_ in tl.templates[tl.passes[1].template]]
    assert f0 == [("gathered_params", e), ("gathered_params", e), ("activations", EMBED), ("gathered_params", -e),
                  ("gathered_params", lay), ("gathered_params", lay), ("gathered_params", -e),
                  ("activations", LAYER), ("gathered_params", -lay),
                  ("gathered_params", lay), ("gathered_params", lay), ("gathered_params", -lay),
                  ("activations", LAYER), ("gathered_params", -lay),
                  ("gathered_params", h), ("gathered_params", h), ("gathered_params", -lay),
                  ("temporaries", 2 * 8 * 128), ("gathered_params", -h),
                  ("activations", HEAD), ("temporaries", -2 * 8 * 128)]
    # backward of micro-batch 1, layer 1 (every sharded grad exists since micro-batch 0): after
    # its last step layer 1's activations are freed and its bf16 gradients (6208) are all
    # written; its fp32 reduce-scatter input (12416) is allocated before they are freed: the
    # peak. Layer 0's all-gather output is prefetched; the head's unit was reduced (and
    # resharded) right after the head's backward, its reduce-scatter input freed when layer
    # 1's reduce begins; the embedding is sharded until layer 0's backward prefetches it.
    pk = tl.peak
    assert (pk.phase, pk.layer, pk.microbatch) == ("backward", 1, 1)
    assert pk.where() == "backward of layer 1 (micro-batch 1)"
    assert pk.label == "layer 1: reduce-scatter input (reduce dtype)"
    by_hand = {"params": 20640, "master": 0, "optimizer": 41280, "grads": 20640, "comm_buffers": 4000, "userbuffers": 0,
               "workspace": 500, "fragmentation": 0,
               "gathered_params": 2 * lay,                # layer 1 + layer 0's all-gather output
               "grad_buffers": 3104 * 2 + 3104 * 4,       # layer 1 grad, its RS input
               "activations": EMBED + LAYER,              # layer 0 and the token ids left
               "temporaries": DY}
    assert sum(st[1] for st in STEPS) == lay and sum(st[2] for st in STEPS) == LAYER
    assert pk.by_kind == by_hand
    assert pk.total_bytes == sum(by_hand.values()) == 122644
    # events: init 4, forward 21, first backward 101, forward 21, then 47 into the last
    # backward: loss 2, prefetch 1, head 6, the head's reduce 4 (gradient, reduce-scatter
    # input, gradient freed, resharded), layer 1's copy-out, output freed, prefetch 3, steps 30
    # (a step: working set +/-, gradient, activations freed; no zero-byte events), the head's
    # reduce-scatter done 1. Against one root unit (forward 17, backwards 93 and 90): forward
    # + the embedding resharded, the head's all-gather output, copy-out and output freed (4);
    # backward + the embedding gathered again (output, copy-out, output freed: 3) and a second
    # unit reduced (reduce-scatter input, gradient freed, resharded, done: 4; the first
    # backward also allocates its sharded gradient: 1)
    steps = sum(4 - (g == 0) for _, g, _ in STEPS)
    assert steps == 30 and pk.t_index == 4 + 21 + 101 + 21 + 2 + 1 + 6 + 4 + 3 + steps + 1 == 194
    assert tl.n_events == 4 + (17 + 4) + (93 + 3 + 4 + 1) + (17 + 4) + (90 + 3 + 4) + 3 == 247
    total = running(tl)
    assert total.max() == pk.total_bytes and int(np.argmax(total)) == pk.t_index
    assert total[-1] == INIT  # steady state: the step ends where it began
    assert tl.max_by_kind["activations"] == EMBED + 2 * LAYER + HEAD
    assert tl.max_by_kind["temporaries"] == 41280 // 2  # foreach Adam: one state-sized temporary


def test_sharded_grads_appear_per_unit_at_first_reduce_and_go_at_zero_grad():
    tl = plan_of().timeline
    allocs = [(e.microbatch, e.delta_bytes) for e in tl.events() if e.kind == "grads" and e.delta_bytes > 0]
    # the head (reduced right after its backward), layer 1, layer 0, then the embedding: each
    # unit's share of the 20640 B (proportional to elements: 2064, 3104, 3104, 2048 of 10320)
    assert allocs == [(0, 2064 * 2), (0, 3104 * 2), (0, 3104 * 2), (0, 2048 * 2)]
    frees = [e for e in tl.events() if e.kind == "grads" and e.delta_bytes < 0]
    assert [(e.phase, e.delta_bytes) for e in frees] == [("step", -20640)]


def gathered_at(tl, label, phase="backward"):
    g = running(tl, "gathered_params")
    return [int(g[e.t_index]) for e in tl.events() if e.label == label and e.phase == phase][0]


def test_prefetch_depth_sets_gathered_layers():
    lay = GATHER["layer"]
    # forward, FSDP2 implicit: at layer 1's copy-out layer 0's all-gather output is still held
    # (the embedding was resharded after its forward, its output freed at layer 0's copy-out)
    assert plan_of().timeline.max_by_kind["gathered_params"] == 3 * lay
    # explicit forward prefetch: the next unit's all-gather issued after this copy-out, this
    # unit's output still kept till the next copy-out (torch 2.13 FSDPParamGroup.wait_for_unshard
    # keeps a synchronous all-gather's result whenever its state is FORWARD): at layer 0's forward
    # its copy, its output and layer 1's output
    explicit = plan_of(memory={**MEM, "forward_prefetch_layers": 1}).timeline
    assert explicit.max_by_kind["gathered_params"] == 3 * lay
    # backward: layer 0's all-gather is issued before layer 1's backward (prefetch 1), or not;
    # the head's unit was resharded after its backward, the embedding's after its forward
    at = "layer 1 backward mlp w_out: working set (gradients of activations)"
    assert gathered_at(plan_of().timeline, at) == 2 * lay
    assert gathered_at(plan_of(memory={**MEM, "prefetch_layers": 0}).timeline, at) == lay


def test_reshard_after_forward_false_keeps_params_gathered_through_backward():
    tl = plan_of(reshard_after_forward=False).timeline
    gathered = running(tl, "gathered_params")
    end_f0 = tl.passes[2].first_event - 1
    assert gathered[end_f0] == GATHER["embedding"] + GATHER["head"] + 2 * GATHER["layer"]  # whole stage
    b0 = [e for e in tl.events() if e.phase == "backward" and e.microbatch == 0 and e.kind == "gathered_params"]
    assert all(e.delta_bytes < 0 for e in b0)  # backward gathers nothing again, only reshards
    default = plan_of().timeline
    # default: each layer's and the embedding's all-gather output and copy-out, in both
    # backward passes (the head's unit stays gathered from its forward)
    assert sum(e.delta_bytes > 0 for e in default.events()
               if e.kind == "gathered_params" and e.phase == "backward") == 12


def test_full_recompute_keeps_layer_inputs_and_one_working_set():
    tl = plan_of(recompute="full").timeline
    act = running(tl, "activations")
    kept = 2 * 8 * 16  # layer input 2sbh
    end_f0 = tl.passes[2].first_event - 1
    assert act[end_f0] == EMBED + 2 * kept + HEAD
    rework = [e for e in tl.events() if e.label == "layer 1 backward: recomputed activations"]
    assert rework[0].delta_bytes == LAYER - kept
    assert act[rework[0].t_index] == EMBED + 2 * kept + (LAYER - kept)  # head freed, one layer recomputed
    in_layers = [act[e.t_index] for e in tl.events() if e.phase == "backward" and e.layer is not None]
    assert max(in_layers) == EMBED + 2 * kept + (LAYER - kept)  # never two working sets at once


def test_fragmentation_allowance_is_a_stated_fraction_of_the_peak():
    tl = plan_of(memory={**MEM, "fragmentation_fraction": 0.1}).timeline
    assert tl.peak.by_kind["fragmentation"] == int(0.1 * 122644)
    assert tl.peak.total_bytes == 122644 + 12264 and tl.peak.t_index == 195  # one init event more


def test_after_last_reduce_accumulates_unsharded_grads():
    # pp 1: reducing after the last micro-batch is training.grad_accumulation's (the table's rule)
    tl = plan_of(grad_accumulation="no_sync_unsharded", memory={**MEM, "fsdp_reduce": "after_last"}).timeline
    end_b0 = tl.passes[3].first_event - 1
    r = tl.running()[end_b0]
    assert r[KINDS.index("grad_buffers")] == 10320 * 4  # every unit's unsharded fp32 accumulator
    assert r[KINDS.index("gathered_params")] == 10320 * 2  # not resharded after backward
    assert r[KINDS.index("grads")] == 0
    assert {e.microbatch for e in tl.events() if e.kind == "grads" and e.delta_bytes > 0} == {1}


PP2 = dict(names=["pp", "dp_shard"], shape=[2, 2], world=4)


def test_pipelined_fsdp_reduces_after_the_last_microbatch_as_the_table_counts():
    """pp 2 x dp_shard 2, 2 micro-batches; stage 1 holds layer 1 (3104 elements) and the root
    unit of the head (final norm + output, 2064), runs F0 B0 F1 B1. torch.distributed.pipelining
    turns gradient sync and reshard-after-backward off for every backward and reduces once
    (stage.py backward_maybe_with_nosync, perform_reduce_grad): at the end of B0 both units'
    unsharded fp32 accumulators (5168 x 4 B) and their gathered bf16 parameters (5168 x 2 B)
    are held and no sharded gradient exists yet; the table counts one reduce-scatter per unit
    per step. Before, the timeline reduced every micro-batch by default and its peak was not
    the table's."""
    plan = plan_of(mesh=PP2)
    tl = plan.timelines[1]
    r = tl.running()[tl.passes[3].first_event - 1]  # the last event of B0
    assert [(p.phase, p.microbatch) for p in tl.passes] == [("init", None), ("forward", 0), ("backward", 0),
                                                           ("forward", 1), ("backward", 1), ("step", None)]
    assert r[KINDS.index("grad_buffers")] == (3104 + 2064) * 4
    assert r[KINDS.index("gathered_params")] == (3104 + 2064) * 2
    assert r[KINDS.index("grads")] == 0
    rs = [x for x in plan.collectives["stage 1"] if x.op == "reduce-scatter"]
    assert sorted((x.size_bytes, x.per_microbatch, x.per_step) for x in rs) == [(2064 * 4, 0, 1), (3104 * 4, 0, 1)]
    assert "FSDP reduces once per step, after each chunk's last backward" in " ".join(tl.notes)
    # stating the rule changes nothing; contradicting it is refused with the fix
    same = plan_of(mesh=PP2, memory={**MEM, "fsdp_reduce": "after_last"}).timelines[1]
    assert same.peak == tl.peak and same.templates == tl.templates
    with pytest.raises(ConfigError, match=r"^memory\.fsdp_reduce: 'per_microbatch' contradicts pp 2: "
                                          r"torch\.distributed\.pipelining reduce-scatters once per step.*remove the key$"):
        plan_of(mesh=PP2, memory={**MEM, "fsdp_reduce": "per_microbatch"})
    with pytest.raises(ConfigError, match=r"'after_last' contradicts training\.grad_accumulation 'sync'.*"
                                          r"no_sync_unsharded"):
        plan_of(memory={**MEM, "fsdp_reduce": "after_last"})


def test_buckets_without_fsdp():
    # zero1, grads fp32 reduced in bf16: a bucket of min(40M, 10320) elements x 2 B in the last backward
    tl = plan_of(sharding="zero1", reduce_dtype="bf16").timeline
    buckets = [e for e in tl.events() if e.kind == "grad_buffers" and e.delta_bytes > 0]
    assert [(e.microbatch, e.delta_bytes) for e in buckets] == [(1, 10320 * 2)]
    assert not any(e.kind == "gathered_params" for e in tl.events())
    # reduced in the grads' own dtype: in place in Megatron's grad buffer, no bucket
    assert not any(e.kind == "grad_buffers" for e in plan_of(sharding="zero1").timeline.events())
    # zero2: one bucket in every backward
    z2 = [e.microbatch for e in plan_of(sharding="zero2").timeline.events()
          if e.kind == "grad_buffers" and e.delta_bytes > 0]
    assert z2 == [0, 1]


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 2), (8, 16)])
def test_1f1b_in_flight_per_stage(pp, m):
    for k in range(pp):
        assert max_in_flight(stage_ops("1f1b", k, pp, m)) == min(m, pp - k)
        # ZB-H1 holds a micro-batch from F to W (torch's I frees no saved activation, meshplan.memory.wlag):
        # stage k's p - k - 1 warm-up forwards + 1 steady-state F + k lagging W = p on every stage
        # (tests/test_zbh1_memory.py counts it on torch's own order)
        assert max_in_flight(stage_ops("zb_h1", k, pp, m)) == min(m, pp)
        assert max_in_flight(stage_ops("gpipe", k, pp, m)) == m


@pytest.mark.parametrize("pp,vpp,m", [(4, 2, 8), (4, 3, 4), (2, 2, 6), (8, 2, 16)])
def test_interleaved_warmup_counts(pp, vpp, m):
    for k in range(pp):
        ops = stage_ops("interleaved_1f1b", k, pp, m, vpp)
        assert max_in_flight(ops) == in_flight_chunks(k, pp, m, vpp)
        assert sorted(o[1:] for o in ops if o[0] == "forward") == [(c, j) for c in range(vpp) for j in range(m)]
        seen = set()
        for phase, c, j in ops:  # every backward after its forward
            assert phase == "forward" or (c, j) in seen
            seen.add((c, j))


def _pp_plan(schedule, vpp=1, layers=4, m=8):
    mesh = dict(names=["pp", "dp_shard"], shape=[4, 1], world=4, pp_schedule=schedule, virtual_stages=vpp)
    return plan_of(model={**TINY, "layers": layers}, mesh=mesh, sharding="zero1", global_batch=m)


def test_pipeline_activations_follow_the_schedule():
    p = _pp_plan("1f1b")  # p 4, m 8, one layer per stage
    acts = [tl.max_by_kind["activations"] for tl in p.timelines]
    assert acts == [4 * (EMBED + LAYER), 3 * LAYER, 2 * LAYER, 1 * (LAYER + HEAD)]  # min(m, p - k)
    g = _pp_plan("gpipe")
    assert [tl.max_by_kind["activations"] for tl in g.timelines][1:3] == [8 * LAYER, 8 * LAYER]
    i = _pp_plan("interleaved_1f1b", vpp=2, layers=8)  # stages 1, 2 hold 9 and 7 one-layer chunks
    assert [i.timelines[k].max_by_kind["activations"] for k in (1, 2)] == [9 * LAYER, 7 * LAYER]
    # run-length: 2 m passes + init + step per stage, few distinct passes
    assert all(len(tl.passes) == 2 * 8 + 2 and len(tl.templates) <= 8 for tl in p.timelines)


def test_v_shaped_activations_follow_the_schedule():
    """p 4, vpp 2, 8 one-layer chunks, m 8. V: stage 0 holds layers 0 and 7 (embedding and
    head), stage 3 layers 3 and 4. ZB-V holds 2p = 8 chunk forwards on every stage; stage 0
    reaches them after its 2p - 1 = 7 chunk-0 forwards (each with the embedding's token ids)
    and the first chunk-1 forward (with the head): 8 LAYER + 7 EMBED + HEAD (the 8th chunk-0
    forward comes after that chunk-1 pass is freed: 8 LAYER + 8 EMBED is less). DualPipeV
    holds 2p + 1 = 9: on stage 0, 8 chunk-0 and 1 chunk-1 forwards (step 4's F before the
    backward of chunk 1). Looped interleaved 1F1B for contrast: stage 0 holds 11, stage 3 5.

    Both V schedules' backward passes stand at their W and hold the output gradients of the chunk
    passes whose B is done and W not (torch's input-gradient pass keeps them: meshplan.memory.wlag),
    WG a layer, by hand: norm outputs 2 x 8 x 16, q k v outputs 8 x (4 x 4 + 2 x 4 x 4), wo and w2
    outputs 2 x 8 x 16, w1 output 8 x 64: 1408 elements x 2 B; the head's chunk also its final norm's,
    NORM = 8 x 16 x 2 B. In step with its B a W holds its own (+ WG; on stage 0's head chunk + WG + NORM,
    at its first W with every forward above still held). ZB-V's cool-down (2s + 1 lagging on stage s, the
    activations held till W): stage 2's first cool-down W holds 6 chunk passes and 5 lagging (6 LAYER +
    5 WG > 8 LAYER + WG), stage 3's 7 and 7; stage 1's (5 and 3) stays under its steady state.
    DualPipeV's cool-down (s + 1 lagging) stays under its steady state's 9 LAYER + WG on every stage."""
    wg, norm = 1408 * 2, 8 * 16 * 2
    z = _pp_plan("zbv", vpp=2, layers=8)
    assert z.stages == [[[0], [7]], [[1], [6]], [[2], [5]], [[3], [4]]] and z.feasible
    assert z.stage(0).last and not z.stage(3).last
    assert [tl.max_by_kind["activations"] for tl in z.timelines] == \
        [8 * LAYER + 7 * EMBED + HEAD + wg + norm, 8 * LAYER + wg, 6 * LAYER + 5 * wg, 7 * LAYER + 7 * wg]
    d = _pp_plan("dualpipev", vpp=2, layers=8)
    assert [tl.max_by_kind["activations"] for tl in d.timelines] == \
        [9 * LAYER + 8 * EMBED + HEAD + wg + norm] + [9 * LAYER + wg] * 3
    i = _pp_plan("interleaved_1f1b", vpp=2, layers=8)
    assert [i.timelines[k].max_by_kind["activations"] for k in (0, 3)] == [11 * LAYER + 8 * EMBED, 5 * LAYER + HEAD]


def test_infeasible_reason_and_boundary():
    gpu = {"name": "tiny", "peak_tflops": {"bf16": 1.0}, "hbm_gb": 122644 / 0.9 / 1e9 * 0.999,
           "hbm_bandwidth_tb_per_s": 1.0, "sms": 1, "source": "test"}
    small = plan_of(system={"system": "dgx-h100", "nodes": 1, "gpu": gpu})
    assert not small.feasible and small.timeline.headroom_bytes < 0
    assert small.reasons[0].startswith("peak 0.0 GiB at backward of layer 1 (micro-batch 1) on stage 0 > ")
    fits = plan_of(system={"system": "dgx-h100", "nodes": 1, "gpu": {**gpu, "hbm_gb": 122644 / 0.9 / 1e9 * 1.001}})
    assert fits.feasible
    load = __import__("meshplan.config", fromlist=["x"]).load_config
    tp4 = build_plan(load(EXAMPLES / "seed-64gpu-tp4.toml"))
    # tp 4: the peak is the head's fp32 reduce-scatter input (its own unit, torchtitan's [norm,
    # output], reduced right after the head's backward, every layer's activations still live);
    # 69.72 GiB fits the runtime's 79.11 GiB x 0.9 = 71.2 GiB usable (catalog device_memory_gib)
    assert tp4.feasible and tp4.timeline.peak.where() == "backward of the head (micro-batch 1)", tp4.reasons
    # at micro-batch 2 (tests/configs.py TP4_MB2) the head's forward, saving its inputs, logits and loss
    # on two sequences' activations, is the peak, 121.5 GiB > 71.2 GiB usable (79.1 GiB device total)
    mb2 = build_plan(load(TP4_MB2))
    assert re.fullmatch(r"peak 121\.5 GiB at forward of the head \(micro-batch 1\) on stage 0 > 71\.2 GiB usable "
                        r"\(79\.1 GiB - 10% reserve\)", mb2.reasons[0]), mb2.reasons


def test_memory_table_is_optional_and_strict():
    p = plan_of(memory={})
    assert p.timeline.templates[0][2][2] == 4 * 2**20 * 16 * 2  # NCCL_BUFFSIZE 4 MiB x 16 channels x 2 peers
    with pytest.raises(ConfigError, match="memory.prefetch"):
        plan_of(memory={"prefetch": 2})
    cfg = {"model": TINY, "cluster": {"system": "dgx-h100", "nodes": 1},
           "training": dict(global_batch=4, seq_len=8), "mesh": dict(names=["dp_shard"], shape=[2], world=2)}
    assert build_plan(config_from_dict(cfg)).timeline is not None


def test_comparison_helpers():
    tl = plan_of().timeline
    groups = tl.by_group()
    assert sum(groups.values()) + sum(tl.peak.by_kind[k] for k in UNTRACKED_KINDS) == tl.peak.total_bytes
    assert groups["params"] == 20640 + 2 * GATHER["layer"]  # at the peak: layer 1 and layer 0's prefetch
    assert tracker_to_kinds({"Sharded Grad": 5, "Unsharded Grad": 1, "Reduce Scatter": 2, "OptState": 3}) == \
        {"grads": 5, "grad_buffers": 3, "optimizer": 3}


def test_seed_example_peak_and_headroom(capsys):
    from meshplan.config import load_config

    p = build_plan(load_config(EXAMPLES / "seed-64gpu.toml"))
    tl = p.timeline
    # Llama-3-70B, tp 8 + SP, selective recompute, flash: per layer (s 8192, h 8192, t 8)
    # [r] 4 x 2sh/t = 67108864, q 2*s*8*128 = 16777216, k + v 4194304, context 16777216,
    # gated MLP 4 x 2*s*28672/8 = 234881024 -> 339738624 B. The peak is in layer 79's
    # backward (micro-batch 1), when its w_gate/w_up gradients are written while the head's
    # fp32 reduce-scatter input (its own FSDP2 unit, torchtitan's [norm, output], reduced right
    # after the head's backward) is still in flight (one at a time, FSDP2): layers 0-78 and
    # the token ids 8s are live, and of layer 79 all but what its w_out and activation steps
    # freed (w_out input 2*s*28672/8; silu output and up, twice that), plus its recomputed
    # flash statistics 4*(64/8)*s. (With one root unit, reduced after the embedding, the
    # peak was one layer later in the backward, layer 78's, behind layer 79's reduce.)
    assert tl.peak.where() == "backward of layer 79 (micro-batch 1)"
    assert tl.peak.label == "layer 79: unsharded gradient (mlp w_in) (compute dtype)"
    f = 2 * 8192 * 28672 // 8
    assert tl.peak.by_kind["activations"] == 79 * 339738624 + (339738624 - 3 * f + 4 * 8 * 8192) + 8 * 8192
    print(f"\nseed example: {tl.summary()}")
    assert 40 * GiB < tl.peak.total_bytes < 48 * GiB and tl.headroom_bytes > 19 * GiB
    assert len(tl.passes) == 2 * 64 + 2 and tl.n_events > 80_000  # run-length, expanded on demand


def test_cli_memory_writes_png_once(tmp_path, capsys):
    cmd = ["memory", EXAMPLES / "seed-64gpu.toml", "--out", tmp_path]  # in-process (tests/cli_run.py): no start-up
    rc, out, err = run_cli(cmd, capsys)
    assert rc == 0, err
    assert "backward of layer 79 (micro-batch 1)" in out and "events around the peak" in out
    png = tmp_path / "seed-64gpu_memory_stage0.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, err = run_cli(cmd, capsys)
    assert rc == 2 and "exists" in err and "--force" in err
    assert "backward of layer 79 (micro-batch 1)" in out  # the timeline still printed (n26small #1)
    assert run_cli(cmd + ["--force"], capsys)[0] == 0
    rc, out, err = run_cli(["plan", EXAMPLES / "seed-64gpu.toml"], capsys)
    assert "Memory timeline per rank" in out and "headroom" in out


@pytest.mark.parametrize("mesh, lf, logits", [
    (None, 4 * 8 * 128, 2 * 8 * 128),  # tp 1: fp32 logits 8 tokens x 128, bf16 half of it
    (dict(names=["dp_shard", "tp"], shape=[2, 2], world=4), 4 * 8 * 64, 2 * 8 * 64)])  # tp 2: 64 columns
def test_torch_cross_entropy_backward_order(mesh, lf, logits):
    """torch's F.cross_entropy on .float() logits (cross_entropy "torch"), by hand: tp 1, the
    nll gradient and the log-softmax gradient at once (2 lf); tp 2, loss_parallel's
    (zeros_like(x) + exp(x)) * grad_output (3 lf); then one lf is left beside the bf16 gradient
    of the upcast. On an H200 (gpu_h200 run 3) this order left the head's peak within 6 MB."""
    p = plan_of(mesh=mesh, memory={**MEM, "cross_entropy": "torch"})
    tl = p.timeline
    ev = [e for e in tl.events() if e.microbatch == 0
          and e.label.startswith(("loss backward", "head backward: logits gradient ("))]
    n = 3 if mesh else 2
    assert [e.delta_bytes for e in ev if e.kind == "temporaries"] == [n * lf, lf - n * lf, logits, -lf]
    assert [e.label for e in ev][2:] == ["loss backward: kept logits and loss terms freed",
                                         "head backward: logits gradient (compute dtype)",
                                         "loss backward: the logits' gradient (logits dtype) freed"]
    r = running(tl)
    before = r[ev[0].t_index - 1]
    assert r[ev[0].t_index] - before == n * lf  # the loss's own peak over what the forward left
    assert max(r[e.t_index] for e in ev[1:]) - before < n * lf


def test_megatron_cross_entropy_backward_unchanged():
    """Megatron's vocab-parallel cross entropy (the default) writes one logits gradient in
    the compute dtype beside its kept fp32 softmax: the loss adds nothing else."""
    tl = plan_of().timeline
    ev = [e for e in tl.events() if e.microbatch == 0
          and e.label.startswith(("loss backward", "head backward: logits gradient ("))]
    assert [(e.kind, e.delta_bytes) for e in ev if e.delta_bytes] == [
        ("temporaries", 2 * 8 * 128), ("activations", -(4 * 8 * 128 + 13 * 8))]


@pytest.mark.parametrize("mesh, sp, work", [
    (None, False, 4 * (8 // 10 + 8) * 16),  # fp32 partial sums: (n // 10 + min(n, 128)) x h, n = 8 ids
    (dict(names=["dp_shard", "tp"], shape=[2, 2], world=4, sequence_parallel=True), True,
     4 * (8 // 10 + 8) * 16 + 2 * (8 - 4) * 16)])  # tp 2 SP: + the bf16 dY gathered from 4 to 8 tokens
def test_embedding_backward_work_by_hand(mesh, sp, work):
    """[memory] embedding_backward_work: torch's CUDA embedding_dense_backward keeps fp32 partial
    sums of (numel // 10 + min(numel, rows)) x h beside the weight gradient
    (EmbeddingBackwardKernel.cu); under DTensor SP its output gradient arrives all-gathered. Off by
    default: the same plan has no such event and a peak as many bytes lower at most."""
    assert bool(mesh and mesh["sequence_parallel"]) == sp
    on = plan_of(mesh=mesh, memory={**MEM, "embedding_backward_work": True}).timeline
    off = plan_of(mesh=mesh, memory=MEM).timeline
    ev = [e for e in on.events() if e.microbatch == 0 and e.label.startswith("embedding backward:")]
    assert [e.delta_bytes for e in ev] == [work, -work] and all(e.kind == "temporaries" for e in ev)
    assert not [e for e in off.events() if e.label.startswith("embedding backward:")]
    r = running(on)
    i, j = ev[0].t_index, ev[1].t_index
    assert r[j - 1] - r[i] > 0  # the embedding's gradient is written while the partial sums live
    assert 0 <= on.peak.total_bytes - off.peak.total_bytes <= work
