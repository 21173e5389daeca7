"""A step's compute by kernel kind (:func:`kernel_kinds_s`): the seconds the critical stage spends
per step in each kind of kernel outside the GEMMs and the attention core, named as the compute
model's cost tables name their ops (:mod:`meshplan.compute.ops`: ``cp ring merge``,
``SP layout copy``, ``silu x up`` ...), and the kinds that differ most between two steps
(:func:`largest_kinds`). ``meshplan search``'s line on the top against #2 names them under its
``other`` part, ``meshplan compare`` under its compute line (newcomer trial: ``other (memory-bound
ops, optimizer step) 94 ms vs 185 ms`` and ``compute +91.4 ms`` said nothing of torch's CP ring
merges and sequence-parallel layout copies that made the difference).
"""

from __future__ import annotations

from meshplan.schedule.step_summary import StepTime


def kernel_kind(name: str) -> str:
    """The kernel kind an op (:class:`~meshplan.compute.ops.Op`) or a step-end event is counted under:
    its own name up to a parenthesised qualifier, so that one kernel's instances and replays add up.

    >>> [kernel_kind(n) for n in ("SP layout copy (gather, attn)", "rope (recompute)", "cp ring merge")]
    ['SP layout copy', 'rope', 'cp ring merge']
    """
    return name.split(" (", 1)[0]


def kernel_kinds_s(st: StepTime) -> dict[str, float]:
    """The ``compute`` part's seconds outside the GEMMs and the attention core, by kernel kind
    (:func:`kernel_kind` of the cost tables' op names: ``cp ring merge``, ``SP layout copy``,
    ``silu x up`` ...; recompute included), on ``st``'s critical stage per step: each op of its
    chunks' layers, embedding, head and batch ops x the micro-batches x schedule runs, as
    :func:`meshplan.search.step_parts.compute_split` counts them, and the step-end work on its compute stream
    (``optimizer step``: :meth:`StepTime.parts_s`'s, by its event's name). What the search's split's
    ``other`` part holds, itemised (the collectives' copies on the compute stream apart:
    :func:`meshplan.search.step_parts.compute_stream_copies_s`)."""
    kinds: dict[str, float] = {}
    # each distinct Cost's (kind, seconds) once: a chunk's layers of one kind share their Cost
    # (schedule.workload.chunk_costs); added op by op in the same order, so the same sums
    items: dict[int, list] = {}
    for ch in st.units.chunks[st.critical_stage]:
        for cost in (*ch.layers, ch.embed, ch.head, ch.batch, ch.engine):
            if cost is None:
                continue
            if id(cost) not in items:
                items[id(cost)] = [(kernel_kind(o.name), o.seconds) for o in cost.ops
                                   if o.kind not in ("gemm", "attention")]
            for kind, seconds in items[id(cost)]:
                kinds[kind] = kinds.get(kind, 0.0) + seconds
    passes = st.pipeline.spec.m * st.runs
    out = {k: passes * v for k, v in kinds.items()}
    for e in st.post_events:
        if e.stage == st.critical_stage and e.stream == "compute" and "later_runs" not in e.args:
            out[kernel_kind(e.name)] = out.get(kernel_kind(e.name), 0.0) + e.dur_s
    return out


def largest_kinds(a: dict[str, float], b: dict[str, float], most: int = 3,
                  floor_s: float = 0.0) -> list[tuple[str, float, float]]:
    """(kind, a's seconds, b's) of the ``most`` kernel kinds (:func:`kernel_kinds_s`) whose seconds
    differ most between ``a`` and ``b``, by more than ``floor_s``, largest difference first (a kind one
    side lacks counts 0 there).

    >>> largest_kinds({"rope": 0.004, "SP layout copy": 0.0}, {"rope": 0.004, "SP layout copy": 0.043,
    ...                                                          "cp ring merge": 0.014})
    [('SP layout copy', 0.0, 0.043), ('cp ring merge', 0.0, 0.014)]
    """
    diff = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in dict.fromkeys([*a, *b])}
    keep = sorted((k for k in diff if abs(diff[k]) > floor_s), key=lambda k: -abs(diff[k]))[:most]
    return [(k, a.get(k, 0.0), b.get(k, 0.0)) for k in keep]
