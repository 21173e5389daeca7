"""The ``note:`` of a torchtitan job planned with ``training.reshard_after_forward`` left unset under
a pipeline (newcomer trial 22 #2). meshplan's default is true (FSDP2's own default,
``fully_shard(reshard_after_forward=True)``); torchtitan's ``fsdp_reshard_after_forward = "default"``
resolves to ``not pp_enabled`` (pytorch/torchtitan b5bcd76, torchtitan/distributed/fsdp.py:124-133,
``get_fsdp_reshard_after_forward_policy``: "For PP, by default do not reshard after forward to avoid
per-microbatch all-gathers"), and ``meshplan import`` of a torchtitan file writes false. So a
hand-written config and an imported one plan the same job differently under pp; the default is not
changed here (pinned steps), the note says what torchtitan runs, its step and the line to add.
"""

from __future__ import annotations

from typing import Callable, Optional

from meshplan.plan import Plan
from meshplan.units import step_seconds

SOURCE = "torchtitan b5bcd76 distributed/fsdp.py:124-133"


def reshard_default_applies(plan: Plan) -> bool:
    """True for framework torch, pp > 1, FSDP2 over a data axis (``fsdp`` = dp_shard x cp > 1)
    and ``reshard_after_forward`` not written in the config."""
    t = plan.config.training
    return (t.framework == "torch" and len(plan.stages) > 1 and t.sharding in ("zero3", "hsdp")
            and t.zero3_engine == "fsdp2" and plan.mesh.degree("fsdp") > 1 and t.reshard_after_forward
            and "reshard_after_forward" not in t.model_fields_set)


def reshard_default_note(plan: Plan, step_s: float, again: Callable[[dict], object]) -> Optional[str]:
    """The note for ``plan`` (step ``step_s``, seconds) where :func:`reshard_default_applies`;
    ``again(update)``: the plan re-planned with ``training`` fields ``update`` (a
    :class:`~meshplan.schedule.verdict.Replanned`, ``step_s`` None where it does not fit)."""
    if not reshard_default_applies(plan):
        return None
    alt = again({"reshard_after_forward": False})
    alt_s = getattr(alt, "step_s", None)
    with_false = (f"step {step_seconds(alt_s)} with false against {step_seconds(step_s)} with true"
                  if alt_s is not None else f"false re-planned: {getattr(alt, 'text', 'does not fit').split(' (')[0]}")
    return (f"note: training.reshard_after_forward is unset, planned true (meshplan's default); torchtitan under "
            f"pp {len(plan.stages)} runs false (fsdp_reshard_after_forward = \"default\" is not pp_enabled: "
            f"{SOURCE}; `meshplan import` writes false): {with_false}; add reshard_after_forward = false under "
            f"[training] to plan what torchtitan runs (true to keep this and drop the note)")
