"""Which meshes a restart on fewer nodes plans, and how it ranks them (:mod:`meshplan.restart`):
the pipeline degrees tried (:class:`PipelineRule`), the bound on the meshes planned
(:data:`PLANNED`), the evaluator (a plan of each mesh) and the ranking.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from meshplan.errors import ConfigError
from meshplan.mesh.layers import ends_short_split, restart_split
from meshplan.plan import Infeasible, build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time

if TYPE_CHECKING:
    from meshplan.restart import Proposal

#: Meshes keeping the global batch tried at most (:func:`bounded`: those of the highest ideal
#: throughput), and of those planned feasible at most (:func:`rank`, in that order; memory refusals do
#: not count). DeepSeek-V3's restart on 2040 GPUs finds 63 such meshes over 61 pipeline degrees
#: (tests/test_reliability.py); a plan of Llama 3 405B on 16k GPUs takes ~0.3 s. The examples'
#: proposal and runner-up (DeepSeek-V3, Llama 3 405B, Mixtral, the seed) are the same with 8, 12
#: or 16 planned.
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

    def split_for(self, pp: int) -> Union[None, tuple[int, ...], str]:
        """Layers per stage at ``pp`` (None: even), or why the layers do not allow it."""
        if pp == self.pp:
            return self.split
        got = restart_split(self.layers, pp, self.vpp, self.short)
        return tuple(got) if isinstance(got, list) else got


def pipeline_rule(plan) -> PipelineRule:
    """The :class:`PipelineRule` of a plan (its model's layers, pp, vpp and pp_layer_split).

    >>> from types import SimpleNamespace as N
    >>> split = [3] + [4] * 14 + [2]  # DeepSeek-V3's, the ends-short rule at pp 16
    >>> plan = N(config=N(model=N(layers=61), mesh=N(pp_layer_split=split)), pp=16, vpp=1)
    >>> r = pipeline_rule(plan); r.short, r.split_for(8), r.split_for(16) == tuple(split)
    (True, (7, 8, 8, 8, 8, 8, 8, 6), True)
    """
    layers, split = plan.config.model.layers, plan.config.mesh.pp_layer_split
    short = split is not None and list(split) == ends_short_split(layers, plan.pp, plan.vpp)
    return PipelineRule(layers, plan.pp, plan.vpp, tuple(split) if split is not None else None, short)


def pipelines(mesh, left: int, pipeline: Optional[PipelineRule]) -> list[tuple[int, Optional[tuple[int, ...]]]]:
    """(pp, layers per stage) of the pipeline degrees tried: the mesh's own without ``pipeline``;
    with it, the configured pp first, then every pp from 1 up whose replica ``tp x pp x cp``
    fits the ``left`` GPUs and whose layers allow it (:meth:`PipelineRule.split_for`)."""
    pp0 = mesh.degree("pp")
    if pipeline is None:
        return [(pp0, None)]
    per = mesh.degree("tp") * mesh.degree("cp")
    out: list[tuple[int, Optional[tuple[int, ...]]]] = []
    for pp in [pp0] + [p for p in range(1, left // per + 1) if p != pp0]:
        split = pipeline.split_for(pp)
        if not isinstance(split, str) and pp * per <= left:
            out.append((pp, split))
    return out


def bounded(keepers: list[Proposal]) -> list[Proposal]:
    """At most :data:`TRIED` meshes, those of the highest :attr:`Proposal.ideal` throughput (GPUs
    less the 1F1B bubble), highest first (the configured pp's first at a tie)."""
    return sorted(keepers, key=lambda p: -p.ideal)[:TRIED]


def changer_refusal(changer: Proposal, as_configured: str, ranked: list[Proposal], unplanned: list) -> tuple[str, int]:
    """Why the largest mesh does not keep the contract (``as_configured``), and whether it runs
    with the changed one (the alternative) or not (its refusal, taken from ``unplanned``: the
    changer is evaluated last)."""
    why = f"{changer.mesh_text()} ({changer.gpus} GPUs): {as_configured}"
    if any(not p.keeps_global_batch for p in ranked):
        return why + " (the alternative below changes the global batch)", changer.gpus
    return why + f"; with {changer.contract}: {unplanned.pop()[0].split(': ', 1)[1]}", changer.gpus


def rank(keepers: list[Proposal], changer: Optional[Proposal], evaluate: Optional[Evaluator]):
    """(proposals ranked: keeping the global batch first, then throughput, else GPUs; the
    meshes the evaluator refused, as (text, GPUs)). ``keepers`` are planned in their order
    until :data:`PLANNED` of them run; the ``changer`` is planned last."""
    out: list[Proposal] = []
    unplanned: list[tuple[str, int]] = []
    for p in keepers + ([changer] if changer else []):
        if evaluate and p is not changer and len(out) >= PLANNED:
            continue
        got = evaluate(p) if evaluate else p
        if isinstance(got, str):
            unplanned.append((f"{p.mesh_text()} ({p.gpus} GPUs): {got}", p.gpus))
        else:
            out.append(got)
    out.sort(key=lambda p: (not p.keeps_global_batch, -(p.tokens_per_s if p.tokens_per_s is not None else p.gpus)))
    return out, unplanned


def plan_evaluator(plan, nodes_left: int) -> Evaluator:
    """Plans a proposal on ``nodes_left`` nodes: ``plan``'s config with the proposal's mesh
    (``mesh.world`` = its GPUs, node-major; at another pp its ``pp_layer_split``, the schedule
    and virtual stages kept), micro_batch and global_batch; its step and
    throughput (:func:`~meshplan.schedule.steptime.step_time`, default overlap, as the search
    ranks) and peak, or the plan's reasons (memory) when it cannot run."""
    cfg = plan.config

    def evaluate(p: Proposal) -> Union[Proposal, str]:
        names = list(p.names) + [a for a, d in (("ep", p.ep), ("etp", p.etp)) if d > 1]
        update: dict[str, Any] = {"names": names, "shape": list(p.shape) + [d for d in (p.ep, p.etp) if d > 1],
                                  "order": None, "degrees": None, "world": p.gpus, "rank_to_gpu": None}
        if p.pp != plan.pp:  # another pipeline degree: its layers per stage (PipelineRule.split_for)
            update["pp_layer_split"] = list(p.pp_layer_split) if p.pp_layer_split is not None else None
        mesh = cfg.mesh.model_copy(update=update)
        training = cfg.training.model_copy(update={"global_batch": p.global_batch, "micro_batch": p.micro_batch})
        try:
            new = build_plan(replace(cfg, mesh=mesh, training=training,
                                     cluster=cfg.cluster.model_copy(update={"nodes": nodes_left})), reports=False)
        except ConfigError as e:
            return str(e)
        if isinstance(new, Infeasible) or not new.feasible:
            return "; ".join(new.reasons)
        st = step_time(new, Overlap())
        return replace(p, step_s=st.step_s, tokens_per_s=st.tokens_per_s, peak_bytes=new.timeline.peak.total_bytes)

    return evaluate
