"""Re-plans of a step with one knob changed, for the step's verdict and ``hint:`` lines
(:mod:`meshplan.schedule.verdict` and the ``*_hint`` modules): :func:`rebuilt_step` makes the
``alternatives`` they call, a :class:`Rebuilt` that re-plans, steps and fits each knob once, and
answers with a :class:`Replanned`. Moved out of :mod:`meshplan.schedule.verdict` (nc55fixB) to keep
it under 400 lines; it re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from meshplan.errors import ConfigError
from meshplan.memory.constraints import Constraints, usable_bytes
from meshplan.plan import Infeasible, Plan, build_plan, with_memory
from meshplan.spec.mesh import MeshSpec
from meshplan.units import GiB, step_seconds


@dataclass(frozen=True)
class Replanned:
    """One knob's re-plan (:func:`rebuilt_step`): ``text``, the verdict's phrase for it;
    ``step_s``, the predicted step (seconds), None where the plan is infeasible or does not fit;
    ``peak_bytes``, its memory timeline's peak (0 where infeasible); ``step``, the predicted
    :class:`~meshplan.schedule.step_summary.StepTime` where it fits (its parts: the bubble hint's
    bubble after), else None."""

    text: str
    step_s: Optional[float] = None
    peak_bytes: float = 0.0
    step: Optional[object] = None


@dataclass(frozen=True)
class Stepped:
    """One knob's re-plan stepped before its memory is planned (:meth:`Rebuilt.stepped`):
    ``step_s``, the predicted step (seconds; None where the knob is refused or the mesh does not
    resolve), ``step`` its :class:`~meshplan.schedule.step_summary.StepTime` and ``plan`` the
    re-plan without memory timelines (``build_plan(memory=False)``), for :meth:`Rebuilt.fitted`."""

    step_s: Optional[float]
    step: Optional[object] = None
    plan: Optional[Plan] = None


class Rebuilt:
    """``alternatives`` for :func:`network_verdict` (and the host and bubble hints), made by
    :func:`rebuilt_step`: called with ``(update, mesh=None)``, ``plan`` rebuilt with the
    ``training`` fields ``update`` changed (and, given, its mesh spec replaced by ``mesh``), its
    memory planned and, where it fits, its step predicted by ``step_fn(plan)``: a
    :class:`Replanned` with the step, or the reason it has none (the memory reason, the mesh's
    infeasibility reasons, or the config error a knob brings).

    A hint that lists only re-plans clearly faster than the step (:func:`clearly_faster`) can
    take the two phases apart: :meth:`stepped` (the step of the re-plan without its memory
    timelines: ``step_time`` reads none of them, nor the constraint rows or placement flags,
    which the re-plans leave out as the search's step-only path does, :mod:`meshplan.search.exact`),
    then :meth:`fitted` (its memory) for the faster ones alone: the same :class:`Replanned`.

    Each knob (its ``training`` update and mesh) is re-planned, stepped and fitted once per object:
    ``step``'s reshard note, verdict and hints share one, and the note and the FSDP hint both ask
    for ``reshard_after_forward = false`` (tests/test_newcomer22.py counts the ``build_plan`` calls)."""

    def __init__(self, plan: Plan, step_fn: Callable):
        self.plan, self.step_fn = plan, step_fn
        self._lean_of: dict[str, object] = {}  # knob key -> its lean re-plan or the Replanned saying why none
        self._stepped_of: dict[str, Stepped] = {}
        self._fitted_of: dict[str, Replanned] = {}

    def __call__(self, update: dict, mesh: Optional[MeshSpec] = None) -> Replanned:
        key = _knob_key(update, mesh)
        if key not in self._fitted_of:
            alt, done = self._lean(update, mesh), self._stepped_of.get(key)
            self._fitted_of[key] = alt if isinstance(alt, Replanned) else self._fit(alt, done.step if done else None)
        return self._fitted_of[key]

    def stepped(self, update: dict, mesh: Optional[MeshSpec] = None) -> Stepped:
        """The knob's re-plan and its step, its memory not planned (``step_s`` None where
        :meth:`__call__` would give no step before planning memory: refused or infeasible)."""
        key = _knob_key(update, mesh)
        if key not in self._stepped_of:
            alt = self._lean(update, mesh)
            st = None if isinstance(alt, Replanned) else self.step_fn(alt)
            self._stepped_of[key] = Stepped(None) if st is None else Stepped(st.step_s, st, alt)
        return self._stepped_of[key]

    def fitted(self, stepped: Stepped) -> Replanned:
        """What :meth:`__call__` gives for the knob of ``stepped`` (a :meth:`stepped` result with a
        step): its memory planned, its step kept where it fits."""
        if stepped.plan is None:
            raise ValueError("Rebuilt.fitted needs a stepped re-plan with a step (step_s not None)")
        key = next((k for k, x in self._stepped_of.items() if x is stepped), None)
        if key is None:
            return self._fit(stepped.plan, stepped.step)
        if key not in self._fitted_of:
            self._fitted_of[key] = self._fit(stepped.plan, stepped.step)
        return self._fitted_of[key]

    def _lean(self, update: dict, mesh: Optional[MeshSpec]):
        """The re-plan without memory timelines, constraint rows or placement flags (none of which a
        step or a timeline reads), or the :class:`Replanned` that says why there is none; built once
        per knob."""
        key = _knob_key(update, mesh)
        if key not in self._lean_of:
            self._lean_of[key] = self._build(update, mesh)
        return self._lean_of[key]

    def _build(self, update: dict, mesh: Optional[MeshSpec]):
        """:meth:`_lean` uncached."""
        cfg = self.plan.config
        asked = {"fp8_all_gather": True} if cfg.fp8_all_gather_asked else {}  # the user's, for another mesh
        cfg = replace(cfg, training=cfg.training.model_copy(update={**asked, **update}), mesh=mesh or cfg.mesh)
        no_rows = Constraints((), usable_bytes(cfg.cluster, cfg.training))
        try:
            alt = build_plan(cfg, no_rows, memory=False, reports=False)
        except (ConfigError, ValueError) as e:  # a knob's mesh the rules refuse (a schedule's chunks, its framework)
            return Replanned(f"refused ({e})")
        if isinstance(alt, Infeasible):
            return Replanned("infeasible (" + "; ".join(alt.reasons) + ")")
        return alt

    def _fit(self, lean: Plan, st) -> Replanned:
        """``lean``'s memory planned; where it fits, its step (``st``, or ``step_fn`` of the plan)."""
        try:
            alt = with_memory(lean)
        except (ConfigError, ValueError) as e:  # as build_plan's own memory planning would refuse it
            return Replanned(f"refused ({e})")
        peak = alt.timeline.peak.total_bytes
        if not alt.feasible:
            return Replanned(f"does not fit (peak {peak / GiB:.1f} GiB > {alt.timeline.usable_bytes / GiB:.1f} GiB "
                             f"usable)", peak_bytes=peak)
        st = st if st is not None else self.step_fn(alt)
        return Replanned(f"step {step_seconds(st.step_s)}, peak {peak / GiB:.1f} GiB fits", st.step_s, peak, st)


def _knob_key(update: dict, mesh: Optional[MeshSpec]) -> str:
    """A knob's key in :class:`Rebuilt`'s caches: its ``training`` update (order-free) and its mesh spec.

    >>> _knob_key({"micro_batch": 2, "reshard_after_forward": False}, None)
    "[('micro_batch', 2), ('reshard_after_forward', False)] None"
    """
    return f"{sorted(update.items())!r} {mesh.model_dump_json() if mesh is not None else None}"


def rebuilt_step(plan: Plan, step_fn: Callable) -> Rebuilt:
    """``alternatives`` for :func:`network_verdict` (and the host and bubble hints): ``plan``
    re-planned with a knob and its step predicted with ``step_fn(plan)`` (:class:`Rebuilt`)."""
    return Rebuilt(plan, step_fn)
