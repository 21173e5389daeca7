"""What a step is made of, on its critical stage (the stage that ends last), for the search's
explanation (:mod:`meshplan.search.explain`) and its exact rows (:mod:`meshplan.search.exact`).

:func:`step_breakdown` splits a :class:`~meshplan.schedule.step_summary.StepTime` into parts
that add up to the step, seconds (:meth:`~meshplan.schedule.step_summary.StepTime.parts_s`:
``compute``, ``bubble`` with a blocking pp call's wait for its partner, ``exposed <stream>``
with pp's transfers only); :func:`compute_split` splits its ``compute`` part by kernel kind,
:func:`stage_flops` gives the FLOP it is spent on, and :func:`layer_passes` counts the layer
passes (a count, kept apart from the seconds)."""

from __future__ import annotations

from meshplan.plan import Plan, table_key, table_stage
from meshplan.schedule.step_summary import StepTime


def step_breakdown(st: StepTime) -> dict[str, float]:
    """Parts of ``st`` on its critical stage (:meth:`StepTime.parts_s`), seconds; key ``step``
    is the step time itself."""
    return {"step": st.step_s, **st.parts_s()}


def stage_flops(st: StepTime) -> float:
    """FLOP one GPU of ``st``'s critical stage executes per step (hardware FLOP: recompute
    included), what its ``compute`` part is spent on: the micro-batches x its chunks' layers,
    embedding and head."""
    return st.pipeline.spec.m * st.runs * sum(x.flops("hardware") for ch in st.units.chunks[st.critical_stage]
                                    for x in (*ch.layers, ch.embed, ch.head) if x is not None)


def compute_stream_copies_s(plan: Plan, st: StepTime) -> float:
    """Seconds per step ``st``'s critical stage spends on its compute stream in its collectives'
    copies and host work, part of its ``compute`` without being FLOP: FSDP2's copy-out after each
    all-gather and copy-in before each reduce-scatter (``CollectiveRow.copy_s``, what ``step``'s
    "FSDP2 copies on the compute stream" note sums) and DeepSpeed ZeRO-3 2021's list copies issued
    (``CollectiveRow.host_s``)."""
    rows = plan.collectives[table_key(table_stage(st.critical_stage, len(plan.stages)))]
    return float(sum((r.copy_s + r.host_s) * r.per_step for r in rows))


#: The parts :func:`compute_split` splits a step's ``compute`` into, as the explanation names them.
SPLIT_PARTS = ("GEMMs", "attention", "copies on the compute stream", "other (memory-bound ops, optimizer step)")
#: The part :func:`compute_split` itemises with ``contention``: the kernels' slowdown while collectives'
#: NCCL channels hold SMs (:meth:`~meshplan.schedule.step_summary.StepTime.contention_s`).
SM_CONTENTION = "SM contention (NCCL channels)"


def compute_split(plan: Plan, st: StepTime, contention: bool = False) -> dict[str, float]:
    """``st``'s ``compute`` part (:func:`step_breakdown`) split by kernel kind, seconds per step on
    its critical stage: the GEMMs' and the attention core's ops (``Op.kind`` "gemm", "attention";
    recompute included) of its chunks x micro-batches x schedule runs, the collectives' copies on
    the compute stream (:func:`compute_stream_copies_s`), and the rest (norms, residual adds,
    activations, casts, issue overheads, the optimizer step), so that the four add up to
    ``compute``. Keys: :data:`SPLIT_PARTS`. The ops' seconds are their own, unslowed: the rest
    also holds the SM contention (the kernels' slowdown beside collectives,
    :meth:`~meshplan.schedule.step_summary.StepTime.contention_s`) unless ``contention``, which
    moves it to a fifth part, :data:`SM_CONTENTION` (``compare``'s split and the search's, whose
    explanation names it rather than calling it memory-bound ops)."""
    kinds = {"gemm": 0.0, "attention": 0.0}
    for ch in st.units.chunks[st.critical_stage]:
        for cost in (*ch.layers, ch.embed, ch.head, ch.batch):
            for o in cost.ops if cost is not None else ():
                if o.kind in kinds:
                    kinds[o.kind] += o.seconds
    passes = st.pipeline.spec.m * st.runs
    gemm, attention = passes * kinds["gemm"], passes * kinds["attention"]
    copies = compute_stream_copies_s(plan, st)
    rest = st.parts_s().get("compute", 0.0) - gemm - attention - copies
    if not contention:
        return dict(zip(SPLIT_PARTS, (gemm, attention, copies, rest)))
    slowed = st.contention_s()
    return dict(zip((*SPLIT_PARTS, SM_CONTENTION), (gemm, attention, copies, rest - slowed, slowed)))


def layer_passes(st: StepTime) -> int:
    """Forward passes of one layer on ``st``'s critical stage per step: the layers of its
    chunks x the micro-batches (what a per-layer cost such as cp's all-gathers is paid per)."""
    return sum(len(ch.layers) for ch in st.units.chunks[st.critical_stage]) * st.pipeline.spec.m
