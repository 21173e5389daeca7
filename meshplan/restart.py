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
  stages, the configured Llama 3 ends-short rule carried over, the balanced split at vpp 1);
  each split of a mesh is planned and the fastest kept, the schedule and vpp kept. tp and cp
  vary where the caller gives a :class:`DegreeRule` (the CLI does: tp inside the fast domain
  splitting the heads and the MLP, cp the configured one, half or twice it, dividing the
  sequence). A checkpoint at other degrees loads resharded: DCP and Megatron-Core
  dist-checkpointing save each shard at its global offset, DeepSpeed through its universal
  checkpoint (:mod:`meshplan.restart_text`). Up to :data:`KEEPERS` meshes per (tp, cp, pp,
  layer split), those whose persistent state fits (the evaluator's screen); of those the
  :data:`TRIED` meshes (each with its splits) of the highest ideal throughput
  (:attr:`Proposal.ideal`: GPUs less the 1F1B bubble, the configured tp and cp first at a
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
  global batch is kept when it uses more GPUs than those. Then the job's kind first
  (:func:`~meshplan.restart_rank.kind_ranked`: the same axes, pp unchanged; its largest mesh
  keeping the global batch and its largest changing it are always planned) unless another
  plans more than MODEL_ACCURACY (5%) more tokens/s (then a note names the two and their tokens/s;
  a plan of the kind that fails is refused, a note each). The first is the proposal; one
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

from dataclasses import dataclass, replace
from functools import lru_cache
from math import prod
from typing import Any, Callable, Optional, Union

from meshplan.mesh.resolve import Infeasible as NoMesh, resolve_mesh
from meshplan.spec import mesh_words
# PLANNED, TRIED, PipelineRule, pipeline_rule, degree_rule, plan_evaluator: re-exported (the CLI's and the tests' names)
from meshplan.restart_degrees import (DegreeRule, PipelineRule, axes_at, degree_rule, engine_rules,  # noqa: F401
                                      pipeline_rule, pipelines, splits)
from meshplan.restart_rank import (PLANNED, TRIED, Evaluator, bounded, kind_passed, kind_ranked,  # noqa: F401
                                   plan_evaluator, rank, same_kind)
from meshplan.restart_text import (KIND_REFUSED, axis_moves, batch_notes, changer_refusal, checkpoint_engine,  # noqa: F401
                                   kind_notes, pipeline_note, result_notes, state_notes)
from meshplan.spec.mesh import MeshSpec

#: Meshes that keep the global batch evaluated at most per pipeline degree (largest first), and larger
#: refused meshes reported.
KEEPERS, REFUSED_SHOWN = 4, 4


@dataclass(frozen=True)
class Proposal:
    """One mesh for the restart. ``names``/``shape``: dense axes (mesh order); ``ep``,
    ``etp`` kept; ``gpus``: ranks it uses; ``contract``: "" (kept as configured) or the
    changed field, ``"micro_batch 4 -> 2"`` (global batch kept) or ``"global_batch 512 -> 511"``;
    ``step_s``, ``tokens_per_s``, ``peak_bytes`` (most loaded stage): from its plan, None
    without an evaluator; ``sharding``: ``training.sharding``, which names the data axis in its
    text (:func:`meshplan.spec.mesh_words.mesh_text`; "" keeps the names)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    ep: int
    etp: int
    gpus: int
    dp: int
    micro_batch: int
    global_batch: int
    micro_batches: int
    contract: str = ""
    step_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_bytes: Optional[float] = None
    pp_layer_split: Optional[tuple[int, ...]] = None
    sharding: str = ""

    @property
    def keeps_global_batch(self) -> bool:
        return not self.contract.startswith("global_batch")

    @property
    def pp(self) -> int:
        return dict(zip(self.names, self.shape)).get("pp", 1)

    @property
    def tp_cp(self) -> tuple[int, int]:
        deg = dict(zip(self.names, self.shape))
        return deg.get("tp", 1), deg.get("cp", 1)

    @property
    def ideal(self) -> float:
        """GPUs x the 1F1B busy fraction ``m / (m + pp - 1)`` (Narayanan et al. SC'21, 2.2.1:
        bubble ``(pp - 1) / m`` of the ideal time): the order meshes are planned in (:func:`_bounded`)."""
        return self.gpus * self.micro_batches / (self.micro_batches + self.pp - 1)

    def mesh_text(self) -> str:
        """Every axis > 1, the expert axes too (``pp 16 x dp_shard 64 x ep 64``), and pp 1 where
        pp is an axis (a restart that removed the pipeline says so)."""
        return mesh_words.mesh_text(self.names, self.shape, self.sharding, self.ep, self.etp,
                                    ("pp",) if "pp" in self.names else ())

    def summary(self) -> str:
        """Mesh, GPUs, contract and (when planned) step and throughput, one line."""
        out = f"{self.mesh_text()} on {self.gpus} GPUs"
        out += f", {self.contract}" if self.contract else ", contract kept"
        if self.step_s is not None and self.tokens_per_s is not None:
            out += f": step {self.step_s:.2f} s, {self.tokens_per_s:,.0f} tokens/s"
        return out


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
    where = _Where(mesh, left, global_batch, micro_batch, micro_batch_reasons, sharding, getattr(evaluate, "screen", None))
    keepers, changer, refused, screened, kind = _candidates(where, pipeline, pairs)
    planned: dict[tuple, list[Proposal]] = {}
    ranked, unplanned = rank(keepers, changer, evaluate, pairs[0], planned)
    ranked, kind_refused = kind_ranked(ranked, kind, evaluate, mesh)  # the kind's failed plans: refused too
    unplanned = screened + unplanned
    as_configured = _why_not_kept(global_batch, micro_batch, changer, micro_batch_reasons) if changer else ""
    top_why = (_why_not_kept(global_batch, micro_batch, ranked[0], micro_batch_reasons)  # the kind's (kind_ranked)
               if ranked and not ranked[0].keeps_global_batch else as_configured)
    if changer:
        refused.append(changer_refusal(changer, as_configured, ranked, unplanned))
    refused = sorted(refused + unplanned, key=lambda r: -r[1])
    if not ranked:
        return bad(*([r for r, _ in refused[:REFUSED_SHOWN] + kind_refused]
                     or ["no data-parallel degree keeps the contract"]))
    top = ranked[0]
    larger = tuple(r for r, gpus in refused if gpus > top.gpus)
    smaller = [r for r, gpus in sorted(unplanned, key=lambda r: -r[1]) if gpus < top.gpus]
    old, new = dict(zip(names, shape)), dict(zip(top.names, top.shape))
    changed = tuple(n for n in top.names if old.get(n, 1) != new[n])
    reshard, dl_ok, state = state_notes(changed, mesh.dp, top.dp, dataloader_state,
                                        changed_words(changed, top.names, sharding), checkpoint)
    notes = (result_notes(top, ranked, smaller, world, left, mesh, gpus_per_node, old_step, pipeline is not None,
                          old_infeasible) + kind_notes(kind_passed(ranked, mesh), kind_refused)
             + batch_notes(top, top_why, any(p.keeps_global_batch for p in ranked))
             + (pipeline_note(pipeline, top, planned.get((top.names, top.shape), [])) if pipeline else []) + state)
    return Restart(True, new_world=top.gpus, shape=top.shape, changed=changed, micro_batches=(old_m, top.micro_batches),
                   batch_contract=not top.contract, reshard=reshard, dataloader_ok=dl_ok, notes=tuple(notes),
                   contract=top.contract, proposals=tuple(ranked),
                   refused=larger[:REFUSED_SHOWN] + tuple(r for r, _ in kind_refused),
                   **{**base, "new_names": top.names})


@dataclass(frozen=True)
class _Where:
    """What every candidate mesh is checked against: the old ``mesh``, the ``left`` GPUs, the
    batch contract (``reasons_of(pp, m)``: the schedule's micro-batch rule), ``sharding`` (the
    text's data axis) and the evaluator's ``screen`` (why a mesh cannot fit before it is
    planned, "" when it may; None: none)."""

    mesh: Any
    left: int
    global_batch: int
    micro_batch: int
    reasons_of: Callable[[int, int], tuple[str, ...]]
    sharding: str = ""
    screen: Optional[Callable[[Proposal], str]] = None


def _candidates(w: _Where, pipeline: Optional[PipelineRule] = None,
                pairs: tuple[tuple[int, int], ...] = ()) -> tuple[list, Optional[Proposal], list, list, list]:
    """(meshes keeping the global batch: up to :data:`KEEPERS` per (tp, cp, pp), largest first,
    at most :data:`TRIED` (:func:`bounded`); the largest mesh changing it when larger than
    those; refused meshes as (text, GPUs); those of them the screen refused), for data-parallel
    degrees from the most the GPUs left hold down to 1, at each (tp, cp) of ``pairs`` (the
    mesh's own by default) and each pipeline degree of :func:`pipelines`; last, the job's kind
    (:func:`~meshplan.restart_rank.same_kind`: the configured tp, cp, pp and split): its largest
    mesh keeping the global batch and its largest changing it where larger (all GPUs but a few)."""
    keepers: list[Proposal] = []
    changers: list[Proposal] = []
    refused: list[tuple[str, int]] = []
    kind: list[Proposal] = []
    pairs = pairs or ((w.mesh.degree("tp"), w.mesh.degree("cp")),)
    for tp, cp in pairs:
        for pp, split in pipelines(w.mesh, w.left, pipeline, tp * cp):
            k, c, r = _at(w, {"tp": tp, "cp": cp, "pp": pp}, split)
            if not kind and not keepers + changers and pp == w.mesh.degree("pp"):  # the configured tp, cp, pp first
                kind = k[:1] + ([c] if c and (not k or c.gpus > k[0].gpus) else [])
            keepers += k
            changers += [c] if c else []
            refused += r
    tried, screened = bounded(keepers, pairs, w.screen)
    top = max((p.gpus for p in keepers), default=0)
    changer = max((c for c in changers if c.gpus > top), key=lambda c: c.gpus, default=None)
    return tried, changer, refused, screened, [p for p in kind if same_kind(p, w.mesh)]



def _at(w: _Where, inner: dict[str, int], split):
    """:func:`_candidates` at one (tp, cp, pp) ``inner`` (layers per stage ``split``). At most
    :data:`REFUSED_SHOWN` refusals kept (the largest; only those can be shown), later meshes
    whose expert block cannot divide then skipped unresolved; once the changer or a keeper is
    found, a degree that cannot keep the global batch is skipped (only the largest changer is
    kept, and a smaller refusal is not shown). The schedule's reasons are asked once per
    micro-batch count."""
    mesh, pp = w.mesh, inner["pp"]
    names, deg = axes_at(mesh, inner)
    ep, etp = mesh.ep, mesh.etp
    fixed_world = inner["tp"] * inner["cp"] * pp
    reasons_of = lru_cache(maxsize=None)(lambda m: w.reasons_of(pp, m))
    keepers: list[Proposal] = []
    changer: Optional[Proposal] = None
    refused: list[tuple[str, int]] = []
    for d in range(w.left // fixed_world, 0, -1):
        if all(w.global_batch % (b * d) for b in range(1, w.micro_batch + 1)) and (
                changer is not None or keepers or len(refused) >= REFUSED_SHOWN
                and all(reasons_of(m) for m in range(max(1, w.global_batch // (w.micro_batch * d)), 0, -1))):
            continue  # cannot keep the global batch: neither the largest changer nor a refusal shown
        for shape in splits(names, deg, d):
            gpus = fixed_world * d
            block = prod(x for n, x in zip(names, shape) if n in ("dp_shard", "dp", "cp", "tp"))
            if len(refused) >= REFUSED_SHOWN and block % (ep * etp):
                continue
            spec = MeshSpec(names=list(names) + [a for a, x in (("ep", ep), ("etp", etp)) if x > 1],
                            shape=list(shape) + [x for x in (ep, etp) if x > 1])
            resolved = resolve_mesh(spec, gpus)
            keep = ("pp",) if "pp" in names else ()
            text = f"{mesh_words.mesh_text(names, shape, w.sharding, ep, etp, keep)} ({gpus} GPUs)"
            if isinstance(resolved, NoMesh):
                refused.append((f"{text}: {'; '.join(resolved.reasons)}", gpus))
                continue
            p = _contract(Proposal(names, shape, ep, etp, gpus, d, w.micro_batch, w.global_batch, 0,
                                   pp_layer_split=split, sharding=w.sharding), reasons_of)
            if isinstance(p, str):
                refused.append((f"{text}: {p}", gpus))
            elif p.keeps_global_batch:
                keepers.append(p)
            elif changer is None and not keepers:
                changer = p
            if len(keepers) >= KEEPERS:
                return keepers, changer, refused[:REFUSED_SHOWN]
    return keepers, changer, refused[:REFUSED_SHOWN]


def _why_not_kept(global_batch: int, micro_batch: int, p: Proposal, reasons_of) -> str:
    """Why ``p``'s dp breaks the contract as configured (the dp rule's words, or the schedule's at its pp)."""
    dp = p.dp
    if global_batch % (micro_batch * dp):
        return (f"global_batch {global_batch} is not divisible by micro_batch {micro_batch} x dp {dp} = "
                f"{micro_batch * dp}")
    return "; ".join(reasons_of(p.pp, global_batch // (micro_batch * dp)))


def _contract(p: Proposal, reasons_of) -> Union[Proposal, str]:
    """``p`` with the contract it runs: as configured; else the largest smaller micro_batch
    that keeps the global batch; else the largest global batch below the configured one that
    is a whole number of micro-batches the schedule accepts (at least one per rank). A string:
    why none works (the schedule's reasons at the most micro-batches the global batch allows)."""
    gb, mb, dp = p.global_batch, p.micro_batch, p.dp
    for b in range(mb, 0, -1):
        if gb % (b * dp) == 0 and not reasons_of(gb // (b * dp)):
            return replace(p, micro_batch=b, micro_batches=gb // (b * dp),
                           contract="" if b == mb else f"micro_batch {mb} -> {b}")
    most = max(1, gb // (mb * dp))
    for m in range(most, 0, -1):
        if not reasons_of(m):
            return replace(p, micro_batches=m, global_batch=m * mb * dp, contract=f"global_batch {gb} -> {m * mb * dp}")
    return (f"none of 1-{most} micro-batches a step runs ({most} = global_batch {gb} // (micro_batch {mb} x dp {dp})); "
            f"at {most}: " + "; ".join(reasons_of(most)))
