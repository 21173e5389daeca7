"""Restart on fewer nodes: which meshes the surviving GPUs can run, each keeping the model's
split and the training contract (or saying which field it changes), ranked by planned
throughput.

Rules (seed, "Reliability": whether elastic restart can reconstruct the same or a different
mesh; "Global semantics": hold the global batch fixed):

- ep and etp keep their degrees. The data-parallel axes shrink: every split
  ``dp_replicate x (dp_shard or dp) = d`` for ``d`` from ``GPUs left // (tp pp cp)`` down,
  the split without resharding (dp_shard kept, replicas dropped) first.
- pp varies too where the caller gives the model's :class:`PipelineRule` (the CLI does):
  every pp from 1 up whose replica fits and whose layers allow it, with up to 3 layer splits
  (:func:`meshplan.mesh.layers.restart_splits`: the model's dense layers alone on the first
  stage where the configured split has them so, and the split over all the layers: even
  stages, the configured Llama 3 ends-short rule carried over, the balanced split at vpp 1,
  Megatron-LM's first/last cut under its framework); a split the job did not run only where
  its framework sets it and it is balanced enough
  (:meth:`~meshplan.restart_degrees.PipelineRule.runs`: Megatron-LM's even middle stages; the
  mean stage at least :data:`~meshplan.restart_degrees.BALANCE` of the heaviest), so 80 layers
  restart at pp 7 or 27, not 15 or 31; each split of a mesh is planned and the fastest kept,
  the schedule and vpp kept. tp and cp
  vary where the caller gives a :class:`DegreeRule` (the CLI does: tp inside the fast domain
  splitting the heads and the MLP, cp the configured one, half or twice it, dividing the
  sequence). A checkpoint at other degrees loads resharded: DCP and Megatron-Core
  dist-checkpointing save each shard at its global offset, DeepSpeed through its universal
  checkpoint (:mod:`meshplan.restart_text`). Up to :data:`~meshplan.restart_meshes.KEEPERS` meshes per (tp, cp, pp,
  layer split), those whose persistent state fits (the evaluator's screen); of those the
  :data:`TRIED` meshes (each with its splits) of the highest ideal throughput
  (:attr:`~meshplan.restart_meshes.Proposal.ideal`: GPUs less the 1F1B bubble, the configured tp and cp first at a
  tie) are planned in that order until :data:`PLANNED` run.
- A mesh must resolve (:func:`meshplan.mesh.resolve.resolve_mesh`): with experts the dense
  block ``dp_shard x cp x tp`` must stay a multiple of ``ep x etp``, so fewer GPUs than the
  largest data-parallel degree may be used; the others sit idle (spares for the next failure).
- The training contract ``global_batch = micro_batch x micro-batches x dp`` (the dp axis rule,
  :mod:`meshplan.spec.axes.dp`, and the pipeline schedule's micro-batch rule,
  :func:`meshplan.plan_runtime.run_reasons`): a mesh keeps it as configured, or keeps the global batch
  with a smaller micro_batch, or changes the global batch (to the largest multiple of
  ``micro_batch x dp`` below it the schedule accepts), said as ``field old -> new``.
- Ranking: meshes that keep the global batch first, then planned throughput (tokens/s of
  :func:`meshplan.schedule.steptime.step_time` on the new mesh's plan, memory checked);
  without an evaluator (the arithmetic alone), GPUs used. The largest mesh that changes the
  global batch is kept when it uses more GPUs than those. Then the job's kind first, the
  least-disruptive restart (:func:`~meshplan.restart_rank.kind_ranked`: pp, tp and cp kept, only
  the data axes shrunk; its largest mesh keeping the global batch and its largest changing it
  are always planned, the latter preferred only beyond RESTART_MARGIN, 5%) unless a mesh changing
  pp, tp or cp plans more than REMESH_MARGIN (29.4%) more tokens/s and keeps the global batch
  where the kind does (a ``why:`` note says why the kind comes first and names the fastest such
  mesh, or a note names the kind passed over; a plan of the kind that fails is refused, a note each). The first is the proposal; one
  alternative is shown: the best keeping the global batch when the proposal changes it, else
  the larger mesh changing it, else the runner-up.

>>> from meshplan.mesh.resolve import resolve_mesh
>>> from meshplan.spec.mesh import MeshSpec
>>> m = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), world=64)
>>> r = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=512, micro_batch=1)
>>> r.shape, r.new_world, [(p.shape, p.contract) for p in r.proposals]
((4, 8), 32, [((4, 8), ''), ((2, 8), ''), ((1, 8), ''), ((7, 8), 'global_batch 512 -> 511')])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from meshplan.spec import mesh_words
# PLANNED, TRIED, KEEPERS, Proposal, PipelineRule, pipeline_rule, degree_rule, plan_evaluator: re-exported (the
# CLI's and the tests' names)
from meshplan.restart_degrees import (DegreeRule, PipelineRule, axes_at, degree_rule, engine_rules,  # noqa: F401
                                      pipeline_rule, pipelines, splits)
from meshplan.restart_meshes import KEEPERS, REFUSED_SHOWN, Proposal, Where, candidates, why_not_kept  # noqa: F401
from meshplan.restart_rank import (PLANNED, TRIED, Evaluator, bounded, kind_kept, kind_passed, kind_ranked,  # noqa: F401
                                   plan_evaluator, rank, same_kind)
from meshplan.restart_text import (KIND_REFUSED, axis_moves, batch_notes, changer_refusal, checkpoint_engine,  # noqa: F401
                                   kind_notes, pipeline_note, result_notes, state_notes)


@dataclass(frozen=True)
class Restart:
    """Result of :func:`restart_on_fewer_nodes`. ``gpus_left``: GPUs after the loss (and
    spares); ``new_world``, ``names``/``shape``, ``changed``, ``micro_batches`` (old, new):
    the proposed mesh (``proposals[0]``); ``batch_contract``: it keeps the contract as
    configured; ``contract``: else the field it changes; ``proposals``: ranked (module
    docstring); ``refused``: larger meshes not proposed, each with why, then the job's kind's
    meshes whose plan failed (:func:`~meshplan.restart_text.kind_refusal`); ``old_step_s``,
    ``old_tokens_per_s``: the plan before the loss; ``reasons``: why no mesh exists (empty when
    feasible); ``notes``: what the restart implies."""

    feasible: bool
    old_world: int
    new_world: int
    names: tuple[str, ...]
    old_shape: tuple[int, ...]
    shape: tuple[int, ...]
    changed: tuple[str, ...]
    micro_batches: tuple[int, int]
    batch_contract: bool
    reshard: bool
    dataloader_ok: bool
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    gpus_left: int = 0
    ep: int = 1
    etp: int = 1
    contract: str = ""
    proposals: tuple[Proposal, ...] = ()
    refused: tuple[str, ...] = ()
    old_step_s: Optional[float] = None
    old_tokens_per_s: Optional[float] = None
    new_names: tuple[str, ...] = ()
    sharding: str = ""

    def moves(self) -> str:
        """Each changed axis with its degrees before and after, and the axes kept
        (:func:`~meshplan.restart_text.axis_moves`): ``shrunk: dp_shard 8 -> 7; kept: tp 8``."""
        names = self.new_names or self.names
        experts = tuple((a, d) for a, d in (("ep", self.ep), ("etp", self.etp)) if a not in names)
        return axis_moves(dict(zip(self.names, self.old_shape)), dict(zip(names, self.shape)), self.changed,
                          mesh_words.shown_names(names, self.sharding), experts)

    def lines(self) -> list[str]:
        """What ``meshplan reliability`` prints; an infeasible restart is one line naming why
        (its ``infeasible:`` line is the CLI's, on stderr), never a mesh called unchanged.

        >>> from meshplan.mesh.resolve import resolve_mesh
        >>> from meshplan.spec.mesh import MeshSpec
        >>> m = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[32]), world=32)
        >>> restart_on_fewer_nodes(m, 4, gpus_per_node=8, global_batch=256, micro_batch=1).lines()
        ['restart: world 32 -> 0: no GPU left to restart on (0 GPUs left are fewer than tp 1 x pp 1 x cp 1 = 1)']
        """
        if not self.feasible:  # no new mesh was found: say why, in one line
            what = "no GPU left to restart on" if self.gpus_left <= 0 else "no mesh to restart on"
            return [f"restart: world {self.old_world} -> {self.gpus_left}: {what} ({'; '.join(self.reasons)})"]
        keep = tuple(self.changed)
        old = mesh_words.mesh_text(self.names, self.old_shape, self.sharding, self.ep, self.etp, keep)
        new = mesh_words.mesh_text(self.new_names or self.names, self.shape, self.sharding, self.ep, self.etp, keep)
        left = f" ({self.gpus_left} GPUs left)" if self.gpus_left != self.new_world else ""
        head = (f"restart: world {self.old_world} -> {self.new_world}{left}; mesh {old} -> {new}"
                + (f" ({self.moves()})" if self.changed else " (unchanged)"))
        if self.refused and not self.refused[0].startswith(KIND_REFUSED):  # the kind's: a note of its own
            head += f"; not {self.refused[0]}"
        return [head] + [f"- {n}" for n in self.notes]


def changed_words(changed, names, sharding: str) -> str:
    """``pp, dp``: the changed axes, the data axis named by ``sharding``
    (:func:`meshplan.spec.mesh_words.shown_names`).

    >>> changed_words(("pp", "dp_shard"), ("pp", "dp_shard"), "zero1")
    'pp, dp'
    """
    printed = mesh_words.shown_names(names, sharding)
    return ", ".join(printed.get(n, n) for n in changed)


def restart_on_fewer_nodes(mesh, lost_nodes: int, *, gpus_per_node: int, global_batch: int, micro_batch: int,
                           spare_nodes: int = 0,
                           micro_batch_reasons: Callable[[int, int], tuple[str, ...]] = lambda pp, m: (),
                           dataloader_state: str = "per_rank", evaluate: Optional[Evaluator] = None,
                           old_step: Optional[tuple[float, float]] = None,
                           pipeline: Optional[PipelineRule] = None, degrees: Optional[DegreeRule] = None,
                           sharding: str = "", checkpoint: str = "dcp", old_infeasible: str = "") -> Restart:
    """Can the job restart on ``lost_nodes`` fewer nodes (after using ``spare_nodes``), and on
    which mesh (module docstring)? ``dataloader_state``: "per_rank" (saved per dp rank, e.g. a
    StatefulDataLoader) or "global" (a global consumed-samples counter, as Megatron-LM keeps).
    ``micro_batch_reasons(pp, m)``: why the pipeline schedule cannot run m micro-batches per
    step on pp stages (the plan's :func:`meshplan.plan_runtime.run_reasons` under its framework; none
    by default). ``evaluate``: plans a proposal (its step and throughput) or says why it cannot
    run (:func:`plan_evaluator`); ``old_step``: (step s, tokens/s) of the plan before the loss
    (``old_infeasible``: why that plan does not run, said instead of the throughput lost);
    ``pipeline``: vary pp too, every degree its layers allow (:class:`PipelineRule`; without
    it pp is kept); ``degrees``: vary tp and cp too (:class:`DegreeRule`; without it they are
    kept); ``sharding``: ``training.sharding``, which names the data axis in the text;
    ``checkpoint``: the engine that loads the checkpoint (:func:`~meshplan.restart_text.checkpoint_engine`:
    "dcp", "megatron" or "deepspeed"), whose resharding path the checkpoint note names.

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> m = resolve_mesh(MeshSpec(names=["dp_replicate", "dp_shard", "tp"], shape=[4, 2, 8]), world=64)
    >>> r = restart_on_fewer_nodes(m, 2, gpus_per_node=8, global_batch=480, micro_batch=1)
    >>> r.shape, r.changed, r.micro_batches, r.batch_contract, r.reshard
    ((3, 2, 8), ('dp_replicate',), (60, 80), True, False)
    """
    names, shape = mesh.layout.names, mesh.layout.shape
    world, lost = mesh.world, max(0, lost_nodes - spare_nodes)
    left = world - lost * gpus_per_node
    min_pp = 1 if pipeline else mesh.degree("pp")
    pairs = degrees.pairs if degrees else ((mesh.degree("tp"), mesh.degree("cp")),)
    tp, cp = min(pairs, key=lambda p: p[0] * p[1])
    fixed = tp * min_pp * cp
    old_m = global_batch // (micro_batch * mesh.dp)
    base: dict[str, Any] = dict(old_world=world, names=names, new_names=names, old_shape=shape, gpus_left=left,
                                ep=mesh.ep, etp=mesh.etp, sharding=sharding,
                                old_step_s=old_step[0] if old_step else None,
                                old_tokens_per_s=old_step[1] if old_step else None)
    if lost == 0:
        note = f"{lost_nodes} lost node(s) replaced by spares: same mesh, same checkpoint layout"
        return Restart(True, new_world=world, shape=shape, changed=(), micro_batches=(old_m, old_m),
                       batch_contract=True, reshard=False, dataloader_ok=True, notes=(note,), **base)

    def bad(*why: str) -> Restart:
        return Restart(False, new_world=0, shape=shape, changed=(), micro_batches=(old_m, 0), batch_contract=False,
                       reshard=False, dataloader_ok=False, reasons=why, **base)

    if left < fixed:
        return bad(f"{left} GPUs left are fewer than tp {tp} x pp {min_pp} x cp {cp} = {fixed}")
    if not any(a in names for a in ("dp_replicate", "dp_shard", "dp")):
        return bad("the mesh has no data-parallel axis to shrink")
    where = Where(mesh, left, global_batch, micro_batch, micro_batch_reasons, sharding, getattr(evaluate, "screen", None))
    planned: dict[tuple, list[Proposal]] = {}
    ranked, refused, unplanned, kind, kind_refused, top_why = _ranked(where, pipeline, pairs, evaluate, planned)
    if not ranked:
        return bad(*([r for r, _ in refused[:REFUSED_SHOWN] + kind_refused]
                     or ["no data-parallel degree keeps the contract"]))
    return _restart_on(ranked[0], ranked, refused, unplanned, (kind, kind_refused, top_why), planned, mesh, where,
                       pipeline, dataloader_state, checkpoint, gpus_per_node, old_step, old_infeasible, old_m, base)


def _ranked(where: Where, pipeline: Optional[PipelineRule], pairs, evaluate: Optional[Evaluator],
            planned: dict) -> tuple:
    """(the proposals ranked, the refused (reason, GPUs) by GPUs, the unplanned, the restart's kind
    and its refused plans, why the top does not keep the global batch) of the candidates
    :func:`restart_on_fewer_nodes` weighs; ``planned``: each mesh's plans, filled."""
    global_batch, micro_batch, micro_batch_reasons = where.global_batch, where.micro_batch, where.reasons_of
    keepers, changer, refused, screened, kind = candidates(where, pipeline, pairs)
    ranked, unplanned = rank(keepers, changer, evaluate, pairs[0], planned)
    ranked, kind_refused = kind_ranked(ranked, kind, evaluate, where.mesh)  # the kind's failed plans: refused too
    unplanned = screened + unplanned
    as_configured = why_not_kept(global_batch, micro_batch, changer, micro_batch_reasons) if changer else ""
    top_why = (why_not_kept(global_batch, micro_batch, ranked[0], micro_batch_reasons)  # the kind's (kind_ranked)
               if ranked and not ranked[0].keeps_global_batch else as_configured)
    if changer:
        refused.append(changer_refusal(changer, as_configured, ranked, unplanned))
    refused = sorted(refused + unplanned, key=lambda r: -r[1])
    return ranked, refused, unplanned, kind, kind_refused, top_why


def _restart_on(top: Proposal, ranked: list, refused: list, unplanned: list, kinds: tuple, planned: dict, mesh,
                where: Where, pipeline: Optional[PipelineRule], dataloader_state: str, checkpoint: str,
                gpus_per_node: int, old_step: Optional[tuple[float, float]], old_infeasible: str, old_m: int,
                base: dict) -> Restart:
    """The :class:`Restart` on the top proposal ``top`` (``kinds``: :func:`_ranked`'s kind, its
    refused plans and why the top does not keep the global batch): what changed, the state's
    resharding and the notes."""
    kind, kind_refused, top_why = kinds
    names, shape, world, left, sharding = mesh.layout.names, mesh.layout.shape, mesh.world, where.left, where.sharding
    larger = tuple(r for r, gpus in refused if gpus > top.gpus)
    smaller = [r for r, gpus in sorted(unplanned, key=lambda r: -r[1]) if gpus < top.gpus]
    old, new = dict(zip(names, shape)), dict(zip(top.names, top.shape))
    changed = tuple(n for n in top.names if old.get(n, 1) != new[n])
    reshard, dl_ok, state = state_notes(changed, mesh.dp, top.dp, dataloader_state,
                                        changed_words(changed, top.names, sharding), checkpoint)
    notes = (result_notes(top, ranked, smaller, world, left, mesh, gpus_per_node, old_step, pipeline is not None,
                          old_infeasible) + kind_notes(kind_passed(ranked, mesh), kind_kept(ranked, mesh), kind_refused)
             + batch_notes(top, top_why, any(p.keeps_global_batch for p in ranked))
             + (pipeline_note(pipeline, top, planned.get((top.names, top.shape), [])) if pipeline else []) + state)
    return Restart(True, new_world=top.gpus, shape=top.shape, changed=changed, micro_batches=(old_m, top.micro_batches),
                   batch_contract=not top.contract, reshard=reshard, dataloader_ok=dl_ok, notes=tuple(notes),
                   contract=top.contract, proposals=tuple(ranked),
                   refused=larger[:REFUSED_SHOWN] + tuple(r for r, _ in kind_refused),
                   **{**base, "new_names": top.names})
