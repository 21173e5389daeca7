"""A stage's collective rows as the rank timeline reads them: each row's kind and stream
(:func:`comm_kind`; the built-in groups and streams, and the registered axes that place their own
rows, :func:`timeline_axes`, :func:`simulated_groups`), and its seconds per call keyed (kind,
group, phase, op) in :class:`CommTimes`, with the per-step, per-micro-batch, pp, loss and
DeepSpeed figures apart; the SM share a collective's NCCL kernel takes from compute
(:func:`nccl_sm_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from meshplan.comm import deepspeed
from meshplan.comm.deepspeed import CADENCE as DEEPSPEED_CADENCE
from meshplan.comm.deepspeed_zero12 import CADENCE as DEEPSPEED_BUCKET_CADENCE
from meshplan.comm.dp_rows import ZERO2_CADENCE
from meshplan.comm.ep_rows import DROPLESS_COUNTS
from meshplan.comm.fsdp_rows import FLOAT8_PRECOMPUTE_CADENCE
from meshplan.comm.pp_rows import SCATTER_GATHER_CADENCE
from meshplan.comm.tp_rows import FLOAT8_AMAX_CADENCE
from meshplan.mesh.tpsplit import KV_REPLICA
from meshplan.spec.axes.base import Slot, Timeline
from meshplan.spec.axes.registry import AXES, Axis


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
    scatter/gather), ``shard`` (FSDP units), ``replica`` (HSDP), ``step`` (per step; also the
    SP norms' tp all-reduces FSDP2 issues once per step at pp > 1, comm/tp_grads.py),
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
        if "norm" in c or "weight gradient" in c:  # once per step under FSDP2 at pp > 1: "step"
            return "tp_async" if row.per_microbatch or not row.per_step else "step"
        return "tp"
    if "(K and V)" in c or "(dK and dV)" in c:
        return "cp"
    if row.op in ("all-gather", "reduce-scatter") and row.phase in ("forward", "backward"):
        return "shard"
    if DEEPSPEED_CADENCE in c and row.op == "all-reduce" and row.phase == "backward":
        return "shard"  # DeepSpeed ZeRO-3 of 2021: its gradient buckets' all-reduces, the unit's reduction
    return "other"


#: The data axes as the table names them (:meth:`~meshplan.mesh.resolve.Mesh.display_name`; "loss":
#: Megatron-LM DDP's dp x cp), whose per-step rows the timeline shows on "dp" (:func:`step_stream`).
DATA_STEP_AXES = frozenset({"dp", "dp_shard", "dp_replicate", "fsdp", "loss"})


def step_stream(row) -> str:
    """The stream that shows a per-step row's (kind ``step``, :func:`comm_kind`) calls in the
    rank timeline and the step's readiness list: "dp" for the data axes
    (:data:`DATA_STEP_AXES`), else the group the row runs on, as the collective table names it:
    ``tp`` for the norms' weight gradients under SP (and the MoE router's, MLA's) without FSDP
    and Megatron-LM's coalesced SP all-reduce, ``pp`` for the tied embedding's all-reduce between
    the first and last stage, ``efsdp`` for the routed experts' ZeRO-1/2 or DDP reduction (the
    replicated KV heads' all-reduces, kind ``kv``, show on their group ``kv_replica`` too).

    >>> from types import SimpleNamespace as R
    >>> [step_stream(R(axis=a)) for a in ("dp_shard", "fsdp", "loss", "tp", "pp", "efsdp")]
    ['dp', 'dp', 'dp', 'tp', 'pp', 'efsdp']
    """
    return "dp" if row.axis in DATA_STEP_AXES else row.axis


def split_by_stream(by: dict, seconds: float) -> list[tuple[str, float]]:
    """``seconds`` of the per-step reduction (or gather) split over the streams of ``by``
    ({stream: seconds per step}, :func:`step_stream`) in proportion, in ``by``'s order; one
    stream (or none: "dp") takes ``seconds`` itself, to the bit.

    >>> split_by_stream({"dp": 3.0, "tp": 1.0}, 2.0), split_by_stream({"tp": 1.0}, 0.5), split_by_stream({}, 0.5)
    ([('dp', 1.5), ('tp', 0.5)], [('tp', 0.5)], [('dp', 0.5)])
    """
    if len(by) <= 1:
        return [(next(iter(by), "dp"), seconds)]
    total = sum(by.values())
    return [(k, seconds * v / total) for k, v in by.items() if v > 0]


#: Timeline group of each FSDP root unit label (:func:`meshplan.comm.fsdp_rows.fsdp_units`): one
#: root, or the embedding's unit and the [norm, output] unit apart (torchtitan, a V).
ROOT_GROUPS = {"root (embedding)": "root_embed", "root (norm/output)": "root_head"}


#: Group of the tp rows that move float8 (the layers' all-gathers under torchao's float8 TP:
#: :func:`meshplan.compute.dtensor_sp.float8_tp`); the embedding's and head's keep "".
FLOAT8_TP = "float8"


#: Group of the tp all-reduces of float8 amaxes (:data:`meshplan.comm.tp_rows.FLOAT8_AMAX_CADENCE`).
FLOAT8_AMAX = "float8 amax"


def _row_group(kind: str, row) -> str:
    """The group a row's seconds are kept under in :attr:`CommTimes.t`."""
    if kind in ("shard", "replica"):
        return shard_group(row.cadence)
    if kind == "tp" and row.cadence == FLOAT8_AMAX_CADENCE:
        return FLOAT8_AMAX
    if kind == "ep" and row.cadence == DROPLESS_COUNTS:  # kept apart from the dispatch, placed before it
        return "counts"
    return FLOAT8_TP if kind == "tp" and row.dtype == "fp8" else ""


def shard_group(cadence: str) -> str:
    """The FSDP unit group a collective row belongs to, from its ``cadence`` text: a root unit's
    label (:data:`ROOT_GROUPS`, else ``"root"``), ``"expert"`` for an MoE experts' unit, else
    ``"layer"``."""
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
    (:func:`~meshplan.schedule.grad_reduce.reduce_pieces`); ``gather_buckets``: calls of the per-step parameter all-gather
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
    mb_buckets: int = 0
    bucket_wait: bool = False
    #: ``step_reduce_s``, ``mb_reduce_s`` and ``step_gather_s`` by the stream that shows them
    #: ({stream: seconds}, :func:`step_stream`: "dp", or the group a per-step row runs on), and the
    #: reduction's collectives by stream ({stream: ops}; "all-reduce" for DDP and DeepSpeed's buckets,
    #: "reduce-scatter" for Megatron-LM's ZeRO-1/2: the one of a stream is named in its events so the
    #: step's collective list shows them, linkload._op_of): each piece and step-end event is split
    #: over them (:meth:`reduce_parts`, :meth:`gather_parts`)
    step_reduce_by: dict = field(default_factory=dict)
    mb_reduce_by: dict = field(default_factory=dict)
    step_gather_by: dict = field(default_factory=dict)
    reduce_ops_by: dict = field(default_factory=dict)
    #: the per-step reduction's table phases by stream ({stream: phases}: "step", or "backward" for
    #: DeepSpeed ZeRO-1's buckets under overlap_comm), as the readiness list prints its pieces
    reduce_phases_by: dict = field(default_factory=dict)
    #: the collective of the shard units' gradient reduction: "all-reduce" for DeepSpeed ZeRO-3
    #: of 2021's gradient buckets (:func:`meshplan.comm.deepspeed.grad_buckets`), else FSDP's
    shard_reduce_op: str = "reduce-scatter"
    #: DeepSpeed ZeRO-3 of 2021's gradient reductions by the module whose hook flushes their
    #: bucket: (group, module) -> (seconds, buckets) per unit (:func:`~meshplan.schedule.deepspeed_layer.ds_backward_layer`)
    ds_flush: dict = field(default_factory=dict)

    def reduce_parts(self, seconds: float, per_step: bool = False) -> list[tuple[str, float, str]]:
        """``seconds`` of the gradient reduction (a piece, :func:`~meshplan.schedule.grad_reduce.reduce_pieces`,
        or with ``per_step`` the step-end whole of ``step_reduce_s``) as (stream, seconds,
        collective) by the stream of its rows (:func:`split_by_stream`): a piece splits the
        micro-batch's rows when there are (ZeRO-2, whose pieces reduce_pieces places), else the
        per-step ones; the collective, the stream's rows' one all-reduce or reduce-scatter, else "".

        Llama-3-8B at tp 8, dp 1, SP without FSDP: the norms' weight gradients, all over tp:

        >>> c = CommTimes(step_reduce_s=2.0, step_reduce_by={"tp": 2.0}, reduce_ops_by={"tp": {"all-reduce"}})
        >>> c.reduce_parts(0.5)
        [('tp', 0.5, 'all-reduce')]
        """
        by = self.mb_reduce_by if self.mb_reduce_s and not per_step else self.step_reduce_by
        return [(k, x, _one_op(self.reduce_ops_by.get(k, ()))) for k, x in split_by_stream(by, seconds)]

    def gather_parts(self, seconds: float) -> list[tuple[str, float]]:
        """``seconds`` of the per-step parameter all-gather by the stream of its rows (:func:`split_by_stream`)."""
        return split_by_stream(self.step_gather_by, seconds)

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
            lab = step_stream(r) if kind == "step" else ""
            if kind == "step" and r.op != "all-gather":
                c.reduce_ops_by[lab] = c.reduce_ops_by.get(lab, frozenset()) | {r.op}
                c.reduce_phases_by[lab] = c.reduce_phases_by.get(lab, frozenset()) | {r.phase}
            if kind == "step" and (ZERO2_CADENCE in r.cadence or (ds and r.per_microbatch)):  # one micro-batch's
                c.mb_reduce_s += r.time_s * r.per_microbatch
                _add_to(c.mb_reduce_by, lab, r.time_s * r.per_microbatch)
                c.mb_buckets += r.per_microbatch
            elif kind == "step":  # every call of the row (torch's SP norm gradients: 3 per norm per step)
                if r.op == "all-gather":  # a synchronous call's host time (DeepSpeed ZeRO-3's persistent
                    # gather) runs beside its GPU time: the later of the two ends it
                    c.step_gather_s += max(r.time_s, r.host_s) * max(r.per_step, 1)
                    _add_to(c.step_gather_by, lab, max(r.time_s, r.host_s) * max(r.per_step, 1))
                    c.gather_buckets += max(r.per_step, 1)
                else:
                    c.step_reduce_s += r.time_s * max(r.per_step, 1)
                    _add_to(c.step_reduce_by, lab, r.time_s * max(r.per_step, 1))
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
                group = shard_group(r.cadence)
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


def _add_to(by: dict, key: str, seconds: float) -> None:
    by[key] = by.get(key, 0.0) + seconds


def _one_op(ops) -> str:
    """The one all-reduce or reduce-scatter of ``ops``, else "" (none, several, another)."""
    (op,) = ops if len(ops) == 1 else ("",)
    return op if op in ("all-reduce", "reduce-scatter") else ""


def nccl_sm_share(cluster):
    """row -> fraction of ``cluster.gpu``'s SMs the row's NCCL kernel holds while it runs:
    ``fabric.nccl_channels / gpu.sms`` for collectives on the node's GPU fabric (path
    ``nvlink``), 0 for the rest (NIC paths: channel counts not in the catalog) and where the
    catalog gives no channel count. NCCL runs one thread block per channel, each resident on
    one SM for the whole collective (NVIDIA/nccl-tests issue #100: 24 channels on an HGX A100,
    108 SMs: 22%)."""
    f = cluster.node.fabric.nccl_channels / cluster.gpu.sms
    return lambda row: f if row.path.kind == "nvlink" else 0.0


#: Parameter modules of torch's layer (separate Q, K, V and gate projections) in the piece that
#: holds their ops.
DS_ALIAS = {"wq": "query_key_value", "wk": "query_key_value", "wv": "query_key_value", "w_gate": "w_up"}


def root_groups(comm: CommTimes) -> tuple[str, str]:
    """Timeline groups of the embedding's and the head's FSDP units: "root_embed" and
    "root_head" when the stage's table has them apart, else both "root" (one root unit)."""
    groups = {k[1] for k in comm.t if k[0] == "shard"}
    return ("root_embed" if "root_embed" in groups else "root", "root_head" if "root_head" in groups else "root")
