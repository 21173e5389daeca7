"""DeepEP's communication buffers on one rank (``training.moe_dispatcher = "deepep"``): the bytes
the one ``deep_ep.Buffer`` that Megatron-LM's flex dispatcher creates per rank allocates on the GPU,
outside PyTorch's caching allocator, held from the first dispatch to the end of the run (the
memory timeline puts them in init, with NCCL's buffers: :func:`meshplan.memory.sizes.init_entries`).

**Sizing** (NVIDIA/Megatron-LM d98e8a6 ``megatron/core/transformer/moe/fused_a2a.py`` lines 24-69):
``get_buffer(group, hidden_bytes)`` takes, over DeepEP's recommended dispatch and combine configs
for the group's size R (``Buffer.get_dispatch_config(R)`` / ``get_combine_config(R)``), the larger
``get_nvl_buffer_size_hint(hidden_bytes, R)`` and the larger ``get_rdma_buffer_size_hint(...)``,
and builds ``Buffer(group, num_nvl_bytes, num_rdma_bytes)``; ``hidden_bytes = h x max(element
bytes, 2)`` (``get_hidden_bytes``). The group is ``tp_ep``, ep x etp ranks
(``MoEFlexTokenDispatcher``, token_dispatcher.py lines 1834-1843). The size hints
(deepseek-ai/DeepEP 92fe2de ``csrc/config.hpp`` lines 52-100), with ``c = num_sms / 2`` channels
(Megatron-LM sets ``num_sms`` 20), ``n = min(R, 8)`` NVLink ranks and ``m = max(R / 8, 1)`` RDMA
ranks, a config's ``nvl_recv`` and ``rdma_recv`` chunk tokens (``rdma_recv`` rounded up to a
multiple of ``rdma_send``), each rounded up to 128 B:

    NVL  = c n (2m + 3) 4 + c n nvl_recv (hidden_bytes + meta + 128 topk_idx + 128 x 4 + 128 x 4)
    RDMA = 0 for R <= 8, else c m (2 x 8 + 2) 2 x 4 + 2 c m rdma_recv (hidden_bytes + meta
           + 128 topk_idx + 128 x 4 + 128 x 4 + 16)

(``meta`` the 8-byte ``SourceMeta``, ``topk_idx`` 8 bytes: int64; the 128s ``kNumMaxTopK`` and
``kNumMaxScales``). ``Buffer::Buffer`` (csrc/deep_ep.cpp lines 146-197) allocates the NVL buffer
plus ``8 x (4 + 8 + 8) = 160`` B of barrier signals and pointers, and a 32 MiB workspace;
``Buffer::sync`` the RDMA buffer from NVSHMEM's symmetric heap (line 368). Constants: catalog
``deepep.toml`` ``[buffer]``. Not modelled: NVSHMEM's own heap beyond the RDMA buffer (its
reservation and mapping granularity), the host-mapped counters (host memory).

DeepSeek-V3 (h 7168, bf16: 14,336 B) at ep 64 (8 nodes x 8): dispatch and combine both give 288 NVL
and 128 RDMA chunk tokens, so NVL = 10 x 8 x 19 x 4 + 23,040 x 16,392 = 377,677,760 -> 377,677,824
(128 B), RDMA = 10 x 8 x 18 x 8 + 20,480 x 16,408 = 336,047,360, with 160 B and 32 MiB: 747,279,776 B:

>>> b = buffer_bytes(7168 * 2, 64)
>>> b.nvl_bytes, b.rdma_bytes, b.total_bytes
(377677824, 336047360, 747279776)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshplan import catalog
from meshplan.units import dtype_bytes, human_bytes

INT_BYTES = 4     # sizeof(int), sizeof(float): the hints' counters, top-k weights and scales
INT4_BYTES = 16   # sizeof(int4): the RDMA buffer's per-token tail
META_PTR_BYTES = 4 + 8 + 8  # per NVLink peer: a barrier signal (int), a buffer pointer, a signal pointer


@dataclass(frozen=True)
class BufferBytes:
    """One rank's ``deep_ep.Buffer`` in bytes (module docstring): ``nvl_bytes`` (``num_nvl_bytes``),
    ``rdma_bytes`` (``num_rdma_bytes``, 0 inside one node), ``meta_bytes`` (barrier signals and
    pointers after the NVL buffer), ``workspace_bytes``; ``group`` the ranks it spans."""

    nvl_bytes: int
    rdma_bytes: int
    meta_bytes: int
    workspace_bytes: int
    group: int

    @property
    def total_bytes(self) -> int:
        return self.nvl_bytes + self.rdma_bytes + self.meta_bytes + self.workspace_bytes


def hidden_bytes(hidden: int, element_bytes: int) -> int:
    """Megatron-LM's ``get_hidden_bytes``: ``hidden x max(element_bytes, 2)`` (an fp8 tensor is
    sized as bf16). DeepSeek-V3 in bf16: 7168 x 2:

    >>> hidden_bytes(7168, 2), hidden_bytes(7168, 1), hidden_bytes(7168, 4)
    (14336, 14336, 28672)
    """
    return hidden * max(element_bytes, catalog.deepep_buffer()["min_element_bytes"])


def supported(group: int) -> bool:
    """Whether DeepEP has a dispatch and combine config for ``group`` ranks (``get_dispatch_config``
    asserts otherwise)."""
    return group in catalog.deepep_buffer()["group_sizes"]


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _per_token(b: dict, h_bytes: int) -> int:
    """Bytes of one chunk token in either buffer before the RDMA tail: hidden, source meta, top-k
    indices and weights, scales."""
    return h_bytes + b["source_meta_bytes"] + b["max_topk"] * (b["topk_idx_bytes"] + INT_BYTES) \
        + b["max_scales"] * INT_BYTES


def _hints(b: dict, h_bytes: int, group: int, phase: str) -> tuple[int, int]:
    """(NVL, RDMA) size hints of ``phase``'s config for ``group`` ranks (module docstring)."""
    i = b["group_sizes"].index(group)
    peers = b["nvl_max_peers"]
    c, n, m = b["num_sms"] // 2, min(group, peers), max(group // peers, 1)
    nvl = c * n * (2 * m + 3) * INT_BYTES + c * n * b[f"{phase}_nvl_recv_tokens"][i] * _per_token(b, h_bytes)
    if group <= peers:
        return _align(nvl, b["alignment_bytes"]), 0
    send = b[f"{phase}_rdma_send_tokens"][i]
    recv = _align(b[f"{phase}_rdma_recv_tokens"][i], send)
    rdma = c * m * (2 * peers + 2) * 2 * INT_BYTES + 2 * c * m * recv * (_per_token(b, h_bytes) + INT4_BYTES)
    return _align(nvl, b["alignment_bytes"]), _align(rdma, b["alignment_bytes"])


def buffer_bytes(h_bytes: int, group: int) -> Optional[BufferBytes]:
    """:class:`BufferBytes` of a rank's Buffer over ``group`` ranks for tokens of ``h_bytes``
    (:func:`hidden_bytes`); None where DeepEP has no config for that size (:func:`supported`). One
    node (8 ranks): no RDMA buffer, NVL = 10 x 8 x 5 x 4 + 20,480 x 16,392 = 335,709,760 -> 335,709,824
    (128 B). 16 ranks: the dispatch's 128 RDMA chunk tokens round up to 140 (a multiple of its 20
    sent), RDMA = 10 x 2 x 18 x 8 + 2 x 20 x 140 x 16,408 = 91,887,680 -> 91,887,744:

    >>> b, b16 = buffer_bytes(14336, 8), buffer_bytes(14336, 16)
    >>> b.nvl_bytes, b.rdma_bytes, b16.rdma_bytes, buffer_bytes(14336, 12)
    (335709824, 0, 91887744, None)
    """
    if not supported(group):
        return None
    b = catalog.deepep_buffer()
    (nd, rd), (nc, rc) = (_hints(b, h_bytes, group, ph) for ph in ("dispatch", "combine"))
    return BufferBytes(max(nd, nc), max(rd, rc), b["nvl_max_peers"] * META_PTR_BYTES, b["workspace_bytes"], group)


def rank_buffer(model, training, ep: int, etp: int, moe_layers: bool) -> Optional[BufferBytes]:
    """The Buffer of a rank whose stage has MoE layers (``moe_layers``; a stage without any never
    dispatches, so never creates one) under ``training.moe_dispatcher = "deepep"`` over ep x etp > 1
    ranks (Megatron-LM asserts ``TPxEP > 1``); None otherwise or for a group size DeepEP has no
    config for (the ep axis's ``deepep_group`` rule makes that plan infeasible)."""
    if training.moe_dispatcher != "deepep" or ep * etp < 2 or not moe_layers:
        return None
    return buffer_bytes(hidden_bytes(model.hidden, dtype_bytes(training.compute_dtype)), ep * etp)


def entry(buf: Optional[BufferBytes]) -> tuple:
    """The memory timeline's init entries of ``buf`` (kind ``comm_buffers``), none without one."""
    if buf is None:
        return ()
    return ((None, "comm_buffers", buf.total_bytes,
             f"DeepEP buffer over ep x etp {buf.group}: NVL {human_bytes(buf.nvl_bytes)} + RDMA "
             f"{human_bytes(buf.rdma_bytes)} + workspace {human_bytes(buf.workspace_bytes)} + {buf.meta_bytes} B "
             f"(Megatron-LM get_buffer's size hints, catalog deepep.toml)"),)
