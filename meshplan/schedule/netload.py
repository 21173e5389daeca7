"""Network load of a stage's node (:func:`network_loads`): what its NICs send and what its
leaf's rail uplinks carry to the spine, the ring hops :mod:`meshplan.placement.spine` says
cross it (the rule ``place`` counts too). Split from :mod:`meshplan.schedule.linkload`, which
builds the edge-load table from it."""

from __future__ import annotations

import numpy as np

from meshplan.errors import ConfigError
from meshplan.comm.row import link_bytes
from meshplan.placement.spine import aligned_share, exit_crosses, leaf_of, pair_crosses


def layer_pass_calls(row, passes: int) -> float:
    """Calls of collective-table ``row`` per layer pass (one layer's forward + backward of one
    micro-batch; ``passes`` = micro-batches x the stage's layers per step): its calls per step
    spread evenly over the passes, ``per_step / passes``. For a row counted per micro-batch
    that is ``per_microbatch / layers``; a row counted per step (FSDP under a pipeline
    schedule: gathers when a pass finds its unit sharded, one reduce-scatter per unit) enters
    with its step average. Rows of the ``step`` phase (after the schedule: optimizer-step
    reductions, ZeRO-1/2's parameter all-gather) run in no layer pass: 0.

    Llama 3 405B, pp 16, stage 0 (7 layers, 16 micro-batches, 112 passes): the FSDP forward
    all-gather, 112 per step (every forward finds its layer resharded), is 1 call per pass;
    the backward all-gather and the reduce-scatter, 7 per step (one per layer), 1/16.

    >>> from types import SimpleNamespace as R
    >>> layer_pass_calls(R(phase="forward", per_step=112), 112), layer_pass_calls(R(phase="backward", per_step=7), 112)
    (1.0, 0.0625)
    >>> layer_pass_calls(R(phase="step", per_step=1), 112)
    0.0
    """
    return 0.0 if row.phase == "step" else row.per_step / max(passes, 1)


def network_loads(plan, rows, passes, node: int = 0, stage: int | None = None, others: dict | None = None):
    """{nic: (bytes/step, bytes/layer pass)} on ``node`` and {rail: ...} going up from the
    leaf (scalable unit) of ``node`` to the spine, all its nodes together (``passes``: layer
    passes per step, :func:`layer_pass_calls`). ``rows`` are pipeline stage ``stage``'s
    collective table, counted for that stage's ranks only (None: every rank, as without a pp
    axis); ``others`` ({stage: (rows, passes)}) adds the other stages' own rows for their ranks,
    so a leaf holding two stages carries each node's traffic under its own stage's table, never
    one stage's rows on another's nodes. What crosses the spine is one rule for ``place``
    and ``step``, :mod:`meshplan.placement.spine`: of a ring (every op but all-to-all) only the
    hops leaving a node of the leaf for another leaf or another set of rails, each carrying the
    node's ring bytes; NCCL's double binary tree is counted as the ring (its tree edges
    between nodes also cross a scalable unit's border about once per unit, NCCL
    ``graph/trees.cc``); of an all-to-all each member's sends to peers on other nodes that sit
    on another rail or leaf (:func:`_spine_share`); of DeepEP's dispatch (algorithm ``deepep``) each
    member's RDMA sends to the same-index member of the other nodes, rail-aligned
    (:func:`~meshplan.placement.spine.aligned_share`)."""
    mesh, p, cluster = plan.mesh, plan.placement, plan.config.cluster
    mine = leaf_nodes(cluster, node)
    nics: dict[int, list[float]] = {}
    uplink: dict[int, list[float]] = {}
    axis_name = {mesh.display_name(a): a for a in mesh.all_axes() + ["fsdp", "loss"] if _has(mesh, a)}
    pp = stage_of_ranks(mesh)
    tables = [(stage, rows, passes)] + [(k, r, n) for k, (r, n) in (others or {}).items() if k != stage]
    seen: dict = {}  # (stage, axis, op, deepep, group) -> its _geometry: a stage's rows share their groups
    for s, table, n in tables:
        ranks = None if s is None else pp == s
        for r in table:
            if r.path.kind != "network" or r.axis not in axis_name:
                continue
            groups = mesh.groups(axis_name[r.axis])
            on = np.isin(p.node[groups], mine) & (True if ranks is None else ranks[groups])
            for g in np.flatnonzero(on.any(axis=1)).tolist():
                key = (s, r.axis, r.op, r.algorithm == "deepep", g)
                if key not in seen:
                    seen[key] = _geometry(p, r, groups[g], mine, None if ranks is None else ranks[groups[g]])
                _group_loads(r, seen[key], n, node, nics, uplink)
    return ({k: tuple(v) for k, v in nics.items()}, {k: tuple(v) for k, v in uplink.items()})


def stage_of_ranks(mesh) -> np.ndarray:
    """The pipeline stage (pp coordinate) of every rank, shape (world,); 0 without a pp axis.

    >>> from types import SimpleNamespace as L
    >>> stage_of_ranks(L(layout=L(names=("pp", "dp"), shape=(2, 3)))).tolist()
    [0, 0, 0, 1, 1, 1]
    """
    names, shape = tuple(mesh.layout.names), tuple(mesh.layout.shape)
    world = int(np.prod(shape))
    if "pp" not in names:
        return np.zeros(world, dtype=np.int64)
    return np.unravel_index(np.arange(world), shape)[names.index("pp")].astype(np.int64)


def leaf_nodes(cluster, node: int) -> np.ndarray:
    """The node indices under ``node``'s leaf (its scalable unit), within the cluster."""
    nodes = np.arange(cluster.nodes)
    return nodes[leaf_of(cluster, nodes) == leaf_of(cluster, np.array([node]))[0]]


def _geometry(p, r, group, mine, counted=None) -> tuple[int, list[tuple[int, int, int, list, float]]]:
    """Where one group of row ``r`` sends from the nodes ``mine`` (:func:`_group_loads`): (its
    nodes, per node of it there (node, members running ``r``, members on it, the NICs those
    use with their rails, the share of its sends that goes up to the spine)). The same for every row of one
    op on the group (``r.op`` and whether ``r.algorithm`` is DeepEP's decide the share);
    ``counted``: which members run ``r`` (its stage's; None: all)."""
    gn = p.node[group]
    n_nodes = len(np.unique(gn))
    ring = None if r.op == "all-to-all" else dict(zip(_ring_domains(p, group), _exits(p, r.op, group)))
    leaf = leaf_of(p.cluster, gn)
    mask = np.isin(gn, mine) & (True if counted is None else counted)
    out = []
    for nd in np.unique(gn[mask]):
        members = group[(gn == nd) & (True if counted is None else counted)]
        used = sorted({int(x) for x in p.nic[members] if x >= 0})
        up = (aligned_share(p, group, int(nd)) if r.algorithm == "deepep"  # RDMA to the same-index GPU
              else _spine_share(r.op, gn, p.rail[group], int(nd), leaf) if ring is None
              else float(ring.get(int(p.domain[members[0]]), False)))
        out.append((int(nd), len(members), int((gn == nd).sum()), [(i, p.cluster.node.nics[i].rail) for i in used], up))
    return n_nodes, out


def _group_loads(r, geometry, passes, node, nics, uplink) -> None:
    """Add one group's traffic of row ``r`` to ``node``'s NICs and to the uplinks of the leaf
    holding the nodes :func:`_geometry` (the group's ``geometry``) was taken on: what each of the
    group's nodes there sends out per call (link_bytes: one rank's ring bytes for a ring, each
    member's off-node share for all-to-all), split over the NICs its members use."""
    n_nodes, at = geometry
    for nd, n_members, here, used, up in at:
        off = r.split[1] if r.split is not None else (  # a row's own split: DeepEP's dispatch
            link_bytes(r.op, r.algorithm, r.group_size, r.size_bytes, n_nodes, here)[1])
        sent = n_members * off
        share = [sent * r.per_step / max(len(used), 1), sent * layer_pass_calls(r, passes) / max(len(used), 1)]
        for i, rail in used:
            if nd == node:
                _acc(nics, i, share)
            if up:
                _acc(uplink, rail, [up * x for x in share])


def _exits(p, op: str, group) -> np.ndarray:
    """:func:`~meshplan.placement.spine.exit_crosses` of ``group``; a pipeline's send/recv runs
    along a chain of stages, not a ring: no hop from the last stage back to the first."""
    out = exit_crosses(p, group)
    if op == "send/recv" and len(out):
        out[-1] = False
    return out


def _ring_domains(p, group) -> list[int]:
    """The group's NVLink domains in ring order (first appearance in rank order), as
    :func:`~meshplan.placement.spine.exit_crosses` lists its hops."""
    dom = p.domain[group]
    _, first = np.unique(dom, return_index=True)
    return [int(d) for d in dom[np.sort(first)]]


def _spine_share(op: str, node: np.ndarray, rail: np.ndarray, home: int = 0, leaf=None) -> float:
    """Share of node ``home``'s all-to-all bytes between nodes that goes up to the spine, from
    the group's members' ``node``, ``rail`` and ``leaf`` (one entry per member; leaf default:
    all under one): all-to-all sends S/n from each member to each peer; the share of (member on
    ``home``, peer on another node) pairs on another rail or leaf
    (:func:`meshplan.placement.spine.pair_crosses`). Rings: :func:`network_loads`.

    >>> _spine_share("all-to-all", np.array([0, 0, 1, 1]), np.array([0, 1, 1, 0]))
    0.5
    >>> _spine_share("all-to-all", np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 0, np.array([0, 0, 1, 1]))
    1.0
    """
    leaf = np.zeros_like(node) if leaf is None else leaf
    at, away = node == home, node != home
    if not at.any() or not away.any():
        return 0.0
    return float(pair_crosses(rail[at], leaf[at], rail[away], leaf[away]).mean())


def _has(mesh, axis) -> bool:
    try:
        return bool(mesh.axes_of(axis)) or axis in ("efsdp", "ep", "etp")
    except ConfigError:  # an axis the mesh does not name (ResolvedMesh.axes_of)
        return axis in ("efsdp", "ep", "etp") and mesh.ep * mesh.etp > 1


def _acc(d: dict, k, share) -> None:
    cur = d.setdefault(k, [0.0, 0.0])
    cur[0] += share[0]
    cur[1] += share[1]
