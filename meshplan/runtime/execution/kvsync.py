"""Replicated KV heads kept equal during training (tp > kv_heads, handed case C6).

The runtime model holds ``tp`` KV heads when tp > kv_heads, head ``i`` of the real model
copied on the ``r = tp / kv_heads`` tp ranks of its replica group
(:func:`meshplan.mesh.tpsplit.kv_replica_groups`: ranks ``{r i, ..., r i + r - 1}`` of a tp
group). Each copy's gradient comes from the q heads of its own rank only; the real head's
gradient is their sum. :class:`KVReplicaSync` all-reduces (sum) each layer's wk and wv (and
bias) gradients over the replica group once per step, after the data-parallel reduction
(FSDP2's reduce-scatter) and before the optimizer, one flattened buffer per layer: the
``kv_replica`` row of the plan's collective table
(:func:`meshplan.comm.collectives.kv_replica_grad_numel`). The copies start equal too: the
model draws the real heads and copies them (:func:`replicated_kv_value`). As bigcode's
Megatron-LM sums the multi-query K/V gradients over tp before the optimizer (PR 39,
``reduce_model_grads``) and HF transformers builds a KV replication group of ``n_rep``
consecutive tp ranks (PR 47811).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from meshplan.mesh.tpsplit import kv_replica_groups
from meshplan.spec.model import ModelSpec

#: Parameters of an attention layer that hold one KV head per rank past ``kv_heads``.
KV_PARAMS = ("attention.wk.weight", "attention.wv.weight", "attention.wk.bias", "attention.wv.bias")


def replicated_kv_value(name: str, full: torch.Tensor, kv_heads: int, r: int) -> torch.Tensor:
    """The value of parameter ``name`` of the model built with ``kv_heads x r`` KV heads,
    from ``full``, its value in the real model (``kv_heads x head_dim`` rows for wk, wv and
    their biases): each head's rows repeated ``r`` times, head by head, so tp rank ``j``
    holds head ``j // r``. ``full`` itself for any other parameter, or when r = 1.

    2 KV heads of 2 rows, r 2: heads [h0, h0, h1, h1]:

    >>> replicated_kv_value("layers.0.attention.wk.weight", torch.arange(4.).view(4, 1), 2, 2).flatten().tolist()
    [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]
    """
    if r == 1 or not name.endswith(KV_PARAMS):
        return full
    rows = full.shape[0]
    heads = full.reshape(kv_heads, rows // kv_heads, *full.shape[1:])
    return heads.repeat_interleave(r, dim=0).reshape(rows * r, *full.shape[1:])


class KVReplicaSync:
    """Sum, over this rank's KV replica group, each layer's replicated K/V gradients (module
    docstring). ``layers``: per layer, the parameters of :data:`KV_PARAMS` this rank holds;
    ``group``: its replica group's process group. ``__call__`` issues one all-reduce per
    layer of the layer's local gradients (DTensor local shards) flattened into one buffer,
    copied back in place."""

    def __init__(self, layers: list[list[torch.nn.Parameter]], group):
        self.layers, self.group = layers, group

    def __call__(self) -> None:
        for params in self.layers:
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params
                     if p.grad is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def kv_replica_sync(modules: list[torch.nn.Module], spec: ModelSpec, mesh) -> Optional[KVReplicaSync]:
    """:class:`KVReplicaSync` of this rank for the layers of ``modules`` (a
    :class:`~meshplan.runtime.execution.model.Transformer`, or a pipeline rank's stage
    modules, each with ``layers``) on ``mesh`` (meshplan's :class:`~meshplan.mesh.resolve.Mesh`),
    or None when no KV head is replicated. Builds every replica group (``new_group`` is
    collective: every rank makes the same calls in the same order) and keeps this rank's."""
    groups = kv_replica_groups(mesh, spec)
    if not len(groups):
        return None
    rank = dist.get_rank()
    mine = None
    for ranks in groups.tolist():
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = pg
    layers = []
    for module in modules:
        for block in getattr(module, "layers").values():  # a Transformer or a StageModule
            att = block.attention
            layers.append([p for p in (att.wk.weight, att.wv.weight, att.wk.bias, att.wv.bias) if p is not None])
    return KVReplicaSync(layers, mine)
