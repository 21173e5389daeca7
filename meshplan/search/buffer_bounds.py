"""The buffers a rank holds whatever the step does, per search candidate (bytes, numpy arrays over
the candidates of :class:`meshplan.search.columns.Candidates`, and over their stages where a stage's
parameters set them): DeepSpeed ZeRO-3's ipg buffer (:func:`ipg_bytes`), ZeRO++ hpZ's secondary
parameter partition (:func:`hpz_bytes`), Transformer Engine's userbuffers (:func:`userbuffers_bytes`), ZeRO-Offload's
GPU gradient staging buffer (:func:`offload_staging_bytes`) and the gradient bucket of the stages without FSDP
(:func:`bucket_bytes`), each as :mod:`meshplan.memory.buffers` sizes it for a plan. Read by the
search's memory bounds (:func:`meshplan.search.bounds.bounds`); split from that module (review rv48:
past the project's 400 lines).
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.memory.buffers import deepspeed3_ipg_bytes
from meshplan.memory.offload import gpu_staging_entries
from meshplan.memory.userbuffers import allocated, ub_bytes
from meshplan.search.candidate import sharding_training
from meshplan.search.columns import SHARDING, Candidates
from meshplan.units import dtype_bytes


def ipg_bytes(cfg: Config, c: Candidates) -> np.ndarray:
    """DeepSpeed ZeRO-3's ipg buffer, bytes per candidate, held from init
    (:func:`meshplan.memory.buffers.deepspeed3_ipg_bytes`): on the zero3 candidates a DeepSpeed config
    plans with ``zero3_engine = "deepspeed"`` (:attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`),
    0 elsewhere."""
    t = cfg.training
    zero3 = t.model_copy(update={"sharding": "zero3", "zero3_engine": t.searched_zero3_engine, "zero12_engine": "megatron"})
    return np.where(c.sh == SHARDING.index("zero3"), deepspeed3_ipg_bytes(zero3, cfg.memory), 0)


def userbuffers_bytes(cfg: Config, c: Candidates) -> np.ndarray:
    """Transformer Engine's userbuffers, bytes per candidate, held from init
    (:func:`meshplan.memory.userbuffers.ub_bytes` at the row's micro-batch and cp): under framework
    megatron on the rows with tp overlap (``ov``, the search's ``tp_comm_overlap``) and tp > 1
    (sequence parallel there, as the search plans it: :func:`meshplan.memory.userbuffers.allocated`),
    0 elsewhere."""
    t = cfg.training
    if not allocated(t.model_copy(update={"tp_comm_overlap": True}), 2, True):
        return np.zeros(len(c.tp), dtype=np.int64)
    on = (c.tp > 1) & (np.asarray(c.ov) > 0)
    return np.where(on, ub_bytes(t.seq_len, c.mb, c.cp, cfg.model.hidden, t.linear_dtype == "fp8"), 0)


def offload_staging_bytes(cfg: Config, tables, c: Candidates) -> np.ndarray:
    """DeepSpeed ZeRO-Offload's GPU gradient staging buffer at stages 1/2 (``temp_grad_buffer_for_gpu_offload``:
    the largest parameter on the rank, 16-bit), bytes per candidate, held from init
    (:func:`meshplan.memory.offload.gpu_staging_entries`, the plan's init entry, once per distinct row
    sharding and (tp, ep, etp); ``tables``: :class:`~meshplan.search.memory.Tables`, its meshes): on the
    zero1/zero2 rows a config with ``offload_optimizer = "cpu"`` runs under DeepSpeed's ZeRO-1/2, 0
    elsewhere. Llama-3-8B at tp 1: the embedding, 128,256 x 4,096 x 2 B = 1.05 GB."""
    out = np.zeros(len(c.tp), dtype=np.int64)
    if cfg.training.offload_optimizer == "none":
        return out
    for k, name in enumerate(SHARDING):
        t, rows = sharding_training(cfg.training, name), c.sh == k
        for tp, ep, etp in sorted(set(zip(c.tp[rows].tolist(), c.ep[rows].tolist(), c.etp[rows].tolist()))):
            entry = gpu_staging_entries(cfg.model, t, tables.mesh(tp, 1, ep, etp))
            out[rows & (c.tp == tp) & (c.ep == ep) & (c.etp == etp)] = entry[0][2] if entry else 0
    return out


def hpz_bytes(cfg: Config, c: Candidates, s: dict) -> np.ndarray:
    """ZeRO++ hpZ's secondary partition, bytes (candidates, stages), held from init
    (:func:`meshplan.memory.buffers.hpz_secondary_bytes` of each stage's parameters on a rank): on the
    zero3 candidates whose hpZ g (:attr:`~meshplan.search.columns.Candidates.hz`, None: the config's
    ``zero_hpz_partition_size``) is above 1, 0 elsewhere."""
    t = cfg.training
    g = (np.full(len(c), t.zero_hpz_partition_size) if c.hz is None else c.hz)[:, None]
    if t.searched_zero3_engine != "deepspeed" or not (g > 1).any():
        return np.zeros_like(s["params_numel"])
    per = -(-s["params_numel"] // g) * dtype_bytes(t.param_dtype)
    return np.where(((c.sh == SHARDING.index("zero3"))[:, None]) & (g > 1), per, 0)


def bucket_bytes(cfg: Config, c: Candidates, s: dict) -> np.ndarray:
    """Gradient bucket of the non-FSDP stages, bytes (candidates, pp):
    :meth:`meshplan.spec.memory.MemoryOptions.grad_bucket_bytes`, as
    :func:`meshplan.memory.sizes.stage_sizes` sizes it, under each row's own training
    (:func:`meshplan.search.candidate.sharding_training`: its sharding and engine). A DeepSpeed
    ZeRO-3 config's zero1/zero2 rows run DeepSpeed's ZeRO-1/2 at that stage's defaults: the ipg
    buffer of ``reduce_bucket_size`` elements (``contiguous_gradients`` true, one buffer with
    ``overlap_comm`` false: deepspeedai/DeepSpeed edaa722 ``runtime/zero/config.py`` 102, 138,
    382-386, ``runtime/zero/stage_1_and_2.py`` ``setup_buckets`` 2493-2515) and the flattened
    bucket (``allreduce_bucket`` 1833-1841), 2 GB at 5e8 bf16, not the config's stage 3 bucket (none
    without FSDP: the config's own training gives 0)."""
    out = np.zeros(s["params_numel"].shape, dtype=np.int64)
    for k, name in enumerate(SHARDING):
        row = (c.sh == k)[:, None]
        if row.any():
            b = cfg.memory.grad_bucket_bytes(sharding_training(cfg.training, name), c.fsdp[:, None], s["params_numel"])
            out = np.where(row, b, out)
    return out
