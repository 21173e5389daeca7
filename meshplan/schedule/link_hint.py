"""The line of a step bound by one link's traffic (newcomer trial hints19 #2).

Exposed time alone can miss a step bound by the network: Llama-3.1-70B at dp_shard 64 x tp 8 on
64 dgx-a100-40gb (full recompute, micro_batch 1, 8 micro-batches) exposes 7.6% of its 30.05 s
step on fsdp and 15.7% on tp, so neither the FSDP hint nor the TP hint speaks (async TP's hidden
tp turns into fsdp wait), yet each node's NICs carry 553.6 GB of FSDP traffic per step and are
busy 22.15 s of the 23.05 s window they must fit in (96%), and the FSDP knobs that cut that
traffic shorten the step: ``reshard_after_forward = false`` 27.95 s (-7.0%),
``micro_batch = 2`` 28.20 s (-6.2%) (tests/test_link_hint.py).

The numbers are the edge-load table's (:func:`meshplan.schedule.linkload.edge_loads`: bytes per
step / line rate against the stage's compute time, the window the table names). Where the
busiest edge of stage 0 (or of the stage whose ranks send the most,
:func:`~meshplan.schedule.link_spill.heaviest_nic_stage`) is busy :data:`LINK_BOUND_SHARE` of
its window or more, one line names the edge, its busy time, the collectives that load it (bytes
per step on that edge, by stream, phase and op) and, where those are FSDP's re-gathers, the FSDP
knobs (:func:`~meshplan.schedule.verdict.fsdp_knobs`) re-planned as the FSDP hint does
(:func:`~meshplan.schedule.verdict.exposed_hint`: those that fit with a step more than 1% shorter,
or each knob's outcome when none does).
"""

from __future__ import annotations

from typing import Callable, Optional

from meshplan.plan import Plan
from meshplan.schedule.link_spill import heaviest_nic_stage
from meshplan.schedule.linkload import EdgeLoad, edge_loads
from meshplan.schedule.hint_facts import Hint, HintLine, Knob
from meshplan.schedule.netload import network_loads
from meshplan.schedule.verdict import Replanned, fsdp_knobs, replanned_knobs, stream_of
from meshplan.spec.search import TIE
from meshplan.units import GB, step_seconds

#: Share of its window (the stage's compute time) an edge must be busy for the step to be called
#: bound by its traffic. A judgement, not a measured constant: at 80% the traffic has under a
#: quarter of its own length of compute-free slack left, so any wait (blocking TP, the copies on the
#: compute stream) exposes it; the hints19 trial's NICs were at 96%.
LINK_BOUND_SHARE = 0.80


#: Share of the edge's bytes under which a collective is summed into ``others`` (:func:`_shown`):
#: a wording choice, so the line names what loads the edge and not every small call.
MINOR = 0.01


def _busiest(plan: Plan, st) -> Optional[tuple[int, EdgeLoad, list[EdgeLoad]]]:
    """(stage, its busiest edge by busy / window, that stage's loads) over stage 0 and the stage
    whose ranks send the most (meshplan.schedule.stage_traffic); None without edges."""
    stages = [0] + [s for s in [heaviest_nic_stage(plan, st) if len(plan.stages) > 1 else None] if s]
    best = None
    for s in stages:
        loads = [e for e in edge_loads(plan, st, s) if e.interval_s > 0 and e.capacity_bytes_per_s]
        for e in loads:
            if best is None or e.busy_s / e.interval_s > best[1].busy_s / best[1].interval_s:
                best = (s, e, loads)
    return best


def _edge_words(edge: EdgeLoad, loads: list[EdgeLoad]) -> str:
    """``node 0's NICs (8 of 8 alike, each 553.6 GB per step)``, or the one edge as the table names it."""
    kind = "NIC" if " NIC " in edge.edge else "uplink" if "uplink" in edge.edge else ""
    same = [e for e in loads if kind and (f" {kind}" in e.edge) and abs(e.bytes_per_step - edge.bytes_per_step)
            <= 1e-9 * edge.bytes_per_step]
    if len(same) < 2:
        return f"{edge.edge} ({edge.bytes_per_step / GB:.1f} GB per step)"
    node = edge.edge.split(" NIC ")[0] if kind == "NIC" else edge.edge.split("(")[-1].rstrip(")")
    what = "NICs" if kind == "NIC" else "rail uplinks to the spine"
    total = sum(1 for e in loads if f" {kind}" in e.edge)
    return f"{node}'s {what} ({len(same)} of {total} alike, each {edge.bytes_per_step / GB:.1f} GB per step)"


def _traffic(plan: Plan, st, stage: int, edge: EdgeLoad) -> dict[tuple[str, str], float]:
    """Bytes per step on ``edge`` by (stream, "phase op"), from ``stage``'s collective rows as
    :func:`~meshplan.schedule.linkload.edge_loads` counts them (NVLink: each row's in-node bytes;
    a NIC or uplink: :func:`~meshplan.schedule.linkload.network_loads` of the row alone, on
    ``stage``'s ranks; an uplink's other stages on the same leaf add their own rows, not listed)."""
    rows = [r for r in plan.stage(stage).collectives if r.per_step]
    out: dict[tuple[str, str], float] = {}
    node = int(plan.placement.node[st.example_ranks[stage]])
    passes = plan.micro_batches * len(plan.stage(stage).layers)
    for r in rows:
        if " NIC " in edge.edge or "uplink" in edge.edge:
            nics, up = network_loads(plan, [r], passes, node, stage)  # this stage's rows on its own ranks
            key = next((i for i, n in enumerate(plan.config.cluster.node.nics) if f"NIC {n.name} " in edge.edge), -1)
            got = nics.get(key, (0.0,))[0] if " NIC " in edge.edge else up.get(_rail(edge), (0.0,))[0]
        else:
            got = r.link_bytes[0] * r.per_step
        if got > 0:
            k = (stream_of(r), f"{r.phase} {r.op}")
            out[k] = out.get(k, 0.0) + got
    return out


def _kind(edge: EdgeLoad) -> str:
    """The edge's kind as the line names it: ``the NICs'``, ``the rail uplinks'``, ``NVLink``."""
    return "the NICs'" if " NIC " in edge.edge else "the rail uplinks'" if "uplink" in edge.edge else "NVLink"


def _shown(st, traffic: dict[tuple[str, str], float]) -> str:
    """The collectives on the edge, most bytes first, each with its bytes per step; those under
    :data:`MINOR` of the edge's bytes summed as ``others``:
    ``fsdp backward reduce-scatter 277.9 GB, fsdp forward all-gather 138.9 GB, ...``."""
    total = sum(traffic.values())
    items = sorted(traffic.items(), key=lambda kv: -kv[1])
    big = [(k, b) for k, b in items if b >= MINOR * total]
    rest = total - sum(b for _, b in big)
    words = [f"{st.named(s)} {op} {b / GB:,.1f} GB" for (s, op), b in big]
    return ", ".join(words + ([f"others {rest / GB:,.1f} GB"] if rest / GB >= 0.05 else [])) or "no collective"


def _rail(edge: EdgeLoad) -> int:
    """The rail of an uplink row ``rail 3 uplinks to spine (nodes 0-31)``."""
    return int(edge.edge.split()[1])


def _knob_list(st, found, alternatives) -> tuple[str, list[Knob]]:
    """(``: shorter with K (step ..., -7.0%, peak ... fits); ...`` for the knobs faster by more than
    :data:`TIE`, best first, or ``: none of its knobs ... (outcomes)``; those knobs' facts)
    (:func:`~meshplan.schedule.verdict.replanned_knobs`)."""
    faster, tried, knobs = replanned_knobs(st.step_s, found, alternatives)
    if faster:
        return ": shorter with " + "; ".join(faster), knobs
    return (f": none of the FSDP knobs re-planned fits with a step more than {TIE:.0%} shorter "
            f"({tried or 'no knob'})"), []


def link_bound_hint(plan: Plan, st, alternatives: Optional[Callable[[dict], Replanned]], *,
                    knobs_listed: bool = False, ep_listed: bool = False) -> list[str]:
    """The line for a step whose busiest edge is busy :data:`LINK_BOUND_SHARE` of its window or
    more (module docstring), empty otherwise. ``hint:`` with the FSDP knobs re-planned by
    ``alternatives`` (:func:`~meshplan.schedule.verdict.rebuilt_step`) where the edge carries FSDP
    traffic with knobs; ``knobs_listed``: an earlier line (the FSDP hint, the verdict's cause)
    re-planned them already, and this one points there; ``ep_listed``: the ep line
    (:mod:`~meshplan.schedule.ep_hint`) re-planned ep inside a node, which the note points to where
    the edge carries ep traffic. ``note:`` where no knob applies."""
    found = _busiest(plan, st)
    if found is None:
        return []
    stage, edge, loads = found
    share = edge.busy_s / edge.interval_s
    if share < LINK_BOUND_SHARE:
        return []
    traffic = _traffic(plan, st, stage, edge)
    head = (f"the step is bound by {_kind(edge)} traffic: {_edge_words(edge, loads)} busy {edge.busy_s:.2f} s of the "
            f"{edge.interval_s:.2f} s window ({share:.0%}; stage {stage}'s compute time, the edge-load table's; "
            f"the step is {step_seconds(st.step_s)}) with {_shown(st, traffic)}")
    streams = {s for s, _ in traffic}
    knobs = next((k for s in ("fsdp", "efsdp") if s in streams and (k := fsdp_knobs(plan, s)) and k[1]), None)
    if knobs is None and ep_listed and "ep" in streams:
        return [f"note: {head}; ep inside a node cuts its ep traffic: the ep line above"]
    if knobs is None or alternatives is None:
        return [f"note: {head}; no knob meshplan re-plans cuts it"]
    if knobs_listed:
        return [f"note: {head}; the FSDP knobs that cut it: the line above"]
    words, facts = _knob_list(st, knobs[1], alternatives)
    return [HintLine(f"hint: {head}{words}", Hint("link", share, tuple(facts)))]
