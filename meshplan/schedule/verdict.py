"""What bounds a predicted step: a one- or two-line verdict for ``meshplan step``.

The step is **network-bound** when its critical stage waits on communication for at least
half of the step: the exposed time of :class:`meshplan.schedule.step_summary.StepTime`, summed over its
streams, plus the part of its bubble spent waiting for a stream another stage exposes
(:mod:`meshplan.schedule.waits`, printed on a line of its own). The verdict then names the stream
with the most of that time, its collectives on the stage that exposes it with the bytes each rank
sends per step (full buffer S x busbw factor x calls per step, as :mod:`meshplan.schedule.linkload`
counts them) and the link they cross (an all-to-all across nodes at each rank's share of its own
NIC, :attr:`meshplan.comm.row.Path.nic_bandwidth_bytes_per_s`).

When that stream is FSDP's (zero3 / hsdp units re-gathered and reduce-scattered every
micro-batch; under a pipeline FSDP2's gathers, :mod:`meshplan.schedule.fsdp_knobs`), a second line names the cause: the micro-batches per step
(``global_batch / (micro_batch x dp)``) multiply every layer's all-gather (twice with
``training.reshard_after_forward = true``: forward and again in backward) and its gradient
reduce-scatter; the knobs that cut them are ``training.grad_accumulation`` (``no_sync``:
one reduce-scatter per step; ``no_sync_unsharded``: also one forward gather per step),
``training.reshard_after_forward = false`` and a larger ``training.micro_batch``. ``alternatives`` (the plan rebuilt with each knob) adds the
predicted step, or the memory reason that rules the knob out.

Under the network-bound share, an FSDP stream exposing :data:`HINT_SHARE` of the step or more
gets a ``hint:`` line instead (:func:`exposed_hint`): the same knobs re-planned, only those that
fit and give a step shorter by more than :data:`~meshplan.spec.search.TIE` (1%, :func:`clearly_faster`)
listed, each with its step, its change against this step and its peak.
"""

from __future__ import annotations

from typing import Callable, Optional

from meshplan.plan import Plan
from meshplan.mesh.tpsplit import KV_REPLICA
from meshplan.schedule.comm_streams import comm_kind, step_stream
from meshplan.schedule.row_groups import shard_group
from meshplan.schedule.fsdp_knobs import fsdp_knobs, one_batch_knobs
from meshplan.schedule.hint_facts import Hint, HintLine, Knob, knob_of
from meshplan.schedule.replan import Rebuilt, Replanned, Stepped, rebuilt_step  # noqa: F401 (their home before nc55fixB)
from meshplan.schedule.waits import BubbleWait, bubble_wait_line
from meshplan.spec.mesh_words import stage_list
from meshplan.spec.search import TIE
from meshplan.units import GB, GiB, counted, step_seconds

#: Exposed share of the step above which the step is called network-bound.
NETWORK_BOUND_SHARE = 0.5

#: Share of the step one stream's exposed time must reach for a ``hint:`` line under the
#: network-bound share (:func:`exposed_hint`; issue 11's newcomer trial: Llama-3-70B at
#: dp_shard 32 x tp 8 exposed 26% of its step on FSDP and ``step`` said nothing). A judgement,
#: not a measured constant: three times the 5% restart margin
#: (:data:`meshplan.spec.accuracy.RESTART_MARGIN`, issue 11's goal for the step model, itself a judgement).
HINT_SHARE = 0.15


def clearly_faster(step_s: float, alt_step_s: Optional[float]) -> bool:
    """Whether a re-planned step ``alt_step_s`` (seconds; None: it has none) is shorter than
    ``step_s`` by more than :data:`~meshplan.spec.search.TIE` (1%), the rule by which the search
    ties two steps (:mod:`meshplan.search.rank`: within ``1 + TIE`` of the faster one): a smaller
    predicted gain is within the step model's error and decides nothing. The one rule of the
    step's ``hint:`` lines (:func:`exposed_hint`, :mod:`~meshplan.schedule.host_hint`,
    :mod:`~meshplan.schedule.bubble_hint`, :mod:`~meshplan.schedule.tp_hint`,
    :mod:`~meshplan.schedule.ep_hint`, :mod:`~meshplan.schedule.link_hint`): only knobs it holds for are listed.

    >>> clearly_faster(10.0, 9.85), clearly_faster(10.0, 9.97), clearly_faster(10.0, None)
    (True, False, False)
    """
    return alt_step_s is not None and step_s > alt_step_s * (1 + TIE)


def stream_of(row) -> str:
    """The simulated stream (:mod:`meshplan.schedule.rank_timeline`) a collective row runs on."""
    kind = comm_kind(row)
    if kind == "shard":
        return "efsdp" if shard_group(row.cadence) == "expert" else "fsdp"
    if kind == "step":
        return step_stream(row)  # "dp" for the data axes, else the row's group (tp, pp, efsdp)
    return {"replica": "dp_replicate", "tp_async": "tp", "loss": "tp", "kv": KV_REPLICA}.get(kind, kind)


def network_verdict(plan: Plan, st, alternatives: Optional[Callable[[dict], "Replanned"]] = None, *,
                    bw: Optional[BubbleWait]) -> list[str]:
    """Verdict lines: where the critical stage's bubble waits for another stage's exposed
    communication (``bw``: :func:`meshplan.schedule.waits.bubble_wait` of ``st``, computed once
    by the caller, which also puts it in the step's JSON), a line saying how much; then,
    when the step is network-bound, the verdict, else the :func:`exposed_hint` line where there is
    one. ``alternatives(update)``: what the step becomes with ``training`` fields ``update``
    (:func:`rebuilt_step`).

    The critical stage's time on communication is its exposed time plus that wait: when the wait
    is its largest part, the verdict names the waited-for stream's collectives on the stage that
    exposes the most of it (DeepSeek-V3 at pp 16 x ep 64: stage 0's 28.5 s wait for the expert
    stages' ep all-to-alls, of a 51.5 s step)."""
    wait = bw.wait_s if bw is not None and round(bw.wait_s * 1e5) > 0 else 0.0  # 0.00 ms printed: none
    head = [bubble_wait_line(st, bw)] if bw is not None and wait else []
    exposed = {k: v for k, v in st.exposed_s.items() if v > 0}
    total = sum(exposed.values()) + wait
    if not total or total < NETWORK_BOUND_SHARE * st.step_s:
        return head + exposed_hint(plan, st, alternatives)
    waited = bw is not None and wait > max(exposed.values(), default=0.0)
    if bw is not None and waited:
        stream, stage, amount = bw.stream, min(bw.stages), _waited(st, bw)
    else:
        stream = max(exposed, key=lambda k: exposed[k])
        stage, amount = st.critical_stage, f"{exposed[stream]:.1f} s"
    what = "exposed communication or waiting for it" if wait else "exposed communication"
    lead = f"verdict: network-bound: {total:.1f} s of the {st.step_s:.1f} s step is {what}, most on {stream} ({amount})"
    rows = [r for r in plan.stage(stage).collectives if stream_of(r) == stream and r.per_step]
    if not rows:
        return head + [lead]
    sent: dict[str, float] = {}
    for r in rows:
        key = f"{r.phase} {r.op}"
        sent[key] = sent.get(key, 0.0) + r.sent_bytes_per_step
    ops = _sent_items(sent)
    who = f"each rank of stage {stage}" if waited else "each rank"
    crossing = sum(r.sent_bytes_per_step * network_share(r) for r in rows)
    total = sum(sent.values())
    across = ("" if not any(r.path.kind == "network" for r in rows) else ", all of it across the network"
              if crossing >= 0.999 * total else f", {crossing / GB:,.1f} GB of it across the network (the rest "
              f"over NVLink)")
    lines = [f"{lead}: {who} sends {sum(sent.values()) / GB:,.0f} GB per step on it ({ops}){across} over "
             f"{_link(max(rows, key=lambda r: r.time_s * r.per_step))}"]
    cause = _fsdp_cause(plan, stream, alternatives)
    return head + lines + ([cause] if cause else [])


def _sent_items(sent: dict[str, float]) -> str:
    """``forward all-to-all 444 GB, backward all-to-all 888 GB (444 GB of it the recompute's
    replay)`` from bytes per step by "phase op"; items printing as 0 GB left out (DeepSeek-V3's
    int64 dropless counts, 63 MB). A backward all-to-all's excess over the forward one is the
    replayed dispatch and combine of recomputed MoE layers (:mod:`meshplan.comm.ep_rows`:
    forward 2 per MoE layer, backward 2 per MoE layer + 2 per replayed one: full recompute, or
    Megatron-LM's ``moe`` recompute module)."""
    items = []
    for k, b in sent.items():
        if round(b / GB) == 0:
            continue
        replay = b - sent.get("forward all-to-all", 0.0) if k == "backward all-to-all" else 0.0
        extra = f" ({replay / GB:,.0f} GB of it the recompute's replay)" if round(replay / GB) > 0 else ""
        items.append(f"{k} {b / GB:,.0f} GB{extra}")
    return ", ".join(items)


def _waited(st, bw) -> str:
    """``stage 0 waits 28.5 s for it in its bubble; stages 1-14 expose 25.6 s of it per step each``."""
    many = len(bw.stages) > 1
    return (f"stage {st.critical_stage} waits {bw.wait_s:.1f} s for it in its bubble; {stage_list(bw.stages)} "
            f"expose{'' if many else 's'} {bw.exposed_s:.1f} s of it per step{' each' if many else ''}")


def network_share(row) -> float:
    """Share of a rank's sent bytes that cross the network on ``row``'s path: 0 inside a node; a
    ring over k ranks per node crosses nodes on 1 of its k hops per node, so 1/k (k = 8: 126 GB sent,
    15.7 GB through the rank's NIC, as the edge-load table counts it); an all-to-all over n ranks
    sends (n - k) of its n - 1 pieces off the node; a deepep row its stated network share.

    >>> from types import SimpleNamespace as N
    >>> network_share(N(op="all-gather", group_size=256, path=N(kind="network", ranks_per_node=8)))
    0.125
    >>> network_share(N(op="all-to-all", group_size=16, path=N(kind="network", ranks_per_node=8)))
    0.5333333333333333
    """
    k = max(row.path.ranks_per_node, 1)
    if row.path.kind != "network":
        return 0.0
    split = getattr(row, "split", None)
    if split is not None:  # a row that states its own bytes per link (DeepEP's dispatch)
        return split[1] / max(split[0] + split[1], 1e-30)
    if row.op == "all-to-all":
        return (row.group_size - k) / max(row.group_size - 1, 1)
    return 1.0 / k


def _link(row) -> str:
    """The link of a collective row, how its groups use the node's NICs (per group) and the
    bandwidth on it: across nodes each rank's share of its own NIC and the ring's bus bandwidth
    over the group's ranks on a node (:func:`meshplan.comm.row.axis_path`: 8 NICs x 50 GB/s under one
    group of 8 ranks a node are 50 GB/s of NIC per rank, 400 GB/s bus bandwidth), or for an
    all-to-all across nodes each rank's share of its own NIC, through which its cross-node bytes leave."""
    path = row.path
    if row.op == "all-to-all" and path.kind == "network" and path.nic_bandwidth_bytes_per_s:
        return (f"{path.kind} ({path.note}; {path.nic_bandwidth_bytes_per_s / GB:.1f} GB/s per rank: "
                f"its share of its own NIC)")
    if path.kind == "network" and path.nic_bandwidth_bytes_per_s:
        return (f"{path.kind} ({path.note}; {path.nic_bandwidth_bytes_per_s / GB:.1f} GB/s of NIC per rank, "
                f"{path.bandwidth_bytes_per_s / GB:.1f} GB/s bus bandwidth over {path.ranks_per_node} rank(s) "
                "per node)")
    return f"{path.kind} ({path.note}; {path.bandwidth_bytes_per_s / GB:.1f} GB/s per rank)"


def _fsdp_cause(plan: Plan, stream: str, alternatives) -> str:
    """The verdict's ``cause:`` line for an FSDP stream (:func:`fsdp_knobs`), each knob with what
    ``alternatives`` makes of it, or without them ``fewer with`` the knobs; empty where none applies."""
    found = fsdp_knobs(plan, stream)
    if found is None:
        return ""
    line, knobs = found
    if alternatives is None:
        return line + "; fewer with " + " or ".join(k for k, _ in knobs) if knobs else line
    return line + "; " + "; ".join(f"{k}: {alternatives(u).text}" for k, u in knobs)


def exposed_hint(plan: Plan, st, alternatives: Optional[Callable[[dict], "Replanned"]]) -> list[str]:
    """``hint:`` line for a step under the network-bound share whose critical stage exposes
    :data:`HINT_SHARE` of the step or more on an FSDP stream with knobs (:func:`fsdp_knobs`):
    each knob re-planned by ``alternatives``, those that fit with a step shorter by more than
    :data:`~meshplan.spec.search.TIE` (:func:`clearly_faster`) listed best first (shortest step) with
    their step, its change against this one and their peak (none: the line says so, with each
    knob's outcome, :func:`knob_outcome`: its peak where it does not fit, its step where it fits); no line
    without ``alternatives``. examples/llama3-70b_256xh100_dp32-tp8.toml (dp_shard 32 x tp 8, 16
    micro-batches): fsdp 26.1% of a 23.6 s step, ``no_sync`` 17.8 s (tests/test_step_hints.py).
    At 1 micro-batch the knobs are :func:`~meshplan.schedule.fsdp_knobs.one_batch_knobs`'s: a
    ``hint:`` where one is clearly faster, else ``note: no fsdp hint: ...`` saying why (newcomer
    trial 55 #4). The line is a :class:`~meshplan.schedule.hint_facts.HintLine`."""
    shares = {k: v / st.step_s for k, v in st.exposed_s.items() if k in ("fsdp", "efsdp")}
    stream = max(shares, key=lambda k: shares[k], default="")
    if alternatives is None or not stream or shares[stream] < HINT_SHARE:
        return []
    found = fsdp_knobs(plan, stream)
    one = one_batch_knobs(plan, stream) if found is None else None
    listed = found or one
    if listed is None:
        return []
    faster, tried, knobs = replanned_knobs(st.step_s, listed[1], alternatives)
    head = (f"exposed {st.named(stream)} is {shares[stream]:.1%} of the step ({st.exposed_s[stream]:.1f} s "
            f"of {step_seconds(st.step_s)}; {counted(plan.micro_batches, 'micro-batch')} per step)")
    if one is not None and not faster:
        return [f"note: no fsdp hint: {head}: {one[0]}" + (f"; {tried}" if tried else "")]
    hint = Hint(stream, shares[stream], tuple(knobs))
    if not faster:
        return [HintLine(f"hint: {head}: none of its knobs re-planned fits with a step more than {TIE:.0%} shorter "
                         f"({tried or 'no knob'})", hint)]
    return [HintLine(f"hint: {head}: shorter with " + "; ".join(faster), hint)]


def replanned_knobs(step_s: float, knobs: list[tuple[str, dict]],
                    alternatives: Callable[[dict], "Replanned"]) -> tuple[list[str], str, list[Knob]]:
    """(the knobs that fit with a step shorter than ``step_s`` by more than :data:`TIE`, each as
    ``words (step ..., -7.0%, peak ... fits)``, best first: shortest step, ties in the knob list's
    order; every knob's outcome, :func:`knob_outcome`, joined by ``; ``; the first list's knobs as
    :class:`~meshplan.schedule.hint_facts.Knob`) for the FSDP hint and the
    link hint alike (newcomer trial 23: the 16% micro-batch knob was listed, the 25% overlap_comm
    one was not; a list in knob order would put a smaller gain first)."""
    faster, tried = [], []
    for words, update in knobs:
        alt = alternatives(update)
        tried.append(f"{knob_name(update)}: {knob_outcome(step_s, alt)}")
        if alt.step_s is not None and clearly_faster(step_s, alt.step_s):
            faster.append((alt.step_s, f"{words} (step {step_seconds(alt.step_s)}, {alt.step_s / step_s - 1:+.1%}, "
                                       f"peak {alt.peak_bytes / GiB:.1f} GiB fits)", knob_of(words, alt)))
    faster.sort(key=lambda f: f[0])
    return [w for _, w, _ in faster], "; ".join(tried), [k for _, _, k in faster]


def knob_name(update: dict) -> str:
    """A knob's short name in the hint's list of outcomes: ``no_sync``, ``reshard_after_forward false``,
    ``micro_batch 2``.

    >>> knob_name({"grad_accumulation": "no_sync"}), knob_name({"reshard_after_forward": False})
    ('no_sync', 'reshard_after_forward false')
    """
    return ", ".join(str(v) if k == "grad_accumulation" else f"{k} {str(v).lower()}" for k, v in update.items())


def knob_outcome(step_s: float, alt: "Replanned") -> str:
    """Why a knob re-planned is not in the hint: its peak where it does not fit, its step where it
    fits but is not more than :data:`~meshplan.spec.search.TIE` shorter than ``step_s``, else what
    the re-plan says (infeasible or refused), without its reasons.

    >>> knob_outcome(10.0, Replanned("does not fit (...)", None, 114.9 * GiB)), knob_outcome(10.0, Replanned("x", 9.95, GiB))
    ('peak 114.9 GiB, does not fit', 'step 9.95 s (-0.5%), not 1% shorter')
    """
    if alt.step_s is not None:
        return f"step {step_seconds(alt.step_s)} ({alt.step_s / step_s - 1:+.1%}), not {TIE:.0%} shorter"
    if alt.peak_bytes > 0:
        return f"peak {alt.peak_bytes / GiB:.1f} GiB, does not fit"
    return alt.text.split(" (")[0]
