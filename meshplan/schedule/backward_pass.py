"""The backward units of a rank's timeline: B (input and weight gradients), Bx (input gradient
only, ZB) and W (weight gradient only, ZB) of one micro-batch through one chunk of layers, on the
streams of :mod:`~meshplan.schedule.unit_sim`. The conventions (TP, CP, EP, FSDP, ZeRO, DDP,
DeepSpeed placements) are :mod:`~meshplan.schedule.rank_timeline`'s docstring; this module issues
a pass in the order the frameworks do: the head's unit and gradient, the layers last first (their
FSDP gathers prefetched by :class:`~meshplan.schedule.layer_prefetch.LayerPrefetch`, their
gradient reductions by :mod:`~meshplan.schedule.grad_reduce`), the embedding's gradient, then what
the pass leaves to its end (``perform_reduce_grad`` under pp, DeepSpeed's epilogue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from meshplan.compute.ops import Cost, Workload
from meshplan.schedule.comm_times import CommTimes, root_groups
from meshplan.schedule.deepspeed_layer import ds_backward_layer, ds_placed
from meshplan.schedule.grad_reduce import perform_reduce_grad, unit_reduce, reduce_pieces
from meshplan.schedule.layer_prefetch import LayerPrefetch
from meshplan.schedule.layer_timeline import COLUMN_PARALLEL_DGRAD, any_recompute, backward_layer, tp_collectives
from meshplan.schedule.rank_timeline import ExpertGathers, layer_gather
from meshplan.schedule.unit_sim import ChunkCosts, Overlap, UnitSim, StreamSim, simulate
from meshplan.schedule.window_unshard import unshard_chunk


@dataclass(frozen=True)
class _Pass:
    """What one backward pass does: ``with_b`` it computes input gradients (B, Bx), ``with_w``
    weight gradients (B, W); ``gather`` it all-gathers the layers' FSDP units itself (found
    sharded and not gathered by torch's window UNSHARD); ``red_w`` it reduces the weight gradients
    in the pass (not deferred to ``perform_reduce_grad``)."""

    with_b: bool
    with_w: bool
    gather: bool
    red_w: bool


def backward_unit(kind: str, chunk: ChunkCosts, comm: CommTimes, w: Workload, ov: Overlap,
                  last_grad_unit: bool = False, gather: bool = True, reduce: bool = True,
                  deferred: bool = False, stage_last: bool = True, gather_root: bool = True,
                  lead_s: Optional[float] = None) -> UnitSim:
    """``kind`` "B" (input and weight gradients), "Bx" (input gradient only, ZB) or "W"
    (weight gradient only, ZB) of one micro-batch through ``chunk``. On the chunk's
    ``last_grad_unit`` the per-step gradient reduction is spread over its layers.
    ``gather``: the pass finds the FSDP units sharded; ``reduce``: it reduce-scatters the
    FSDP gradients (every micro-batch without pp, the chunk's last gradient unit with pp).
    ``deferred`` (pp > 1): the reduce-scatters wait for the whole pass, as torch 2.13's
    ``PipelineStage`` runs FSDP2: every backward runs with gradient sync off, and after the
    chunk's last one ``perform_reduce_grad`` calls each unit's ``post_backward`` (copy-in,
    reduce-scatter) and ``_root_post_backward_final_callback``, whose ``finalize_backward`` and
    reduce-scatter-state waits hold the compute stream until every one is done. The pass's send
    goes out before (the schedule issues it after the backward, REDUCE_GRAD next), so on the
    stage's last pass (``stage_last``: the chunk whose last gradient unit ends the stage's order) the
    reduction is the unit's tail, which the stage's end waits for; on an earlier chunk's last
    pass it holds the stream in the unit (the send then waits with it: a little early).
    ``lead_s``: as :func:`~meshplan.schedule.rank_timeline.forward_unit`'s (B and Bx only)."""
    args = (kind, chunk, last_grad_unit, gather, reduce, deferred, stage_last, gather_root, lead_s)
    return simulate(lambda s: _backward(s, *args), comm, w, ov)


def block_backward_issue_s(w: Workload, c: Cost) -> float:
    """The host's seconds to issue one block's backward under eager DTensor TP
    (:attr:`~meshplan.compute.ops.Workload.dtensor_host_s`): its backward's, plus its forward's
    when the block replays its forward first (checkpointed: full, per-layer or op-level AC).
    A zero-bubble input-gradient pass ("Bx") is charged the whole backward's (the measurement's
    backward held both; an upper bound), its weight-gradient pass ("W") nothing."""
    fwd, bwd = w.dtensor_host_s
    return bwd + (fwd if w.recompute in ("full", "layer", "op") and any_recompute(c) else 0.0)


def _backward(s: StreamSim, kind: str, chunk: ChunkCosts, last_grad_unit: bool, gather: bool, reduce: bool,
              deferred: bool, stage_last: bool, gather_root: bool, lead_s: Optional[float]) -> None:
    """:func:`backward_unit`'s issue order on ``s``: the head (:func:`_backward_head`), the
    layers last first (:func:`_backward_layers`), what follows them (:func:`_after_layers`), then
    the reductions left to the pass's end."""
    comm, ov = s.c, s.ov
    with_b, with_w = kind in ("B", "Bx"), kind in ("B", "W")
    if lead_s is not None and with_b and gather:
        unshard_chunk(s, chunk, "backward", lead_s, gather_root)
        gather = gather_root = False
    p = _Pass(with_b, with_w, gather, with_w and reduce and not deferred)
    n = len(chunk.layers)
    pieces = reduce_pieces(comm, n, last_grad_unit, ov.grad_reduce) if with_w else [0.0] * n
    gather_ = lambda i, part: layer_gather(s, "backward", i, part) if with_b and gather else None
    # the routed experts' group (efsdp), resharded after forward as the layer's: gathered again,
    # prefetched beside the layer's, the chunk's last layer's by the head's pre-backward with it
    # (rank_timeline's docstring; on demand without the head's own unit)
    experts = ExpertGathers(lambda i: s.comm("shard", "backward", "all-gather", f"efsdp AG L{i}", "expert")
                            if with_b and gather and chunk.moe[i] else None)
    pf = LayerPrefetch(gather_, list(reversed(range(n))), ov.fsdp_ahead if ov.fsdp_prefetch else 0.0,
                       slide=ov.fsdp_slide)
    embed_ag = _embed_regather(s, chunk, p)
    _backward_head(s, chunk, p, pf, experts, gather_root)
    emb_ev = _backward_layers(s, chunk, p, pf, experts, pieces, embed_ag)
    _after_layers(s, chunk, p, embed_ag, emb_ev)
    if deferred and with_w and reduce:
        perform_reduce_grad(s, chunk, tail=stage_last)
    if comm.bucket_wait and s.reduced is not None and ov.grad_reduce:  # DeepSpeed's epilogue synchronize()
        s.compute("DeepSpeed epilogue synchronize", 0.0, [s.reduced])


def _embed_regather(s: StreamSim, chunk: ChunkCosts, p: _Pass) -> Optional[Callable[[], object]]:
    """The all-gather that issues the embedding's own unit again in this pass (torchtitan: it is
    resharded after forward), as a call made when the pass reaches it; None where the chunk has
    no embedding, the table no backward all-gather of it, or the pass gathers nothing."""
    emb_g = root_groups(s.c)[0]
    if chunk.embed is not None and ("shard", emb_g, "backward", "all-gather") in s.c.t and p.with_b and p.gather:
        return lambda: s.comm("shard", "backward", "all-gather", f"fsdp AG {emb_g}", emb_g)
    return None


def _backward_head(s: StreamSim, chunk: ChunkCosts, p: _Pass, pf: LayerPrefetch, experts: ExpertGathers,
                   gather_root: bool) -> None:
    """The pass up to the last layer: the head's unit gathered again (resharded after forward,
    ``training.reshard_head_after_forward``, torchtitan's "always"; ``gather_root``: this pass finds it
    sharded) and its copy-out, the head's gradient, and the layers' prefetch started. With the
    head's own unit (torchtitan, every pp) its pre-backward prefetches the last layer (and its
    experts, torchtitan b5bcd76) before the head's backward runs (FSDP2's backward prefetch in
    post-forward order), ahead of the head's reduce-scatter on the FSDP stream; otherwise the
    prefetch starts after the head."""
    comm, ov = s.c, s.ov
    head_g = root_groups(comm)[1]
    n = len(chunk.layers)
    early = ov.fsdp_prefetch and chunk.head is not None and head_g == "root_head" and n > 0
    head_ag = s.comm("shard", "backward", "all-gather", f"fsdp AG {head_g}", head_g) \
        if chunk.head is not None and p.with_b and gather_root \
        and ("shard", head_g, "backward", "all-gather") in comm.t else None
    start = ov.fsdp_start[1] if ov.fsdp_start and chunk.head is not None else None
    if early:
        pf.start(start)
        experts.prefetch(n - 1)  # in the last layer's unit (torchtitan b5bcd76): prefetched with it
    if head_ag is not None:
        s.compute(f"{head_g} copy-out", comm.copies.get((head_g, "all-gather"), 0.0), [head_ag])
    _head_grad(s, chunk, p, head_g)
    if not early:
        pf.start(start)


def _head_grad(s: StreamSim, chunk: ChunkCosts, p: _Pass, head_g: str) -> None:
    """The head's gradient: under ``Overlap.tp_grad`` (B only) Megatron-LM's
    (:func:`_head_backward`); else its input and weight gradients as one compute, then (B, Bx) the
    vocab-parallel output's tp collective waited for, and the head's unit reduced here when it is
    its own or the only root unit (one root unit with an embedding: reduced after the embedding)."""
    if chunk.head is None:
        return
    if p.with_b and p.with_w and s.ov.tp_grad:
        _head_backward(s, chunk.head)
        return
    s.compute("head grad", (chunk.head.seconds("backward_input") if p.with_b else 0.0)
              + (chunk.head.seconds("backward_weight") if p.with_w else 0.0))
    if p.with_b:
        op = tp_collectives(s.w)[1]
        s.compute("head tp wait", 0.0, [s.comm("tp", "backward", op, f"tp {op} (head)")])
    if p.red_w and (head_g == "root_head" or chunk.embed is None):
        unit_reduce(s, head_g, head_g, 0.0)


def _head_backward(s: StreamSim, head: Cost) -> None:
    """The last stage's head backward under ``Overlap.tp_grad`` (Megatron-LM 2022: the output
    layer is ``language_model.py`` ``parallel_lm_logits`` through ``mpu/layers.py``
    ``LinearWithGradAccumulationAndAsyncCommunication``, a column-parallel linear): the cross
    entropy's backward, then with SP the output layer's input all-gathered again during its
    input-gradient GEMM, the input gradient's reduce-scatter (SP) or all-reduce launched before
    its weight-gradient GEMM and run beside it, then the final norm's backward (and its
    main-gradient hooks) once the reduced gradient is there."""
    after = tp_collectives(s.w)[1]
    part = lambda phase, keep: sum(o.seconds for o in head.ops if o.phase == phase and keep(o.name))
    is_norm = lambda name: name.startswith("final norm")
    norm = part("backward_input", is_norm) + part("backward_weight", is_norm)
    col = part("backward_input", lambda name: name in ("output.dgrad", *COLUMN_PARALLEL_DGRAD)) if s.w.sp else 0.0
    s.compute("head B", part("backward_input", lambda name: not is_norm(name)) - col)
    ag = s.comm("tp", "backward", "all-gather", "tp all-gather (head input again, for wgrad)") if s.w.sp else None
    if s.w.sp:
        s.compute("head column B", col)
    post = s.comm("tp", "backward", after, f"tp {after} (head)")
    s.compute("head W", part("backward_weight", lambda name: not is_norm(name)), [ag], [post] if s.ov.tp else [])
    s.compute("head tp wait", 0.0, [post])
    s.compute("final norm grad", norm)


def _backward_layers(s: StreamSim, chunk: ChunkCosts, p: _Pass, pf: LayerPrefetch, experts: ExpertGathers,
                     pieces: list[float], embed_ag: Optional[Callable[[], object]]):
    """The chunk's layers, last first: each waits for its FSDP all-gathers (and its experts'), pays
    its copy-out (FSDP2's follows an all-gather only: none where the table has no backward one,
    ``reshard_after_forward`` false keeping the forward's unsharded parameters) and its host time,
    prefetches the next, then computes its gradients (:func:`_layer_grads`; ``pieces``: seconds of
    the gradient reduction after each layer, backward order). Returns the embedding unit's
    all-gather when FSDP2's backward prefetch issued it after the first layer's copy-out, else None."""
    comm, ov = s.c, s.ov
    n = len(chunk.layers)
    emb_ev = None
    for i in reversed(range(n)):
        ags = pf.need(n - 1 - i)
        ag_e = experts.need(i)
        s.compute(f"L{i}", comm.host.get(("layer", "backward"), 0.0)
                  + (comm.copies.get(("layer", "all-gather"), 0.0) if ags else 0.0)
                  + (comm.copies.get(("expert", "all-gather"), 0.0) if ag_e is not None else 0.0)
                  if p.with_b and p.gather else 0.0, [*ags, ag_e])
        pf.after(n - 1 - i)
        if ov.fsdp_prefetch and i > 0:
            experts.prefetch(i - 1)
        if i == 0 and embed_ag is not None and ov.fsdp_prefetch:
            emb_ev = embed_ag()  # FSDP2's backward prefetch: the embedding's unit after the first layer
        _layer_grads(s, chunk, i, p, pieces[n - 1 - i])
    return emb_ev


def _layer_grads(s: StreamSim, chunk: ChunkCosts, i: int, p: _Pass, piece_s: float) -> None:
    """Layer ``i``'s gradients: DeepSpeed ZeRO-3 2021's layer backward with its reductions placed
    in it (:func:`~meshplan.schedule.deepspeed_layer.ds_backward_layer`); else its blocks' backward
    (:func:`~meshplan.schedule.layer_timeline.backward_layer`), the tp all-reduce of its replicated
    weights' Partial gradients on the tp stream and the host's issue time (B, Bx), or its
    weight-gradient GEMMs and, checkpointed, its forward's replays (W: :func:`_w_replays`); then its
    unit's gradient reduction (``piece_s``: the
    per-step reduction's piece after it) and its experts'."""
    c, moe = chunk.layers[i], chunk.moe[i]
    ds = p.with_b and p.red_w and ds_placed(s, moe)
    if ds:
        ds_backward_layer(s, c, f"L{i}")
    elif p.with_b:
        backward_layer(s, c, moe, p.with_w)
        s.comm("tp", "backward", "all-reduce", f"tp norm-grad all-reduce L{i}", seconds=s.c.async_s)
        s.host_pace(f"L{i}", block_backward_issue_s(s.w, c))
    else:
        s.compute(f"L{i} W", c.seconds("backward_weight"))
        _w_replays(s, chunk, i)
    if p.with_w and not ds:
        unit_reduce(s, f"L{i}", "layer", piece_s, p.red_w)
        if moe and p.red_w:
            unit_reduce(s, f"L{i} experts", "expert", 0.0)


def _w_replays(s: StreamSim, chunk: ChunkCosts, i: int) -> None:
    """A zero-bubble W of a fully checkpointed layer under eager torch (``recompute`` full, or
    per-layer AC's checkpointed layers; ``Workload.torch_eager``): torch 2.13's
    ``stage_backward_weight`` runs one ``autograd.grad`` per parameter group, and the non-reentrant
    checkpoint replays the layer's whole forward in each (measured on torch 2.13 CPU, two runtime Blocks
    of 9 groups each: 2 forwards in F, 2 in I, 18 in W, 140 GEMMs in W = 14 weight-gradient + 18 x 7
    replayed: :func:`meshplan.memory.wlag.weight_groups`, tests/test_wlag_layers.py). So W carries
    ``chunk.w_replays[i]`` times the layer's recomputed forward ops (``Cost.seconds("backward_input",
    recompute=True)``, what B's own replay computes), as compute only: the replays' TP/CP/EP collectives
    are not added (the W is a lower bound there). Not under op-level AC (torch 2.13 raises in W: "Trying
    to backward an extra time ... selective activation checkpoint") nor compiled (not measured)."""
    c = chunk.layers[i]
    n = chunk.w_replays[i] if chunk.w_replays else 0
    if n and s.w.torch_eager and s.w.recompute in ("full", "layer") and s.of(any_recompute, c):
        s.compute(f"L{i} W: forward replayed x{n}", n * c.seconds("backward_input", recompute=True))


def _after_layers(s: StreamSim, chunk: ChunkCosts, p: _Pass, embed_ag: Optional[Callable[[], object]],
                  emb_ev) -> None:
    """What follows the layers on the first stage: the embedding's own input-gradient ops
    (Megatron-LM: its dropout's backward, on the rank's sequence shard under SP, before the split's
    backward gathers the gradient) and, under SP, the all-gather mirroring its forward
    reduce-scatter; the timers' syncs; DeepSpeed pipe's rebuilt output and grad; then the
    embedding's unit (``embed_ag``, or ``emb_ev`` already prefetched): only gathered for a ZB Bx,
    else its weight gradient, host time and copy-out, and its reduction."""
    comm, w, emb_g = s.c, s.w, root_groups(s.c)[0]
    if chunk.embed is not None and p.with_b and chunk.embed.seconds("backward_input"):
        s.compute("embedding dropout grad", chunk.embed.seconds("backward_input"))
    if chunk.embed is not None and p.with_b and w.sp:  # the gradient of the embedding's reduce-scatter
        s.compute("embedding tp wait", 0.0, [s.comm("tp", "backward", "all-gather", "tp all-gather (embedding)")])
    if chunk.batch is not None and p.with_b:
        s.compute("timers", chunk.batch.seconds("backward_input"))
    if chunk.engine is not None and p.with_b and chunk.engine.seconds("backward_input"):
        s.compute("DeepSpeed pipe: output and grad rebuilt, fp32 grad accumulation", chunk.engine.seconds("backward_input"))
    if embed_ag is not None and not p.with_w:  # Bx (ZB): the embedding's pre-backward gathers it
        ag_e = emb_ev if emb_ev is not None else embed_ag()
        s.compute("embedding unshard", comm.copies.get((emb_g, "all-gather"), 0.0) if ag_e is not None else 0.0,
                  [ag_e])
    if chunk.embed is not None and p.with_w:
        ag_e = emb_ev if emb_ev is not None or embed_ag is None else embed_ag()
        s.compute("embedding grad", chunk.embed.seconds("backward_weight")
                  + (comm.host.get((emb_g, "backward"), 0.0) if p.red_w else 0.0)
                  + (comm.copies.get((emb_g, "all-gather"), 0.0) if ag_e is not None else 0.0), [ag_e])
        if p.red_w:
            unit_reduce(s, emb_g, emb_g, 0.0)
