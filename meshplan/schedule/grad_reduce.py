"""Where a gradient unit issues its gradient reductions: a unit's FSDP reduce-scatter and HSDP
all-reduce and its layer's piece of the per-step ZeRO-1/2 or DDP reduction (:func:`unit_reduce`,
pieces by :func:`reduce_pieces`), and torch's ``PipelineStage.perform_reduce_grad`` after a
chunk's last backward under pp (:func:`perform_reduce_grad`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.pipeline.simulate import Event
from meshplan.schedule.comm_times import CommTimes, root_groups
from meshplan.schedule.unit_sim import ChunkCosts, StreamSim


def unit_reduce(s: StreamSim, name: str, group: str, step_piece: float, shard: bool = True) -> None:
    """FSDP reduce-scatter (+ HSDP all-reduce) of a unit when ``shard``; ``step_piece``:
    seconds of this layer's piece (bucket) of the per-step ZeRO-1/2 or DDP reduction."""
    if shard:
        rs_buffer_wait(s)
    if shard and (copy_in := s.c.copies.get((group, "reduce-scatter"), 0.0)):
        s.compute(shard_name("RS copy-in", name, group), copy_in)  # FSDP2: on the compute stream (comm.fsdp2)
    rs = _reduce_scatter(s, name, group, s.last) if shard else None
    if step_piece and s.c.bucket_wait and s.ov.grad_reduce and s.reduced is not None:
        # DeepSpeed overlap_comm: the compute stream waits for the reduction stream (the
        # previous bucket's all-reduce) before issuing the next (deepspeed_zero12)
        s.compute("bucket wait (DeepSpeed overlap_comm)", 0.0, [s.reduced])
    red = _reduce_piece(s, name, step_piece) if step_piece else None
    s.reduced = red or s.reduced
    if not s.ov.grad_reduce:
        s.compute("grad reduce wait", 0.0, [rs, red])


def rs_buffer_wait(s: StreamSim, tail: bool = False) -> None:
    """FSDP2's one reduce-scatter in flight (``Overlap.fsdp_rs_queue``): a unit's ``post_backward``
    makes the compute stream wait for the previous reduce-scatter before its copy-in reuses the
    input buffer (torch 2.13 ``_fsdp_param_group.py`` lines 639-658, ``reduce_scatter_max_input_buffers``
    1 by default, ``_fully_shard.py`` ``set_reduce_scatter_max_input_buffers``; the memory timeline's
    :mod:`meshplan.memory.passes` frees it so). ``tail``: after the unit's compute (the compute stream's
    clock moved, not its last event). Nothing where none was issued in the unit, nor shown where the
    reduce-scatter ends before the compute stream is free (the run decides:
    :class:`~meshplan.schedule.unit_sim.StreamSim`)."""
    prev = s.rs_prev
    if not s.ov.fsdp_rs_queue or prev is None:
        return
    if tail:  # from the stream's free time to the reduce-scatter's end, shown where it ends later
        s.fixed("fsdp RS buffer wait", 0.0, hold=[prev], cond=True)
    else:  # exposed on the reduce-scatter's stream where it ends after the stream is free
        s.compute("fsdp RS buffer wait", 0.0, [prev], cond=True)


def shard_name(word: str, name: str, group: str) -> str:
    """The trace name of a unit's FSDP reduction (``word``: RS, AR, RS copy-in) on the stream its
    group runs on, as the unit's all-gathers are named (:mod:`meshplan.schedule.rank_timeline`):
    ``fsdp``, or ``efsdp`` for an MoE layer's experts' unit (``name`` ``"L0 experts"``).

    >>> shard_name("RS", "L0", "layer"), shard_name("RS", "L0 experts", "expert")
    ('fsdp RS L0', 'efsdp RS L0')
    >>> shard_name("RS copy-in", "L3 experts", "expert")
    'efsdp RS copy-in L3'
    """
    if group == "expert":
        return f"efsdp {word} {name.removesuffix(' experts')}"
    return f"fsdp {word} {name}"


def _reduce_piece(s: StreamSim, name: str, seconds: float) -> Optional[Event]:
    """A layer's piece of the per-step (or ZeRO-2's micro-batch) gradient reduction: one event
    per group its rows run on (:meth:`~meshplan.schedule.comm_times.CommTimes.reduce_parts`:
    "dp" for the data axes, "tp" for the SP norms' gradients without FSDP, "pp" for the tied
    embedding's), one after another on the one queue the reduction had before it was split, so
    the pieces' times are unchanged; the last event (the reduction is done with it)."""
    red = None
    for label, sec, op in s.c.reduce_parts(seconds):
        red = s.comm("dp", "step", "reduce", f"grad reduce: {op} {name}" if op else f"grad reduce {name}",
                     seconds=sec, label=label) or red
    return red


def _reduce_scatter(s: StreamSim, name: str, group: str, after: Optional[Event]) -> Optional[Event]:
    """A unit's FSDP reduce-scatter issued after ``after`` and its HSDP all-reduce after it:
    the event the gradient is done with (None when the stage has neither)."""
    word = "AR" if s.c.shard_reduce_op == "all-reduce" else "RS"
    rs = s.comm("shard", "backward", "reduce-scatter", shard_name(word, name, group), group, after=[after])
    s.rs_prev = rs or s.rs_prev
    return s.comm("replica", "backward", "all-reduce", f"hsdp AR {name}", group, after=[rs or after]) or rs


def reduce_pieces(comm: CommTimes, n: int, last_grad_unit: bool = True, overlapped: bool = True) -> list[float]:
    """Seconds of the gradient reduction issued after each of the ``n`` layers of a gradient
    unit, in backward order (the last layer first): ZeRO-2's micro-batch reduction
    (``mb_reduce_s`` in ``mb_buckets`` buckets) on every unit, overlapped or not; else the
    per-step reduction (``step_reduce_s``, DDP's ``ddp_buckets``) on a chunk's
    ``last_grad_unit`` when ``overlapped`` (``Overlap.grad_reduce``; otherwise it runs at the
    step's end), nothing elsewhere. Each layer's share, ``S / max(layers, n)``; but when there
    are fewer buckets ``B`` than the stage has layers (one chunk), a bucket goes out only once
    its layers' gradients are all there: after the ``j``-th layer ``floor((j+1) B / n) -
    floor(j B / n)`` buckets of ``S / B`` each, so one bucket (the whole model) is issued after
    the first layer's backward, the last of the pass.

    >>> reduce_pieces(CommTimes(step_reduce_s=6.0, layers=3, ddp_buckets=1), 3)
    [0.0, 0.0, 6.0]
    >>> reduce_pieces(CommTimes(step_reduce_s=6.0, layers=3), 3)
    [2.0, 2.0, 2.0]
    >>> reduce_pieces(CommTimes(step_reduce_s=6.0, layers=4, ddp_buckets=2), 4)
    [0.0, 3.0, 0.0, 3.0]
    >>> reduce_pieces(CommTimes(step_reduce_s=6.0, layers=3), 3, last_grad_unit=False)
    [0.0, 0.0, 0.0]
    >>> reduce_pieces(CommTimes(mb_reduce_s=2.0, mb_buckets=1, layers=4), 4, last_grad_unit=False, overlapped=False)
    [0.0, 0.0, 0.0, 2.0]
    """
    if comm.mb_reduce_s:
        total, big_b = comm.mb_reduce_s, comm.mb_buckets
    elif last_grad_unit and overlapped:
        total, big_b = comm.step_reduce_s, comm.ddp_buckets
    else:
        return [0.0] * n
    if not big_b or big_b >= n or n != comm.layers:
        return [total / max(comm.layers, n)] * n
    return [((j + 1) * big_b // n - j * big_b // n) * total / big_b for j in range(n)]


def perform_reduce_grad(s: StreamSim, chunk: ChunkCosts, tail: bool) -> None:
    """torch ``PipelineStage.perform_reduce_grad`` after a chunk's last backward: each FSDP
    unit's ``post_backward`` in FSDP's state order (module order: the one root unit or the
    embedding's, the layers in forward order, then the [norm, output] unit):
    its copy-in on the compute stream, then its reduce-scatter (and HSDP all-reduce) on their
    stream; the compute stream waits for them all (``_root_post_backward_final_callback``):
    within the unit, or after it (``tail``: events past its compute end, the unit's tail)."""
    emb_g, head_g = root_groups(s.c)
    # FSDP's states in module order: one root unit first; the embedding's own unit first and
    # [norm, output]'s last (torchtitan's units)
    first = emb_g if chunk.embed is not None else head_g if chunk.head is not None and head_g == "root" else None
    names = [(first, first)] if first is not None else []
    for i, moe in enumerate(chunk.moe):
        names.append((f"L{i}", "layer"))
        if moe:
            names.append((f"L{i} experts", "expert"))
    if chunk.head is not None and head_g != "root":
        names.append((head_g, head_g))
    done, prev = [], s.last
    for name, group in names:
        rs_buffer_wait(s, tail)
        if copy_in := s.c.copies.get((group, "reduce-scatter"), 0.0):
            if tail:  # on the compute stream after the unit, not moving its end
                prev = s.fixed(shard_name("RS copy-in", name, group), copy_in, after=[prev])
            else:
                prev = s.compute(shard_name("RS copy-in", name, group), copy_in)
        done.append(_reduce_scatter(s, name, group, prev))
    if not tail:
        s.compute("perform_reduce_grad wait", 0.0, done)
