"""Golden step times of three small whole plans, every term derived by hand (issue 10, item 3).

Each test writes out the step of :func:`meshplan.schedule.steptime.step_time` (default
:class:`~meshplan.schedule.rank_timeline.Overlap`) term by term, from the formulas the modules'
docstrings state and the catalog's measured data (copied here as named constants, checked
against the catalog in ``test_inputs_are_the_catalog_values``), and asserts the plan's step
time to 1e-6 relative:

- GEMM time = FLOP / (peak x efficiency), the efficiency from a GEMM table this test supplies
  (every local GEMM shape at ``EFF_GEMM``; the ``--gemm-table`` / :class:`GemmTable` path, which
  takes precedence over the catalog's measured GEMM points), so the golden does not depend on
  the interpolation of kernels.toml's GEMM rows; attention likewise from the table's fused-attention
  entry at ``EFF_ATTN`` (forward FLOP = causal half ``2 b a s^2 d``, backward 2.5x forward);
- memory-bound ops = bytes read + written / measured bandwidth (the byte counts of compute/elementwise.py and compute/megatron.py):
  norms on the fused-norm curve by hidden size, everything else at BabelStream Triad
  (catalog/kernels.toml); the backward's residual-gradient accumulation before each norm;
- torch plans run uncompiled (``training.torch_compile`` off): SwiGLU, RoPE and the fp32 cross
  entropy kernel by kernel (compute/torch_eager.py); FSDP2's copy-out after each all-gather and
  copy-in before each reduce-scatter on the compute stream (comm/fsdp2.py);
- every kernel at least the host's issue floor (4.7 us), and per micro-batch the batch's
  blocking copies to the GPU over the node's PCIe link (torch: inputs and labels in the
  embedding's forward; Megatron-LM: rank 0's copy and, at tp > 1, get_batch's two tp
  broadcasts on the NVLink curve; compute/batch_input.py);
- each collective from the measured nccl-tests curves of catalog/nccl.toml
  (comm/alphabeta.measured_time: NCCL's latency for the group, plus the curve's bandwidth term
  at that size, the straight line between two measured rows, scaled to the bytes sent), NVLS
  for an all-reduce inside the node, ring or hierarchical across nodes, the fastest one;
- the pipeline bubble from 1F1B's fill and drain; the optimizer step's passes (gradient norm and
  clip, Adam, master copy, gradient-buffer zeroing) at Triad bandwidth (compute/kernel_time.optimizer_bandwidth).

Every term is a named variable with a comment, so a model change (a new kernel, other
measured rows, new NCCL constants) is one more term or one changed line here.
Mutations that fail here: the exact optimizer step doubled (all three), the pp send not
timed (pp 2), the issue floor removed (all three), the residual-gradient accumulation
dropped (all three), FSDP prefetch off by default (dp_shard 16). (The residual add's bytes
3 -> 2 operands no longer fails: the add, 4.2 us at Triad, runs at the 4.7 us issue floor.)

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
PEAK = 989.4e12            # dense BF16 FLOP/s, H100 SXM5 datasheet (catalog/gpus.toml)
NVLINK = 450e9             # NVLink4 bytes/s per GPU per direction (catalog/nodes.toml dgx-h100 fabric)
NIC = 400e9 / 8            # one ConnectX-7 per GPU, 400 Gbit/s (catalog/nodes.toml dgx-h100 nics)
NODE_GPUS = 8
# The test's GEMM table: every local GEMM at 60% of peak, fused attention at 40%.
EFF_GEMM, EFF_ATTN = 0.60, 0.40

# Measured kernel data (catalog/kernels.toml, [gpu.h100-sxm5-80gb] and [host]) --------------
TRIAD = 2.97e12            # stream_tb_per_s: BabelStream Triad, every elementwise kernel and the optimizer
NORM_POINTS = (4096, (1024, 4096, 16384), (0.0122, 0.0292, 0.095))  # norm_rows / norm_hidden / norm_ms (Liger RMSNorm)
ISSUE = 4.7e-6             # [host] kernel_issue_s: no kernel shorter than this (compute/kernel_time.issue_floor)
PCIE, PCIE_LAT = 63e9, 5.7e-6   # dgx-h100 pcie: PCIe 5.0 x16 B/s per direction, latency (catalog/nodes.toml)

# NCCL latencies (comm/nccl_protocols.NCCL_LATENCY_US["ring"], NVIDIA/nccl tuning.cc): (LL, LL128, Simple)
BASE_US, NVL_STEP_US, NET_STEP_US = (6.6, 14.0, 8.4), (0.6, 1.9, 3.4), (2.7, 4.0, 14.0)
NVLS_LAT = 25e-6                    # alphabeta.NVLS: NCCL tuning.cc hwLat NVLink NVLS/Simple, no base, one step

# Measured nccl-tests all-reduce rows (catalog/nccl.toml), (size B, busbw GB/s); time = 1.75 S / busbw
# for 8 ranks (busbw factor 2(n-1)/n), 1.875 S / busbw for 16.
RING_NVL = {"1K": (1024, 0.07), "64K": (65536, 2.72), "1M": (1048576, 43.70), "8G": (8589934592, 368.0)}
NVLS_4M = (4194304, 128.73)             # h100-nvlink4-nvls, its 4M row; rank_counts: 8 ranks -> factor 1
NIC_8G = (8589934592, 376.0)            # ib-ndr-400-8nic: 16 ranks, 2 nodes, line 400 GB/s, one row
# Model and workload ------------------------------------------------------------------------
L, H, F, Q, D, V = 2, 1024, 4096, 8, 128, 32768
S, B = 2048, 2             # tokens per micro-batch (seq 2048 x micro-batch 1), bytes per bf16 element
MODEL = {"name": "golden", "layers": L, "hidden": H, "ffn": F, "q_heads": Q, "kv_heads": Q, "head_dim": D,
         "vocab": V}
BYTES_PER_PARAM = 2 + 4 + 4 + 8   # bf16 param, fp32 grad, fp32 master, two fp32 Adam moments


def config(mesh: dict, nodes: int, global_batch: int, sharding: str, framework: str = "torch"):
    return config_from_dict({"model": MODEL, "cluster": {"system": "dgx-h100", "nodes": nodes},
                             "training": {"global_batch": global_batch, "seq_len": S, "micro_batch": 1,
                                          "recompute": "none", "sharding": sharding, "framework": framework},
                             "mesh": mesh})


# Compute terms -----------------------------------------------------------------------------

def kernel(seconds: float) -> float:
    """One kernel on the step: never shorter than the host's issue floor (compute/kernel_time.issue_floor)."""
    return max(seconds, ISSUE)


def least_squares(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of the ordinary least-squares line through the points."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


# A fused norm of n bytes takes NORM_T0 + n / NORM_BW: the least-squares line through the Liger
# times against their bytes 2 x 4096 rows x H x 2 B (compute/measured.memory_seconds, kind "norm"):
# 6.90 us + n / 3.045 TB/s.
NORM_T0, _slope = least_squares([2 * NORM_POINTS[0] * h * 2 for h in NORM_POINTS[1]], [ms * 1e-3 for ms in NORM_POINTS[2]])
NORM_BW = 1 / _slope


#: the row-parallel linears: their weight gradient is computed with their input gradient
#: (schedule/rank_timeline.ROW_PARALLEL_WGRAD), before the block's input-gradient all-reduce
ROW = ("wo", "w_down")
#: SMs NCCL's NVLink collectives hold on an H100 (catalog/nodes.toml dgx-h100 fabric
#: nccl_channels 24 / gpus.toml 132 SMs): compute beside them runs at 1 - 24/132
SM_SHARE = 24 / 132


def beside(compute: float, comm: float) -> float:
    """``compute`` seconds issued when a collective of ``comm`` seconds starts, until both end:
    the kernels progress at 1 - SM_SHARE while it runs (unit_sim.StreamSim._finish)."""
    rate = 1 - SM_SHARE
    return comm + max(0.0, compute - rate * comm)


def linears(tp: int, fused_qkv: bool = False) -> dict:
    """Per-rank linear layers of one transformer layer: name -> (K in, N out, block).
    ``fused_qkv`` (Megatron-LM): Q, K and V as one column-parallel GEMM of width 3 Q D / tp."""
    qkv = {"wqkv": (H, 3 * Q * D // tp, "attn")} if fused_qkv else \
        {"wq": (H, Q * D // tp, "attn"), "wk": (H, Q * D // tp, "attn"), "wv": (H, Q * D // tp, "attn")}
    return {**qkv, "wo": (Q * D // tp, H, "attn"), "w_gate": (H, F // tp, "mlp"), "w_up": (H, F // tp, "mlp"),
            "w_down": (F // tp, H, "mlp")}


def wgrad_s(n: int, k: int, fp32_acc: bool = False) -> float:
    """Weight gradient (N, K, M = S) of a linear K -> N at the table's efficiency; with
    ``fp32_acc`` (Megatron-LM's gradient_accumulation_fusion into fp32 main gradients) no
    faster than its bytes at Triad: the bf16 operands (N x S, S x K) and C read and written
    in fp32, 8 B per weight element (compute/kernel_time.wgrad_accumulate_s)."""
    t = gemm_s(n, k, S)
    return max(t, (B * (n * S + S * k) + 8 * n * k) / TRIAD) if fp32_acc else t


def gemm_s(m: int, n: int, k: int) -> float:
    """One GEMM (M, N, K) at the table's efficiency: 2 M N K / (peak x EFF_GEMM)."""
    return 2 * m * n * k / (PEAK * EFF_GEMM)


def attention_flops(tp: int) -> float:
    """Causal-half forward FLOP of the attention core: 2 b a s s d (a = local heads)."""
    return 2 * 1 * (Q // tp) * S * S * D


def gemm_table(tp: int) -> GemmTable:
    """Every local GEMM shape of the plan (forward (M, N, K), data gradient (M, K, N), weight
    gradient (N, K, M); M = S tokens) and the output layer, each at EFF_GEMM; the attention call
    (batch 1, local heads, seq S x S) at EFF_ATTN, backward 2.5x the forward FLOP. The table
    takes precedence over the catalog's measured GEMM and attention rates."""
    shapes = [(S, n, k) for f in (False, True) for k, n, _ in linears(tp, f).values()] + [(S, V // tp, H)]
    rows = {}
    for m, n, k in shapes:
        for mm, nn, kk in ((m, n, k), (m, k, n), (n, k, m)):
            rows[(mm, nn, kk, "bf16")] = Measurement(mm, nn, kk, "bf16", gemm_s(mm, nn, kk), "golden", "-")
    att = attention_flops(tp) / (PEAK * EFF_ATTN)
    return GemmTable(rows, "golden", {(1, Q // tp, Q // tp, S, S, D, "bf16"): (att, 2.5 * att)})


def layer_terms(tp: int, megatron: bool = False) -> dict:
    """Seconds of one layer per block and pass (no SP: norms and adds see all S rows), every
    kernel floored at ISSUE. ``f_*`` forward, ``b_*`` input gradient, ``w_*`` weight gradient.
    Byte counts of compute/elementwise.elementwise_ops; norms NORM_T0 + bytes at NORM_BW, everything else at TRIAD.
    ``megatron``: one fused QKV GEMM (one kernel, one floor) and fp32-accumulating weight
    gradients (:func:`wgrad_s`); Megatron-LM's fused layer norm backward reads x and dy twice
    (5 passes, compute/megatron.norm_backward_passes); each norm weight's main-gradient hook
    (main_grad.add_: fp32 main gradient read and written, bf16 gradient read, 10 B x h: one
    floored kernel) runs with the column-parallel weight gradients of its block, and so does
    the ``torch.empty(1) + 1`` delay kernel Megatron issues after launching the column-parallel
    input gradient's async all-reduce (no SP, tp > 1: one floor, compute/megatron.comm_delay_kernels)."""
    lin = linears(tp, megatron)
    fwd = lambda blk: sum(kernel(gemm_s(S, n, k)) for k, n, b in lin.values() if b == blk)      # (M, N, K)
    dgrad = lambda blk: sum(kernel(gemm_s(S, k, n)) for k, n, b in lin.values() if b == blk)    # (M, K, N)
    wgrad = lambda blk, row=None: sum(kernel(wgrad_s(n, k, megatron)) for name, (k, n, b) in lin.items()
                                      if b == blk and row in (None, name in ROW))            # (N, K, M)
    att_f = kernel(attention_flops(tp) / (PEAK * EFF_ATTN))          # table's forward
    att_b = kernel(2.5 * attention_flops(tp) / (PEAK * EFF_ATTN))    # table's backward
    norm_f, norm_b = kernel(NORM_T0 + 2 * B * S * H / NORM_BW), kernel(NORM_T0 + (5 if megatron else 3) * B * S * H / NORM_BW)
    hook = kernel(10 * H / TRIAD) if megatron else 0.0                # Megatron: norm weight main_grad add
    delay = ISSUE if megatron and tp > 1 else 0.0                     # Megatron: empty(1) + 1 after the async all-reduce
    add = kernel(3 * B * S * H / TRIAD)                               # residual add: two in, one out (both passes)
    grad_acc = kernel(3 * B * S * H / TRIAD)                          # backward: skip + norm-branch gradient summed
    e, a = S * (Q // tp) * D, S * (F // tp)                           # elements of q (= of k: no GQA); of the gate
    if megatron:  # fused kernels
        rope = kernel(2 * B * 2 * e / TRIAD)                          # q and k rotated: in and out
        silu_f = kernel(3 * B * a / TRIAD)                            # silu(gate) x up: gate, up in, out
        silu_b = kernel(5 * B * a / TRIAD)                            # gate, up, dy in; d gate, d up out
    else:  # torch without torch.compile (compute/torch_eager.py), each pass: on q, then on k, the
        # upcast (2 in, 4 out), the complex multiply (4 in, 4 out) and the downcast (4 in, 2 out)
        rope = 2 * (kernel((B + 4) * e / TRIAD) + kernel(8 * e / TRIAD) + kernel((4 + B) * e / TRIAD))
        silu_f = kernel(2 * B * a / TRIAD) + kernel(3 * B * a / TRIAD)  # silu (1 in, 1 out), x up (2 in, 1 out)
        silu_b = kernel(3 * B * a / TRIAD) + kernel(6 * B * a / TRIAD)  # silu_backward; mul's two products
    # no linear biases (model: linear_bias and qkv_bias false): elementwise.bias_ops adds nothing
    return {"f_attn_pre": norm_f, "f_attn": fwd("attn") + att_f + rope, "f_attn_post": add,
            "f_mlp_pre": norm_f, "f_mlp": fwd("mlp") + silu_f, "f_mlp_post": add,
            "b_attn_pre": norm_b + grad_acc, "b_attn": dgrad("attn") + att_b + rope, "b_attn_post": add,
            "b_mlp_pre": norm_b + grad_acc, "b_mlp": dgrad("mlp") + silu_b, "b_mlp_post": add,
            "w_attn": wgrad("attn") + hook + delay, "w_mlp": wgrad("mlp") + hook + delay,
            "row_w_attn": wgrad("attn", True), "row_w_mlp": wgrad("mlp", True),
            "col_w_attn": wgrad("attn", False) + hook + delay, "col_w_mlp": wgrad("mlp", False) + hook + delay}


def h2d(nbytes: float) -> float:
    """One blocking host-to-device copy over the node's PCIe link (compute/batch_input.host_copy_seconds)."""
    return PCIE_LAT + nbytes / PCIE


def get_batch_broadcasts(tp: int) -> float:
    """Megatron-LM's two get_batch broadcasts over the tp group (compute/batch_input.py): the
    sizes (5 int64, 40 B), then the batch (S + 1 int64 tokens), each on the NVLink ring curve
    (nvlink_ring_s, broadcast: n - 1 steps, S bytes sent); none at tp 1."""
    return 0.0 if tp == 1 else nvlink_ring_s("broadcast", tp, 40) + nvlink_ring_s("broadcast", tp, 8 * (S + 1))


def head_terms(tp: int, megatron: bool = False) -> dict:
    """Embedding (first stage) and head (last stage) seconds: lookup read + write S x h at
    TRIAD, plus (torch) torchtitan's two blocking copies of the micro-batch's int64 inputs and
    labels to the GPU and one issue floor after them in the embedding's forward; its weight gradient
    torch's dense one: the zero-filled V/tp x h bf16 table and the S rows scattered (read +
    write S x h), one kernel here; final norm (NORM_BW), output GEMM (S, V/tp, h), vocab-parallel
    cross entropy (reads bf16 logits, writes the fp32 softmax: (2 + 4) B per logit, both passes,
    TRIAD). ``megatron`` (compute/megatron.py): the lookup's rows of other tp ranks zeroed
    (2 B x S x h x (tp-1)/tp), no [b s h] -> [s b h] transpose copy (micro-batch 1: a view), the
    embedding's main-gradient hook (10 B x V/tp x h), with tp > 1 the zeroing's gradient (the
    gradient cloned, 2 x 2 B x S x h, and its (tp-1)/tp rows zeroed; micro-batch 1: the
    transposed gradient view is contiguous, no copy), the final norm's backward in 5 passes and
    its weight's hook (10 B x h), and the cross entropy on fp32 logits pass by pass: 38 B per
    logit forward (upcast 2 + 4, max 4, sub 8, exp 8, sum 4, div 8), 14 B backward (mul 8,
    upcast's backward 4 + 2). Megatron-LM 2022 runs ``get_batch`` in every chunk's forward
    (compute/megatron.batch_bytes): rank 0's copy of the S + 1 tokens to the GPU and the two tp
    broadcasts (get_batch_broadcasts; then no copy in the embedding), the
    causal mask from fp32 ones (4 S^2 B), tril (8 S^2), < 0.5 (5 S^2), 2 small kernels (loss mask,
    position ids: at the floor; micro-batch 1: the labels' and tokens' slices are contiguous, no
    copies), and its timers' syncs, one floor each:
    4 in forward, 2 in backward (``batch_f``, ``batch_b``), and broadcast_data's sizes copied to
    the GPU and back (2 floors in ``batch_f``); the loss's tiny kernels, 22 in forward and 12 in
    backward (the loss graph's 10 and backward_step's scale_loss multiply with its backward; 20 in
    forward at micro-batch 1: the two transposes are views), one floor each
    (compute/megatron.loss_kernels). With tp > 1 the output layer's
    backward issues Megatron's ``torch.empty(1) + 1`` delay after its async all-reduce (one
    floor in ``head_w``)."""
    logits = S * V // tp
    # torch without torch.compile (compute/torch_eager.py): forward the upcast (2 in, 4 out) and
    # log_softmax (4 in, 4 out); backward nll_loss's zero-filled gradient (4 out), log_softmax's
    # backward (4 + 4 in, 4 out) and the upcast's gradient (4 in, 2 out); one kernel each
    ce_f = kernel(38 * logits / TRIAD) if megatron else kernel((B + 4) * logits / TRIAD) + kernel(8 * logits / TRIAD)
    ce_b = kernel(14 * logits / TRIAD) if megatron else \
        kernel(4 * logits / TRIAD) + kernel(12 * logits / TRIAD) + kernel((4 + B) * logits / TRIAD)
    emb_f = kernel(2 * B * S * H / TRIAD) + (0.0 if megatron else 2 * h2d(8 * S) + ISSUE)
    batch_f = (h2d(8 * (S + 1)) + get_batch_broadcasts(tp) + kernel(4 * S * S / TRIAD) + kernel(8 * S * S / TRIAD) + kernel(5 * S * S / TRIAD)
               + 2 * ISSUE + 4 * ISSUE + 2 * ISSUE) if megatron else 0.0
    batch_b = 2 * ISSUE if megatron else 0.0
    emb_w = kernel((B * (V // tp) * H + 2 * B * S * H) / TRIAD)
    head_w = kernel(wgrad_s(V // tp, H, megatron))
    if megatron:
        emb_f += kernel(B * S * H * (tp - 1) // tp / TRIAD)   # micro-batch 1: the transpose's .contiguous() copies nothing
        emb_w += kernel(10 * (V // tp) * H / TRIAD)
        if tp > 1:  # the zeroed rows' gradient: index_put_'s derivative clones it and zeroes the rows again
            emb_w += kernel((2 * B * S * H + B * S * H * (tp - 1) // tp) / TRIAD)
        head_w += kernel(10 * H / TRIAD) + (ISSUE if tp > 1 else 0.0)
    loss_f, loss_b = (20 * ISSUE, 12 * ISSUE) if megatron else (0.0, 0.0)   # compute/megatron.loss_kernels(1)
    return {"emb_f": emb_f, "emb_w": emb_w, "batch_f": batch_f, "batch_b": batch_b,
            "head_f": kernel(NORM_T0 + 2 * B * S * H / NORM_BW) + kernel(gemm_s(S, V // tp, H)) + ce_f
            + loss_f,
            "head_b": kernel(NORM_T0 + (5 if megatron else 3) * B * S * H / NORM_BW) + kernel(gemm_s(S, H, V // tp))
            + ce_b + loss_b,
            "head_w": head_w}


def layer_params(tp: int) -> int:
    """Parameters of one layer on one rank: the linears split by tp, two replicated norms."""
    return sum(k * n for k, n, _ in linears(tp).values()) + 2 * H


def optimizer_s(params: float, zero_grads: bool = True, megatron: bool = False, master: bool = True) -> float:
    """Optimizer step at Triad (compute/kernel_time.optimizer_bandwidth, schedule/steptime.optimizer_step_bytes),
    per parameter: gradient norm (read 4 B) and clip (read + write 4 B) = 12; Adam reads master,
    gradient and both moments (4 + 4 + 8) and writes master and moments (4 + 8) = 28; the master
    copied to the bf16 parameter (read 4, write 2) = 6; zero1 zeroes its fp32 gradient buffer
    (write 4), FSDP2 (zero3) frees it instead: 50 or 46 B. Megatron-LM also divides that buffer
    by the dp size in place (read + write 4 B, at dp 1 too): 58 B. ``master=False``: fp32
    parameters updated in place (torchtitan's FSDP2 default), no copy: 40 B under zero3."""
    copy = 6 if master else 0
    return (12 + 28 + copy + (4 if zero_grads else 0) + (8 if megatron and zero_grads else 0)) * params / TRIAD


def megatron_step_s(tp: int) -> float:
    """Megatron-LM 2022's per-step kernels beyond the optimizer's bulk passes, no SP
    (compute/megatron_cost.megatron_step_cost): every parameter tensor of the rank copied master -> bf16
    by its own ``copy_`` (6 B per element; the bulk bytes are in optimizer_s, so each adds the
    floor's excess over them): per layer the two norm weights, the fused QKV, wo, w_gate, w_up,
    w_down, then the word embedding (V/tp x h) and the final norm; 23 syncs (11 timers
    started and stopped, the gradient norm's ``.item()``), one floor each; and the loss of the one
    micro-batch averaged and logged (0 + loss, / 1, training_log's H2D zero and add: 4 floors)."""
    per_layer = [H, H] + [k * n for k, n, _ in linears(tp, fused_qkv=True).values()]
    tensors = L * per_layer + [(V // tp) * H, H]
    return sum(max(0.0, ISSUE - 6 * n / TRIAD) for n in tensors) + 23 * ISSUE + (1 + 3) * ISSUE


# Communication terms (comm/alphabeta.py measured_time, collective_time) ---------------------

def latency(steps: int, network: bool = False) -> float:
    """NCCL's latency for ``steps`` ring steps, fastest protocol: min(base + steps x per-step)."""
    per = NET_STEP_US if network else NVL_STEP_US
    return min(b + steps * p for b, p in zip(BASE_US, per)) * 1e-6


def row_time(row: tuple, factor: float) -> float:
    """A measured row's time: factor x size / busbw (nccl-tests: busbw = factor x S / t)."""
    return factor * row[0] / (row[1] * 1e9)


def on_curve(size: float, sent: float, lat: float, lat_ref: float, factor: float, line: float, bw: float,
             p0: tuple, p1: tuple) -> float:
    """Time of a collective read from a measured curve between the points p0 = (S0, t0) and
    p1 = (S1, t1) (straight line in S): t_meas(S) on that line, its bandwidth term t_meas -
    lat_ref (lat_ref: NCCL's latency at the curve's own rank count) scaled from the curve's
    bytes (factor x S at ``line``) to this collective's (``sent`` at ``bw``), after ``lat``."""
    (s0, t0), (s1, t1) = p0, p1
    t_meas = t0 + (t1 - t0) * (size - s0) / (s1 - s0)
    return lat + sent / (factor * size) * (t_meas - lat_ref) * line / bw


def nvlink_ring_s(op: str, n: int, size: float) -> float:
    """Ring on NVLink from h100-nvlink4-ring (8 ranks, all-reduce, line 450 = NVLINK): latency for
    this op's steps, reference latency for the curve's 14 steps. Below 1 KiB between (0, that
    reference latency) and the 1K row; below 64 KiB between the 1K and 64K rows; above 1 MiB
    between the 1M row (raised to the 64K row's larger time: a larger buffer is never faster)
    and the 8G row. A broadcast sends its whole buffer (busbw factor 1)."""
    k = {"all-reduce": 2 * (n - 1), "send/recv": 1}.get(op, n - 1)
    sent = {"all-reduce": 2 * (n - 1) / n, "send/recv": 1.0, "broadcast": 1.0}.get(op, (n - 1) / n) * size
    t = {key: row_time(r, 1.75) for key, r in RING_NVL.items()}
    if size < RING_NVL["1K"][0]:
        p0, p1 = (0.0, latency(14)), (RING_NVL["1K"][0], t["1K"])
    elif size <= RING_NVL["64K"][0]:
        p0, p1 = (RING_NVL["1K"][0], t["1K"]), (RING_NVL["64K"][0], t["64K"])
    else:
        assert RING_NVL["1M"][0] <= size <= RING_NVL["8G"][0]
        p0, p1 = (RING_NVL["1M"][0], max(t["1M"], t["64K"])), (RING_NVL["8G"][0], t["8G"])
    return on_curve(size, sent, latency(k), latency(14), 1.75, NVLINK, NVLINK, p0, p1)


def nvls_s(size: float) -> float:
    """NVLS all-reduce over the 8 GPUs of a node at exactly the 4M row of h100-nvlink4-nvls
    (rank factor 1 at the curve's 8 ranks), after NVLS_LAT (the reference latency is the same)."""
    assert size == NVLS_4M[0]
    t_4m = row_time(NVLS_4M, 1.75)
    return on_curve(size, 1.75 * size, NVLS_LAT, NVLS_LAT, 1.75, NVLINK, NVLINK, (0.0, NVLS_LAT), (size, t_4m))


def nic_ring_s(op: str, n: int, size: float, bw: float) -> float:
    """Ring across nodes on ib-ndr-400-8nic (16 ranks, all-reduce: 30 steps, factor 1.875, line
    400 GB/s): below its one 8G row, the line from (0, NCCL latency of 30 network steps) to it."""
    k = n - 1                                     # all-gather / reduce-scatter
    lat_ref = latency(30, network=True)
    return on_curve(size, (n - 1) / n * size, latency(k, network=True), lat_ref, 1.875, 8 * NIC, bw,
                    (0.0, lat_ref), (NIC_8G[0], row_time(NIC_8G, 1.875)))


def cross_node_s(op: str, n: int, size: float, nodes: int) -> float:
    """An all-gather or reduce-scatter over n ranks on ``nodes`` nodes, each node's ranks leaving
    through their own NICs (8 x NIC per group): the faster of the ring and the hierarchical
    algorithm (the op across nodes on S/g at 8 NIC / g, then the op inside the node over NVLink,
    g = n / nodes). No tree: none of these plans all-reduces across nodes."""
    g = n // nodes
    ring = nic_ring_s(op, n, size, 8 * NIC)
    hier = nic_ring_s(op, nodes, size / g, 8 * NIC / g) + nvlink_ring_s(op, g, size)
    return min(ring, hier)


def test_inputs_are_the_catalog_values():
    """The derivation's hardware numbers are the catalog's (a catalog change re-derives here)."""
    from meshplan.compute.measured import kernel_data

    c = config({"names": ["tp"], "shape": [8]}, 1, 1, "zero1").cluster
    assert c.gpu.peak_flops("bf16") == PEAK
    assert c.node.fabric.bandwidth_bytes_per_s == NVLINK and c.node.fabric.nvls and c.node.gpus == NODE_GPUS
    assert c.node.fabric.latency_us == 3.4 and c.network[0].latency_us == 14.0    # = the Simple per-step values
    assert [n.bandwidth_bytes_per_s for n in c.node.nics] == [NIC] * NODE_GPUS
    k = kernel_data(c.gpu.name)
    assert (k.stream_bytes_per_s, k.kernel_issue_s) == (TRIAD, ISSUE)
    assert (c.node.pcie.bandwidth_bytes_per_s, c.node.pcie.latency_s) == (PCIE, pytest.approx(PCIE_LAT, rel=1e-12))
    assert (k.norm_fixed_s, k.norm_bytes_per_s) == (pytest.approx(NORM_T0, rel=1e-12), pytest.approx(NORM_BW, rel=1e-12))
    assert (round(NORM_T0 * 1e6, 2), round(NORM_BW / 1e12, 3)) == (6.9, 3.045)
    ring, nvls, nic = (c.node.busbw[kind] for kind in ("nvlink", "nvls", "nic"))
    assert dict(zip(ring.sizes_bytes, ring.busbw_gb_per_s)) == dict(RING_NVL.values())
    assert dict(zip(nvls.sizes_bytes, nvls.busbw_gb_per_s))[NVLS_4M[0]] == NVLS_4M[1] and nvls.ranks == 8
    assert list(zip(nic.sizes_bytes, nic.busbw_gb_per_s)) == [NIC_8G] and (nic.ranks, nic.line_gb_per_s) == (16, 400.0)


@pytest.mark.parametrize("framework", ["torch", "megatron"])
def test_tp8_one_node(framework, no_host_pace):
    """tp 8 (no SP) on one DGX H100, zero1 over dp 1, one micro-batch.

    Forward unit: embedding + its vocab-parallel all-reduce, per layer the attention and MLP
    blocks each followed by a blocking all-reduce of (S, h), the head, then the loss's three
    all-reduces of S fp32 (max, sum-exp, target logit). Backward unit: the head's gradient and
    its all-reduce, per layer each block's input gradient and its row-parallel linear's weight
    gradient, then the column-parallel linears' weight gradients and the block's all-reduce:
    torch issues the all-reduce after them and waits (W + AR); Megatron-LM issues it before
    them and they run beside it, slowed by its 24 of 132 SMs (beside()), the output layer's
    too (its input gradient's all-reduce beside its weight gradient, the final norm's backward
    after it). Then the embedding gradient and the optimizer step.
    At tp 8 nearly every kernel is under the 4.7 us issue floor: the GEMMs (e.g. wq 0.9 us),
    the attention (2.7 us forward), the adds; only the norms, the output GEMM and the cross
    entropy are longer. Megatron-LM's fused QKV GEMM is one kernel (one floor where torch pays
    three), and its weight gradients accumulate into the fp32 main gradients
    (layer_terms(megatron=True), head_terms(megatron=True))."""
    tp = 8
    lt, ht = layer_terms(tp, framework == "megatron"), head_terms(tp, framework == "megatron")
    # 4 MiB (S, h) bf16 all-reduce: NVLS at its measured 4M row (57.0 us) against the ring
    # (1M-8G line: 57.1 us): NVLS wins
    ar = min(nvls_s(B * S * H), nvlink_ring_s("all-reduce", tp, B * S * H))
    ar_loss = nvlink_ring_s("all-reduce", tp, 4 * S)      # 8 KiB fp32, 1K-64K line: 27.4 us (NVLS the same)
    layer_f = sum(lt[f"f_{b}"] for b in ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post")) + 2 * ar
    forward = ht["batch_f"] + ht["emb_f"] + ar + L * layer_f + ht["head_f"] + 3 * ar_loss
    grad = (lambda w: beside(w, ar)) if framework == "megatron" else (lambda w: w + ar)
    layer_b = (lt["b_mlp_post"] + lt["b_mlp"] + lt["row_w_mlp"] + grad(lt["col_w_mlp"]) + lt["b_mlp_pre"]
               + lt["b_attn_post"] + lt["b_attn"] + lt["row_w_attn"] + grad(lt["col_w_attn"]) + lt["b_attn_pre"])
    if framework == "megatron":  # the output layer's all-reduce beside its weight gradient, then the final norm
        hook = kernel(10 * H / TRIAD)                     # the final norm weight's main_grad add, after the wait
        head = ht["head_b"] + hook + beside(ht["head_w"] - hook, ar)
    else:
        head = ht["head_b"] + ht["head_w"] + ar
    backward = head + L * layer_b + ht["batch_b"] + ht["emb_w"]
    params = L * layer_params(tp) + (V // tp) * H + H + (V // tp) * H    # layers, embedding, final norm, output
    step = forward + backward + optimizer_s(params, megatron=framework == "megatron")
    step += megatron_step_s(tp) if framework == "megatron" else 0.0

    plan = build_plan(config({"names": ["tp"], "shape": [tp], "sequence_parallel": False}, 1, 1, "zero1", framework))
    got = step_time(plan, Overlap(), table=gemm_table(tp)).step_s
    assert got == pytest.approx(step, rel=1e-6)


def test_tp8_host_pace():
    """The same tp 8 step under torch's eager DTensor TP with the host's measured pace per
    block (kernels.toml ``[host]``: 4.65 ms forward, 5.37 ms backward, M1), hundreds of times
    the layer's microsecond kernels: each layer ends when the host has issued it. Forward: the
    embedding runs while the host issues layer 0, so the layers end at L x 4.65 ms, then the
    head and the loss's three all-reduces. Backward: the head's gradient and its all-reduce run
    while the host issues layer L-1, so the layers end at L x 5.37 ms, then the batch's and the
    embedding's gradients. Then the optimizer step."""
    tp, hf, hb = 8, 4.65e-3, 5.37e-3
    ht = head_terms(tp, False)
    ar_loss = nvlink_ring_s("all-reduce", tp, 4 * S)
    forward = L * hf + ht["head_f"] + 3 * ar_loss
    backward = L * hb + ht["batch_b"] + ht["emb_w"]
    params = L * layer_params(tp) + (V // tp) * H + H + (V // tp) * H
    step = forward + backward + optimizer_s(params, megatron=False)
    plan = build_plan(config({"names": ["tp"], "shape": [tp], "sequence_parallel": False}, 1, 1, "zero1", "torch"))
    st = step_time(plan, Overlap(), table=gemm_table(tp))
    assert st.step_s == pytest.approx(step, rel=1e-6)
    assert st.units.w.dtensor_host_s == (hf, hb)


def test_fsdp16_two_nodes():
    """dp_shard 16 (ZeRO-3) over two DGX H100 nodes, one micro-batch per rank.

    FSDP units as torchtitan wraps them (torchtitan/distributed/fsdp.py apply_fsdp_to_decoder
    at b5bcd76): the embedding (resharded after forward as the layers are), each layer
    (16,779,264 parameters) and [final norm, output] (kept gathered from forward to backward);
    all-gathered in bf16, reduce-scattered in fp32. Each rank's ring leaves its node through
    its own NIC: 8 NICs x 50 GB/s = 400 GB/s per group.
    Forward: the embedding's all-gather (exposed), embedding, layer 0's all-gather (issued
    after the embedding, exposed), layer 1's all-gather issued after layer 0's copy-out, the
    head's after layer 1's (each waited for only if longer than the layer before), head.
    Backward: the head's pre-backward prefetches layer 1 before the head's gradient; the head's
    reduce-scatter right after it (serial after that all-gather on the FSDP stream); layer 0
    prefetched after layer 1's copy-out, the embedding after layer 0's (FSDP2's backward
    prefetch), each layer's reduce-scatter after its backward; the embedding's after the
    embedding gradient; the step ends when that reduce-scatter does, then the optimizer step
    on the 1/16 shard. (nicshare: under torch FSDP2 issues its reduce-scatters on their own
    stream, torch 2.13 _fsdp_param_group.py 89-92, so the head's reduce-scatter no longer waits
    behind layer 1's all-gather, and layer 0's all-gather no longer behind it: the two run at once
    and share each NIC max-min fairly (NVIDIA/nccl #204): each collective's demand is its NIC bytes
    (the ring's (n-1)/n of its bytes over the group's 8 NICs) at 50 GB/s over its time (layer
    all-gather 0.6022, layer reduce-scatter and embedding all-gather 0.7347, head and embedding
    reduce-scatters 0.8255); two demands over 1/2 get 1/2 each, each running at 0.5 / demand of its
    speed while both run. One reduce-scatter in flight (lines 639-658): each copy-in waits for the
    reduce-scatter before. The step 4.2028 -> 4.2359 ms: the backward's end 2.6430 ms from its
    start.) (nc52fixC: the cross-node all-gathers and reduce-scatters hold NCCL's network channels
    while they run, one thread block each (row_shares.nccl_net_channels, NVIDIA/nccl @5067397
    search.cc:827, connect.cc:457/475-478): DGX H100's 8 NICs, 2 x 8 = 16 rings, of the H100's 132
    SMs, s = 16/132 = 0.1212 each; a kernel runs at 1 - (the shares of the running collectives issued
    before it) (unit_events._rates), so it takes its seconds plus s x (the time one ring overlaps it),
    or 2s where two run. Forward: each layer beside the next all-gather (issued before it, shorter than
    it): layer_f + s x ag (0.0158 ms) and layer_f + s x ag_head (0.0260 ms); the copy-outs and the head
    run with no ring issued before them. Backward: the head's gradient beside layer 1's all-gather
    (+ s x ag); layer 1's copy-out beside the head's reduce-scatter (co / (1 - s)); layer 1's backward
    at 1 - 2s until layer 0's all-gather ends, at 1 - s until the head's reduce-scatter ends, then
    alone; layer 0's copy-out beside layer 1's reduce-scatter; layer 0's backward at 1 - 2s until that
    reduce-scatter ends, 1 - s until the embedding's all-gather ends; the embedding's gradient and
    copy-out beside layer 0's reduce-scatter, / (1 - s); the copy-ins find no ring running. The
    collectives keep their times (the NIC shares do not see the SMs), later where the compute is.
    The step 4.2359 -> 4.4267 ms (forward 1.5081 -> 1.5499, backward 2.6430 -> 2.7920 ms; SM
    contention 0.2135 ms, the F unit 0.0418, the B unit 0.1717).)"""
    n = 16
    lt, ht = layer_terms(1), head_terms(1)
    n_layer = layer_params(1)
    n_emb, n_head = V * H, H + V * H
    ag = cross_node_s("all-gather", n, B * n_layer, nodes=2)
    rs = cross_node_s("reduce-scatter", n, 4 * n_layer, nodes=2)
    ag_emb = cross_node_s("all-gather", n, B * n_emb, nodes=2)
    rs_emb = cross_node_s("reduce-scatter", n, 4 * n_emb, nodes=2)
    ag_head = cross_node_s("all-gather", n, B * n_head, nodes=2)
    rs_head = cross_node_s("reduce-scatter", n, 4 * n_head, nodes=2)
    # FSDP2's compute-stream copies (comm/fsdp2.py): after each all-gather its copy-out reads the
    # gathered buffer and writes the parameters (2 x bf16 bytes); before each reduce-scatter its
    # copy-in reads the bf16 gradients and writes the fp32 send buffer (2 + 4 B per parameter)
    co, co_emb, co_head = (kernel(2 * B * x / TRIAD) for x in (n_layer, n_emb, n_head))
    ci, ci_emb, ci_head = (kernel((B + 4) * x / TRIAD) for x in (n_layer, n_emb, n_head))
    layer_f = sum(lt[f"f_{b}"] for b in ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post"))
    layer_b = sum(lt[k] for k in lt if k[0] in "bw")           # no TP: B then W of each block
    s = 16 / 132        # SMs one cross-node ring collective holds: 2 x 8 NICs channels of the H100's 132
    forward = ag_emb + ht["emb_f"] + co_emb + ag + co + (layer_f + s * ag) + co + (layer_f + s * ag_head) \
        + co_head + ht["head_f"]
    assert layer_f > ag_head * (1 - s) and ag_head > ag   # each layer outlasts the ring beside it
    # backward, from its start; FSDP2's reduce-scatters on their own stream beside the all-gathers
    def demand(size, t):  # the share of its NIC a collective holds alone: its NIC bytes at the line rate over t
        return (n - 1) / n * size / 8 / NIC / t
    d_ag, d_rs, d_ag_emb, d_rs_head = (demand(B * n_layer, ag), demand(4 * n_layer, rs), demand(B * n_emb, ag_emb),
                                       demand(4 * n_head, rs_head))
    assert [round(x, 4) for x in (d_ag, d_rs, d_ag_emb, d_rs_head)] == [0.6022, 0.7347, 0.7347, 0.8255]
    head_b = ht["head_b"] + ht["head_w"]
    head_b_end = head_b + s * ag                           # the head's gradient beside layer 1's all-gather
    assert head_b_end > ag
    rs_head_start = head_b_end + ci_head                   # not behind layer 1's all-gather: another stream
    l1_co = rs_head_start + co / (1 - s)                   # layer 1's copy-out, beside the head's reduce-scatter
    # layer 0's all-gather from l1_co beside the head's reduce-scatter: 1/2 of the NIC each
    ag0_end = l1_co + ag / (0.5 / d_ag)
    rs_head_end = ag0_end + rs_head - (l1_co - rs_head_start) - (ag0_end - l1_co) * 0.5 / d_rs_head
    assert rs_head_start < l1_co < ag0_end < rs_head_end   # the all-gather ends first, then the rest alone
    # layer 1's backward: 1 - 2s beside both rings, 1 - s beside the reduce-scatter, then alone
    done = (ag0_end - l1_co) * (1 - 2 * s) + (rs_head_end - ag0_end) * (1 - s)
    assert done < layer_b
    l1_end = rs_head_end + layer_b - done
    rs1_start = max(l1_end, rs_head_end) + ci              # layer 1's copy-in waits for the head's reduce-scatter
    l0_co = max(rs1_start, ag0_end) + co / (1 - s)         # after layer 1's copy-in, beside its reduce-scatter
    # the embedding's all-gather from l0_co beside layer 1's reduce-scatter, equal demands: 1/2 each
    rs1_end = l0_co + (rs - (l0_co - rs1_start)) / (0.5 / d_rs)
    ag_emb_end = rs1_end + ag_emb - (rs1_end - l0_co) * 0.5 / d_ag_emb
    assert rs1_start < l0_co < rs1_end < ag_emb_end
    done = (rs1_end - l0_co) * (1 - 2 * s) + (ag_emb_end - rs1_end) * (1 - s)
    assert done < layer_b
    l0_end = ag_emb_end + layer_b - done
    rs0_end = max(l0_end, rs1_end) + ci + rs               # alone: the embedding's all-gather ended
    assert ag_emb_end < rs0_end - rs
    emb_end = max(l0_end + ci, ag_emb_end) + (ht["emb_w"] + co_emb) / (1 - s)   # beside layer 0's reduce-scatter
    assert emb_end < rs0_end
    rs_emb_end = max(rs0_end, emb_end) + ci_emb + rs_emb   # its copy-in waits for layer 0's reduce-scatter
    params = (L * n_layer + n_emb + n_head) / n            # every kind sharded 16 ways (exact: 6,291,776)
    # torchtitan's fp32 parameters (the torch default), updated in place: no master copy
    step = forward + rs_emb_end + optimizer_s(params, zero_grads=False, master=False)

    plan = build_plan(config({"names": ["dp_shard"], "shape": [n]}, 2, 16, "zero3"))
    st = step_time(plan, Overlap(), table=gemm_table(1))
    assert st.step_s == pytest.approx(step, rel=1e-6)
    # the FSDP stream of the backward, event by event (the step hides some of them)
    fsdp = [(e.name, e.start_s, e.end_s) for e in st.units.get(0, 0, "B", 0).events if e.stream == "fsdp"]
    by_hand = [("fsdp AG L1", 0.0, ag), ("fsdp RS root_head", rs_head_start, rs_head_end),
               ("fsdp AG L0", l1_co, ag0_end), ("fsdp RS L1", rs1_start, rs1_end),
               ("fsdp AG root_embed", l0_co, ag_emb_end), ("fsdp RS L0", rs0_end - rs, rs0_end),
               ("fsdp RS root_embed", rs_emb_end - rs_emb, rs_emb_end)]
    assert round(step * 1e3, 4) == 4.4267   # 4.2359 before nc52fixC's network SM shares
    assert round(st.contention_s() * 1e3, 4) == 0.2135
    assert [x[0] for x in fsdp] == [x[0] for x in by_hand]
    assert [t for x in fsdp for t in x[1:]] == pytest.approx([t for x in by_hand for t in x[1:]], rel=1e-9, abs=1e-12)


def test_pp2_1f1b():
    """pp 2 on two GPUs of one node (mesh.world 2), 1F1B, 4 micro-batches, one layer a stage.

    Stage 0 runs the embedding (with the batch's copies to the GPU) and layer 0, stage 1 layer 1
    and the head (much longer: the 32768-wide output layer). Each forward and backward crosses
    stages as one (S, h) bf16 send/recv, in torch 2.13's Schedule1F1B calls
    (torch/distributed/pipelining/schedules.py ``_step_microbatches``): stage 1 receives F0
    alone (posted at 0, waited: F0 at f0 + send); after each backward k < m - 1 it sends B k's
    gradient and receives F k + 1 in one call waited at once (line 1127), which meets stage 0's
    call after F k + 1 (send it, receive B k's gradient, line 1105). Stage 0 posts that call
    first (a backward, a forward and its calls, asserted below), so stage 1 waits one transfer
    in each of its m - 1 fused calls, and its last backward's send, waited at the end (line
    1172), meets stage 0's receive: stage 1 ends at f0 + send + m (F1 + B1) + m send + its
    optimizer step, stage 0 its last backward later, then its own optimizer step. (Asynchronous
    sends, as meshplan modelled torch before: F k + 1's input there while stage 1 computed, the
    m - 1 fused transfers hidden: 10.2319 ms instead of 10.3257 ms.)"""
    m, p = 4, 2
    lt, ht = layer_terms(1), head_terms(1)
    layer_f = sum(lt[f"f_{b}"] for b in ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post"))
    layer_b = sum(lt[k] for k in lt if k[0] in "bw")
    # 4 MiB over NVLink: one step (LL 7.2 us) + the ring curve's bandwidth term at 4 MiB (1M-8G
    # line, 57.1 us less its 14-step latency 15.0 us) x S / (1.75 S): 31.3 us
    send = nvlink_ring_s("send/recv", 2, B * S * H)
    f0, b0 = ht["emb_f"] + layer_f, layer_b + ht["emb_w"]
    f1, b1 = layer_f + ht["head_f"], ht["head_b"] + ht["head_w"] + layer_b
    assert 2 * send + b0 + f0 <= f1 + b1                 # stage 1 is never starved
    fill = f0 + send                                     # stage 1's F0 starts
    opt0 = optimizer_s(layer_params(1) + V * H)          # layer 0 and the embedding
    opt1 = optimizer_s(layer_params(1) + H + V * H)      # layer 1, final norm, output layer
    stage1_end = fill + m * (f1 + b1) + (m - 1) * send + send + opt1
    stage0_end = fill + m * (f1 + b1) + (m - 1) * send + send + b0 + opt0
    step = max(stage0_end, stage1_end)

    plan = build_plan(config({"names": ["pp"], "shape": [p], "pp_schedule": "1f1b", "world": p}, 1, m, "zero1"))
    assert plan.micro_batches == m
    got = step_time(plan, Overlap(), table=gemm_table(1)).step_s
    assert got == pytest.approx(step, rel=1e-6)
