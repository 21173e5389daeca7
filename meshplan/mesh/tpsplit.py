"""How tensor and expert parallelism split the model: padded vocabulary, local heads and
per-rank element counts of each weight.

The rules (heads vs tp, padded vocabulary, local heads; handed cases C6, C7) are the tp
axis's own (:mod:`meshplan.spec.axes.tp`); this module re-exports them beside the per-rank
element counts that use them.
"""

from __future__ import annotations

import numpy as np

from meshplan.spec.axes.ep import expert_shard_dim
from meshplan.spec.axes.tp import heads_reason, local_heads, padded_vocab
from meshplan.spec.axes.tp_kv import qkv_gathered
from meshplan.spec.model import ModelSpec, Tensor

__all__ = ["KV_REPLICA", "expert_shard_dim", "fsdp_padded_numel", "fsdp_shard_len", "heads_reason", "kv_replica_group_of", "kv_replica_groups",
           "local_heads", "local_numel", "local_rows", "model_groups", "padded_numel", "padded_vocab"]

#: Name of the groups of tp ranks that hold copies of the same KV head (tp > kv_heads).
KV_REPLICA = "kv_replica"
#: Frameworks whose runtime keeps no copy of a KV head (:func:`model_groups`): torchtitan refuses
#: tp past the KV heads (:data:`meshplan.spec.axes.tp.TORCH_KV`), Megatron-LM sub-shards its fused QKV.
NO_KV_COPIES = ("torch", "megatron")


def kv_replica_groups(mesh, model: ModelSpec) -> np.ndarray:
    """Groups (n_groups, r) of the ranks that hold the same KV head when tp > kv_heads, ``r =
    tp / kv_heads`` (:func:`local_heads`): inside each tp group (its ranks in tp order) the
    ``r`` consecutive ranks ``{r i, ..., r i + r - 1}`` hold KV head ``i``, the copies the
    replicated K and V weights' gradients are summed over (HF transformers PR 47811's KV
    replication group; bigcode Megatron-LM PR 39 for MQA). Shape (0, 1) when no head is
    replicated (tp <= kv_heads). ``mesh``: a resolved :class:`~meshplan.mesh.resolve.Mesh`.

    32 q heads, 4 KV heads, tp 8 x dp_shard 2 (handed case C6): tp groups {0..7}, {8..15}:

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> mesh = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[2, 8]), world=16)
    >>> m = ModelSpec(layers=1, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> kv_replica_groups(mesh, m).tolist()
    [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    >>> kv_replica_groups(resolve_mesh(MeshSpec(names=["tp", "dp_shard"], shape=[8, 2]), world=16), m)[:2].tolist()
    [[0, 2], [4, 6]]
    """
    _, _, r = local_heads(model, mesh.degree("tp"))
    if r == 1:
        return np.zeros((0, 1), dtype=np.int64)
    tp_groups = np.asarray(mesh.groups("tp"))
    return tp_groups.reshape(-1, r)


def model_groups(mesh, model: ModelSpec, framework: str = "torch", own_runtime: bool = False) -> dict[str, np.ndarray]:
    """Groups that depend on the model as well as the mesh, by name, beside the mesh axes'
    (``groups`` output): ``kv_replica`` (:func:`kv_replica_groups`) when tp > kv_heads and
    tp can split the heads, for meshplan's own runtime only (``own_runtime``: validate's
    comparison and probe, its dry runs); empty otherwise. No framework of :data:`NO_KV_COPIES`
    forms them (``framework``: the config's): torchtitan
    (``framework`` torch) replicates no KV head (rule ``torch_kv_heads`` refuses such a tp,
    :data:`meshplan.spec.axes.tp.TORCH_KV`; handed case C6), nor does Megatron-LM
    (:mod:`meshplan.spec.axes.tp_kv`: its QKV all-gather runs on the tp group).

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> m = ModelSpec(layers=1, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> tp8 = resolve_mesh(MeshSpec(names=["tp"], shape=[8]), world=8)
    >>> {k: v.tolist() for k, v in model_groups(tp8, m, own_runtime=True).items()}
    {'kv_replica': [[0, 1], [2, 3], [4, 5], [6, 7]]}
    >>> model_groups(tp8, m, "torch"), model_groups(tp8, m, "megatron")
    ({}, {})
    """
    if heads_reason(model, mesh.degree("tp")) or (framework in NO_KV_COPIES and not own_runtime):
        return {}
    groups = kv_replica_groups(mesh, model)
    return {KV_REPLICA: groups} if len(groups) else {}


def kv_replica_group_of(mesh, model: ModelSpec, rank: int) -> list[int]:
    """Ranks holding the same KV head as ``rank`` (:func:`kv_replica_groups`); ``[rank]``
    when no head is replicated.

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> mesh = resolve_mesh(MeshSpec(names=["tp"], shape=[16]), world=16)
    >>> m = ModelSpec(layers=1, hidden=16384, ffn=1, q_heads=128, kv_heads=8, head_dim=128, vocab=1)
    >>> kv_replica_group_of(mesh, m, 5), kv_replica_group_of(mesh, m.model_copy(update={"kv_heads": 16}), 5)
    ([4, 5], [5])
    """
    groups = kv_replica_groups(mesh, model)
    hit = np.flatnonzero((groups == rank).any(axis=1))
    return [int(x) for x in groups[hit[0]]] if len(hit) else [rank]


def local_numel(t: Tensor, model: ModelSpec, tp: int, ep: int = 1, etp: int = 1, framework: str = "torch") -> int:
    """Elements of weight ``t`` held by one rank under tp (dense) or ep x etp (experts).

    Exact for the split kinds of :class:`~meshplan.spec.model.Tensor`: at tp > kv_heads a
    replicated K/V head counts once per rank that holds it (meshplan's own runtime, framework
    torch), and under framework megatron each rank holds 1/tp of wk and wv as of every
    column-parallel weight (the fused ``linear_qkv``'s 1/tp, :mod:`meshplan.spec.axes.tp_kv`).

    Llama-3-70B's wk (1024 x 8192) at tp 16: one head of 128 rows, or 64 rows under Megatron:

    >>> m = ModelSpec(layers=80, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, vocab=128256)
    >>> wk = next(t for t in m.layer_tensors(0) if t.name == "wk")
    >>> local_numel(wk, m, 16), local_numel(wk, m, 16, framework="megatron")
    (1048576, 524288)
    """
    if t.split == "replicated":
        return t.numel
    if t.split in ("column", "row", "vocab"):
        return t.numel // tp
    if t.split == "kv_column":
        if qkv_gathered(framework, tp, model.n_kv_heads):
            return t.numel // tp
        _, local_kv, _ = local_heads(model, tp)
        return t.numel * local_kv // model.n_kv_heads
    if t.split in ("expert_column", "expert_row"):
        return t.numel // (ep * etp)
    raise ValueError(f"unknown split {t.split!r}")


def local_rows(t: Tensor, model: ModelSpec, tp: int, ep: int = 1, framework: str = "torch") -> int:
    """Dim-0 rows of weight ``t`` on one rank (torch (out, in) layout): column, vocab and
    K/V splits cut dim 0 over tp (K/V under framework megatron at tp > kv_heads as a column
    split, :func:`local_numel`); row splits cut dim 1; experts (E, ...) cut E over ep."""
    rows = t.rows or t.numel
    if t.split in ("column", "vocab") or (t.split == "kv_column" and qkv_gathered(framework, tp, model.n_kv_heads)):
        return rows // tp
    if t.split == "kv_column":
        _, local_kv, _ = local_heads(model, tp)
        return rows * local_kv // model.n_kv_heads
    if t.split in ("expert_column", "expert_row"):
        return rows // ep
    return rows


def local_dim1(t: Tensor, etp: int = 1) -> int:
    """Dim 1 of routed expert weight ``t`` on one rank: etp cuts the expert width, dim 1 of
    w_gate/w_up (E, f, h) and dim 2 of w_down (E, h, f) (torchtitan ``ExpertTensorParallel``:
    ``Shard(1)`` and ``Shard(2)``); 0 for a tensor without ``dim1``."""
    return t.dim1 // etp if t.split == "expert_column" else t.dim1


def fsdp_shard_len(t: Tensor, model: ModelSpec, shards: int, tp: int, ep: int = 1, etp: int = 1) -> int:
    """Length on one rank of the dim FSDP2 shards ``t`` on over ``shards`` ranks: dim 0
    (:func:`local_rows`), or dim 1 for routed experts when efsdp ``shards`` x ep > experts
    (:func:`~meshplan.spec.axes.ep.expert_shard_dim`, torchtitan's ``shard_placement_fn``).

    Mixtral's w_gate (8, 14336, 4096) at ep 8: 1 expert per rank; over efsdp 4 FSDP2 shards
    dim 1 (14336), over efsdp 1 dim 0 (1 row):

    >>> from meshplan.spec.model import ModelSpec
    >>> m = ModelSpec(layers=1, hidden=4096, ffn=14336, q_heads=32, vocab=1, experts=8, top_k=2)
    >>> gate = next(t for t in m.layer_tensors(0) if t.name == "experts_w_gate")
    >>> fsdp_shard_len(gate, m, 4, tp=1, ep=8), fsdp_shard_len(gate, m, 1, tp=1, ep=8)
    (14336, 1)
    """
    if t.expert and t.dim1 and expert_shard_dim(model.experts, shards, ep) == 1:
        return local_dim1(t, etp)
    return local_rows(t, model, tp, ep)


def fsdp_padded_numel(t: Tensor, model: ModelSpec, shards: int, tp: int, ep: int = 1, etp: int = 1) -> int:
    """Elements of ``t``'s unsharded FSDP2 buffer on one rank: FSDP2 shards one dim
    (:func:`fsdp_shard_len`: dim 0, or dim 1 of the routed experts past efsdp x ep > experts)
    and pads it to a multiple of the shard degree (torch ``fully_shard``), so the all-gather
    output is ``ceil(len / shards) * shards * (numel / len)``.

    >>> from meshplan.spec.model import Tensor, ModelSpec
    >>> m = ModelSpec(layers=1, hidden=64, ffn=128, q_heads=4, vocab=256)
    >>> fsdp_padded_numel(Tensor("wq", 64 * 64, "column", rows=64), m, shards=3, tp=2)
    2112

    Mixtral's w_gate at ep 8 over efsdp 4 (dim 1, no padding) and, were it dim 0, 1 expert
    padded to 4:

    >>> m = ModelSpec(layers=1, hidden=4096, ffn=14336, q_heads=32, vocab=1, experts=8, top_k=2)
    >>> gate = next(t for t in m.layer_tensors(0) if t.name == "experts_w_gate")
    >>> fsdp_padded_numel(gate, m, 4, tp=1, ep=8), padded_numel(1, 14336 * 4096, 4)
    (58720256, 234881024)
    """
    return padded_numel(fsdp_shard_len(t, model, shards, tp, ep, etp), local_numel(t, model, tp, ep, etp), shards)


def padded_numel(rows: int, numel: int, shards: int) -> int:
    """Elements of a local tensor of ``numel`` elements in ``rows`` rows once FSDP2 pads
    its sharded dim (``rows`` long: dim 0, or dim 1 of routed experts, :func:`fsdp_shard_len`)
    to a multiple of ``shards``: ``ceil(rows / shards) x shards x (numel / rows)``;
    0 for a tensor without rows. The rule of :func:`fsdp_padded_numel`, also called by the
    search (:func:`meshplan.search.comm_bounds.comm_times`) on its per-rank tables.

    >>> padded_numel(32, 32 * 64, 3), padded_numel(0, 0, 3)
    (2112, 0)
    """
    if rows == 0:
        return 0
    return -(-rows // shards) * shards * (numel // rows)


def experts_apart(mesh) -> bool:
    """Whether an MoE layer's routed experts are all-gathered (FSDP) or reduced (ZeRO-1/2, DDP)
    apart from the rest of their layer, over efsdp: :func:`experts_apart_degrees` of the mesh.

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> [experts_apart(resolve_mesh(MeshSpec(names=["dp_shard", "ep"], shape=[4, e]), world=4)) for e in (1, 2)]
    [False, True]
    """
    return bool(experts_apart_degrees(mesh.ep, mesh.degree("efsdp"), mesh.degree("fsdp")))


def experts_apart_degrees(ep, efsdp, fsdp):
    """:func:`experts_apart` from the degrees, elementwise on numpy arrays too (the search's
    columns): under ep > 1, or where efsdp is not fsdp's group (ep 1: etp != tp).

    - torchtitan (``apply_fsdp_to_decoder`` at b5bcd76) gives the experts their own mesh under
      ep > 1, the block's parameter group over efsdp beside its dense one; under ep 1 it shards
      them with the block over its FSDP mesh, one all-gather of the whole layer (``Shard(1)``
      past fsdp > experts).
    - Megatron-LM marks expert weights ``allreduce = not use_expert_pgs``, ``use_expert_pgs`` =
      ep > 1 or etp != tp (NVIDIA/Megatron-LM d98e8a6 ``megatron/core/extensions/transformer_engine.py``
      110, 1235-1239, 1740-1745), and only those get their own gradient buffer over the expert
      data-parallel group (``megatron/core/distributed/param_and_grad_buffer.py`` 896-899,
      ``distributed_data_parallel.py`` 285-289); the others reduce with the dense ones over dp x cp.

    >>> import numpy as np
    >>> experts_apart_degrees(np.array([1, 1, 2]), np.array([8, 4, 4]), np.array([8, 8, 8])).tolist()
    [False, True, True]
    """
    return (ep > 1) | (efsdp != fsdp)
