"""The ``hint:`` line of a step whose ep all-to-alls cross nodes and cost the critical stage
:data:`~meshplan.schedule.verdict.HINT_SHARE` of the step or more (newcomer trial: DeepSeek-V3 at
pp 16 x dp 64 x ep 64 on 128 dgx-h100 was network-bound on ep with no knob named, while
``meshplan search`` found ep 8 meshes about twice as fast).

The cost counted is the critical stage's exposed ep (the parts line's ``exposed ep``) plus the
part of its bubble that waits for the ep the other stages expose
(:func:`meshplan.schedule.waits.bubble_wait`, the verdict's ``waits ... for it in its bubble``).
Where rank 0's ep group spans more than one node (:func:`meshplan.plan_moe.ep_span`), every smaller
ep that keeps the group inside a node is re-planned on its own: ``ep x etp`` dividing the GPUs per
node, and valid by the ep rules (:func:`meshplan.spec.axes.ep.ep_refusal`: ep divides the experts
and ``ep x etp`` the dense block ``dp_shard x cp x tp``), efsdp re-factored to
``block / (ep x etp)`` (:class:`meshplan.mesh.resolve.Mesh`), the rest of the config kept. Those
that fit with a step shorter by more than :data:`~meshplan.spec.search.TIE` (1%,
:func:`~meshplan.schedule.verdict.clearly_faster`, the rule of every ``hint:`` line) are listed,
the fastest :data:`MAX_SHOWN` first, each with the exact edit, its step, its change and its peak.
Otherwise a ``note: no ep hint`` line says why: no valid smaller ep (each refused with its rule),
or each re-plan's outcome; both point to ``meshplan search``, which re-factors every axis.
An explicit ``mesh.rank_to_gpu`` is the user's placement and is not re-planned.
"""

from __future__ import annotations

from typing import Callable, Optional

from meshplan.plan import Plan
from meshplan.plan_moe import ep_span
from meshplan.schedule.hint_facts import Hint, HintLine, Knob, knob_of
from meshplan.schedule.verdict import HINT_SHARE, Replanned, clearly_faster, knob_outcome
from meshplan.spec.axes.base import divisors
from meshplan.spec.axes.ep import ep_choices, ep_refusal
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.search import TIE
from meshplan.spec.wording import expert_data_axis
from meshplan.units import GiB, step_seconds

#: Re-plans shown at most on the line (the fastest first), as the bubble hint's.
MAX_SHOWN = 3

#: Where a note without a hint points: the search re-factors every axis, not ep alone.
SEARCH = "`meshplan search` ranks every ep with the other axes re-factored"


def ep_cost(st, bw) -> float:
    """Seconds per step the critical stage of ``st`` spends on ep: its exposed ep plus its bubble's
    wait for the ep other stages expose (``bw``, :func:`~meshplan.schedule.waits.bubble_wait`)."""
    wait = bw.wait_s if bw is not None and bw.stream == "ep" else 0.0
    return st.exposed_s.get("ep", 0.0) + wait


def ep_spec(plan: Plan, ep: int) -> tuple[MeshSpec, str]:
    """The config's mesh spec with ``ep`` in place of its ep degree, and the edit in its fields'
    words (``mesh.shape [32, 8]`` or ``mesh.degrees {...}``)."""
    spec = plan.spec
    if spec.names is not None and spec.shape is not None:
        shape = [ep if n == "ep" else d for n, d in zip(spec.names, spec.shape)]
        return spec.model_copy(update={"shape": shape}), f"mesh.shape {shape}"
    degrees = dict(spec.degrees or {}) | {"ep": ep}
    return spec.model_copy(update={"degrees": degrees}), f"mesh.degrees {degrees}"


def inside_node(plan: Plan) -> list[tuple[int, str]]:
    """(ep, why not) for each ep below the plan's whose group ``ep x etp`` fits a node's GPUs (divides
    them), smallest last; ``why not`` "" where the ep rules accept it (:func:`ep_refusal`)."""
    mesh, gpus = plan.mesh, plan.config.cluster.node.gpus
    return [(e, ep_refusal(e, plan.config.model.experts, mesh.block_size, mesh.etp))
            for e in sorted(divisors(gpus // mesh.etp) if gpus % mesh.etp == 0 else [], reverse=True)
            if 1 < e < mesh.ep]


def _straddle(plan: Plan) -> str:
    """``; ep 9, 3 are valid but do not divide a node's 8 GPUs: some of their groups straddle two nodes``
    for the valid ep below the plan's (other than 1) whose ``ep x etp`` does not divide a node's GPUs; ""."""
    mesh, gpus = plan.mesh, plan.config.cluster.node.gpus
    odd = [e for e in ep_choices(plan.config.model.experts, mesh.block_size, mesh.etp)[::-1]
           if 1 < e < mesh.ep and gpus % (e * mesh.etp)]
    if not odd:
        return ""
    return (f"; ep {', '.join(map(str, odd))} {'are' if len(odd) > 1 else 'is'} valid but ep x etp does not divide "
            f"a node's {gpus} GPUs: some of {'their' if len(odd) > 1 else 'its'} groups straddle two nodes")


def ep_hint(plan: Plan, st, alternatives: Optional[Callable[..., Replanned]], bw) -> list[str]:
    """The module docstring's line for ``st`` (the :class:`~meshplan.schedule.step_summary.StepTime`
    of ``plan``), ``alternatives(update, mesh)`` its re-plans (:func:`~meshplan.schedule.verdict.rebuilt_step`),
    ``bw`` its bubble wait; empty where ep costs under :data:`HINT_SHARE` of the step, its group is in
    one node, or without ``alternatives``."""
    cost, mesh, waits = ep_cost(st, bw), plan.mesh, bw is not None and bw.stream == "ep" and bw.wait_s > 0
    nodes, per_node = ep_span(mesh, plan.placement)
    if alternatives is None or nodes < 2 or plan.spec.rank_to_gpu is not None or cost < HINT_SHARE * st.step_s:
        return []
    what = ("its deepep dispatches cross the NICs, once per destination node"
            if plan.config.training.moe_dispatcher == "deepep" else "its all-to-alls cross the NICs")
    head = (f"ep {mesh.ep} spans {nodes} nodes ({per_node} of its ranks on each: {what}) and "
            f"costs the critical stage {step_seconds(cost)} of the {step_seconds(st.step_s)} step "
            f"({cost / st.step_s:.1%}; exposed ep{' and its bubble waiting for ep' if waits else ''})")
    tried = inside_node(plan)
    valid = [e for e, why in tried if not why]
    if not valid:
        whys = "; ".join(why for _, why in tried) or f"etp {mesh.etp} leaves no ep > 1 inside a node"
        return [f"note: no ep hint: {head}, but no smaller ep keeps the group inside a node ({whys}{_straddle(plan)}); "
                f"{SEARCH}"]
    faster, outcomes, knobs = _replanned(plan, st, valid, alternatives)
    if not faster:
        return [f"note: no ep hint: {head}, but no ep inside a node re-planned fits with a step more than {TIE:.0%} "
                f"shorter ({'; '.join(outcomes)}); {SEARCH}"]
    return [HintLine(f"hint: {head}: shorter with the group inside a node, " + "; ".join(faster[:MAX_SHOWN]),
                     Hint("ep", cost / st.step_s, tuple(knobs[:MAX_SHOWN])))]


def _replanned(plan: Plan, st, valid: list[int],
               alternatives: Callable[..., Replanned]) -> tuple[list[str], list[str], list[Knob]]:
    """(the words of each ep in ``valid`` re-planned that fits with a step clearly shorter than ``st``'s,
    fastest first; each ep's outcome, :func:`~meshplan.schedule.verdict.knob_outcome`; the first
    list's :class:`~meshplan.schedule.hint_facts.Knob`)."""
    mesh = plan.mesh
    # the experts' data axis as plan, groups and the state table name it: edp under DDP and ZeRO-1/2,
    # efsdp under FSDP (efsdp everywhere before newcomer trial nc62 #3)
    edp = expert_data_axis(plan.config.training.sharding)
    faster: list[tuple[float, str, Knob]] = []
    outcomes = []
    for e in valid:
        spec, edit = ep_spec(plan, e)
        alt = alternatives({}, spec)
        words = f"ep {e} ({edp} {mesh.block_size // (e * mesh.etp)}, etp {mesh.etp}; {edit})"
        if alt.step_s is not None and clearly_faster(st.step_s, alt.step_s):
            faster.append((alt.step_s, f"{words} (step {step_seconds(alt.step_s)}, {alt.step_s / st.step_s - 1:+.1%}, "
                                       f"peak {alt.peak_bytes / GiB:.1f} GiB fits)", knob_of(words, alt)))
        outcomes.append(f"ep {e}: {knob_outcome(st.step_s, alt)}")
    faster.sort(key=lambda f: round(f[0], 6))
    return [w for _, w, _ in faster], outcomes, [k for _, _, k in faster]
