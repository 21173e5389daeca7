"""Megatron-LM 2022's own kernels around the GEMMs, as HBM bytes (the home of what
``Workload.megatron_ops`` adds; :mod:`meshplan.compute.megatron_cost` and the layer's ops time each pass as a
memory-bound kernel at Triad, never below the issue floor). Each was read in NVIDIA/Megatron-LM
at 2755bcb (June 2022, the code Korthikanti et al. 2022 measured):

- layer norm backward: for the hidden sizes of its persistent kernel
  (``megatron/model/fused_layer_norm.py`` ``persist_ln_hidden_sizes``: 6144 and 12288 among them)
  apex's ``FastLayerNormFN`` (``apex/contrib/csrc/layer_norm``: one kernel reads the output
  gradient and the input once and writes the input gradient and per-CTA partial weight and bias
  gradients, a second kernel sums the partials), 3 passes over ``rows x h``; for other sizes
  Megatron's own ``fused_kernels/layer_norm_cuda_kernel.cu`` (``cuComputePartGradGammaBeta``
  reads the output gradient and the input for the weight and bias gradients,
  ``cuComputeGradInput`` reads both again and writes the input gradient), 5 passes
  (:func:`norm_backward_passes`, :func:`norm_backward_partial_bytes`);
- the causal fused softmax (``fused_kernels/scaled_upper_triang_masked_softmax.h``) reads only the
  lower triangle of the scores and writes whole rows (:func:`softmax_bytes`);
- non-flash attention (``model/transformer.py`` ``CoreAttention``, ``ParallelAttention``): the
  context ``permute(2, 0, 1, 3).contiguous()`` copy (forward, and in its recompute), the
  ``baddbmm`` scale ``alpha = 1/norm_factor`` on dQ and dK in backward (torch's ``baddbmm``
  derivative multiplies each operand's gradient by alpha, a separate kernel), and the backward of
  ``split_tensor_along_last_dim`` (torch's split backward: ``cat`` of dQ, dK, dV into the fused QKV
  output gradient) (:func:`attention_copy_bytes`);
- the main-gradient hooks (``model/distributed.py`` ``_make_param_hook``:
  ``param.main_grad.add_(param.grad.data)`` for each parameter whose gradient is not fused into its
  GEMM: norm weights and biases, linear biases, the embeddings), one kernel each per micro-batch
  (:func:`hook_params`);
- vocab-parallel cross entropy (``model/gpt_model.py``: ``vocab_parallel_cross_entropy(output.float(),
  labels)``; ``mpu/cross_entropy.py``): the logits upcast to fp32, then max, ``sub_``, ``exp``, sum
  and ``div_`` as separate passes (:func:`cross_entropy_bytes`);
- the embedding (``mpu/layers.py`` ``VocabParallelEmbedding``, ``model/language_model.py``
  ``Embedding``): the rows other tp ranks own zeroed after the lookup (and its gradient), the
  ``[b s h] -> [s b h]`` transpose copy, the gradient made contiguous for each lookup's backward,
  the embedding dropout, and the tables' main-gradient hook (:func:`embedding_bytes`);
- every forward step of every chunk on every stage (``pretrain_gpt.py`` ``forward_step`` ->
  ``get_batch``; ``megatron/utils.py`` ``get_ltor_masks_and_position_ids``): the batch broadcast
  over tp, the labels' and tokens' slice copies, the causal mask built again from an fp32
  ``ones(1, s, s)``, ``tril`` and ``< 0.5``, the loss mask and position ids; and the timers
  (``megatron/global_vars.py`` ``_Timer.start``/``stop`` call ``torch.cuda.synchronize``) around
  ``forward-compute``, ``batch-generator`` and ``backward-compute`` (:func:`batch_bytes`).

- the backward of every column-parallel linear (``mpu/layers.py``
  ``LinearWithGradAccumulationAndAsyncCommunication.backward``: ``query_key_value``,
  ``dense_h_to_4h`` and the output layer through ``language_model.py`` ``parallel_lm_logits``)
  launches its input's all-gather (SP) or its input gradient's all-reduce (``async_grad_allreduce``,
  no SP) and the SP reduce-scatter asynchronously, each followed by ``_ = torch.empty(1,
  device=...) + 1`` ("Delay the start of ... computation shortly (3us) to have [the collective]
  scheduled first"): one tiny kernel each (:func:`comm_delay_kernels`).

Also Megatron's, timed elsewhere: the in-place division of the gradient buffer by the dp size
(:func:`meshplan.schedule.optimizer_step.optimizer_step_bytes`).
"""

from __future__ import annotations

from meshplan.compute.shapes import Attention
from meshplan.spec.model import ModelSpec

MEGATRON_OPS = ("layer norm backward", "causal softmax", "attention copies", "main-grad hooks", "cross entropy",
                "embedding", "batch and timers", "comm delay kernels", "loss kernels")

#: Op names of the delay kernels (:func:`comm_delay_kernels`) by pass: the one before the
#: column-parallel input-gradient GEMM (SP, after the input's all-gather is launched) and the one
#: before its weight-gradient GEMM (after the input gradient's reduce-scatter or all-reduce).
COMM_DELAY_OPS = {"backward_input": "dgrad delay (empty + 1)", "backward_weight": "wgrad delay (empty + 1)"}

#: ``torch.cuda.synchronize`` calls per micro-batch and chunk of Megatron-LM 2022's timers
#: (2755bcb ``megatron/schedules.py`` ``forward_step`` / ``backward_step``, ``pretrain_gpt.py``
#: ``forward_step``): forward-compute and batch-generator start and stop, backward-compute start
#: and stop.
TIMER_SYNCS = {"forward": 4, "backward_input": 2}

#: Host syncs and copies of ``mpu/data.py`` ``broadcast_data`` in every ``get_batch`` besides its
#: two broadcasts: ``torch.cuda.LongTensor(sizes)`` (a host-to-device copy) and
#: ``sizes_cuda.cpu()`` (a device-to-host copy that waits for the GPU).
BATCH_SYNCS = 2

#: Tiny kernels (one or a few elements per token, each at the issue floor) of Megatron-LM 2022's
#: loss on the last stage per micro-batch, by pass, read at 2755bcb. Forward: in
#: ``mpu/cross_entropy.py`` ``_VocabParallelCrossEntropy.forward`` the target mask (``<``,
#: ``>=``, ``|``), ``target.clone() - start`` (2), ``masked_target[target_mask] = 0``, ``arange``,
#: the target logits' gather and ``.clone()``, ``predicted_logits[target_mask] = 0.0``,
#: ``log`` and ``-`` (12); ``model/gpt_model.py`` the labels' and the loss's ``transpose(0, 1)
#: .contiguous()`` (2); ``pretrain_gpt.py`` ``loss_func`` ``losses * loss_mask``, ``sum``,
#: ``loss_mask.sum()``, ``/`` (4) and ``utils.py`` ``average_losses_across_data_parallel_group``
#: ``clone``, ``cat``, ``/`` (3); ``schedules.py`` ``forward_step`` ``loss / num_microbatches``
#: (1): 22. Backward: ``schedules.py`` ``backward_step``'s ``optimizer.scale_loss(output_tensor)``
#: (``optimizer.py``: ``self.get_loss_scale() * loss``, a one-element CUDA tensor, 1.0 without a
#: grad scaler) and its backward (2), ``custom_backward``'s ones gradient, the backward of
#: ``/ num_microbatches``, of ``/ loss_mask.sum()`` and of ``* loss_mask`` (4; the transposes,
#: views and ``sum``'s expand copy nothing), in ``_VocabParallelCrossEntropy.backward``
#: ``arange``, ``.float()``, ``1.0 - ...`` and ``grad_2d[arange, target] -= ...`` (gather,
#: subtract, put: 3) (6): 12. The logit-sized passes are :func:`cross_entropy_bytes`'.
LOSS_KERNELS = {"forward": 22, "backward_input": 12}


def loss_kernels(micro_batch: int) -> dict[str, int]:
    """:data:`LOSS_KERNELS` at ``micro_batch``: with one sequence the two ``transpose(0, 1)
    .contiguous()`` of ``gpt_model.py`` copy nothing (a ``[s, 1]`` / ``[1, s]`` transpose is already
    contiguous; ``model/transformer.py`` ``ParallelTransformer.forward`` says so of the embedding's).

    >>> loss_kernels(4), loss_kernels(1)
    ({'forward': 22, 'backward_input': 12}, {'forward': 20, 'backward_input': 12})
    """
    return dict(LOSS_KERNELS) if micro_batch > 1 else {**LOSS_KERNELS, "forward": LOSS_KERNELS["forward"] - 2}


def comm_delay_kernels(tp: int, sp: bool) -> dict[str, int]:
    """Delay kernels (``torch.empty(1) + 1``) per column-parallel linear's backward, by pass, in
    Megatron-LM 2022 (2755bcb ``megatron/mpu/layers.py``
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``): with SP one after the input's
    all-gather is launched (before the input-gradient GEMM) and one after the input gradient's
    reduce-scatter is launched (before the weight-gradient GEMM); without SP one after the input
    gradient's asynchronous all-reduce (``--async-tensor-model-parallel-allreduce``, on by
    default, off under SP: ``arguments.py``). None at tp 1 (no collective; ``arguments.py`` turns
    SP off and ``ColumnParallelLinear`` the async all-reduce).

    >>> comm_delay_kernels(8, True), comm_delay_kernels(8, False), comm_delay_kernels(1, False)
    ({'backward_input': 1, 'backward_weight': 1}, {'backward_weight': 1}, {})
    """
    if tp == 1:
        return {}
    return {"backward_input": 1, "backward_weight": 1} if sp else {"backward_weight": 1}


#: Hidden sizes of Megatron-LM 2022's persistent layer norm (2755bcb ``megatron/model/fused_layer_norm.py``
#: ``persist_ln_hidden_sizes``): ``MixedFusedLayerNorm`` runs apex's ``FastLayerNormFN`` for these
#: unless ``--no-persist-layer-norm`` (default off) or torch < 1.11 (``arguments.py``: "supported
#: from pytorch v1.11 (nvidia pytorch container paired with v1.11)"; NVIDIA's PyTorch containers
#: "come with all the custom extensions", apex README @3ff1a10, June 2022, fast_layer_norm among them).
PERSIST_LN_HIDDEN_SIZES = (1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 15360,
                           16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536)


def persistent_layer_norm(norm: str, hidden: int) -> bool:
    """Whether Megatron-LM 2022 normalises a ``norm`` ("layernorm" or "rmsnorm") of ``hidden``
    with apex's persistent ``FastLayerNormFN`` (:data:`PERSIST_LN_HIDDEN_SIZES`; Megatron 2022 has
    no RMSNorm: its own kernel is kept for one).

    >>> persistent_layer_norm("layernorm", 6144), persistent_layer_norm("layernorm", 6000)
    (True, False)
    """
    return norm == "layernorm" and hidden in PERSIST_LN_HIDDEN_SIZES


def norm_backward_passes(megatron: bool, persistent: bool = False) -> int:
    """Passes over ``rows x h`` of a norm's backward: 3 for one fused kernel (read the input and
    the output gradient, write the input gradient: torch's, and apex's persistent
    ``FastLayerNormFN`` that Megatron-LM runs for ``persistent`` sizes, :func:`persistent_layer_norm`;
    apex PR #1037: "the main backward kernel crucially reads the large input tensors dout and x only
    once"), 5 with Megatron-LM's own fused layer norm (its weight-gradient kernel reads both again).

    >>> norm_backward_passes(False), norm_backward_passes(True), norm_backward_passes(True, persistent=True)
    (3, 5, 3)
    """
    return 5 if megatron and not persistent else 3


def norm_backward_partial_bytes(hidden: int, sms: int) -> int:
    """Bytes of the partial weight and bias gradients of apex's persistent layer norm backward
    (``ln_bwd_kernel`` writes ``dgamma_part`` and ``dbeta_part``, fp32, one row of ``hidden`` per CTA
    column; ``ln_bwd_finalize_kernel`` reads them back and writes the two gradients): one CTA
    column per SM taken (``ctas_per_col = SMs x CTAs per SM / CTAs per row``: at 6144 bf16 the
    kernel holds 155 registers x 256 threads, one CTA per A100 SM, 108 columns; at 12288, 164 x 128
    threads, 3 per SM and 4 per row, 81: ptxas --resource-usage of apex @3ff1a10 for sm_80, CUDA
    13.0). The main kernel writes them, the finalize kernel reads them.

    >>> norm_backward_partial_bytes(6144, 108) == 108 * 6144 * 2 * 4
    True
    """
    return sms * hidden * 2 * 4


def softmax_bytes(att: Attention, b: int, megatron: bool = False) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the fused softmax over the ``n s_q s_kv`` scores of a
    non-flash attention (``b`` bytes per element). Reading and writing every score: ``2 b`` forward
    (scores in, probabilities out), ``3 b`` backward (gradient and probabilities in, gradient out).
    Megatron-LM's causal kernel (``s_q == s_kv``: row i reads its first i + 1 elements,
    ``element_index < local_seq``, and writes the whole row, zeros past the diagonal) reads only the
    lower triangle, a fraction ``f = (s + 1) / (2 s)`` of the scores: ``b (f + 1)`` forward,
    ``b (2 f + 1)`` backward.

    >>> a = Attention(batch=1, q_heads=1, kv_heads=1, seq_q=4, seq_kv=4, head_dim=8)
    >>> softmax_bytes(a, 2), softmax_bytes(a, 2, megatron=True)   # 16 scores, 10 on or below the diagonal
    ((64, 96), (52.0, 72.0))
    """
    scores = att.batch * att.q_heads * att.seq_q * att.seq_kv
    if not megatron or att.seq_q != att.seq_kv:
        return 2 * b * scores, 3 * b * scores
    f = (att.seq_kv + 1) / (2 * att.seq_kv)
    return b * (f + 1) * scores, b * (2 * f + 1) * scores


def attention_copy_bytes(att: Attention, b: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) ``(name, bytes)`` of the non-flash attention's copies: the context
    permute (read and write ``b np sq d_v``), alpha on dQ and dK (read and write each), the QKV
    split's backward (read dQ, dK, dV, write the fused gradient).

    >>> f, b = attention_copy_bytes(Attention(batch=1, q_heads=2, kv_heads=2, seq_q=4, seq_kv=4, head_dim=8), 2)
    >>> f, b   # 64 elements each of Q, K, V and the context
    ([('context permute copy', 256)], [('baddbmm alpha (dQ, dK)', 512), ('qkv split grad (cat)', 768)])
    """
    q = att.batch * att.q_heads * att.seq_q * att.head_dim
    k = att.batch * att.kv_heads * att.seq_kv * att.head_dim
    v = att.batch * att.kv_heads * att.seq_kv * att.d_v
    ctx = att.batch * att.q_heads * att.seq_q * att.d_v
    return ([("context permute copy", 2 * b * ctx)],
            [("baddbmm alpha (dQ, dK)", 2 * b * (q + k)), ("qkv split grad (cat)", 2 * b * (q + k + v))])


def cross_entropy_bytes(b: int) -> tuple[int, int]:
    """(forward, backward) HBM bytes per local logit of Megatron-LM 2022's vocab-parallel cross
    entropy (``b``: bytes of a logit): the logits upcast (read b, write 4), max (read 4),
    ``sub_`` (4 + 4), ``exp`` (4 + 4), sum (4), ``div_`` (4 + 4): b + 36 forward; backward
    ``mul_`` by the loss gradient (4 + 4) and the upcast's backward (read 4, write b): 12 + b.
    (torch's: :func:`meshplan.compute.torch_eager.cross_entropy_bytes`.)

    >>> cross_entropy_bytes(2)
    (38, 14)
    """
    return b + 36, 12 + b


#: Block whose weight-gradient pass issues a hooked parameter's add (:func:`hook_params`;
#: anything not listed: "mlp").
HOOK_BLOCK = {"attn_norm": "attn", "attn_norm_bias": "attn", "wq_bias": "attn", "wo_bias": "attn",
              "q_norm": "attn", "k_norm": "attn"}


def hook_params(model: ModelSpec, tp: int, fused_qkv: bool, layer: int) -> list[tuple[str, str, int]]:
    """``(name, block, local elements)`` of the parameters of transformer layer ``layer`` whose
    gradients Megatron-LM adds to the main gradient in a hook: the 1-D ones (``numel == rows`` in
    :meth:`~meshplan.spec.model.ModelSpec.layer_tensors`: norm weights and biases, linear biases),
    the fused QKV bias once (``fused_qkv``). Column-split ones hold ``1/tp`` of their elements.

    >>> from meshplan import catalog
    >>> [(n, e) for n, _, e in hook_params(catalog.model("megatron-22b"), 8, True, 0)]  # doctest: +NORMALIZE_WHITESPACE
    [('attn_norm', 6144), ('attn_norm_bias', 6144), ('wq_bias', 2304), ('wo_bias', 6144),
     ('mlp_norm', 6144), ('mlp_norm_bias', 6144), ('w_up_bias', 3072), ('w_down_bias', 6144)]
    """
    tensors = model.layer_tensors(layer)
    out = []
    for t in tensors:
        if t.numel != t.rows or (fused_qkv and t.name in ("wk_bias", "wv_bias")):
            continue
        n = t.numel // tp if t.split in ("column", "kv_column") else t.numel
        if fused_qkv and t.name == "wq_bias":
            n = sum(x.numel for x in tensors if x.name in ("wq_bias", "wk_bias", "wv_bias")) // tp
        out.append((t.name, HOOK_BLOCK.get(t.name, "mlp"), n))
    return out


def embedding_bytes(b: int, g: int, tokens: int, h: int, tp: int, shard_rows: int, table: int, sp: bool,
                    dropout: bool, lookups: int = 1, transposed: bool = False) -> list[tuple[str, str, int]]:
    """``(name, phase, bytes)`` of Megatron-LM's embedding around the lookup for one micro-batch:
    ``tokens`` rows of ``h`` in ``b`` bytes, ``shard_rows`` the rank's rows after the SP split,
    ``table`` the local table elements (word rows ``V_padded / tp`` and learned position rows, x h),
    ``g`` bytes of a main-gradient element, ``lookups`` the embedding tables looked up (word, and
    learned positions), ``transposed``: the gradient reaching the lookups is a non-contiguous
    view (micro-batch > 1). Forward: the rows other ranks own zeroed (``output_parallel[input_mask,
    :] = 0.0``: ``(tp - 1) / tp`` of the output, written), the ``[b s h] -> [s b h]`` transpose copy
    (read + write; with micro-batch 1 ``.contiguous()`` passes the view through, as
    ``model/transformer.py`` ``ParallelTransformer.forward`` notes), with dropout its pass both ways (``2 b + 1``: in, out, mask); with SP the split
    (``mpu/mappings.py`` ``_split_along_first_dim``) slices the sequence dimension of a contiguous
    tensor, so its ``.contiguous()`` copies nothing. Backward: the zeroing's gradient (torch's
    ``index_put_`` derivative: the gradient cloned, read + write, and its masked rows zeroed), the
    gradient made contiguous once per lookup when it is a transposed view (torch
    ``embedding_dense_backward_cuda``: ``grad_.contiguous()``; with micro-batch 1 the ``[1, s, h]``
    view is contiguous), and the tables' main-gradient hook (``(2 g + b)`` per element).

    >>> [(n, p, x) for n, p, x in embedding_bytes(2, 4, 8, 4, 2, 4, 100, True, True, 2, True)]  # doctest: +NORMALIZE_WHITESPACE
    [('masked rows zeroed', 'forward', 32), ('masked rows zeroed', 'backward_weight', 160),
     ('embedding main_grad add', 'backward_weight', 1000), ('transpose copy', 'forward', 128),
     ('gradient contiguous copy', 'backward_weight', 256),
     ('embedding dropout', 'forward', 80), ('embedding dropout', 'backward_input', 80)]
    """
    rows = b * tokens * h
    out = [("masked rows zeroed", "forward", (rows * (tp - 1)) // tp),
           ("masked rows zeroed", "backward_weight", 2 * rows + (rows * (tp - 1)) // tp)] if tp > 1 else []
    out.append(("embedding main_grad add", "backward_weight", (2 * g + b) * table))
    if transposed:
        out += [("transpose copy", "forward", 2 * rows), ("gradient contiguous copy", "backward_weight", 2 * rows * lookups)]
    if dropout:
        out += [("embedding dropout", phase, (2 * b + 1) * shard_rows * h) for phase in ("forward", "backward_input")]
    return out


def batch_bytes(micro_batch: int, seq_len: int) -> list[tuple[str, int]]:
    """``(kernel, HBM bytes)`` of Megatron-LM 2022's ``get_batch`` after the broadcast, run in
    every chunk's forward step on every stage (module docstring; ``reset_position_ids``,
    ``reset_attention_mask`` and ``eod_mask_loss`` off, their defaults): the labels' and tokens'
    ``[:, 1:]`` / ``[:, :-1]`` ``contiguous`` copies (int64, read + write ``b s`` each), the mask
    ``torch.ones((1, s, s))`` (fp32, written), ``torch.tril`` of it (read + write), ``< 0.5``
    (fp32 read, bool written), the loss mask ``ones(b, s)`` (fp32) and the position ids
    ``arange(s)`` (int64).

    With one sequence the slices ``[1, s]`` of ``[1, s + 1]`` are already contiguous (a size-1
    dimension's stride does not count): no copies.

    >>> [(n, x) for n, x in batch_bytes(2, 4)]  # doctest: +NORMALIZE_WHITESPACE
    [('labels copy', 128), ('tokens copy', 128), ('mask ones', 64), ('mask tril', 128),
     ('mask < 0.5', 80), ('loss mask ones', 32), ('position ids', 32)]
    >>> [n for n, _ in batch_bytes(1, 4)]
    ['mask ones', 'mask tril', 'mask < 0.5', 'loss mask ones', 'position ids']
    """
    b, s = micro_batch, seq_len
    copies = [("labels copy", 2 * 8 * b * s), ("tokens copy", 2 * 8 * b * s)] if b > 1 else []
    return copies + [("mask ones", 4 * s * s),
            ("mask tril", 2 * 4 * s * s), ("mask < 0.5", (4 + 1) * s * s), ("loss mask ones", 4 * b * s),
            ("position ids", 8 * s)]


#: Timers Megatron-LM 2022 starts and stops once per step outside the micro-batches, each start
#: and stop a ``torch.cuda.synchronize`` (2755bcb ``megatron/training.py`` ``train_step``;
#: ``optimizer/optimizer.py`` ``reduce_model_grads`` and ``MixedPrecisionOptimizer.step``, no grad
#: scaler: bf16 without ``--loss-scale``; fp16 adds ``optimizer-unscale-and-check-inf``).
STEP_TIMERS = ("backward-reduce-model-grads", "backward-layernorm-all-reduce", "backward-params-all-reduce",
               "backward-embedding-all-reduce", "optimizer", "optimizer-copy-to-main-grad",
               "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
               "optimizer-copy-main-to-model-params", "backward-gather-model-params")


def stage_param_tensors(model: ModelSpec, tp: int, vocab_rows: int, layers: list[int], first: bool, last: bool,
                        pp: int) -> list[tuple[str, int, bool]]:
    """``(name, local elements, sequence_parallel)`` of every parameter tensor of one pipeline
    stage's rank as Megatron-LM 2022's GPT holds them (one tensor per ``torch.nn.Parameter``):
    per layer the layer's tensors (:meth:`~meshplan.spec.model.ModelSpec.layer_tensors`) with Q, K
    and V as one ``query_key_value`` weight and one bias (``model/transformer.py``), column- and
    row-split ones holding ``1/tp``; on the first stage the word embedding (``vocab_rows`` local
    rows x h) and the learned position embedding; on the last the final norm and, with pp > 1,
    the output layer's own copy of the word embedding (``module.py``
    ``initialize_word_embeddings``). ``sequence_parallel``: the attribute ``fused_layer_norm.py``
    sets on norm weights and biases and ``mpu/layers.py`` ``RowParallelLinear`` on its bias (the
    tensors every tp rank holds whole, ``replicated``), whose gradients
    ``optimizer.py`` ``allreduce_layernorm_grads`` all-reduces over tp under SP. (Megatron-LM
    2022 has no grouped-query attention: K and V split by tp as Q.)

    >>> from meshplan import catalog
    >>> t = stage_param_tensors(catalog.model("megatron-22b"), 8, 6400, [0], True, True, 1)
    >>> [(n, e, s) for n, e, s in t]  # doctest: +NORMALIZE_WHITESPACE
    [('attn_norm', 6144, True), ('attn_norm_bias', 6144, True), ('query_key_value', 14155776, False),
     ('query_key_value_bias', 2304, False), ('wo', 4718592, False), ('wo_bias', 6144, True),
     ('mlp_norm', 6144, True), ('mlp_norm_bias', 6144, True), ('w_up', 18874368, False),
     ('w_up_bias', 3072, False), ('w_down', 18874368, False), ('w_down_bias', 6144, True),
     ('word_embedding', 39321600, False), ('position_embedding', 12582912, False),
     ('final_norm', 6144, True), ('final_norm_bias', 6144, True)]
    """
    out: list[tuple[str, int, bool]] = []
    for i in layers:
        qkv = {"weight": 0, "bias": 0}
        for t in model.layer_tensors(i):
            n = t.numel if t.split == "replicated" else t.numel // tp
            if t.name in ("wq", "wk", "wv", "wq_bias", "wk_bias", "wv_bias"):
                part = "bias" if t.name.endswith("_bias") else "weight"
                qkv[part] += n
                if t.name in ("wv", "wv_bias"):
                    out.append(("query_key_value" + ("_bias" if part == "bias" else ""), qkv[part], False))
                continue
            out.append((t.name, n, t.split == "replicated"))
    if first:
        out.append(("word_embedding", vocab_rows * model.hidden, False))
        if model.position_embedding == "learned":
            out.append(("position_embedding", model.max_position * model.hidden, False))
    if last:
        out.append(("final_norm", model.hidden, True))
        if model.norm == "layernorm":
            out.append(("final_norm_bias", model.hidden, True))
        if pp > 1:
            out.append(("output_word_embedding", vocab_rows * model.hidden, False))
    return out
