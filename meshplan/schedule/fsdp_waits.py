"""The FSDP waits of a pipelined step apart from the schedule's bubble: the pipeline simulated
again with every unit shortened by the time its compute stream waits inside it for FSDP, and
``step``'s line that splits the busiest stage's idle into the schedule's bubble and what those
waits add (read by :class:`~meshplan.schedule.step_summary.StepTime`, which keeps the re-simulated
pipeline once per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from meshplan.pipeline.fast import ArrayResult
from meshplan.schedule.pipeline_exposure import pipeline_without
from meshplan.units import rounded_to_total

if TYPE_CHECKING:
    from meshplan.schedule.step_summary import StepTime

#: Streams of FSDP's collectives a unit's compute stream can wait for: fsdp (dp_shard x cp),
#: efsdp (the routed experts'), dp_replicate (HSDP's all-reduce after the reduce-scatter).
FSDP_STREAMS = ("fsdp", "efsdp", "dp_replicate")

#: The bubble line's note where units wait for FSDP under pp: idle/ideal counts those waits as
#: busy time (:func:`fsdp_wait_line` shows them apart).
WAITS_BUSY = ", the units' FSDP waits counted as busy"


def pipeline_without_fsdp_waits(st: StepTime) -> Optional[ArrayResult]:
    """The pipeline of ``st`` simulated again with every unit shortened by the time its compute
    stream waits inside it for FSDP (:data:`FSDP_STREAMS`: an all-gather not hidden, and after a
    chunk's last backward torch 2.13's ``PipelineStage.perform_reduce_grad``: ``_add_reduce_grad``
    schedules it right after that backward, and its ``_root_post_backward_final_callback`` ->
    ``FSDPParamGroup.finalize_backward`` makes the compute stream wait for the chunk's
    reduce-scatters before the stage's next unit); None with pp 1 or no such wait."""
    res = st.pipeline
    if res.spec.p == 1:
        return None
    keys, idx = st.unit_index if st.unit_index else st.units.index(res.flat)
    waits = np.array([sum(v for k, v in st.units.by_key(key).exposed_s.items() if k in FSDP_STREAMS)
                      for key in keys])[idx]
    return pipeline_without(res, waits) if waits.any() else None


def fsdp_wait_line(st: StepTime) -> list[str]:
    """The FSDP waits apart from the schedule's bubble (:meth:`StepTime.without_fsdp_waits`), in
    seconds on the busiest stage s, which add up: its idle and FSDP-wait time
    ``step - busy_bare[s]`` = the schedule's bubble ``step_bare - busy_bare[s]`` + what the
    waits add to the pipeline ``step - step_bare`` (>= 0: waits only lengthen units), and as
    ratios over the stage's compute without the waits ``busy_bare[s]`` (one denominator, so
    the ratios add up too; the bubble line's idle/ideal counts the waits as busy instead)."""
    bare = st.without_fsdp_waits()
    if bare is None:
        return []
    p, s = st.pipeline, st.pipeline.busiest_stage
    c = float(bare.busy_s[s])
    y, z = bare.step_s - c, p.step_s - bare.step_s
    each = ", each run" if st.runs > 1 else ""
    # each sum printed as its terms rounded to add up (largest remainder, as StepTime.parts_line)
    ms = rounded_to_total({"y": y * 1e5, "z": z * 1e5}, round((y + z) * 1e5))
    r = rounded_to_total({"y": y / c * 1e4, "z": z / c * 1e4}, round((y + z) / c * 1e4))
    return [f"bubble and FSDP waits on stage {s}: {(ms['y'] + ms['z']) / 100:.2f} ms = the schedule's bubble "
            f"{ms['y'] / 100:.2f} ms (simulated without the units' FSDP waits) + {ms['z'] / 100:.2f} ms the FSDP "
            f"waits add (all-gathers not hidden; after each chunk's last backward perform_reduce_grad's "
            f"reduce-scatters, which the compute stream waits for: the pipeline {bare.step_s * 1e3:.2f} -> "
            f"{p.step_s * 1e3:.2f} ms{each}); over its compute without the waits: {(r['y'] + r['z']) / 1e4:.4f} = "
            f"{r['y'] / 1e4:.4f} + {r['z'] / 1e4:.4f}", _headline_line(p, s, c, y + z)]


def _headline_line(p: ArrayResult, s: int, bare_busy: float, idle_and_waits: float) -> str:
    """What the bubble line's idle/ideal (``p.bubble``) is made of, in the terms of the line above
    (newcomer trial nc56 #6: 0.0787 beside a schedule's bubble of 407.57 ms and 373.70 ms of waits
    read as neither): stage ``s``'s own FSDP waits ``w = busy[s] - bare_busy`` (its units lengthened
    by them) count as busy there, so its idle ``step - busy[s]`` is ``idle_and_waits - w`` (the
    schedule's bubble and the waits of the stages it waits for), over ``busy[s]``, its compute with
    its waits; the printed idle and w add up to the line above's total (largest remainder)."""
    w = float(p.busy_s[s]) - bare_busy
    ms = rounded_to_total({"idle": p.idle_s * 1e5, "w": w * 1e5}, round(idle_and_waits * 1e5))
    return (f"the bubble line's {p.bubble:.4f} idle/ideal = stage {s}'s idle {ms['idle'] / 100:.2f} ms / its compute "
            f"with its own FSDP waits {float(p.busy_s[s]) * 1e3:.2f} ms; its idle is the {(ms['idle'] + ms['w']) / 100:.2f} "
            f"ms above less those waits, {ms['w'] / 100:.2f} ms, counted as busy there (what it keeps is the schedule's "
            f"bubble and the waits of the stages it waits for)")
