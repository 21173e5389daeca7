"""The ends of the model on one rank for one micro-batch (:mod:`meshplan.compute.ops`'
conventions): the input embedding on the first stage (:func:`embedding_cost`), and the final
norm, output GEMM and cross entropy on the last (:func:`head_cost`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from meshplan.compute import float8_head
from meshplan.compute.batch_input import torch_batch_copy
from meshplan.compute.elementwise import norm_finalize_ops, norm_spec
from meshplan.compute.gemm import GemmTable
from meshplan.compute.kernel_time import gemm_ops, memory_op
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.megatron import cross_entropy_bytes, embedding_bytes, loss_kernels
from meshplan.compute.megatron_cost import comm_delay_ops
from meshplan.compute.ops import Cost, Op, Workload
from meshplan.compute.shapes import Gemm
from meshplan.compute.torch_eager import cross_entropy_bytes as torch_cross_entropy_bytes
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.spec.cluster import GPUSpec, LinkSpec
from meshplan.spec.model import ModelSpec
from meshplan.units import dtype_bytes


def embedding_cost(model: ModelSpec, gpu: GPUSpec, w: Workload, host: Optional[LinkSpec] = None) -> Cost:
    """Input embedding on the first stage: lookup (read + write ``tokens x h``), with learned
    positions their own lookup (read + write) and the add, and in backward the dense weight
    gradient torch's ``embedding_dense_backward`` builds for each table: a zero-filled
    ``(table rows) x h`` tensor (``at::zeros``; the rank's ``V_padded / tp`` rows,
    ``max_position`` for learned positions) into which the token rows are scattered (read +
    write ``tokens x h`` per table).
    Memory-bound. With ``w.megatron_ops`` also Megatron-LM's passes around it
    (:func:`meshplan.compute.megatron.embedding_bytes`); without, on a GPU with catalog data and
    given the node's ``host`` link, torchtitan's blocking copy of the micro-batch to the GPU
    (:func:`meshplan.compute.batch_input.torch_batch_copy`; Megatron-LM's ``get_batch`` is
    :func:`meshplan.compute.megatron_cost.megatron_batch_cost`'s).

    >>> from meshplan import catalog
    >>> gpt, a100 = catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb")
    >>> c = embedding_cost(gpt, a100, Workload(seq_len=2048, micro_batch=4, tp=8))
    >>> grad = [o for o in c.ops if o.name == "embedding grad"][0]   # 2 B x (6400 + 2048) x 6144 + 2 scatters
    >>> grad.size_bytes == 2 * (6400 + 2048) * 6144 + 2 * (2 * 2 * 8192 * 6144)
    True
    """
    b, h, t = dtype_bytes(w.dtype), model.hidden, w.tokens
    rows = padded_vocab(model.vocab, w.vocab_pad_divisor, w.tp) // w.tp
    learned = model.position_embedding == "learned"
    pos, lookups = (model.max_position, 2) if learned else (0, 1)
    ops = [memory_op(gpu, "embedding lookup", "embed", "forward", 2 * b * t * h),
           memory_op(gpu, "embedding grad", "embed", "backward_weight", b * (rows + pos) * h + lookups * 2 * b * t * h)]
    if learned:
        ops += [memory_op(gpu, "position lookup", "embed", "forward", 2 * b * t * h),
                memory_op(gpu, "position add", "embed", "forward", 3 * b * t * h)]
    if w.megatron_ops:
        g = 4 if w.fp32_wgrad_accumulation else b
        ops += [memory_op(gpu, name, "embed", phase, nb)
                for name, phase, nb in embedding_bytes(b, g, t, h, w.tp, w.row_tokens, (rows + pos) * h, w.sp, w.dropout,
                                                       lookups, w.micro_batch > 1)]
    data = kernel_data(gpu)
    if data is not None and host is not None and not w.megatron_ops:  # Megatron's: megatron_batch_cost
        ops.append(torch_batch_copy(w, host, data.kernel_issue_s))
    return Cost(tuple(ops))


def head_cost(model: ModelSpec, gpu: GPUSpec, w: Workload, table: Optional[GemmTable] = None) -> Cost:
    """Final norm, output GEMM ``(tokens, V_padded / tp, h)`` and vocab-parallel cross
    entropy on the last stage; with ``w.megatron_ops`` the cross entropy, the final norm's
    backward and its main-gradient hooks as Megatron-LM's (:mod:`meshplan.compute.megatron`)."""
    b, h, r = dtype_bytes(w.dtype), model.hidden, w.row_tokens
    pv = padded_vocab(model.vocab, w.vocab_pad_divisor, w.tp)
    g = Gemm("output", w.tokens, pv // w.tp, h)
    logits = w.tokens * (pv // w.tp)
    wn = replace(w, decomposed_norm=w.decomposed_norm or w.decomposed_head_norm)  # never compiled (framework_kernels)
    ops = [memory_op(gpu, name, "head", phase, nb, kind="norm" if name.endswith("norm") else "elementwise")
           for name, _, f, bw in norm_spec(model, gpu, wn, "final norm", "head", r)
           for phase, nb in (("forward", f), ("backward_input", bw)) if nb > 0]
    ops += norm_finalize_ops(model, gpu, wn, (("final norm", "head"),))
    ops += gemm_ops(gpu, g, "head", w, table, model_scale=model.vocab / pv)
    ops += [memory_op(gpu, name, "head", ph, nb) for name, _, ph, nb in float8_head.head_kernels(w, g, b)]  # fp8_output_layer
    if w.megatron_ops:
        fwd_b, bwd_b = cross_entropy_bytes(b)
        ops += [memory_op(gpu, "cross entropy", "head", "forward", fwd_b * logits),
                memory_op(gpu, "cross entropy", "head", "backward_input", bwd_b * logits)]
    else:  # torch: fused when compiled, else kernel by kernel (compute.torch_eager)
        fwd, bwd = torch_cross_entropy_bytes(b, w.torch_eager or w.eager_loss)
        ops += [memory_op(gpu, name, "head", phase, nb * logits)
                for phase, kernels in (("forward", fwd), ("backward_input", bwd)) for name, nb in kernels]
    if w.megatron_ops:  # the final norm's weight (and bias) main-gradient hooks (main_grad_hooks)
        main = 4 if w.fp32_wgrad_accumulation else b
        ops += [memory_op(gpu, f"final norm {p} main_grad add", "head", "backward_weight", (2 * main + b) * h)
                for p in (("weight", "bias") if model.norm == "layernorm" else ("weight",))]
        ops += comm_delay_ops(gpu, w, ("head",))  # parallel_lm_logits: the same autograd function
        data = kernel_data(gpu)
        if data is not None:  # the loss's tiny kernels (compute.megatron.loss_kernels), one issue floor each
            ops += [Op("loss tiny kernels", "head", phase, "overhead", n * data.kernel_issue_s,
                       note=f"{n} kernels of a few elements per token, one issue floor each")
                    for phase, n in loss_kernels(w.micro_batch).items()]
    return Cost(tuple(ops))
