"""Rank timeline of one pipeline unit: the forward (F), backward (B, input gradient), or
weight-gradient (W) pass of one micro-batch through one chunk of layers, as an event
simulation over a compute stream and one stream per collective kind (``tp``, ``cp``,
``ep``, ``fsdp``, ``efsdp``, ``dp_replicate``, ``dp``), and one per registered axis that
declares where its rows run (:attr:`~meshplan.spec.axes.base.AxisDef.timeline`, below).

Op times come from :mod:`meshplan.compute.ops` (per block of a layer), collective times from
the plan's collective rows (``CollectiveRow.time_s`` per call, kinds by :func:`~meshplan.schedule.comm_streams.comm_kind`;
per-layer counts follow the conventions below, not the rows' counts). Dependencies, as the
frameworks issue them:

- **TP**, per layer forward: ``norm (AG) attention-block (RS|AR) add+norm (AG) mlp-block
  (RS|AR) add`` (AG/RS with sequence parallel, AR without; Korthikanti et al. 2022 4.2.2).
  A collective blocks the next compute unless ``Overlap.tp``: then a block's collectives
  run during its GEMMs (block time = max(compute, communication), an ideal decomposition),
  except under ``training.tp_comm_overlap`` with SP (``Workload.async_tp``): there the fused
  all-gather + column-parallel GEMMs and row-parallel GEMM + reduce-scatter run as the runtime
  decomposes them (:mod:`meshplan.compute.asynctp`, :meth:`~meshplan.schedule.unit_sim.StreamSim.fused`; forward blocks without
  CP or EP; in backward the gathered output gradient with the row-parallel input gradient);
  under torch the collectives it does not fuse block as without it (``Overlap.tp`` stays off:
  :func:`meshplan.compute.asynctp.unfused_overlap`).
  Backward: with SP an AG before each block; the row-parallel linear's (wo, w_down) weight
  gradient is computed with its input gradient at the block's start. torch (``training.framework``,
  the default): the input-gradient RS|AR of the column-parallel linears (wq/wk/wv, w_up/w_gate)
  is issued after their input and weight gradients (one autograd node each, before the
  redistribution's backward) and the next block waits for it. Megatron-LM
  (``Overlap.tp_grad``): it runs during their weight-gradient GEMMs (the asynchronous gradient
  collective), and with SP their input is all-gathered again before, during their
  input-gradient GEMM (only its sequence shard is saved). Full recompute re-runs the forward blocks (with their
  collectives; compiled torch's not the MLP's closing one, :func:`~meshplan.schedule.layer_timeline.replay_scatters`);
  torchtitan's per-layer AC does so in its checkpointed layers, its op-level AC re-runs the
  forward ops it did not save, with each block's all-gather but not its reduce-scatter (whose
  output it saved; the row-parallel GEMM replayed, if at all, as a plain GEMM).
  An MoE layer's MLP block issues the tp collectives the table counts (``Workload.moe_tp_ops``,
  :func:`meshplan.spec.axes.ep.moe_mlp_tp_ops`): none where the routed experts issue nothing over
  tp (etp 1, and Megatron-LM at any etp: its tokens move over ep and etp) and there is no shared
  expert; torch MoE at ep 1, etp = tp with SP and shared experts: the MLP block closes with two RS (the
  routed and the shared outputs reduced apart), the add waiting for
  both; in backward two AG open it (their mirrors), full AC's replay re-runs the first RS.
  torchao's float8 tensorwise TP: the amax all-reduces of a block's casts of tp shards
  (:mod:`meshplan.compute.float8`) block one after the other before the block (forward and its
  replay: the attention's 2, the MLP's 2; backward: the MLP's 3, the attention's 4 per Llama layer);
  rowwise under plain TP, its casts' scale all-reduces likewise (forward: wo's, w_down's; backward:
  the column-parallel Linears').
  The all-reduces of the Partial gradients of weights replicated over tp (SP norms, an MoE
  router, MLA's down projections and latent norms) run on the tp stream after each layer's
  backward (nothing waits for them until the step ends, but the tp stream is busy meanwhile); the vocab-parallel loss collectives block
  after the output layer.
- **CP** (all-gather CP: Llama 3, Dubey et al. 2024, 3.3.2; torchtitan): the attention block
  runs as K/V projection (wk, wv, RoPE), Q projection (wq), core attention, output projection
  (wo). The K/V all-gather is issued after the K/V projection and may overlap only the Q
  projection: the core attention waits for it (exposed per layer ``max(0, AG - wq)``).
  Backward: the dK/dV reduce-scatter is issued after the core attention's backward (wo's
  input gradient, attention, RoPE) and may overlap only wq's input gradient; the K/V
  projections' input gradients wait for it. Full recompute replays the gather (phase
  backward, as the table counts it). torch's ring attention (``training.cp_attention = "ring"``,
  torchtitan's; :mod:`meshplan.schedule.ring_timeline`): the gather is issued after all three
  projections and runs beside the first of the core's cp SDPA calls; backward gathers again
  beside its first call and shifts the fp32 dK/dV after each call, beside the next, the last
  one exposed.
- **EP**: the dispatch all-to-all blocks the expert block; the combine follows it.
- **FSDP** (zero3/hsdp): the all-gather of the next layer is issued when a layer starts
  (``Overlap.fsdp_prefetch``, FSDP2's default prefetch of one layer; otherwise issued when
  needed; ``Overlap.fsdp_ahead`` layers ahead, DeepSpeed ZeRO-3's: :mod:`~meshplan.schedule.layer_prefetch`); a layer's gradient reduce-scatter is issued after its weight gradients and runs
  during the next layer's backward (``Overlap.grad_reduce``; otherwise it blocks); HSDP
  all-reduces the shard over dp_replicate after it. The routed experts' all-gather (efsdp,
  ep > 1; under ep 1 they are in the layer's: :func:`~meshplan.mesh.tpsplit.experts_apart`) is
  gathered by the same passes as its layer, on the efsdp stream, prefetched beside the layer's
  (torchtitan ``apply_fsdp_to_decoder`` at b5bcd76 under ep > 1: the experts a parameter group of
  the block's unit on their own mesh, so each block's explicit prefetch of the next block in
  forward and of the previous one in backward takes them too, as does the output layer's of the
  last block in backward, before the head's), except the chunk's first layer's in forward:
  gathered at the layer's start, as the layer's own (issued after the embedding). The memory
  timeline holds them in the same windows (:mod:`meshplan.memory.units`). With pp > 1 a pass gathers only when it
  finds its chunk sharded (:func:`meshplan.comm.fsdp_rows.fsdp_gather_flags`: with
  ``reshard_after_forward = false`` once per step and chunk, and under torch at vpp > 3 again
  after each eviction from the schedule's window of 3 local stages, all-gathered from torch's
  UNSHARD up to 2 chunks of ops earlier and waited for at that pass: :mod:`~meshplan.schedule.window_unshard`)
  and reduces only on the chunk's
  last gradient unit (``PipelineStage`` turns gradient sync off for every other backward).
  The ends (torchtitan's units, ``TrainingSpec.torchtitan_units``, at every pp): the
  embedding's unit is gathered before the embedding (and, resharded, again after the first
  layer's backward copy-out, FSDP2's backward prefetch) and reduce-scattered after its
  gradient; the [norm, output] unit is gathered after the last layer's copy-out (prefetched as
  a layer's) and reduce-scattered right after the head's backward, its pre-backward having
  prefetched the last layer first (resharded after forward, ``training.reshard_head_after_forward``:
  all-gathered again just before, with its copy-out) (with pp > 1 too; there the reduce-scatters wait for
  ``perform_reduce_grad``, the embedding's first and [norm, output]'s after the layers'). One
  root unit (tied at pp 1, Megatron): gathered before the embedding, reduced after the
  embedding's gradient.
  DeepSpeed ZeRO-3 of 2021 (``training.zero3_engine``): a layer's gather is the sum of its
  per-parameter calls (:mod:`meshplan.comm.deepspeed`), placed as one unit's; its gradient
  buckets' reductions (``fsdp AR``, or ``fsdp RS`` under ``contiguous_gradients``) are placed
  in its backward, module by module, where v0.3.13's hooks flush them and its fetches wait
  for them (:func:`~meshplan.schedule.deepspeed_layer.ds_backward_layer`; with tp > 1 or MoE, as one unit's, waited for at once);
  their host time (partition views, list copies issued, the zero fill waited for) runs on the
  compute stream at the layer's start (``CommTimes.host``); the persistent parameters' gather
  ends the step.
- **ZeRO-1, DDP**: on a chunk's last gradient unit the per-step reduction is issued in
  per-layer pieces (buckets) after each layer's weight gradients (``Overlap.grad_reduce``);
  DDP with fewer buckets than layers issues each bucket once its layers are done
  (:func:`~meshplan.schedule.grad_reduce.reduce_pieces`). **ZeRO-2**: every gradient unit issues its micro-batch's bucket
  reduce-scatters the same way (overlapped under ``Overlap.grad_reduce``, else each blocks).
  **DeepSpeed ZeRO-1/2** (``training.zero12_engine``, :mod:`meshplan.comm.deepspeed_zero12`):
  its bucket all-reduces are placed as ZeRO-2's (zero2) or ZeRO-1's (zero1), overlapped only
  under ``training.overlap_comm`` (else on the compute stream: each blocks, and zero1's run
  after the last backward), where each piece first waits for the previous one and the unit
  ends waiting for the last (``CommTimes.bucket_wait``). As ZeRO-2's, the pieces follow the
  layers (:func:`~meshplan.schedule.grad_reduce.reduce_pieces`): the embedding's and output layer's buckets are spread over
  them, not placed at the ends (the exposed sum without overlap is the same).
- **A registered axis with a timeline** (not built-in: :func:`~meshplan.schedule.comm_streams.timeline_axes`): its rows run
  on its own stream (the timeline's ``stream``, default the axis's name), one call per
  layer for each :class:`~meshplan.spec.axes.base.Slot` of the pass's phase, at the slot's
  place: ``before`` / ``after`` the attention or MLP block (in the backward, around that
  block's backward; the compute waits for it) or ``overlapped`` after the layer's pass
  (nothing waits). Seconds per call: the row's of that phase and op. A checkpoint's replay
  places none. Its rows of a (phase, op) no slot names are reported as not simulated.

A unit's duration is its compute-stream end; communication still running then is its
``tail`` (it overlaps the next unit; contention between units on a stream is ignored).
Exposed communication of a stream = time the compute stream waited on it.

This module builds the units (:func:`forward_unit`, :func:`backward_unit`) and places the
embedding, the head and the FSDP root units; the rest lives beside it:
:mod:`~meshplan.schedule.comm_times` (the rows' kinds and seconds per call),
:mod:`~meshplan.schedule.unit_sim` (the stream simulation), :mod:`~meshplan.schedule.layer_timeline`
(a layer's blocks and their TP, CP, EP collectives), :mod:`~meshplan.schedule.deepspeed_layer`
(DeepSpeed ZeRO-3 of 2021's layer backward), :mod:`~meshplan.schedule.grad_reduce` (the gradient
reductions' placement).
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.batch_input import BATCH_BROADCASTS, BROADCAST_GROUPS, CORE_KEY_BYTES
from meshplan.compute.ops import Cost, Workload
from meshplan.schedule.comm_times import CommTimes, root_groups
from meshplan.schedule.deepspeed_layer import ds_backward_layer, ds_placed
from meshplan.schedule.grad_reduce import perform_reduce_grad, unit_reduce, reduce_pieces
from meshplan.schedule.layer_prefetch import LayerPrefetch
from meshplan.schedule.layer_timeline import COLUMN_PARALLEL_DGRAD, any_recompute, backward_layer, forward_layer, tp_collectives
from meshplan.schedule.unit_sim import ChunkCosts, Overlap, UnitSim, StreamSim, simulate
from meshplan.schedule.window_unshard import unshard_chunk


def _layer_gather(s: StreamSim, phase: str, i: int, part: float):
    """The all-gather of ``part`` of layer ``i``'s FSDP unit in ``phase`` (1: the whole call; a
    part's seconds its share of the call's, :mod:`~meshplan.schedule.layer_prefetch`). In backward
    under DeepSpeed's ``stage3_max_reuse_distance`` (``Overlap.fsdp_backward``) each of the layer's
    calls gathers its share of that part, timed as that share of the forward's whole call (the same
    unit's bytes; none where the distance kept the whole layer); the last one is returned (one
    stream: it ends after the others)."""
    shares = s.ov.fsdp_backward[i] if phase == "backward" and s.ov.fsdp_backward else None
    if shares is not None:
        # the backward's whole call where the table has one (ZeRO++ hpZ: the secondary group's), else the forward's
        whole_s = s.c.get("shard", "backward", "all-gather", "layer") or s.c.get("shard", "forward", "all-gather", "layer")
        ev = None
        for x in shares:
            ev = s.comm("shard", phase, "all-gather", f"fsdp AG L{i} ({part * x:.0%}, stage3_max_reuse_distance)",
                        "layer", seconds=whole_s * part * x)
        return ev
    whole = part >= 1.0
    return s.comm("shard", phase, "all-gather", f"fsdp AG L{i}" + ("" if whole else f" ({part:.0%})"), "layer",
                  seconds=None if whole else s.c.get("shard", phase, "all-gather", "layer") * part)


class _ExpertGathers:
    """A pass's all-gathers of the routed experts' FSDP units (efsdp): ``issue(i)`` gives layer
    ``i``'s event (None where the pass gathers none); :meth:`prefetch` issues it beside the
    layer prefetched, :meth:`need` gives what layer ``i`` waits for, issued on demand when no
    prefetch took it."""

    def __init__(self, issue):
        self.issue, self.events = issue, {}

    def prefetch(self, i: int) -> None:
        self.events[i] = self.issue(i)

    def need(self, i: int):
        return self.events.pop(i) if i in self.events else self.issue(i)


def forward_unit(chunk: ChunkCosts, comm: CommTimes, w: Workload, ov: Overlap,
                 gather_layers: bool = True, gather_root: bool = True, lead_s: Optional[float] = None) -> UnitSim:
    """F of one micro-batch through ``chunk`` (module docstring); ``gather_layers`` /
    ``gather_root``: whether this pass finds the layers' / the root's FSDP units sharded;
    ``lead_s``: they were all-gathered by torch's window UNSHARD, issued that many seconds before
    the pass (:mod:`~meshplan.schedule.window_unshard`; None: gathered in the pass)."""
    return simulate(lambda s: _forward(s, chunk, gather_layers, gather_root, lead_s), comm, w, ov)


def _forward(s: StreamSim, chunk: ChunkCosts, gather_layers: bool, gather_root: bool, lead_s: Optional[float]) -> None:
    """:func:`forward_unit`'s issue order on ``s``."""
    comm, w, ov = s.c, s.w, s.ov
    if lead_s is not None and gather_layers:
        unshard_chunk(s, chunk, "forward", lead_s, gather_root)
        gather_layers = gather_root = False
    n = len(chunk.layers)
    emb_g, head_g = root_groups(comm)
    # the embedding's own unit (torchtitan) reshards after forward as the layers do
    gather_emb = gather_layers if ("shard", emb_g, "backward", "all-gather") in comm.t else gather_root
    root_ag = lambda g, on: s.comm("shard", "forward", "all-gather", f"fsdp AG {g}", g) if on else None
    if chunk.batch is not None:  # get_batch's tp broadcasts are NCCL collectives: on tp, exposed there (calib37),
        # one event per row of the table (comm.tp_rows.get_batch_rows), the compute less their op's seconds
        bcast = sum(o.seconds for o in chunk.batch.ops if o.name == BATCH_BROADCASTS and o.phase == "forward")
        evs = [s.comm("tp", "forward", "broadcast", f"{BATCH_BROADCASTS} ({g})", g)
               for g in (CORE_KEY_BYTES if w.megatron_core else BROADCAST_GROUPS)]  # core: one per tensor
        s.compute("get_batch and timers", chunk.batch.seconds("forward") - bcast, after=tuple(e for e in evs if e))
    if chunk.engine is not None and chunk.engine.seconds("forward"):
        s.compute("DeepSpeed pipe: input rebuilt, output partitioned", chunk.engine.seconds("forward"))
    if chunk.embed is not None:
        s.compute("embedding", chunk.embed.seconds("forward") + (comm.host.get((emb_g, "forward"), 0.0)
                                                                 + comm.copies.get((emb_g, "all-gather"), 0.0)
                                                                 if gather_emb else 0.0), [root_ag(emb_g, gather_emb)])
        # Megatron 2022 all-reduces it under SP too, Megatron Core reduce-scatters it without learned positions
        op = "all-reduce" if w.megatron_ops and not w.embed_reduce_scatter else tp_collectives(w)[1]
        s.compute("embedding tp wait", 0.0, [s.comm("tp", "forward", op, f"tp {op}")])
    gather = lambda i, part: _layer_gather(s, "forward", i, part) if gather_layers else None
    pf = LayerPrefetch(gather, list(range(n)), ov.fsdp_ahead if ov.fsdp_prefetch else 0.0,
                       slide=ov.fsdp_slide)
    pf.start(ov.fsdp_start[0] if ov.fsdp_start and chunk.embed is not None else None)  # none without layers
    # the routed experts' own unit (efsdp): prefetched beside the next layer's, the chunk's first
    # layer's on demand (module docstring)
    experts = _ExpertGathers(lambda i: s.comm("shard", "forward", "all-gather", f"efsdp AG L{i}", "expert")
                             if chunk.moe[i] and gather_layers else None)
    ag = None
    for i, (c, moe) in enumerate(zip(chunk.layers, chunk.moe)):
        ags = pf.need(i)
        ag_e = experts.need(i)
        s.compute(f"L{i}", comm.host.get(("layer", "forward"), 0.0) + comm.copies.get(("layer", "all-gather"), 0.0)
                  + (comm.copies.get(("expert", "all-gather"), 0.0) if moe else 0.0) if gather_layers else 0.0,
                  [*ags, ag_e])
        pf.after(i)
        if ov.fsdp_prefetch and i + 1 < n:
            experts.prefetch(i + 1)
        if ov.fsdp_prefetch and i + 1 == n and chunk.head is not None and head_g == "root_head":
            ag = root_ag(head_g, gather_root)  # the head's unit, prefetched behind the last layer
        forward_layer(s, c, moe)
        s.host_pace(f"L{i}", w.dtensor_host_s[0])
    if chunk.head is not None:
        pre = s.comm("tp", "forward", "all-gather", "tp all-gather (head)") if w.sp else None
        if head_g == "root_head":
            root = ag if ov.fsdp_prefetch and n else root_ag(head_g, gather_root)
        else:
            root = root_ag(head_g, gather_root) if chunk.embed is None else None
        s.compute("head", chunk.head.seconds("forward") + (comm.copies.get((head_g, "all-gather"), 0.0)
                                                           if root is not None else 0.0), [pre, root])
        s.compute("loss tp wait", 0.0, [s.comm("tp", "loss", "all-reduce", "tp loss collectives", seconds=comm.loss_s)])


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


def block_backward_issue_s(w: Workload, c: Cost) -> float:
    """The host's seconds to issue one block's backward under eager DTensor TP
    (:attr:`~meshplan.compute.ops.Workload.dtensor_host_s`): its backward's, plus its forward's
    when the block replays its forward first (checkpointed: full, per-layer or op-level AC).
    A zero-bubble input-gradient pass ("Bx") is charged the whole backward's (the measurement's
    backward held both; an upper bound), its weight-gradient pass ("W") nothing."""
    fwd, bwd = w.dtensor_host_s
    return bwd + (fwd if w.recompute in ("full", "layer", "op") and any_recompute(c) else 0.0)


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
    ``lead_s``: as :func:`forward_unit`'s (B and Bx only)."""
    args = (kind, chunk, last_grad_unit, gather, reduce, deferred, stage_last, gather_root, lead_s)
    return simulate(lambda s: _backward(s, *args), comm, w, ov)


def _backward(s: StreamSim, kind: str, chunk: ChunkCosts, last_grad_unit: bool, gather: bool, reduce: bool,
              deferred: bool, stage_last: bool, gather_root: bool, lead_s: Optional[float]) -> None:
    """:func:`backward_unit`'s issue order on ``s``."""
    comm, w, ov = s.c, s.w, s.ov
    with_b, with_w = kind in ("B", "Bx"), kind in ("B", "W")
    if lead_s is not None and with_b and gather:
        unshard_chunk(s, chunk, "backward", lead_s, gather_root)
        gather = gather_root = False
    red_w = with_w and reduce and not deferred
    n = len(chunk.layers)
    emb_g, head_g = root_groups(comm)
    # the embedding's own unit, resharded after forward (torchtitan), is gathered again
    embed_ag = (lambda: s.comm("shard", "backward", "all-gather", f"fsdp AG {emb_g}", emb_g)) \
        if chunk.embed is not None and ("shard", emb_g, "backward", "all-gather") in comm.t and with_b and gather \
        else None
    emb_ev = None
    pieces = reduce_pieces(comm, n, last_grad_unit, ov.grad_reduce) if with_w else [0.0] * n
    gather_ = lambda i, part: _layer_gather(s, "backward", i, part) if with_b and gather else None
    # the routed experts' group (efsdp), resharded after forward as the layer's: gathered again,
    # prefetched beside the layer's, the chunk's last layer's by the head's pre-backward with it
    # (module docstring; on demand without the head's own unit)
    experts = _ExpertGathers(lambda i: s.comm("shard", "backward", "all-gather", f"efsdp AG L{i}", "expert")
                             if with_b and gather and chunk.moe[i] else None)
    # the head's own unit (torchtitan, every pp): its pre-backward prefetches the last layer
    # before the head's backward runs (FSDP2's backward prefetch in post-forward order), ahead of
    # the head's reduce-scatter on the FSDP stream
    early = ov.fsdp_prefetch and chunk.head is not None and head_g == "root_head" and n > 0
    # the head's unit resharded after forward (training.reshard_head_after_forward, torchtitan's
    # "always"; ``gather_root``: this pass finds it sharded): its pre-backward all-gathers it
    # first, then prefetches the last layer; its copy-out precedes the head's backward
    head_ag = s.comm("shard", "backward", "all-gather", f"fsdp AG {head_g}", head_g) \
        if chunk.head is not None and with_b and gather_root \
        and ("shard", head_g, "backward", "all-gather") in comm.t else None
    pf = LayerPrefetch(gather_, list(reversed(range(n))), ov.fsdp_ahead if ov.fsdp_prefetch else 0.0,
                       slide=ov.fsdp_slide)
    if early:
        pf.start(ov.fsdp_start[1] if ov.fsdp_start and chunk.head is not None else None)
        experts.prefetch(n - 1)  # in the last layer's unit (torchtitan b5bcd76): prefetched with it
    if head_ag is not None:
        s.compute(f"{head_g} copy-out", comm.copies.get((head_g, "all-gather"), 0.0), [head_ag])
    if chunk.head is not None and with_b and with_w and ov.tp_grad:
        _head_backward(s, chunk.head)
    elif chunk.head is not None:
        s.compute("head grad", (chunk.head.seconds("backward_input") if with_b else 0.0)
                  + (chunk.head.seconds("backward_weight") if with_w else 0.0))
        if with_b:
            s.compute("head tp wait", 0.0, [s.comm("tp", "backward", tp_collectives(w)[1], f"tp {tp_collectives(w)[1]} (head)")])
        if red_w and (head_g == "root_head" or chunk.embed is None):  # one root unit: reduced after the embedding
            unit_reduce(s, head_g, head_g, 0.0)
    if not early:
        pf.start(ov.fsdp_start[1] if ov.fsdp_start and chunk.head is not None else None)
    for i in reversed(range(n)):
        c, moe = chunk.layers[i], chunk.moe[i]
        ags = pf.need(n - 1 - i)
        ag_e = experts.need(i)
        # FSDP2's copy-out follows an all-gather only: none where the table has no backward one
        # (reshard_after_forward false keeps the forward's unsharded parameters)
        s.compute(f"L{i}", comm.host.get(("layer", "backward"), 0.0)
                  + (comm.copies.get(("layer", "all-gather"), 0.0) if ags else 0.0)
                  + (comm.copies.get(("expert", "all-gather"), 0.0) if ag_e is not None else 0.0)
                  if with_b and gather else 0.0, [*ags, ag_e])
        pf.after(n - 1 - i)
        if ov.fsdp_prefetch and i > 0:
            experts.prefetch(i - 1)
        if i == 0 and embed_ag is not None and ov.fsdp_prefetch:
            emb_ev = embed_ag()  # FSDP2's backward prefetch: the embedding's unit after the first layer
        ds = with_b and red_w and ds_placed(s, moe)  # DeepSpeed ZeRO-3 2021: its reductions in the layer
        if ds:
            ds_backward_layer(s, c, f"L{i}")
        elif with_b:
            backward_layer(s, c, moe, with_w)
            s.comm("tp", "backward", "all-reduce", f"tp norm-grad all-reduce L{i}", seconds=comm.async_s)
            s.host_pace(f"L{i}", block_backward_issue_s(w, c))
        else:
            s.compute(f"L{i} W", c.seconds("backward_weight"))
        if with_w and not ds:
            unit_reduce(s, f"L{i}", "layer", pieces[n - 1 - i], red_w)
            if moe and red_w:
                unit_reduce(s, f"L{i} experts", "expert", 0.0)
    if chunk.embed is not None and with_b and chunk.embed.seconds("backward_input"):
        # the embedding's own input-gradient ops (Megatron-LM: its dropout's backward, on the
        # rank's sequence shard under SP, before the split's backward gathers the gradient)
        s.compute("embedding dropout grad", chunk.embed.seconds("backward_input"))
    if chunk.embed is not None and with_b and w.sp:  # the gradient of the embedding's reduce-scatter
        s.compute("embedding tp wait", 0.0, [s.comm("tp", "backward", "all-gather", "tp all-gather (embedding)")])
    if chunk.batch is not None and with_b:
        s.compute("timers", chunk.batch.seconds("backward_input"))
    if chunk.engine is not None and with_b and chunk.engine.seconds("backward_input"):
        s.compute("DeepSpeed pipe: output and grad rebuilt, fp32 grad accumulation", chunk.engine.seconds("backward_input"))
    if embed_ag is not None and not with_w:  # Bx (ZB): the embedding's pre-backward gathers it
        ag_e = emb_ev if emb_ev is not None else embed_ag()
        s.compute("embedding unshard", comm.copies.get((emb_g, "all-gather"), 0.0) if ag_e is not None else 0.0,
                  [ag_e])
    if chunk.embed is not None and with_w:
        ag_e = emb_ev if emb_ev is not None or embed_ag is None else embed_ag()
        s.compute("embedding grad", chunk.embed.seconds("backward_weight")
                  + (comm.host.get((emb_g, "backward"), 0.0) if red_w else 0.0)
                  + (comm.copies.get((emb_g, "all-gather"), 0.0) if ag_e is not None else 0.0), [ag_e])
        if red_w:
            unit_reduce(s, emb_g, emb_g, 0.0)
    if deferred and with_w and reduce:
        perform_reduce_grad(s, chunk, tail=stage_last)
    if comm.bucket_wait and s.reduced is not None and ov.grad_reduce:  # DeepSpeed's epilogue synchronize()
        s.compute("DeepSpeed epilogue synchronize", 0.0, [s.reduced])


