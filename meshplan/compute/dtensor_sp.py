"""The layout copies torch's sequence parallelism adds around each TP collective when a rank's
micro-batch holds more than one sequence (``training.framework = "torch"``, tp > 1).

torchtitan shards the residual stream on the sequence dim of a ``[batch, seq, hidden]`` tensor
(``SequenceParallel``, ``PrepareModuleInput(input_layouts=Shard(1))``, ``RowwiseParallel(
output_layouts=Shard(1))``; ``models/llama3/parallelize_llama.py`` at 820504e, whose comment
points at the batch/sequence folding of torchtitan PR #437 to avoid this). NCCL gathers and
scatters along dim 0 only, so torch 2.13's functional collectives rearrange (read, not copied):

- ``all_gather_single`` (``torch/distributed/_functional_collectives.py``) with ``gather_dim``
  1: ``torch._utils._maybe_view_chunk_cat`` returns a view only when every dim the gathered
  block moves across has size 1 (batch 1); else ``torch.cat(torch.chunk(res, tp), dim=1)``, a
  copy of the gathered ``[batch, seq, hidden]`` tensor;
- ``reduce_scatter_single`` with ``scatter_dim`` 1: ``_chunk_or_narrow_cat(self, tp, 1, 0)``,
  a ``cat`` of the tp chunks along dim 0 before the collective, a copy of its input. With
  batch 1 that cat is the same bytes in the same order: eager torch still copies (seen in
  tests/test_op_sac_tp_torch.py), inductor may not (not checked); counted from batch 2 on, as
  the gather's (an under-count at batch 1 in eager runs).

Each copy reads and writes the whole tensor: ``2 x tokens x hidden x bytes`` HBM traffic (``bytes``
1 for a gather of float8 under torchao's float8 TP: :func:`meshplan.compute.float8.sp_gather_in_float8`), where
``tokens = micro_batch x seq_len / cp`` (the rank's full sequence after the gather). Per dense
layer and micro-batch, per block (attention, MLP): forward one gather (the block's input) and
one scatter (the row-parallel output); backward one gather (the output gradient, the scatter's
backward) and one scatter (the column-parallel input gradient, the gather's backward): 8 copies.

**Async TP** (``training.tp_comm_overlap``, :mod:`meshplan.compute.asynctp`): the fused
``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` take ``gather_dim`` /
``scatter_dim`` and move that dim to the front as a view (``torch/distributed/_symmetric_memory``:
"if A_shard.movedim(gather_dim, 0) is contiguous, no extra copy is required"; inductor's
``restride_A_shard_for_fused_all_gather_matmul`` gives the shard that order, at most a copy of
the shard, 1/tp of the tensor, not counted): their GEMMs read the gathered rows in that order and
the forward reduce-scatter copies nothing. But the gathered tensor the fused all-gather returns
(``return_A``) is ``unflatten(A_flat)`` = ``A_flat.view(tp, s / tp, b, h).flatten(0, 1).movedim(0,
gather_dim)``: a ``[b, s, h]`` view whose rows run sequence-major, the same in every stored
version of ``_fused_all_gather_matmul_impl`` (2024 to 2.13). Its other consumers are the weight
gradients, ``mm(dY^T, reshape(A, [b s, h]))``, and that reshape of a non-contiguous view is a copy
of the whole tensor: so each fused gather still costs one copy at batch > 1, the block input's
(gathered in forward, or in the replay under AC: once, counted in the input-gradient pass) and the
output gradient's. The backward's column-parallel input-gradient reduce-scatter is not fused
(asynctp) and keeps its copy: 3 copies per block instead of 4.

Not counted: the output layer's input gather and the embedding's output scatter (2 copies per
step, against 8 per layer), MoE blocks (their collectives are the experts'), Megatron-LM
(``[seq, batch, hidden]``: SP shards dim 0, no copy).
"""

from __future__ import annotations

from meshplan.compute.asynctp import te_fp8_gathers
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec

#: (phase, what) of the copies per dense block, and what torch's async TP runs instead.
COPIES = (("forward", "gather"), ("forward", "scatter"), ("backward_input", "gather"), ("backward_input", "scatter"))
ASYNC_COPIES = (("backward_input", "gathered input"), ("backward_input", "gather"), ("backward_input", "scatter"))
#: Under async TP with float8 rowwise Linears (gathers not fused): only the forward scatter goes.
ASYNC_SCATTER_ONLY = (("forward", "gather"), ("backward_input", "gather"), ("backward_input", "scatter"))


def applies(framework: str, sp: bool, tp: int, micro_batch: int) -> bool:
    """Whether the copies run: torch's TP with sequence parallelism, tp > 1, batch > 1.

    >>> applies("torch", True, 8, 12), applies("torch", True, 8, 1), applies("megatron", True, 8, 12)
    (True, False, False)
    """
    return framework == "torch" and sp and tp > 1 and micro_batch > 1


def copy_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """HBM bytes of one layout copy: read and write ``tokens x hidden`` elements.

    Llama 3 8B, 12 sequences of 8,192 tokens, bf16: 2 x 98,304 x 4,096 x 2 B = 1.61 GB:

    >>> copy_bytes(12 * 8192, 4096, 2)
    1610612736
    """
    return 2 * tokens * hidden * dtype_bytes


def copies(blocks: tuple[str, ...], async_tp: bool, gathers_fused: bool = True) -> list[tuple[str, str, str]]:
    """(name, block, phase) of the layout copies of one layer's dense ``blocks`` ("attn",
    "mlp"); with torch's async TP the copies of the returned gathered input and output gradient
    for the weight gradients and of the unfused backward scatter (module docstring); with it and
    gathers not fused (float8 rowwise, :mod:`meshplan.compute.asynctp`) all but the forward
    scatter's.

    >>> len(copies(("attn", "mlp"), False)), [c[0] for c in copies(("attn",), True)]
    (8, ['SP layout copy (gathered input, attn)', 'SP layout copy (gather, attn)', 'SP layout copy (scatter, attn)'])
    """
    return [(f"SP layout copy ({what}, {block})", block, phase)
            for block in blocks
            for phase, what in ((ASYNC_COPIES if gathers_fused else ASYNC_SCATTER_ONLY) if async_tp else COPIES)]


def float8_tp(model: ModelSpec, training: TrainingSpec, sp: bool = True) -> bool:
    """Whether the layers' tp all-gathers move float8 (1 byte a value): torchao's float8 TP
    styles (:attr:`~meshplan.spec.training.TrainingSpec.float8_tp_gathers`) under sequence
    parallelism (``sp``), in a dense model whose attention the float8 converter covers: every forward
    all-gather (the attention's and the MLP's input, cast before the gather), every backward
    all-gather (the output gradients of wo and w_down, cast before the reduce-scatter's
    mirror) and every replayed one. MoE and MLA models are planned in the compute dtype
    (their float8 TP plans are not modelled)."""
    return training.float8_tp_gathers and sp and not model.is_mla and not model.is_moe


def fp8_tp_gathers(model: ModelSpec, training: TrainingSpec, sp: bool = True) -> bool:
    """Whether the layers' tp all-gathers move 1 byte a value, under either runtime: torchao's
    float8 TP (:func:`float8_tp`, framework torch) or Transformer Engine's fp8 linears quantizing
    before their gathers (:func:`meshplan.compute.asynctp.te_fp8_gathers`, framework megatron). The
    one rule the collective table (:mod:`meshplan.comm.tp_rows`) and the search's step bound
    (:mod:`meshplan.search.comm_bounds`) read; the reduce-scatters stay in the compute dtype."""
    return float8_tp(model, training, sp) or te_fp8_gathers(model, training, sp)
