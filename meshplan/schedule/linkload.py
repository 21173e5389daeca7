"""Readiness, concurrency and the load on each physical edge (issue 4, items 1 and 3).

From the predicted step (:func:`meshplan.schedule.steptime.step_time`, stage 0, every op and
collective with its start and end in the step):

- **ready / deadline** of each collective kind (axis, phase, op), its slack:
  :mod:`meshplan.schedule.readiness`.
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

from meshplan.schedule.netload import leaf_nodes, layer_pass_calls, network_loads, stage_of_ranks
from meshplan.plan import Plan


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
