"""The one ``note:`` line of a plan whose ``training.reshard_after_forward`` was left unset and
resolved to false: framework torch, FSDP2 over a data axis and pp > 1, where torchtitan's
``fsdp_reshard_after_forward = "default"`` is ``not pp_enabled`` (pytorch/torchtitan b5bcd76,
torchtitan/distributed/fsdp.py:124-133, ``get_fsdp_reshard_after_forward_policy``: "For PP, by default
do not reshard after forward to avoid per-microbatch all-gathers"). The rule itself is
:meth:`~meshplan.spec.training.TrainingSpec.reshard_default`; ``build_plan`` applies it per mesh
(:meth:`~meshplan.spec.training.TrainingSpec.at_pp`). ``plan`` and ``step`` print the line.
"""

from __future__ import annotations

from typing import Optional

from meshplan.plan import Plan
from meshplan.schedule.window_regathers import note_words as window_words

SOURCE = "torchtitan b5bcd76 distributed/fsdp.py:124-133"
#: The same rule where the plan is of 9810191's names, planned as its parent 238fa99 runs them
#: (``training.op_sac_policy = "238fa99"``; newcomer trial 57 #9): each model's ``apply_fsdp``.
SOURCES = {"238fa99": "torchtitan 238fa99 models/llama3/infra/parallelize.py:324-327, the MoE models' "
                      "models/llama4/infra/parallelize.py:363-366"}


def source(plan: Plan) -> str:
    """The file and lines of the rule in the torchtitan revision ``plan`` is planned as."""
    return SOURCES.get(plan.config.training.op_sac_policy or "b5bcd76", SOURCE)


def reshard_default_applies(plan: Plan) -> bool:
    """True where ``plan``'s ``reshard_after_forward`` is unset and pp resolved it to false
    (:meth:`~meshplan.spec.training.TrainingSpec.reshard_defaulted`) and FSDP2 shards over a data
    axis (``fsdp`` = dp_shard x cp > 1), so the value changes what the plan gathers."""
    t = plan.config.training
    return t.reshard_defaulted(plan.pp) and plan.mesh.degree("fsdp") > 1


def reshard_default_note(plan: Plan) -> Optional[str]:
    """The line for ``plan`` where :func:`reshard_default_applies`, else None."""
    if not reshard_default_applies(plan):
        return None
    kept = window_words(plan) or " (no backward all-gather)"  # torch's window re-gathers at vpp > 3
    if plan.config.origin == "torchtitan":  # the job TOML's own key (the importer leaves "default" unset)
        return (f"note: {torchtitan_said(plan)}: planned false under pp {plan.pp} "
                f"(\"default\" is not pp_enabled: {source(plan)}), each chunk's parameters kept gathered from its "
                f"forward to its backward{kept}; set it to \"always\" to reshard after forward")
    return (f"note: training.reshard_after_forward unset: planned false, torchtitan's default under pp "
            f"{plan.pp} (fsdp_reshard_after_forward = \"default\" is not pp_enabled: {source(plan)}), each "
            f"chunk's parameters kept gathered from its forward to its backward{kept}; set it "
            f"to true to reshard after forward")


def torchtitan_said(plan: Plan) -> str:
    """What ``plan``'s torchtitan job TOML said of ``parallelism.fsdp_reshard_after_forward``
    (:attr:`~meshplan.config.Config.source_said`): the key as written, or that it was omitted and
    torchtitan took its default, ``"default"`` (``Parallelism.fsdp_reshard_after_forward``,
    torchtitan b5bcd76 torchtitan/config/job_config.py)."""
    if ("parallelism.fsdp_reshard_after_forward", "default") in plan.config.source_said:
        return "parallelism.fsdp_reshard_after_forward = \"default\""
    return "parallelism.fsdp_reshard_after_forward omitted (torchtitan's default: \"default\")"
