"""Replicated KV heads kept equal during training (tp > kv_heads, handed case C6).

The runtime model holds ``tp`` KV heads when tp > kv_heads, head ``i`` of the real model
copied on the ``r = tp / kv_heads`` tp ranks of its replica group
(:func:`meshplan.mesh.tpsplit.kv_replica_groups`: ranks ``{r i, ..., r i + r - 1}`` of a tp
group). Each copy's gradient comes from the q heads of its own rank only; the real head's
gradient is their sum. :class:`KVReplicaSync` all-reduces (sum) each layer's wk and wv (and
bias) gradients over the replica group once per step, after the data-parallel reduction
(FSDP2's reduce-scatter) and before the optimizer, one flattened buffer per layer: the
``kv_replica`` row of the plan's collective table
(:func:`meshplan.comm.tp_grads.kv_replica_grad_numel`). The copies start equal too: the
model draws the real heads and copies them (:func:`replicated_kv_value`). A DCP checkpoint
holds each real head once and loads it into every copy (:func:`dedup_kv_state`). As bigcode's
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


def kv_copies(model: torch.nn.Module) -> tuple[int, int]:
    """(real KV heads, copies of each) of ``model`` (a Transformer or a pipeline stage
    module: ``spec`` and ``kv_heads`` built); copies 1 when nothing is replicated."""
    spec = getattr(model, "spec", None)
    built = getattr(model, "kv_heads", None)
    if spec is None or built is None or spec.is_mla:
        return 1, 1
    return spec.n_kv_heads, built // spec.n_kv_heads


def dedup_kv_state(model: torch.nn.Module, msd: dict, osd: dict) -> tuple[dict, dict]:
    """The state dicts (``get_state_dict``'s) with every replicated KV parameter
    (:data:`KV_PARAMS`) and its optimizer states as a DTensor of the real model's shape, so a
    DCP checkpoint holds each KV head once and loads it into every copy.

    TP splits the ``kv_heads x r`` built heads rows-wise (``Shard(0)`` over tp: tp rank j
    holds head j // r); DCP sees a global tensor of ``r`` copies per head and writes them all
    (``r`` times the bytes, and a shape that exists at this tp only). Here the tp mesh
    dimension becomes two, ``tp_kv`` (kv_heads) ``x tp_kv_copy`` (r; a replica group, ranks
    r i .. r i + r - 1, is one ``tp_kv`` index), placed ``Shard(0)`` and ``Replicate()``,
    and FSDP2's ``_StridedShard(0, split_factor=tp)`` over its data-parallel dimension
    becomes ``split_factor=kv_heads``: the global tensor has ``kv_heads x head_dim`` rows,
    the copies are replicas of one chunk, and DCP's planner writes one of them
    (``dedup_save_plans``). The local tensors are shared (no copy): ``dcp.load`` into the
    returned dicts fills every copy with its head. The mesh is built without process groups
    (``_init_backend=False``: DCP needs only the ranks' coordinates). Without copies: the
    dicts unchanged."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kv, r = kv_copies(model)
    if r == 1:
        return msd, osd
    meshes: dict = {}

    def convert(v):
        names = tuple(getattr(getattr(v, "device_mesh", None), "mesh_dim_names", None) or ())
        if not isinstance(v, DTensor) or "tp" not in names or v.placements[names.index("tp")] != Shard(0):
            return v
        t, dm = names.index("tp"), v.device_mesh
        if names not in meshes:
            grid = dm.mesh.reshape(*dm.mesh.shape[:t], kv, r, *dm.mesh.shape[t + 1:])
            meshes[names] = DeviceMesh(dm.device_type, grid, mesh_dim_names=names[:t] + ("tp_kv", "tp_kv_copy")
                                       + names[t + 1:], _init_backend=False)
        tp = dm.mesh.shape[t]
        pl: list = []
        for i, p in enumerate(v.placements):
            if i == t:
                pl += [Shard(0), Replicate()]
            elif isinstance(p, _StridedShard) and p.dim == 0 and p.split_factor == tp:
                pl.append(_StridedShard(0, split_factor=kv))
            else:
                pl.append(p)
        shape = torch.Size((v.shape[0] // r,) + tuple(v.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(v.to_local(), meshes[names], pl, run_check=False, shape=shape, stride=stride)

    msd = {k: convert(v) if k.endswith(KV_PARAMS) else v for k, v in msd.items()}
    state = {k: ({n: convert(t) for n, t in s.items()} if str(k).endswith(KV_PARAMS) else s)
             for k, s in osd.get("state", {}).items()}
    return msd, {**osd, "state": state}
