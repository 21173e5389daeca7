"""Whether a fitting plan's tp (or cp) is larger than its memory needs: ``meshplan plan``'s one
``note:`` line.

tp and cp shard the activations (and tp the weights) at a cost in communication on every layer;
a mesh whose tp is larger than its memory needs pays that cost for the step time alone. For a
feasible plan, :func:`smaller_fit` re-plans the same mesh with the axis at each smaller divisor of
its degree, largest first, the data axis (the mesh's ``dp_shard`` or ``dp``; else a new one right
inside pp, ``dp_shard`` under zero3/hsdp and ``dp`` otherwise) grown by the same factor, so the
product of the other axes and the world are kept, with :func:`meshplan.plan.build_plan` (the same
memory timeline and rules as the plan), and stops at the first that does not fit; the smallest that
fits is the answer. A variant the rules refuse counts as not fitting: that is what the user's
config forces (a global batch that caps dp at global_batch / micro_batch, heads or a sequence the
smaller degree does not split, cp's 2 x cp chunks: :mod:`meshplan.spec.axes`), so those meshes get
no line. An explicit ``mesh.rank_to_gpu`` is the user's placement and is not re-planned.

:func:`need_line` then predicts both steps (:func:`meshplan.schedule.steptime.step_time`) and says
whether the axis is kept for the step: the configured mesh clearly faster, by more than the search's
1% tie (:func:`meshplan.schedule.verdict.clearly_faster`), or not (slower, or ``within 1%``):
``note: tp 4 is more than memory needs: tp 1 (dp_shard 8) also fits, timeline peak 63.12 GiB of 67.06
GiB usable (this mesh 27.24 GiB); not for the step either: 10.46 s at tp 4 against 7.00 s at tp 1`` for
``examples/mini_2x4_tp4-dp2.toml``.

Cost: one build_plan per smaller degree tried (at most log2 of the degree), without the constraints
(the plan's are kept) and with memory planned only up to the first stage that does not fit, and
two step times (the plan's own from the caller where it has it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from meshplan.errors import ConfigError
from meshplan.plan import Plan, build_plan, with_memory_if_fits
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import clearly_faster
from meshplan.units import GiB, step_seconds

#: The axes that shard activations and whose degree the line questions, in the order they are tried.
AXES = ("tp", "cp")
#: The data axes that take what the questioned axis gives up (the first in the mesh).
_DATA = ("dp_shard", "dp")


def _degrees_with(plan: Plan, axis: str, k: int) -> Optional[dict[str, int]]:
    """The config's mesh axes with ``axis`` at ``k`` and the data axis grown by degree / k (a new
    data axis right inside pp where the mesh has none; None where the Megatron order string names
    no data axis, which cannot grow)."""
    deg = plan.axis_degrees()
    data = next((n for n in _DATA if n in deg), None)
    if data is None:
        if plan.spec.names is None:
            return None
        data = "dp_shard" if plan.config.training.sharding in ("zero3", "hsdp") else "dp"
        deg = {n: d for key, v in deg.items() for n, d in ((key, v), (data, 1))[:1 + (key == "pp")]}
        if data not in deg:  # no pp: the data axis outermost
            deg = {data: 1, **deg}
    return deg | {axis: k, data: deg[data] * deg[axis] // k}


def _variant(plan: Plan, axis: str, k: int) -> Optional[Plan]:
    """``plan``'s config re-planned with ``axis`` at ``k`` (:func:`_degrees_with`) where it fits;
    None where it does not resolve, the rules refuse it or a stage does not fit (its memory planned
    up to that stage: :func:`~meshplan.plan.with_memory_if_fits`). SP stays as configured where
    tp > 1 and is off at tp 1."""
    deg = _degrees_with(plan, axis, k)
    if deg is None:
        return None
    spec = plan.spec
    axes = {"names": list(deg), "shape": list(deg.values())} if spec.names is not None else {"degrees": deg}
    sp = spec.sequence_parallel and deg.get("tp", 1) > 1
    cfg = replace(plan.config, mesh=spec.model_copy(update=axes | {"sequence_parallel": sp}))
    try:  # the constraints do not depend on the mesh: the plan's, not computed again
        lean = build_plan(cfg, plan.constraints, memory=False, reports=False)
        return with_memory_if_fits(lean) if isinstance(lean, Plan) else None
    except (ConfigError, ValueError):
        return None


def smaller_fit(plan: Plan, axis: str) -> Optional[tuple[int, Plan]]:
    """(degree, plan) of the smallest ``axis`` degree below ``plan``'s that still fits, trying the
    divisors of its degree largest first and stopping at the first that does not fit (module
    docstring); None where ``plan`` does not fit, its degree is 1, its placement is explicit or
    the next smaller degree does not fit."""
    d = plan.mesh.degree(axis)
    if not plan.feasible or d == 1 or plan.spec.rank_to_gpu is not None:
        return None
    found = None
    for k in [k for k in range(d - 1, 0, -1) if d % k == 0]:
        p = _variant(plan, axis, k)
        if p is None:
            break
        found = (k, p)
    return found


def _mesh_words(p: Plan) -> str:
    """``dp_shard 16 x tp 2``: the axes of degree > 1, as the fix lines name a mesh."""
    return " x ".join(f"{n} {d}" for n, d in p.axis_degrees().items() if d > 1) or "one rank"


def need_line(plan: Plan, step_s: Optional[Callable[[], float]] = None) -> Optional[str]:
    """One line for the first of :data:`AXES` that is larger than ``plan``'s memory needs, else
    None: the smallest degree that fits, its mesh, its timeline peak against this mesh's and the
    usable memory, and whether the configured degree is kept for the step (both steps predicted;
    ``step_s()``, where given, is ``plan``'s own step in seconds, as the caller already has it)."""
    step_s = step_s or (lambda: step_time(plan).step_s)
    for axis in AXES:
        found = smaller_fit(plan, axis)
        if found is None:
            continue
        k, small = found
        d, usable = plan.mesh.degree(axis), plan.constraints.usable_bytes / GiB
        here, there = step_s(), step_time(small).step_s
        steps = f"{step_seconds(here)} at {axis} {d} against {step_seconds(there)} at {axis} {k}"
        kept = (f"{axis} {d} kept for the step: {steps}" if clearly_faster(there, here) else
                f"not for the step either: {steps}" + ("" if clearly_faster(here, there) else ", within 1%"))
        return (f"note: {axis} {d} is more than memory needs: {axis} {k} ({_mesh_words(small)}) also fits, timeline "
                f"peak {small.timeline.peak.total_bytes / GiB:.2f} GiB of {usable:.2f} GiB usable (this mesh "
                f"{plan.timeline.peak.total_bytes / GiB:.2f} GiB); {kept}")
    return None
