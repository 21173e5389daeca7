"""Readiness, concurrency and the load on each physical edge (issue 4, items 1 and 3).

From the predicted step (:func:`meshplan.schedule.steptime.step_time`, stage 0, every op and
collective with its start and end in the step):

- **ready / deadline** of each collective kind (axis, phase, op), at its first occurrence
  in the step: ready = when it is issued (its input exists and its stream is free);
  deadline = when compute needs its result: the start of the layer it gathers for (FSDP
  all-gather, marker ``L<i>``), the optimizer step for gradient reductions, the end of the
  Q projection beside which all-gather CP's K/V all-gather runs (forward; in backward wq's
  input gradient beside the dK/dV reduce-scatter): slack ``wq - AG``, the time the gather
  leaves, exposed when negative; and its own end for blocking collectives (TP, EP: the next
  op waits on it; slack 0) and for ZeRO-1/2's parameter all-gather after the optimizer (the
  step ends with it). ``slack = deadline - ready - duration``; negative slack is exposed time.
- **concurrency**: pairs of collectives of different axes whose intervals overlap, with the
  total overlapped time per step: they share the GPU's copy engines and links.
- **edge load**: bytes per step on each physical edge of a stage (stage 0 unless asked; its
  first rank and that rank's node, rank 0 and node 0 for stage 0): rank 0's NVLink (what the rank sends
  inside its node: all of its NVLink-local rows and, of the rows whose groups span nodes, the
  part the row's algorithm keeps inside the node, :func:`meshplan.comm.row.link_bytes`:
  7/8 of a ring's bytes with 8 ranks of the group per node), each NIC of node 0 (what every
  group's members on node 0 send out of it, by the same split: one rank's ring bytes for a
  ring, split over the NICs its members use there), and each rail leaf's uplinks to the spine
  (node 0's scalable unit: the ring hops that leave it or change rail,
  :mod:`meshplan.placement.spine`, the rule ``place`` counts too). Each edge's busy time (bytes / capacity) is checked against
  the interval it must fit in: the stage's compute time per step, and per layer pass (one
  layer's forward + backward of one micro-batch) that pass's time; every row that runs in
  the passes counts there, those counted per step (FSDP under a pipeline schedule) with
  their step average (:func:`layer_pass_calls`). Where a network edge does not fit, where its
  traffic goes on the timeline: :mod:`meshplan.schedule.link_spill`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.comm.alphabeta import OPS
from meshplan.comm.row import link_bytes
from meshplan.compute.batch_input import BATCH_BROADCASTS
from meshplan.schedule.comm_streams import step_stream
from meshplan.schedule.ring_timeline import BLOCKING_GATHER, BLOCKING_SHIFT, LAST_SHIFT, RING_CALL, RING_CALL_B
from meshplan.schedule.netload import leaf_nodes, layer_pass_calls, network_loads, stage_of_ranks
from meshplan.pipeline.fast import KINDS
from meshplan.plan import Plan

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


@dataclass(frozen=True)
class EdgeLoad:
    """Bytes per step on one physical edge, its capacity (bytes/s) and the interval it must
    fit in (seconds)."""

    edge: str
    bytes_per_step: float
    capacity_bytes_per_s: float
    interval_s: float
    per_layer_bytes: float = 0.0
    layer_interval_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return self.bytes_per_step / self.capacity_bytes_per_s if self.capacity_bytes_per_s else 0.0

    @property
    def fits(self) -> bool:
        ok_step = self.busy_s <= self.interval_s
        ok_layer = (not self.layer_interval_s or
                    self.per_layer_bytes / self.capacity_bytes_per_s <= self.layer_interval_s)
        return ok_step and ok_layer


@dataclass(frozen=True)
class StageDetail:
    """The events of one stage that :meth:`~meshplan.schedule.step_summary.StepTime.trace_events` lists with ``detail``, less
    the unit-level ones, as arrays in that list's order (each unit's inner events in its
    timeline's order, units in stage order; then the pp sends the stage makes, then its
    step-end ops): ``code`` (row of the small tables ``streams`` and ``names``: one row per
    distinct timeline event, one for the sends, one per step-end op), ``start``/``end`` (s,
    the same additions as the list: unit start + time in the unit), ``unit`` (position of the
    unit in the stage's order, -1 for sends and step-end ops) and ``kind`` (index into
    :data:`~meshplan.pipeline.fast.KINDS` of its unit, -1 for the others). Built from each
    distinct unit timeline once (a stage of 8,192 units shares a few), so the link report
    reads 10^5 events without an Event object or a string each."""

    code: np.ndarray
    streams: tuple[str, ...]
    names: tuple[str, ...]
    start: np.ndarray
    end: np.ndarray
    unit: np.ndarray
    kind: np.ndarray

    @classmethod
    def of(cls, st, stage: int) -> "StageDetail":
        res, sl = st.pipeline, st.pipeline.stage_slice(stage)
        keys, idx = st.unit_index if st.unit_index else st.units.index(res.flat)
        uniq, inv = np.unique(idx[sl], return_inverse=True)
        per = [[e for e in st.units.by_key(keys[k]).events if e.end_s > e.start_s] for k in uniq.tolist()]
        count = np.array([len(x) for x in per], dtype=np.int64)
        offset = np.concatenate([[0], np.cumsum(count)[:-1]])
        flat = [e for x in per for e in x]
        rel_s, rel_e = np.array([e.start_s for e in flat]), np.array([e.end_s for e in flat])
        n = count[inv]
        unit = np.repeat(np.arange(len(inv)), n)
        src = np.repeat(offset[inv] - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(int(n.sum()))
        base = res.start[sl][unit]
        f, length = res.flat, res.flat.length
        waiting = np.flatnonzero(f.cross & (np.minimum(f.dep, len(f.dep) - 1) // length == stage)
                                 & (f.dep < len(f.dep)) & (res.input_s > 0)) if res.spec.max_p2p_s > 0 else np.zeros(0, dtype=np.int64)
        # a transfer starts at its producer's end, or at the rendezvous of both calls (blocking: ArrayResult._send)
        xfer = res.xfer_at(waiting)
        send_s = res.end[f.dep[waiting]] if xfer is None else xfer
        post = [e for e in st.post_events if e.stage == stage]
        rest = len(waiting) + len(post)
        return cls(np.concatenate([src, np.full(len(waiting), len(flat)), len(flat) + 1 + np.arange(len(post))]),
                   tuple(e.stream for e in flat) + ("pp",) + tuple(e.stream for e in post),
                   tuple(e.name for e in flat) + ("send",) + tuple(e.name for e in post),
                   np.concatenate([base + rel_s[src], send_s, [e.start_s for e in post]]),
                   np.concatenate([base + rel_e[src], send_s + res.input_s[waiting], [e.end_s for e in post]]),
                   np.concatenate([unit, np.full(rest, -1)]),
                   np.concatenate([f.kind[sl][unit], np.full(rest, -1)]))

    @classmethod
    def cached(cls, st, stage: int) -> "StageDetail":
        """:meth:`of`, built once per step prediction and stage (kept with its trace cache)."""
        key = ("arrays", stage)
        if key not in st._trace_cache:
            st._trace_cache[key] = cls.of(st, stage)
        return st._trace_cache[key]

    def of_table(self, values) -> np.ndarray:
        """``values`` (one per table row) for every event."""
        return np.asarray(values)[self.code]


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
    (:class:`StageDetail`): the earliest event of each
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


def concurrency(st, stage: int = 0) -> dict[tuple[str, str], float]:
    """Seconds per step during which collectives of two different streams run at once: for
    streams A and B, the integral over the step of ``n_A(t) n_B(t)`` (n: collectives of the
    stream running at t), the sum over every pair of their overlaps."""
    d = StageDetail.cached(st, stage)
    names = sorted(set(d.streams) - {"compute"})
    row = np.array([names.index(s) if s != "compute" else -1 for s in d.streams])
    code = d.of_table(row)
    keep = (code >= 0) & (d.end > d.start)
    code = code[keep]
    if len(set(code.tolist())) < 2:
        return {}
    t = np.concatenate([d.start[keep], d.end[keep]])
    order = np.argsort(t, kind="stable")
    k = len(code)
    delta = np.zeros((len(names), 2 * k))
    delta[np.concatenate([code, code])[order], np.arange(2 * k)] = np.where(order < k, 1.0, -1.0)
    running = np.cumsum(delta, axis=1)[:, :-1]   # collectives of each stream between boundaries
    dt = np.diff(t[order])
    out: dict[tuple[str, str], float] = {}
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            sec = float(np.dot(running[a] * running[b], dt))
            if sec > 0:
                out[(names[a], names[b])] = sec
    return out


def edge_loads(plan: Plan, st, stage: int = 0) -> list[EdgeLoad]:
    """Load per step on the NVLink of ``stage``'s first rank (``st.example_ranks[stage]``: rank 0
    for stage 0), the NICs of that rank's node and the rail leaves' uplinks to the spine of its
    scalable unit (every node's traffic under the leaf that crosses the spine, against the
    leaf's uplinks: a non-blocking leaf has one NIC's rate per node, over the spine tier's
    oversubscription; each node of the leaf under its own stage's rows, :func:`_leaf_stages`),
    against ``stage``'s windows (:func:`compute_window_s`), from ``stage``'s collective rows."""
    rows = plan.stage(stage).collectives
    compute_s = compute_window_s(st, stage)
    n_layers = len(plan.stage(stage).layers)
    layer_s = compute_s / max(plan.micro_batches * n_layers, 1)
    cluster = plan.config.cluster
    passes = plan.micro_batches * n_layers
    rank = st.example_ranks[stage]
    node = int(plan.placement.node[rank])
    nv = sum(r.link_bytes[0] * r.per_step for r in rows)
    nv_layer = sum(r.link_bytes[0] * layer_pass_calls(r, passes) for r in rows)
    out = [EdgeLoad(f"rank {rank} {cluster.node.fabric.name}", nv, cluster.node.fabric.bandwidth_bytes_per_s,
                    compute_s, nv_layer, layer_s)]
    nics, uplink = network_loads(plan, rows, passes, node, stage, _leaf_stages(plan, node, stage))
    for i, (per_step, per_layer) in sorted(nics.items()):
        nic = cluster.node.nics[i]
        out.append(EdgeLoad(f"node {node} NIC {nic.name} (rail {nic.rail})", per_step, nic.bandwidth_bytes_per_s,
                            compute_s, per_layer, layer_s))
    leaf = leaf_nodes(cluster, node)
    for rail, (per_step, per_layer) in sorted(uplink.items()):
        nic = next(n for n in cluster.node.nics if n.rail == rail)
        over = cluster.network[-1].oversubscription if cluster.network else 1.0
        out.append(EdgeLoad(f"rail {rail} uplinks to spine (nodes {leaf[0]}-{leaf[-1]})", per_step,
                            len(leaf) * nic.bandwidth_bytes_per_s / over, compute_s, per_layer, layer_s))
    return out


def _leaf_stages(plan: Plan, node: int, stage: int) -> dict[int, tuple]:
    """{stage: (its collective rows, its layer passes)} of the other pipeline stages with ranks on
    ``node``'s leaf: the uplinks carry every node's traffic under its own stage's table
    (:func:`~meshplan.schedule.netload.network_loads`)."""
    on_leaf = np.isin(plan.placement.node, leaf_nodes(plan.config.cluster, node))
    present = np.unique(stage_of_ranks(plan.mesh)[on_leaf]).tolist()
    return {k: (plan.stage(k).collectives, plan.micro_batches * len(plan.stage(k).layers))
            for k in present if k != stage}


def compute_window_s(st, stage: int = 0) -> float:
    """The window an edge's traffic per step must fit in (:func:`edge_loads`): ``stage``'s
    compute time, seconds per step: its units' compute events (forward, backward, recompute;
    not the optimizer step, the bubble or the waits for communication), every schedule run."""
    d = StageDetail.cached(st, stage)
    inner = d.of_table([s == "compute" for s in d.streams]) & (d.unit >= 0)
    return float((d.end[inner] - d.start[inner]).sum()) * st.runs
