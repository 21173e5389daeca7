"""Placement choice: the rank -> GPU permutation that keeps weak-path traffic smallest.

The seed's rule ("Map logical groups to physical domains"): groups that talk inside every
layer (tp, cp, sp, ep, etp) go in the smallest fast domain that holds them; data and shard
groups that cross nodes sit on corresponding local positions, so on one NIC rail; each GPU
uses a NIC under its own PCIe switch. The rule is conditional (seed, knowledge check): it
assumes NVLink faster than the NICs, enough local GPUs for the tensor degree, and no other
fabric hierarchy. :func:`choose_placement` builds candidates constructively (fill the fast
domain innermost-first with the heaviest axes, splitting the axis that straddles it), scores
each by :func:`~meshplan.placement.score.weak_bytes` on the placement it gives
(:func:`meshplan.placement.assign.place`) and explains the result (:mod:`meshplan.placement.explain`).

Worked example (the seed's 8 x 8 cluster, mesh given in the bad order, tp outermost):

>>> from meshplan.catalog import system
>>> from meshplan.mesh.resolve import resolve_mesh
>>> from meshplan.spec.mesh import MeshSpec
>>> mesh = resolve_mesh(MeshSpec(names=["tp", "dp_shard"], shape=[8, 8]), world=64)
>>> c = choose_placement(mesh, system("seed-8x8-2nic", 8), weights={"tp": 1000.0, "dp_shard": 10.0})
>>> c.before.network_bytes, c.after.network_bytes    # 64 inter-node ring hops x weight
(64000.0, 640.0)
>>> c.rank_to_gpu[:3].tolist(), c.equivalent_names  # rank 1 (tp 0, dp_shard 1) -> node 1
([0, 8, 16], ('dp_shard', 'tp'))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from math import gcd
from typing import Callable, Iterable, Mapping, Optional

import numpy as np

from meshplan.mesh.resolve import Mesh
from meshplan.placement.assign import Placement, place
from meshplan.placement.bindings import all_bindings, bindings, write_bindings  # noqa: F401  (re-exported)
from meshplan.placement.explain import choose_hint, explain
from meshplan.placement.score import Score, default_weights, scored_axes, weak_bytes
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.mesh import Schedule
from meshplan.spec.search import TIE

#: Fill orders tried exhaustively up to this many non-trivial axes (5! = 120 candidates).
MAX_PERMUTED_AXES = 5


# --------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Factor:
    """One physical level: ``degree`` of mesh axis ``axis``; ``part`` "" (the whole axis),
    "in" (its inner factor, coordinate % degree) or "out" (coordinate // inner degree)."""

    axis: str
    degree: int
    part: str = ""

    def __str__(self) -> str:
        return f"{self.axis} {self.degree}" + {"": "", "in": " (inner part)", "out": " (outer part)"}[self.part]


def fill(mesh: Mesh, order: Iterable[str], capacity: int) -> tuple[list[Factor], list[Factor]]:
    """Inner (inside one fast domain) and outer factors, innermost first, when the axes of
    ``order`` (heaviest first) fill a domain of ``capacity`` GPUs: an axis whose degree
    divides the room left goes inside; one that does not is split into gcd(degree, room)
    inside and the rest outside (tp 16 in 8 GPUs: 8 inside x 2 across); else outside."""
    inner, outer, room = [], [], capacity
    for a in order:
        d = mesh.layout.degree(a)
        f = gcd(d, room)
        if f == d:
            inner.append(Factor(a, d))
        elif f > 1:
            inner.append(Factor(a, f, "in"))
            outer.append(Factor(a, d // f, "out"))
        else:
            outer.append(Factor(a, d))
        room //= f
    return inner, outer


def slot_gpus(cluster: ClusterSpec, world: int) -> np.ndarray:
    """Global GPU of each dense slot 0..world-1: node-major, and inside a node the local GPUs
    sorted by (socket, NIC, index) so that contiguous slots share a socket and a NIC
    (identity on every catalog node)."""
    node = cluster.node
    order = np.array(sorted(range(node.gpus), key=lambda g: (node.socket_of(g), node.nic_of(g) or 0, g)))
    s = np.arange(world)
    return (s // node.gpus) * node.gpus + order[s % node.gpus]


def rank_to_slot(mesh: Mesh, inner: list[Factor], outer: list[Factor]) -> np.ndarray:
    """Dense slot of each rank when the physical order, outermost first, is trivial axes,
    then ``outer`` reversed, then ``inner`` reversed (the first inner factor is fastest)."""
    lay = mesh.layout
    split = {f.axis: f.degree for f in inner if f.part == "in"}
    dims, shape = [], []
    for a, d in zip(lay.names, lay.shape):
        if a in split:
            dims += [(a, "out"), (a, "in")]
            shape += [d // split[a], split[a]]
        else:
            dims.append((a, ""))
            shape.append(d)
    phys = [(f.axis, f.part) for f in reversed(outer)] + [(f.axis, f.part) for f in reversed(inner)]
    phys = [x for x in dims if x not in phys] + phys
    slot_rank = lay.grid().reshape(shape).transpose([dims.index(x) for x in phys]).reshape(-1)
    out = np.empty(lay.world, dtype=np.int64)
    out[slot_rank] = np.arange(lay.world)
    return out


def ordering_weights(mesh: Mesh, weights: Mapping[str, float]) -> dict[str, float]:
    """Weight of each mesh axis for the fill order: its own weight plus that of every
    derived or expert axis whose groups vary along it (ep 8 on a dp_shard 8 block adds to
    dp_shard)."""
    lay = mesh.layout
    out = {a: 0.0 for a in lay.names}
    for axis, w in weights.items():
        if axis in out:
            out[axis] += w
            continue
        coords = np.unravel_index(mesh.groups(axis)[0], lay.shape)
        for a, c in zip(lay.names, coords):
            out[a] += w if np.unique(c).size > 1 else 0.0
    return out


def fill_orders(mesh: Mesh, weights: Mapping[str, float]) -> list[tuple[str, ...]]:
    """Fill orders to try, heaviest first: the weight order (ties: the mesh's innermost
    axis first), then every other permutation of the non-trivial axes when there are at
    most :data:`MAX_PERMUTED_AXES`, else the weight order's adjacent swaps."""
    lay = mesh.layout
    ow = ordering_weights(mesh, weights)
    axes = [a for a in reversed(lay.names) if lay.degree(a) > 1]
    first = tuple(sorted(axes, key=lambda a: -ow[a]))
    if len(axes) <= MAX_PERMUTED_AXES:
        rest = list(itertools.permutations(first))
    else:
        rest = [first[:i] + (first[i + 1], first[i]) + first[i + 2:] for i in range(len(first) - 1)]
    return [first] + [o for o in rest if o != first]


# --------------------------------------------------------------------------- choice


@dataclass(frozen=True, eq=False)
class Choice:
    """Result of :func:`choose_placement`. ``rank_to_gpu``: global GPU of each rank (apply
    it with torchrun's node-major RANK = global GPU and a DeviceMesh built from
    ``rank_to_gpu.reshape(shape)``, or with ``equivalent_names`` when that is not None);
    ``before``: the given placement's score, ``after``: the chosen one's; ``inner`` /
    ``outer``: the chosen physical levels innermost first (empty when the given placement
    was kept); ``searched``: False when only the given placement was scored;
    ``step_before_s`` / ``step_after_s``: the predicted step of the given and the chosen
    placement when the choice was scored by the step-time model (None otherwise);
    ``decisions`` and ``warnings``: one line each; ``schedule`` and ``vpp``: the plan's
    pipeline schedule and chunks per rank (the pp line counts the schedule's own boundary
    crossings per micro-batch); ``labels``: {axis: printed} for the axes the plan prints under
    another name (``efsdp`` as ``edp``, :func:`meshplan.spec.wording.expert_data_axis`), which the
    decisions, warnings and ``place``'s axis rows print."""

    mesh: Mesh
    rank_to_gpu: np.ndarray
    placement: Placement
    before: Score
    after: Score
    weights: dict[str, float]
    weights_source: str
    changed: bool
    searched: bool = True
    inner: tuple[Factor, ...] = ()
    outer: tuple[Factor, ...] = ()
    equivalent_names: Optional[tuple[str, ...]] = None
    step_before_s: Optional[float] = None
    step_after_s: Optional[float] = None
    decisions: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    schedule: Schedule = Schedule.ONE_F_ONE_B
    vpp: int = 1
    labels: Mapping[str, str] = field(default_factory=dict)


def for_command(c: Choice, command: str) -> Choice:
    """``c`` with its warnings' fix naming ``command``'s own ``--choose``
    (:func:`~meshplan.placement.explain.choose_hint`): ``meshplan launch --choose`` binds the
    permutation ``place --choose`` finds, so a launch's warnings (printed and ``--json``) point
    at the command the user ran."""
    hint = (choose_hint(), choose_hint(command))
    return replace(c, warnings=tuple(w.replace(*hint) for w in c.warnings))


def _equivalent_names(mesh: Mesh, inner, outer, r2g: np.ndarray) -> Optional[tuple[str, ...]]:
    """Mesh names in physical order when the permutation is a plain reordering of the axes
    (no split, node-major slots): the same mesh, listed outermost first."""
    phys = [(f.axis, f.part) for f in reversed(outer)] + [(f.axis, f.part) for f in reversed(inner)]
    for i in range(len(phys) - 1, 0, -1):  # an axis split as (out, in) next to each other is whole
        if phys[i][1] == "in" and phys[i - 1] == (phys[i][0], "out"):
            phys[i - 1:i + 1] = [(phys[i][0], "")]
    if any(part for _, part in phys):
        return None
    lay = mesh.layout
    axes = [a for a, _ in phys]
    names = tuple([a for a in lay.names if a not in axes] + axes)
    perm = [lay.names.index(a) for a in names]
    return names if np.array_equal(lay.grid().transpose(perm).reshape(-1), np.argsort(r2g)) else None


def _best(mesh: Mesh, cluster: ClusterSpec, w, current, before, step_s, t_before) -> tuple[tuple, Optional[float]]:
    """((weak-path bytes, placement, rank -> GPU, inner axes, outer axes) of the best candidate,
    its step seconds or None without ``step_s``): over each fill order's distinct placement
    (:func:`fill_orders`, :func:`fill`, :func:`slot_gpus`), the fewest weak-path bytes; with
    ``step_s``, the shortest step among those shorter than the given placement's (``t_before``)
    by more than :data:`~meshplan.spec.search.TIE` (at an equal step, the fewer bytes); the given
    placement ``current`` (``before`` its bytes) where none is."""
    world = mesh.world
    best: tuple = (before, current, np.asarray(current.global_gpu), [], [])
    t_best = t_before
    capacity = min(cluster.node.nvlink_domain_gpus or cluster.node.gpus, world)
    slots, seen = slot_gpus(cluster, world), {current.global_gpu.tobytes()}
    for order in fill_orders(mesh, w):
        inner, outer = fill(mesh, order, capacity)
        r2g = slots[rank_to_slot(mesh, inner, outer)]
        if r2g.tobytes() in seen:
            continue
        seen.add(r2g.tobytes())
        p = place(cluster, world, r2g)
        score = weak_bytes(mesh, p, w)
        if step_s is None:
            if score.total < best[0].total * (1 - 1e-9):
                best = (score, p, r2g, inner, outer)
            continue
        t = step_s(r2g)
        if t_before is not None and t >= t_before * (1 - TIE):
            continue  # within the tie band of the given placement: no gain the model can tell
        if best[1] is current or t_best is None or t < t_best or (t == t_best and score.total < best[0].total * (1 - 1e-9)):
            best, t_best = (score, p, r2g, inner, outer), t
    return best, t_best


def choose_placement(mesh: Mesh, cluster: ClusterSpec, weights: Optional[Mapping[str, float]] = None,
                     rank_to_gpu=None, search: bool = True, source: str = "given",
                     step_s: Optional[Callable[[np.ndarray], float]] = None,
                     schedule: Schedule | str = Schedule.ONE_F_ONE_B, vpp: int = 1,
                     labels: Optional[Mapping[str, str]] = None) -> Choice:
    """Choose the rank -> GPU permutation with the fewest weak-path bytes (:func:`weak_bytes`),
    or, with ``step_s``, the shortest predicted step.

    ``step_s(rank_to_gpu) -> seconds``: the caller's step-time model
    (:func:`meshplan.schedule.placement_score.step_scorer`; placement/ is an earlier layer
    and never imports it). With it a candidate counts only when its step is shorter than the
    given placement's by more than :data:`~meshplan.spec.search.TIE` (1%, below the model's
    error: a smaller predicted gain decides nothing), and among those the shortest wins (at an
    equal step, the fewer weak-path bytes): the choice is never slower than the given placement
    by the model, and the given placement is kept when no candidate beats it by that much
    (tensor groups leave the fast domain only for a gain the model can tell).

    ``weights``: bytes per step per rank by axis (:func:`~meshplan.placement.score.weights_from_table`),
    default the frequency order :data:`~meshplan.placement.score.DEFAULT_WEIGHTS`; ``source`` names where given weights come from.
    ``schedule``, ``vpp``: the pipeline schedule and chunks per rank (the explanation's pp line);
    ``labels``: {axis: printed} for the axes output names otherwise (the plan's words).
    ``rank_to_gpu``: the placement to compare with
    and keep on a tie (default node-major); ``search=False`` only scores and explains it.
    Candidates: for each fill order
    (:func:`fill_orders`), :func:`fill` the NVLink domain (or node) and pack densely
    (:func:`slot_gpus`). Each rank's NIC is the one :meth:`NodeSpec.nic_of` gives its GPU.
    Raises ConfigError if the mesh does not fit the cluster.
    """
    given = weights is not None
    w = scored_axes(mesh, weights if weights is not None else default_weights(mesh))
    world = mesh.world
    current = place(cluster, world, rank_to_gpu)
    before = weak_bytes(mesh, current, w)
    t_before = step_s(np.asarray(current.global_gpu)) if step_s is not None else None
    best, t_best = _best(mesh, cluster, w, current, before, step_s, t_before) if search else \
        ((before, current, np.asarray(current.global_gpu), [], []), t_before)
    after, p, r2g, inner, outer = best
    changed = p is not current
    choice = Choice(mesh=mesh, rank_to_gpu=r2g, placement=p, before=before, after=after, weights=w,
                    weights_source=source if given else "default", changed=changed, searched=search,
                    inner=tuple(inner), outer=tuple(outer), step_before_s=t_before, step_after_s=t_best,
                    equivalent_names=_equivalent_names(mesh, inner, outer, r2g) if changed else None,
                    schedule=Schedule(schedule), vpp=vpp, labels=dict(labels or {}))
    decisions, warnings = explain(choice)
    return replace(choice, decisions=tuple(decisions), warnings=tuple(warnings))
