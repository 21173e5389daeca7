"""Newcomer trial 27 (256 A100 80GB, torchtitan, a dense ~30B model): the memory ``fix:`` line
(:func:`meshplan.plan_fix.memory_fix`). #A: under DDP (sharding none) it offers sharding; #B: it
offers re-splitting HSDP's data axes and never offers a variant over usable memory as a fix; #C: a
fitting variant with under 15% of usable memory free is marked tight, in its place among the fitting
variants, fastest first (the search's headroom rule, :func:`meshplan.memory.headroom.tight`, by which
the search lists such a mesh after those that keep 15% free; the fix line only marks it). Each printed
peak and step is the plan (and ``step``) of the config edited by hand, as tests/test_plan_fix.py checks;
the Llama-3-8B peaks are derived by hand, kind by kind."""

from __future__ import annotations

from dataclasses import replace

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.schedule.steptime import step_time
from meshplan.units import GiB
from tests.test_compare_headroom import N8B, PEAK_8B_NONE
from tests.test_plan_fix import _gib, _step

#: The ``_ddp`` job's sequence (tokens per micro-batch) and the NCCL buffers (4 MiB x 16 channels x 2 peers)
#: and cuBLAS workspace (8 x 4 MiB) of one data axis' communicator (meshplan/spec/memory.py's defaults).
S = 2048
BUFFERS = {"comm_buffers": 4 * 2 ** 20 * 16 * 2, "userbuffers": 0, "workspace": 8 * 4 * 2 ** 20, "fragmentation": 0}

#: DDP over dp_replicate 32, full recompute, by hand: fp32 parameters, gradients and Adam's two moments
#: whole on every rank (4 N, 4 N, 8 N B); at the head's forward (the first micro-batch) each layer's input
#: kept, 32 x 2 S 4096, the token ids 8 S, the final-norm and output inputs 2 x 2 S 4096, the fp32 logits
#: 4 S 128256 and the loss's 13 S; the bf16 logits beside them, 2 S 128256. 130,798,430,208 B = 121.8 GiB.
PEAK_DDP = {"params": 4 * N8B, "master": 0, "optimizer": 8 * N8B, "grads": 4 * N8B, **BUFFERS,
            "gathered_params": 0, "grad_buffers": 0,
            "activations": 32 * 2 * S * 4096 + 8 * S + 2 * 2 * S * 4096 + 4 * S * 128256 + 13 * S,
            "temporaries": 2 * S * 128256}
assert sum(PEAK_DDP.values()) == 130_798_430_208

#: ZeRO-3 over dp_shard 32, by hand: the same state / 32; at the head's backward of the last micro-batch
#: (its gradients reduce-scattered), the head gathered in bf16 2 x (128256 x 4096 + 4096) beside the last
#: layer's, 2 x 218,112,000 (the next unit's all-gather prefetched); the head's gradient in bf16 and its
#: fp32 reduce-scatter input, 6 B x (128256 x 4096 + 4096); each layer's input 32 x 2 S 4096 and the token
#: ids 8 S kept; the output layer's input gradient 2 S 4096. 9,375,516,672 B = 8.73 GiB.
PEAK_Z3 = {"params": 4 * N8B // 32, "master": 0, "optimizer": 8 * N8B // 32, "grads": 4 * N8B // 32, **BUFFERS,
           "gathered_params": 2 * (128256 * 4096 + 4096) + 2 * 218_112_000,
           "grad_buffers": 6 * (128256 * 4096 + 4096),
           "activations": 32 * 2 * S * 4096 + 8 * S, "temporaries": 2 * S * 4096}
assert sum(PEAK_Z3.values()) == 9_375_516_672

#: The trial's 30B model (its hsdp_full.toml): 60 layers, hidden 7168, ffn 20480, 56 q / 8 kv heads.
MODEL30 = {"name": "llama-30b-ish", "layers": 60, "hidden": 7168, "ffn": 20480, "gated_mlp": True, "q_heads": 56,
           "kv_heads": 8, "head_dim": 128, "vocab": 128256, "tied_embeddings": False, "norm": "rmsnorm",
           "position_embedding": "rope", "max_position": 8192}


def _ddp(framework: str = "torch", **mesh):
    return config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 4},
        "training": {"global_batch": 64, "seq_len": 2048, "micro_batch": 1, "sharding": "none", "recompute": "full",
                     "framework": framework},
        "mesh": mesh or {"names": ["dp_replicate"], "shape": [32]}})


#: MODEL30's parameters by hand: per layer q and o 7168 x 7168 each, k and v 7168 x 1024 each, gate, up and
#: down 7168 x 20480 each, two norms of 7168: 557,856,768; x 60, plus the embedding and the output layer
#: 128256 x 7168 each and the final norm: 35,310,091,264.
LAYER30 = 2 * 7168 ** 2 + 2 * 7168 * 1024 + 3 * 7168 * 20480 + 2 * 7168
N30 = 60 * LAYER30 + 2 * 128256 * 7168 + 7168
assert (LAYER30, N30) == (557_856_768, 35_310_091_264)
#: One MODEL30 layer's kept tensors at seq 8192 (Table 2 tensor by tensor, as PEAK_8B_NONE's; 56 q and 8 KV
#: heads of 128): the attention norm's and QKV inputs, q and the context 4 x 2 s 7168; k and v 2 x 2 s 1024;
#: the flash statistics 4 x 56 s; the MLP norm's and w_in's inputs 2 x 2 s 7168; gate, SiLU output, up and
#: product 4 x 2 s 20480: 2,082,209,792 B.
_S30 = 8192
LAYER30_ACTS = (4 * 2 * _S30 * 7168 + 2 * 2 * _S30 * 1024 + 4 * 56 * _S30 + 2 * 2 * _S30 * 7168
                + 4 * 2 * _S30 * 20480)
#: hsdp_full (dp_replicate 32 x dp_shard 8, recompute full), by hand: the peak is layer 59's backward (the
#: last layer, second micro-batch) at its SiLU-and-product step. State fp32, sharded over dp_shard 8: 4 N / 8
#: each of parameters and gradients, 8 N / 8 of Adam's moments; two communicators' NCCL buffers (dp_replicate,
#: dp_shard), 2 x 128 MiB, and 32 MiB of cuBLAS workspace; layer 59 gathered in bf16 and layer 58's all-gather
#: prefetched, 2 x 2 x LAYER30; the head's fp32 reduce-scatter input 4 x (128256 x 7168 + 7168), still in
#: flight, and layer 59's w_out gradient in bf16, 2 x 7168 x 20480; each layer's input (full recompute)
#: 60 x 2 s 7168 and the token ids 8 s, plus layer 59 recomputed less its input (already kept) and less
#: w_out's input, freed by w_out's backward; the head's dY 2 s 7168 and the SiLU-and-product backward's
#: three gradients 3 x 2 s 20480. 86,924,380,160 B = 81.0 GiB.
PEAK_HSDP = {"params": 4 * N30 // 8, "master": 0, "optimizer": 8 * N30 // 8, "grads": 4 * N30 // 8,
             **BUFFERS, "comm_buffers": 2 * 4 * 2 ** 20 * 16 * 2, "gathered_params": 2 * 2 * LAYER30,
             "grad_buffers": 4 * (128256 * 7168 + 7168) + 2 * 7168 * 20480,
             "activations": 60 * 2 * _S30 * 7168 + 8 * _S30 + LAYER30_ACTS - 2 * _S30 * 7168 - 2 * _S30 * 20480,
             "temporaries": 2 * _S30 * 7168 + 3 * 2 * _S30 * 20480}
assert sum(PEAK_HSDP.values()) == 86_924_380_160
#: Its tp x2 variant (dp_replicate 32 x dp_shard 4 x tp 2, sequence parallel), by hand, at the same op: a tp
#: rank holds half of each Linear and of the embedding and output layer, the norms whole: per layer
#: (557,856,768 - 2 x 7168) / 2 + 2 x 7168 = 278,935,552, L = 60 x that + 128256 x 7168 / 2 x 2 + 7168 =
#: 17,655,479,296 elements, the state 16 B x L / dp_shard 4; three communicators' buffers; layers 59 and 58
#: gathered, 2 x 2 x 278,935,552; the head's fp32 reduce-scatter input 4 x (128256 x 7168 / 2 + 7168) and
#: w_out's bf16 gradient 2 x 7168 x 10240; each layer's input split by SP, 60 x 2 (s / 2) 7168, the ids 8 s,
#: layer 59 recomputed but for its input (Table 2 with SP: the QKV input and the MLP norm's and w_in's
#: inputs 3 x 2 (s / 2) 7168, q and the context 2 s 28 x 128 each, k and v 2 s 4 x 128 each, the flash
#: statistics 4 x 28 s, gate, SiLU output, up and product 4 x 2 s 10240) less w_out's input; the head's dY
#: 2 (s / 2) 7168 and 3 x 2 s 10240. 79,059,304,448 B = 73.6 GiB.
L_TP2 = 60 * ((LAYER30 - 2 * 7168) // 2 + 2 * 7168) + 128256 * 7168 + 7168
PEAK_TP2 = {"params": 4 * L_TP2 // 4, "master": 0, "optimizer": 8 * L_TP2 // 4, "grads": 4 * L_TP2 // 4,
            **BUFFERS, "comm_buffers": 3 * 4 * 2 ** 20 * 16 * 2,
            "gathered_params": 2 * 2 * ((LAYER30 - 2 * 7168) // 2 + 2 * 7168),
            "grad_buffers": 4 * (128256 * 7168 // 2 + 7168) + 2 * 7168 * 10240,
            "activations": 60 * 2 * _S30 // 2 * 7168 + 8 * _S30 + 3 * 2 * _S30 // 2 * 7168
            + 2 * 2 * _S30 * 28 * 128 + 2 * 2 * _S30 * 4 * 128 + 4 * 28 * _S30 + 4 * 2 * _S30 * 10240
            - 2 * _S30 * 10240,
            "temporaries": 2 * _S30 // 2 * 7168 + 3 * 2 * _S30 * 10240}
assert L_TP2 == 17_655_479_296 and sum(PEAK_TP2.values()) == 79_059_304_448

def test_ddp_over_memory_is_offered_sharding_over_every_data_rank():
    """#A, the trial's ddp4.toml: Llama-3-8B (8.03e9 parameters) under DDP over dp_replicate 32 on 4
    dgx-a100 peaks at 121.8 GiB (> 71.3 usable: the A100 80GB's runtime total 79.25 GiB x 0.9 = 71.325 GiB; :data:`PEAK_DDP`, by hand). The line
    said nothing fits on up to 4 nodes: its zero3 variant kept dp_replicate, a replica axis, and
    sharded nothing. ZeRO-3 over the 32 data ranks holds 1/32 of fp32 parameters, gradients and
    Adam's two moments, 16 B x 8.03e9 / 32 = 4.0e9 B = 3.7 GiB of state a rank: the trial's own
    fsdp4.toml (dp_shard 32, zero3), whose plan the user printed at 8.73 GiB (:data:`PEAK_Z3`, by
    hand). torch has no zero1 engine (has_zero1_engine): zero3 alone is offered."""
    cfg = _ddp()
    p = build_plan(cfg)
    assert not p.feasible and _gib(p) == "121.8 GiB" and p.timeline.usable_bytes == 79.25 * 2**30 * 0.9
    assert p.timeline.peak.by_kind == PEAK_DDP
    z3 = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["dp_shard"]}),
                            training=cfg.training.model_copy(update={"sharding": "zero3"})))
    assert z3.feasible and round(z3.timeline.peak.total_bytes / GiB, 2) == 8.73
    assert z3.timeline.peak.by_kind == PEAK_Z3
    assert memory_fix(p) == f"fix: sharding zero3 (dp_shard 32) -> peak 8.7 GiB (fits; {_step(z3)}) (usable 71.3 GiB)"


def test_one_data_rank_names_no_mesh_it_does_not_move():
    """#A's words at one data rank: DDP over dp_replicate 1 on 1 GPU folds into dp_shard 1, the same
    mesh (mesh_words: the axes of degree > 1, none), so ``sharding zero3`` carries no mesh words; the
    line said ``sharding zero3 ()``. Llama-3-8B on 1 dgx-a100 GPU, recompute none: the fp32 state
    alone, 16 B x 8.03e9 = 128.5e9 B, is over the 79.25 GiB x 0.9 = 76.6e9 B usable whatever the sharding over 1 rank, so
    the line closes with both knobs together, its peak the plan of the config edited by hand."""
    cfg = _ddp(**{"names": ["dp_replicate"], "shape": [1], "world": 1})
    cfg = replace(cfg, training=cfg.training.model_copy(update={"recompute": "none"}))
    p = build_plan(cfg)
    assert not p.feasible and p.world == 1 and p.timeline.peak.total_bytes > 16 * 8.03e9 > 79.25 * 2**30 * 0.9
    both = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["dp_shard"]}),
                              training=cfg.training.model_copy(update={"recompute": "full", "sharding": "zero3"})))
    assert memory_fix(p).endswith(f"; all of recompute full + sharding zero3 -> peak {_gib(both)}")


def test_megatron_ddp_is_offered_its_distributed_optimizer_too():
    """Under framework megatron, zero1 (Megatron-LM's distributed optimizer) runs too: both fit,
    zero3 (the state all sharded) and zero1 (optimizer state and master copy sharded, bf16 parameters
    and gradients whole), the faster first; each peak the plan of the config edited by hand."""
    cfg = _ddp("megatron")
    p = build_plan(cfg)
    z1, z3 = (build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["dp_shard"]}),
                                 training=cfg.training.model_copy(update={"sharding": s}))) for s in ("zero1", "zero3"))
    assert z1.feasible and z3.feasible and z3.timeline.peak.total_bytes < z1.timeline.peak.total_bytes
    first, second = sorted((z1, z3), key=lambda q: step_time(q).step_s)
    words = {id(z1): "sharding zero1 (dp_shard 32)", id(z3): "sharding zero3 (dp_shard 32)"}
    assert memory_fix(p) == (f"fix: {words[id(first)]} -> peak {_gib(first)} (fits; {_step(first)}); "
                             f"{words[id(second)]} -> peak {_gib(second)} (fits; {_step(second)}) (usable 71.3 GiB)")


def test_hsdp_over_memory_is_offered_its_data_axes_re_split_and_no_variant_over_usable():
    """#B, the trial's hsdp_full.toml: the 30B model at dp_replicate 32 x dp_shard 8 on 32 dgx-a100,
    seq 8192, recompute full, peaks at 81.0 GiB (:data:`PEAK_HSDP`, by hand). The line offered tp x2
    (dp_replicate 32 x dp_shard 4 x tp 2) at 73.6 GiB (:data:`PEAK_TP2`, by hand), over the usable (67.1 GiB then; 79.25 x 0.9 = 71.3 GiB now), then 64 nodes.
    dp_replicate 16 x dp_shard 16 (the same 256 ranks, the state sharded 16 ways, not 8) fits on the
    same 32 nodes: the trial's hsdp16.toml."""
    cfg = config_from_dict({
        "model": MODEL30, "cluster": {"system": "dgx-a100", "nodes": 32},
        "training": {"global_batch": 512, "seq_len": 8192, "micro_batch": 1, "sharding": "hsdp", "recompute": "full",
                     "memory_reserve": 0.10},
        "mesh": {"names": ["dp_replicate", "dp_shard"], "shape": [32, 8]}})
    p = build_plan(cfg)
    assert not p.feasible and _gib(p) == "81.0 GiB" and p.timeline.peak.by_kind == PEAK_HSDP
    tp2 = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["dp_replicate", "dp_shard", "tp"],
                                                                    "shape": [32, 4, 2], "sequence_parallel": True})))
    assert not tp2.feasible and _gib(tp2) == "73.6 GiB" and tp2.timeline.peak.by_kind == PEAK_TP2
    r16 = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [16, 16]})))
    assert r16.feasible
    line = memory_fix(p)
    assert line == (f"fix: dp_replicate 16 x dp_shard 16 (the data axes re-split on the same nodes) -> peak {_gib(r16)} "
                    f"(fits; {_step(r16)}) (usable 71.3 GiB)")
    assert "73.6" not in line


def test_a_tight_variant_is_marked():
    """#C: Llama-3-8B at seq 8192, micro-batch 2, dp_shard 8 on one dgx-h100 peaks at 106.4 GiB. Its
    micro-batch 1 variant fits at 63.1 GiB of 71.20 usable (the H100's runtime total 79.11 GiB x 0.9; the peak by hand:
    tests/test_compare_headroom.PEAK_8B_NONE, the same job):
    71.20 - 63.12 = 8.08 GiB = 11.3% free, under the search's 15% (tight, marked; 3.94 GiB = 5.9% of the
    datasheet's 67.06 GiB before); recompute full fits with more than 15% free (unmarked). The
    line keeps its order, the fastest first."""
    cfg = config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 16, "seq_len": 8192, "micro_batch": 2, "sharding": "zero3", "recompute": "none"},
        "mesh": {"names": ["dp_shard"], "shape": [8]}})
    p = build_plan(cfg)
    mb1 = build_plan(replace(cfg, training=cfg.training.model_copy(update={"micro_batch": 1})))
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    assert not p.feasible and mb1.feasible and full.feasible
    assert mb1.timeline.peak.by_kind == PEAK_8B_NONE
    usable = 79.11 * 2**30 * 0.9
    free = usable - mb1.timeline.peak.total_bytes
    assert (round(free / GiB, 2), round(free / usable, 3)) == (8.08, 0.113)
    assert full.timeline.peak.total_bytes < 0.85 * usable
    line = memory_fix(p)
    mine = f"micro_batch 1 -> peak 63.1 GiB (fits; {_step(mb1)}; tight: 8.1 GiB = 11.3% of the usable 71.2 GiB free, under 15%)"
    assert mine in line and f"recompute full -> peak {_gib(full)} (fits; {_step(full)})" in line
    first, _ = sorted((mb1, full), key=lambda q: step_time(q).step_s)
    assert line.startswith("fix: micro_batch 1" if first is mb1 else "fix: recompute full")
