"""The ``hint:`` line of a step whose critical stage exposes mostly context-parallel communication
(newcomer trial 53 #5: Llama 3.1 70B at 128k, cp 16 x tp 8 on 16 dgx-h200, exposed 352.7 s of cp in
a 510.1 s step, and the hint lines offered only FSDP's -4 to -11% while the search found a mesh
about 4 times faster): when exposed cp (:attr:`~meshplan.schedule.step_summary.StepTime.exposed_s`
``cp``) is the largest exposed stream and holds :data:`~meshplan.schedule.verdict.HINT_SHARE` of
the step or more, the config re-planned with the CP moves (:func:`cp_knobs`), those that fit with a
step shorter by more than :data:`~meshplan.spec.search.TIE` (1%,
:func:`~meshplan.schedule.verdict.clearly_faster`, the rule of every ``hint:`` line) listed, the
fastest :data:`~meshplan.schedule.bubble_hint.MAX_SHOWN` first, each with its step, its change,
its own exposed cp and its peak; when none helps, a ``note: no cp hint`` line with each move's
outcome.

The moves, each on its own, as a long-context practitioner turns them:

- a smaller cp, ``cp / k`` for k = 2, 4, ... down to cp 1, the freed factor on tp where tp x k
  stays inside a node (the K/V exchanged over fewer ranks, the heads split more), or on the data
  axis (fewer tokens a rank: more activations per GPU, which the memory timeline checks): CP's
  K/V traffic a layer scales with the whole sequence's K/V whatever cp, so fewer and faster
  (NVLink) cp ranks expose less;
- the runtime's other way of moving K/V, a setting of the same job: under torch's ring the
  other K/V rotation (``training.cp_rotate``, torchtitan's ``context_parallel_rotate_method``,
  :func:`meshplan.spec.axes.cp.alltoall_kv_rows`: the all-gather of the whole sequence against
  cp - 1 shifts of the local K/V, each beside one SDPA step); under Megatron-LM the other
  ``--cp-comm-type`` (``training.cp_attention`` p2p, Transformer Engine's ring at the KV heads,
  against all_gather). All-gather CP under framework torch (meshplan's runtime, not torchtitan)
  and a move to another framework are not offered: no setting of the user's job runs them.

Each is stepped before its memory is planned (:class:`~meshplan.schedule.verdict.Rebuilt`), only
the clearly faster ones fitted (:func:`meshplan.schedule.bubble_hint.fastest`).
"""

from __future__ import annotations

from typing import Callable, Optional

from meshplan.plan import Plan
from meshplan.schedule.bubble_hint import Knob, fastest, knob_outcomes
from meshplan.schedule.hint_facts import Hint, HintLine, knob_of
from meshplan.schedule.verdict import HINT_SHARE, Replanned
from meshplan.spec.search import TIE
from meshplan.spec.mesh import MeshSpec
from meshplan.units import GiB, step_seconds

#: Data axes that take a smaller cp's freed factor, the first present in the config's mesh.
_DATA = ("dp_shard", "dp", "dp_replicate")


def cp_share(st) -> float:
    """Exposed cp of the critical stage as a share of the step (0 where another stream exposes more)."""
    exposed = st.exposed_s
    cp = exposed.get("cp", 0.0)
    return cp / st.step_s if cp > 0 and cp >= max(exposed.values()) else 0.0


def cp_hint(plan: Plan, st, alternatives: Optional[Callable[..., Replanned]]) -> list[str]:
    """``hint:`` line for ``st`` (the :class:`~meshplan.schedule.step_summary.StepTime` of ``plan``)
    whose exposed cp is the largest exposed stream and :data:`HINT_SHARE` of the step or more: each
    of :func:`cp_knobs` re-planned by ``alternatives(update, mesh)``, the fastest that fit with a
    clearly shorter step; when none helps, a ``note: no cp hint`` line (:func:`knob_outcomes`).
    The trial's job (tests/data/nc53b/tt_70b_128k.toml): exposed cp 69.1% of a 510.08 s step;
    cp 4 x tp 8 (dp_shard 4) 157.9 s among the moves (tests/test_nc53_hints.py)."""
    share = cp_share(st)
    if alternatives is None or share < HINT_SHARE:
        return []
    knobs = cp_knobs(plan)
    head = (f"exposed cp is {share:.1%} of the step ({st.exposed_s['cp']:.2f} s of {step_seconds(st.step_s)}; "
            f"cp {plan.mesh.degree('cp')}, {plan.config.training.cp_kind}"
            + (f" with the {plan.config.training.cp_rotate} rotation" if plan.config.training.cp_ring else "") + ")")
    found = fastest(st, knobs, alternatives)
    if not found:
        return [f"note: no cp hint: {head}, but no move re-planned fits with a step more than {TIE:.0%} shorter: "
                + knob_outcomes(plan, st, knobs, alternatives)]
    items = [f"{words} (step {step_seconds(s)}, {s / st.step_s - 1:+.1%}, exposed cp {_exposed_cp(alt):.2f} s, "
             f"peak {alt.peak_bytes / GiB:.1f} GiB fits)" for s, words, alt in found]
    return [HintLine(f"hint: {head}: shorter with " + "; ".join(items),
                     Hint("cp", share, tuple(knob_of(words, alt) for _, words, alt in found)))]


def _exposed_cp(alt: Replanned) -> float:
    """Exposed cp (s) of a re-plan's step (0 without one)."""
    return getattr(alt.step, "exposed_s", {}).get("cp", 0.0)


def cp_knobs(plan: Plan) -> list[Knob]:
    """The moves of the module docstring for ``plan`` (cp > 1), smaller cp first."""
    deg = plan.axis_degrees()
    cp, t = deg.get("cp", 1), plan.config.training
    if cp < 2:
        return []
    out: list[Knob] = []
    data = next((a for a in _DATA if a in deg), None)
    k = 2
    while cp % k == 0:
        if "tp" in deg and deg["tp"] * k <= plan.config.cluster.node.gpus:
            moved = {**deg, "cp": cp // k, "tp": deg["tp"] * k}
            out.append((mesh_words(moved), {}, mesh_spec(plan, moved)))
        if data is not None:
            moved = {**deg, "cp": cp // k, data: deg[data] * k}
            out.append((mesh_words(moved), {}, mesh_spec(plan, moved)))
        k *= 2
    if t.cp_ring:
        other = "allgather" if t.cp_rotate == "alltoall" else "alltoall"
        out.append((f"training.cp_rotate = \"{other}\"", {"cp_rotate": other}, None))
    if t.framework == "megatron" and t.cp_kind in ("p2p", "allgather"):
        other = "allgather" if t.cp_kind == "p2p" else "p2p"
        out.append((f"training.cp_attention = \"{other}\" (--cp-comm-type {'all_gather' if other == 'allgather' else 'p2p'})",
                    {"cp_attention": other}, None))
    return out


def mesh_spec(plan: Plan, deg: dict[str, int]) -> MeshSpec:
    """The config's own mesh spec with ``deg``'s degrees (its names, or Megatron's degrees)."""
    axes = {"names": list(deg), "shape": list(deg.values())} if plan.spec.names is not None else {"degrees": deg}
    return plan.spec.model_copy(update=axes)


def mesh_words(deg: dict[str, int]) -> str:
    """``cp 4 x tp 8 (dp_shard 4)``: a move's mesh, its axes of degree > 1."""
    return "mesh " + " x ".join(f"{n} {d}" for n, d in deg.items() if d > 1)
