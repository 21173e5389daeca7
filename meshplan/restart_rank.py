"""Which meshes a restart on fewer nodes plans, and how it ranks them (:mod:`meshplan.restart`):
the bound on the meshes planned (:data:`PLANNED`), the evaluator (a plan of each mesh, and its
screen of the persistent state) and the ranking. The pipeline, tp and cp degrees tried are
:mod:`meshplan.restart_degrees`'.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from meshplan.errors import ConfigError
from meshplan.memory.constraints import usable_bytes
from meshplan.memory.state import most_loaded, state_bytes
from meshplan.mesh.layers import stage_layers
from meshplan.mesh.resolve import resolved_mesh
from meshplan.pipeline.registry import get as get_schedule
from meshplan.plan import Infeasible, build_plan
from meshplan.restart_text import kind_refusal
from meshplan.spec.accuracy import REMESH_MARGIN, RESTART_MARGIN
from meshplan.spec.mesh import MeshSpec
from meshplan.schedule.rank_timeline import Overlap
from meshplan.schedule.steptime import step_time

if TYPE_CHECKING:
    from meshplan.restart_meshes import Proposal

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
    """Whether ``p`` keeps the job's kind: the model-parallel degrees of ``mesh`` (pp, tp and cp; ep
    and etp never change), only the data axes shrunk: the least-disruptive restart, as torchtitan and
    Megatron-LM jobs restart (an FSDP job ``dp_shard 32 x cp 2 x tp 2`` as ``dp_shard 30 x cp 2 x tp 2``,
    not as ``pp 28 x cp 2 x tp 2``, nor as ``dp_shard 15 x cp 2 x tp 4``)."""
    return p.pp == mesh.degree("pp") and p.tp_cp == (mesh.degree("tp"), mesh.degree("cp"))


def kind_pick(ranked: list[Proposal], mesh) -> Optional[Proposal]:
    """The plan of the job's kind (:func:`same_kind`) that :func:`kind_first` puts first: the one
    keeping the global batch unless one changing it plans more than
    :data:`~meshplan.spec.accuracy.RESTART_MARGIN` (5%) more tokens/s; None without a planned one."""
    kind = [p for p in ranked if same_kind(p, mesh) and p.tokens_per_s is not None]
    if not kind:
        return None
    fastest = max(kind, key=lambda p: p.tokens_per_s or 0.0)
    kept = [p for p in kind if p.keeps_global_batch and (p.tokens_per_s or 0.0) * (1 + RESTART_MARGIN)
            >= (fastest.tokens_per_s or 0.0)]
    return max(kept, key=lambda p: p.tokens_per_s or 0.0) if kept else fastest


def remeshes(ranked: list[Proposal], mesh) -> list[Proposal]:
    """The plans of ``ranked`` (in its order) that change pp, tp or cp and plan more than
    :data:`~meshplan.spec.accuracy.REMESH_MARGIN` more tokens/s than the kind's (:func:`kind_pick`),
    keeping the global batch where the kind's does; empty without a plan of the kind."""
    pick = kind_pick(ranked, mesh)
    if pick is None:
        return []
    bar = (pick.tokens_per_s or 0.0) * (1 + REMESH_MARGIN)
    return [p for p in ranked if not same_kind(p, mesh) and (p.tokens_per_s or 0.0) > bar
            and (p.keeps_global_batch or not pick.keeps_global_batch)]


def kind_first(ranked: list[Proposal], mesh) -> list[Proposal]:
    """``ranked`` (:func:`rank`'s order) with the least-disruptive plan first: the job's kind's
    (:func:`kind_pick`), unless a mesh changing pp, tp or cp plans more than
    :data:`~meshplan.spec.accuracy.REMESH_MARGIN` (29.4%) more tokens/s; then the first such mesh in
    ``ranked``'s order (the global batch kept first, then tokens/s). Unchanged without tokens/s (no
    evaluator) or a plan of the kind.

    >>> from types import SimpleNamespace as N
    >>> m = N(degree=lambda a: {"tp": 8}.get(a, 1), layout=N(names=("dp_shard", "tp"), shape=(16, 8)))
    >>> P = lambda shape, tps, gb=True: N(names=("pp", "dp_shard", "tp"), shape=shape, pp=shape[0], tp_cp=(8, 1),
    ...                                   tokens_per_s=tps, keeps_global_batch=gb)
    >>> ranked = [P((7, 2, 8), 125.0), P((1, 8, 8), 60.0), P((1, 14, 8), 100.0, False)]
    >>> [p.shape for p in kind_first(ranked, m)]  # 125 / 100 - 1 = 25% <= 29.4%: the kind's 14 x 8 first
    [(1, 14, 8), (7, 2, 8), (1, 8, 8)]
    >>> [p.shape for p in kind_first([P((7, 2, 8), 130.0), P((1, 14, 8), 100.0, False)], m)]  # 30% > 29.4%
    [(7, 2, 8), (1, 14, 8)]
    """
    top = kind_pick(ranked, mesh)
    if top is None:
        return ranked
    first = (remeshes(ranked, mesh) or [top])[0]
    return [first] + [p for p in ranked if p is not first]


def kind_passed(ranked: list[Proposal], mesh) -> Optional[tuple[Proposal, Proposal]]:
    """(the job's kind's plan, the proposal) where :func:`kind_first` passed over the kind for a
    mesh over :data:`~meshplan.spec.accuracy.REMESH_MARGIN` faster (``ranked``: its order, so its
    first, the proposal); None otherwise."""
    pick = kind_pick(ranked, mesh)
    if pick is None or same_kind(ranked[0], mesh):
        return None
    return pick, ranked[0]


def kind_kept(ranked: list[Proposal], mesh) -> Optional[tuple[Proposal, Optional[Proposal]]]:
    """(the proposal, the fastest plan changing pp, tp or cp where it plans more tokens/s, else
    None) where :func:`kind_first` kept the job's kind first; None otherwise."""
    if kind_pick(ranked, mesh) is None or not same_kind(ranked[0], mesh):
        return None
    others = [p for p in ranked if not same_kind(p, mesh) and p.tokens_per_s is not None]
    fastest = max(others, key=lambda p: p.tokens_per_s or 0.0, default=None)
    return ranked[0], fastest if fastest and (fastest.tokens_per_s or 0.0) > (ranked[0].tokens_per_s or 0.0) else None


def kind_ranked(ranked: list[Proposal], kind: list[Proposal], evaluate: Optional[Evaluator],
                mesh) -> tuple[list[Proposal], list[tuple[str, int]]]:
    """(``ranked`` with the job's kind's meshes (``kind``: :func:`meshplan.restart_meshes.candidates`)
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
