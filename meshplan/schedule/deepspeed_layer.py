"""A dense layer's backward as DeepSpeed ZeRO-3 of 2021 (v0.3.13) runs it, module by module
(:data:`DS_PIECES`), with its gradient buckets' reductions where its hooks flush them and its
fetches wait for them (:func:`ds_backward_layer`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.comm import deepspeed
from meshplan.compute.ops import Cost
from meshplan.pipeline.simulate import Event
from meshplan.schedule.comm_times import DS_ALIAS
from meshplan.schedule.layer_timeline import any_recompute, forward_layer
from meshplan.schedule.unit_sim import StreamSim


#: A dense layer's backward as DeepSpeed ZeRO-3 of 2021 runs it, module by module in autograd's
#: order (:func:`ds_backward_layer`): the residual's gradient, the MLP's second linear, the
#: activation, the first linear(s), the MLP norm with the attention's residual, the attention's
#: output projection, the core, the QKV projection(s), the attention norm.
DS_PIECES = ("mlp_post", "w_down", "act", "w_up", "mlp_norm", "wo", "core", "query_key_value", "attn_norm")


#: The pieces whose module DeepSpeed gathers again in backward: its pre-backward ``fetch_sub_module``
#: ends in ``torch.cuda.synchronize()`` (``_synchronize_communication``, v0.3.13 ``stage3.py``
#: lines 483-491, called at line 406): the host waits for every stream, the bucket reductions in
#: flight included. The norms are persistent (never gathered); w_down also without a replay.
DS_FETCHED = ("w_up", "wo", "query_key_value")


def _ds_piece(block: str, name: str) -> str:
    """The :data:`DS_PIECES` piece of a layer's backward op (block, op name)."""
    module = deepspeed.module_of(name.split(".")[0].split(" ")[0])
    module = DS_ALIAS.get(module, module)
    if block in ("mlp_pre", "attn_post"):
        return "mlp_norm"
    if block in ("mlp_post", "attn_pre"):
        return "mlp_post" if block == "mlp_post" else "attn_norm"
    if block == "mlp":
        return module if module in ("w_down", "w_up") else "w_down" if name.startswith("mlp down") else \
            "w_up" if name.startswith("mlp up") else "act"
    return module if module in ("wo", "query_key_value") else "wo" if name.startswith("wo ") else \
        "query_key_value" if name.startswith("qkv") else "core"


def _ds_pieces(c: Cost, full: bool) -> dict[str, float]:
    """Seconds of each :data:`DS_PIECES` piece of a layer's backward (the replayed forward's ops
    left out under ``full`` recompute): the same ops :func:`~meshplan.schedule.layer_timeline.backward_layer` runs."""
    out = dict.fromkeys(DS_PIECES, 0.0)
    for o in c.ops:
        if o.phase == "backward_weight" or (o.phase == "backward_input" and not (full and o.recompute)):
            out[_ds_piece(o.block, o.name)] += o.seconds
    return out


def ds_placed(s: StreamSim, moe: bool) -> bool:
    """Whether a layer's backward places DeepSpeed ZeRO-3 of 2021's bucket reductions where its
    hooks flush them (:func:`ds_backward_layer`): the stage has them, a dense layer, tp 1 (no
    TP collectives inside the blocks) and no other axis's slots."""
    return any(g == "layer" for g, _ in s.c.ds_flush) and not moe and s.w.tp == 1 and not s.c.slots


def ds_backward_layer(s: StreamSim, c: Cost, name: str) -> None:
    """A layer's backward under DeepSpeed ZeRO-3 of 2021 with its gradient reductions where
    v0.3.13 issues and waits for them (``stage3.py``): the replayed forward, then the
    :data:`DS_PIECES` in order. A bucket is reduced on the reduction stream (``overlap_comm``,
    stage 3's default true: ``ZERO3_OPTIMIZATION_OVERLAP_COMM_DEFAULT``) from the hook of the
    gradient that would overflow it (:func:`meshplan.comm.deepspeed.flush_modules`), issued
    once that module's GEMMs are enqueued, so it runs beside them; the flush first waits on the
    host for the bucket before (``reduce_ipg_grads``: ``reduction_stream.synchronize()``, line
    1691), so what follows the module waits for it (for a module that flushes two buckets, for
    both: at most its last, one bucket, waited early), and the host issues the next flush no
    earlier than what it last waited for (a fetch's synchronize or such a bucket), not when the
    GPU finishes the module (the host runs ahead of the compute stream between waits); every
    :data:`DS_FETCHED` module's fetch, and the next layer's first, waits for all. Buckets
    flushed elsewhere (by the embedding's gradient) are waited for at the layer's end, as before.
    The layer's gathers stay one unit's, prefetched during the layer before: on the one NCCL
    stream a bucket waits behind them (at 1,536 GPUs w_down's, flushed first)."""
    full = s.w.recompute in ("full", "layer", "op") and s.of(any_recompute, c)
    if full:
        forward_layer(s, c, False, "backward_input", True)
    secs = s.of(_ds_pieces, c, full)
    word = "AR" if s.c.shard_reduce_op == "all-reduce" else "RS"
    last: Optional[Event] = None
    host = [s.last]  # what the host last waited for: it issues the next flush no earlier than all
    for piece in DS_PIECES:
        if last is not None and (piece in DS_FETCHED or (piece == "w_down" and not full)):
            host = [s.compute(f"{name} {piece} fetch sync (DeepSpeed)", 0.0, [last])]
        sec, buckets = s.c.ds_flush.get(("layer", piece), (0.0, 0.0))
        before = last
        ev = s.comm("shard", "backward", "reduce-scatter", f"fsdp {word} {name} ({piece})", "layer",
                    after=host, seconds=sec)
        last = ev or last
        s.compute(f"{name} {piece} grad", secs[piece])
        wait = (ev if buckets > 1 else before) if ev is not None else None
        if wait is not None:
            s.compute(f"{name} {piece} flush wait (DeepSpeed)", 0.0, [wait])
            host = [*host, wait]  # the later of the two (the run takes the latest end)
    rest = sum(t for (g, m), (t, _) in s.c.ds_flush.items() if g == "layer" and m not in DS_PIECES)
    ev = s.comm("shard", "backward", "reduce-scatter", f"fsdp {word} {name} (elsewhere)", "layer", seconds=rest)
    s.compute(f"{name} reductions wait (DeepSpeed)", 0.0, [ev or last])
