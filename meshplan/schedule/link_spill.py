"""Where the network traffic goes when a NIC's edge-load line says it DOES NOT FIT
(:func:`meshplan.schedule.linkload.edge_loads`).

An edge's busy time (bytes / line rate) is checked against the **window** its traffic is meant
to hide in: the stage's compute time per step (its units' compute events, every schedule run:
forward, backward and recompute kernels; not the step, which also holds the exposed
communication, the bubble and the optimizer step). Traffic over that window is not all exposed:
on the rank timeline (:class:`~meshplan.schedule.linkload.StageDetail`) the streams that cross
the NICs (the plan's collective rows on a ``network`` path, each on its stream:
:func:`~meshplan.schedule.verdict.stream_of`) run on past the compute, and of that time:

- the compute stream's waits for them are their exposed time (the parts line's
  ``exposed fsdp``: :attr:`~meshplan.schedule.step_summary.StepTime.exposed_s`);
- the rest runs while the compute stream waits for another stream (blocking TP collectives),
  or idles in the pipeline bubble: hidden there, and exposed once that wait goes (async TP).

:func:`network_spill` measures it on the timeline: its segments between consecutive event
boundaries, each with the streams running in it (seconds per step, every schedule run).
Llama-3-70B at dp_shard 16 x tp 8 on 16 dgx-h100 (seq 8192, micro_batch 1, full recompute,
blocking TP): fsdp runs 1410.94 ms against 1097.69 ms of compute; 333.19 ms of it beside no
compute, of which 54.05 ms exposed (as the parts line prints it) and 279.14 ms while the compute
waits for tp; with async TP the exposed fsdp is 227.86 ms (tests/test_link_spill.py).

The edge-load table is stage 0's; :func:`heaviest_nic_stage` names the stage whose links are
loaded most when that is another (:func:`meshplan.schedule.stage_traffic.traffic_stage`, the
one home of that choice: the stage whose ranks send the most over the network), and step prints
that stage's table too (:func:`other_stage_loads`: a MoE model whose dense first stage sends
nothing over ep, while the expert stages' all-to-alls cross the NICs; or a dense model's middle
stages, a layer more than stage 0's), labelled, whether or not its edges fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from meshplan.errors import ConfigError
from meshplan.plan import Infeasible, Plan, build_plan
from meshplan.schedule.linkload import StageDetail, compute_window_s, edge_loads
from meshplan.schedule.netload import network_loads
from meshplan.schedule.pipeline_exposure import unit_exposure
from meshplan.schedule.stage_traffic import traffic_stage
from meshplan.schedule.verdict import stream_of


@dataclass(frozen=True)
class Spill:
    """The network streams of one stage on its timeline, seconds per step (module docstring).

    ``streams``: the streams crossing the NICs; ``busy_s``: the time any of them runs;
    ``window_s``: the stage's compute time (the edge-load lines' window); ``spill_s``: the part
    of ``busy_s`` while the compute stream runs nothing; ``exposed_s``: the compute stream's
    waits for them; ``beside``: per other stream, the time it runs during the spill."""

    stage: int
    streams: tuple[str, ...]
    busy_s: float
    window_s: float
    spill_s: float
    exposed_s: float
    beside: dict

    @property
    def hidden_elsewhere_s(self) -> float:
        """The spill not exposed: run while the compute waits for another stream or idles."""
        return max(self.spill_s - self.exposed_s, 0.0)


def network_streams(plan: Plan, stage: int = 0) -> tuple[str, ...]:
    """Streams of ``stage``'s collective rows on a ``network`` path (sorted)."""
    return tuple(sorted({stream_of(r) for r in plan.stage(stage).collectives
                         if r.path.kind == "network" and r.per_step}))


def network_spill(plan: Plan, st, stage: int = 0) -> Optional[Spill]:
    """:class:`Spill` of ``stage`` (``st``: its :class:`~meshplan.schedule.step_summary.StepTime`),
    None where no network stream runs on it."""
    d = StageDetail.cached(st, stage)
    streams = tuple(s for s in network_streams(plan, stage) if s in d.streams)
    if not streams:
        return None
    active = _active(d)
    dt = active.pop("")
    net = np.any([active[s] for s in streams], axis=0)
    spill = net & ~active["compute"]
    beside = {k: float(dt[spill & v].sum()) * st.runs for k, v in active.items()
              if k != "compute" and k not in streams and (spill & v).any()}
    return Spill(stage, streams, float(dt[net].sum()) * st.runs, compute_window_s(st, stage),
                 float(dt[spill].sum()) * st.runs, sum(_exposed(st, stage).get(s, 0.0) for s in streams),
                 beside)


def _active(d: StageDetail) -> dict:
    """Per stream, whether it runs in each segment between consecutive event boundaries (key
    ``""``: the segments' lengths, seconds)."""
    keep = d.end > d.start
    t = np.unique(np.concatenate([d.start[keep], d.end[keep]]))
    mid = (t[:-1] + t[1:]) / 2
    names = sorted(set(d.streams))
    code = d.of_table([names.index(s) for s in d.streams])
    out = {"": np.diff(t)}
    for i, name in enumerate(names):
        m = keep & (code == i)
        started = np.searchsorted(np.sort(d.start[m]), mid, side="right")
        out[name] = started - np.searchsorted(np.sort(d.end[m]), mid, side="right") > 0
    return out


def _exposed(st, stage: int) -> dict:
    """Exposed seconds per stream of ``stage``: the parts line's on the critical stage, else its units'."""
    if stage == st.critical_stage:
        return dict(st.exposed_s)
    res = st.pipeline
    keys, idx = st.unit_index if st.unit_index else st.units.index(res.flat)
    return {k: v * st.runs for k, v in unit_exposure(res, stage, st.units, keys, idx, {}).items()}


def spill_line(plan: Plan, st, spill: Spill, step_fn=None) -> str:
    """The line under the edge loads when a NIC does not fit its window: how long the network
    streams run against the window, how much of it while no compute runs and where that goes
    (exposed, or under another stream's wait), and, where blocking TP hides some of it and
    ``step_fn`` is given, the exposed time with async TP (:func:`async_tp_exposed`). On the
    critical stage the exposed time is the parts line's, as it prints it
    (:meth:`~meshplan.schedule.step_summary.StepTime.shown_ms`)."""
    names = "+".join(st.named(s) for s in spill.streams)
    parts = " and ".join(st.named(s) for s in spill.streams)
    exposed_ms = _shown(st, spill)
    crit = spill.stage == st.critical_stage
    head = (f"where the NICs' traffic goes: on stage {spill.stage}'s timeline {names} runs {spill.busy_s * 1e3:.2f} ms "
            f"(its collectives' modelled times) against the window's {spill.window_s * 1e3:.2f} ms of compute; "
            f"{spill.spill_s * 1e3:.2f} ms of it while no compute runs, of which {exposed_ms:.2f} ms exposed"
            f"{' (the parts line' + chr(39) + 's exposed ' + parts + ')' if crit else ''}")
    rest = spill.spill_s * 1e3 - exposed_ms
    if round(rest * 100) <= 0:
        return head
    under = sorted((k for k, v in spill.beside.items() if v > 1e-4), key=lambda k: -spill.beside[k])
    where = (" or ".join(f"waits for {st.named(k)} (exposed {st.named(k)})" for k in under) if under else "idles")
    line = f"{head} and the other {rest:.2f} ms while the compute stream {where}, hidden there"
    if "tp" in under and step_fn is not None:
        line += async_tp_exposed(plan, st, spill, step_fn)
    return line


def _shown(st, spill: Spill) -> float:
    """``spill``'s exposed milliseconds: on the critical stage as the parts line prints them."""
    if spill.stage != st.critical_stage:
        return round(spill.exposed_s * 1e5) / 100
    shown = st.shown_ms()
    return sum(float(shown.get(f"exposed {s}", "0")) for s in spill.streams)


def async_tp_exposed(plan: Plan, st, spill: Spill, step_fn) -> str:
    """``; with async TP (...) tp no longer hides it: exposed fsdp 54.06 -> 227.86 ms, step
    1460.14 -> 1436.69 ms``:
    ``plan`` re-planned with ``training.tp_comm_overlap = true`` (under framework torch with
    ``torch_compile = true``, which torchtitan's async TP needs) and stepped by ``step_fn``;
    empty where the re-plan is refused or infeasible, or exposes no more of these streams."""
    t = plan.config.training
    if t.tp_comm_overlap:
        return ""
    update = {"tp_comm_overlap": True} | ({"torch_compile": True} if t.framework == "torch" else {})
    try:
        alt = build_plan(replace(plan.config, training=t.model_copy(update=update)))
    except (ConfigError, ValueError):
        return ""
    if isinstance(alt, Infeasible) or not alt.feasible:
        return ""
    on = step_fn(alt)
    before, after = _shown(st, spill), _shown(on, replace(spill, exposed_s=sum(
        _exposed(on, spill.stage).get(s, 0.0) for s in spill.streams)))
    if after <= before:
        return ""
    knobs = ", ".join(f"training.{k} = true" for k in update)
    names = "+".join(on.named(s) for s in spill.streams)
    return (f"; with async TP ({knobs}) tp no longer hides it: exposed {names} {before:.2f} -> {after:.2f} ms, "
            f"step {st.shown_ms()['step']} -> {on.shown_ms()['step']} ms")


def nic_bytes_per_stage(plan: Plan, st) -> list[float]:
    """Bytes per step on the busiest NIC of each stage's first node (``st.example_ranks``), from
    the stage's own collective rows (:func:`network_loads`, no timeline needed): 0 for a stage
    whose rows cross no NIC (a MoE model's dense first stage at ep across nodes)."""
    out = []
    for stage, rank in enumerate(st.example_ranks):
        rows = plan.stage(stage).collectives
        nics, _ = network_loads(plan, rows, 1, int(plan.placement.node[rank]), stage)
        out.append(max((v[0] for v in nics.values()), default=0.0))
    return out


def heaviest_nic_stage(plan: Plan, st=None) -> int | None:
    """The stage whose links are loaded most
    (:func:`~meshplan.schedule.stage_traffic.traffic_stage`: its ranks send the most bytes per
    step over the network), None with one stage or where that is stage 0 (within 1e-9): the
    table of stage 0 already shows the busiest links then. ``st`` is unused (the choice is the
    collective tables', no timeline needed); kept so callers pass their step."""
    if len(plan.stages) == 1:
        return None
    return traffic_stage(plan) or None


def other_stage_loads(plan: Plan, st) -> Optional[tuple[int, list]]:
    """(stage, its :func:`~meshplan.schedule.linkload.edge_loads`) for :func:`heaviest_nic_stage`,
    the second edge-load table step prints, whether or not its edges fit; None where stage 0's
    links are loaded most. Llama-3-405B at pp 16: stage 1 (8 layers, 122.3 GB per rank per step
    on the network) against stage 0 (7 layers, 116.2 GB)."""
    heavy = heaviest_nic_stage(plan, st)
    return None if heavy is None else (heavy, edge_loads(plan, st, heavy))


def stage_fits(loads: list) -> bool:
    """Whether every NIC and rail uplink of an edge-load table fits its window (NVLink aside:
    the spill line is the network's)."""
    return all(e.fits for e in loads if "NIC" in e.edge or "uplink" in e.edge)
