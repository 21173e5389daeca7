"""The context-parallel variant of a plan's memory ``fix:`` line (:func:`meshplan.plan_fix.memory_fix`):
cp taken from the data axis, or from pp where the data axis does not split in 2, the smallest of
:data:`CP_FACTORS` times the configured that fits; the sequence's activations per rank scale with
1 / cp while FSDP still shards the state over dp_shard x cp. Where no cp is offered and activations
dominate the peak, why (:func:`_cp_why`; newcomer trial 21 #4, Mixtral-8x7B at seq 10,000,000).
Split from :mod:`meshplan.plan_fix` (over the 400-line module limit) along this seam: the one
variant that plans several meshes of its own and explains a refusal.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from meshplan.keymap import OWN, KeyMap
from meshplan.plan import Plan
from meshplan.plan_variant import DATA_AXES, mesh_words, tried, variant_mesh

#: Factors of the configured cp tried in turn (each taken from the data axis where it divides
#: it), the first that fits offered: at most 3 more plans.
CP_FACTORS = (2, 4, 8)


def _with_cp(deg: dict[str, int], data: str, k: int) -> dict[str, int]:
    """``deg`` with cp ``k`` times larger and ``data`` ``k`` times smaller (a new cp axis inside
    the data axes, before tp and the expert axes: torchtitan's ``dp_shard, cp, tp``).

    >>> _with_cp({"dp_shard": 8, "tp": 8}, "dp_shard", 4)
    {'dp_shard': 2, 'cp': 4, 'tp': 8}
    """
    names = list(deg)
    if "cp" not in names:
        names.insert(next((i for i, n in enumerate(names) if n in ("tp", "ep", "etp")), len(names)), "cp")
    out = {n: deg.get(n, 1) for n in names}
    out[data] //= k
    out["cp"] *= k
    return out


def cp_variant(plan: Plan, keys: KeyMap = OWN) -> tuple[Optional[tuple[str, Plan]], str]:
    """((words, plan), why) of context parallelism taken from the data axis (from pp where the data
    axis does not split in 2, :func:`_pp_source`): the smallest cp,
    :data:`CP_FACTORS` times the configured, whose plan fits; where none fits, the largest the
    rules take, whose peak the line prints where it is lower than the plan's (as tp x2's; the
    sequence's activations scale with 1 / cp). ``why``: where no cp is offered, why, for a
    line whose peak activations dominate (:func:`_cp_why`; "" otherwise): no data axis that
    splits, the user's ``rank_to_gpu``, or the rule that refuses the first cp (a sequence that
    does not split into 2 x cp chunks, an engine without cp)."""
    deg = plan.axis_degrees()
    if moe_cp_refused(plan):
        groups = plan.timeline.by_group()
        return None, MOE_CP if max(groups, key=lambda g: groups[g]) == "activations" else ""
    data = next((n for n in DATA_AXES if deg.get(n, 1) > 1), next((n for n in DATA_AXES if n in deg), None))
    source = data if data is not None and deg[data] % CP_FACTORS[0] == 0 else _pp_source(plan, deg)
    if source is None or plan.spec.rank_to_gpu is not None:
        return None, _cp_why(plan, deg, data, None)
    best: Optional[tuple[str, Plan]] = None
    refused: Optional[str] = None
    for k in CP_FACTORS:
        if deg[source] % k:
            break
        moved = _with_cp(deg, source, k)
        p = tried(replace(plan.config, mesh=variant_mesh(plan, moved)))
        if isinstance(p, str):
            refused = refused or f"cp {moved['cp']}: {p}"
            continue
        words = f"{keys.axis('cp')} {moved['cp']} ({mesh_words(moved, keys)})"
        if p.feasible:
            return (words, p), ""
        best = (words, p)
    if best is not None and best[1].timeline.verdict_bytes < plan.timeline.verdict_bytes:
        return best, ""
    return None, _cp_why(plan, deg, data, refused)


#: Why no cp is offered for a model with multi-head latent attention under ``training.framework = "torch"``
#: (:func:`moe_cp_refused`), in torchtitan's words (newcomer trial 48: the line offered
#: context_parallel_degree 4 for torchtitan's DeepSeek-V3 16B).
MOE_CP = ("cp not offered: torchtitan runs its DeepSeek-V3 flavours (MLA) with flex attention, where its "
          "parallelize refuses CP: \"Context Parallel only supports SDPA attention. Got attn_type='flex'. "
          "FlexAttention and varlen attention are not supported with CP.\" (models/deepseek_v3/infra/"
          "parallelize.py:67-73 at e347b1e, v0.2.2)")


def moe_cp_refused(plan: Plan) -> bool:
    """Whether cp is not offered for ``plan`` because torchtitan refuses it: an MoE model with multi-head
    latent attention (a DeepSeek-V3 flavour's shape) under ``training.framework = "torch"``. pytorch/torchtitan e347b1e (v0.2.2, the job
    TOML meshplan reads and writes; 238fa99 the same) ``models/deepseek_v3/infra/parallelize.py`` lines
    67-73 raise NotImplementedError at ``context_parallel_degree > 1`` unless ``attn_type == "sdpa"``,
    and ``models/deepseek_v3/__init__.py`` gives the 16B, 236B and 671B flavours ``attn_type="flex"``
    (lines 100, 127, 154; DeepSeek-V3 is torchtitan's one MLA model). Qwen3's MoE flavours keep the
    default "sdpa" (``models/qwen3/model/args.py`` line 39; ``models/qwen3/infra/parallelize.py``
    lines 69-75 the same rule), so CP is offered there, and for the other MoE models, whose attention
    meshplan plans as SDPA. (meshplan validate builds context parallelism for dense models only:
    :func:`meshplan.runtime.execution.buildable.unsupported_reasons` says so for the plan it
    runs.) A dense MLA model is no torchtitan flavour; meshplan's own runtime runs it with cp (torch's ring
    over SDPA: tests/test_mla.py), so cp stays offered; ``plan`` itself refuses no cp (a refusal rule broke
    those validated meshes: tt49). torchtitan b5bcd76 reversed the rule (``models/common/decoder.py``
    173-183: CP with SDPA or varlen raises, flex is required); meshplan plans torch's CP as the SDPA
    ring of <= v0.2.2."""
    m = plan.config.model
    return m.is_moe and m.is_mla and plan.config.training.framework == "torch"


def _pp_source(plan: Plan, deg: dict[str, int]) -> Optional[str]:
    """``"pp"`` where cp may be taken from the pipeline axis instead of a data axis of one rank (or
    one that does not split in 2): pp even and its layers split evenly (no ``pp_layer_split``);
    None otherwise. Newcomer trial 31 #1: Llama-3-70B at seq 131072, pp 8 x dp 1 x cp 4 x tp 8 on
    32 dgx-h100 (peak 100.5 GiB) fits at pp 4 x cp 8 x tp 8 (the constraint table's "cp >= 8"),
    where the line offered only recompute full, the slower step."""
    return "pp" if deg.get("pp", 1) % CP_FACTORS[0] == 0 and plan.spec.pp_layer_split is None else None


def _cp_why(plan: Plan, deg: dict[str, int], data: Optional[str], refused: Optional[str]) -> str:
    """Why no cp is offered, for a plan whose peak activations dominate ("" otherwise, or
    where cp was planned and lowers nothing): the user's ``rank_to_gpu``, a data axis that
    does not split in 2, or ``refused``, the first cp's refusal by the planner's rules."""
    groups = plan.timeline.by_group()
    if max(groups, key=lambda g: groups[g]) != "activations":
        return ""
    if plan.spec.rank_to_gpu is not None:
        return "cp not tried: mesh.rank_to_gpu fixes the placement"
    if data is None:
        return "cp not tried: it is taken from the data axis, and the mesh has no dp_shard or dp"
    if deg[data] % CP_FACTORS[0]:
        return f"cp not tried: it is taken from the data axis, and {data} {deg[data]} does not split in 2"
    return f"cp not offered ({refused})" if refused else ""
