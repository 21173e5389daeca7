"""The lines every view of one plan prints beside its verdict, one home for ``plan``'s text, its
HTML page (``report``, ``plan --html``) and ``step`` (newcomer trial 49: the page dropped the
tp-overlap note ``plan`` printed, and neither ``plan`` nor ``step`` said that a mesh was tight or that
its setting's step error was measured larger, where ``search`` and ``compare`` did):

- :func:`plan_notes`: the plan's ``note`` lines (:attr:`~meshplan.plan.Plan.notes`) and, with
  ``training.tp_comm_overlap`` on, what the overlap saves against blocking TP
  (:func:`meshplan.schedule.tp_overlap_lines.tp_overlap_line`);
- :func:`plan_warnings`: the headroom rule's ``warning (this mesh): tight: ...``
  (:func:`meshplan.memory.headroom.tight_warning`, compare's line) and, under Megatron Core, the peak without the data
  loader's attention mask where it is what keeps the mesh tight (:func:`meshplan.plan_fix_mask.mask_note`), the allocator's retry warning where the
  reserved peak exceeds usable memory but the peak fits (:func:`meshplan.memory.headroom.retry_warning`),
  and the measured-error setting's
  ``note: this mesh lies where ...`` (:func:`meshplan.plan_fidelity.plan_setting_line`, the line
  search and compare print as a warning, since they choose; here a caveat on the model beside the
  MFU caveat, not a warning on the config)."""

from __future__ import annotations

from typing import Optional

from meshplan.memory.headroom import retry_warning, tight_warning
from meshplan.plan import Infeasible, Plan
from meshplan.plan_fidelity import plan_setting_line
from meshplan.plan_fix_mask import mask_note
from meshplan.schedule.steptime import step_time
from meshplan.schedule.step_summary import StepTime
from meshplan.schedule.tp_overlap_lines import tp_overlap_line

#: How the lines name the plan's mesh (compare names its sides by their files).
WHO = "this mesh"


def plan_notes(plan: Plan | Infeasible, st: Optional[StepTime] = None) -> list[str]:
    """The plan's notes, then its tp-overlap line (``st``: its step, predicted here when None and
    the overlap is on), each without a ``note`` prefix."""
    notes = list(plan.notes)
    if isinstance(plan, Plan) and plan.config.training.tp_comm_overlap and plan.mesh.degree("tp") > 1:
        tp = tp_overlap_line(plan, st or step_time(plan), step_time)
        notes += [tp] if tp else []
    return notes


def plan_warnings(plan: Plan | Infeasible) -> list[str]:
    """The tight and measured-error ``warning`` lines of a mesh that fits (module docstring); []
    for an infeasible one, whose verdict gives its reasons."""
    if not isinstance(plan, Plan) or not plan.feasible:
        return []
    tl = plan.timeline
    lines = [tight_warning(WHO, tl.peak.total_bytes, tl.usable_bytes, plan.config.memory.fragmentation_fraction),
             mask_note(plan), retry_warning(WHO, plan.timelines), plan_setting_line(WHO, plan, "note")]
    return [line for line in lines if line]
