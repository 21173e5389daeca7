"""Restart on fewer nodes: which meshes the surviving GPUs can run, each keeping the model's
split and the training contract (or saying which field it changes), ranked by planned
throughput.

Rules (seed, "Reliability": whether elastic restart can reconstruct the same or a different
mesh; "Global semantics": hold the global batch fixed):

- tp, pp, cp, ep and etp keep their degrees: they fix the model's split and the
  checkpoint's tensor layout. Only the data-parallel axes shrink: every split
  ``dp_replicate x (dp_shard or dp) = d`` for ``d`` from ``GPUs left // (tp pp cp)`` down,
  the split without resharding (dp_shard kept, replicas dropped) first.
- A mesh must resolve (:func:`meshplan.mesh.resolve.resolve_mesh`): with experts the dense
  block ``dp_shard x cp x tp`` must stay a multiple of ``ep x etp``, so fewer GPUs than the
  largest data-parallel degree may be used; the others sit idle (spares for the next failure).
- The training contract ``global_batch = micro_batch x micro-batches x dp`` (the dp axis rule,
  :mod:`meshplan.spec.axes.dp`, and the pipeline schedule's micro-batch rule,
  :func:`meshplan.plan.run_reasons`): a mesh keeps it as configured, or keeps the global batch
  with a smaller micro_batch, or changes the global batch (to the largest multiple of
  ``micro_batch x dp`` below it the schedule accepts), said as ``field old -> new``.
- Ranking: meshes that keep the global batch first, then planned throughput (tokens/s of
  :func:`meshplan.schedule.steptime.step_time` on the new mesh's plan, memory checked);
  without an evaluator (the arithmetic alone), GPUs used. The first is the proposal, the
  second the runner-up; the largest mesh that changes the global batch is kept as the
  alternative when it uses more GPUs than the proposal.

>>> from meshplan.mesh.resolve import resolve_mesh
>>> from meshplan.spec.mesh import MeshSpec
>>> m = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), world=64)
>>> r = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=512, micro_batch=1)
>>> r.shape, r.new_world, [(p.shape, p.contract) for p in r.proposals]
((4, 8), 32, [((4, 8), ''), ((2, 8), ''), ((1, 8), ''), ((7, 8), 'global_batch 512 -> 511')])
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Infeasible as NoMesh, resolve_mesh
from meshplan.plan import Infeasible, build_plan
from meshplan.schedule.rank_timeline import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.spec import wording
from meshplan.spec.mesh import MeshSpec
from meshplan.units import counted

#: Meshes that keep the global batch evaluated at most (largest first), and larger refused meshes reported.
KEEPERS, REFUSED_SHOWN = 4, 4


@dataclass(frozen=True)
class Proposal:
    """One mesh for the restart. ``names``/``shape``: dense axes (mesh order); ``ep``,
    ``etp`` kept; ``gpus``: ranks it uses; ``contract``: "" (kept as configured) or the
    changed field, ``"micro_batch 4 -> 2"`` (global batch kept) or ``"global_batch 512 -> 511"``;
    ``step_s``, ``tokens_per_s``, ``peak_bytes`` (most loaded stage): from its plan, None
    without an evaluator."""

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

    @property
    def keeps_global_batch(self) -> bool:
        return not self.contract.startswith("global_batch")

    def mesh_text(self) -> str:
        """Every axis > 1, the expert axes too (``pp 16 x dp_shard 64 x ep 64``)."""
        return mesh_text(self.names, self.shape, self.ep, self.etp)

    def summary(self) -> str:
        """Mesh, GPUs, contract and (when planned) step and throughput, one line."""
        out = f"{self.mesh_text()} on {self.gpus} GPUs"
        out += f", {self.contract}" if self.contract else ", contract kept"
        if self.step_s is not None and self.tokens_per_s is not None:
            out += f": step {self.step_s:.2f} s, {self.tokens_per_s:,.0f} tokens/s"
        return out


def mesh_text(names, shape, ep: int = 1, etp: int = 1, keep: tuple[str, ...] = ()) -> str:
    """``a 2 x b 4 x ep 8``: :func:`meshplan.spec.wording.mesh_text` (axes of degree > 1 and
    those in ``keep``, then ep and etp > 1), the names as configured.

    >>> mesh_text(("pp", "dp_shard"), (16, 64), 64), mesh_text(("dp_shard",), (1,))
    ('pp 16 x dp_shard 64 x ep 64', 'dp_shard 1')
    """
    return wording.mesh_text(names, shape, ep=ep, etp=etp, keep=keep)


@dataclass(frozen=True)
class Restart:
    """Result of :func:`restart_on_fewer_nodes`. ``gpus_left``: GPUs after the loss (and
    spares); ``new_world``, ``names``/``shape``, ``changed``, ``micro_batches`` (old, new):
    the proposed mesh (``proposals[0]``); ``batch_contract``: it keeps the contract as
    configured; ``contract``: else the field it changes; ``proposals``: ranked (module
    docstring); ``refused``: larger meshes not proposed, each with why; ``old_step_s``,
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
        old = mesh_text(self.names, self.old_shape, self.ep, self.etp, keep)
        new = mesh_text(self.names, self.shape, self.ep, self.etp, keep)
        left = f" ({self.gpus_left} GPUs left)" if self.gpus_left != self.new_world else ""
        head = (f"restart: world {self.old_world} -> {self.new_world}{left}; mesh {old} -> {new}"
                + (f" (changed: {', '.join(self.changed)})" if self.changed else " (unchanged)"))
        if self.refused:
            head += f"; not {self.refused[0]}"
        return [head] + [f"- {n}" for n in self.notes]


Evaluator = Callable[[Proposal], Union[Proposal, str]]


def restart_on_fewer_nodes(mesh, lost_nodes: int, *, gpus_per_node: int, global_batch: int, micro_batch: int,
                           spare_nodes: int = 0,
                           micro_batch_reasons: Callable[[int], tuple[str, ...]] = lambda m: (),
                           dataloader_state: str = "per_rank", evaluate: Optional[Evaluator] = None,
                           old_step: Optional[tuple[float, float]] = None) -> Restart:
    """Can the job restart on ``lost_nodes`` fewer nodes (after using ``spare_nodes``), and on
    which mesh (module docstring)? ``dataloader_state``: "per_rank" (saved per dp rank, e.g. a
    StatefulDataLoader) or "global" (a global consumed-samples counter, as Megatron-LM keeps).
    ``micro_batch_reasons(m)``: why the pipeline schedule cannot run m micro-batches per step
    (the plan's :func:`meshplan.plan.run_reasons` under its framework; none by default).
    ``evaluate``: plans a proposal (its step and throughput) or says why it cannot run
    (:func:`plan_evaluator`); ``old_step``: (step s, tokens/s) of the plan before the loss.

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
    fixed = mesh.degree("tp") * mesh.degree("pp") * mesh.degree("cp")
    old_m = global_batch // (micro_batch * mesh.dp)
    base: dict[str, Any] = dict(old_world=world, names=names, old_shape=shape, gpus_left=left, ep=mesh.ep, etp=mesh.etp,
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
        return bad(f"{left} GPUs left are fewer than tp {mesh.degree('tp')} x pp {mesh.degree('pp')} "
                   f"x cp {mesh.degree('cp')} = {fixed}")
    if not any(a in names for a in ("dp_replicate", "dp_shard", "dp")):
        return bad("the mesh has no data-parallel axis to shrink")
    keepers, changer, refused = _candidates(mesh, left // fixed, global_batch, micro_batch, micro_batch_reasons)
    ranked, unplanned = _rank(keepers, changer, evaluate)
    as_configured = _why_not_kept(global_batch, micro_batch, changer.dp, micro_batch_reasons) if changer else ""
    if changer:
        refused.append(_changer_refusal(changer, as_configured, ranked, unplanned))
    refused = sorted(refused + unplanned, key=lambda r: -r[1])
    if not ranked:
        return bad(*([r for r, _ in refused[:REFUSED_SHOWN]] or ["no data-parallel degree keeps the contract"]))
    top = ranked[0]
    larger = tuple(r for r, gpus in refused if gpus > top.gpus)
    smaller = [r for r, gpus in unplanned if gpus < top.gpus]
    changed = tuple(n for n, a, b in zip(names, shape, top.shape) if a != b)
    reshard, dl_ok, state_notes = _state_notes(changed, mesh.dp, top.dp, dataloader_state)
    notes = (_result_notes(top, ranked, smaller, world, left, mesh, gpus_per_node, old_step)
             + _batch_notes(top, as_configured) + state_notes)
    return Restart(True, new_world=top.gpus, shape=top.shape, changed=changed, micro_batches=(old_m, top.micro_batches),
                   batch_contract=not top.contract, reshard=reshard, dataloader_ok=dl_ok, notes=tuple(notes),
                   contract=top.contract, proposals=tuple(ranked), refused=larger[:REFUSED_SHOWN], **base)


def _splits(mesh, d: int) -> list[tuple[int, ...]]:
    """Dense shapes with data-parallel degree ``d``, tp/pp/cp kept: dp_replicate x (dp_shard
    or dp) = d, the split keeping the shard degree (no resharding) first, then larger shards."""
    names, deg = mesh.layout.names, dict(zip(mesh.layout.names, mesh.layout.shape))
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


def _candidates(mesh, max_dp: int, global_batch: int, micro_batch: int, reasons_of) -> tuple[list, Optional[Proposal],
                                                                                             list]:
    """(up to :data:`KEEPERS` meshes keeping the global batch, largest first; the largest
    mesh changing it when larger than those; refused meshes as (text, GPUs)), for data-parallel
    degrees ``max_dp`` down to 1."""
    names, ep, etp, fixed_world = mesh.layout.names, mesh.ep, mesh.etp, mesh.world // mesh.dp
    keepers: list[Proposal] = []
    changer: Optional[Proposal] = None
    refused: list[tuple[str, int]] = []
    for d in range(max_dp, 0, -1):
        for shape in _splits(mesh, d):
            gpus = fixed_world * d
            spec = MeshSpec(names=list(names) + [a for a, x in (("ep", ep), ("etp", etp)) if x > 1],
                            shape=list(shape) + [x for x in (ep, etp) if x > 1])
            resolved = resolve_mesh(spec, gpus)
            text = f"{mesh_text(names, shape, ep, etp)} ({gpus} GPUs)"
            if isinstance(resolved, NoMesh):
                refused.append((f"{text}: {'; '.join(resolved.reasons)}", gpus))
                continue
            p = _contract(Proposal(names, shape, ep, etp, gpus, d, micro_batch, global_batch, 0), reasons_of)
            if isinstance(p, str):
                refused.append((f"{text}: {p}", gpus))
            elif p.keeps_global_batch:
                keepers.append(p)
            elif changer is None and not keepers:
                changer = p
            if len(keepers) >= KEEPERS:
                return keepers, changer, refused
    return keepers, changer, refused


def _why_not_kept(global_batch: int, micro_batch: int, dp: int, reasons_of) -> str:
    """Why ``dp`` breaks the contract as configured (the dp rule's words, or the schedule's)."""
    if global_batch % (micro_batch * dp):
        return (f"global_batch {global_batch} is not divisible by micro_batch {micro_batch} x dp {dp} = "
                f"{micro_batch * dp}")
    return "; ".join(reasons_of(global_batch // (micro_batch * dp)))


def _changer_refusal(changer: Proposal, as_configured: str, ranked: list[Proposal], unplanned: list) -> tuple[str, int]:
    """Why the largest mesh does not keep the contract (``as_configured``), and whether it runs
    with the changed one (the alternative) or not (its refusal, taken from ``unplanned``: the
    changer is evaluated last)."""
    why = f"{changer.mesh_text()} ({changer.gpus} GPUs): {as_configured}"
    if any(not p.keeps_global_batch for p in ranked):
        return why + " (the alternative below changes the global batch)", changer.gpus
    return why + f"; with {changer.contract}: {unplanned.pop()[0].split(': ', 1)[1]}", changer.gpus


def _contract(p: Proposal, reasons_of) -> Union[Proposal, str]:
    """``p`` with the contract it runs: as configured; else the largest smaller micro_batch
    that keeps the global batch; else the largest global batch below the configured one that
    is a whole number of micro-batches the schedule accepts (at least one per rank). A string:
    why none works."""
    gb, mb, dp = p.global_batch, p.micro_batch, p.dp
    for b in range(mb, 0, -1):
        if gb % (b * dp) == 0 and not reasons_of(gb // (b * dp)):
            return replace(p, micro_batch=b, micro_batches=gb // (b * dp),
                           contract="" if b == mb else f"micro_batch {mb} -> {b}")
    for m in range(max(1, gb // (mb * dp)), 0, -1):
        if not reasons_of(m):
            return replace(p, micro_batches=m, global_batch=m * mb * dp, contract=f"global_batch {gb} -> {m * mb * dp}")
    return "; ".join(reasons_of(1)) or "no micro-batch count runs"


def _rank(keepers: list[Proposal], changer: Optional[Proposal], evaluate: Optional[Evaluator]):
    """(proposals ranked: keeping the global batch first, then throughput, else GPUs; the
    meshes the evaluator refused, as (text, GPUs))."""
    out: list[Proposal] = []
    unplanned: list[tuple[str, int]] = []
    for p in keepers + ([changer] if changer else []):
        got = evaluate(p) if evaluate else p
        if isinstance(got, str):
            unplanned.append((f"{p.mesh_text()} ({p.gpus} GPUs): {got}", p.gpus))
        else:
            out.append(got)
    out.sort(key=lambda p: (not p.keeps_global_batch, -(p.tokens_per_s if p.tokens_per_s is not None else p.gpus)))
    return out, unplanned


def _result_notes(top: Proposal, ranked: list[Proposal], smaller: list[str], world: int, left: int, mesh,
                  gpus_per_node: int, old_step: Optional[tuple[float, float]]) -> list[str]:
    """Planned step and throughput lost, idle GPUs, runner-up (or why none: ``smaller``, the
    smaller meshes the evaluator refused) and alternative."""
    notes = []
    if top.step_s is not None and top.tokens_per_s is not None and top.peak_bytes is not None:
        line = (f"planned step {top.step_s:.2f} s, {top.tokens_per_s:,.0f} tokens/s, memory peak "
                f"{top.peak_bytes / 2 ** 30:.1f} GiB")
        if old_step:
            line += (f": {1 - top.tokens_per_s / old_step[1]:.1%} of the throughput lost (the {world}-GPU plan: "
                     f"step {old_step[0]:.2f} s, {old_step[1]:,.0f} tokens/s)")
        notes.append(line)
    if left > top.gpus:
        notes.append(_idle_text(top.gpus, left, gpus_per_node))
    others = [p for p in ranked[1:] if p.keeps_global_batch]
    if others:
        notes.append(f"runner-up: {others[0].summary()}")
    elif smaller:
        notes.append(f"runner-up: none (the next, {smaller[0]})")
    else:
        notes.append("runner-up: none (no other data-parallel degree keeps the global batch"
                     + (f" and ep {mesh.ep} x etp {mesh.etp} valid)" if mesh.ep * mesh.etp > 1 else ")"))
    alt = [p for p in ranked if not p.keeps_global_batch and p is not top]
    if alt:
        notes.append(f"with a different global batch (changes the optimisation): {alt[0].summary()}")
    return notes


def _idle_text(used: int, left: int, gpus_per_node: int) -> str:
    """Which GPUs a mesh of ``used`` ranks leaves idle on ``left`` GPUs (node-major ranks:
    rank r on node r // gpus_per_node of the nodes left).

    >>> _idle_text(1024, 2040, 8)  # doctest: +NORMALIZE_WHITESPACE
    '1016 of the 2040 GPUs left sit idle (spares for the next failure): the mesh takes nodes 0-127
    of the 255 nodes left (node-major); idle: nodes 128-254'
    >>> _idle_text(12, 24, 8)  # doctest: +NORMALIZE_WHITESPACE
    '12 of the 24 GPUs left sit idle (spares for the next failure): the mesh takes node 0 and GPUs
    0-3 of node 1 of the 3 nodes left (node-major); idle: GPUs 4-7 of node 1 and node 2'
    """
    nodes, full, part = -(-left // gpus_per_node), used // gpus_per_node, used % gpus_per_node
    span = lambda a, b: f"node {a}" if a == b else f"nodes {a}-{b}"
    took = ([span(0, full - 1)] if full else []) + ([f"GPUs 0-{part - 1} of node {full}"] if part else [])
    first_idle = full + (1 if part else 0)
    idle = ([f"GPUs {part}-{gpus_per_node - 1} of node {full}"] if part else []) + (
        [span(first_idle, nodes - 1)] if first_idle < nodes else [])
    return (f"{left - used} of the {left} GPUs left sit idle (spares for the next failure): the mesh takes "
            f"{' and '.join(took)} of the {nodes} nodes left (node-major); idle: {' and '.join(idle)}")


def _batch_notes(top: Proposal, as_configured: str) -> list[str]:
    """The proposal's batch arithmetic and what its contract change means (``as_configured``:
    why its data-parallel degree breaks the contract as configured)."""
    line = (f"global batch {top.global_batch} = micro_batch {top.micro_batch} x dp {top.dp} x "
            f"{counted(top.micro_batches, 'micro-batch')}")
    if top.contract.startswith("global_batch"):
        line += (f" ({top.contract}: as configured, {as_configured}; no mesh of these GPUs keeps the global batch, "
                 "a different one changes the optimisation)")
    elif top.contract:
        line += f" ({top.contract}: the global batch is kept)"
    return [line]


def _state_notes(changed, old_dp: int, new_dp: int, dataloader_state: str):
    """(checkpoint reshards, data-loader state loads, notes)."""
    reshard = any(n != "dp_replicate" for n in changed)
    notes = ["checkpoint: " + ("sharded state changes layout; DCP (torch.distributed.checkpoint) and Megatron "
                               "dist-checkpointing reshard it on load" if reshard else
                               "replicas hold identical shards: load without resharding")]
    ok = dataloader_state == "global" or new_dp == old_dp
    if dataloader_state == "global":
        notes.append("data loader: a global consumed-samples counter rebuilds each rank's position")
    elif ok:
        notes.append("data loader: per-rank state loads unchanged (same dp)")
    else:
        notes.append(f"data loader: per-rank state saved at dp {old_dp} cannot be resharded to dp {new_dp}: loading "
                     f"it must raise, never drop or repeat samples; restart from a global sample index")
    return reshard, ok, notes


def plan_evaluator(plan, nodes_left: int) -> Evaluator:
    """Plans a proposal on ``nodes_left`` nodes: ``plan``'s config with the proposal's mesh
    (``mesh.world`` = its GPUs, node-major), micro_batch and global_batch; its step and
    throughput (:func:`~meshplan.schedule.steptime.step_time`, default overlap, as the search
    ranks) and peak, or the plan's reasons (memory) when it cannot run."""
    cfg = plan.config

    def evaluate(p: Proposal) -> Union[Proposal, str]:
        names = list(p.names) + [a for a, d in (("ep", p.ep), ("etp", p.etp)) if d > 1]
        mesh = cfg.mesh.model_copy(update={"names": names, "shape": list(p.shape) + [d for d in (p.ep, p.etp) if d > 1],
                                           "order": None, "degrees": None, "world": p.gpus, "rank_to_gpu": None})
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
