"""What the critical stage's bubble waits for (issue 11, a newcomer's finding): on DeepSeek-V3 at
pp 16 x ep 64 the dense first stage ends the step, and its bubble (36.8 s of a 51.5 s step) is
not the schedule's: every expert stage exposes its ep all-to-alls over the network (stage 1:
25.6 s per step), so stage 0 waits for them.

The split is measured on the simulated timeline, as :meth:`StepTime.without_fsdp_waits
<meshplan.schedule.step_summary.StepTime.without_fsdp_waits>` splits the FSDP waits: the pipeline
is simulated again with every unit (every stage's) shortened by the time its compute stream
spends on the stream's exposed collectives (:func:`~meshplan.schedule.pipeline_exposure.pipeline_without`),
and the critical stage's bubble is counted in both the same way
(:func:`~meshplan.schedule.pipeline_exposure.stage_bubble`). What the bubble loses is the part of it spent
waiting for that stream on the other stages; the rest is the schedule's fill and drain and the
stages' unequal compute. The stream is the one the most exposing stage
(:meth:`~meshplan.schedule.step_summary.StepTime.most_exposed_stage`) exposes the most, pp aside
(the transfers are the pipeline's own).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from meshplan.schedule.pipeline_exposure import last_tail_s, pipeline_without, run_shift, stage_bubble
from meshplan.schedule.step_summary import StepTime
from meshplan.spec.mesh_words import stage_list


class BubbleWait(NamedTuple):
    """The critical stage's bubble and its part spent waiting for ``stream`` on the other
    stages, seconds per step. ``stage``: the stage exposing the most communication
    (``exposed_s`` of it on ``stream``, its units, per step); ``bubble_s``: the critical stage's
    bubble (:meth:`StepTime.parts_s`); ``bare_bubble_s``: the same count on the pipeline
    simulated again without any unit's exposed ``stream``."""

    stream: str
    stage: int
    exposed_s: float
    bubble_s: float
    bare_bubble_s: float
    stages: tuple[int, ...]  # every stage exposing as much on ``stream`` (within 1e-9), ``stage`` first

    @property
    def wait_s(self) -> float:
        """Seconds of the critical stage's bubble spent waiting for ``stream`` (>= 0)."""
        return max(0.0, self.bubble_s - self.bare_bubble_s)


def bubble_wait(st: StepTime) -> Optional[BubbleWait]:
    """:class:`BubbleWait` of a step whose most exposing stage is not the critical one
    (:meth:`StepTime.most_exposed_stage`) and exposes something besides pp; else None."""
    most = st.most_exposed_stage()
    if most is None:
        return None
    streams = {k: v for k, v in most[1].items() if k != "pp" and v > 0}
    if not streams:
        return None
    stream = max(streams, key=lambda k: streams[k])
    res, s = st.pipeline, st.critical_stage
    keys, idx = st.unit_index if st.unit_index else st.units.index(res.flat)
    waits = np.array([st.units.by_key(k).exposed_s.get(stream, 0.0) for k in keys])[idx]
    per_stage = np.bincount(np.arange(len(idx)) // res.flat.length, weights=waits, minlength=res.spec.p)
    alike = np.flatnonzero(np.abs(per_stage - per_stage[most[0]]) <= 1e-9 * per_stage[most[0]]).tolist()
    bare = pipeline_without(res, waits)
    later = (st.runs - 1, run_shift(bare, st.units)) if st.runs > 1 else (0, 0.0)
    return BubbleWait(stream, most[0], streams[stream], st.parts_s()["bubble"],
                      stage_bubble(bare, s, last_tail_s(bare, s, st.units), *later),
                      tuple([most[0]] + [k for k in alike if k != most[0]]))


def bubble_wait_line(st: StepTime, bw: BubbleWait) -> str:
    """``bubble on stage 0: 36800.11 ms, of which 28458.41 ms waiting for the ep communication
    the other stages expose (stages 1-14 the most: 25644.63 ms each per step) ...``: the bubble as the
    parts line prints it (:meth:`StepTime.shown_ms`), the wait and the bare bubble rounded to
    add up to it."""
    s, shown = st.critical_stage, st.shown_ms()["bubble"]
    bare = round(float(shown) * 100) - round(bw.wait_s * 1e5)
    return (f"bubble on stage {s}: {shown} ms, of which {round(bw.wait_s * 1e5) / 100:.2f} ms waiting for the "
            f"{bw.stream} communication the other stages expose ({stage_list(bw.stages)} the most: "
            f"{bw.exposed_s * 1e3:.2f} ms{' each' if len(bw.stages) > 1 else ''} per step); the pipeline simulated "
            f"again without any unit's exposed {bw.stream} leaves stage {s} {bare / 100:.2f} ms idle")
