"""Side-by-side comparison of two plans of one workload (the seed's tensor 8 against
tensor 4): local GEMM shapes and their efficiency, peak memory, bytes per link, exposed
communication, step time, and a verdict with its reasons, as rows of one table
(:func:`meshplan.compare.table.rows`). Each side's numbers and the workload both must share are
:mod:`meshplan.compare.sides`, the reasons under the verdict :mod:`meshplan.compare.reasons`. Its
outputs (the ``--json`` document, the HTML page, the rejected plan's evidence folder) are
:mod:`meshplan.compare.output`.

The workload is the model, the cluster, the [training] fields that say what the step
computes (global batch, sequence length, dtypes, optimizer ...) and the [memory] assumptions
(NCCL buffers, fragmentation ...); both sides must share it
(:func:`~meshplan.compare.sides.check_workload`: a one-line error names the first field that differs). A plan is the
mesh and its knobs (:data:`~meshplan.spec.training_knobs.PLAN_KNOBS`: micro_batch, recompute,
sharding ..., the [mesh] schedule, virtual stages, layer split, and
:data:`~meshplan.spec.memory.MEMORY_KNOBS`: prefetch depth, when FSDP reduces): each
knob that differs is a row of the table, and the verdict says when the difference is not the
mesh's alone.

Verdict rule (stated, no hidden weights): a mesh that does not fit (infeasible plan or
memory peak above usable HBM) loses to one that fits; between two that fit, the search's
order decides (:func:`meshplan.search.rank.decide`, one rule in one home): the shorter
predicted step wins when it is shorter by more than 1% (:data:`~meshplan.spec.search.TIE`,
below the model's resolution); within 1%, the mesh with fewer axes of degree > 1, then the
lower tp*pp*cp*ep, then the lower tp, then the fewer and cheaper settings off their default
(recompute none < selective < op < layer < block < full, no tp overlap, lower vpp,
``reshard_after_forward`` at the plan's default, kept gathered under torch's FSDP2 with pp > 1
and resharded elsewhere, the even layer split, 1F1B), then the lower peak memory where the peaks are more
than 1% apart (more headroom), then the shorter step: each side's key is the search's own
(:func:`meshplan.compare.sides.plan_tie_key`, :func:`meshplan.search.tie_key.tie_key`), so that
``compare top1.toml row4.toml`` of rows the search exported agrees with the search's order;
the reason names the criterion that decided with both values, in the search's words. Two
configs of the same mesh with the same knobs are reported as identical: nothing is chosen
or rejected; nor when the rule finds two plans that fit equal on every criterion (``equal``:
the same step, simplicity and peak, e.g. a plan and its own Megatron-LM export imported back).
When neither mesh fits, nothing is chosen either (``none_fit``, identical plans or not; each
side's reasons are given and the CLI exits 1, as ``meshplan plan`` does for an infeasible mesh).
Where the shorter step decided by less than the model's max error on its development set
(:func:`meshplan.spec.accuracy.within_error`), the verdict says so (:attr:`Comparison.caveat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from meshplan.compare.reasons import evidence_lines, knob_text
from meshplan.compare.sides import Side, check_workload, same_mesh, side_of
from meshplan.plan import Infeasible, Plan
from meshplan.schedule.rank_timeline import Overlap
from meshplan.search.rank import PAIR_RULE, decide
from meshplan.search.tie_key import knob_words
from meshplan.plan_fidelity import plan_setting_line, plan_settings
from meshplan.spec.accuracy import within_error
from meshplan.memory.headroom import tight_warning
from meshplan.spec.search import TIE, shorter_by
from meshplan.units import GiB


@dataclass(frozen=True)
class Comparison:
    """``winner`` and ``rejected`` are "" when the two plans are the same (``identical``: the
    same mesh and knobs), when the rule finds them equal (``equal``) or when neither fits
    (``none_fit``, which an identical pair may be too); ``rule``: the verdict rule in
    words; ``decided_by``: the criterion that chose the winner, with both values, in the
    search's words (:func:`meshplan.search.rank.decide`; ``fits where the other does not``
    when one side is infeasible; "" without a winner); ``knobs``: (field, A's value, B's value) of each plan knob that differs
    (:attr:`meshplan.compare.differences.Differences.knobs`)."""

    a: Side
    b: Side
    winner: str
    rejected: str
    reasons: tuple[str, ...]
    rule: str = ""
    identical: bool = False
    none_fit: bool = False
    knobs: tuple[tuple[str, Any, Any], ...] = ()
    decided_by: str = ""
    equal: bool = False

    @property
    def verdict(self) -> str:
        """The verdict line's words (the CLI's and the HTML page's): ``A (rejected: B)``, or
        why nothing is chosen."""
        if self.identical:
            return "identical plans; neither fits" if self.none_fit else "identical plans"
        if self.none_fit:
            return "neither mesh fits"
        if self.equal:
            return "equal (no criterion separates them)"
        return f"{self.winner} (rejected: {self.rejected})" + self.caveat

    def headroom_lines(self) -> list[str]:
        """One warning per side that fits with under 15% of its usable memory free
        (:attr:`~meshplan.compare.sides.Side.headroom`: the rule ``search`` demotes such meshes by,
        one home), the winner's included: compare chooses by the step as the search does within a
        tier, and says what the search would (newcomer trial 27 #C: compare chose a mesh at 3.9% free
        with no word)."""
        sides = (self.a,) if self.a.name == self.b.name else (self.a, self.b)
        return [tight_warning(s.name, s.peak_bytes, s.usable_bytes, s.plan.config.memory.fragmentation_fraction)
                for s in sides if s.headroom and s.peak_bytes is not None and s.usable_bytes is not None]

    def setting_lines(self) -> list[str]:
        """One ``warning:`` line per side (one for both where they are the same mesh) that lies in a
        setting whose step error was measured larger than the development set's
        (:func:`meshplan.plan_fidelity.plan_setting_line`, figures from
        :data:`~meshplan.spec.accuracy.FIDELITY`): the verdict's step difference may be within that
        error (newcomer trial 34)."""
        sides = (self.a,) if self.a.name == self.b.name else (self.a, self.b)
        return [line for s in sides if (line := plan_setting_line(s.name, s.plan))]

    @property
    def caveat(self) -> str:
        """``; 2.8% shorter, within the model's 2.9% max error on the development set: measure both
        before choosing`` where the step decided by less than that error, or where either side lies
        in a setting measured less well (the warning lines', :meth:`setting_lines`) by less than that
        setting's mean |error|, named with its figures
        (:func:`meshplan.spec.accuracy.within_error`, :data:`~meshplan.spec.accuracy.FIDELITY`'s one
        home); "" otherwise (a plan that does not fit, a tie rule's criterion, a larger difference)."""
        if not self.decided_by.startswith("shorter step by more than"):
            return ""
        win, lose = (self.a, self.b) if self.winner == self.a.name else (self.b, self.a)
        shorter = shorter_by(_fit(win)[0], _fit(lose)[0])
        words = within_error(shorter, tuple(dict.fromkeys(plan_settings(win.plan) + plan_settings(lose.plan))))
        return f"; {shorter:.1%} shorter, {words}" if words else ""


def rule_text() -> str:
    """The verdict rule in words (the module docstring's): fit first, then the search's order
    on two plans, its mesh and settings keys (:data:`meshplan.search.rank.PAIR_RULE`)."""
    return ("a mesh that does not fit (infeasible, or its memory peak above usable HBM) loses to one that fits; "
            f"between two that fit, the search's {PAIR_RULE}")


def _fit(s: Side) -> tuple[float, float]:
    """(step_s, peak_bytes) of a side that fits (:func:`~meshplan.compare.sides.side_of` sets both for every Plan)."""
    if s.step_s is None or s.peak_bytes is None:
        raise ValueError(f"{s.name}: no step time or peak memory (not a resolved plan)")
    return s.step_s, s.peak_bytes


def compare(plan_a: Plan | Infeasible, plan_b: Plan | Infeasible, names: tuple[str, str] = ("A", "B"),
            overlap: Optional[Overlap] = None) -> Comparison:
    """Compare two plans of one workload (see the module docstring for the rule); a ConfigError
    when the workloads differ (:func:`~meshplan.compare.sides.check_workload`)."""
    knobs = check_workload(plan_a, plan_b, names).knobs
    a, b = side_of(names[0], plan_a, overlap), side_of(names[1], plan_b, overlap)
    rule = rule_text()
    if same_mesh(plan_a, plan_b) and not knobs:
        what = f"{a.name} and {b.name} are" if a.name != b.name else f"both configs ({a.name}) are"
        none = not (a.feasible or b.feasible)  # the same plan that does not fit: exit 1, as plan does
        return Comparison(a, b, "", "", (f"{what} the same plan (mesh {a.mesh_text}, the same knobs) of one "
                                         f"workload: nothing to choose; give two meshes or plans of the workload",)
                          + (_infeasible_lines(a, b) if none else ()), rule, identical=True, none_fit=none)
    why, by_memory = [], True  # decided by memory (a plan that does not fit, or the peak among tied steps)
    if a.feasible != b.feasible:
        win, lose = (a, b) if a.feasible else (b, a)
        decided = "fits where the other does not"
        why.append(f"{lose.name} ({lose.mesh_text}) is infeasible: " + "; ".join(lose.reasons))
        if lose.step_s and win.step_s and lose.step_s < win.step_s:
            why.append(f"{lose.name} would predict a {shorter_by(lose.step_s, win.step_s):.0%} shorter step "
                       f"({lose.step_s:.3f} s vs {win.step_s:.3f} s) if it fit: " + _to_fit(win, lose, knobs, win is a))
    elif not a.feasible:
        return Comparison(a, b, "", "", _infeasible_lines(a, b) + tuple(evidence_lines(a, b, knobs, True)), rule,
                          none_fit=True, knobs=knobs)
    else:
        decision = _decide(a, b)
        if decision is None:
            return Comparison(a, b, "", "", (_equal_line(a, b),) + tuple(evidence_lines(a, b, knobs)), rule,
                              knobs=knobs, equal=True)
        win, lose, decided = decision
        by_memory = decided.startswith("lower peak memory")
        why.append(_decision_line(win, lose, decided))
    why += evidence_lines(a, b, knobs, memory_first=by_memory)
    return Comparison(a, b, win.name, lose.name, tuple(why), rule, knobs=knobs, decided_by=decided)


def _infeasible_lines(a: Side, b: Side) -> tuple[str, ...]:
    """Each side's ``<name> (<mesh>) is infeasible: <reasons>``, once when both are one file."""
    return tuple(dict.fromkeys(f"{s.name} ({s.mesh_text}) is infeasible: " + "; ".join(s.reasons) for s in (a, b)))


def _decide(a: Side, b: Side) -> Optional[tuple[Side, Side, str]]:
    """(winner, rejected, criterion) of two sides that fit, by the search's order
    (:func:`meshplan.search.rank.decide`); None when no criterion separates them."""
    (sa, pa), (sb, pb) = _fit(a), _fit(b)
    first, decided = decide([sa, sb], [a.simplicity, b.simplicity], [pa, pb])
    if first is None:
        return None
    return (a, b, decided) if first == 0 else (b, a, decided)


def _equal_line(a: Side, b: Side) -> str:
    """Why an equal pair has no verdict: the values of every criterion, one for both."""
    (s, p), (axes, mp, tp) = _fit(a), a.simplicity[:3]
    knobs = knob_words(a.simplicity)  # the settings as the search's rule weighs them ("" without them)
    return (f"{a.name} and {b.name} are equal on every criterion of the search's rule (step {s:.3f} s, {axes} "
            f"{'axis' if axes == 1 else 'axes'} of degree > 1, tp*pp*cp*ep {mp}, tp {tp}, "
            f"{f'settings {knobs}, ' if knobs else ''}peak memory {p / GiB:.1f} GiB): nothing to choose")


def _decision_line(win: Side, lose: Side, decided: str) -> str:
    """The verdict's first reason: ``A predicts a 4.8% shorter step (...)`` when the steps are
    more than 1% apart, else ``step times within 1% (...): A is listed first by the search's tie
    rule: fewer axes of degree > 1 (2 vs 3)``."""
    ws, ls = _fit(win)[0], _fit(lose)[0]
    if decided.startswith("shorter step by more than"):
        return f"{win.name} predicts a {shorter_by(ws, ls):.1%} shorter step ({ws:.3f} s vs {ls:.3f} s)"
    return (f"step times within {TIE:.0%} ({win.name} {ws:.3f} s, {lose.name} {ls:.3f} s): {win.name} is listed "
            f"first by the search's tie rule: {decided}")


def _to_fit(win: Side, lose: Side, knobs: tuple = (), win_is_a: bool = True) -> str:
    """What would make the faster plan ``lose`` (resolved, infeasible) fit, true of the two
    plans compared: when ``win`` fits with a larger tensor degree and the same knobs, a larger
    tp is a way to fit (``win`` shows it) that gives up the shorter step; when knobs differ too,
    ``win`` fits with its mesh and those knobs together, named as such; else larger tp is one of
    the untried ways."""
    mw, ml = win.plan.mesh, lose.plan.mesh
    tw, tl = (mw.degree("tp") if mw else 1), (ml.degree("tp") if ml else 1)
    if knobs:
        mesh = (f"the same mesh and " if win.mesh_key == lose.mesh_key
                else f"{win.mesh_text} against {lose.mesh_text} and ")
        full = lose.plan.config.training.recompute == "full" and lose.plan.config.training.recompute_num_layers is None
        return (f"{win.name} fits with {mesh}{knob_text(knobs, win_is_a)}, but gives up that step; to keep it, "
                f"{lose.name} needs another axis (cp, pp), a larger tensor degree, "
                f"{'' if full else 'more recompute, '}or more memory")
    if tw > tl:
        return (f"a larger tensor degree fits ({win.name}, tp {tw} against tp {tl}) but gives up that step; "
                f"to keep it, {lose.name} needs another axis (cp, pp) or more memory")
    return "it needs another axis (cp, pp), a larger tensor degree or more memory"
