"""Tensor parallelism past the KV heads (tp > kv_heads, handed case C6) as framework megatron
runs it: Megatron-LM's QKV sub-sharding, the one home of its predicate and sizes (the
collective table's rows, :func:`meshplan.comm.tp_rows.qkv_gather_rows`; the timeline's
blocking calls, :mod:`meshplan.schedule.layer_timeline`; the weights' local shard,
:func:`meshplan.mesh.tpsplit.local_numel`; the gathered activation,
:func:`meshplan.memory.activations`; the search's vectorised rows, :mod:`meshplan.search.comm_bounds`;
the GEMM table, step time and FLOPs of the QKV projection, :func:`meshplan.compute.shapes.qkv_local_features`
through :func:`fused_qkv_local_widths`; the QKV bias add, :func:`meshplan.compute.elementwise.bias_ops`).

Megatron-LM since f7dfb99 (#2565, "Support TP greater than num_kv_heads by supporting QKV
activation sub-sharding"), read at d98e8a6, ``megatron/core/transformer/attention.py``:

- :353-366: with ``num_query_groups < tp`` each rank keeps one query group
  (``num_query_groups_per_partition = 1``) and, in the end, ``q_heads / tp`` q heads;
- :1689-1704: ``linear_qkv`` stays a ColumnParallelLinear (``gather_output=False``) of output
  size ``query_projection_size + 2 kv_projection_size`` = ``(q + 2 kv) d``, laid out per group
  (``q1 q2 k1 v1 | q3 q4 k2 v2 | ...``, :1852-1853), and ``tensor_parallel/layers.py``:1038
  gives each rank ``output_size_per_partition = divide(output_size, world_size)`` rows (TE's
  ``TELayerNormColumnParallelLinear``, ``extensions/transformer_engine.py``:1518-1537, passes the
  whole ``out_features`` with ``parallel_mode="column"``, which TE splits over tp the same): one
  GEMM of N = ``(q + 2 kv) d / tp`` per rank (:func:`fused_qkv_local_rows`), computing 1/tp of
  the fused output; no K/V weight row is held, nor K/V column computed, on two ranks (the K/V
  activations are: after the gather every rank of a group keeps its group's, :1864-1871);
- :1851-1871 (``get_query_key_value_tensors``): that output is all-gathered over tp on its last
  dim (``all_gather_last_dim_from_tensor_parallel_region``, ``tensor_parallel/mappings.py``:
  forward all-gather, backward reduce-scatter), and each rank keeps its group's slice (``rank //
  (tp / kv)``), then its own q heads (``rank % (tp / kv)``, :1920-1929).

So per layer and micro-batch: one all-gather over tp of ``b x s/cp x (q + 2 kv) d`` values in the
compute dtype in forward (under SP too: the input was all-gathered over the sequence first), one
reduce-scatter of its gradient in backward (:func:`qkv_gather_numel`), both issued inside the
autograd function on the compute stream (blocking); no per-step gradient all-reduce, since every
weight row lives on one rank. Framework torch refuses tp past the KV heads (rule
``torch_kv_heads``); meshplan's own runtime keeps its replicated copies and their ``kv_replica``
gradient all-reduce (:mod:`meshplan.comm.tp_grads`) for its dry runs.
"""

from __future__ import annotations

import numpy as np

from meshplan.spec.model import ModelSpec

#: Cadence of the per-layer all-gather (forward) and reduce-scatter (backward) of the fused QKV
#: output under framework megatron at tp > kv_heads (:func:`qkv_gathered`).
QKV_GATHER_CADENCE = "every layer (Megatron QKV sub-sharding, tp > kv_heads: the fused QKV output)"


def qkv_gathered(framework, tp, kv_heads):
    """Whether Megatron-LM's QKV sub-sharding runs: framework megatron and tp > kv_heads
    (a bool, or an array of them when ``tp`` is an array: the search's columns).

    >>> qkv_gathered("megatron", 16, 8), qkv_gathered("megatron", 8, 8), qkv_gathered("torch", 16, 8)
    (True, False, False)
    >>> qkv_gathered("megatron", np.array([4, 8, 16]), 8).tolist()
    [False, False, True]
    """
    out = (framework == "megatron") & (np.asarray(tp) > kv_heads)
    return bool(out) if np.ndim(out) == 0 else out


def qkv_width(model: ModelSpec) -> int:
    """Features of the fused QKV output, ``(q_heads + 2 kv_heads) d_head`` (Megatron's
    ``query_projection_size + 2 kv_projection_size``, one head size for K and V).

    >>> qkv_width(ModelSpec(layers=80, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, vocab=128256))
    10240
    """
    return (model.q_heads + 2 * model.n_kv_heads) * model.d_head


def qkv_gather_numel(model: ModelSpec, micro_batch, seq_len: int, cp):
    """Values of one all-gather of the fused QKV output (its reduce-scatter in backward moves
    the same): the whole gathered tensor ``b x s/cp x (q + 2 kv) d`` (nccl-tests' all-gather
    size). Arrays broadcast (the search's micro-batch and cp columns).

    Small model (4 q / 2 KV heads of 16), b 1, s 64, cp 1: 64 x (4 + 4) x 16 = 8192 values:

    >>> qkv_gather_numel(ModelSpec(layers=4, hidden=64, ffn=256, q_heads=4, kv_heads=2, vocab=256), 1, 64, 1)
    8192
    """
    return micro_batch * (seq_len // cp) * qkv_width(model)


def fused_qkv_local_widths(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(Q, K) output features of the fused ``linear_qkv`` GEMM on one tp rank when its columns
    are split as a plain ColumnParallelLinear (tp > kv_heads, framework megatron): ``q d / tp``
    and ``kv d / tp`` (V's as K's). They are the shares of the fused GEMM's N on the mean
    rank: with the per-group layout (``q1 q2 k1 v1 | ...``) one rank's 1/tp slice may hold more
    Q and another the K and V, but each rank's N and FLOPs are these summed, and no K or V column
    is computed twice.

    32 q / 4 KV heads of 128, tp 8 (handed case C6): 32 x 128 / 8 = 512 and 4 x 128 / 8 = 64:

    >>> fused_qkv_local_widths(ModelSpec(layers=2, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1), 8)
    (512, 64)
    """
    return model.q_heads * model.d_head // tp, model.n_kv_heads * model.d_head // tp


def fused_qkv_local_rows(model: ModelSpec, tp: int) -> int:
    """Rows of the fused ``linear_qkv`` weight on one tp rank, the N of its GEMM: ``(q + 2 kv) d
    / tp`` (a ColumnParallelLinear at every tp, :func:`fused_qkv_local_widths` summed; the K and
    V share is ``2 kv d / tp``).

    Llama-3-70B at tp 16: (64 + 16) x 128 / 16 = 640 rows, of which 2 x 8 x 128 / 16 = 128 K/V:

    >>> fused_qkv_local_rows(ModelSpec(layers=80, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, vocab=1), 16)
    640
    """
    q, kv = fused_qkv_local_widths(model, tp)
    return q + 2 * kv


def qkv_note(model: ModelSpec, tp: int, q_local: int) -> str:
    """The ``heads`` rule's note for framework megatron at tp > kv_heads (handed case C6): the
    mechanism, that it is neither of C6's two options (reject, or replicate the KV heads tp / kv
    times), the model's KV heads (unchanged by tp: C6's "still has 8 KV heads in total (not 16)"),
    what one rank holds and the collectives it adds.

    >>> m = ModelSpec(layers=2, hidden=4096, ffn=16384, q_heads=32, kv_heads=4, head_dim=128, vocab=32000)
    >>> print(qkv_note(m, 8, 4))
    kv_heads 4 < tp 8: Megatron-LM's QKV sub-sharding (f7dfb99, attention.py:1851-1871 at d98e8a6), neither refusing tp 8 nor replicating each KV head 2x: no KV head is replicated (the model still has 4 KV heads in total, not 8); each rank holds 1/8 of the fused QKV weight ((32 + 2 x 4) x 128 / 8 = 640 rows), all-gathers the fused QKV output over tp in every layer (its gradient reduce-scattered in backward) and keeps its group's KV head (tp ranks {2i..2i+1} use KV head i) and its 4 q heads (collectives: tp all-gather / reduce-scatter, every layer)
    """
    kv, r = model.n_kv_heads, tp // model.n_kv_heads
    return (f"kv_heads {kv} < tp {tp}: Megatron-LM's QKV sub-sharding (f7dfb99, attention.py:1851-1871 at d98e8a6), "
            f"neither refusing tp {tp} nor replicating each KV head {r}x: no KV head is replicated (the model still has {kv} KV heads in total, not {tp}); each rank holds 1/{tp} of the fused QKV weight (({model.q_heads} + 2 x {kv}) x "
            f"{model.d_head} / {tp} = {fused_qkv_local_rows(model, tp)} rows), all-gathers the fused QKV output over tp "
            f"in every layer (its gradient reduce-scattered in backward) and keeps its group's KV head (tp ranks "
            f"{{{r}i..{r}i+{r - 1}}} use KV head i) and its {q_local} q heads (collectives: tp all-gather / "
            f"reduce-scatter, every layer)")
