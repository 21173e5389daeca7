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

Malformed input raises :class:`~meshplan.errors.ConfigError` before any of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.comm import deepspeed_zero12
from meshplan.comm.collectives import collective_table
from meshplan.comm.row import CollectiveRow
from meshplan.compute.shapes import Attention, Gemm, local_shapes
from meshplan.compute.routing import RoutingOptions, routing
from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.memory import constraints as cons
from meshplan.memory.state import StateBytes, state_bytes
from meshplan.memory.timeline import Timeline, memory_timelines, most_loaded
from meshplan.mesh import resolve
from meshplan.mesh.layers import last_stage
from meshplan.mesh.layout import check_partition
from meshplan.mesh.resolve import Mesh, resolve_mesh
from meshplan.spec.axes.dp import micro_batches
from meshplan.spec.axes.ep import megatron_sp_reason
from meshplan.mesh.validity import check
from meshplan.pipeline.registry import check_chunks, check_framework
from meshplan.pipeline.registry import get as get_schedule
from meshplan.pipeline.registry import reasons as schedule_reasons
from meshplan.placement.assign import Flag, Placement, place, placement_flags
from meshplan.spec.mesh import MeshSpec
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
        """True when every stage's memory timeline peak fits usable HBM."""
        return not self.reasons

    @property
    def timeline(self) -> Timeline:
        """The memory timeline of the most loaded stage."""
        return most_loaded(self.timelines)

    @property
    def pp(self) -> int:
        return len(self.stages)

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


def run_reasons(schedule, pp: int, m: int, v: int, runs: int, framework: str = "torch") -> tuple[str, ...]:
    """The schedule's infeasibility reasons (:func:`meshplan.pipeline.registry.reasons`, under
    ``framework``) for ``m`` micro-batches run as ``runs`` schedules of ``m / runs`` each
    (``training.pp_schedule_runs``, pp > 1 only), or why ``runs`` does not divide ``m``.

    >>> print(run_reasons("1f1b", 4, 6, 1, 4)[0])
    training.pp_schedule_runs 4 does not divide the step's 6 micro-batches (global_batch / (micro_batch x dp)); use a divisor of 6
    >>> print(run_reasons("1f1b", 4, 8, 1, 4)[0])  # 4 runs of 2: fewer than pp
    each of the 4 schedule runs (training.pp_schedule_runs): 1F1B needs micro-batches (2) >= pp (4) (torch Schedule1F1B)
    >>> run_reasons("interleaved_1f1b", 4, 8, 2, 2), run_reasons("interleaved_1f1b", 4, 6, 2, 1, "megatron")
    ((), ('interleaved 1F1B needs micro-batches (6) divisible by pp (4) (Megatron-LM)',))
    """
    if pp == 1 or runs == 1:
        return schedule_reasons(schedule, pp, m, v, framework)
    if m % runs:
        return (f"training.pp_schedule_runs {runs} does not divide the step's {m} micro-batches (global_batch / "
                f"(micro_batch x dp)); use a divisor of {m}",)
    return tuple(f"each of the {runs} schedule runs (training.pp_schedule_runs): {r}"
                 for r in schedule_reasons(schedule, pp, m // runs, v, framework))


#: The warning of sharding zero1 over a data axis under framework torch without DeepSpeed's
#: engine (:attr:`~meshplan.spec.training.TrainingSpec.has_zero1_engine`; the search rejects such
#: candidates, rule ``framework``).
ZERO1_WITHOUT_ENGINE = ("sharding zero1 under framework torch: no torch engine shards the optimizer state alone "
                        "(FSDP2 always shards the parameters, ZeroRedundancyOptimizer runs under DDP; torchtitan "
                        "has neither), so this plan is Megatron-LM's distributed optimizer and meshplan search "
                        "rejects it (rule 'framework'); use sharding zero3 with reshard_after_forward = false "
                        "(ZeRO-2-like), framework = \"megatron\" or zero12_engine = \"deepspeed\" (DeepSpeed's ZeRO-1)")


def runtime_warnings(training, schedule, mesh: Mesh, model=None) -> tuple[str, ...]:
    """What the framework's runtime is known to run differently from the plan of ``mesh``
    under ``schedule`` (the schedule's :meth:`~meshplan.pipeline.base.PipelineSchedule.warnings`,
    FSDP2 over a data axis when ``training.sharding`` is zero3 or hsdp and fsdp x dp_replicate
    > 1), :data:`ZERO1_WITHOUT_ENGINE` for zero1 over a data axis where no engine runs it
    (:attr:`~meshplan.spec.training.TrainingSpec.has_zero1_engine`), and with ``model`` given
    :func:`position_warning`: the one source of the lines plan and step print as notes, compare
    prints per side and export writes in its header (:func:`config_warnings`)."""
    data = mesh.degree("fsdp") * mesh.degree("dp_replicate") > 1
    fsdp2 = training.sharding in ("zero3", "hsdp") and data
    zero1 = (ZERO1_WITHOUT_ENGINE,) if training.sharding == "zero1" and data and not training.has_zero1_engine else ()
    positions = position_warning(model, training.seq_len) if model is not None else ()
    return positions + zero1 + get_schedule(schedule).warnings(training.framework, mesh.degree("pp"), fsdp2)


def position_warning(model, seq_len: int) -> tuple[str, ...]:
    """One line when ``seq_len`` (tokens) is more than ``model.max_position`` (the positions the
    model was built for; 0: unknown, no line): with RoPE the plan's costs are the same (no
    table), but the model needs RoPE scaling it does not say it has (Llama 3.1's, Dubey et al.
    2024 section 3.4.2, for 8k -> 128k: ``model.rope_scaling``), or past the context its stated
    scaling was built for; learned positions have no row for the later tokens.

    >>> from meshplan import catalog
    >>> position_warning(catalog.model("llama3-70b"), 8192), len(position_warning(catalog.model("llama3-70b"), 131072))
    ((), 1)
    """
    rows = model.max_position
    if not rows or seq_len <= rows:
        return ()
    if model.position_embedding == "learned":
        return (f"training.seq_len {seq_len} is more than model {model.name}'s max_position {rows}, the rows of "
                f"its learned position table: no row for the later tokens; shorten training.seq_len or raise "
                f"model.max_position (a larger table)",)
    rs = model.rope_scaling
    assumed = "assuming RoPE scaling the model does not state" if rs is None else \
        f"assuming its RoPE scaling (factor {rs.factor:g} over {rs.original_max_position} positions) holds that far"
    return (f"training.seq_len {seq_len} is more than model {model.name}'s max_position {rows}: planned as given "
            f"(RoPE has no table; the cost is the same), {assumed}; set "
            f"model.max_position to the scaled context (e.g. {seq_len}) or shorten training.seq_len",)


def config_warnings(config: Config) -> tuple[str, ...]:
    """:func:`runtime_warnings` of ``config``'s mesh (none when it has no [mesh] or its mesh
    does not resolve: nothing runs then)."""
    mesh = _config_mesh(config)
    if mesh is None or config.mesh is None:  # (the second for mypy: no [mesh] resolves to None)
        return ()
    return runtime_warnings(config.training, config.mesh.pp_schedule, mesh, config.model)


def _config_mesh(config: Config) -> Mesh | None:
    """``config``'s [mesh] resolved on its cluster, None when it has none or it does not resolve."""
    if config.mesh is None:
        return None
    mesh = resolve.resolve_mesh(config.mesh, config.cluster.world, config.cluster.node.gpus)
    return None if isinstance(mesh, resolve.Infeasible) else mesh


#: The ``training.framework`` whose runtime runs a file exported to each foreign format with a pipeline.
EXPORT_FRAMEWORK = {"megatron": "megatron", "torchtitan": "torch"}


def export_refusals(config: Config, to: str) -> tuple[str, ...]:
    """What the runtime of export target ``to`` (:data:`EXPORT_FRAMEWORK`) refuses in
    ``config`` although ``config``'s own framework runs it, each reason ending with what is
    refused (the export's one-line error as is): the schedule's micro-batch rules under that
    framework (:func:`run_reasons`, e.g. torch runs interleaved 1F1B at pp 4 with 6
    micro-batches, Megatron-LM needs pp to divide them: "... refuses this pipeline schedule"),
    or Megatron-LM's MoE with tp > 1 without sequence parallelism ("... refuses this MoE mesh
    without sequence parallelism"); empty when they agree, pp is 1, or the mesh does not resolve.

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 6, "seq_len": 4096, "micro_batch": 1},
    ...     "mesh": {"names": ["pp", "tp"], "shape": [4, 2], "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}})
    >>> export_refusals(cfg, "megatron"), export_refusals(cfg, "torchtitan")  # doctest: +NORMALIZE_WHITESPACE
    (("interleaved 1F1B needs micro-batches (6) divisible by pp (4) (Megatron-LM): megatron's runtime refuses
    this pipeline schedule",), ())
    """
    target = EXPORT_FRAMEWORK.get(to)
    if to == "megatron" and config.model.is_moe and config.mesh is not None and not config.mesh.sequence_parallel:
        whole = _config_mesh(config)  # Megatron-LM's MoE with tp > 1 needs SP whatever config's framework
        if whole is not None and whole.degree("tp") > 1:
            return (f"{megatron_sp_reason(whole.degree('tp'), whole.ep)}: {to}'s runtime refuses this MoE mesh "
                    "without sequence parallelism",)
    mesh = None if target in (None, config.training.framework) else _config_mesh(config)
    if mesh is None or config.mesh is None or target is None or mesh.degree("pp") == 1:
        return ()
    t = config.training
    m = micro_batches(t.global_batch, t.micro_batch, mesh.dp)
    if m == 0:
        return ()
    vpp = config.mesh.virtual_stages
    return tuple(f"{r}: {to}'s runtime refuses this pipeline schedule"
                 for r in run_reasons(config.mesh.pp_schedule, mesh.degree("pp"), m, vpp, t.pp_schedule_runs, target))


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



#: Axes DeepSpeed ZeRO-3 of 2021 (``training.zero3_engine = "deepspeed-2021"``) cannot run
#: beside it, and why (its parameters are partitioned over the data-parallel group only; tp is
#: Megatron-DeepSpeed's ``mpu``).
DEEPSPEED_2021_AXES = {
    "pp": "DeepSpeed's pipeline engine refuses ZeRO stages 2 and 3 (runtime/pipe/engine.py)",
    "dp_replicate": "ZeRO-3 of 2021 partitions over the whole data-parallel group (hierarchical "
                    "partitioning came with ZeRO++ in 2023)",
    "cp": "DeepSpeed of 2021 has no context parallelism",
    "ep": "experts with ZeRO-3 are not modelled for DeepSpeed of 2021",
}


def check_deepspeed_zero3(mesh, engine: str) -> None:
    """ConfigError on the first axis DeepSpeed's ZeRO-3 ``engine`` cannot run beside with degree
    > 1: :data:`DEEPSPEED_2021_AXES` for ``deepspeed-2021``; pp and cp for ``deepspeed`` (its
    pipeline engine refuses ZeRO-3; meshplan's cp is all-gather CP, which DeepSpeed does not run)."""
    axes = DEEPSPEED_2021_AXES if engine == "deepspeed-2021" else {
        "pp": DEEPSPEED_2021_AXES["pp"], "cp": "DeepSpeed has no all-gather context parallelism (its sequence "
                                               "parallelism is Ulysses' all-to-all)"}
    for axis, why in axes.items():
        if mesh.degree(axis) > 1:
            raise ConfigError("training.zero3_engine", f"{engine!r} with {axis} {mesh.degree(axis)}: {why}; "
                              f"use {axis} 1 or zero3_engine = \"fsdp2\"")


#: Why ``recompute = "op"`` has no runtime where :attr:`~meshplan.spec.training.TrainingSpec.has_op_recompute`
#: is false, and the fix: the same rule ``[search] recompute`` (:mod:`meshplan.config`) and
#: ``export --to megatron`` (:mod:`meshplan.interop.megatron`) apply.
_NO_OP_RECOMPUTE = {
    "framework": "'op' is torchtitan's op-level selective AC, which framework \"megatron\" does not have (Megatron-LM "
                 "has no flag for it); use 'selective' (--recompute-activations), 'full' or 'none', or framework "
                 "\"torch\"",
    "zero3_engine": "'op' is torchtitan's op-level selective AC, which zero3_engine \"{engine}\" does not have "
                    "(DeepSpeed's ZeRO-3); use 'selective', 'full' or 'none', or zero3_engine \"fsdp2\"",
    "zero0_engine": "'op' is torchtitan's op-level selective AC, which zero0_engine \"deepspeed\" (DeepSpeed without "
                    "ZeRO) does not have; use 'selective', 'full' or 'none', or remove zero0_engine (DDP)",
    "zero12_engine": "'op' is torchtitan's op-level selective AC, which zero12_engine \"deepspeed\" (DeepSpeed's "
                     "ZeRO-1/2) does not have; use 'selective', 'full' or 'none', or sharding \"zero3\" without "
                     "zero12_engine (FSDP2)",
}
#: Why ``recompute = "layer"`` has no Megatron-LM run: Megatron-Core's full recompute
#: (``--recompute-granularity full``) checkpoints, with ``--recompute-method uniform``, every layer
#: in chunks of ``--recompute-num-layers``, with ``block`` the first ``--recompute-num-layers`` layers
#: of each stage (``TransformerBlock._checkpointed_forward``,
#: megatron/core/transformer/transformer_block.py, NVIDIA/Megatron-LM at 0034bda); neither is
#: torchtitan's every ``ac_freq``-th layer, which ``export --to megatron`` refuses too.
_NO_LAYER_RECOMPUTE = ("'layer' is torchtitan's per-layer selective AC (every ac_freq-th layer in full), which "
                       "framework \"megatron\" does not have (--recompute-method uniform recomputes every layer, "
                       "block the first n layers of each stage); use 'full' (every layer: 'layer' with ac_freq 1), "
                       "'selective' or 'none', or framework \"torch\"")


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
    mesh = resolve_mesh(spec, world, gpus_per_node=c.node.gpus)
    if t.grad_accumulation != "sync" and not isinstance(mesh, resolve.Infeasible) and mesh.degree("pp") > 1:
        raise ConfigError("training.grad_accumulation", f"{t.grad_accumulation!r} is for pp 1; with pp "
                          f"{mesh.degree('pp')} torch.distributed.pipelining turns gradient sync and "
                          "reshard-after-backward off itself: remove the key")
    if not isinstance(mesh, resolve.Infeasible):  # an explicit [memory] fsdp_reduce must state the table's rule
        config.memory.fsdp_reduce_for(t, mesh.degree("pp"))
    if t.zero3_engine != "fsdp2" and not isinstance(mesh, resolve.Infeasible):
        check_deepspeed_zero3(mesh, t.zero3_engine)
        if not t.reshard_after_forward:  # a search candidate's (TrainingSpec refuses it in a config)
            raise ConfigError("training.reshard_after_forward", f"false is FSDP2's; zero3_engine "
                              f"{t.zero3_engine!r} gathers every parameter again in backward: remove it")
    if not isinstance(mesh, resolve.Infeasible):
        deepspeed_zero12.check_mesh(t, mesh.degree, spec.pp_schedule)
    if t.recompute == "layer" and t.framework == "megatron":
        raise ConfigError("training.recompute", _NO_LAYER_RECOMPUTE)
    if t.recompute == "op" and not t.has_op_recompute:
        raise ConfigError("training.recompute", _NO_OP_RECOMPUTE[t.op_recompute_blocker].format(engine=t.zero3_engine))
    if t.recompute == "op" and not isinstance(mesh, resolve.Infeasible) and max(mesh.degree("cp"), mesh.ep) > 1:
        raise ConfigError("training.recompute", "'op' (torchtitan op-level selective AC) is planned with cp = ep = 1 "
                          "only: which CP/EP collectives its recompute replays is not modelled yet; use 'layer', "
                          "'selective' or 'full'")
    if t.recompute == "op" and not isinstance(mesh, resolve.Infeasible) and mesh.degree("tp") > 1 and \
            not mesh.sequence_parallel:
        raise ConfigError("training.recompute", "'op' (torchtitan op-level selective AC) with tp > 1 is planned with "
                          "sequence parallelism, as torchtitan applies TP: set mesh.sequence_parallel = true")
    if t.recompute == "op" and m.is_mla:
        raise ConfigError("training.recompute", "'op' (torchtitan op-level selective AC) is not modelled for "
                          "multi-head latent attention (which of its mms the policy saves); use 'layer', "
                          "'selective' or 'full'")
    if constraints is None:
        constraints = cons.constraints(m, t, c, world)
    if isinstance(mesh, resolve.Infeasible):
        return Infeasible(config, spec, world, mesh.reasons, constraints)
    v = check(m, t, mesh, spec, get_schedule(spec.pp_schedule).virtual_stage)  # the schedule's chunk map
    check_chunks(spec.pp_schedule, v.vpp)  # a one-chunk schedule with virtual stages: the same error everywhere
    check_framework(spec.pp_schedule, t.framework, mesh.degree("pp"))  # Megatron-LM runs 1F1B and interleaved only
    pp = mesh.degree("pp")  # the pipeline schedule's own rules (meshplan.pipeline), after the mesh's
    v = replace(v, reasons=v.reasons + run_reasons(spec.pp_schedule, pp, v.micro_batches, v.vpp,
                                                   t.pp_schedule_runs, t.framework),
                notes=v.notes + runtime_warnings(t, spec.pp_schedule, mesh, m))
    partition = [f"axis {a}: {problem}" for a in mesh.all_axes() for problem in check_partition(mesh.groups(a), world)]
    placement = place(c, world, spec.rank_to_gpu)
    failed = bool(v.reasons or partition or v.stages is None)
    flags = tuple(placement_flags(mesh, placement)) if failed or reports else ()
    if failed or v.stages is None:  # (the second for mypy: failed covers it)
        return Infeasible(config, spec, world, v.reasons + tuple(partition), constraints, notes=v.notes,
                          derivation=mesh.derivation, mesh=mesh, placement=placement, flags=flags, vpp=v.vpp,
                          micro_batches=v.micro_batches)
    shapes = local_shapes(m, t, mesh)  # each registered axis divides the dims its descriptor names
    tp, tokens = mesh.degree("tp"), shapes.tokens
    annotated = cons.annotate_axes(constraints, m, t, c, mesh, v.stages, v.micro_batches) if reports else constraints
    notes = v.notes
    if t.pp_schedule_runs > 1 and pp == 1:
        notes += (f"training.pp_schedule_runs {t.pp_schedule_runs} applies with pp > 1; with pp 1 each micro-batch "
                  "is its own forward and backward either way",)
    if m.is_moe:  # the capacity (or the dropless rows) every ep rank uses, with its arithmetic
        ro = RoutingOptions.of(t)
        # the tp ranks split their tokens tp/etp ways before routing: a Megatron import's etp = tp
        # (Megatron-LM's default) routes twice the tokens of a TOML's default etp 1 at tp 2
        origin = f"{tokens} local tokens x etp {mesh.etp} / tp {tp}" if tp > 1 else ""
        notes += (routing(ro, max(1, tokens * mesh.etp // tp), m.top_k, m.experts, mesh.ep).describe(
            ro, m.top_k, m.experts, mesh.ep, origin),)
    plan = Plan(config=config, spec=spec, world=world, reasons=(), notes=notes, derivation=mesh.derivation,
                mesh=mesh, stages=v.stages, vpp=v.vpp, micro_batches=v.micro_batches, placement=placement,
                flags=flags, gemms=shapes.gemms, attention=shapes.attention,
                state=tuple(state_bytes(m, mesh, t, v.stages)), constraints=annotated,
                collectives=_collectives(config, spec, mesh, placement, v.stages, v.micro_batches), timelines=())
    if not memory:
        return plan
    timelines = memory_timelines(plan)  # reads the plan's mesh, stages, state and tables
    return replace(plan, reasons=memory_reasons(timelines), timelines=timelines)


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
                                             paths=paths)
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
                   flags=tuple(placement_flags(plan.mesh, placement)), collectives=colls)
