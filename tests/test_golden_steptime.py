"""Golden step times of three small whole plans, every term derived by hand (issue 10, item 3).

Each test writes out the step of :func:`meshplan.schedule.steptime.step_time` (default
:class:`~meshplan.schedule.rank_timeline.Overlap`) term by term, from the formulas the modules'
docstrings state, and asserts the plan's step time to 1e-6 relative:

- GEMM time = FLOP / (peak x efficiency), the efficiency from a GEMM table this test supplies
  (every local GEMM shape at ``EFF_GEMM``; the ``--gemm-table`` / :class:`GemmTable` path), so
  the golden does not depend on the shape-efficiency model; attention likewise from the table's
  fused-attention entry at ``EFF_ATTN`` (forward FLOP = causal half ``2 b a s^2 d``, backward
  2.5x forward: FlashAttention-2's five products);
- memory-bound ops = bytes read + written / HBM bandwidth (compute/ops.py's byte counts);
- each collective from the alpha-beta formula of comm/alphabeta.py with NCCL's ring latencies
  (tuning.cc), NVLS for an all-reduce inside an NVSwitch node, the hierarchical algorithm across
  nodes; the fastest one, as NCCL's tuner picks;
- the pipeline bubble from 1F1B's fill and drain; the optimizer step reads all state and writes
  all but the gradients at HBM bandwidth.

Every term is a named variable with a comment, so a model change (kernel-launch overhead,
measured attention tables, new NCCL constants) is one more term or one changed line here.
Mutations that fail here: the exact optimizer step doubled (all three), the pp send not
timed (pp 2), the residual add's bytes 3 -> 2 operands (all three), FSDP prefetch off by
default (dp_shard 16).

Model: 2 layers, h 1024, ffn 4096 (SwiGLU), 8 heads of 128 (no GQA), vocab 32768 (a multiple of
128 x tp: no padding), RMSNorm, RoPE; bf16 compute, bf16 parameters, fp32 gradients, master and
Adam states (2 + 4 + 4 + 8 = 18 B per parameter); seq 2048, micro-batch 1, no recompute.
"""

from __future__ import annotations

import pytest

from meshplan.compute.gemm import GemmTable, Measurement
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.rank_timeline import Overlap
from meshplan.schedule.steptime import step_time

# Hardware (catalog dgx-h100, h100-sxm5-80gb; checked against the catalog in test_inputs) -----
PEAK = 989.4e12            # dense BF16 FLOP/s, H100 SXM5 datasheet
HBM = 3.35e12              # HBM3 bytes/s, H100 SXM5 datasheet
NVLINK = 450e9             # NVLink4 bytes/s per GPU per direction (900 GB/s both ways)
NIC = 400e9 / 8            # one ConnectX-7 per GPU, 400 Gbit/s
NODE_GPUS = 8
# The test's GEMM table: every local GEMM at 60% of peak, fused attention at 40%.
EFF_GEMM, EFF_ATTN = 0.60, 0.40
# NCCL ring latencies (base, per NVLink step, per network step) and protocol efficiency
# (NVIDIA/nccl src/graph/tuning.cc; LL 4 of 8 bytes, LL128 120 of 128).
PROTOCOLS = ((6.6e-6, 0.6e-6, 2.7e-6, 0.5), (14.0e-6, 1.9e-6, 4.0e-6, 120 / 128), (8.4e-6, 3.4e-6, 14.0e-6, 1.0))
NVLS_GAIN = 480 / 450      # NVLS all-reduce busbw 480 GB/s on the 450 GB/s link

# Model and workload ------------------------------------------------------------------------
L, H, F, Q, D, V = 2, 1024, 4096, 8, 128, 32768
S, B = 2048, 2             # tokens per micro-batch (seq 2048 x micro-batch 1), bytes per bf16 element
MODEL = {"name": "golden", "layers": L, "hidden": H, "ffn": F, "q_heads": Q, "kv_heads": Q, "head_dim": D,
         "vocab": V}
BYTES_PER_PARAM = 2 + 4 + 4 + 8   # bf16 param, fp32 grad, fp32 master, two fp32 Adam moments


def config(mesh: dict, nodes: int, global_batch: int, sharding: str):
    return config_from_dict({"model": MODEL, "cluster": {"system": "dgx-h100", "nodes": nodes},
                             "training": {"global_batch": global_batch, "seq_len": S, "micro_batch": 1,
                                          "recompute": "none", "sharding": sharding}, "mesh": mesh})


# Compute terms -----------------------------------------------------------------------------

def linears(tp: int) -> dict:
    """Per-rank linear layers of one transformer layer: name -> (K in, N out, block)."""
    return {"wq": (H, Q * D // tp, "attn"), "wk": (H, Q * D // tp, "attn"), "wv": (H, Q * D // tp, "attn"),
            "wo": (Q * D // tp, H, "attn"), "w_gate": (H, F // tp, "mlp"), "w_up": (H, F // tp, "mlp"),
            "w_down": (F // tp, H, "mlp")}


def gemm_s(m: int, n: int, k: int) -> float:
    """One GEMM (M, N, K) at the table's efficiency: 2 M N K / (peak x EFF_GEMM)."""
    return 2 * m * n * k / (PEAK * EFF_GEMM)


def attention_flops(tp: int) -> float:
    """Causal-half forward FLOP of the attention core: 2 b a s s d (a = local heads)."""
    return 2 * 1 * (Q // tp) * S * S * D


def gemm_table(tp: int) -> GemmTable:
    """Every local GEMM shape of the plan (forward (M, N, K), data gradient (M, K, N), weight
    gradient (N, K, M); M = S tokens) and the output layer, each at EFF_GEMM; the attention call
    (batch 1, local heads, seq S x S) at EFF_ATTN, backward 2.5x the forward FLOP."""
    shapes = [(S, n, k) for k, n, _ in linears(tp).values()] + [(S, V // tp, H)]
    rows = {}
    for m, n, k in shapes:
        for mm, nn, kk in ((m, n, k), (m, k, n), (n, k, m)):
            rows[(mm, nn, kk, "bf16")] = Measurement(mm, nn, kk, "bf16", gemm_s(mm, nn, kk), "golden", "-")
    att = attention_flops(tp) / (PEAK * EFF_ATTN)
    return GemmTable(rows, "golden", {(1, Q // tp, Q // tp, S, S, D, "bf16"): (att, 2.5 * att)})


def layer_terms(tp: int) -> dict:
    """Seconds of one layer per block and pass (no SP: norms and adds see all S rows).
    ``f_*`` forward, ``b_*`` input gradient, ``w_*`` weight gradient."""
    lin = linears(tp)
    fwd = lambda blk: sum(gemm_s(S, n, k) for k, n, b in lin.values() if b == blk)      # (M, N, K)
    dgrad = lambda blk: sum(gemm_s(S, k, n) for k, n, b in lin.values() if b == blk)    # (M, K, N)
    wgrad = lambda blk: sum(gemm_s(n, k, S) for k, n, b in lin.values() if b == blk)    # (N, K, M)
    att_f = attention_flops(tp) / (PEAK * EFF_ATTN)                 # table's forward
    att_b = 2.5 * att_f                                               # table's backward
    norm_f, norm_b = 2 * B * S * H / HBM, 3 * B * S * H / HBM       # RMSNorm: x in, y out / x, dy in, dx out
    add = 3 * B * S * H / HBM                                         # residual add: two in, one out (both passes)
    rope = 2 * B * S * (2 * Q // tp) * D / HBM                       # q and k rotated: in and out
    silu_f, silu_b = 3 * B * S * (F // tp) / HBM, 5 * B * S * (F // tp) / HBM   # silu(gate) x up
    return {"f_attn_pre": norm_f, "f_attn": fwd("attn") + att_f + rope, "f_attn_post": add,
            "f_mlp_pre": norm_f, "f_mlp": fwd("mlp") + silu_f, "f_mlp_post": add,
            "b_attn_pre": norm_b, "b_attn": dgrad("attn") + att_b + rope, "b_attn_post": add,
            "b_mlp_pre": norm_b, "b_mlp": dgrad("mlp") + silu_b, "b_mlp_post": add,
            "w_attn": wgrad("attn"), "w_mlp": wgrad("mlp")}


def head_terms(tp: int) -> dict:
    """Embedding (first stage) and head (last stage) seconds: lookup and gradient scatter
    read + write S x h; final norm, output GEMM (S, V/tp, h), vocab-parallel cross entropy
    (reads bf16 logits, writes the fp32 softmax: (2 + 4) B per logit, both passes)."""
    logits = S * V // tp
    return {"emb_f": 2 * B * S * H / HBM, "emb_w": 2 * B * S * H / HBM,
            "head_f": 2 * B * S * H / HBM + gemm_s(S, V // tp, H) + (B + 4) * logits / HBM,
            "head_b": 3 * B * S * H / HBM + gemm_s(S, H, V // tp) + (B + 4) * logits / HBM,
            "head_w": gemm_s(V // tp, H, S)}


def layer_params(tp: int) -> int:
    """Parameters of one layer on one rank: the linears split by tp, two replicated norms."""
    return sum(k * n for k, n, _ in linears(tp).values()) + 2 * H


def optimizer_s(params: float) -> float:
    """Optimizer step: reads all state (18 B/param) and writes all but the 4 B gradient."""
    return (2 * BYTES_PER_PARAM - 4) * params / HBM


# Communication terms (comm/alphabeta.py) ----------------------------------------------------

def ring_s(op: str, n: int, size: float, bw: float, network: bool = False) -> float:
    """base + steps x per-step latency + bytes sent / (bw x protocol efficiency), fastest protocol;
    all-reduce 2(n-1) steps sending 2(n-1)/n S; all-gather and reduce-scatter n-1 steps,
    (n-1)/n S; send/recv 1 step, S."""
    steps = {"all-reduce": 2 * (n - 1), "send/recv": 1}.get(op, n - 1)
    sent = {"all-reduce": 2 * (n - 1) / n, "send/recv": 1.0}.get(op, (n - 1) / n) * size
    return min(base + steps * (net if network else nvl) + sent / (bw * eff) for base, nvl, net, eff in PROTOCOLS)


def nccl_s(op: str, n: int, size: float, bw: float, network: bool = False, nodes: int = 1) -> float:
    """The fastest algorithm: ring; NVLS for an all-reduce in the node (Simple base + two NVLink
    steps, ring bytes at 480/450 of the link); across nodes with g = n / nodes > 1 ranks per node,
    hierarchical: the op across nodes on S/g at bw/g, plus the intra-node part over NVLink.
    (No tree: none of these plans all-reduces across nodes.)"""
    out = [ring_s(op, n, size, bw, network)]
    if op == "all-reduce" and not network:
        out.append(8.4e-6 + 2 * 3.4e-6 + 2 * (n - 1) / n * size / (bw * NVLS_GAIN))
    g = n // nodes
    if network and g > 1:
        local = {"all-gather": ("all-gather",), "reduce-scatter": ("reduce-scatter",),
                 "all-reduce": ("reduce-scatter", "all-gather")}[op]
        out.append(ring_s(op, nodes, size / g, bw / g, True) + sum(ring_s(o, g, size, NVLINK) for o in local))
    return min(out)


def test_inputs_are_the_catalog_values():
    """The derivation's hardware numbers are the catalog's (a catalog change re-derives here)."""
    c = config({"names": ["tp"], "shape": [8]}, 1, 1, "zero1").cluster
    assert (c.gpu.peak_flops("bf16"), c.gpu.hbm_bandwidth_bytes_per_s) == (PEAK, HBM)
    assert c.node.fabric.bandwidth_bytes_per_s == NVLINK and c.node.fabric.nvls and c.node.gpus == NODE_GPUS
    assert c.node.fabric.latency_us == 3.4 and c.network[0].latency_us == 14.0    # = the Simple per-step values
    assert [n.bandwidth_bytes_per_s for n in c.node.nics] == [NIC] * NODE_GPUS


def test_tp8_one_node():
    """tp 8 (no SP) on one DGX H100, zero1 over dp 1, one micro-batch.

    Forward unit: embedding + its vocab-parallel all-reduce, per layer the attention and MLP
    blocks each followed by a blocking all-reduce of (S, h), the head, then the loss's three
    all-reduces of S fp32 (max, sum-exp, target logit). Backward unit: the head's gradient and
    its all-reduce, per layer each block's input gradient, then its weight gradient while the
    block's all-reduce runs (max(W, AR)), the embedding gradient. Then the optimizer step."""
    tp = 8
    lt, ht = layer_terms(tp), head_terms(tp)
    ar = nccl_s("all-reduce", tp, B * S * H, NVLINK)        # 4 MiB (S, h) bf16: NVLS wins
    ar_loss = nccl_s("all-reduce", tp, 4 * S, NVLINK)       # 8 KiB fp32: ring LL wins
    layer_f = sum(lt[f"f_{b}"] for b in ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post")) + 2 * ar
    forward = ht["emb_f"] + ar + L * layer_f + ht["head_f"] + 3 * ar_loss
    layer_b = (lt["b_mlp_post"] + lt["b_mlp"] + max(lt["w_mlp"], ar) + lt["b_mlp_pre"] + lt["b_attn_post"]
               + lt["b_attn"] + max(lt["w_attn"], ar) + lt["b_attn_pre"])
    backward = ht["head_b"] + ht["head_w"] + ar + L * layer_b + ht["emb_w"]
    params = L * layer_params(tp) + (V // tp) * H + H + (V // tp) * H    # layers, embedding, final norm, output
    step = forward + backward + optimizer_s(params)

    plan = build_plan(config({"names": ["tp"], "shape": [tp], "sequence_parallel": False}, 1, 1, "zero1"))
    got = step_time(plan, Overlap(), table=gemm_table(tp)).step_s
    assert got == pytest.approx(step, rel=1e-6)


def test_fsdp16_two_nodes():
    """dp_shard 16 (ZeRO-3) over two DGX H100 nodes, one micro-batch per rank.

    FSDP units: each layer (16,779,264 parameters) and the root (embedding, final norm, output);
    all-gathered in bf16 forward and again in backward, reduce-scattered in fp32. Each rank's
    ring leaves its node through its own NIC: 8 NICs x 50 GB/s = 400 GB/s per group.
    Forward: root all-gather (exposed), embedding, layer 0's all-gather (issued after the
    embedding, exposed), layer 1's all-gather issued when layer 0 starts (waited for only if
    longer than layer 0), head. Backward: head gradient, layer 1's all-gather (exposed), layer
    0's prefetched during layer 1; each layer's reduce-scatter after its backward, serial on
    the FSDP stream; the root's after the embedding gradient; the step ends when the last
    reduce-scatter does, then the optimizer step on the 1/16 shard."""
    n = 16
    lt, ht = layer_terms(1), head_terms(1)
    n_layer = layer_params(1)
    n_root = V * H + H + V * H
    ag = nccl_s("all-gather", n, B * n_layer, 8 * NIC, network=True, nodes=2)       # ring LL128 wins
    rs = nccl_s("reduce-scatter", n, 4 * n_layer, 8 * NIC, network=True, nodes=2)
    ag_root = nccl_s("all-gather", n, B * n_root, 8 * NIC, network=True, nodes=2)
    rs_root = nccl_s("reduce-scatter", n, 4 * n_root, 8 * NIC, network=True, nodes=2)
    layer_f = sum(lt[f"f_{b}"] for b in ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post"))
    layer_b = sum(lt[k] for k in lt if k[0] in "bw")           # no TP: B then W of each block
    forward = ag_root + ht["emb_f"] + ag + max(layer_f, ag) + layer_f + ht["head_f"]
    # backward, from its start
    head_b = ht["head_b"] + ht["head_w"]
    l1_end = head_b + ag + layer_b                       # layer 1 waited for its all-gather
    l0_end = max(l1_end, head_b + 2 * ag) + layer_b      # layer 0's all-gather ran after layer 1's
    rs1_end = max(head_b + 2 * ag, l1_end) + rs          # FSDP stream busy with the prefetch until then
    rs0_end = max(rs1_end, l0_end) + rs
    rs_root_end = max(rs0_end, l0_end + ht["emb_w"]) + rs_root
    params = (L * n_layer + n_root) / n                  # every kind sharded 16 ways (exact: 6,291,776)
    step = forward + rs_root_end + optimizer_s(params)

    plan = build_plan(config({"names": ["dp_shard"], "shape": [n]}, 2, 16, "zero3"))
    got = step_time(plan, Overlap(), table=gemm_table(1)).step_s
    assert got == pytest.approx(step, rel=1e-6)


def test_pp2_1f1b():
    """pp 2 on two GPUs of one node (mesh.world 2), 1F1B, 4 micro-batches, one layer a stage.

    Stage 0 runs the embedding and layer 0, stage 1 layer 1 and the head (much longer: the
    32768-wide output layer). Each forward and backward crosses stages as one (S, h) bf16
    send/recv. Stage 1 never waits after its first forward: stage 0's forward of micro-batch
    k + 2 arrives (two sends, a backward and a forward of stage 0 after stage 1's backward k)
    before stage 1 finishes its forward and backward of k + 1 (asserted below). So stage 1 ends
    at fill + m (F1 + B1) + its optimizer step, and stage 0 a send and its last backward later,
    then its own optimizer step; the bubble is stage 0's forward, two sends and its backward."""
    m, p = 4, 2
    lt, ht = layer_terms(1), head_terms(1)
    layer_f = sum(lt[f"f_{b}"] for b in ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post"))
    layer_b = sum(lt[k] for k in lt if k[0] in "bw")
    send = nccl_s("send/recv", 2, B * S * H, NVLINK)     # 4 MiB over NVLink: ring Simple wins
    f0, b0 = ht["emb_f"] + layer_f, layer_b + ht["emb_w"]
    f1, b1 = layer_f + ht["head_f"], ht["head_b"] + ht["head_w"] + layer_b
    assert 2 * send + b0 + f0 <= f1 + b1                 # stage 1 is never starved
    bubble = f0 + send + send + b0                       # fill and drain on the critical path
    opt0 = optimizer_s(layer_params(1) + V * H)          # layer 0 and the embedding
    opt1 = optimizer_s(layer_params(1) + H + V * H)      # layer 1, final norm, output layer
    stage1_end = f0 + send + m * (f1 + b1) + opt1
    stage0_end = bubble + m * (f1 + b1) + opt0
    step = max(stage0_end, stage1_end)

    plan = build_plan(config({"names": ["pp"], "shape": [p], "pp_schedule": "1f1b", "world": p}, 1, m, "zero1"))
    assert plan.micro_batches == m
    got = step_time(plan, Overlap(), table=gemm_table(1)).step_s
    assert got == pytest.approx(step, rel=1e-6)
