"""Build one inspectable plan from a config: mesh -> validity -> placement -> shapes ->
memory -> constraints -> collectives -> memory timeline. Pure: a :class:`Plan` is a value;
reports read it. Memory feasibility comes from the per-stage timeline peak
(:mod:`meshplan.memory.timeline`); the constraints' first estimate only sizes the
pre-mesh capacity rows.

An infeasible mesh is a Plan with ``feasible = False`` and its reasons, never an exception;
malformed input raises :class:`~meshplan.errors.ConfigError` before any of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from meshplan.memory import constraints as cons
from meshplan.comm.collectives import CollectiveRow, collective_table
from meshplan.errors import ConfigError
from meshplan.memory.state import StateBytes, state_bytes
from meshplan.memory.timeline import Timeline, memory_timelines, most_loaded
from meshplan.mesh.layout import check_partition
from meshplan.mesh.resolve import Infeasible, Mesh, resolve_mesh
from meshplan.placement.assign import Flag, Placement, place, placement_flags
from meshplan.compute.shapes import Attention, Gemm, attention_shape, layer_gemms, output_gemm
from meshplan.config import Config
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.mesh.validity import check
from meshplan.pipeline.registry import reasons as schedule_reasons

SCHEMA = "meshplan.plan/v1"


@dataclass(frozen=True)
class Plan:
    """Everything meshplan derives for one mesh. Fields after ``reasons`` are None/empty
    when the mesh could not be resolved."""

    config: Config
    world: int
    feasible: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()
    derivation: tuple[str, ...] = ()
    mesh: Optional[Mesh] = None
    stages: Optional[list] = None
    vpp: int = 1
    micro_batches: int = 0
    placement: Optional[Placement] = None
    flags: tuple[Flag, ...] = ()
    gemms: tuple[Gemm, ...] = ()
    attention: Optional[Attention] = None
    state: tuple[StateBytes, ...] = ()
    constraints: Optional[Any] = None
    collectives: dict[str, list[CollectiveRow]] = field(default_factory=dict)
    timelines: tuple[Timeline, ...] = ()

    @property
    def timeline(self) -> Optional[Timeline]:
        """The memory timeline of the most loaded stage (None without timelines)."""
        return most_loaded(self.timelines) if self.timelines else None

    @property
    def tokens_per_microbatch(self) -> int:
        return self.config.training.micro_batch * self.config.training.seq_len // self.mesh.degree("cp")


def build_plan(config: Config, constraints: Optional[cons.Constraints] = None) -> Plan:
    """The plan of ``config``'s mesh on its cluster. Raises ConfigError on bad input only.
    ``constraints``: :func:`meshplan.memory.constraints.constraints` of the same model, training
    and cluster when already computed (the search passes them; they do not depend on the
    mesh)."""
    m, t, c = config.model, config.training, config.cluster
    if config.mesh is None:
        raise ConfigError("mesh", "missing table [mesh]; planning needs a mesh (meshplan search finds one)")
    world = config.mesh.world or c.world
    if world > c.world:
        raise ConfigError("mesh.world", f"{world} ranks but the cluster has {c.world} GPUs "
                          f"({c.nodes} nodes x {c.node.gpus}); use fewer ranks or more nodes")
    mesh = resolve_mesh(config.mesh, world, gpus_per_node=c.node.gpus)
    if constraints is None:
        constraints = cons.constraints(m, t, c, world)
    if isinstance(mesh, Infeasible):
        return Plan(config, world, False, mesh.reasons, constraints=constraints)
    v = check(m, t, mesh, config.mesh)
    pp = mesh.degree("pp")  # the pipeline schedule's own rules (meshplan.pipeline), after the mesh's
    v = replace(v, reasons=v.reasons + schedule_reasons(config.mesh.pp_schedule, pp, v.micro_batches, v.vpp))
    partition = [f"axis {a}: {problem}" for a in mesh.all_axes() for problem in check_partition(mesh.groups(a), world)]
    placement = place(c, world, config.mesh.rank_to_gpu)
    flags = tuple(placement_flags(mesh, placement))
    base = dict(config=config, world=world, notes=v.notes, derivation=mesh.derivation, mesh=mesh,
                placement=placement, flags=flags, vpp=v.vpp, micro_batches=v.micro_batches)
    if v.reasons or partition:
        return Plan(feasible=False, reasons=v.reasons + tuple(partition), constraints=constraints, **base)
    tp, cp = mesh.degree("tp"), mesh.degree("cp")
    tokens = t.micro_batch * t.seq_len // cp
    gemms = layer_gemms(m, tp, tokens, ep=mesh.ep, etp=mesh.etp)
    gemms.append(output_gemm(m, tp, tokens, padded_vocab(m.vocab, t.vocab_pad_divisor, tp)))
    state = tuple(state_bytes(m, mesh, t, v.stages))
    annotated = cons.annotate_axes(constraints, m, t, c, mesh, v.stages, v.micro_batches)
    colls = _collectives(config, mesh, placement, v.stages, v.micro_batches)
    plan = Plan(feasible=True, reasons=(), stages=v.stages, gemms=tuple(gemms),
                attention=attention_shape(m, tp, cp, t.micro_batch, t.seq_len), state=state,
                constraints=annotated, collectives=colls, **base)
    timelines = memory_timelines(plan)
    reasons = memory_reasons(timelines)
    return replace(plan, feasible=not reasons, reasons=reasons, timelines=timelines)


def memory_reasons(timelines: tuple[Timeline, ...]) -> tuple[str, ...]:
    """The most loaded stage's reason when its peak exceeds usable memory, and how many
    stages do."""
    over = [tl for tl in timelines if not tl.fits]
    if not over:
        return ()
    reasons = [most_loaded(over).reason()]
    if len(over) > 1:
        reasons.append(f"{len(over)} of {len(timelines)} stages exceed usable memory: stages "
                       + ", ".join(str(tl.stage) for tl in over[:16]) + (" ..." if len(over) > 16 else ""))
    return tuple(reasons)


def _collectives(config: Config, mesh: Mesh, placement, stages, micro) -> dict[str, list[CollectiveRow]]:
    """Tables for the first stage, one middle stage (pp > 2) and the last stage: the roles
    that differ (middle stages hold no embedding or head and talk to two neighbours)."""
    pp, vpp = len(stages), len(stages[0])
    out = {}
    for k in sorted({0, min(1, pp - 1), pp - 1} if pp > 2 else {0, pp - 1}):
        layers = [i for chunk in stages[k] for i in chunk]
        out[f"stage {k}"] = collective_table(config.model, config.training, mesh, config.cluster, placement,
                                             layers, micro, first_stage=k == 0, last_stage=k == pp - 1,
                                             loss_parallel=config.mesh.loss_parallel, stage=k, vpp=vpp,
                                             schedule=config.mesh.pp_schedule, chunks=stages[k])
    return out


def stage_table(plan: "Plan", stage: int) -> list[CollectiveRow]:
    """The collective table of pipeline stage ``stage`` (middle stages share stage 1's)."""
    pp = len(plan.stages)
    key = 0 if stage == 0 else pp - 1 if stage == pp - 1 else 1
    return plan.collectives[f"stage {key}"]


def with_rank_to_gpu(plan: Plan, rank_to_gpu) -> Plan:
    """``plan`` with the rank -> GPU permutation ``rank_to_gpu`` (element r = global GPU of
    rank r): new config ``mesh.rank_to_gpu``, placement, locality flags and collective tables
    (their paths and link classes follow the placement). Degrees, groups, shapes, state and
    the memory timelines do not depend on where ranks sit and are kept; equal to
    ``build_plan`` of the changed config (tests check the step time)."""
    if plan.mesh is None or plan.stages is None:
        raise ConfigError("mesh.rank_to_gpu", "a placement needs a resolved plan with stages")
    r2g = [int(g) for g in rank_to_gpu]
    config = replace(plan.config, mesh=plan.config.mesh.model_copy(update={"rank_to_gpu": r2g}))
    placement = place(config.cluster, plan.world, r2g)
    colls = _collectives(config, plan.mesh, placement, plan.stages, plan.micro_batches)
    return replace(plan, config=config, placement=placement, flags=tuple(placement_flags(plan.mesh, placement)),
                   collectives=colls)
