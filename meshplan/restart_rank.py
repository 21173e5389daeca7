"""Which meshes a restart on fewer nodes plans, and how it ranks them (:mod:`meshplan.restart`):
the pipeline degrees tried (:class:`PipelineRule`), the tp and cp degrees tried
(:class:`DegreeRule`), the bound on the meshes planned (:data:`PLANNED`), the evaluator (a plan
of each mesh, and its screen of the persistent state) and the ranking.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from meshplan.comm import deepspeed_zero12
from meshplan.errors import ConfigError
from meshplan.memory.constraints import usable_bytes
from meshplan.memory.state import most_loaded, state_bytes
from meshplan.mesh.layers import ends_short_split, restart_splits, stage_layers
from meshplan.mesh.resolve import resolved_mesh
from meshplan.pipeline.registry import get as get_schedule
from meshplan.plan import Infeasible, build_plan
from meshplan.plan_checks import check_deepspeed_zero3
from meshplan.restart_text import MODEL_ACCURACY, checkpoint_engine, kind_refusal
from meshplan.spec.axes.base import AxisDegrees
from meshplan.spec.axes.cp import CP
from meshplan.spec.axes.tp import TP, max_tp, tp_misfit
from meshplan.spec.mesh import MeshSpec
from meshplan.schedule.rank_timeline import Overlap
from meshplan.schedule.steptime import step_time

if TYPE_CHECKING:
    from meshplan.restart import Proposal

#: Meshes of the configured tp and cp keeping the global batch tried at most (:func:`bounded`: those
#: of the highest ideal throughput), and of those planned feasible at most (:func:`rank`, in that
#: order; memory refusals do not count); each other (tp, cp) adds one mesh, planned. A mesh counts
#: once with all its layer splits (at most 3, each planned). DeepSeek-V3's restart on 2040 GPUs
#: finds 63 such meshes over 31 pipeline degrees at tp 1, cp 1 (161 with their splits), and 7
#: other pairs (tests/test_reliability.py); a plan of Llama 3 405B on 16k GPUs takes ~0.3 s. The
#: proposal and runner-up of DeepSeek-V3, Mixtral and the seed were the same with 8, 12 or 16
#: planned (before the splits were varied).
TRIED, PLANNED = 16, 8

Evaluator = Callable[["Proposal"], Union["Proposal", str]]


@dataclass(frozen=True)
class PipelineRule:
    """What lets a restart change pp (DCP and Megatron-Core dist-checkpointing reshard on load,
    :mod:`meshplan.restart_text`): the model's ``layers``, the configured ``pp`` and its
    ``split`` (kept at that pp), ``vpp`` (kept, with the schedule) and whether the split is
    Llama 3's ends-short rule (``short``, carried to the new pp by
    :func:`~meshplan.mesh.layers.restart_split`)."""

    layers: int
    pp: int
    vpp: int = 1
    split: Optional[tuple[int, ...]] = None
    short: bool = False
    dense: int = 0

    def splits_for(self, pp: int) -> Union[list[Optional[tuple[int, ...]]], str]:
        """The layer splits planned at ``pp`` (None: even), or why the layers allow none
        (:func:`~meshplan.mesh.layers.restart_splits`): ``dense`` (> 0: the configured split holds
        the model's dense layers alone on the first stage) offers them alone there
        (:func:`~meshplan.mesh.layers.dense_first_split`) besides the split over all the layers
        (``short``: Llama 3's ends-short rule, and the balanced split). At the configured pp its
        split first (not an even alternative: the plan reads None there as the configured split)."""
        got = restart_splits(self.layers, pp, self.vpp, self.short, self.dense)
        if isinstance(got, str):
            return got if pp != self.pp else [self.split]
        out = [tuple(s) if s is not None else None for s in got]
        return out if pp != self.pp else [self.split] + [s for s in out if s not in (self.split, None)]


def pipeline_rule(plan) -> PipelineRule:
    """The :class:`PipelineRule` of a plan (its model's layers, pp, vpp and pp_layer_split; the
    model's dense layers where the split puts exactly them on the first stage at vpp 1).

    >>> from types import SimpleNamespace as N
    >>> split = [3] + [4] * 14 + [2]  # DeepSeek-V3's: the 3 dense layers alone on the first stage
    >>> model = N(layers=61, dense_layers=3, is_moe=True)
    >>> plan = N(config=N(model=model, mesh=N(pp_layer_split=split)), pp=16, vpp=1)
    >>> r = pipeline_rule(plan); r.short, r.dense, r.splits_for(8)[0], r.splits_for(16)[0] == tuple(split)
    (True, 3, (3, 8, 9, 9, 9, 8, 8, 7), True)
    """
    model, split = plan.config.model, plan.config.mesh.pp_layer_split
    layers = model.layers
    short = split is not None and list(split) == ends_short_split(layers, plan.pp, plan.vpp)
    dense = model.dense_layers if (model.is_moe and model.dense_layers and split is not None and plan.vpp == 1
                                   and split[0] == model.dense_layers) else 0
    return PipelineRule(layers, plan.pp, plan.vpp, tuple(split) if split is not None else None, short, dense)


@dataclass(frozen=True)
class DegreeRule:
    """The (tp, cp) degrees a restart may run, the configured pair first: DCP and Megatron-Core
    dist-checkpointing reshard tp and cp on load as they do pp (:mod:`meshplan.restart_text`)."""

    pairs: tuple[tuple[int, int], ...]


def engine_rules(plan) -> tuple[Optional[PipelineRule], DegreeRule]:
    """(pipeline rule, degree rule) a restart of ``plan`` may vary, within what its engine runs.
    Under DeepSpeed (:func:`~meshplan.restart_text.checkpoint_engine`) tp and cp are kept: a
    DeepSpeed config runs ZeRO over one data axis (its import's ``[search]`` keeps tp = [1],
    :data:`meshplan.interop.deepspeed.SEARCH`; a TOML's tp under DeepSpeed is the model code's, cp
    is refused by both engines), and pp varies only where the engine runs a pipeline at all
    (:func:`engine_runs_pp`); else :func:`pipeline_rule` and :func:`degree_rule`."""
    if checkpoint_engine(plan.config.training) != "deepspeed":
        return pipeline_rule(plan), degree_rule(plan)
    pairs = ((plan.mesh.degree("tp"), plan.mesh.degree("cp")),)
    return (pipeline_rule(plan) if engine_runs_pp(plan) else None), DegreeRule(pairs)


def engine_runs_pp(plan) -> bool:
    """Whether the engine of ``plan`` runs pp 2 with the rest of its mesh: build_plan's engine
    checks, the per-mesh home of the search's ``engine`` rule (:mod:`meshplan.search.reasons`):
    DeepSpeed's ZeRO-1/2 (:func:`meshplan.comm.deepspeed_zero12.check_mesh`: its pipeline engine
    refuses ZeRO-2, overlap_comm and schedules other than 1F1B) and its ZeRO-3
    (:func:`meshplan.plan_checks.check_deepspeed_zero3`: pp refused)."""
    t = plan.config.training
    at_pp2 = lambda axis: 2 if axis == "pp" else plan.mesh.degree(axis)
    try:
        deepspeed_zero12.check_mesh(t, at_pp2, plan.spec.pp_schedule)
        if t.sharding == "zero3" and t.zero3_engine != "fsdp2":
            check_deepspeed_zero3(SimpleNamespace(degree=at_pp2), t.zero3_engine)
    except ConfigError:
        return False
    return plan.vpp == 1


def degree_rule(plan) -> DegreeRule:
    """Every tp up to the fast domain (:func:`~meshplan.spec.axes.tp.max_tp`: the NVLink domain
    or ``[search] max_tp``) that splits the heads and the dense MLP and fills nodes evenly
    (:func:`~meshplan.spec.axes.tp.tp_misfit`), with cp the configured one, half or twice it (a
    bound: each halves or doubles the tokens of a sequence on a rank); a pair kept where the tp
    and cp rules hold (:data:`~meshplan.spec.axes.tp.TP`'s sequence-parallel rule, the
    sequence split into 2 cp chunks of :data:`~meshplan.spec.axes.cp.CP`)."""
    cfg, mesh = plan.config, plan.mesh
    tp0, cp0, node = mesh.degree("tp"), mesh.degree("cp"), cfg.cluster.node.gpus
    tps = [t for t in range(1, max(max_tp(cfg), tp0) + 1) if t == tp0 or tp_misfit(cfg.model, t, node) is None]
    cps = [cp0] + ([cp0 // 2] if cp0 % 2 == 0 else []) + [2 * cp0]
    if mesh.etp > 1:  # etp is tp's degree for the experts (1 or tp): tp kept
        tps = [tp0]
    bad = [r.bad for r in TP.rules + CP.rules if r.bad is not None]
    pairs = [(t, c) for t in [tp0] + [t for t in tps if t != tp0] for c in cps
             if (t, c) == (tp0, cp0) or not any(bool(b(cfg.model, cfg.training, _degrees(mesh, t, c))) for b in bad)]
    return DegreeRule(tuple(pairs))


def _degrees(mesh, tp: int, cp: int) -> AxisDegrees:
    """The degrees the tp and cp rules read, at ``tp`` and ``cp``."""
    return AxisDegrees(pp=1, dpr=1, dps=1, dp=1, cp=cp, tp=tp, ep=mesh.ep, etp=mesh.etp, mb=1, vpp=1,
                       sp=mesh.sequence_parallel)


def pipelines(mesh, left: int, pipeline: Optional[PipelineRule],
              per: Optional[int] = None) -> list[tuple[int, Optional[tuple[int, ...]]]]:
    """(pp, layers per stage) of the pipeline degrees and splits tried: the mesh's own without
    ``pipeline``; with it, the configured pp first, then every pp from 1 up whose replica ``tp x
    pp x cp`` (``per``: tp x cp, the mesh's by default) fits the ``left`` GPUs, once per split its
    layers allow (:meth:`PipelineRule.splits_for`: at most 3 a pp)."""
    pp0 = mesh.degree("pp")
    if pipeline is None:
        return [(pp0, None)]
    per = per or mesh.degree("tp") * mesh.degree("cp")
    out: list[tuple[int, Optional[tuple[int, ...]]]] = []
    for pp in [pp0] + [p for p in range(1, left // per + 1) if p != pp0]:
        got = pipeline.splits_for(pp)
        if not isinstance(got, str) and pp * per <= left:
            out += [(pp, split) for split in got]
    return out


def axes_at(mesh, inner: dict[str, int]) -> tuple[tuple[str, ...], dict[str, int]]:
    """The dense axes and degrees of ``mesh`` with tp, cp and pp at ``inner``'s degrees: an
    axis the mesh lacks is added where it differs from 1 (pp outermost, cp then tp innermost)."""
    names, deg = mesh.layout.names, dict(zip(mesh.layout.names, mesh.layout.shape))
    for axis in ("pp", "cp", "tp"):
        if inner[axis] != deg.get(axis, 1):
            names = names if axis in names else ("pp",) + names if axis == "pp" else names + (axis,)
            deg = {**deg, axis: inner[axis]}
    if "cp" in names and "tp" in names and names.index("cp") > names.index("tp"):  # cp outside tp
        names = tuple(n for n in names if n != "cp")
        names = names[:names.index("tp")] + ("cp",) + names[names.index("tp"):]
    return names, deg


def splits(names: tuple[str, ...], deg: dict[str, int], d: int) -> list[tuple[int, ...]]:
    """Dense shapes of axes ``names`` (degrees ``deg``, tp/pp/cp as given) with data-parallel degree
    ``d``: dp_replicate x (dp_shard or dp) = d, the split keeping the shard degree (no
    resharding) first, then larger shards."""
    shard_axis = "dp_shard" if "dp_shard" in deg else "dp" if "dp" in deg else None
    if "dp_replicate" not in deg:
        pairs = [(1, d)]
    elif shard_axis is None:
        pairs = [(d, 1)]
    else:
        pairs = sorted(((d // s, s) for s in range(1, d + 1) if d % s == 0),
                       key=lambda p: (p[1] != deg[shard_axis], -p[1]))
    out = []
    for rep, shard in pairs:
        new = {**deg, **({"dp_replicate": rep} if "dp_replicate" in deg else {}),
               **({shard_axis: shard} if shard_axis else {})}
        out.append(tuple(new[n] for n in names))
    return out


def bounded(keepers: list[Proposal], pairs: tuple[tuple[int, int], ...] = (),
            screen: Optional[Callable[[Proposal], str]] = None) -> tuple[list[Proposal], list[tuple[str, int]]]:
    """(meshes tried, those the ``screen`` refused as (text, GPUs)). At most :data:`TRIED`
    meshes of the configured tp and cp (``pairs[0]``; all ``keepers`` without ``pairs``), those
    of the highest :attr:`Proposal.ideal` throughput (GPUs less the 1F1B bubble), highest first
    (the configured pp's first at a tie); then of each other (tp, cp) of ``pairs``, in their
    order, its one mesh of the highest ideal throughput. A mesh counts once whatever its layer
    splits (:func:`variants`: each is tried, at most 3). The ideal counts neither the tp nor the
    cp collectives, and a smaller dp leaves more micro-batches and so a smaller bubble: it would
    put every mesh of the largest tp x cp first; one mesh per other pair lets the plans rank
    them. A split the screen refuses (its persistent state alone exceeds the memory,
    :meth:`PlanEvaluator.screen`) is passed over."""
    own = pairs[0] if pairs else None
    tried: list[Proposal] = []
    refused: list[tuple[str, int]] = []
    seen: set[tuple[int, int]] = set()
    mine = 0
    for group in variants(sorted(keepers, key=lambda p: -p.ideal)):
        p = group[0]
        if (mine >= TRIED if own in (None, p.tp_cp) else p.tp_cp in seen) or (own and p.tp_cp not in pairs):
            continue
        whys = [screen(v) if screen else "" for v in group]
        if all(whys):
            refused.append((f"{p.mesh_text()} ({p.gpus} GPUs): {whys[0]}", p.gpus))
            continue
        tried += [v for v, why in zip(group, whys) if not why]
        mine += own in (None, p.tp_cp)
        seen.add(p.tp_cp)
    first = [p for p in tried if own is None or p.tp_cp == own]
    return first + [p for pair in pairs[1:] for p in tried if p.tp_cp == pair], refused


def variants(meshes: list[Proposal]) -> list[list[Proposal]]:
    """``meshes`` grouped by mesh (axes and degrees), each group its layer splits in order, the
    groups in the order of their first mesh."""
    groups: dict[tuple, list[Proposal]] = {}
    for p in meshes:
        groups.setdefault((p.names, p.shape), []).append(p)
    return list(groups.values())


def rank(keepers: list[Proposal], changer: Optional[Proposal], evaluate: Optional[Evaluator],
         pair: Optional[tuple[int, int]] = None, planned: Optional[dict[tuple, list[Proposal]]] = None):
    """(proposals ranked: keeping the global batch first, then throughput, else GPUs and the
    ideal throughput; the meshes the evaluator refused, as (text, GPUs)). ``keepers`` of the
    configured tp and cp (``pair``; all without it) are planned in their order until
    :data:`PLANNED` meshes run, those of other tp and cp (one each, :func:`bounded`) all; the
    ``changer`` is planned last. Each mesh's layer splits (:func:`variants`) are all planned and
    the fastest kept: one proposal per mesh (without an evaluator, the first split); ``planned``
    (if given) gets each mesh's planned splits, fastest first, where it has more than one."""
    out: list[Proposal] = []
    unplanned: list[tuple[str, int]] = []
    own = 0
    for group in variants(keepers) + ([[changer]] if changer else []):
        p = group[0]
        mine = pair is None or p.tp_cp == pair
        if evaluate and p is not changer and mine and own >= PLANNED:
            continue
        got = [evaluate(v) for v in group] if evaluate else [p]
        ran = [g for g in got if not isinstance(g, str)]
        if not ran:
            unplanned.append((f"{p.mesh_text()} ({p.gpus} GPUs): {got[0]}", p.gpus))
        else:
            ran.sort(key=lambda g: -(g.tokens_per_s or 0.0))
            out.append(ran[0])
            if planned is not None and len(ran) > 1:
                planned[(p.names, p.shape)] = ran
            own += mine and p is not changer
    out.sort(key=lambda p: (not p.keeps_global_batch,
                            -(p.tokens_per_s if p.tokens_per_s is not None else p.gpus), -p.ideal))
    return out, unplanned


def same_kind(p: Proposal, mesh) -> bool:
    """Whether ``p`` keeps the job's kind: the same pp as ``mesh`` and the same axes of degree > 1
    (an FSDP job ``dp_shard 32 x cp 2 x tp 2`` restarted as ``dp_shard 30 x cp 2 x tp 2``, not as
    ``pp 28 x cp 2 x tp 2``)."""
    axes = lambda names, shape: {n for n, x in zip(names, shape) if x > 1}
    return p.pp == mesh.degree("pp") and axes(p.names, p.shape) == axes(mesh.layout.names, mesh.layout.shape)


def kind_pick(ranked: list[Proposal], mesh) -> Optional[Proposal]:
    """The plan of the job's kind (:func:`same_kind`) that :func:`kind_first` puts first: the one
    keeping the global batch unless one changing it plans more than
    :data:`~meshplan.restart_text.MODEL_ACCURACY` more tokens/s; None without a planned one."""
    kind = [p for p in ranked if same_kind(p, mesh) and p.tokens_per_s is not None]
    if not kind:
        return None
    fastest = max(kind, key=lambda p: p.tokens_per_s or 0.0)
    kept = [p for p in kind if p.keeps_global_batch and (p.tokens_per_s or 0.0) * (1 + MODEL_ACCURACY)
            >= (fastest.tokens_per_s or 0.0)]
    return max(kept, key=lambda p: p.tokens_per_s or 0.0) if kept else fastest


def kind_first(ranked: list[Proposal], mesh) -> list[Proposal]:
    """``ranked`` (:func:`rank`'s order) with the plan keeping the job's kind (:func:`kind_pick`)
    first unless another plans more than :data:`~meshplan.restart_text.MODEL_ACCURACY` (5%,
    issue 11's step-time goal) more tokens/s: a faster plan within the model's accuracy is not
    shown to be faster. Unchanged without tokens/s (no evaluator) or a plan of the kind.

    >>> from types import SimpleNamespace as N
    >>> m = N(degree=lambda a: 1, layout=N(names=("dp_shard", "tp"), shape=(16, 8)))
    >>> P = lambda shape, tps, gb=True: N(names=("pp", "dp_shard", "tp"), shape=shape, pp=shape[0],
    ...                                   tokens_per_s=tps, keeps_global_batch=gb)
    >>> ranked = [P((7, 2, 8), 100.0), P((1, 8, 8), 60.0), P((1, 14, 8), 96.0, False)]
    >>> [p.shape for p in kind_first(ranked, m)]  # 100 / 96 - 1 = 4.2% <= 5%: the kind's 14 x 8 first
    [(1, 14, 8), (7, 2, 8), (1, 8, 8)]
    >>> [p.shape for p in kind_first([P((7, 2, 8), 100.0), P((1, 14, 8), 95.0, False)], m)]  # 5.3% > 5%
    [(7, 2, 8), (1, 14, 8)]
    """
    top = kind_pick(ranked, mesh)
    if top is None or any((p.tokens_per_s or 0.0) > (top.tokens_per_s or 0.0) * (1 + MODEL_ACCURACY) for p in ranked):
        return ranked
    return [top] + [p for p in ranked if p is not top]


def kind_passed(ranked: list[Proposal], mesh) -> Optional[tuple[Proposal, Proposal]]:
    """(the job's kind's plan, a plan over MODEL_ACCURACY faster) where :func:`kind_first` passed
    over the kind (``ranked``: its order, so its first is not of the kind only then): the faster
    is the proposal where it is over 5% faster, else the fastest plan; None otherwise."""
    pick = kind_pick(ranked, mesh)
    if pick is None or same_kind(ranked[0], mesh):
        return None
    over = lambda p: (p.tokens_per_s or 0.0) > (pick.tokens_per_s or 0.0) * (1 + MODEL_ACCURACY)
    return pick, ranked[0] if over(ranked[0]) else max(ranked, key=lambda p: p.tokens_per_s or 0.0)


def kind_ranked(ranked: list[Proposal], kind: list[Proposal], evaluate: Optional[Evaluator],
                mesh) -> tuple[list[Proposal], list[tuple[str, int]]]:
    """(``ranked`` with the job's kind's meshes (``kind``: :func:`meshplan.restart._candidates`)
    planned where :data:`PLANNED` left them out, in :func:`rank`'s order, then :func:`kind_first`'s;
    the kind's meshes whose plan failed, as (text, GPUs): :func:`~meshplan.restart_text.kind_refusal`)."""
    if evaluate is None:
        return ranked, []
    seen = {(p.names, p.shape, p.contract) for p in ranked}
    refused = []
    for p in kind:
        got = evaluate(p) if (p.names, p.shape, p.contract) not in seen else p
        if isinstance(got, str):
            refused.append((kind_refusal(p, got), p.gpus))
        elif got is not p:
            ranked = ranked + [got]
    ranked.sort(key=lambda p: (not p.keeps_global_batch, -(p.tokens_per_s or 0.0), -p.ideal))  # rank's order
    return kind_first(ranked, mesh), refused


class PlanEvaluator:
    """Plans a proposal on ``nodes_left`` nodes (``__call__``): ``plan``'s config with the
    proposal's mesh (``mesh.world`` = its GPUs, node-major; at another pp its ``pp_layer_split``,
    the schedule and virtual stages kept), micro_batch and global_batch; its step and throughput
    (:func:`~meshplan.schedule.steptime.step_time`, default overlap, as the search ranks) and
    peak, or the plan's reasons (memory) when it cannot run. :meth:`screen` refuses, before any
    plan, a mesh whose persistent state alone exceeds usable memory."""

    def __init__(self, plan, nodes_left: int):
        self.plan, self.nodes_left = plan, nodes_left

    def mesh_spec(self, p: Proposal):
        """The config's ``[mesh]`` with the proposal's axes, degrees, world and layer split."""
        names = list(p.names) + [a for a, d in (("ep", p.ep), ("etp", p.etp)) if d > 1]
        update: dict[str, Any] = {"names": names, "shape": list(p.shape) + [d for d in (p.ep, p.etp) if d > 1],
                                  "order": None, "degrees": None, "world": p.gpus, "rank_to_gpu": None}
        if p.pp != self.plan.pp or p.pp_layer_split is not None:  # its layers per stage (PipelineRule.splits_for)
            update["pp_layer_split"] = list(p.pp_layer_split) if p.pp_layer_split is not None else None
        return self.plan.config.mesh.model_copy(update=update)

    def screen(self, p: Proposal) -> str:
        """Why ``p`` cannot fit before it is planned: the most loaded stage's persistent state
        (:func:`~meshplan.memory.state.state_bytes`: parameters, gradients, master copy and optimizer
        state, which the memory timeline's peak holds) above usable memory
        (:func:`~meshplan.memory.constraints.usable_bytes`); "" when it may fit."""
        cfg, spec = self.plan.config, self.mesh_spec(p)
        mesh = resolved_mesh(MeshSpec(names=spec.names, shape=spec.shape,
                                      sequence_parallel=spec.sequence_parallel), p.gpus)
        split = list(spec.pp_layer_split) if spec.pp_layer_split is not None else None
        stages = stage_layers(cfg.model.layers, p.pp, self.plan.vpp, split, get_schedule(spec.pp_schedule).virtual_stage)
        if isinstance(stages, str):  # the plan says why
            return ""
        state = most_loaded(state_bytes(cfg.model, mesh, cfg.training, stages)).total_bytes
        usable = usable_bytes(cfg.cluster, cfg.training)
        return (f"persistent state {state / 2 ** 30:.1f} GiB (parameters, gradients and optimizer state) > usable "
                f"{usable / 2 ** 30:.1f} GiB" if state > usable else "")

    def __call__(self, p: Proposal) -> Union[Proposal, str]:
        cfg, mesh = self.plan.config, self.mesh_spec(p)
        training = cfg.training.model_copy(update={"global_batch": p.global_batch, "micro_batch": p.micro_batch})
        try:
            new = build_plan(replace(cfg, mesh=mesh, training=training,
                                     cluster=cfg.cluster.model_copy(update={"nodes": self.nodes_left})), reports=False)
        except ConfigError as e:
            return str(e)
        if isinstance(new, Infeasible) or not new.feasible:
            return "; ".join(new.reasons)
        st = step_time(new, Overlap())
        return replace(p, step_s=st.step_s, tokens_per_s=st.tokens_per_s, peak_bytes=new.timeline.peak.total_bytes)


def plan_evaluator(plan, nodes_left: int) -> PlanEvaluator:
    """The :class:`PlanEvaluator` of ``plan`` on ``nodes_left`` nodes."""
    return PlanEvaluator(plan, nodes_left)
