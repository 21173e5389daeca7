"""torchtitan's ``[parallelism]`` degrees and pipeline keys -> meshplan's ``[mesh]`` table
(:mod:`meshplan.interop.torchtitan` reads the rest of the job TOML): the degree of each axis
(:data:`DEGREES`, ``data_parallel_shard_degree = -1`` kept for meshplan to infer), the axes in
torchtitan's ``ParallelDims`` order, sequence parallel with tp, loss parallel, and the pipeline:
its schedule and its split of layers into model parts (:func:`read_pipeline`; torchtitan's own
split :func:`~meshplan.interop.torchtitan_tables.default_split`). Key names and defaults from
pytorch/torchtitan e347b1e ``torchtitan/config/job_config.py`` (``class Parallelism``) and
``torchtitan/distributed/pipeline_parallel.py`` (``generate_llm_fqn_per_model_part``).
"""

from __future__ import annotations

import math
from typing import Any

from meshplan.errors import ConfigError
from meshplan.interop.torchtitan_tables import MULTI_STAGE, SCHEDULE_NAMES, SCHEDULES, V_SCHEDULES, default_split
from meshplan.spec.mesh import LOOPED_BFS_REFUSAL, multi_stage_refusal

#: [parallelism] degree key -> mesh axis (torchtitan ParallelDims order, outermost first).
DEGREES = {"pipeline_parallel_degree": "pp", "data_parallel_replicate_degree": "dp_replicate",
           "data_parallel_shard_degree": "dp_shard", "context_parallel_degree": "cp",
           "tensor_parallel_degree": "tp", "expert_parallel_degree": "ep", "expert_tensor_parallel_degree": "etp"}


def degrees(par: dict) -> dict[str, int]:
    """The degree of each mesh axis of ``[parallelism]`` (:data:`DEGREES`; absent: 1, dp_shard -1,
    torchtitan's defaults); ConfigError naming the key when not a whole number >= 1 (dp_shard: or -1)."""
    out = {}
    for key, axis in DEGREES.items():
        v = par.get(key, -1 if axis == "dp_shard" else 1)
        if isinstance(v, bool) or not isinstance(v, int) or v == 0 or (v < 0 and axis != "dp_shard") or v < -1:
            raise ConfigError(f"parallelism.{key}", f"must be a whole number >= 1"
                              + (" (or -1: the rest of the world)" if axis == "dp_shard" else
                                 " (only data_parallel_shard_degree takes -1)") + f"; got {v!r}")
        out[axis] = v
    return out


def read_pipeline(par: dict, pp: int, layers: int, notes: list[str]) -> dict:
    """[mesh] keys of the pipeline of ``par`` ([parallelism] as parsed) at ``pp`` over a model of
    ``layers``: schedule, virtual stages per rank, layers per model part (none at pp 1); a note
    gives the split. ConfigError naming the key for a schedule meshplan does not plan or a part
    count that does not suit it."""
    if pp == 1:
        return {}
    raw = str(par.get("pipeline_parallel_schedule", "1F1B"))
    sched = SCHEDULES.get(raw.lower().replace("_", ""))
    if sched is None and raw.lower().replace("_", "") == "loopedbfs":
        raise ConfigError("parallelism.pipeline_parallel_schedule", LOOPED_BFS_REFUSAL)
    if sched is None:
        raise ConfigError("parallelism.pipeline_parallel_schedule",
                          f"{raw!r} is not planned by meshplan; use one of {', '.join(SCHEDULE_NAMES.values())}, "
                          f"or InterleavedZeroBubble with one stage per rank")
    parts = par.get("module_fqns_per_model_part")
    first, last = par.get("pipeline_parallel_first_stage_less_layers", 1), \
        par.get("pipeline_parallel_last_stage_less_layers", 1)
    if parts:
        split = [sum(1 for f in part if str(f).startswith("layers.")) for part in parts]
        stages = len(parts)
    else:
        per = par.get("pipeline_parallel_layers_per_stage")
        stages = math.ceil((layers + first + last) / per) if per else pp * (2 if sched in MULTI_STAGE else 1)
        split = default_split(stages, layers, first, last)
    if stages % pp:
        raise ConfigError("parallelism.pipeline_parallel_degree", f"{stages} model parts do not divide over pp {pp}")
    vpp = stages // pp
    if sched == "zb_h1" and vpp > 1:
        raise ConfigError("parallelism.pipeline_parallel_schedule", multi_stage_refusal(vpp))
    if sched == "zb_h1" and not parts:  # torchtitan: a multi-stage schedule needs 2 stages per rank
        raise ConfigError("parallelism.pipeline_parallel_layers_per_stage", f"{raw} with 1 stage per rank: torchtitan "
                          f"refuses a multi-stage schedule with fewer than 2; give module_fqns_per_model_part with "
                          f"{pp} parts for one stage per rank")
    if sched in V_SCHEDULES and vpp != 2:
        raise ConfigError("parallelism.pipeline_parallel_schedule", f"{raw} with {vpp} stages per rank; a V-shaped "
                          f"schedule holds exactly 2 (2 x pp model parts)")
    if sched not in V_SCHEDULES + ("zb_h1",) and (vpp > 1) != (sched == "interleaved_1f1b"):
        raise ConfigError("parallelism.pipeline_parallel_schedule", f"{raw} with {vpp} stages per rank; a "
                          f"single-stage schedule needs 1, Interleaved1F1B at least 2")
    notes.append(f"layers per {'virtual ' if vpp > 1 else ''}stage {split} (torchtitan's split)")
    return {"pp_schedule": sched, "virtual_stages": vpp, "pp_layer_split": split}


def mesh_table(deg: dict[str, int], par: dict, layers: int, notes: list[str]) -> dict[str, Any]:
    """[mesh]: the axes of degree != 1 in torchtitan's order (dp_shard -1 kept: meshplan
    infers it exactly), SP with tp, loss parallel, the pipeline."""
    axes = [a for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp") if deg[a] != 1]
    mesh: dict[str, Any] = {"names": axes or ["dp_shard"], "shape": [deg[a] for a in axes] or [1],
                            "sequence_parallel": deg["tp"] > 1,
                            "loss_parallel": not par.get("disable_loss_parallel", False)}
    return mesh | read_pipeline(par, deg["pp"], layers, notes)
