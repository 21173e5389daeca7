"""Each collective row's kind and stream as the rank timeline reads it (:func:`comm_kind`): the
built-in groups and streams the timeline places by hand, the registered axes that place their
own rows (:func:`timeline_axes`, :func:`simulated_groups`), and the stream a per-step row shows on
(:func:`step_stream`), with a per-step time split over those streams (:func:`split_by_stream`).
The rows' seconds per call by kind: :class:`meshplan.schedule.comm_times.CommTimes`.
"""

from __future__ import annotations

from typing import Optional

from meshplan.comm import zeropp
from meshplan.comm.deepspeed import CADENCE as DEEPSPEED_CADENCE
from meshplan.comm.deepspeed_zero12 import CADENCE as DEEPSPEED_BUCKET_CADENCE
from meshplan.comm.dp_rows import ZERO2_CADENCE
from meshplan.comm.ep_rows import DROPLESS_COUNTS, ETP_GATHER
from meshplan.comm.fsdp_rows import FLOAT8_PRECOMPUTE_CADENCE
from meshplan.comm.pp_rows import SCATTER_GATHER_CADENCE
from meshplan.mesh.tpsplit import KV_REPLICA
from meshplan.spec.axes.base import Timeline
from meshplan.spec.axes.cp import P2P_PACKED
from meshplan.spec.axes.registry import AXES, Axis

#: Groups whose rows the timeline places by hand (the built-in axes, and the derived groups
#: their rows run over, by the name the table shows).
BUILT_IN_GROUPS = frozenset(map(str, (Axis.PP, Axis.DP_REPLICATE, Axis.DP, Axis.DP_SHARD, Axis.CP, Axis.TP,
                                      Axis.EP, Axis.ETP))) | {"fsdp", "efsdp", "loss", KV_REPLICA}


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
    ['cp', 'dp', 'dp_replicate', 'dp_shard', 'efsdp', 'ep', 'etp', 'fsdp', 'kv_replica', 'loss', 'pp', 'tp']
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
    if "(K and V)" in c or "(dK and dV)" in c or P2P_PACKED in c:  # before send/recv: the cp rings send by send/recv
        return "cp"
    if row.op == "send/recv":
        return "pp"
    if SCATTER_GATHER_CADENCE in c:
        return "pp_gather"
    if zeropp.MARK in c and row.phase in ("forward", "backward"):  # DeepSpeed ZeRO++: a unit's gathers, qgZ's all-to-alls
        return "shard"
    if row.op == "all-to-all" or c in (DROPLESS_COUNTS, ETP_GATHER):  # Megatron-LM's counts: an all-gather
        return "ep"
    if row.axis == Axis.DP_REPLICATE or c.endswith("(HSDP replicas)"):
        return "replica"
    if row.axis == Axis.TP:
        if row.phase == "loss" or "logits" in c or "loss" in c:
            return "loss"
        if "norm" in c or "weight gradient" in c:  # once per step under FSDP2 at pp > 1: "step"
            return "tp_async" if row.per_microbatch or not row.per_step else "step"
        return "tp"
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
