"""Rank timeline of one pipeline unit: the forward (F), backward (B, input gradient), or
weight-gradient (W) pass of one micro-batch through one chunk of layers, as an event
simulation over a compute stream and one stream per collective kind (``tp``, ``cp``,
``ep``, ``fsdp``, ``efsdp``, ``dp_replicate``, ``dp``), and one per registered axis that
declares where its rows run (:attr:`~meshplan.spec.axes.base.AxisDef.timeline`, below).

Op times come from :mod:`meshplan.compute.ops` (per block of a layer), collective times from
the plan's collective rows (``CollectiveRow.time_s`` per call, kinds by :func:`comm_kind`;
per-layer counts follow the conventions below, not the rows' counts). Dependencies, as the
frameworks issue them:

- **TP**, per layer forward: ``norm (AG) attention-block (RS|AR) add+norm (AG) mlp-block
  (RS|AR) add`` (AG/RS with sequence parallel, AR without; Korthikanti et al. 2022 4.2.2).
  A collective blocks the next compute unless ``Overlap.tp``: then a block's collectives
  run during its GEMMs (block time = max(compute, communication), an ideal decomposition),
  except under ``training.tp_comm_overlap`` with SP (``Workload.async_tp``): there the fused
  all-gather + column-parallel GEMMs and row-parallel GEMM + reduce-scatter run as the runtime
  decomposes them (:mod:`meshplan.compute.asynctp`, :meth:`_Sim.fused`; forward blocks without
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
  collectives; torch's not the MLP's closing one, :func:`replay_scatters`);
  torchtitan's per-layer AC does so in its checkpointed layers, its op-level AC re-runs the
  forward ops it did not save, with each block's all-gather but not its reduce-scatter (whose
  output it saved; the row-parallel GEMM replayed, if at all, as a plain GEMM).
  torchao's float8 tensorwise TP: the amax all-reduces of a block's casts of tp shards
  (:mod:`meshplan.compute.float8`) block one after the other before the block (forward and its
  replay: the attention's 2, the MLP's 2; backward: the MLP's 3, the attention's 4 per Llama layer).
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
  backward, as the table counts it).
- **EP**: the dispatch all-to-all blocks the expert block; the combine follows it.
- **FSDP** (zero3/hsdp): the all-gather of the next layer is issued when a layer starts
  (``Overlap.fsdp_prefetch``, FSDP2's default prefetch of one layer; otherwise issued when
  needed); a layer's gradient reduce-scatter is issued after its weight gradients and runs
  during the next layer's backward (``Overlap.grad_reduce``; otherwise it blocks); HSDP
  all-reduces the shard over dp_replicate after it. With pp > 1 a pass gathers only when it
  finds its chunk sharded (:func:`meshplan.comm.collectives.fsdp_gather_flags`: with
  ``reshard_after_forward = false`` once per step and chunk) and reduces only on the chunk's
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
  for them (:func:`_ds_backward_layer`; with tp > 1 or MoE, as one unit's, waited for at once);
  their host time (partition views, list copies issued, the zero fill waited for) runs on the
  compute stream at the layer's start (``CommTimes.host``); the persistent parameters' gather
  ends the step.
- **ZeRO-1, DDP**: on a chunk's last gradient unit the per-step reduction is issued in
  per-layer pieces (buckets) after each layer's weight gradients (``Overlap.grad_reduce``);
  DDP with fewer buckets than layers issues each bucket once its layers are done
  (:func:`reduce_pieces`). **ZeRO-2**: every gradient unit issues its micro-batch's bucket
  reduce-scatters the same way (overlapped under ``Overlap.grad_reduce``, else each blocks).
  **DeepSpeed ZeRO-1/2** (``training.zero12_engine``, :mod:`meshplan.comm.deepspeed_zero12`):
  its bucket all-reduces are placed as ZeRO-2's (zero2) or ZeRO-1's (zero1), overlapped only
  under ``training.overlap_comm`` (else on the compute stream: each blocks, and zero1's run
  after the last backward), where each piece first waits for the previous one and the unit
  ends waiting for the last (``CommTimes.bucket_wait``). As ZeRO-2's, the pieces follow the
  layers (:func:`reduce_pieces`): the embedding's and output layer's buckets are spread over
  them, not placed at the ends (the exposed sum without overlap is the same).
- **A registered axis with a timeline** (not built-in: :func:`timeline_axes`): its rows run
  on its own stream (the timeline's ``stream``, default the axis's name), one call per
  layer for each :class:`~meshplan.spec.axes.base.Slot` of the pass's phase, at the slot's
  place: ``before`` / ``after`` the attention or MLP block (in the backward, around that
  block's backward; the compute waits for it) or ``overlapped`` after the layer's pass
  (nothing waits). Seconds per call: the row's of that phase and op. A checkpoint's replay
  places none. Its rows of a (phase, op) no slot names are reported as not simulated.

A unit's duration is its compute-stream end; communication still running then is its
``tail`` (it overlaps the next unit; contention between units on a stream is ignored).
Exposed communication of a stream = time the compute stream waited on it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from meshplan.comm.collectives import (DROPLESS_COUNTS, FLOAT8_AMAX_CADENCE, FLOAT8_PRECOMPUTE_CADENCE,
                                      SCATTER_GATHER_CADENCE, ZERO2_CADENCE)
from meshplan.comm import deepspeed
from meshplan.comm.deepspeed import CADENCE as DEEPSPEED_CADENCE
from meshplan.comm.deepspeed_zero12 import CADENCE as DEEPSPEED_BUCKET_CADENCE
from meshplan.compute import asynctp, float8
from meshplan.compute.megatron import COMM_DELAY_OPS
from meshplan.compute.ops import Cost, Workload
from meshplan.mesh.tpsplit import KV_REPLICA
from meshplan.pipeline.simulate import Event
from meshplan.spec.axes.base import At, Block, Slot, Timeline
from meshplan.spec.axes.registry import AXES, Axis

LAYER_BLOCKS = ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post")


@dataclass(frozen=True)
class Overlap:
    """Which communication overlaps compute (module docstring)."""

    tp: bool = False
    tp_grad: bool = False
    fsdp_prefetch: bool = True
    grad_reduce: bool = True
    param_gather: bool = False


#: Groups whose rows the timeline places by hand (the built-in axes, and the derived groups
#: their rows run over, by the name the table shows).
BUILT_IN_GROUPS = frozenset(map(str, (Axis.PP, Axis.DP_REPLICATE, Axis.DP, Axis.DP_SHARD, Axis.CP, Axis.TP,
                                      Axis.EP))) | {"fsdp", "efsdp", "loss", KV_REPLICA}

#: Streams and kinds of the hand-placed collectives (:func:`comm_kind`), which a registered
#: axis's stream may not reuse (its kind is its stream's name).
BUILT_IN_STREAMS = frozenset({"compute", "tp", "tp_async", "loss", "cp", "ep", "pp", "pp_gather", "shard", "replica",
                              "step", "fsdp", "efsdp", "dp_replicate", "dp", "kv", "float8_step", "other"})


def timeline_axes() -> dict[str, Timeline]:
    """``{axis name: its Timeline}`` of every registered axis (:data:`~meshplan.spec.axes.registry.AXES`,
    read at each call) that declares one, its ``stream`` filled in (default the axis's name).
    A built-in axis keeps its hand-written placement and declares none; a stream that is a
    built-in one is refused (ValueError: a registration error, not a user's).

    >>> timeline_axes()
    {}
    """
    out: dict[str, Timeline] = {}
    for name, a in AXES.items():
        if a.timeline is None:
            continue
        stream = a.timeline.stream or str(name)
        if str(name) in BUILT_IN_GROUPS or stream in BUILT_IN_STREAMS:
            raise ValueError(f"axis {name}: a timeline needs an axis and stream the rank timeline does not place by "
                             f"hand (stream {stream!r}; built-in: {', '.join(sorted(BUILT_IN_STREAMS))})")
        out[str(name)] = Timeline(a.timeline.slots, stream)
    return out


def simulated_groups() -> frozenset[str]:
    """Groups whose rows the timeline places: :data:`BUILT_IN_GROUPS` and every registered
    axis with a timeline (:func:`timeline_axes`); any other axis's rows are reported as not
    simulated (:attr:`CommTimes.other`), never filed under a built-in stream by their op.

    >>> sorted(simulated_groups())
    ['cp', 'dp', 'dp_replicate', 'dp_shard', 'efsdp', 'ep', 'fsdp', 'kv_replica', 'loss', 'pp', 'tp']
    """
    return BUILT_IN_GROUPS | frozenset(timeline_axes())


def _placed(row) -> Optional[str]:
    """The stream of a row of a registered axis with a timeline when a slot names its phase
    and op, else None."""
    tl = timeline_axes().get(row.axis)
    if tl is None or not any((x.phase, x.op) == (row.phase, row.op) for x in tl.slots):
        return None
    return tl.stream


def comm_kind(row) -> str:
    """Kind of a collective row: ``tp`` (blocking, per layer), ``tp_async`` (tp, overlapped:
    the Partial gradients of weights replicated over tp: SP norms, an MoE router, MLA's down
    projections and latent norms), ``loss`` (tp, at the loss: vocab-parallel loss or logits),
    ``cp``, ``ep``, ``pp``, ``pp_gather`` (tp, rebuilding a pp receive: Megatron's
    scatter/gather), ``shard`` (FSDP units), ``replica`` (HSDP), ``step`` (per step),
    ``kv`` (the per-step, per-layer all-reduces of replicated KV heads' gradients, axis
    ``kv_replica``: one step-end event each, before the optimizer),
    the stream of a registered axis with a timeline (its name by default) when one of its
    slots names the row's phase and op, or ``other`` (not understood: the caller reports it).
    Decided by phase, op and axis first, then by the cadence text (``K``/``dK`` for cp,
    ``norm``, ``logits``); ``float8_step``: the per-step all-reduce of torchao's float8 precompute
    (a step-end event after the optimizer). A row over an axis the timeline has no stream for (not in
    :func:`simulated_groups`: an axis registered with its own rows,
    :attr:`~meshplan.spec.axes.base.AxisDef.rows`, and no timeline) is ``other``."""
    c = row.cadence
    if row.axis == KV_REPLICA:
        return "kv"
    if row.axis not in BUILT_IN_GROUPS:
        return _placed(row) or "other"
    if c == FLOAT8_PRECOMPUTE_CADENCE:  # after the optimizer step, before the next step's gathers
        return "float8_step"
    if row.phase == "step" or "(DDP" in c or ZERO2_CADENCE in c or DEEPSPEED_BUCKET_CADENCE in c:
        # DDP, ZeRO-2, DeepSpeed ZeRO-1/2: issued in backward, bucketed
        return "step"
    if row.op == "send/recv":
        return "pp"
    if SCATTER_GATHER_CADENCE in c:
        return "pp_gather"
    if row.op == "all-to-all" or c == DROPLESS_COUNTS:  # Megatron-LM's count exchange is an all-gather
        return "ep"
    if row.axis == Axis.DP_REPLICATE or c.endswith("(HSDP replicas)"):
        return "replica"
    if row.axis == Axis.TP:
        if row.phase == "loss" or "logits" in c or "loss" in c:
            return "loss"
        return "tp_async" if "norm" in c or "weight gradient" in c else "tp"
    if "(K and V)" in c or "(dK and dV)" in c:
        return "cp"
    if row.op in ("all-gather", "reduce-scatter") and row.phase in ("forward", "backward"):
        return "shard"
    if DEEPSPEED_CADENCE in c and row.op == "all-reduce" and row.phase == "backward":
        return "shard"  # DeepSpeed ZeRO-3 of 2021: its gradient buckets' all-reduces, the unit's reduction
    return "other"


#: Timeline group of each FSDP root unit label (:func:`meshplan.comm.collectives._units`): one
#: root, or the embedding's unit and the [norm, output] unit apart (torchtitan, a V).
ROOT_GROUPS = {"root (embedding)": "root_embed", "root (norm/output)": "root_head"}


#: Group of the tp rows that move float8 (the layers' all-gathers under torchao's float8 TP:
#: :func:`meshplan.compute.dtensor_sp.float8_tp`); the embedding's and head's keep "".
FLOAT8_TP = "float8"


#: Group of the tp all-reduces of float8 amaxes (:data:`meshplan.comm.collectives.FLOAT8_AMAX_CADENCE`).
FLOAT8_AMAX = "float8 amax"


def _row_group(kind: str, row) -> str:
    """The group a row's seconds are kept under in :attr:`CommTimes.t`."""
    if kind in ("shard", "replica"):
        return _shard_group(row.cadence)
    if kind == "tp" and row.cadence == FLOAT8_AMAX_CADENCE:
        return FLOAT8_AMAX
    if kind == "ep" and row.cadence == DROPLESS_COUNTS:  # kept apart from the dispatch, placed before it
        return "counts"
    return FLOAT8_TP if kind == "tp" and row.dtype == "fp8" else ""


def _shard_group(cadence: str) -> str:
    if "root" in cadence:
        return next((g for label, g in ROOT_GROUPS.items() if label in cadence), "root")
    return "expert" if ("expert" in cadence or "MoE" in cadence) else "layer"


@dataclass
class CommTimes:
    """Seconds per call of one stage's collectives keyed (kind, group, phase, op); group is
    "layer", "expert", "root" (one root unit), "root_embed" or "root_head" (the embedding's
    and [norm, output]'s units apart, :data:`ROOT_GROUPS`) for shard/replica rows. ``loss_s``: seconds of the loss
    collectives per micro-batch; ``async_s``: per-layer overlapped tp collectives (norm
    weight gradients); ``step_reduce_s``/``step_gather_s``: per-step ZeRO-1/2 or DDP
    collectives; ``p2p_s``: one pp send; ``p2p_gather_s``: the tp all-gather after each pp
    receive under Megatron's scatter/gather (0 without); ``other``: rows not understood (not simulated);
    ``layers``: the stage's layers over all its chunks (each chunk's last gradient unit
    issues its layers' pieces of the per-step reduction); ``slots``: (stream, slot) of the
    registered axes with a timeline whose rows the stage has (:func:`timeline_axes`), each
    call's seconds under (stream, "", phase, op) in ``t``; ``host``: (group, phase) -> host
    seconds per unit of DeepSpeed ZeRO-3's list-based calls (``CollectiveRow.host_s``), run on
    the compute stream before the unit's compute; ``kv_s``/``kv_calls``: seconds of one
    all-reduce of a layer's replicated K/V gradients and how many per step (step-end events);
    ``copies``: (group, op) -> compute-stream seconds of FSDP2's copy-out after one all-gather
    of the group's unit and its copy-in before one reduce-scatter (``CollectiveRow.copy_s``,
    :mod:`meshplan.comm.fsdp2`;
    the largest unit's when a group has units of several sizes); ``ddp_buckets``: DDP's gradient
    buckets per step (rows of cadence "(DDP"), which place the per-step reduction's pieces
    (:func:`reduce_pieces`); ``gather_buckets``: calls of the per-step parameter all-gather
    (Megatron-LM's buckets under ``training.overlap_grad_reduce``, else 1), of which the next
    forward waits for the first under ``Overlap.param_gather``; ``mb_reduce_s``/``mb_buckets``: seconds and buckets of one
    micro-batch's ZeRO-2 reduce-scatters (rows of cadence :data:`ZERO2_CADENCE`) or DeepSpeed
    ZeRO-2 all-reduces, issued by every gradient unit (DeepSpeed ZeRO-1's per-step all-reduces
    count in ``step_reduce_s`` and ``ddp_buckets``); ``bucket_wait``: the reductions are
    DeepSpeed ZeRO-1/2's (:mod:`meshplan.comm.deepspeed_zero12`), which under ``overlap_comm``
    make the compute stream wait for the previous bucket's all-reduce before it issues the next
    and for the last at the backward's end (``synchronize()``)."""

    t: dict = field(default_factory=dict)
    share: dict = field(default_factory=dict)
    loss_s: float = 0.0
    async_s: float = 0.0
    step_reduce_s: float = 0.0
    step_gather_s: float = 0.0
    p2p_s: float = 0.0
    p2p_gather_s: float = 0.0
    other: tuple = ()
    layers: int = 1
    slots: tuple[tuple[str, Slot], ...] = ()
    host: dict = field(default_factory=dict)
    kv_s: float = 0.0
    kv_calls: int = 0
    #: the per-step all-reduce of the float8 weights' amaxes (torchao's precompute, after the optimizer)
    float8_step_s: float = 0.0
    #: its second all-reduce, over tp (tp > 1: the amaxes are Partial over tp too)
    float8_tp_step_s: float = 0.0
    copies: dict = field(default_factory=dict)
    ddp_buckets: int = 0
    gather_buckets: int = 0
    mb_reduce_s: float = 0.0
    #: the collectives of the per-step / per-micro-batch gradient reduction's rows ("all-reduce" for
    #: DDP and DeepSpeed's buckets, "reduce-scatter" for Megatron-LM's ZeRO-1/2): the one of them is
    #: named in its events so the step's collective list shows them (linkload._op_of), none when
    #: there are several (:attr:`step_reduce_op`)
    step_reduce_ops: frozenset[str] = frozenset()
    mb_buckets: int = 0
    bucket_wait: bool = False
    #: the collective of the shard units' gradient reduction: "all-reduce" for DeepSpeed ZeRO-3
    #: of 2021's gradient buckets (:func:`meshplan.comm.deepspeed.grad_buckets`), else FSDP's
    shard_reduce_op: str = "reduce-scatter"
    #: DeepSpeed ZeRO-3 of 2021's gradient reductions by the module whose hook flushes their
    #: bucket: (group, module) -> (seconds, buckets) per unit (:func:`_ds_backward_layer`)
    ds_flush: dict = field(default_factory=dict)

    @property
    def step_reduce_op(self) -> str:
        """The gradient reduction's collective when its rows have one (all-reduce or
        reduce-scatter), else "" (none, several, or another op).

        >>> CommTimes(step_reduce_ops=frozenset({"all-reduce"})).step_reduce_op
        'all-reduce'
        >>> CommTimes(step_reduce_ops=frozenset({"all-reduce", "reduce-scatter"})).step_reduce_op
        ''
        """
        (op,) = self.step_reduce_ops if len(self.step_reduce_ops) == 1 else ("",)
        return op if op in ("all-reduce", "reduce-scatter") else ""

    @classmethod
    def from_rows(cls, rows, layers: int = 1, sm_share=None) -> "CommTimes":
        """From a stage's collective rows; ``layers``: transformer layers of the stage;
        ``sm_share``: row -> fraction of the GPU's SMs its NCCL kernel holds while it runs
        (:func:`nccl_sm_share`), kept per key in ``share`` and per kind under (kind,)."""
        c, other = cls(layers=layers), []
        for r in rows:
            kind = comm_kind(r)
            if sm_share is not None and (f := sm_share(r)) > 0:
                op = "reduce-scatter" if kind == "shard" and r.op == "all-reduce" else r.op  # DeepSpeed's buckets
                key = (kind, _row_group(kind, r), r.phase, op)
                c.share[key] = f
                c.share[(kind,)] = max(f, c.share.get((kind,), 0.0))
            ds = DEEPSPEED_BUCKET_CADENCE in r.cadence
            c.bucket_wait = c.bucket_wait or ds
            if kind == "step" and r.op != "all-gather":
                c.step_reduce_ops |= {r.op}
            if kind == "step" and (ZERO2_CADENCE in r.cadence or (ds and r.per_microbatch)):  # one micro-batch's
                c.mb_reduce_s += r.time_s * r.per_microbatch
                c.mb_buckets += r.per_microbatch
            elif kind == "step":  # every call of the row (torch's SP norm gradients: 3 per norm per step)
                if r.op == "all-gather":  # a synchronous call's host time (DeepSpeed ZeRO-3's persistent
                    # gather) runs beside its GPU time: the later of the two ends it
                    c.step_gather_s += max(r.time_s, r.host_s) * max(r.per_step, 1)
                    c.gather_buckets += max(r.per_step, 1)
                else:
                    c.step_reduce_s += r.time_s * max(r.per_step, 1)
                    c.ddp_buckets += max(r.per_step, 1) if "(DDP" in r.cadence or ds else 0
            elif kind == "kv":
                c.kv_s, c.kv_calls = r.time_s, c.kv_calls + r.per_step
            elif kind == "float8_step" and r.axis == Axis.TP:
                c.float8_tp_step_s += r.time_s * max(r.per_step, 1)
            elif kind == "float8_step":
                c.float8_step_s += r.time_s * max(r.per_step, 1)
            elif kind == "pp":
                c.p2p_s = max(c.p2p_s, r.time_s)
            elif kind == "pp_gather":
                c.p2p_gather_s = max(c.p2p_gather_s, r.time_s)
            elif kind == "loss":
                c.loss_s += r.time_s * r.per_microbatch
            elif kind == "tp_async":
                c.async_s += r.time_s * r.per_microbatch / max(layers, 1)
            elif kind == "other":
                other.append(f"{r.axis} {r.phase} {r.op} ({r.cadence})")
            elif kind == "shard" and DEEPSPEED_CADENCE in r.cadence:  # per-parameter calls: their sum per unit
                group = _shard_group(r.cadence)
                # the gradient buckets' all-reduces take the unit's reduction slot (named AR in the timeline)
                op = "reduce-scatter" if r.op == "all-reduce" else r.op
                c.shard_reduce_op = r.op if r.op == "all-reduce" else c.shard_reduce_op
                key, per = (kind, group, r.phase, op), r.per_microbatch / (max(layers, 1) if group == "layer" else 1)
                c.t[key] = c.t.get(key, 0.0) + r.time_s * per
                c.host[(group, r.phase)] = c.host.get((group, r.phase), 0.0) + r.host_s * per
                if deepspeed.FLUSHED in r.cadence:  # a gradient reduction: where its bucket is flushed
                    module = r.cadence.split(deepspeed.FLUSHED)[1].rstrip(")")
                    at = (group, DS_ALIAS.get(module, module))
                    bucket = r.op == "all-reduce" or "first of its bucket" in r.cadence
                    sec, n = c.ds_flush.get(at, (0.0, 0.0))
                    c.ds_flush[at] = (sec + r.time_s * per, n + per * bucket)
            else:
                group = _row_group(kind, r)
                c.t[(kind, group, r.phase, r.op)] = r.time_s
                if kind == "shard" and r.copy_s:
                    c.copies[(group, r.op)] = max(r.copy_s, c.copies.get((group, r.op), 0.0))
        c.other = tuple(other)
        placed = {k[0] for k in c.t} - BUILT_IN_STREAMS
        if placed:
            c.slots = tuple((tl.stream, x) for tl in timeline_axes().values() if tl.stream in placed for x in tl.slots
                            if (tl.stream, "", x.phase, x.op) in c.t)
        return c

    def get(self, kind: str, phase: str, op: str, group: str = "") -> float:
        return self.t.get((kind, group, phase, op), 0.0)

    def sm_share(self, kind: str, phase: str, op: str, group: str = "") -> float:
        """Fraction of the SMs a collective of this key holds (its kind's largest when the key
        has no row: the loss and norm-gradient collectives, the per-step reduction pieces)."""
        return self.share.get((kind, group, phase, op), self.share.get((kind,), 0.0))


#: At most this fraction of the SMs is taken from compute by concurrent collectives.
MAX_SM_SHARE = 0.9


def nccl_sm_share(cluster):
    """row -> fraction of ``cluster.gpu``'s SMs the row's NCCL kernel holds while it runs:
    ``fabric.nccl_channels / gpu.sms`` for collectives on the node's GPU fabric (path
    ``nvlink``), 0 for the rest (NIC paths: channel counts not in the catalog) and where the
    catalog gives no channel count. NCCL runs one thread block per channel, each resident on
    one SM for the whole collective (NVIDIA/nccl-tests issue #100: 24 channels on an HGX A100,
    108 SMs: 22%)."""
    f = cluster.node.fabric.nccl_channels / cluster.gpu.sms
    return lambda row: f if row.path.kind == "nvlink" else 0.0


@dataclass(frozen=True)
class ChunkCosts:
    """Compute of one chunk per micro-batch: a Cost per layer, which are MoE, and the
    embedding (first virtual stage) and head (last virtual stage) Costs or None; ``batch``:
    what the framework runs around every chunk's passes (Megatron-LM 2022's ``get_batch`` and
    timer syncs, :func:`meshplan.compute.ops.megatron_batch_cost`) or None."""

    layers: tuple[Cost, ...]
    moe: tuple[bool, ...]
    embed: Optional[Cost] = None
    head: Optional[Cost] = None
    batch: Optional[Cost] = None


@dataclass(frozen=True)
class UnitSim:
    """One unit's simulated timeline, times from the unit start (seconds)."""

    duration_s: float
    tail_s: float
    exposed_s: dict
    events: tuple[Event, ...]
    tail_stream: str = ""


class _Sim:
    """Streams run tasks in issue order; a task starts when its stream is free and its
    dependencies (``after``) are done. A compute task may ``overlap`` communication: it
    starts no earlier than the first of them starts and ends no earlier than all end."""

    def __init__(self, comm: CommTimes, w: Workload, ov: Overlap):
        self.c, self.w, self.ov = comm, w, ov
        self.free: defaultdict[str, float] = defaultdict(float)
        self.events: list[Event] = []
        self.exposed: defaultdict[str, float] = defaultdict(float)
        self.last: Optional[Event] = None
        self.busy: list[tuple[float, float, float]] = []   # (start, end, SM share) of collectives
        self.memo: dict = {}  # per-Cost sums of this unit (its layers share Cost objects)
        self.reduced: Optional[Event] = None  # the last piece of the gradient reduction issued

    def of(self, fn, c: Cost, *args):
        """``fn(c, *args)`` once per (fn, Cost, args) in this unit: the sums over a layer's ops
        that every layer of the same kind repeats (the chunk's layers share their Cost)."""
        key = (fn, id(c), args)
        if key not in self.memo:
            self.memo[key] = (c, fn(c, *args))  # holds c: its id stays its own
        return self.memo[key][1]

    def _finish(self, start: float, dur: float) -> float:
        """End of ``dur`` seconds of compute from ``start`` while the collectives in ``busy``
        hold their SM shares: the kernel progresses at ``1 - sum of the shares`` (at most
        :data:`MAX_SM_SHARE` taken) while they run, at full rate otherwise."""
        self.busy = [b for b in self.busy if b[1] > start]
        if dur <= 0 or not self.busy:
            return start + dur
        t, left = start, dur
        edges = sorted({x for a, b, _ in self.busy for x in (a, b) if x > start})
        for nxt in edges + [float("inf")]:
            rate = 1.0 - min(MAX_SM_SHARE, sum(f for a, b, f in self.busy if a <= t < b))
            if (nxt - t) * rate >= left:
                return t + left / rate
            left -= (nxt - t) * rate
            t = nxt
        return t  # unreachable: the last segment is unbounded

    def _add(self, stream, name, start, end, args=None) -> Event:
        ev = Event(0, stream, name, start, end, dict(args or {}))
        self.events.append(ev)
        self.free[stream] = end
        return ev

    def compute(self, name: str, dur: float, after=(), overlap=()) -> Event:
        after = [a for a in (self.last, *after) if a is not None]
        ov = [o for o in overlap if o is not None]
        free = self.free["compute"]
        ready = [(a.end_s, a) for a in after] + ([(o.start_s, o) for o in [min(ov, key=lambda o: o.start_s)]] if ov else [])
        start = max([free] + [t for t, _ in ready])
        if start > free:
            binding = max(ready, key=lambda x: x[0])[1]
            if binding.stream != "compute":
                self.exposed[binding.stream] += start - free
        done = self._finish(start, dur)
        end = max([done] + [o.end_s for o in ov])
        for o in ov:
            if o.end_s > start + dur and o.end_s == end:
                self.exposed[o.stream] += end - (start + dur)
                break
        self.last = self._add("compute", name, start, end)
        return self.last

    def comm(self, kind: str, phase: str, op: str, name: str, group: str = "", after=None,
             seconds: Optional[float] = None) -> Optional[Event]:
        t = self.c.get(kind, phase, op, group) if seconds is None else seconds
        if not op or t <= 0:
            return None
        stream = {"shard": "efsdp" if group == "expert" else "fsdp", "replica": "dp_replicate"}.get(kind, kind)
        deps = [a for a in ([self.last] if after is None else after) if a is not None]
        start = max([self.free[stream]] + [a.end_s for a in deps])
        if (f := self.c.sm_share(kind, phase, op, group)) > 0:
            self.busy.append((start, start + t, f))
        return self._add(stream, name, start, start + t, {"kind": kind, "group": group, "phase": phase, "op": op})

    def fused(self, name: str, gemm_s: float, collective_s: float, n: int, reduce_scatter: bool) -> Event:
        """A fused all-gather + GEMM (``reduce_scatter`` False) or GEMM + reduce-scatter of ``n``
        pieces (:mod:`meshplan.compute.asynctp`): the compute stream runs it for
        :func:`~meshplan.compute.asynctp.fused_seconds` of its GEMMs (``gemm_s``, the pieces')
        and one piece's transfer (``collective_s``: the whole collective's model time); the time
        beyond the GEMMs is exposed on "tp". The transfers (``collective_s`` in all) are shown on
        the tp stream from the op's start (all-gather: the local piece first) or after its first
        GEMM piece (reduce-scatter)."""
        fw = self.w.async_tp
        c = asynctp.piece_comm_s(fw, collective_s, self.w.tp, reduce_scatter)
        total = asynctp.fused_seconds(gemm_s, c, n, trail=reduce_scatter and fw == "megatron")
        ev = self.compute(name, total)
        if total > gemm_s:
            self.exposed["tp"] += total - gemm_s
        if collective_s > 0:
            t0 = ev.start_s + (gemm_s / n if reduce_scatter else 0.0)
            self.events.append(Event(0, "tp", f"tp {name} ({n} pieces)", t0, t0 + collective_s,
                                     {"kind": "tp", "group": "", "phase": "", "op": "fused"}))
            self.free["tp"] = max(self.free["tp"], t0 + collective_s)
        return ev

    def finish(self) -> UnitSim:
        end = self.last.end_s if self.last else 0.0
        final = max(self.events, key=lambda e: e.end_s, default=None)
        tail = max(0.0, final.end_s - end) if final else 0.0
        return UnitSim(end, tail, dict(self.exposed), tuple(self.events), final.stream if final and tail else "")


def _gather_group(s: "_Sim", phase: str) -> str:
    """Group of a layer block's tp all-gathers of ``phase``: :data:`FLOAT8_TP` when the stage's
    table has float8 rows for them (torchao's float8 TP, the layers'), else ""."""
    return FLOAT8_TP if ("tp", FLOAT8_TP, phase, "all-gather") in s.c.t else ""


def _tp(w: Workload) -> tuple[str, str]:
    """TP collective before and after a block: (all-gather, reduce-scatter) with SP, else
    ("", all-reduce)."""
    return ("all-gather", "reduce-scatter") if w.sp else ("", "all-reduce")


def _block(s: _Sim, name: str, t: float, phase: str, ep: bool = False, cp: Optional[tuple] = None,
           cp_phase: str = "forward", fused: Optional[dict] = None, scatter: bool = True) -> None:
    """One forward block; ``cp``: the attention's (K/V proj, Q proj, core, out proj) seconds
    under all-gather CP (module docstring); ``fused``: the block's async-TP GEMMs
    (:func:`fused_gemms`), run as their runtime decomposes them (:func:`_fused_block`);
    ``scatter`` False: the block's closing tp collective is not issued (op-level AC's replay)."""
    if fused and cp is None and not ep and ("ag" in fused or ("rs" in fused and scatter)):
        _fused_block(s, name, t, phase, fused, scatter)
        return
    before, after = _tp(s.w)
    pre = s.comm("tp", phase, before, f"tp {before}", _gather_group(s, phase))
    if ep:  # a dropless dispatch's count exchange first (collectives._count_rows)
        n = "all-gather" if ("ep", "counts", phase, "all-gather") in s.c.t else "all-to-all"
        pre = s.comm("ep", phase, n, "ep counts", "counts", after=[pre or s.last]) or pre
        pre = s.comm("ep", phase, "all-to-all", "ep dispatch", after=[pre or s.last]) or pre
    post = s.comm("tp", phase, after, f"tp {after}", after=[s.last]) if s.ov.tp and scatter else None
    tp_ov = [x for x in (pre, post) if x] if s.ov.tp else []
    if cp is None:
        s.compute(name, t, [] if s.ov.tp else [pre], tp_ov)
    else:
        kv, q, core, out = cp
        s.compute(name + " K/V proj", kv, [] if s.ov.tp else [pre])
        ring = s.comm("cp", cp_phase, "all-gather", "cp K/V all-gather", after=[s.last])
        s.compute(name + " Q proj", q)
        s.compute(name + " core", core, [ring])
        s.compute(name + " out proj", out, [], tp_ov)
    if ep:
        s.compute(name + " combine wait", 0.0, [s.comm("ep", phase, "all-to-all", "ep combine")])
    if not s.ov.tp and scatter:
        s.compute(name + " tp wait", 0.0, [s.comm("tp", phase, after, f"tp {after}")])


def _fused_block(s: _Sim, name: str, t: float, phase: str, fused: dict, scatter: bool = True) -> None:
    """A forward block under async TP (:mod:`meshplan.compute.asynctp`): the all-gather fused
    with the column-parallel GEMMs, the block's other ops, the row-parallel GEMM fused with the
    reduce-scatter; ``t``: the block's seconds (pieces' GEMMs and the runtime's copies included).
    ``scatter`` False (op-level AC's replay): no reduce-scatter; a replayed row-parallel GEMM
    runs whole among the block's other ops."""
    ag_s, ag_n = fused.get("ag", (0.0, 0))
    rs_s, rs_n = fused.get("rs", (0.0, 0)) if scatter else (0.0, 0)
    if ag_n:
        s.fused(name + " all-gather+GEMMs", ag_s, s.c.get("tp", phase, "all-gather", _gather_group(s, phase)), ag_n, False)
        s.compute(name, t - ag_s - rs_s)
    else:  # float8 rowwise: the gather blocks as without async TP
        s.compute(name, t - rs_s, [s.comm("tp", phase, "all-gather", "tp all-gather")])
    if scatter and rs_n:
        s.fused(name + " GEMM+reduce-scatter", rs_s, s.c.get("tp", phase, "reduce-scatter"), rs_n, True)
    elif scatter:
        s.compute(name + " tp wait", 0.0, [s.comm("tp", phase, "reduce-scatter", "tp reduce-scatter")])


def fused_gemms(c: Cost, phase: str, recompute: Optional[bool], framework: str, tp: int,
                rowwise: frozenset = frozenset()) -> dict:
    """``{block: {"ag" | "rs": (seconds, pieces)}}`` of the async-TP fused GEMMs among ``c``'s
    ops of ``phase`` and ``recompute`` (a replayed forward GEMM as its forward), summed per side
    (:func:`meshplan.compute.asynctp.pieces`; an all-gather feeds several GEMMs); ``rowwise``:
    the float8 rowwise Linears (``Workload.fp8_rowwise``), whose gathers do not fuse."""
    out: dict = {}
    for o in c.ops:
        if o.kind != "gemm" or o.phase != phase or recompute not in (None, o.recompute):
            continue
        base = o.name.removesuffix(" (recompute)")
        ph = "forward" if o.recompute else phase
        n = asynctp.pieces(framework, tp, base, ph, base.split(".")[0] in rowwise)
        if n:
            side = "rs" if ph == "forward" and base in asynctp.RS_FORWARD else "ag"
            g, _ = out.setdefault(o.block, {}).get(side, (0.0, n))
            out[o.block][side] = (g + o.seconds, n)
    return out


def _block_backward(s: _Sim, name: str, t_b: float, t_w: float, ep=False, cp: Optional[tuple] = None,
                    t_w_row: float = 0.0, t_b_col: float = 0.0, fused: Optional[dict] = None) -> None:
    """One block's backward; ``cp``: the attention's input-gradient seconds (core incl. wo
    and RoPE, Q proj, K/V proj) under all-gather CP (module docstring). ``t_w_row``: the
    weight gradients of the block's row-parallel linear (wo, w_down) and its bias, computed
    with its input gradient at the block's start (one autograd node, before the core);
    ``t_w``: the rest (the column-parallel linears' wgrad); ``t_b_col``: the column-parallel
    linears' input gradients (the end of ``t_b``).

    ``Overlap.tp_grad`` (Megatron-LM): the input-gradient collective is issued after the
    column-parallel input gradients and runs during their weight gradients; with SP their
    input is all-gathered again first, during their input-gradient GEMM. Otherwise (torch):
    the collective is issued after the weight gradients and the next block waits for it;
    ``Overlap.tp`` overlaps it with the weight gradients whatever the framework.
    ``fused``: async TP's gathered output gradient fused with the row-parallel input-gradient
    GEMM (:func:`fused_gemms`, backward side "ag"), the rest of the input gradients after it."""
    before, after = _tp(s.w)
    ag_fused = fused.get("ag") if fused and cp is None and not ep and s.w.sp else None
    g = _gather_group(s, "backward")
    pre = None if ag_fused else s.comm("tp", "backward", before, f"tp {before}", g)
    if ep:
        pre = s.comm("ep", "backward", "all-to-all", "ep combine grad", after=[pre or s.last]) or pre
    regather = s.ov.tp_grad and s.w.sp and not ep and t_w > 0
    ag = None
    if ag_fused:
        s.fused(name + " all-gather+dgrad", ag_fused[0], s.c.get("tp", "backward", before, g), ag_fused[1], False)
        s.compute(name + " B", t_b - ag_fused[0] - (t_b_col if regather else 0.0) + t_w_row)
        if regather:
            ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)")
            s.compute(name + " column B", t_b_col)
    elif cp is None:
        s.compute(name + " B", t_b - (t_b_col if regather else 0.0) + t_w_row, [pre])
        if regather:
            ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)")
            s.compute(name + " column B", t_b_col)
    else:
        core, q, kv = cp
        s.compute(name + " core B", core + t_w_row, [pre])
        rs = s.comm("cp", "backward", "reduce-scatter", "cp dK/dV reduce-scatter", after=[s.last])
        if regather:
            ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)")
        s.compute(name + " Q proj B", q)
        s.compute(name + " K/V proj B", kv, [rs])
    beside = s.ov.tp or s.ov.tp_grad
    if not beside and t_w > 0:
        s.compute(name + " W", t_w)
    post = s.comm("tp", "backward", after, f"tp {after}")
    if ep:
        post = s.comm("ep", "backward", "all-to-all", "ep dispatch grad", after=[post or s.last]) or post
    if beside and t_w > 0:
        s.compute(name + " W", t_w, [ag], [post] if s.ov.tp else [])
    s.compute(name + " grad wait", 0.0, [post])


_CP_PART = {"wk": "kv", "wv": "kv", "wq": "q", "wq_a": "q", "wq_b": "q", "wkv_a": "kv", "wkv_b": "kv"}


def cp_parts(c: Cost, phase: str, recompute: Optional[bool]) -> dict:
    """Seconds of the attention block's ops of ``phase`` by part: ``kv`` (wk, wv, and RoPE and
    torch's repeat_kv in forward; MLA: wkv_a, wkv_b), ``q`` (wq; MLA: wq_a, wq_b), ``out`` (wo in forward), ``core``
    (the rest; in backward also wo's input gradient and RoPE, which precede dK/dV). Op names from :mod:`meshplan.compute.ops`."""
    fwd = phase == "forward" or recompute
    out = dict.fromkeys(("kv", "q", "core", "out"), 0.0)
    for o in c.ops:
        if o.block != "attn" or o.phase != phase or recompute not in (None, o.recompute):
            continue
        base = o.name.split(" ")[0].split(".")[0]
        part = _CP_PART.get(base, "core")
        if fwd and base in ("rope", "repeat_kv", "wo"):
            part = "out" if base == "wo" else "kv"
        out[part] += o.seconds
    return out


_cp_parts = cp_parts


def _times(c: Cost, phase: str, recompute: Optional[bool] = None) -> dict:
    return {b: c.seconds(phase, b, recompute) for b in LAYER_BLOCKS}


#: Input-gradient ops of the column-parallel linears (Megatron's ColumnParallelLinear, torch's
#: ColwiseParallel), op names of :mod:`meshplan.compute.ops`.
COLUMN_PARALLEL_DGRAD = ("wq.dgrad", "wk.dgrad", "wv.dgrad", "w_gate.dgrad", "w_up.dgrad",
                         "wq_b.dgrad", "wkv_b.dgrad",  # MLA's up projections (its down projections are replicated)
                         COMM_DELAY_OPS["backward_input"])  # Megatron's kernel after the re-gather's launch

#: Weight-gradient ops of the row-parallel linears (Megatron's RowParallelLinear, torch's
#: RowwiseParallel) and their biases, op names of :mod:`meshplan.compute.ops`.
ROW_PARALLEL_WGRAD = ("wo.wgrad", "w_down.wgrad", "shared_w_down.wgrad", "wo bias grad", "mlp down bias grad")


def _ops_by_block(c: Cost, phase: str, names: tuple, recompute: Optional[bool] = None) -> dict:
    """Seconds per block of the ops of ``phase`` named in ``names``."""
    out = dict.fromkeys(LAYER_BLOCKS, 0.0)
    for o in c.ops:
        if o.phase == phase and o.name in names and recompute in (None, o.recompute):
            out[o.block] += o.seconds
    return out


def _slots(s: _Sim, phase: Optional[str], at: At, block: Optional[Block] = None) -> None:
    """The calls of the registered axes' slots (:attr:`CommTimes.slots`) of row ``phase``
    at ``at`` ``block``, in registry order, each on its stream after the compute so far;
    the compute waits for a blocking one (its wait is exposed on the stream). ``phase``
    None (a checkpoint's replay): none."""
    if not s.c.slots or phase is None:
        return
    for stream, x in s.c.slots:
        if x.phase == phase and x.at is at and x.block is block:
            ev = s.comm(stream, phase, x.op, f"{stream} {x.op} ({at} {block})" if block else f"{stream} {x.op}")
            if ev is not None and at is not At.OVERLAPPED:
                s.compute(f"{stream} wait", 0.0, [ev])


def _rowwise(w: Workload) -> frozenset:
    """The float8 rowwise Linears of ``w`` (none unless ``fp8_rowwise``)."""
    return w.float8_gemms if w.fp8_rowwise and w.linear_dtype == "fp8" else frozenset()


def replay_scatters(w: Workload, phase: str) -> tuple[bool, bool]:
    """Whether a forward pass of ``phase`` (a replay when not "forward") issues the attention's
    and the MLP's closing TP collective: a replay under op-level AC neither (the policy saved the
    reduce-scatters' outputs), under torch's full AC not the MLP's (its output only feeds the
    next layer: :func:`meshplan.compute.ops.full_ac_not_replayed`), under Megatron-LM's both."""
    if phase == "forward":
        return True, True
    if w.recompute == "op":
        return False, False
    return True, w.megatron_ops


def _amax_calls(c: Cost, side: str, phase: str) -> int:
    """:func:`meshplan.compute.float8.tp_amax_calls` of layer ``c``'s ops."""
    return float8.tp_amax_calls(c.ops, side, phase)


def _amax_wait(s: _Sim, c: Cost, side: str, phase: str) -> None:
    """The blocking tp all-reduces of the float8 amaxes of layer ``c``'s ``side`` ("attn" or
    "mlp") in ``phase`` ("forward", also for a replay; "backward"), one after the other before the
    block (:func:`meshplan.compute.float8.tp_amax_calls`; the cast waits for its scale)."""
    t = s.c.get("tp", phase, "all-reduce", FLOAT8_AMAX)
    n = s.of(_amax_calls, c, side, "forward" if phase == "forward" else "backward_input") if t > 0 else 0
    if n:
        ev = s.comm("tp", phase, "all-reduce", f"tp float8 amax all-reduce x{n}", FLOAT8_AMAX, seconds=n * t)
        s.compute("float8 amax wait", 0.0, [ev])


def _forward_layer(s: _Sim, c: Cost, moe: bool, phase: str = "forward", recompute=None) -> None:
    scatter, scatter_mlp = replay_scatters(s.w, phase)
    t = s.of(_times, c, phase, recompute)
    f = s.of(fused_gemms, c, phase, recompute, s.w.async_tp, s.w.tp, _rowwise(s.w)) if s.w.async_tp and s.w.sp else {}
    own = "forward" if phase == "forward" else None  # the registered axes' slots: not in a replay
    s.compute("norm", t["attn_pre"])
    p = s.of(cp_parts, c, phase, recompute) if s.w.cp > 1 else None
    _slots(s, own, At.BEFORE, Block.ATTN)
    _amax_wait(s, c, "attn", "forward")
    _block(s, "attention", t["attn"], "forward", cp=(p["kv"], p["q"], p["core"], p["out"]) if p else None,
           cp_phase="forward" if phase == "forward" else "backward", fused=f.get("attn"), scatter=scatter)
    _slots(s, own, At.AFTER, Block.ATTN)
    s.compute("add+norm", t["attn_post"] + t["mlp_pre"])
    _slots(s, own, At.BEFORE, Block.MLP)
    _amax_wait(s, c, "mlp", "forward")
    _block(s, "mlp", t["mlp"], "forward", ep=moe, fused=f.get("mlp"), scatter=scatter_mlp)
    _slots(s, own, At.AFTER, Block.MLP)
    s.compute("add", t["mlp_post"])
    _slots(s, own, At.OVERLAPPED)


def _any_recompute(c: Cost) -> bool:
    return any(o.recompute for o in c.ops)


def _backward_layer(s: _Sim, c: Cost, moe: bool, with_w: bool) -> None:
    # a checkpointed layer (full; torchtitan per-layer or op-level AC) replays its forward's
    # recomputed ops, with their collectives, before its backward
    full = s.w.recompute in ("full", "layer", "op") and s.of(_any_recompute, c)
    if full:
        _forward_layer(s, c, moe, "backward_input", True)
    b = s.of(_times, c, "backward_input", False if full else None)
    w = s.of(_times, c, "backward_weight") if with_w else dict.fromkeys(LAYER_BLOCKS, 0.0)
    row = s.of(_ops_by_block, c, "backward_weight", ROW_PARALLEL_WGRAD) if with_w else dict.fromkeys(LAYER_BLOCKS, 0.0)
    col = s.of(_ops_by_block, c, "backward_input", COLUMN_PARALLEL_DGRAD, False if full else None)
    f = s.of(fused_gemms, c, "backward_input", False if full else None, s.w.async_tp, s.w.tp,
             _rowwise(s.w)) if s.w.async_tp else {}
    s.compute("add grad", b["mlp_post"])
    mlp_row = 0.0 if moe else row["mlp"]          # MoE: the experts' own order (dispatch, combine)
    _slots(s, "backward", At.BEFORE, Block.MLP)
    _amax_wait(s, c, "mlp", "backward")
    _block_backward(s, "mlp", b["mlp"], w["mlp"] - mlp_row, ep=moe, t_w_row=mlp_row, t_b_col=col["mlp"],
                    fused=f.get("mlp"))
    _slots(s, "backward", At.AFTER, Block.MLP)
    s.compute("norm+add grad", b["mlp_pre"] + b["attn_post"])
    p = s.of(cp_parts, c, "backward_input", False if full else None) if s.w.cp > 1 else None
    _slots(s, "backward", At.BEFORE, Block.ATTN)
    _amax_wait(s, c, "attn", "backward")
    _block_backward(s, "attention", b["attn"], w["attn"] - row["attn"], cp=(p["core"], p["q"], p["kv"]) if p else None,
                    t_w_row=row["attn"], t_b_col=col["attn"], fused=f.get("attn"))
    _slots(s, "backward", At.AFTER, Block.ATTN)
    s.compute("norm grad", b["attn_pre"])
    _slots(s, "backward", At.OVERLAPPED)


#: A dense layer's backward as DeepSpeed ZeRO-3 of 2021 runs it, module by module in autograd's
#: order (:func:`_ds_backward_layer`): the residual's gradient, the MLP's second linear, the
#: activation, the first linear(s), the MLP norm with the attention's residual, the attention's
#: output projection, the core, the QKV projection(s), the attention norm.
DS_PIECES = ("mlp_post", "w_down", "act", "w_up", "mlp_norm", "wo", "core", "query_key_value", "attn_norm")
#: The pieces whose module DeepSpeed gathers again in backward: its pre-backward ``fetch_sub_module``
#: ends in ``torch.cuda.synchronize()`` (``_synchronize_communication``, v0.3.13 ``stage3.py``
#: lines 483-491, called at line 406): the host waits for every stream, the bucket reductions in
#: flight included. The norms are persistent (never gathered); w_down also without a replay.
DS_FETCHED = ("w_up", "wo", "query_key_value")
#: Parameter modules of torch's layer (separate Q, K, V and gate projections) in the piece that
#: holds their ops.
DS_ALIAS = {"wq": "query_key_value", "wk": "query_key_value", "wv": "query_key_value", "w_gate": "w_up"}


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
    left out under ``full`` recompute): the same ops :func:`_backward_layer` runs."""
    out = dict.fromkeys(DS_PIECES, 0.0)
    for o in c.ops:
        if o.phase == "backward_weight" or (o.phase == "backward_input" and not (full and o.recompute)):
            out[_ds_piece(o.block, o.name)] += o.seconds
    return out


def _ds_placed(s: _Sim, moe: bool) -> bool:
    """Whether a layer's backward places DeepSpeed ZeRO-3 of 2021's bucket reductions where its
    hooks flush them (:func:`_ds_backward_layer`): the stage has them, a dense layer, tp 1 (no
    TP collectives inside the blocks) and no other axis's slots."""
    return any(g == "layer" for g, _ in s.c.ds_flush) and not moe and s.w.tp == 1 and not s.c.slots


def _ds_backward_layer(s: _Sim, c: Cost, name: str) -> None:
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
    full = s.w.recompute in ("full", "layer", "op") and s.of(_any_recompute, c)
    if full:
        _forward_layer(s, c, False, "backward_input", True)
    secs = s.of(_ds_pieces, c, full)
    word = "AR" if s.c.shard_reduce_op == "all-reduce" else "RS"
    last: Optional[Event] = None
    host = s.last  # what the host last waited for: it issues the next flush no earlier
    for piece in DS_PIECES:
        if last is not None and (piece in DS_FETCHED or (piece == "w_down" and not full)):
            host = s.compute(f"{name} {piece} fetch sync (DeepSpeed)", 0.0, [last])
        sec, buckets = s.c.ds_flush.get(("layer", piece), (0.0, 0.0))
        before = last
        ev = s.comm("shard", "backward", "reduce-scatter", f"fsdp {word} {name} ({piece})", "layer",
                    after=[host], seconds=sec)
        last = ev or last
        s.compute(f"{name} {piece} grad", secs[piece])
        wait = (ev if buckets > 1 else before) if ev is not None else None
        if wait is not None:
            s.compute(f"{name} {piece} flush wait (DeepSpeed)", 0.0, [wait])
            host = wait if host is None or wait.end_s > host.end_s else host
    rest = sum(t for (g, m), (t, _) in s.c.ds_flush.items() if g == "layer" and m not in DS_PIECES)
    ev = s.comm("shard", "backward", "reduce-scatter", f"fsdp {word} {name} (elsewhere)", "layer", seconds=rest)
    s.compute(f"{name} reductions wait (DeepSpeed)", 0.0, [ev or last])


def forward_unit(chunk: ChunkCosts, comm: CommTimes, w: Workload, ov: Overlap,
                 gather_layers: bool = True, gather_root: bool = True) -> UnitSim:
    """F of one micro-batch through ``chunk`` (module docstring); ``gather_layers`` /
    ``gather_root``: whether this pass finds the layers' / the root's FSDP units sharded."""
    s = _Sim(comm, w, ov)
    n = len(chunk.layers)
    emb_g, head_g = _root_groups(comm)
    # the embedding's own unit (torchtitan) reshards after forward as the layers do
    gather_emb = gather_layers if ("shard", emb_g, "backward", "all-gather") in comm.t else gather_root
    root_ag = lambda g, on: s.comm("shard", "forward", "all-gather", f"fsdp AG {g}", g) if on else None
    if chunk.batch is not None:
        s.compute("get_batch and timers", chunk.batch.seconds("forward"))
    if chunk.embed is not None:
        s.compute("embedding", chunk.embed.seconds("forward") + (comm.host.get((emb_g, "forward"), 0.0)
                                                                 + comm.copies.get((emb_g, "all-gather"), 0.0)
                                                                 if gather_emb else 0.0), [root_ag(emb_g, gather_emb)])
        op = "all-reduce" if w.megatron_ops else _tp(w)[1]  # Megatron 2022 all-reduces it under SP too
        s.compute("embedding tp wait", 0.0, [s.comm("tp", "forward", op, f"tp {op}")])
    gather = lambda i: s.comm("shard", "forward", "all-gather", f"fsdp AG L{i}", "layer") if gather_layers else None
    ag = gather(0) if ov.fsdp_prefetch and n else None  # a chunk without layers (stage_layers) gathers none
    for i, (c, moe) in enumerate(zip(chunk.layers, chunk.moe)):
        ag = ag if ov.fsdp_prefetch else gather(i)
        ag_e = s.comm("shard", "forward", "all-gather", f"efsdp AG L{i}", "expert") if moe and gather_layers else None
        s.compute(f"L{i}", comm.host.get(("layer", "forward"), 0.0) + comm.copies.get(("layer", "all-gather"), 0.0)
                  + (comm.copies.get(("expert", "all-gather"), 0.0) if moe else 0.0) if gather_layers else 0.0,
                  [ag, ag_e])
        ag = gather(i + 1) if ov.fsdp_prefetch and i + 1 < n else None
        if ov.fsdp_prefetch and i + 1 == n and chunk.head is not None and head_g == "root_head":
            ag = root_ag(head_g, gather_root)  # the head's unit, prefetched behind the last layer
        _forward_layer(s, c, moe)
    if chunk.head is not None:
        pre = s.comm("tp", "forward", "all-gather", "tp all-gather (head)") if w.sp else None
        if head_g == "root_head":
            root = ag if ov.fsdp_prefetch and n else root_ag(head_g, gather_root)
        else:
            root = root_ag(head_g, gather_root) if chunk.embed is None else None
        s.compute("head", chunk.head.seconds("forward") + (comm.copies.get((head_g, "all-gather"), 0.0)
                                                           if root is not None else 0.0), [pre, root])
        s.compute("loss tp wait", 0.0, [s.comm("tp", "loss", "all-reduce", "tp loss collectives", seconds=comm.loss_s)])
    return s.finish()


def _root_groups(comm: CommTimes) -> tuple[str, str]:
    """Timeline groups of the embedding's and the head's FSDP units: "root_embed" and
    "root_head" when the stage's table has them apart, else both "root" (one root unit)."""
    groups = {k[1] for k in comm.t if k[0] == "shard"}
    return ("root_embed" if "root_embed" in groups else "root", "root_head" if "root_head" in groups else "root")


def _reduce(s: _Sim, name: str, group: str, step_piece: float, shard: bool = True) -> None:
    """FSDP reduce-scatter (+ HSDP all-reduce) of a unit when ``shard``; ``step_piece``:
    seconds of this layer's piece (bucket) of the per-step ZeRO-1/2 or DDP reduction."""
    if shard and (copy_in := s.c.copies.get((group, "reduce-scatter"), 0.0)):
        s.compute(f"fsdp RS copy-in {name}", copy_in)  # FSDP2: on the compute stream (comm.fsdp2)
    rs = _reduce_scatter(s, name, group, s.last) if shard else None
    if step_piece and s.c.bucket_wait and s.ov.grad_reduce and s.reduced is not None:
        # DeepSpeed overlap_comm: the compute stream waits for the reduction stream (the
        # previous bucket's all-reduce) before issuing the next (deepspeed_zero12)
        s.compute("bucket wait (DeepSpeed overlap_comm)", 0.0, [s.reduced])
    op = s.c.step_reduce_op
    red = s.comm("dp", "step", "reduce", f"grad reduce: {op} {name}" if op else f"grad reduce {name}",
                 seconds=step_piece) if step_piece else None
    s.reduced = red or s.reduced
    if not s.ov.grad_reduce:
        s.compute("grad reduce wait", 0.0, [rs, red])


def _reduce_scatter(s: _Sim, name: str, group: str, after: Optional[Event]) -> Optional[Event]:
    """A unit's FSDP reduce-scatter issued after ``after`` and its HSDP all-reduce after it:
    the event the gradient is done with (None when the stage has neither)."""
    word = "AR" if s.c.shard_reduce_op == "all-reduce" else "RS"
    rs = s.comm("shard", "backward", "reduce-scatter", f"fsdp {word} {name}", group, after=[after])
    return s.comm("replica", "backward", "all-reduce", f"hsdp AR {name}", group, after=[rs or after]) or rs


def _head_backward(s: _Sim, head: Cost) -> None:
    """The last stage's head backward under ``Overlap.tp_grad`` (Megatron-LM 2022: the output
    layer is ``language_model.py`` ``parallel_lm_logits`` through ``mpu/layers.py``
    ``LinearWithGradAccumulationAndAsyncCommunication``, a column-parallel linear): the cross
    entropy's backward, then with SP the output layer's input all-gathered again during its
    input-gradient GEMM, the input gradient's reduce-scatter (SP) or all-reduce launched before
    its weight-gradient GEMM and run beside it, then the final norm's backward (and its
    main-gradient hooks) once the reduced gradient is there."""
    after = _tp(s.w)[1]
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


def backward_unit(kind: str, chunk: ChunkCosts, comm: CommTimes, w: Workload, ov: Overlap,
                  last_grad_unit: bool = False, gather: bool = True, reduce: bool = True,
                  deferred: bool = False, stage_last: bool = True, gather_root: bool = True) -> UnitSim:
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
    pass it holds the stream in the unit (the send then waits with it: a little early)."""
    s = _Sim(comm, w, ov)
    with_b, with_w = kind in ("B", "Bx"), kind in ("B", "W")
    red_w = with_w and reduce and not deferred
    n = len(chunk.layers)
    emb_g, head_g = _root_groups(comm)
    # the embedding's own unit, resharded after forward (torchtitan), is gathered again
    embed_ag = (lambda: s.comm("shard", "backward", "all-gather", f"fsdp AG {emb_g}", emb_g)) \
        if chunk.embed is not None and ("shard", emb_g, "backward", "all-gather") in comm.t and with_b and gather \
        else None
    emb_ev = None
    pieces = reduce_pieces(comm, n, last_grad_unit, ov.grad_reduce) if with_w else [0.0] * n
    gather_ = lambda i: s.comm("shard", "backward", "all-gather", f"fsdp AG L{i}", "layer") \
        if with_b and gather else None
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
    ag = gather_(n - 1) if early else None
    if head_ag is not None:
        s.compute(f"{head_g} copy-out", comm.copies.get((head_g, "all-gather"), 0.0), [head_ag])
    if chunk.head is not None and with_b and with_w and ov.tp_grad:
        _head_backward(s, chunk.head)
    elif chunk.head is not None:
        s.compute("head grad", (chunk.head.seconds("backward_input") if with_b else 0.0)
                  + (chunk.head.seconds("backward_weight") if with_w else 0.0))
        if with_b:
            s.compute("head tp wait", 0.0, [s.comm("tp", "backward", _tp(w)[1], f"tp {_tp(w)[1]} (head)")])
        if red_w and (head_g == "root_head" or chunk.embed is None):  # one root unit: reduced after the embedding
            _reduce(s, head_g, head_g, 0.0)
    ag = ag if early else gather_(n - 1) if ov.fsdp_prefetch and n else None
    for i in reversed(range(n)):
        c, moe = chunk.layers[i], chunk.moe[i]
        ag = ag if ov.fsdp_prefetch else gather_(i)
        # FSDP2's copy-out follows an all-gather only: none where the table has no backward one
        # (reshard_after_forward false keeps the forward's unsharded parameters)
        s.compute(f"L{i}", comm.host.get(("layer", "backward"), 0.0)
                  + (comm.copies.get(("layer", "all-gather"), 0.0) if ag is not None else 0.0)
                  if with_b and gather else 0.0, [ag])
        ag = gather_(i - 1) if ov.fsdp_prefetch and i > 0 else None
        if i == 0 and embed_ag is not None and ov.fsdp_prefetch:
            emb_ev = embed_ag()  # FSDP2's backward prefetch: the embedding's unit after the first layer
        ds = with_b and red_w and _ds_placed(s, moe)  # DeepSpeed ZeRO-3 2021: its reductions in the layer
        if ds:
            _ds_backward_layer(s, c, f"L{i}")
        elif with_b:
            _backward_layer(s, c, moe, with_w)
            s.comm("tp", "backward", "all-reduce", f"tp norm-grad all-reduce L{i}", seconds=comm.async_s)
        else:
            s.compute(f"L{i} W", c.seconds("backward_weight"))
        if with_w and not ds:
            _reduce(s, f"L{i}", "layer", pieces[n - 1 - i], red_w)
            if moe and red_w:
                _reduce(s, f"L{i} experts", "expert", 0.0)
    if chunk.embed is not None and with_b and chunk.embed.seconds("backward_input"):
        # the embedding's own input-gradient ops (Megatron-LM: its dropout's backward, on the
        # rank's sequence shard under SP, before the split's backward gathers the gradient)
        s.compute("embedding dropout grad", chunk.embed.seconds("backward_input"))
    if chunk.embed is not None and with_b and w.sp:  # the gradient of the embedding's reduce-scatter
        s.compute("embedding tp wait", 0.0, [s.comm("tp", "backward", "all-gather", "tp all-gather (embedding)")])
    if chunk.batch is not None and with_b:
        s.compute("timers", chunk.batch.seconds("backward_input"))
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
            _reduce(s, emb_g, emb_g, 0.0)
    if deferred and with_w and reduce:
        _perform_reduce_grad(s, chunk, tail=stage_last)
    if comm.bucket_wait and s.reduced is not None and ov.grad_reduce:  # DeepSpeed's epilogue synchronize()
        s.compute("DeepSpeed epilogue synchronize", 0.0, [s.reduced])
    return s.finish()


def _perform_reduce_grad(s: _Sim, chunk: ChunkCosts, tail: bool) -> None:
    """torch ``PipelineStage.perform_reduce_grad`` after a chunk's last backward: each FSDP
    unit's ``post_backward`` in FSDP's state order (module order: the one root unit or the
    embedding's, the layers in forward order, then the [norm, output] unit):
    its copy-in on the compute stream, then its reduce-scatter (and HSDP all-reduce) on their
    stream; the compute stream waits for them all (``_root_post_backward_final_callback``):
    within the unit, or after it (``tail``: events past its compute end, the unit's tail)."""
    emb_g, head_g = _root_groups(s.c)
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
        if copy_in := s.c.copies.get((group, "reduce-scatter"), 0.0):
            if tail:  # on the compute stream after the unit, not moving its end
                t0 = max(s.free["compute"], prev.end_s if prev is not None else 0.0)
                prev = s._add("compute", f"fsdp RS copy-in {name}", t0, t0 + copy_in)
            else:
                prev = s.compute(f"fsdp RS copy-in {name}", copy_in)
        done.append(_reduce_scatter(s, name, group, prev))
    if not tail:
        s.compute("perform_reduce_grad wait", 0.0, done)
