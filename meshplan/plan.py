"""Build one inspectable plan from a config: mesh -> validity -> placement -> shapes ->
memory -> constraints -> collectives -> memory timeline. Pure: a :class:`Plan` is a value;
reports read it. Memory feasibility comes from the per-stage timeline peak
(:mod:`meshplan.memory.timeline`); the constraints' first estimate only sizes the
pre-mesh capacity rows.

:func:`build_plan` returns one of two types, never raises for a mesh that does not work:

- :class:`Infeasible`: the mesh has no plan: its degrees do not make the world
  (``mesh`` None) or a validity rule fails (heads, widths, batch, layers, groups; ``mesh``
  and ``placement`` set). ``reasons`` say why, one line each with the numbers.
- :class:`Plan`: a resolved mesh with every field set (no Optional): stages, shapes,
  state, collective tables and the memory timeline of every stage. ``Plan.feasible`` is
  whether the timeline peak fits usable HBM; ``Plan.reasons`` are the memory reasons when
  it does not.

Malformed input raises :class:`~meshplan.errors.ConfigError` before any of this runs, and so
does a setting no runtime runs (:mod:`meshplan.plan_checks`). What the framework's runtime
refuses or runs differently from the plan (the schedule's rules per run, the warnings
printed as notes, an export target's refusals) is :mod:`meshplan.plan_runtime`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.comm.collectives import collective_table
from meshplan.comm.deepep import group_reason as deepep_group_reason
from meshplan.comm.row import CollectiveRow
from meshplan.compute.shapes import Attention, Gemm, local_shapes
from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.memory import constraints as cons
from meshplan.memory.offload_host import host_memory_note, host_memory_reasons
from meshplan.memory.state import StateBytes, state_bytes
from meshplan.memory.timeline import Timeline, memory_timelines, most_loaded, stage_timelines
from meshplan.mesh import resolve
from meshplan.mesh.layers import last_stage
from meshplan.mesh.layout import check_partition
from meshplan.mesh.resolve import Mesh, resolve_mesh
from meshplan.mesh.validity import check, unresolved_reasons
from meshplan.pipeline.registry import check_chunks, check_framework
from meshplan.pipeline.registry import get as get_schedule
from meshplan.placement.assign import Placement, place
from meshplan.placement.flags import Flag, placement_flags
from meshplan.plan_checks import check_block_recompute, check_runnable, without_pipeline
from meshplan.plan_moe import deepep_ep_copies, ep_span, moe_notes
from meshplan.plan_runtime import dualpipev_ep_ac_reasons, megatron_p2p_reasons, p2p_note, run_reasons, runtime_warnings
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.mesh_words import derivation_words
from meshplan.units import counted

SCHEMA = "meshplan.plan/v1"

#: Layer indices per pipeline stage, per virtual chunk: ``stages[k][c] = [layer, ...]``
#: (:func:`meshplan.mesh.layers.stage_layers`).
StageLayers = list[list[list[int]]]


def table_stage(stage: int, pp: int) -> int:
    """The stage whose collective table stage ``stage`` of ``pp`` uses: the first and the
    last stage have their own (embedding, output layer, one pp neighbour); every middle
    stage shares stage 1's (same layers' collectives, two neighbours).

    >>> [table_stage(k, 4) for k in range(4)]
    [0, 1, 1, 3]
    >>> [table_stage(k, 2) for k in range(2)], table_stage(0, 1)
    ([0, 1], 0)
    """
    return 0 if stage == 0 else pp - 1 if stage == pp - 1 else 1


def table_key(stage: int) -> str:
    """Key of stage ``stage``'s table in :attr:`Plan.collectives` (and the JSON's
    ``collectives``): ``"stage 0"``."""
    return f"stage {stage}"


@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``index`` of a :class:`Plan`, as one rank of it sees it.

    ``chunks``: layer indices per virtual chunk (``vpp`` lists); ``table_stage``: the stage
    whose collective table this one uses (:func:`table_stage`); ``collectives``: that table;
    ``state``: persistent bytes per rank; ``timeline``: this stage's memory timeline;
    ``last``: it holds the model's last layer, output layer and loss (the last stage, or
    stage 0 under a V-shaped schedule, :func:`meshplan.mesh.layers.last_stage`)."""

    index: int
    pp: int
    chunks: list[list[int]]
    table_stage: int
    collectives: list[CollectiveRow]
    state: StateBytes
    timeline: Timeline
    last: bool

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def layers(self) -> list[int]:
        """Every layer this stage holds, chunk by chunk."""
        return [i for chunk in self.chunks for i in chunk]


@dataclass(frozen=True)
class Plan:
    """Everything meshplan derives for one resolved mesh; every field is set.

    ``stages``: :data:`StageLayers`; ``state``, ``timelines``: one per stage;
    ``collectives``: the tables of the stages :func:`table_stage` names, keyed by
    :func:`table_key` (read one stage's with :meth:`stage`); ``reasons``: why the memory
    timeline does not fit (empty when it does)."""

    config: Config
    spec: MeshSpec
    world: int
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    derivation: tuple[str, ...]
    mesh: Mesh
    stages: StageLayers
    vpp: int
    micro_batches: int
    placement: Placement
    flags: tuple[Flag, ...]
    gemms: tuple[Gemm, ...]
    attention: Attention
    state: tuple[StateBytes, ...]
    constraints: cons.Constraints
    collectives: dict[str, list[CollectiveRow]]
    timelines: tuple[Timeline, ...]

    @property
    def feasible(self) -> bool:
        """True when every stage's memory timeline peak fits usable HBM (and, under ZeRO-Offload,
        the node's host memory holds its ranks' host state)."""
        return not self.reasons

    @property
    def timeline(self) -> Timeline:
        """The memory timeline of the most loaded stage."""
        return most_loaded(self.timelines)

    @property
    def pp(self) -> int:
        return len(self.stages)

    def axis_degrees(self) -> dict[str, int]:
        """The config's mesh axes (its names, or its Megatron degrees' keys, in its order) with
        their resolved degrees (ep and etp as the mesh re-factors them); the one home of the
        fix line's and the bubble hint's re-planned meshes (:mod:`meshplan.plan_fix`,
        :mod:`meshplan.schedule.bubble_hint`)."""
        spec, mesh = self.spec, self.mesh
        names = spec.names if spec.names is not None else list((spec.degrees or {}))
        return {n: (mesh.ep if n == "ep" else mesh.etp if n == "etp" else mesh.degree(n)) for n in names}

    @property
    def schedule_runs(self) -> int:
        """Pipeline schedules per step (``training.pp_schedule_runs`` with pp > 1, else 1)."""
        return self.config.training.pp_schedule_runs if self.pp > 1 else 1

    @property
    def run_micro_batches(self) -> int:
        """Micro-batches of one pipeline schedule run: ``micro_batches / schedule_runs``."""
        return self.micro_batches // self.schedule_runs

    @property
    def tokens_per_microbatch(self) -> int:
        return self.config.training.micro_batch * self.config.training.seq_len // self.mesh.degree("cp")

    def stage(self, k: int) -> Stage:
        """Pipeline stage ``k`` (0 .. pp-1): its layers, collective table, state and timeline."""
        if not 0 <= k < self.pp:
            raise IndexError(f"stage {k} outside 0..{self.pp - 1}")
        key = table_stage(k, self.pp)
        return Stage(index=k, pp=self.pp, chunks=self.stages[k], table_stage=key,
                     collectives=self.collectives[table_key(key)], state=self.state[k], timeline=self.timelines[k],
                     last=k == last_stage(self.stages))

    def stage_of(self, rank: int) -> Stage:
        """The stage rank ``rank`` runs: its pp coordinate (0 without a pp axis)."""
        names = self.mesh.layout.names
        return self.stage(self.mesh.layout.coords_of(rank)[names.index("pp")] if "pp" in names else 0)


@dataclass(frozen=True)
class Infeasible:
    """A mesh with no plan, and why. ``mesh`` is None when the degrees do not make the
    world; when a validity rule failed, ``mesh``, ``placement``, ``flags``, ``vpp`` and
    ``micro_batches`` say what was resolved (printed before the reasons)."""

    config: Config
    spec: MeshSpec
    world: int
    reasons: tuple[str, ...]
    constraints: cons.Constraints
    notes: tuple[str, ...] = ()
    derivation: tuple[str, ...] = ()
    mesh: Mesh | None = None
    placement: Placement | None = None
    flags: tuple[Flag, ...] = ()
    vpp: int = 1
    micro_batches: int = 0

    @property
    def feasible(self) -> bool:
        return False

    @property
    def timelines(self) -> tuple[Timeline, ...]:
        """Empty: a mesh without a plan has no memory timeline (a loop over results can
        read ``timelines`` of either type)."""
        return ()


def build_plan(config: Config, constraints: cons.Constraints | None = None, memory: bool = True,
               reports: bool = True) -> Plan | Infeasible:
    """The plan of ``config``'s mesh on its cluster, or why it has none (see the module
    docstring). Raises ConfigError on bad input only. ``constraints``:
    :func:`meshplan.memory.constraints.constraints` of the same model, training and cluster
    when already computed (the search passes them; they do not depend on the mesh).
    For the search's exact evaluation (:mod:`meshplan.search.exact`), of a resolved mesh:
    ``reports=False`` leaves out what only reports read, the constraints' per-axis
    annotation (``constraints`` kept as given) and the placement flags (empty);
    ``memory=False`` also the memory timelines (``timelines`` empty, no memory reasons, so
    ``feasible`` says nothing about memory). Every other field is the same."""
    m, t, c, spec = config.model, config.training, config.cluster, config.mesh
    if spec is None:
        raise ConfigError("mesh", "missing table [mesh]; planning needs a mesh (meshplan search finds one)")
    world = spec.world or c.world
    if world > c.world:
        raise ConfigError("mesh.world", f"{world} ranks but the cluster has {c.world} GPUs "
                          f"({counted(c.nodes, 'node')} x {c.node.gpus}); use fewer ranks or more nodes")
    mesh = resolve_mesh(spec, world, gpus_per_node=c.node.gpus, filled=config.filled_axes)
    check_runnable(config, spec, mesh)
    if constraints is None:
        constraints = cons.constraints(m, t, c, world, spec.pp_schedule)
    if isinstance(mesh, resolve.Infeasible):  # a tp the model refuses named first (unresolved_reasons)
        return Infeasible(config, spec, world, unresolved_reasons(m, t, spec) + mesh.reasons, constraints)
    # reshard_after_forward unset: this mesh's default (TrainingSpec.at_pp); fp8_all_gather as torchtitan runs it
    t = t.at_pp(mesh.degree("pp")).at_dp_shard(mesh.degree("dp_shard") * mesh.degree("dp"))
    asked = config.fp8_all_gather_asked or (config.training.fp8_all_gather and not t.fp8_all_gather)
    config = replace(config, training=t, fp8_all_gather_asked=asked)
    config, spec, no_pipeline = without_pipeline(config, spec, mesh)
    v = _stages(config, spec, mesh, no_pipeline)
    partition = [f"axis {a}: {problem}" for a in mesh.all_axes() for problem in check_partition(mesh.groups(a), world)]
    placement = place(c, world, spec.rank_to_gpu)
    if t.moe_dispatcher == "deepep" and m.is_moe:  # DeepEP asserts on a group size it has no config for (rule deepep)
        partition += [why for why in [deepep_group_reason(mesh.ep, mesh.etp, t.framework)] if why]
    failed = bool(v.reasons or partition or v.stages is None)
    flags = tuple(placement_flags(mesh, placement, training=t)) if failed or reports else ()
    if failed or v.stages is None:  # (the second for mypy: failed covers it)
        return Infeasible(config, spec, world, v.reasons + tuple(partition), constraints, notes=v.notes,
                          derivation=derivation_words(mesh.derivation, t, config.origin), mesh=mesh, placement=placement, flags=flags, vpp=v.vpp,
                          micro_batches=v.micro_batches)
    plan = _plan(config, spec, world, mesh, v, placement, flags, constraints, reports)
    return with_memory(plan) if memory else plan


def _stages(config: Config, spec, mesh, no_pipeline: tuple):
    """The stage split of ``mesh`` (:func:`~meshplan.mesh.validity.check` with the schedule's chunk
    map) after the schedule's, the block recompute's and the framework's refusals (ConfigError),
    with the pipeline schedule's own rules as reasons (:mod:`meshplan.pipeline`, after the mesh's;
    none where the virtual stages are unknown: their reason says why) and the runtime's notes
    (``no_pipeline``: :func:`~meshplan.plan_checks.without_pipeline`'s first)."""
    m, t = config.model, config.training
    v = check(m, t, mesh, spec, get_schedule(spec.pp_schedule).virtual_stage)  # the schedule's chunk map
    check_chunks(spec.pp_schedule, v.vpp)  # a one-chunk schedule with virtual stages: the same error everywhere
    if v.stages is not None:
        check_block_recompute(t, v.stages)  # n past every model chunk
    check_framework(spec.pp_schedule, t.framework, mesh.degree("pp"))  # Megatron-LM runs 1F1B and interleaved only
    pp = mesh.degree("pp")  # the pipeline schedule's own rules (meshplan.pipeline), after the mesh's
    vpp_unknown = bool(spec.layers_per_virtual_stage) and v.stages is None  # its reason says why; no vpp to judge
    return replace(v, reasons=v.reasons + (() if vpp_unknown else run_reasons(spec.pp_schedule, pp, v.micro_batches,
                                                                              v.vpp, t.pp_schedule_runs, t.framework)
                                           + megatron_p2p_reasons(t, spec.pp_schedule, pp, v.vpp)
                                           + dualpipev_ep_ac_reasons(t, spec.pp_schedule, pp, mesh.degree("ep"))),
                   notes=no_pipeline + v.notes + runtime_warnings(t, spec.pp_schedule, mesh, m)
                   + p2p_note(t, spec.pp_schedule, pp))


def _plan(config: Config, spec, world: int, mesh, v, placement, flags: tuple, constraints, reports: bool) -> Plan:
    """The plan of a mesh that passed every rule, without memory timelines: local shapes (each
    registered axis divides the dims its descriptor names), the constraints annotated per axis
    (``reports``), the notes (pp_schedule_runs at pp 1; MoE: the capacity every ep rank uses, with
    its arithmetic), the state bytes per stage and the collective tables."""
    m, t, c = config.model, config.training, config.cluster
    shapes = local_shapes(m, t, mesh)  # each registered axis divides the dims its descriptor names
    tokens = shapes.tokens
    span = ep_span(mesh, placement, flex=t.moe_dispatcher == "deepep")
    annotated = cons.annotate_axes(constraints, m, t, c, mesh, v.stages, v.micro_batches, span,
                                   deepep=deepep_ep_copies(config, mesh, span[0], tokens),
                                   schedule=spec.pp_schedule) if reports else constraints
    notes = v.notes
    if t.pp_schedule_runs > 1 and mesh.degree("pp") == 1:
        notes += (f"training.pp_schedule_runs {t.pp_schedule_runs} applies with pp > 1; with pp 1 each micro-batch "
                  "is its own forward and backward either way",)
    notes += moe_notes(m, t, mesh, tokens, span[0])  # MoE: the capacity every ep rank uses, with its arithmetic
    state = tuple(state_bytes(m, mesh, t, v.stages))
    notes += host_memory_note(state, mesh, t, c.node, v.micro_batches)  # ZeRO-Offload's host share, where it fits
    return Plan(config=config, spec=spec, world=world, reasons=(), notes=notes, derivation=derivation_words(mesh.derivation, t, config.origin),
                mesh=mesh, stages=v.stages, vpp=v.vpp, micro_batches=v.micro_batches, placement=placement,
                flags=flags, gemms=shapes.gemms, attention=shapes.attention,
                state=state, constraints=annotated,
                collectives=_collectives(config, spec, mesh, placement, v.stages, v.micro_batches), timelines=())


def with_memory(plan: Plan) -> Plan:
    """``plan`` (built with ``memory=False``) with its memory timelines and their reasons: what
    :func:`build_plan` adds by default, for callers that plan the memory only of the plans they keep
    (the bubble hint's re-plans: :meth:`meshplan.schedule.verdict.Rebuilt.stepped`)."""
    timelines = memory_timelines(plan)  # reads the plan's mesh, stages, state and tables
    return replace(plan, reasons=memory_reasons(timelines) + _host_reasons(plan), timelines=timelines)


def _host_reasons(plan: Plan) -> tuple[str, ...]:
    """ZeRO-Offload's host memory over the node's (:func:`meshplan.memory.offload_host.host_memory_reasons`)."""
    c = plan.config
    return host_memory_reasons(plan.state, plan.mesh, c.training, c.cluster.node, plan.micro_batches)


def with_memory_if_fits(plan: Plan) -> Plan | None:
    """:func:`with_memory` of ``plan`` where every stage fits usable memory, else None, found at
    the first stage over it (the stages after it not planned): for callers that need only whether
    a re-plan fits and, where it does, its timelines (:func:`meshplan.report.axis_need.smaller_fit`)."""
    timelines = []
    for tl in stage_timelines(plan):
        if not tl.fits:
            return None
        timelines.append(tl)
    return None if _host_reasons(plan) else replace(plan, reasons=(), timelines=tuple(timelines))


def memory_reasons(timelines: tuple[Timeline, ...]) -> tuple[str, ...]:
    """The most loaded stage's reason when its peak exceeds usable memory, and how many
    stages do."""
    over = [tl for tl in timelines if not tl.fits]
    if not over:
        return ()
    top = most_loaded(over).reason()  # a str: every timeline in ``over`` does not fit
    reasons = [top] if top is not None else []
    if len(over) > 1:
        reasons.append(f"{len(over)} of {len(timelines)} stages exceed usable memory: stages "
                       + ", ".join(str(tl.stage) for tl in over[:16]) + (" ..." if len(over) > 16 else ""))
    return tuple(reasons)


def _collectives(config: Config, spec: MeshSpec, mesh: Mesh, placement: Placement, stages: StageLayers,
                 micro: int) -> dict[str, list[CollectiveRow]]:
    """Tables of the stages :func:`table_stage` names: the first, one middle stage (pp > 2)
    and the last (middle stages hold no embedding or head and talk to two neighbours)."""
    pp, vpp = len(stages), len(stages[0])
    out: dict[str, list[CollectiveRow]] = {}
    paths: dict = {}  # each axis's path, found once for all the stages' tables (same mesh and placement)
    for k in sorted({table_stage(s, pp) for s in range(pp)}):
        layers = [i for chunk in stages[k] for i in chunk]
        out[table_key(k)] = collective_table(config.model, config.training, mesh, config.cluster, placement,
                                             layers, micro, first_stage=k == 0, last_stage=k == last_stage(stages),
                                             loss_parallel=spec.loss_parallel, stage=k, vpp=vpp,
                                             schedule=spec.pp_schedule, chunks=stages[k],
                                             grad_bucket_elements=config.memory.grad_bucket_elements,
                                             deepspeed_prefetch=config.memory.deepspeed_prefetch_bytes(config.training),
                                             deepspeed_reuse=config.memory.deepspeed_max_reuse_elements,
                                             paths=paths, kv_expanded=config.memory.kv_expanded)
    return out


def with_rank_to_gpu(plan: Plan, rank_to_gpu) -> Plan:
    """``plan`` with the rank -> GPU permutation ``rank_to_gpu`` (element r = global GPU of
    rank r): new config ``mesh.rank_to_gpu``, placement, locality flags and collective tables
    (their paths and link classes follow the placement). Degrees, groups, shapes, state and
    the memory timelines do not depend on where ranks sit and are kept; equal to
    ``build_plan`` of the changed config (tests check the step time)."""
    r2g = [int(g) for g in rank_to_gpu]
    spec = plan.spec.model_copy(update={"rank_to_gpu": r2g})
    config = replace(plan.config, mesh=spec)
    placement = place(config.cluster, plan.world, r2g)
    colls = _collectives(config, spec, plan.mesh, placement, plan.stages, plan.micro_batches)
    return replace(plan, config=config, spec=spec, placement=placement,
                   flags=tuple(placement_flags(plan.mesh, placement, training=config.training)), collectives=colls)


def with_example_rank(plan: Plan | Infeasible, rank: int) -> Plan | Infeasible:
    """``plan`` whose placement flags name the offending group holding ``rank`` where that
    group offends (``placement_flags(..., example_rank=rank)``; the CLI's ``plan --rank``), so
    a fault line agrees with the group table printed for the same rank (handed case C3: rank 9's
    dp_shard group, not dp_shard(0)). Unchanged without flags (``reports=False``, no mesh)."""
    if not plan.flags or plan.mesh is None or plan.placement is None:
        return plan
    return replace(plan, flags=tuple(placement_flags(plan.mesh, plan.placement, example_rank=rank,
                                                     training=plan.config.training)))
