"""Megatron-LM 2022's own kernels around the GEMMs (issue 11, compute/megatron.py), each
read in NVIDIA/Megatron-LM at 2755bcb and derived here by hand for the 22B GPT of Korthikanti et
al. 2022 on A100 (tp 8, micro-batch 4, seq 2048, SP: 8,192 tokens, 1,024 rows per rank; 8 local
heads of 96), every memory-bound pass at BabelStream Triad 1.70 TB/s (catalog kernels.toml),
norms on the fused-norm curve, no kernel below the 4.7 us issue floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.gemm import gemm_time
from meshplan.compute.measured import bandwidth, kernel_data
from meshplan.compute.embed_head import embedding_cost, head_cost
from meshplan.compute.layer import layer_cost
from meshplan.compute.megatron_cost import megatron_batch_cost
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import Gemm, backward_gemms
from meshplan.schedule.steptime import chunk_costs, workload_of
from tests.test_megatron_p2p import plan_of

A100 = catalog.gpu("a100-sxm-80gb")
GPT22B = catalog.model("megatron-22b")   # h 6144, 64 heads of 96, vocab 51200, LayerNorm, biases
GPT175B = catalog.model("megatron-175b")  # h 12288, 96 heads
TRIAD = 1.70e12
ISSUE = 4.7e-6
T, ROWS, H = 8192, 1024, 6144            # tokens, SP rows per rank, hidden
HEADS, D = 8, 96                          # local heads, head dim
MEGATRON = dict(seq_len=2048, micro_batch=4, tp=8, sp=True, flash=False, dropout=True, fused_qkv=True,
                fp32_wgrad_accumulation=True, megatron_ops=True)


def ops_of(cost, phase=None):
    return {o.name: o for o in cost.ops if phase in (None, o.phase)}


def test_attention_copies_by_hand():
    """Non-flash attention (CoreAttention): the context permute(2, 0, 1, 3).contiguous() reads and
    writes b np sq hn = 4 x 8 x 2048 x 96 = 6,291,456 bf16 elements (25,165,824 B); backward: alpha
    scales dQ and dK (read + write each: 50,331,648 B), the split's backward cats dQ, dK, dV
    (read 3, write 3: 75,497,472 B). Selective recompute replays the copy with the core."""
    el = 4 * HEADS * 2048 * D
    assert el == 6_291_456
    c = layer_cost(GPT22B, A100, Workload(**MEGATRON, recompute="selective"))
    fwd, bwd = ops_of(c, "forward"), ops_of(c, "backward_input")
    assert fwd["context permute copy"].size_bytes == 2 * 2 * el == 25_165_824
    assert fwd["context permute copy"].seconds == pytest.approx(25_165_824 / TRIAD)   # 14.8 us
    assert bwd["baddbmm alpha (dQ, dK)"].size_bytes == 2 * 2 * 2 * el == 50_331_648
    assert bwd["qkv split grad (cat)"].size_bytes == 2 * 2 * 3 * el == 75_497_472
    assert bwd["qkv split grad (cat)"].seconds == pytest.approx(75_497_472 / TRIAD)   # 44.4 us
    assert bwd["context permute copy (recompute)"].recompute
    plain = ops_of(layer_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": False})))
    assert not {"context permute copy", "baddbmm alpha (dQ, dK)", "qkv split grad (cat)"} & set(plain)


def test_attention_score_products_are_not_weight_gradients():
    """QK^T and PV's second-operand gradients (dK, dV) are activations: no fp32 main-gradient
    accumulation even with fp32_wgrad_accumulation (it would add 8 B per output element). Both are
    (s_kv, d, s_q) products per head, batched over the 32 local (sequence, head) pairs: dK =
    dS^T Q and dV = P^T dO (torch's bmm derivative for the second operand, mat1^T.bmm(grad)),
    timed alike; the Linear layers' (out, in, tokens) orientation would time dV as a (d, s_kv,
    s_q) product with the batch on d: 172.7 us at 210 TFLOP/s where dK takes 376.2 us (68.5: head
    dim 96 is below the points' N 128, so 93.0 TFLOP/s there on the "D S7a" plane x 0.950 for 32
    batches in place of its 128 (5 waves of 512 tiles against 19 of 2,048: 88.35, test_compute.py
    test_batched_gemm_reads_the_points_plane_at_another_batch_count) x 0.775, the measured PV ratio
    at N 96 of kernels.toml bmm_head_dim, AC24 107 / 138; 2 x 2048 x 96 x 2048 x 32 FLOP = 25.77
    GFLOP / 68.51 TFLOP/s)."""
    c = ops_of(layer_cost(GPT22B, A100, Workload(**MEGATRON)), "backward_input")
    dk = backward_gemms(Gemm("qk^T", 2048, 2048, D, 4 * HEADS))[1]
    assert (dk.m, dk.n, dk.k) == (2048, D, 2048)
    for name in ("qk^T", "pv"):
        want = gemm_time(A100, 2048, D, 2048, "bf16", 4 * HEADS).seconds
        assert c[f"{name}.wgrad"].seconds == pytest.approx(want, rel=1e-12)
        assert "fp32 main-grad" not in c[f"{name}.wgrad"].note
    rate = 93.0 * (512 / 540) / (2048 / 2052) * 107 / 138
    assert c["pv.wgrad"].seconds == pytest.approx(2 * 2048 * D * 2048 * 32 / (rate * 1e12))
    assert c["pv.wgrad"].seconds == pytest.approx(376.2e-6, abs=0.05e-6)
    assert gemm_time(A100, D, 2048, 2048, "bf16", 4 * HEADS).seconds == pytest.approx(172.7e-6, abs=0.05e-6)
    # the layer's real weights still accumulate into fp32: wo's weight gradient moves its 8 B C
    wo = ops_of(layer_cost(GPT22B, A100, Workload(**MEGATRON)), "backward_weight")["wo.wgrad"]
    assert "fp32 main-grad accumulate" in wo.note


def test_layer_norm_backward_persistent_kernel_at_its_hidden_sizes():
    """Megatron-LM 2022's LayerNorm backward (fused_layer_norm.py MixedFusedLayerNorm). At h 6144,
    one of persist_ln_hidden_sizes, apex's FastLayerNormFN: ln_bwd_kernel reads dy and x once and
    writes dx, 3 x 2 B x 1,024 rows x 6,144 = 37,748,736 B, plus its fp32 partial dgamma and dbeta,
    one row of 6,144 each per CTA column: 108 on an A100 (one 256-thread CTA per SM) x 6,144 x 8 B =
    5,308,416 B, on the fused norm's fitted curve; ln_bwd_finalize_kernel reads the partials and
    writes the two bf16 gradients (5,308,416 + 24,576 B at Triad: 3.14 us, so the 4.7 us floor).
    At a hidden size outside the list (6,016: 47 heads of 128) Megatron's own kernel:
    cuComputePartGradGammaBeta reads dy and x, cuComputeGradInput reads them again and writes dx:
    5 passes, no finalize op. Without Megatron's kernels (torch), 3 passes."""
    d = kernel_data("a100-sxm-80gb")
    c = ops_of(layer_cost(GPT22B, A100, Workload(**MEGATRON)), "backward_input")
    main = 3 * 2 * ROWS * H + 108 * H * 8
    assert (3 * 2 * ROWS * H, 108 * H * 8) == (37_748_736, 5_308_416)
    assert c["attn norm"].size_bytes == c["mlp norm"].size_bytes == main
    assert c["attn norm"].seconds == pytest.approx(d.norm_fixed_s + main / bandwidth(d, "norm"))
    fin = c["attn norm backward finalize"]
    assert fin.size_bytes == 108 * H * 8 + 2 * 2 * H and fin.seconds == ISSUE
    other = GPT22B.model_copy(update={"hidden": 6016, "q_heads": 47, "kv_heads": 47, "ffn": 4 * 6016})
    w = Workload(**{**MEGATRON, "tp": 1, "sp": False})
    c = ops_of(layer_cost(other, A100, w), "backward_input")
    assert c["attn norm"].size_bytes == 5 * 2 * T * 6016 and "attn norm backward finalize" not in c
    plain = ops_of(layer_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": False})), "backward_input")
    assert plain["attn norm"].size_bytes == 3 * 2 * ROWS * H and "attn norm backward finalize" not in plain


def test_main_grad_hooks_one_kernel_per_one_dimensional_parameter():
    """The 8 hooks of a GPT layer (2 norms x weight and bias, fused QKV bias, dense bias, fc1 and
    fc2 biases): main_grad.add_(grad) moves 4 + 2 + 4 = 10 B per local element; the largest, the
    fc1 bias (24,576 / 8 = 3,072 elements, 30,720 B), takes 18 ns at Triad: each runs at the
    4.7 us issue floor, 37.6 us per layer per micro-batch, in the weight-gradient pass."""
    c = layer_cost(GPT22B, A100, Workload(**MEGATRON))
    hooks = [o for o in c.ops if o.name.endswith("main_grad add")]
    assert len(hooks) == 8 and all(o.phase == "backward_weight" for o in hooks)
    size = {o.name.split(" ")[0]: o.size_bytes for o in hooks}
    assert size["wq_bias"] == 10 * 3 * H // 8 and size["w_up_bias"] == 10 * 24576 // 8
    assert size["attn_norm"] == size["wo_bias"] == size["w_down_bias"] == 10 * H
    assert sum(o.seconds for o in hooks) == pytest.approx(8 * ISSUE)
    assert not [o for o in layer_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": False})).ops
                if o.name.endswith("main_grad add")]


def test_cross_entropy_on_fp32_logits_pass_by_pass():
    """Local logits 8,192 x 51,200 / 8 = 52,428,800. Megatron (vocab_parallel_cross_entropy on
    output.float()): forward 38 B each (upcast 2 + 4, max 4, sub_ 8, exp 8, sum 4, div_ 8),
    1.99 GB, 1.17 ms; backward 14 B (mul_ 8, upcast backward 4 + 2), 0.43 ms. A fused kernel:
    6 B each way."""
    logits = T * 51200 // 8
    assert logits == 52_428_800
    c = head_cost(GPT22B, A100, Workload(**MEGATRON))
    f, b = ops_of(c, "forward")["cross entropy"], ops_of(c, "backward_input")["cross entropy"]
    assert (f.size_bytes, b.size_bytes) == (38 * logits, 14 * logits)
    assert f.seconds == pytest.approx(38 * logits / TRIAD) and b.seconds == pytest.approx(14 * logits / TRIAD)
    plain = head_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": False}))
    assert ops_of(plain, "forward")["cross entropy"].size_bytes == 6 * logits


def test_embedding_gradient_and_megatron_embedding_by_hand():
    """torch's dense embedding gradient, one per table (embedding_dense_backward): zero-filled
    tables of 51,200 / 8 = 6,400 word rows and 2,048 learned-position rows (2 B x 8,448 x 6,144 =
    103,809,024 B) plus the scatter of the 8,192 token rows into each (read + write, 2 x
    201,326,592 B); the learned positions are looked up too (read + write, 201,326,592 B).
    Megatron adds its main-gradient hook over both tables (10 B per element: 519,045,120 B,
    0.305 ms), the rows other tp ranks own zeroed (7/8 of 2 B x 8,192 x 6,144 = 88,080,384 B) and
    in backward that zeroing's gradient (index_put_'s derivative: the gradient cloned, 201,326,592
    B, its 7/8 masked rows zeroed), the [b s h] -> [s b h] copy (201,326,592 B), the gradient made
    contiguous for each of the 2 lookups (micro-batch 4: the transposed [b s h] view is not
    contiguous; 2 x 201,326,592 B), and the embedding dropout on the rank's 1,024 rows (2 + 2 + 1
    B: 31,457,280 B each way). The SP split slices a contiguous tensor along its first dimension:
    no copy. With micro-batch 1 the [1 s h] views are contiguous: neither the forward transpose
    nor the gradient copies (transformer.py ParallelTransformer.forward: "'.contiguous()' is a
    pass-through")."""
    table = (6400 + 2048) * H
    for mega in (True, False):
        c = ops_of(embedding_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": mega})))
        assert c["embedding grad"].size_bytes == 2 * table + 2 * (2 * 2 * T * H) == 506_462_208
        assert c["position lookup"].size_bytes == 2 * 2 * T * H == 201_326_592
    c = embedding_cost(GPT22B, A100, Workload(**MEGATRON))
    got = {(o.name, o.phase): o.size_bytes for o in c.ops}
    assert got[("embedding main_grad add", "backward_weight")] == 10 * table == 519_045_120
    assert got[("masked rows zeroed", "forward")] == 2 * T * H * 7 // 8 == 88_080_384
    assert got[("masked rows zeroed", "backward_weight")] == 2 * 2 * T * H + 88_080_384 == 289_406_976
    assert got[("gradient contiguous copy", "backward_weight")] == 2 * (2 * 2 * T * H) == 402_653_184
    assert got[("transpose copy", "forward")] == 2 * 2 * T * H
    assert not any(name == "sequence split copy" for name, _ in got)
    assert got[("embedding dropout", "forward")] == got[("embedding dropout", "backward_input")] == 5 * ROWS * H
    assert c.seconds("backward_weight") == pytest.approx(
        (506_462_208 + 519_045_120 + 289_406_976 + 402_653_184) / TRIAD)
    one = ops_of(embedding_cost(GPT22B, A100, Workload(**{**MEGATRON, "micro_batch": 1})))
    assert "gradient contiguous copy" not in one and "transpose copy" not in one   # [1 s h] views


def test_causal_softmax_reads_the_lower_triangle():
    """scaled_upper_triang_masked_softmax: row i of 2,048 reads i + 1 scores and writes all 2,048.
    32 x 2048^2 = 134,217,728 scores per rank; the triangle holds 32 x 2048 x 2049 / 2 =
    67,141,632 of them. Forward: 2 B x 67,141,632 read + 2 B x 134,217,728 written = 402,718,720 B
    (536,870,912 when every score is read); backward reads the gradient and the probabilities on
    the triangle and writes every gradient: 2 x 2 B x 67,141,632 + 2 B x 134,217,728 =
    537,001,984 B (805,306,368)."""
    tri, scores = 32 * 2048 * 2049 // 2, 32 * 2048 ** 2
    assert tri == 67_141_632
    for mega, (f, b) in ((True, (2 * tri + 2 * scores, 4 * tri + 2 * scores)), (False, (4 * scores, 6 * scores))):
        c = ops_of(layer_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": mega})))
        assert c["softmax"].size_bytes == pytest.approx(f, rel=1e-12)
        assert c["softmax backward"].size_bytes == pytest.approx(b, rel=1e-12)
    assert 2 * tri + 2 * scores == 402_718_720 and 4 * tri + 2 * scores == 537_001_984


def test_get_batch_and_timers_in_every_chunk_on_every_stage():
    """Megatron-LM 2755bcb pretrain_gpt.forward_step calls get_batch for every chunk's forward on
    every stage (data iterators on every tp rank 0, broadcast_data over tp), rebuilding the causal
    mask: fp32 ones(1, s, s) 4 s^2 B, tril 8 s^2, < 0.5 5 s^2; at s 2048: 16,777,216 + 33,554,432 +
    20,971,520 B at Triad (9.87 + 19.74 + 12.34 us); 4 small kernels and 4 timer syncs at the issue
    floor, and broadcast_data's sizes copied to the GPU and back (torch.cuda.LongTensor(sizes),
    sizes_cuda.cpu(): 2 floors): 88.9 us per chunk forward without the batch's transfers
    (test_get_batch_transfers_on_the_plan's links), 2 syncs (9.4 us) per backward.
    D4's 175B (pp 8 x vpp 3, micro-batch 1): the same on each of the 24 chunks; torch: none."""
    s = 2048
    c = ops_of(megatron_batch_cost(A100, Workload(**MEGATRON)))
    assert [c[n].size_bytes for n in ("mask ones", "mask tril", "mask < 0.5")] == [4 * s * s, 8 * s * s, 5 * s * s]
    want = (17 * s * s) / TRIAD + 10 * ISSUE
    assert megatron_batch_cost(A100, Workload(**MEGATRON)).seconds("forward") == pytest.approx(want, rel=1e-12)
    assert megatron_batch_cost(A100, Workload(**MEGATRON)).seconds("backward_input") == pytest.approx(2 * ISSUE)
    one = megatron_batch_cost(A100, Workload(**{**MEGATRON, "micro_batch": 1}))   # [1, s] slices: contiguous
    assert one.seconds("forward") == pytest.approx(want - 2 * ISSUE, rel=1e-12)
    for framework, has in (("megatron", True), ("torch", False)):
        plan = plan_of(True, framework)
        chunks = [ch for stage in chunk_costs(plan, workload_of(plan)) for ch in stage]
        assert len(chunks) == 24 and all((ch.batch is not None) == has for ch in chunks)


def test_get_batch_transfers_on_the_plan():
    """Megatron-LM 2755bcb get_batch -> mpu/data.py broadcast_data on D4's 175B plan (tp 8 on
    one DGX A100's NVLink, micro-batch 1, seq 2048), every chunk's forward: tp rank 0 copies the
    2,049 int64 tokens to the GPU, 16,392 B over PCIe 4.0 x16 (31.5 GB/s, 5.7 us: 6.220 us), then
    two broadcasts over the 8 ranks on the a100-nvlink3-ring curve (all-reduce, 8 ranks, busbw
    factor f 1.75, line 300 GB/s = the path's): below its first row (32 KiB, 1.31 GB/s: t =
    1.75 x 32768 / 1.31e9 = 43.773 us) the curve's time runs from NCCL's 14-step latency (LL:
    6.6 + 14 x 0.6 = 15.0 us) at 0 to it; a broadcast sends its S bytes in 7 steps (LL 6.6 + 7 x
    0.6 = 10.8 us) plus the curve's bandwidth term x S / (f S): 40 B (the 5 int64 sizes) 10.820
    us, 16,392 B 19.025 us. At tp 1 the rank is its own group: the copy alone."""
    plan = plan_of(True, "megatron")
    batch = ops_of(chunk_costs(plan, workload_of(plan))[0][0].batch)
    assert batch["get_batch copy to device"].size_bytes == 8 * 2049 == 16_392
    assert batch["get_batch copy to device"].seconds == pytest.approx(5.7e-6 + 16_392 / 31.5e9, rel=1e-12)
    t32k = 1.75 * 32768 / 1.31e9
    bcast = [10.8e-6 + (t32k - 15.0e-6) * n / 32768 / 1.75 for n in (40, 16_392)]
    assert [round(t * 1e6, 3) for t in bcast] == [10.82, 19.025]
    assert batch["get_batch broadcasts"].seconds == pytest.approx(sum(bcast), rel=1e-9)
    one = megatron_batch_cost(A100, Workload(**{**MEGATRON, "tp": 1}), plan.config.cluster.node.pcie, 0.0)
    assert [o.name for o in one.ops if "get_batch" in o.name] == ["get_batch copy to device"]


def test_torch_batch_copy_in_the_embedding():
    """torchtitan (train.py batch_generator at 42b0beb): the micro-batch's int64 inputs and
    labels each copied to the GPU with a blocking .to(device), then the host issues again: on the
    175B plan's DGX A100 (PCIe 4.0 x16, 31.5 GB/s, 5.7 us; micro-batch 1 x 2048) 2 x (5.7 +
    16,384 / 31.5e9 s = 0.520 us) + 4.7 us issue floor = 17.140 us, once per micro-batch in the
    first stage's embedding forward, whatever tp (no broadcast: every rank reads its own batch).
    Megatron-LM's embedding has none (its get_batch: test_get_batch_transfers_on_the_plan)."""
    for framework in ("torch", "megatron"):
        plan = plan_of(True, framework)
        emb = ops_of(chunk_costs(plan, workload_of(plan))[0][0].embed)
        assert ("batch to device" in emb) == (framework == "torch") and "micro-batch overhead" not in emb
    assert emb_copy(plan_of(True, "torch")) == pytest.approx(2 * (5.7e-6 + 8 * 2048 / 31.5e9) + 4.7e-6, rel=1e-12)
    assert round(emb_copy(plan_of(True, "torch")) * 1e6, 3) == 17.14


def emb_copy(plan) -> float:
    """Seconds of the torch batch copy in the first chunk's embedding forward."""
    return ops_of(chunk_costs(plan, workload_of(plan))[0][0].embed)["batch to device"].seconds


def test_comm_delay_kernel_after_each_async_collective_launch():
    """mpu/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward issues
    ``torch.empty(1) + 1`` after launching each asynchronous collective: with SP after the input's
    all-gather (before the dgrad GEMM) and after the input gradient's reduce-scatter (before the
    wgrad GEMM); without SP after the async all-reduce (before the wgrad GEMM). Two
    column-parallel linears per layer (query_key_value, dense_h_to_4h) and the output layer:
    8 B each, at the 4.7 us issue floor. The SP one before the dgrad runs in the column-parallel
    input-gradient segment of the timeline (after the re-gather is launched)."""
    from meshplan.schedule.layer_timeline import _ops_by_block
    from meshplan.schedule.layer_timeline import COLUMN_PARALLEL_DGRAD

    def delays(cost):
        return sorted((o.block, o.phase, o.seconds) for o in cost.ops if "delay" in o.name)

    sp = Workload(**MEGATRON)
    assert delays(layer_cost(GPT22B, A100, sp)) == [
        ("attn", "backward_input", ISSUE), ("attn", "backward_weight", ISSUE),
        ("mlp", "backward_input", ISSUE), ("mlp", "backward_weight", ISSUE)]
    assert delays(head_cost(GPT22B, A100, sp)) == [("head", "backward_input", ISSUE), ("head", "backward_weight", ISSUE)]
    no_sp = Workload(**{**MEGATRON, "sp": False})
    assert delays(layer_cost(GPT22B, A100, no_sp)) == [("attn", "backward_weight", ISSUE), ("mlp", "backward_weight", ISSUE)]
    assert delays(layer_cost(GPT22B, A100, Workload(**{**MEGATRON, "tp": 1, "sp": False}))) == []
    assert delays(layer_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": False}))) == []
    col = _ops_by_block(layer_cost(GPT22B, A100, sp), "backward_input", COLUMN_PARALLEL_DGRAD)
    dgrad = {o.block: o.seconds for o in layer_cost(GPT22B, A100, sp).ops
             if o.phase == "backward_input" and o.name.endswith(".dgrad") and o.name.split(".")[0] in ("wq", "wk", "wv", "w_up")}
    assert col["mlp"] == pytest.approx(dgrad["mlp"] + ISSUE, rel=1e-12)


def test_step_kernels_per_parameter_copies_sp_grad_copies_and_syncs():
    """Once per step beyond the optimizer's bulk passes (compute/megatron_cost.megatron_step_cost), 175B
    (h 12288) SP + selective, a middle pipeline stage (12 layers, no embedding or final norm):

    - bf16 master-to-model copy, one ``copy_`` per parameter (optimizer.py
      ``_multi_tensor_copy_this_to_that`` without an overflow buffer for bf16): 12 tensors per
      layer; the 8 small ones (4 norm weights/biases and the 2 row-parallel biases of 12,288, the
      QKV bias 3 x 12,288 / 8 = 4,608, the h-to-4h bias 4 x 12,288 / 8 = 6,144) take the 4.7 us
      floor instead of 6 B x n at Triad; the 4 weights (>= 18.9 M elements) are bandwidth-bound;
    - SP (optimizer.py ``allreduce_layernorm_grads``): the 6 sequence_parallel tensors per layer
      (norms and row-parallel biases), 72 x 12,288 = 884,736 fp32 elements, flattened by one cat
      (8 B each: 7.08 MB, 4.16 us at Triad, floored to 4.7 us) and copied back one kernel each (72
      floors);
    - 11 timers started and stopped (22 syncs) and the gradient norm's ``.item()``: 23 floors."""
    from meshplan.schedule.optimizer_step import optimizer_step_s
    from meshplan.schedule.step_end import _optimizer_s
    from meshplan.compute.kernel_time import optimizer_bandwidth
    from meshplan.compute.megatron_cost import megatron_stage_step_cost

    plan = plan_of(True)
    w = workload_of(plan)
    layers = plan.stage(1).layers
    assert len(layers) == 12
    small = [12288] * 6 + [4608, 6144]
    copies = 12 * sum(ISSUE - 6 * n / TRIAD for n in small)
    hand = copies + ISSUE + 72 * ISSUE + 23 * ISSUE
    assert 8 * 72 * 12288 / TRIAD < ISSUE
    c = megatron_stage_step_cost(GPT175B, A100, w, plan.config.training, layers, False, False, 8)
    assert c.seconds() == pytest.approx(hand, rel=1e-9)
    st = plan.state[1]
    bulk = optimizer_step_s(st.bytes_of("params"), st.bytes_of("grads"), st.bytes_of("master"),
                            st.bytes_of("optimizer"), plan.config.training, optimizer_bandwidth(A100))
    assert _optimizer_s(plan, 1) == pytest.approx(bulk + hand, rel=1e-12)
    # the last stage also averages its 64 micro-batches' losses (64 adds from 0, a division) and logs
    # the step's (a blocking H2D zero, an add): 67 floors; its layers are the same 12 kinds
    last = megatron_stage_step_cost(GPT175B, A100, w, plan.config.training, plan.stage(7).layers, False, True, 8, 64)
    assert [o.seconds for o in last.ops if o.name == "loss average and log"] == [pytest.approx(67 * ISSUE, rel=1e-12)]
    # torch: none of it
    assert megatron_stage_step_cost(GPT175B, A100, workload_of(plan_of(True, "torch")), plan.config.training,
                                    layers, False, False, 8).seconds() == 0.0


def test_optimizer_step_computed_once_per_distinct_stage():
    """step_time's memo of the Megatron-LM optimizer step (:func:`_optimizer_s` with ``memo``)
    keys a stage by its layers' MoE flags and whether it is the first or the last: DeepSeek-V3
    (3 dense layers, then MoE) at pp 16 under Megatron-LM, split [2, 4 x 14, 3]: stage 0 holds
    dense layers 0-1, stage 1 layers 2-5 (dense, then MoE), stages 2-14 four MoE layers each.
    Every stage's time equals the one computed alone, stage 1's differs from stage 2's (the key
    is more than first/last), and 4 distinct stages are computed for 16."""
    from dataclasses import replace as dc_replace

    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.step_end import _optimizer_s

    cfg = load_config(Path(__file__).resolve().parent.parent / "examples" / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    plan = build_plan(dc_replace(cfg, mesh=cfg.mesh.model_copy(update={"pp_layer_split": [2] + [4] * 14 + [3]}),
                                 training=cfg.training.model_copy(update={"framework": "megatron"})))
    assert plan.stages[1] == [[2, 3, 4, 5]]
    memo: dict = {}
    kept = [_optimizer_s(plan, s, memo) for s in range(16)]
    assert kept == [_optimizer_s(plan, s) for s in range(16)]
    assert kept[1] != kept[2] and len({kept[s] for s in range(2, 15)}) == 1
    assert sorted(k for k in memo if isinstance(k, tuple)) == [
        ((False, False), True, False), ((False, True, True, True), False, False), ((True, True, True), False, True),
        ((True, True, True, True), False, False)]


def test_embedding_dropout_backward_is_on_the_timeline():
    """Megatron-LM's embedding dropout (language_model.py Embedding.forward) has a backward on
    the rank's sequence shard under SP: 175B, micro-batch 1, tp 8: 256 rows of 12,288, read the
    gradient and the 1 B mask, write the gradient (2 + 1 + 2 B: 15,728,640 B, 9.25 us at Triad),
    in the first stage's first chunk's backward unit, before the gradient's all-gather over tp."""
    from meshplan.schedule.comm_times import nccl_sm_share
    from meshplan.schedule.backward_pass import backward_unit
    from meshplan.schedule.comm_times import CommTimes
    from meshplan.schedule.steptime import config_overlap

    plan = plan_of(True)
    w = workload_of(plan)
    chunk = chunk_costs(plan, w)[0][0]
    comm = CommTimes.from_rows(plan.stage(0).collectives, sm_share=nccl_sm_share(plan.config.cluster))
    unit = backward_unit("B", chunk, comm, w, config_overlap(plan.config.training))
    names = [e.name for e in unit.events]
    ev = [e for e in unit.events if e.name == "embedding dropout grad"]
    assert len(ev) == 1 and ev[0].end_s - ev[0].start_s == pytest.approx(5 * 256 * 12288 / TRIAD, rel=1e-12)
    assert names.index("embedding dropout grad") < names.index("embedding tp wait") < names.index("embedding grad")


def test_output_layer_backward_overlaps_its_collective_as_a_column_parallel_linear():
    """parallel_lm_logits runs the output layer through LinearWithGradAccumulationAndAsyncCommunication
    (mpu/layers.py), so under SP its backward gathers the input again during the input-gradient
    GEMM and runs the input gradient's reduce-scatter beside the weight-gradient GEMM; the final
    norm's backward waits for it. 175B SP, last stage: the table counts that extra all-gather
    once per micro-batch on the last stage (stage 7 vs the middle stage 1, same 12 layers), and the
    timeline issues it before the column B part and the reduce-scatter with the head's W."""
    from meshplan.schedule.comm_times import nccl_sm_share
    from meshplan.schedule.backward_pass import backward_unit
    from meshplan.schedule.comm_times import CommTimes
    from meshplan.schedule.steptime import config_overlap

    plan = plan_of(True)
    ag = {k: [r for r in rows(plan, k) if (r.axis, r.phase, r.op) == ("tp", "backward", "all-gather")][0]
          for k in (1, 7)}
    assert ag[7].per_microbatch == ag[1].per_microbatch + 1
    w = workload_of(plan)
    chunk = chunk_costs(plan, w)[7][-1]
    comm = CommTimes.from_rows(plan.stage(7).collectives, sm_share=nccl_sm_share(plan.config.cluster))
    unit = backward_unit("B", chunk, comm, w, config_overlap(plan.config.training))
    ev = {e.name: e for e in unit.events}
    names = [e.name for e in unit.events]
    head = [n for n in names if "head" in n or n == "final norm grad"]
    assert head == ["head B", "tp all-gather (head input again, for wgrad)", "head column B",
                    "tp reduce-scatter (head)", "head W", "head tp wait", "final norm grad"]
    assert ev["head W"].start_s == ev["tp reduce-scatter (head)"].start_s == ev["head column B"].end_s
    assert ev["tp all-gather (head input again, for wgrad)"].start_s == ev["head column B"].start_s
    out = {o.name: o.seconds for o in chunk.head.ops if o.phase == "backward_input"}
    assert ev["final norm grad"].end_s - ev["final norm grad"].start_s == pytest.approx(
        out["final norm"] + out["final norm backward finalize"] + 2 * ISSUE, rel=1e-12)
    # its backward (apex's persistent kernel and its partial sums' finalize) and its weight's and bias's main_grad adds


def rows(plan, stage):
    return plan.stage(stage).collectives


def test_loss_tiny_kernels_on_the_last_stage():
    """Megatron-LM 2022's loss per micro-batch beyond its logit-sized passes (compute/megatron.py
    LOSS_KERNELS, counted line by line in mpu/cross_entropy.py, gpt_model.py, pretrain_gpt.py
    loss_func, utils.py average_losses_across_data_parallel_group, schedules.py forward_step):
    22 kernels of a few elements per token in forward, 12 in backward (10 of the loss's graph and,
    read in the fid175 audit, schedules.py backward_step's optimizer.scale_loss multiply and its
    backward), each at the 4.7 us floor; none under torch."""
    c = head_cost(GPT22B, A100, Workload(**MEGATRON))
    tiny = {o.phase: o.seconds for o in c.ops if o.name == "loss tiny kernels"}
    assert tiny == {"forward": pytest.approx(22 * ISSUE, rel=1e-12), "backward_input": pytest.approx(12 * ISSUE, rel=1e-12)}
    plain = head_cost(GPT22B, A100, Workload(**{**MEGATRON, "megatron_ops": False}))
    assert not any(o.name == "loss tiny kernels" for o in plain.ops)
    one = head_cost(GPT22B, A100, Workload(**{**MEGATRON, "micro_batch": 1}))   # the 2 transposes: views
    assert sum(o.seconds for o in one.ops if o.name == "loss tiny kernels" and o.phase == "forward") == \
        pytest.approx(20 * ISSUE, rel=1e-12)
