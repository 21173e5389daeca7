"""Checkpoint bytes of a mesh: what the most loaded rank holds, every distinct shard once in
total, what the busiest rank writes under DCP (:func:`dcp_write_bytes`) or DeepSpeed
(:func:`deepspeed_write_bytes`), and the seconds to write or read it at a stated storage
bandwidth (:func:`write_time_s`). The interval, goodput and restart cost that follow from them:
:mod:`meshplan.reliability`.

Persistent state without gradients: parameters, fp32 master copy and
optimizer moments (:mod:`meshplan.memory.state`), plus data-loader and RNG state (small,
not counted). Per rank: the most loaded rank. In total: every distinct shard once (a
replicated copy is written by one rank, as DCP deduplicates): ``tp x shards`` pieces of
the dense state of each stage, ``ep x etp x shards`` of the expert state (norms, held
whole by every tp rank, are counted tp times: small). KV heads replicated past
``kv_heads`` (tp > kv_heads, handed case C6) are one head's state per rank but are counted
once per KV head, ``kv_heads`` per stage, not ``tp`` (a checkpoint in the model's layout,
as Megatron-LM and HF save it, holds each head once; the copies are equal, kept so by the
``kv_replica`` all-reduce). Write time at a stated storage
bandwidth: ``max(total / aggregate bandwidth, per rank / per-rank bandwidth)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshplan.mesh.tpsplit import local_heads, local_numel
from meshplan.spec.axes.tp_kv import qkv_gathered

#: The state kinds a checkpoint holds (module docstring).
CHECKPOINT_KINDS = ("params", "master", "optimizer")


@dataclass(frozen=True)
class CheckpointSize:
    """``per_rank_bytes``: what the most loaded rank holds (and reads back on load);
    ``total_bytes``: distinct shards once; ``written_per_rank_bytes``: what the busiest rank
    writes (0: unknown, ``per_rank_bytes`` is used) under ``writer``: "dcp" (:func:`dcp_write_bytes`) or
    "deepspeed" (:func:`deepspeed_write_bytes`)."""

    per_rank_bytes: float
    total_bytes: float
    written_per_rank_bytes: float = 0.0
    writer: str = "dcp"


def checkpoint_size(states, mesh, model=None, framework: str = "torch") -> CheckpointSize:
    """Checkpoint bytes from :func:`meshplan.memory.state.state_bytes` (one StateBytes per
    stage) of ``mesh``: kinds params, master and optimizer (module docstring). ``model``
    (the :class:`~meshplan.spec.model.ModelSpec`): count replicated KV heads once
    (:func:`kv_copy_numel`), as meshplan's runtime saves them
    (:func:`meshplan.runtime.execution.kvsync.dedup_kv_state`); without it every tp rank's
    copy counts; ``framework`` megatron holds no copies (:mod:`meshplan.spec.axes.tp_kv`)."""
    tp, ep, etp = mesh.degree("tp"), mesh.degree("ep"), mesh.degree("etp")
    model = None if model is not None and qkv_gathered(framework, tp, model.n_kv_heads) else model
    per_rank = 0.0
    for st in states:
        per_rank = max(per_rank, sum(i.size_bytes for i in st.items if i.kind in CHECKPOINT_KINDS))
    totals = _stage_totals(states, mesh, model)
    ranks = mesh.world / mesh.degree("pp")
    return CheckpointSize(per_rank, sum(totals), max(t / ranks for t in totals))


def kv_copy_numel(st, model, mesh) -> int:
    """Elements of stage ``st``'s dense state (per kind, before data-parallel sharding) that
    the tp ranks of one group hold as copies of replicated KV heads: with ``r = tp / kv_heads
    > 1`` each rank holds one KV head's wk, wv (and biases), ``k`` elements per layer, so the
    group holds ``tp k`` of which ``kv_heads k`` are distinct: ``(tp - kv_heads) k`` per layer.

    128 q / 8 KV heads of 128, h 16384, tp 16 (C6): k = 2 x 128 x 16384 = 4,194,304; 8 copies
    of it per layer:

    >>> from types import SimpleNamespace as N
    >>> from meshplan.spec.model import ModelSpec
    >>> m = ModelSpec(layers=1, hidden=16384, ffn=1, q_heads=128, kv_heads=8, head_dim=128, vocab=1)
    >>> kv_copy_numel(N(params=N(layer_ids=(0,))), m, N(degree=lambda a: 16))
    33554432
    """
    tp = mesh.degree("tp")
    if local_heads(model, tp)[2] == 1:
        return 0
    per_layer = sum(local_numel(t, model, tp) for t in model.layer_tensors(0) if t.split == "kv_column")
    return (tp - model.n_kv_heads) * per_layer * len(st.params.layer_ids)


def _stage_totals(states, mesh, model=None) -> list[float]:
    """Checkpoint bytes of each stage, every distinct shard once (:func:`_distinct`), less
    the replicated KV heads' copies when ``model`` is given (:func:`kv_copy_numel`)."""
    tp, ep, etp = mesh.degree("tp"), mesh.degree("ep"), mesh.degree("etp")
    out = []
    for st in states:
        items = [i for i in st.items if i.kind in CHECKPOINT_KINDS]
        copies = kv_copy_numel(st, model, mesh) if model is not None else 0
        out.append(sum(i.size_bytes * _distinct(i, tp, ep, etp) for i in items)
                   - sum(copies * i.bytes_per_element for i in items if copies and i.group == "dense"))
    return out


def _distinct(item, tp: int, ep: int, etp: int) -> int:
    """Distinct shards of one state item on a stage: its model split (tp, or ep x etp for
    experts) times its data-parallel shard degree."""
    return (ep * etp if item.group == "expert" else tp) * item.divisor


def dcp_write_bytes(states, mesh, model=None) -> list[float]:
    """Bytes one rank of each stage writes under DCP (torch.distributed.checkpoint): the
    default save planner deduplicates replicated shards (``dedup_save_plans``), writing each
    once, from the replica whose plan is smallest so far, so the ``r`` ranks holding the same
    shard split its bytes. A stage's ``world / pp`` ranks hold ``split x divisor`` distinct
    shards of an item (:func:`_distinct`), each held by ``r = (world / pp) / (split x divisor)``
    ranks (dp_replicate under HSDP, dp under DDP, 1 under FSDP): a rank writes
    ``sum(size / r)``, the balanced share (greedy: within one tensor of it).

    DDP over dp 4 (nothing sharded): each rank holds the whole model and writes a quarter:

    >>> from types import SimpleNamespace as N
    >>> mesh = N(world=4, degree=lambda a: {"tp": 1, "ep": 1, "etp": 1, "pp": 1}.get(a, 1))
    >>> item = N(kind="params", group="dense", size_bytes=1000, divisor=1)
    >>> dcp_write_bytes([N(items=[item])], mesh)
    [250.0]
    """
    ranks = mesh.world / mesh.degree("pp")
    return [t / ranks for t in _stage_totals(states, mesh, model)]


def deepspeed_write_bytes(states, sharding: str) -> float:
    """Bytes the busiest rank writes in DeepSpeed's ``save_checkpoint`` (deepspeedai/DeepSpeed
    deepspeed/runtime/engine.py@edaa722). Data-parallel rank 0 alone writes the module's
    state_dict (``_configure_checkpointing`` 1586-1589: ``is_data_parallel_writer(rank)``, which
    runtime/checkpoint_engine/checkpoint_engine.py 47-48 makes ``dp_rank == 0``; ``_save_checkpoint``
    5239-5266 saves ``module_state_dict()`` then), and every rank of the ZeRO group its own
    ``zero_pp_rank_{dp_rank}`` optimizer file (1591-1596, ``_save_zero_checkpoint`` 5409-5424:
    ``optimizer.state_dict()``, its fp32 partition and moments: runtime/zero/stage_1_and_2.py
    2620-2624, stage3.py 3177-3178). Under ZeRO-0/1/2 the module
    holds the whole parameters (in the model dtype), so rank 0 writes them and its partition:
    everything it holds (parameters, master copy, optimizer state). Under ZeRO-3 every rank
    writes a model-states file (``is_first_weights_partition_group``, 1291-1296, true without
    MiCS) whose parameters are the partitioned placeholders (empty), and its optimizer
    partition: its master copy and optimizer state. Per stage the busiest rank; ``sharding``:
    ``training.sharding``.

    Llama 3 8B (8.03e9 parameters), ZeRO-2 at dp 16 in bf16: 16.06 GB module + 12 B x 8.03e9 / 16
    = 6.02 GB partition = 22.08 GB on rank 0:

    >>> from types import SimpleNamespace as N
    >>> items = [N(kind="params", size_bytes=16.06e9), N(kind="master", size_bytes=2.007e9),
    ...          N(kind="optimizer", size_bytes=4.015e9), N(kind="grads", size_bytes=1.0e9)]
    >>> round(deepspeed_write_bytes([N(items=items)], "zero2") / 1e9, 3), deepspeed_write_bytes([N(items=items)], "zero3")
    (22.082, 6022000000.0)
    """
    kinds = ("master", "optimizer") if sharding == "zero3" else CHECKPOINT_KINDS
    return max(sum(i.size_bytes for i in st.items if i.kind in kinds) for st in states)


def write_time_s(size: CheckpointSize, bandwidth_bytes_per_s: float,
                 per_rank_bandwidth_bytes_per_s: Optional[float] = None, read: bool = False) -> float:
    """Seconds to write (or, ``read``, read) the checkpoint: total bytes / aggregate storage
    bandwidth, or the busiest rank's bytes / its own bandwidth when that is slower; a rank
    writes its DCP share (``written_per_rank_bytes``) and reads back all it holds.

    >>> write_time_s(CheckpointSize(2e9, 1e12), 50e9, 1e9)
    20.0
    >>> size = CheckpointSize(2e9, 1e12, 5e8)  # holds 2 GB, writes its 0.5 GB DCP share
    >>> write_time_s(size, 2000e9, 1e9), write_time_s(size, 2000e9, 1e9, read=True)
    (0.5, 2.0)
    """
    t = size.total_bytes / bandwidth_bytes_per_s
    if per_rank_bandwidth_bytes_per_s:
        rank = size.per_rank_bytes if read or not size.written_per_rank_bytes else size.written_per_rank_bytes
        t = max(t, rank / per_rank_bandwidth_bytes_per_s)
    return t
