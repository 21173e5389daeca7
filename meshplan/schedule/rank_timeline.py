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
  :func:`meshplan.spec.axes.moe_tp.moe_mlp_tp_ops`): none where the routed experts issue nothing over
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

This module builds the forward units (:func:`forward_unit`) and the layers' FSDP gathers both
passes share (:func:`layer_gather`, :class:`ExpertGathers`); :mod:`~meshplan.schedule.backward_pass`
the backward units (:func:`~meshplan.schedule.backward_pass.backward_unit`). Both place the
embedding, the head and the FSDP root units; the rest lives beside them:
:mod:`~meshplan.schedule.comm_times` (the rows' kinds and seconds per call),
:mod:`~meshplan.schedule.unit_sim` (the stream simulation), :mod:`~meshplan.schedule.layer_timeline`
(a layer's blocks and their TP, CP, EP collectives), :mod:`~meshplan.schedule.deepspeed_layer`
(DeepSpeed ZeRO-3 of 2021's layer backward), :mod:`~meshplan.schedule.grad_reduce` (the gradient
reductions' placement).
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.batch_input import BATCH_BROADCASTS, BROADCAST_GROUPS, CORE_KEY_BYTES
from meshplan.compute.ops import Workload
from meshplan.schedule.comm_times import CommTimes, root_groups
from meshplan.schedule.layer_prefetch import LayerPrefetch
from meshplan.schedule.layer_timeline import forward_layer, tp_collectives
from meshplan.schedule.unit_sim import ChunkCosts, Overlap, UnitSim, StreamSim, simulate
from meshplan.schedule.window_unshard import unshard_chunk


def layer_gather(s: StreamSim, phase: str, i: int, part: float):
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


class ExpertGathers:
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
    gather = lambda i, part: layer_gather(s, "forward", i, part) if gather_layers else None
    pf = LayerPrefetch(gather, list(range(n)), ov.fsdp_ahead if ov.fsdp_prefetch else 0.0,
                       slide=ov.fsdp_slide)
    pf.start(ov.fsdp_start[0] if ov.fsdp_start and chunk.embed is not None else None)  # none without layers
    # the routed experts' own unit (efsdp): prefetched beside the next layer's, the chunk's first
    # layer's on demand (module docstring)
    experts = ExpertGathers(lambda i: s.comm("shard", "forward", "all-gather", f"efsdp AG L{i}", "expert")
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
