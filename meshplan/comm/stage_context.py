"""What a row builder of the collective table reads about one pipeline stage
(:class:`StageContext`: the model, training, mesh and the stage's layers, chunks, schedule and
micro-batches; :data:`meshplan.spec.axes.base.RowBuilder`), and the stage's parameter tensors
as the model code registers them (:func:`registered_tensors`, :func:`model_code_params`,
:func:`registration_numels`), which DDP's buckets, DeepSpeed's ZeRO-1/2 flat buffer and its
ZeRO-3 of 2021 follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from meshplan.compute.megatron import stage_param_tensors
from meshplan.compute.shapes import local_split
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import local_numel, padded_vocab
from meshplan.spec.axes.base import Dim
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.mesh import Schedule
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


@dataclass(frozen=True)
class StageContext:
    """One pipeline stage as the row builders see it: ``layers`` (its layer indices, all
    chunks), ``first`` / ``last`` (it holds the embedding / the head), ``gpu`` (where FSDP2's
    compute-stream copies run), ``stage`` (its index), ``vpp`` chunks run under ``schedule``
    with ``micro`` micro-batches per step, ``chunk_of`` (layer -> local chunk),
    ``loss_parallel`` (mesh option), ``bucket_elements`` (``[memory] grad_bucket_elements``,
    DDP's bucket cap; None: torch's), ``deepspeed_prefetch`` (DeepSpeed ZeRO-3's
    (prefetch, max live) bytes), ``deepspeed_reuse`` (its ``stage3_max_reuse_distance``) and
    ``domain`` (each rank's NVLink domain, shape (world,): which pp boundaries stay on NVLink,
    :func:`meshplan.comm.pp_rows.pp_rows`), ``placement`` and ``cluster`` (where the pp rows
    time the stage's other boundaries, :func:`meshplan.comm.pp_rows.timed_boundary`; None: not
    timed), ``kv_expanded`` (``[memory] kv_expanded``: the K/V heads torch's ring moves,
    :func:`meshplan.spec.axes.tp.sdpa_kv_heads`)."""

    model: ModelSpec
    training: TrainingSpec
    mesh: Mesh
    layers: list[int]
    first: bool
    last: bool
    gpu: GPUSpec  # the GPU the compute-stream copies run on (FSDP2)
    stage: int = 0
    vpp: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    micro: int = 1
    chunk_of: Optional[dict] = None  # layer -> local chunk
    loss_parallel: bool = True
    bucket_elements: Optional[int] = None  # [memory] grad_bucket_elements (DDP's bucket cap)
    deepspeed_prefetch: Optional[tuple[int, int]] = None  # DeepSpeed ZeRO-3's (prefetch, max live) bytes
    deepspeed_reuse: Optional[int] = None  # its stage3_max_reuse_distance, elements (None: DeepSpeed's 1e9)
    domain: Optional[np.ndarray] = None  # rank -> NVLink domain (placement.domain; None: pp rows on the pp axis's path)
    placement: Optional[object] = None  # the plan's placement (the pp rows' other boundaries timed on it)
    cluster: Optional[object] = None  # its ClusterSpec
    kv_expanded: bool = False  # [memory] kv_expanded: torch's SDPA reads K/V at the q heads (spec.axes.tp.sdpa_kv_heads)

    def layer_recomputed(self, k: int) -> bool:
        """Whether the stage's ``k``-th layer (``layers[k]``) is checkpointed in full
        (:meth:`~meshplan.spec.training.TrainingSpec.layer_recomputed` at its stage position and at
        its position within its chunk, ``chunk_of``; without ``chunk_of`` the stage is one chunk)."""
        if self.chunk_of is None:
            return self.training.layer_recomputed(k)
        chunk = self.chunk_of[self.layers[k]]
        return self.training.layer_recomputed(k, sum(self.chunk_of[i] == chunk for i in self.layers[:k]))

    @property
    def runs(self) -> int:
        """Pipeline schedule runs per step (``training.pp_schedule_runs`` with pp > 1, else 1)."""
        return self.training.pp_schedule_runs if self.mesh.degree("pp") > 1 else 1

    @property
    def seq_local(self) -> int:
        """Tokens of a sequence on one rank: s / cp, the sequence as the registered axes split
        it (:func:`meshplan.compute.shapes.local_split`)."""
        return self.training.seq_len // local_split(self.mesh)[Dim.SEQUENCE]

    @property
    def act_bytes(self) -> int:
        """TP activation buffer b * s/cp * h in compute dtype."""
        t = self.training
        return t.micro_batch * self.seq_local * self.model.hidden * dtype_bytes(t.compute_dtype)


def registered_tensors(c: StageContext) -> list:
    """The stage's parameter tensors (:class:`~meshplan.spec.model.Tensor`) in registration
    order: the embedding (first stage), the layers, the head (last stage; a tied output layer
    on the embedding's stage is the embedding)."""
    m = c.model
    v = padded_vocab(m.vocab, c.training.vocab_pad_divisor, c.mesh.degree("tp"))
    ts = (m.embedding_tensors(v) if c.first else []) + [x for i in c.layers for x in m.layer_tensors(i)]
    return ts + [x for x in (m.head_tensors(v) if c.last else []) if not (x.tied and c.first)]


def registration_numels(c: StageContext) -> list[int]:
    """Local elements of each of the stage rank's parameters in registration order, as the
    model code holds them (:func:`model_code_params`: Megatron-LM's fused QKV under
    ``framework = "megatron"``): the order DeepSpeed ZeRO-1/2 flattens them in
    (:mod:`meshplan.comm.deepspeed_zero12`)."""
    if c.training.framework == "megatron":
        parts = [([], c.first, False), (list(c.layers), False, False), ([], False, c.last)]
        return [k for layers, first, last in parts for _, k in model_code_params(c, layers, first, last)]
    mesh = c.mesh
    return [local_numel(x, c.model, mesh.degree("tp"), mesh.ep, mesh.etp, c.training.framework)
            for x in registered_tensors(c)]


def model_code_params(c: StageContext, layers: list[int], first: bool, last: bool) -> list[tuple[str, int]]:
    """(name, local elements) of the parameter tensors of ``layers`` (and the root's on the
    first / last stage) as the model code holds them: Megatron-LM's (fused QKV,
    :func:`~meshplan.compute.megatron.stage_param_tensors`) under ``framework = "megatron"``,
    else one per :class:`~meshplan.spec.model.Tensor`."""
    m, mesh, t = c.model, c.mesh, c.training
    tp = mesh.degree("tp")
    v = padded_vocab(m.vocab, t.vocab_pad_divisor, tp)
    if t.framework == "megatron":
        return [(n, k) for n, k, _ in stage_param_tensors(m, tp, v // tp, layers, first, last, mesh.degree("pp"))]
    ts = [x for i in layers for x in m.layer_tensors(i)]
    ts += (m.embedding_tensors(v) if first else []) + [x for x in (m.head_tensors(v) if last else [])
                                                        if not (x.tied and first)]
    return [(x.name, local_numel(x, m, tp, mesh.ep, mesh.etp)) for x in ts]
