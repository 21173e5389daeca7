"""Readiness of a stage's collectives (issue 4, item 1), from the predicted step
(:func:`meshplan.schedule.steptime.step_time`, every op and collective with its start and end in
the step, read through :class:`meshplan.schedule.linkload.StageDetail`):

**ready / deadline** of each collective kind (axis, phase, op), at its first occurrence
in the step: ready = when it is issued (its input exists and its stream is free);
deadline = when compute needs its result: the start of the layer it gathers for (FSDP
all-gather, marker ``L<i>``), the optimizer step for gradient reductions, the end of the
Q projection beside which all-gather CP's K/V all-gather runs (forward; in backward wq's
input gradient beside the dK/dV reduce-scatter): slack ``wq - AG``, the time the gather
leaves, exposed when negative; and its own end for blocking collectives (TP, EP: the next
op waits on it; slack 0) and for ZeRO-1/2's parameter all-gather after the optimizer (the
step ends with it). ``slack = deadline - ready - duration``; negative slack is exposed time.

One row per kind (:func:`timings`), and the table's per-step rows a kind stands for
(:func:`step_rows`). Concurrency and the load per physical edge: :mod:`meshplan.schedule.linkload`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.comm.alphabeta import OPS
from meshplan.compute.batch_input import BATCH_BROADCASTS
from meshplan.pipeline.fast import KINDS
from meshplan.schedule.comm_streams import step_stream
from meshplan.schedule.linkload import StageDetail
from meshplan.schedule.ring_timeline import BLOCKING_GATHER, BLOCKING_SHIFT, LAST_SHIFT, RING_CALL, RING_CALL_B


#: Event-name markers of the table's ops: FSDP's and the other axes' ``AG``/``RS``/``AR``, and torch's
#: ring attention's dK/dV ``shift`` (:mod:`meshplan.schedule.ring_timeline`: the table's cp send/recv).
_OPS = {"AG": "all-gather", "RS": "reduce-scatter", "AR": "all-reduce", "shift": "send/recv"}

#: The compute ops a CP collective runs beside (:mod:`meshplan.schedule.rank_timeline`): its deadline
#: (torch's ring attention: the SDPA call after it).
Q_OPS = (" Q proj", " Q proj B", RING_CALL, RING_CALL_B)


@dataclass(frozen=True)
class Timing:
    """First occurrence of a collective kind in the step (seconds from the step start).
    ``phase`` as the plan's collective table names it: ``step`` for a per-step row, also where
    its pieces go out inside the last backward (``issued``: ``in the last backward``; Megatron-LM's
    DDP and ZeRO-1 buckets under overlapped reduction, its coalesced SP all-reduce, torch's SP norm
    gradients), and ``backward`` for torch DDP's and DeepSpeed ZeRO-1's (``overlap_comm``) buckets,
    whose rows say so (:attr:`~meshplan.schedule.comm_times.CommTimes.reduce_phases_by`).
    ``calls``: calls of the plan's table the one event stands for, 1 but for a layer's torch SP
    norm-weight gradient all-reduces (tp, backward), merged into one event of ``calls`` x the
    table's time (:attr:`~meshplan.schedule.comm_times.CommTimes.async_calls`: a layer's rows'
    calls per micro-batch over the stage's layers, 161 / 80 = 2.01 for Llama-3-70B's 2 norms a
    layer and the final norm; newcomer trial 54 #9)."""

    stream: str
    phase: str
    op: str
    ready_s: float
    deadline_s: float
    duration_s: float
    issued: str = ""  # where a per-step row (phase "step") is issued when not at the step's end
    calls: float = 1.0

    @property
    def slack_s(self) -> float:
        return self.deadline_s - self.ready_s - self.duration_s


def _op_of(name: str) -> str:
    """The collective of a timeline event named ``name``, as the collective table names it ("" for
    compute): its marker (``AG``, ``RS``, ``AR``), an op word of the table
    (:data:`~meshplan.comm.alphabeta.OPS`), or Megatron-LM's ``get_batch`` broadcasts
    (:data:`~meshplan.compute.batch_input.BATCH_BROADCASTS`, the table's two tp "broadcast" rows).

    >>> _op_of("fsdp AG L3"), _op_of("get_batch broadcasts (get_batch data)"), _op_of("attention")
    ('all-gather', 'broadcast', '')
    >>> _op_of("cp dK/dV last shift")
    'send/recv'
    """
    if name.startswith(BATCH_BROADCASTS):
        return "broadcast"
    for word in name.replace("(", " ").split():
        if word in _OPS:
            return _OPS[word]
        if word in OPS:
            return word
    return "all-reduce" if "all-reduce" in name else ""


def timings(st, stage: int = 0) -> list[Timing]:
    """Ready time, deadline and duration of the first occurrence of each (stream, phase, op)
    on ``stage`` (see the module docstring), from the stage's events on arrays
    (:class:`~meshplan.schedule.linkload.StageDetail`): the earliest event of each
    kind, ties in the trace's order."""
    key = ("timings", stage)
    if key not in st._trace_cache:  # the step command prints them and writes them to --json
        st._trace_cache[key] = _timings(st, stage)
    return list(st._trace_cache[key])


def _timings(st, stage: int) -> list[Timing]:
    """:func:`timings`: the events sorted by start (stable), each labelled by its (stream,
    phase, op) as an integer, and the first event of each label kept, in that order."""
    d = StageDetail.cached(st, stage)
    ops = [_op_of(n) for n in d.names]
    comm = [s not in ("compute", "p2p") and not s.startswith("stage") and bool(o) for s, o in zip(d.streams, ops)]
    cand = np.flatnonzero(d.of_table(comm))
    cand = cand[np.argsort(d.start[cand], kind="stable")]
    posts = np.flatnonzero(d.unit < 0).tolist()
    opt = next((float(d.start[i]) for i in posts if "optimizer" in d.names[d.code[i]]),
               max(float(d.end.max()), float(st.pipeline.end[st.pipeline.stage_slice(stage)].max())))
    phases = ("forward", "backward", "step")
    labels = sorted({(s, o) for s, o in zip(d.streams, ops)})
    row = np.array([labels.index((s, o)) for s, o in zip(d.streams, ops)], dtype=np.int64)
    per_step, table = _step_pieces(st, stage, d.names)
    kind = d.kind[cand]
    phase = np.where(kind == KINDS.index("F"), 0, np.where((kind < 0) | per_step[d.code[cand]], 2, 1))
    label = row[d.code[cand]] * len(phases) + phase
    _, first = np.unique(label, return_index=True)
    out = []
    for j in np.sort(first).tolist():
        i, c = int(cand[j]), int(d.code[cand[j]])
        name, issued = _phase_issued(phases[int(phase[j])], bool(per_step[c]), d.kind[i] >= 0,
                                     table.get(d.streams[c], ()))
        merged = st.units.comms[stage].async_calls if "norm-grad" in d.names[c] else 1.0
        out.append(Timing(d.streams[c], name, ops[c], float(d.start[i]), _deadline(d, i, opt),
                          float(d.end[i] - d.start[i]), issued, merged or 1.0))
    return out


def _phase_issued(phase: str, piece: bool, in_unit: bool, table: frozenset) -> tuple[str, str]:
    """(phase, issued) of a table row: a piece of the per-step reduction (``piece``) takes its
    rows' one phase where they have one (``table``: DeepSpeed ZeRO-1 under overlap_comm and the
    DDP buckets, ``backward``), and says where it goes out when not where that phase puts it:
    inside the last backward (``in_unit``), or at the step's end after it (Megatron-LM's DDP
    without overlapped reduction: ``reduce_model_grads`` all-reduces the buffers after the last
    backward, in the optimizer's step, NVIDIA/Megatron-LM 2755bcb megatron/optimizer/optimizer.py
    293-310; today's ``finalize_model_grads`` calls ``finish_grad_sync`` there, d98e8a6
    megatron/core/distributed/finalize_model_grads.py 636-640).

    >>> _phase_issued("step", True, False, frozenset({"backward"}))
    ('backward', 'at the step end, after the last backward')
    >>> _phase_issued("step", True, True, frozenset({"step"})), _phase_issued("step", True, False, frozenset({"step"}))
    (('step', 'in the last backward'), ('step', ''))
    """
    name = next(iter(table)) if piece and len(table) == 1 else phase
    if piece and in_unit:
        return name, "in the last backward"
    return name, "at the step end, after the last backward" if piece and name != "step" else ""


def step_rows(plan, t: Timing, stage: int = 0) -> str:
    """What a ``step`` row of the table (``t``) stands for: the cadences of ``stage``'s per-step
    rows of the plan's collective table that ``t.stream`` shows with ``t.op``
    (:func:`~meshplan.schedule.comm_streams.step_stream`), distinct, ``"; "`` between them
    (Megatron-LM's coalesced SP norm gradients over tp, the data axes' gradient reduce-scatter,
    the updated parameters' all-gather); "" for another phase.

    >>> from types import SimpleNamespace as R
    >>> rows = [R(axis="tp", phase="step", op="all-reduce", cadence="once per step (SP)"),
    ...         R(axis="dp_shard", phase="step", op="reduce-scatter", cadence="once per step")]
    >>> plan = R(stage=lambda s: R(collectives=rows))
    >>> step_rows(plan, Timing("tp", "step", "all-reduce", 0.0, 1.0, 0.5))
    'once per step (SP)'
    >>> step_rows(plan, Timing("dp", "step", "reduce-scatter", 0.0, 1.0, 0.5))
    'once per step'
    """
    if t.phase != "step":
        return ""
    seen = [r.cadence for r in plan.stage(stage).collectives
            if r.phase == "step" and r.op == t.op and step_stream(r) == t.stream]
    return "; ".join(dict.fromkeys(seen))


def _step_pieces(st, stage: int, names: tuple[str, ...]) -> tuple[np.ndarray, dict]:
    """(for each event name, whether it is a piece of the per-step reduction issued inside the last
    backward: :func:`meshplan.schedule.grad_reduce.unit_reduce`'s ``grad reduce ...``, not ZeRO-2's
    per-micro-batch pieces, ``mb_reduce_s``; the phases the table gives those rows by stream)."""
    pieces = np.array([n.startswith("grad reduce") for n in names], dtype=bool)
    if not pieces.any():
        return pieces, {}
    comm = st.units.comms[stage]
    return pieces & (not comm.mb_reduce_s), comm.reduce_phases_by


def p2p_calls(st, stage: int = 0) -> int:
    """The pp sends ``stage`` makes per schedule run (activations forward, gradients backward),
    which :func:`timings` leaves out: they are the parts line's ``exposed pp`` (their transfers;
    a blocking call's wait for its partner stage is bubble)."""
    d = StageDetail.cached(st, stage)
    send = [k for k, (s, n) in enumerate(zip(d.streams, d.names)) if s == "pp" and n == "send"]
    return int(np.isin(d.code, send).sum())


def _deadline(d, i: int, opt: float) -> float:
    stream, name = d.streams[d.code[i]], d.names[d.code[i]]
    words = name.split()
    if stream in ("fsdp", "efsdp") and "AG" in words:
        # the first compute event named for the layer at or after the gather's start: inside its
        # own unit or a later one (units run in order on the stage's stream)
        rows = [k for k, (s, n) in enumerate(zip(d.streams, d.names)) if s == "compute" and n == words[-1]]
        hits = np.flatnonzero(np.isin(d.code, rows) & (d.start >= d.start[i]) & (d.unit >= d.unit[i]))
        return float(d.start[hits[np.argmin(d.start[hits])]]) if len(hits) else float(d.end[i])
    if stream == "cp" and name in (LAST_SHIFT, BLOCKING_SHIFT, BLOCKING_GATHER):
        return float(d.end[i])  # torch's ring: a layer's last dK/dV shift blocks (compiled: the backward's every one)
    if stream == "cp":
        # all-gather CP (layer_timeline._block): the K/V all-gather runs beside the Q projection and
        # the core attention waits for it; the dK/dV reduce-scatter beside wq's input gradient,
        # and the K/V projections' input gradients wait for it; torch's ring: each beside the SDPA
        # call after it. Needed when that op ends.
        rows = [k for k, (s, n) in enumerate(zip(d.streams, d.names)) if s == "compute" and n.endswith(Q_OPS)]
        hits = np.flatnonzero(np.isin(d.code, rows) & (d.start >= d.start[i]) & (d.unit == d.unit[i]))
        return float(d.end[hits[np.argmin(d.start[hits])]]) if len(hits) else float(d.end[i])
    if stream in ("dp_replicate", "dp") and "all-gather" in name or name.startswith("param all-gather"):
        return float(d.end[i])  # ZeRO-1/2's parameter all-gather after the optimizer: the step ends with it
    if "RS" in words or "norm-grad" in name or stream in ("dp_replicate", "dp") or name.startswith("grad reduce"):
        return opt  # a gradient reduction (on "dp", or on the group of a per-step row: tp, pp, efsdp)
    return float(d.end[i])  # blocking: the next op waits for it
