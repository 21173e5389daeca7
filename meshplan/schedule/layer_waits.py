"""The waits of one transformer layer's compute stream for the tp collectives it cannot run
beside (:mod:`meshplan.schedule.layer_timeline` issues them around its blocks): the float8 amax
all-reduces before a cast (:func:`amax_wait`), Megatron-LM's QKV sub-sharding gather or scatter
(:func:`qkv_gather`) and the latents' all-gathers of its ``mla_up_proj`` replay
(:func:`mla_up_gathers`). Each issues the stage's table rows on the tp stream and makes the
compute wait for them; a missing row issues nothing. Seconds come from the collective table
(:mod:`meshplan.schedule.comm_times`); shapes and sources are in each function's docstring.
"""

from __future__ import annotations

from meshplan.comm.tp_rows import MLA_UP_CADENCES
from meshplan.compute import float8, float8_tp_reduces
from meshplan.compute.ops import Cost
from meshplan.schedule.row_groups import FLOAT8_AMAX, FLOAT8_TOKEN_SCALES, FLOAT8_WEIGHT_SCALES, QKV
from meshplan.schedule.unit_sim import StreamSim


def amax_calls_of(c: Cost, side: str, phase: str, mark: str) -> int:
    """:func:`meshplan.compute.float8_tp_reduces.tp_amax_calls` of layer ``c``'s ops."""
    return float8_tp_reduces.tp_amax_calls(c.ops, side, phase, mark)


#: The groups of the float8 amax all-reduces and the mark of the casts that issue them: torchao
#: tensorwise's amaxes, rowwise's token and weight scales (:mod:`meshplan.compute.float8`).
AMAX_GROUPS = ((FLOAT8_AMAX, float8.OVER_TP), (FLOAT8_TOKEN_SCALES, float8.TOKEN_SCALES),
               (FLOAT8_WEIGHT_SCALES, float8.WEIGHT_SCALES))


def amax_wait(s: StreamSim, c: Cost, side: str, phase: str) -> None:
    """The blocking tp all-reduces of the float8 amaxes of layer ``c``'s ``side`` ("attn" or
    "mlp") in ``phase`` ("forward", also for a replay; "backward"), one after the other before the
    block (:func:`meshplan.compute.float8_tp_reduces.tp_amax_calls`; the cast waits for its scale), by group."""
    for group, mark in AMAX_GROUPS:
        t = s.c.get("tp", phase, "all-reduce", group)
        n = s.of(amax_calls_of, c, side, "forward" if phase == "forward" else "backward_input", mark) if t > 0 else 0
        if n:
            ev = s.comm("tp", phase, "all-reduce", f"tp {group} all-reduce x{n}", group, seconds=n * t)
            s.compute(f"{group} wait", 0.0, [ev])


def qkv_gather(s: StreamSim, phase: str, op: str) -> None:
    """Megatron-LM's QKV sub-sharding at tp > kv_heads (:mod:`meshplan.spec.axes.tp_kv`): the
    fused QKV output's all-gather (forward, and a recomputed layer's replay: row phase
    ``backward``) or its gradient's reduce-scatter (backward), issued in the attention's autograd
    function on the compute stream: the compute waits for it (no row: nothing)."""
    ev = s.comm("tp", phase, op, f"tp QKV {op}", QKV)
    if ev is not None:
        s.compute(f"QKV {op} wait", 0.0, [ev])


def mla_up_gathers(s: StreamSim) -> None:
    """Megatron-LM's ``mla_up_proj`` replay: each latent's tp all-gather (:func:`meshplan.comm.tp_rows.mla_up_rows`),
    the compute waiting for them before the attention's backward (no row: nothing)."""
    evs = [e for g in MLA_UP_CADENCES if (e := s.comm("tp", "backward", "all-gather", f"tp {g} all-gather", g))]
    if evs:
        s.compute("mla_up_proj replay gathers wait", 0.0, evs)
