"""``meshplan step --schedule``: the option applied to the config before its plan is built
(:func:`scheduled`), so the plan's rules (the schedule's micro-batch and virtual-stage rules,
Megatron-LM's and DeepSpeed's schedules, memory) judge the schedule the user asked for, not
the config's ``mesh.pp_schedule``; and its refusals named ``--schedule``, each with the fix
its rule needs (:func:`renamed`, :func:`rule_error`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from meshplan.errors import ConfigError
from meshplan.mesh import resolve
from meshplan.mesh.layers import stage_layers
from meshplan.pipeline.registry import fewest_micro_batches
from meshplan.pipeline.registry import get as get_schedule
from meshplan.pipeline.registry import reasons as schedule_reasons
from meshplan.plan_runtime import run_reasons


def scheduled(cfg, schedule: Optional[str]):
    """``cfg`` with its ``mesh.pp_schedule`` replaced by ``schedule`` when its mesh resolves
    with pp > 1; ``cfg`` itself otherwise (no option, no [mesh], an unresolved mesh, or pp 1:
    nothing to schedule, step's note says so)."""
    spec, c = cfg.mesh, cfg.cluster
    if schedule is None or spec is None:
        return cfg
    mesh = resolve.resolve_mesh(spec, spec.world or c.world, gpus_per_node=c.node.gpus)
    if isinstance(mesh, resolve.Infeasible) or mesh.degree("pp") == 1:
        return cfg
    return replace(cfg, mesh=spec.model_copy(update={"pp_schedule": schedule}))


def renamed(e: ConfigError, schedule: str) -> ConfigError:
    """The ConfigError ``e`` that the plan of a config :func:`scheduled` with ``schedule``
    raised, named ``--schedule`` when the schedule brought it: ``mesh.pp_schedule`` (a schedule
    Megatron-LM or DeepSpeed's engine does not run) as is, ``mesh.virtual_stages`` (the mesh's
    chunks per rank that ``schedule`` does not run) with the choice left; ``e`` otherwise."""
    if e.field == "mesh.pp_schedule":
        return ConfigError("--schedule", e.message)
    if e.field == "mesh.virtual_stages":
        return ConfigError("--schedule", f"{schedule}: {e.message}; choose a schedule this mesh allows, or set "
                           f"mesh.virtual_stages to the chunks per rank {schedule} runs")
    return e


def rule_error(plan, schedule: str) -> Optional[ConfigError]:
    """The ``--schedule`` error of an infeasible ``plan`` of a config :func:`scheduled` with
    ``schedule`` when the schedule's own rules refuse it (:func:`~meshplan.plan_runtime.run_reasons`,
    the first reason), with what the rule needs: for the micro-batch rule
    (:meth:`~meshplan.pipeline.base.PipelineSchedule.refused`), the step's micro-batches
    (global_batch / (micro_batch x dp)) and the fewest the schedule runs
    (:func:`~meshplan.pipeline.registry.fewest_micro_batches`, per schedule run); else the
    mesh's virtual stages. None when the rules take it, the mesh did not resolve, or
    ``training.pp_schedule_runs`` does not divide the micro-batches (the config's, under any
    schedule: the plan's infeasible line says it).

    E.g. 1f1b at pp 2 with 1 micro-batch: ``1f1b: 1F1B needs micro-batches (1) >= pp (2)
    (torch Schedule1F1B); raise training.global_batch, or lower training.micro_batch or pp,
    until the step's micro-batches (now 1: global_batch / (micro_batch x dp)) meet the rule
    (the fewest 1f1b runs at pp 2: 2), or choose a schedule this mesh allows``."""
    if plan.mesh is None or plan.feasible or str(plan.spec.pp_schedule) != schedule:  # not scheduled: pp 1
        return None
    return refusal(schedule, plan.mesh.degree("pp"), plan.micro_batches, plan.vpp, plan.config.training,
                   plan.config.model.layers, layer_split(plan.config))


def layer_split(cfg) -> Optional[list[int]]:
    """``cfg``'s ``mesh.pp_layer_split``, None without one (or without a [mesh])."""
    return cfg.mesh.pp_layer_split if cfg.mesh is not None else None


def chunks_fix(schedule: str, pp: int, m: int, layers: int, framework: str = "torch",
               split: Optional[list[int]] = None) -> str:
    """The fix of a schedule's virtual-stage rule, naming the key and a value it takes: the fewest
    chunks per rank ``v`` that ``schedule`` runs at ``pp`` stages and ``m`` micro-batches per
    schedule run, or at the fewest it runs with ``v`` (:func:`~meshplan.pipeline.registry.reasons`
    empty: the micro-batches are a fix of their own), whose virtual stages the ``layers`` fill
    (:func:`~meshplan.mesh.layers.stage_layers`, the plan's rule: without ``split`` evenly, a
    multiple of pp x v; with the config's ``mesh.pp_layer_split`` each stage's layers over its
    chunks). Newcomer trial 29 (Llama-3.1-70B, pp 4, 32 micro-batches, interleaved_1f1b) was told
    "set the config's virtual stages" without the key:

    >>> chunks_fix("interleaved_1f1b", 4, 32, 80)
    'set mesh.virtual_stages = 2 (80 layers / (pp 4 x 2) = 10 per virtual stage)'
    >>> chunks_fix("1f1b", 4, 32, 80)
    'set mesh.virtual_stages = 1 (80 layers / (pp 4 x 1) = 20 per virtual stage)'

    Llama 3 405B's 126 layers at pp 16 (examples/llama3-405b_16384xh100_tp8-pp16-dp128.toml) are
    no multiple of 16 x v, but its split [7, 8 x 14, 7] gives each stage's 7 or 8 layers to 2 chunks:

    >>> chunks_fix("interleaved_1f1b", 16, 16, 126, split=[7] + [8] * 14 + [7])
    "set mesh.virtual_stages = 2 (mesh.pp_layer_split's layers of each stage over its 2 chunks)"
    """
    for v in range(1, layers // max(pp, 1) + 1):  # at m, or at the fewest the schedule runs (m its own fix)
        ms = (m, fewest_micro_batches(schedule, pp, v, framework))
        if not isinstance(stage_layers(layers, pp, v, split), str) and any(
                not schedule_reasons(schedule, pp, x, v, framework) for x in ms):
            return (f"set mesh.virtual_stages = {v} ({layers} layers / (pp {pp} x {v}) = {layers // (pp * v)} per "
                    f"virtual stage)") if split is None else \
                f"set mesh.virtual_stages = {v} (mesh.pp_layer_split's layers of each stage over its {v} chunks)"
    return f"set mesh.virtual_stages to chunks per rank that {schedule} runs at pp {pp}"


def refusal(schedule: str, pp: int, m: int, v: int, t, layers: int,
            split: Optional[list[int]] = None) -> Optional[ConfigError]:
    """:func:`rule_error` of ``schedule`` at ``pp`` stages, ``m`` micro-batches per step, ``v``
    chunks per rank, under training ``t`` (its framework and ``pp_schedule_runs``), for a model
    of ``layers`` layers split by ``split`` (the virtual stages' fix: :func:`chunks_fix`)."""
    runs = t.pp_schedule_runs
    bad = run_reasons(schedule, pp, m, v, runs, t.framework)
    if not bad or m % runs:  # runs not dividing m is the config's, whatever the schedule: the plan's reason
        return None
    least = fewest_micro_batches(schedule, pp, v, t.framework)
    chunks = bool(schedule_reasons(schedule, pp, least, v, t.framework))  # the virtual-stage rule
    vs_fix = chunks_fix(schedule, pp, m // runs, layers, t.framework, split)
    if not get_schedule(get_schedule(schedule).for_chunks(v)).refused(pp, m // runs, t.framework):
        return ConfigError("--schedule", f"{schedule}: {bad[0]}; choose a schedule this mesh allows, or {vs_fix}")
    per_run = f", {runs} schedule runs: training.pp_schedule_runs" if runs > 1 else ""
    return ConfigError("--schedule", f"{schedule}: {'; '.join(bad)}; {vs_fix + ', and ' if chunks else ''}raise "
                       f"training.global_batch, or lower training.micro_batch or pp, until the step's micro-batches "
                       f"(now {m}: global_batch / (micro_batch x dp){per_run}) meet the rule (the fewest {schedule} "
                       f"runs at pp {pp}: {least * runs}), or choose a schedule this mesh allows")
