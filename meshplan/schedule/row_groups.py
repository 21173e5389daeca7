"""The group and op a collective row's seconds are kept under in a stage's
:class:`~meshplan.schedule.comm_times.CommTimes` (its key (kind, group, phase, op)): the FSDP
unit a shard or replica row belongs to (:func:`shard_group`: a layer's, an MoE expert's, a root
unit's, :data:`ROOT_GROUPS`), and the groups that keep some tp, cp and ep rows apart from the
rest of their kind (float8's all-gathers, amaxes and scales, Transformer Engine's packed K/V/dK/dV
sends, torch's ring K/V shifts, Megatron-LM's QKV sub-sharding, MLA's replayed all-gathers,
get_batch's broadcasts, the dropless counts, the etp gather): :func:`row_group`, :func:`slot_op`.
"""

from __future__ import annotations

from meshplan.comm import zeropp
from meshplan.comm.ep_rows import DROPLESS_COUNTS, ETP_GATHER
from meshplan.comm.tp_rows import (FLOAT8_AMAX_CADENCE, FLOAT8_TOKEN_SCALES_CADENCE, FLOAT8_WEIGHT_SCALES_CADENCE,
                                   MLA_UP_CADENCES)
from meshplan.compute.batch_input import CORE_CADENCES, GET_BATCH_CADENCES
from meshplan.spec.axes.cp import A2A_KV, P2P_PACKED
from meshplan.spec.axes.tp_kv import QKV_GATHER_CADENCE


#: Timeline group of each FSDP root unit label (:func:`meshplan.comm.fsdp_rows.fsdp_units`): one
#: root, or the embedding's unit and the [norm, output] unit apart (torchtitan, a V).
ROOT_GROUPS = {"root (embedding)": "root_embed", "root (norm/output)": "root_head"}

#: Group of the tp rows that move float8 (the layers' all-gathers under torchao's float8 TP:
#: :func:`meshplan.compute.dtensor_sp.float8_tp`); the embedding's and head's keep "".
FLOAT8_TP = "float8"

#: Group of the tp all-reduces of float8 amaxes (:data:`meshplan.comm.tp_rows.FLOAT8_AMAX_CADENCE`).
FLOAT8_AMAX = "float8 amax"

#: Groups of the tp all-reduces of rowwise float8 scales (:mod:`meshplan.comm.tp_rows`), by row cadence.
FLOAT8_TOKEN_SCALES, FLOAT8_WEIGHT_SCALES = "float8 token scales", "float8 weight scales"

_SCALE_GROUPS = {FLOAT8_TOKEN_SCALES_CADENCE: FLOAT8_TOKEN_SCALES, FLOAT8_WEIGHT_SCALES_CADENCE: FLOAT8_WEIGHT_SCALES}

#: Group of the cp send/recv rows of Transformer Engine's p2p backward steps that carry K, V, dK and dV in
#: one buffer (:data:`meshplan.spec.axes.cp.P2P_PACKED`: twice the size of its K/V-only sends).
CP_PACKED = "kv+dkv"

#: Group of the cp send/recv rows of torch's ring K/V shifts under ``cp_rotate = "alltoall"``
#: (:data:`meshplan.spec.axes.cp.A2A_KV`), apart from its fp32 dK/dV shifts.
CP_KV_SHIFT = "kv shift"

#: Group of the tp rows of Megatron-LM's QKV sub-sharding at tp > kv_heads (the fused QKV output's
#: all-gather and reduce-scatter, :data:`meshplan.spec.axes.tp_kv.QKV_GATHER_CADENCE`).
QKV = "qkv"


def slot_op(kind: str, row) -> str:
    """The op a row's seconds are kept under: a shard unit's gradient reduction's is
    "reduce-scatter" whatever runs it (DeepSpeed ZeRO-3 of 2021's bucket all-reduces, ZeRO++ qgZ's
    all-to-alls), else the row's own."""
    if kind == "shard" and (row.op == "all-reduce" or (row.op == "all-to-all" and zeropp.MARK in row.cadence)):
        return "reduce-scatter"
    return row.op


def row_group(kind: str, row) -> str:
    """The group a row's seconds are kept under in :attr:`CommTimes.t`."""
    if kind == "tp" and row.cadence == QKV_GATHER_CADENCE:
        return QKV
    if kind == "tp" and row.cadence in MLA_UP_CADENCES.values():  # each latent's replayed all-gather its own
        return next(g for g, text in MLA_UP_CADENCES.items() if text == row.cadence)
    if kind == "cp" and P2P_PACKED in row.cadence:
        return CP_PACKED
    if kind == "cp" and A2A_KV in row.cadence:
        return CP_KV_SHIFT
    if kind == "tp" and row.op == "broadcast":  # Megatron-LM's get_batch: each broadcast its own group
        return next(g for g, text in {**GET_BATCH_CADENCES, **CORE_CADENCES}.items() if text == row.cadence)
    if kind in ("shard", "replica"):
        return shard_group(row.cadence)
    if kind == "tp" and row.cadence == FLOAT8_AMAX_CADENCE:
        return FLOAT8_AMAX
    if kind == "tp" and row.cadence in _SCALE_GROUPS:
        return _SCALE_GROUPS[row.cadence]
    if kind == "ep" and row.cadence == DROPLESS_COUNTS:  # kept apart from the dispatch, placed before it
        return "counts"
    if kind == "ep" and row.cadence == ETP_GATHER:  # Megatron-LM's etp gather and scatter, beside the all-to-alls
        return "etp"
    return FLOAT8_TP if kind == "tp" and row.dtype == "fp8" else ""


def shard_group(cadence: str) -> str:
    """The FSDP unit group a collective row belongs to, from its ``cadence`` text: a root unit's
    label (:data:`ROOT_GROUPS`, else ``"root"``), ``"expert"`` for an MoE experts' unit, else
    ``"layer"``."""
    if "root" in cadence:
        return next((g for label, g in ROOT_GROUPS.items() if label in cadence), "root")
    return "expert" if ("expert" in cadence or "MoE" in cadence) else "layer"
