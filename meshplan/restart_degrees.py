"""The pipeline, tp and cp degrees a restart on fewer nodes tries (:mod:`meshplan.restart`): the
pipeline degrees and layer splits (:class:`PipelineRule`, :func:`pipelines`), the tp and cp pairs
(:class:`DegreeRule`), what the checkpoint's engine lets vary (:func:`engine_rules`), and the
dense axes and data-parallel splits of a mesh at those degrees (:func:`axes_at`, :func:`splits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Union

from meshplan.comm import deepspeed_zero12
from meshplan.errors import ConfigError
from meshplan.mesh.layers import ends_short_split, first_last_sets, restart_splits, split_balance
from meshplan.plan_checks import check_deepspeed_zero3
from meshplan.restart_text import checkpoint_engine
from meshplan.spec.accuracy import RESTART_MARGIN
from meshplan.spec.axes.base import AxisDegrees
from meshplan.spec.axes.cp import CP
from meshplan.spec.axes.tp import TP, max_tp, tp_misfit


#: The least :func:`~meshplan.mesh.layers.split_balance` (mean stage over the heaviest) of a layer
#: split a restart proposes at a pp the job did not run: 1 - the restart margin
#: (:data:`~meshplan.restart_text.RESTART_MARGIN`, 5%), so a split idles its stages no more than an
#: error the model cannot tell from an even one. The published uneven splits meet it: Llama 3 405B's
#: [7, 8 x 14, 7] at pp 16 (126 / 128 = 0.98, 128 / 128 with the ends counted), DeepSeek-V3's
#: [3, 4 x 14, 2] (61 / 64 = 0.95); 80 layers at pp 31 (2 or 3 a stage, 82 / 93 = 0.88) or pp 15 (5
#: or 6, 82 / 90 = 0.91) do not: a newcomer found both proposed (trial 16).
BALANCE = 1 - RESTART_MARGIN


@dataclass(frozen=True)
class PipelineRule:
    """What lets a restart change pp (DCP and Megatron-Core dist-checkpointing reshard on load,
    :mod:`meshplan.restart_text`): the model's ``layers``, the configured ``pp`` and its
    ``split`` (kept at that pp), ``vpp`` (kept, with the schedule), whether the split is
    Llama 3's ends-short rule (``short``, carried to the new pp by
    :func:`~meshplan.mesh.layers.restart_split`) and ``framework`` (``training.framework``),
    which says what uneven splits the job can run (:meth:`runs`)."""

    layers: int
    pp: int
    vpp: int = 1
    split: Optional[tuple[int, ...]] = None
    short: bool = False
    dense: int = 0
    framework: str = "torch"

    def runs(self, split: Optional[list[int]], pp: int) -> bool:
        """Whether the job's framework runs layers per stage ``split`` at ``pp`` and it is balanced
        enough. Megatron-LM sets the first and the last stage (``--decoder-first/last-pipeline-
        num-layers``) and spreads the rest evenly, so its middle stages hold the same layers
        (:func:`~meshplan.mesh.layers.first_last_split`; with vpp > 1 the restart's splits are even
        chunks or Llama 3's, which its ``--account-for-embedding/loss-in-pipeline-split`` give);
        torchtitan takes any split as ``module_fqns_per_model_part`` (torchtitan
        distributed/pipeline_parallel.py ``pipeline_llm``@02ef790; its default cut spreads the
        layers with the embedding and the output weighted 1 each, stages a layer apart). Balanced
        enough: :func:`~meshplan.mesh.layers.split_balance` at least :data:`BALANCE`.

        >>> PipelineRule(80, 1).runs([10] + [12] * 5 + [10], 7), PipelineRule(80, 1).runs([5] + [6] * 5 + [5] * 9, 15)
        (True, False)
        >>> PipelineRule(80, 1, framework="megatron").runs([11, 12, 12, 12, 11, 11, 11], 7)  # middles differ
        False
        """
        if self.framework == "megatron" and not first_last_sets(split):
            return False
        return split_balance(split, self.layers, pp) >= BALANCE

    def splits_for(self, pp: int) -> Union[list[Optional[tuple[int, ...]]], str]:
        """The layer splits planned at ``pp`` (None: even), or why the layers allow none
        (:func:`~meshplan.mesh.layers.restart_splits`): ``dense`` (> 0: the configured split holds
        the model's dense layers alone on the first stage) offers them alone there
        (:func:`~meshplan.mesh.layers.dense_first_split`) besides the split over all the layers
        (``short``: Llama 3's ends-short rule, and the balanced split, Megatron-LM's cut under
        ``framework = "megatron"``), each only where the job runs it (:meth:`runs`). At the
        configured pp its split first, whatever its balance (not an even alternative: the plan
        reads None there as the configured split).

        >>> PipelineRule(80, 1).splits_for(27)[0][-2:], PipelineRule(80, 1).splits_for(31)
        ((3, 2), '80 layers over pp 31: the most even split loads its stages 0.88 as evenly as an even one, under 0.95')
        """
        got = restart_splits(self.layers, pp, self.vpp, self.short, self.dense, self.framework == "megatron")
        if isinstance(got, str):
            return got if pp != self.pp else [self.split]
        out = [tuple(s) if s is not None else None for s in got if self.runs(s, pp)]
        if pp == self.pp:
            return [self.split] + [s for s in out if s not in (self.split, None)]
        best = max(split_balance(s, self.layers, pp) for s in got)
        return out or (f"{self.layers} layers over pp {pp}: the most even split loads its stages {best:.2f} as evenly "
                       f"as an even one, under {BALANCE:.2f}")


def pipeline_rule(plan) -> PipelineRule:
    """The :class:`PipelineRule` of a plan (its model's layers, pp, vpp and pp_layer_split; the
    model's dense layers where the split puts exactly them on the first stage at vpp 1).

    >>> from types import SimpleNamespace as N
    >>> split = [3] + [4] * 14 + [2]  # DeepSeek-V3's: the 3 dense layers alone on the first stage
    >>> model = N(layers=61, dense_layers=3, is_moe=True)
    >>> plan = N(config=N(model=model, mesh=N(pp_layer_split=split), training=N(framework="torch")), pp=16, vpp=1)
    >>> r = pipeline_rule(plan); r.short, r.dense, r.splits_for(16)[0] == tuple(split)
    (True, 3, True)

    At pp 8 the dense layers alone on the first stage ([3, 8, 9, 9, 9, 8, 8, 7]: 63 / (8 x 9) =
    0.88 with the ends counted) are not balanced enough (:meth:`PipelineRule.runs`); the split over
    all the layers, ends-short and balanced, is (61 / 64 = 0.95):

    >>> r.splits_for(8)
    [(7, 8, 8, 8, 8, 8, 8, 6), (7, 8, 8, 8, 8, 8, 7, 7)]
    """
    model, split = plan.config.model, plan.config.mesh.pp_layer_split
    layers = model.layers
    short = split is not None and list(split) == ends_short_split(layers, plan.pp, plan.vpp)
    dense = model.dense_layers if (model.is_moe and model.dense_layers and split is not None and plan.vpp == 1
                                   and split[0] == model.dense_layers) else 0
    return PipelineRule(layers, plan.pp, plan.vpp, tuple(split) if split is not None else None, short, dense,
                        plan.config.training.framework)


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
