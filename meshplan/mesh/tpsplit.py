"""How tensor and expert parallelism split the model: padded vocabulary, local heads and
per-rank element counts of each weight.

The rules (heads vs tp, padded vocabulary, local heads; handed cases C6, C7) are the tp
axis's own (:mod:`meshplan.spec.axes.tp`); this module re-exports them beside the per-rank
element counts that use them.
"""

from __future__ import annotations

from meshplan.spec.axes.tp import heads_reason, local_heads, padded_vocab
from meshplan.spec.model import ModelSpec, Tensor

__all__ = ["fsdp_padded_numel", "heads_reason", "local_heads", "local_numel", "local_rows", "padded_numel",
           "padded_vocab"]


def local_numel(t: Tensor, model: ModelSpec, tp: int, ep: int = 1, etp: int = 1) -> int:
    """Elements of weight ``t`` held by one rank under tp (dense) or ep x etp (experts).

    Exact for the split kinds of :class:`~meshplan.spec.model.Tensor`: a replicated K/V
    head counts once per rank that holds it.
    """
    if t.split == "replicated":
        return t.numel
    if t.split in ("column", "row", "vocab"):
        return t.numel // tp
    if t.split == "kv_column":
        _, local_kv, _ = local_heads(model, tp)
        return t.numel * local_kv // model.n_kv_heads
    if t.split in ("expert_column", "expert_row"):
        return t.numel // (ep * etp)
    raise ValueError(f"unknown split {t.split!r}")


def local_rows(t: Tensor, model: ModelSpec, tp: int, ep: int = 1) -> int:
    """Dim-0 rows of weight ``t`` on one rank (torch (out, in) layout): column, vocab and
    K/V splits cut dim 0 over tp; row splits cut dim 1; experts (E, ...) cut E over ep."""
    rows = t.rows or t.numel
    if t.split in ("column", "vocab"):
        return rows // tp
    if t.split == "kv_column":
        _, local_kv, _ = local_heads(model, tp)
        return rows * local_kv // model.n_kv_heads
    if t.split in ("expert_column", "expert_row"):
        return rows // ep
    return rows


def fsdp_padded_numel(t: Tensor, model: ModelSpec, shards: int, tp: int, ep: int = 1, etp: int = 1) -> int:
    """Elements of ``t``'s unsharded FSDP2 buffer on one rank: FSDP2 shards dim 0 and pads
    it to a multiple of the shard degree (torch ``fully_shard``: ``Shard(0)`` with padding),
    so the all-gather output is ``ceil(rows / shards) * shards * (numel / rows)``.

    >>> from meshplan.spec.model import Tensor, ModelSpec
    >>> m = ModelSpec(layers=1, hidden=64, ffn=128, q_heads=4, vocab=256)
    >>> fsdp_padded_numel(Tensor("wq", 64 * 64, "column", rows=64), m, shards=3, tp=2)
    2112
    """
    return padded_numel(local_rows(t, model, tp, ep), local_numel(t, model, tp, ep, etp), shards)


def padded_numel(rows: int, numel: int, shards: int) -> int:
    """Elements of a local tensor of ``numel`` elements in ``rows`` rows once FSDP2 pads
    dim 0 to a multiple of ``shards``: ``ceil(rows / shards) x shards x (numel / rows)``;
    0 for a tensor without rows. The rule of :func:`fsdp_padded_numel`, also called by the
    search (:func:`meshplan.search.timing.comm_times`) on its per-rank tables.

    >>> padded_numel(32, 32 * 64, 3), padded_numel(0, 0, 3)
    (2112, 0)
    """
    if rows == 0:
        return 0
    return -(-rows // shards) * shards * (numel // rows)
