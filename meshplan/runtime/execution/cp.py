"""Context parallelism (cp) as Llama 3 trained with it: all-gather based CP (Dubey et al.
2024, "The Llama 3 Herd of Models", section 3.3.2).

Each rank of a cp group holds ``s / cp`` tokens of every sequence, as two chunks of
``s / (2 cp)``: rank ``i`` holds chunk ``i`` and chunk ``2 cp - 1 - i`` of the ``2 cp``
equal chunks (Llama 3's split for causal load balance, the split meshplan's plan assumes:
:func:`meshplan.mesh.validity` needs ``seq_len % (2 cp) == 0`` and says so in its notes). In
every attention layer the rank all-gathers K and V over the cp group, stacked into one
buffer of ``2 x b x s x kv_heads_local x head_dim`` elements (multi-head latent attention,
whose K and V head dims differ: concatenated, ``b x s x heads_local x (d_qk + d_v)``; one
all-gather per layer; its autograd backward is one reduce-scatter (sum) of dK and dV of the
same size: :func:`meshplan.spec.axes.cp.cp_rows`), and computes attention for its ``s / cp`` local
queries against all ``s`` keys with a boolean causal mask built from the global positions
of both (``key_position <= query_position``), the shape
:func:`meshplan.compute.shapes.attention_shape` gives (``seq_q = s / cp``, ``seq_kv = s``). With
the load-balanced split every rank's unmasked work is half of ``s/cp x s``, the plan's
``causal_half`` convention; the CPU kernel with an explicit mask computes the whole
``s/cp x s`` block either way. Rotary positions are the global positions of the rank's
tokens (:meth:`ContextParallel.positions`).

Each cp rank computes the loss on its own tokens (mean over them). FSDP2 shards and averages
gradients over the ``fsdp`` axis (dp_shard x cp, torchtitan), so the averaged gradient is the
gradient of the mean loss over the whole sequence: the chunks are of equal size, and the
reduce-scatter of dK/dV sums each rank's contribution to the other ranks' keys.

Worked example: seq 8, cp 2 (chunks of 2 tokens): rank 0 holds positions [0, 1, 6, 7],
rank 1 holds [2, 3, 4, 5]; the gathered keys are in rank order [0, 1, 6, 7, 2, 3, 4, 5].

>>> chunk_positions(8, 2, 0).tolist(), chunk_positions(8, 2, 1).tolist()
([0, 1, 6, 7], [2, 3, 4, 5])
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from meshplan.errors import ConfigError


def chunk_positions(seq: int, cp: int, index: int) -> torch.Tensor:
    """Global token positions (``seq / cp``, int64) held by cp rank ``index`` of ``cp``:
    chunks ``index`` and ``2 cp - 1 - index`` of ``seq / (2 cp)`` tokens each.

    Raises ConfigError (field ``training.seq_len``) when ``seq % (2 cp) != 0``."""
    if seq % (2 * cp):
        raise ConfigError("training.seq_len", f"seq_len {seq} is not divisible by 2 * cp ({2 * cp}) "
                          "for load-balanced causal CP")
    if not 0 <= index < cp:
        raise ConfigError("mesh.cp", f"cp rank {index} is outside 0..{cp - 1}")
    c = seq // (2 * cp)
    return torch.cat((torch.arange(index * c, (index + 1) * c),
                      torch.arange((2 * cp - 1 - index) * c, (2 * cp - index) * c)))


def shard_sequence(x: torch.Tensor, cp: int, index: int) -> torch.Tensor:
    """This cp rank's tokens of ``x`` (batch, seq, ...): (batch, seq / cp, ...), in the order
    of :func:`chunk_positions`. ``cp == 1`` returns ``x``."""
    if cp == 1:
        return x
    return x[:, chunk_positions(x.shape[1], cp, index)]


def rank_chunks(mesh, rank: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``xs`` (batch, seq, ...) as global ``rank`` of ``mesh`` (a
    :class:`meshplan.mesh.resolve.Mesh`) feeds it to the model: :func:`shard_sequence` at the rank's
    index in its cp group; unchanged when cp is 1."""
    cp = mesh.degree("cp")
    index = mesh.group_of(rank, "cp").index(rank) if cp > 1 else 0
    return tuple(shard_sequence(x, cp, index) for x in xs)


class ContextParallel:
    """What one rank needs for all-gather CP: the cp process group, its degree and this
    rank's index in it. Attached to the model and to every attention module by
    :func:`apply_cp`; the model passes local tokens (batch, seq / cp)."""

    def __init__(self, group: dist.ProcessGroup, degree: int, index: int):
        self.group, self.degree, self.index = group, degree, index
        self._mask: dict[tuple[int, str], torch.Tensor] = {}

    def positions(self, local_seq: int) -> torch.Tensor:
        """Global positions (local_seq,) of this rank's tokens; the sequence is ``local_seq * cp``."""
        return chunk_positions(local_seq * self.degree, self.degree, self.index)

    def mask(self, local_seq: int, device) -> torch.Tensor:
        """Boolean (local_seq, local_seq * cp) mask, True where a local query may attend to a
        gathered key (keys in rank order, each rank's :func:`chunk_positions`)."""
        key = (local_seq, str(device))
        if key not in self._mask:
            seq = local_seq * self.degree
            keys = torch.cat([chunk_positions(seq, self.degree, r) for r in range(self.degree)])
            self._mask[key] = (keys[None, :] <= self.positions(local_seq)[:, None]).to(device)
        return self._mask[key]

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (batch, seq / cp, kv_heads_local, head_dim) of every cp rank, in rank
        order: (batch, seq, kv_heads_local, head_dim) each, by one autograd-aware all-gather
        of the stacked (2, batch, seq / cp, ...) buffer (backward: one reduce-scatter, sum)."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        if k.shape != v.shape:  # multi-head latent attention: d_qk != d_v
            return self._gather_cat(k, v)
        kv = all_gather_single_autograd(torch.stack((k, v)).contiguous(), 0, self.group)
        kv = kv.view(self.degree, 2, *k.shape)  # (cp, 2, b, s/cp, kv, d): rank r's K and V at [r]
        full = kv.permute(1, 2, 0, 3, 4, 5).reshape(2, k.shape[0], -1, *k.shape[2:])
        return full[0], full[1]

    def _gather_cat(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gather_kv` for K and V of different head dims (MLA: (b, s/cp, heads, d_qk)
        and (b, s/cp, heads, d_v)): one all-gather of the (b, s/cp, heads, d_qk + d_v) buffer,
        ``b s/cp heads (d_qk + d_v)`` elements per rank, as the plan's MLA row counts it."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        d = k.shape[-1]
        kv = all_gather_single_autograd(torch.cat((k, v), dim=-1).contiguous(), 0, self.group)
        kv = kv.view(self.degree, *k.shape[:-1], -1)  # (cp, b, s/cp, heads, d_qk + d_v)
        full = kv.permute(1, 0, 2, 3, 4).reshape(k.shape[0], -1, *kv.shape[3:])
        return full[..., :d], full[..., d:]


def apply_cp(model: nn.Module, group: dist.ProcessGroup, degree: int, index: int) -> Optional[ContextParallel]:
    """Attach a :class:`ContextParallel` to ``model`` and every ``Attention`` inside it, in
    place; ``degree == 1`` attaches nothing and returns None."""
    if degree == 1:
        return None
    ctx = ContextParallel(group, degree, index)
    model.context_parallel = ctx
    for block in model.layers.values():
        block.attention.context_parallel = ctx
    return ctx
