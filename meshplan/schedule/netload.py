"""Network load of a stage's node (:func:`network_loads`): what its NICs send and what its
leaf's rail uplinks carry to the spine, the ring hops :mod:`meshplan.placement.spine` says
cross it (the rule ``place`` counts too). Split from :mod:`meshplan.schedule.linkload`, which
builds the edge-load table from it."""

from __future__ import annotations

import numpy as np

from meshplan.errors import ConfigError
from meshplan.comm.row import link_bytes
from meshplan.placement.spine import PXN_SOURCE, aligned_share, exit_crosses, leaf_of, pair_crosses, pxn
from meshplan.spec.axes.cp import send_step


def pxn_line(plan, rows) -> list[str]:
    """The edge-load table's line on PXN (:func:`pxn`) where ``rows`` (a stage's collective table) hold an
    all-to-all over the network other than DeepEP's: how its sends were routed; none otherwise."""
    if not pxn(plan.config.cluster) or not any(r.op == "all-to-all" and r.path.kind == "network"
                                               and r.algorithm != "deepep" for r in rows):
        return []
    return ["  all-to-all across nodes routed as NCCL's PXN does (NCCL_PXN_DISABLE=0 and NCCL_P2P_PXN_LEVEL=2, its "
            f"defaults: {PXN_SOURCE.split(', ')[0]}): each send relayed over NVLink to the GPU by the NIC on the "
            "peer's rail and sent on that rail, so it reaches the spine only between scalable units"]


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
    on another rail or leaf (:func:`_spine_share`), or under NCCL's PXN (:func:`pxn`, the default on an
    NVLink node) on another leaf only, each sent through the NIC on the peer's rail; of DeepEP's dispatch (algorithm ``deepep``) each
    member's RDMA sends to the same-index member of the other nodes, rail-aligned
    (:func:`~meshplan.placement.spine.aligned_share`)."""
    mesh, p, cluster = plan.mesh, plan.placement, plan.config.cluster
    mine = leaf_nodes(cluster, node)
    nics: dict[int, list[float]] = {}
    uplink: dict[int, list[float]] = {}
    axis_name = {mesh.display_name(a): a for a in mesh.all_axes() + ["fsdp", "loss"] if _has(mesh, a)}
    pp = stage_of_ranks(mesh)
    tables = [(stage, rows, passes)] + [(k, r, n) for k, (r, n) in (others or {}).items() if k != stage]
    seen: dict = {}  # (stage, axis, op, deepep, group, send direction) -> its _geometry
    for s, table, n in tables:
        ranks = None if s is None else pp == s
        for r in table:
            if r.path.kind != "network" or r.axis not in axis_name:
                continue
            groups = mesh.groups(axis_name[r.axis])
            on = np.isin(p.node[groups], mine) & (True if ranks is None else ranks[groups])
            for g in np.flatnonzero(on.any(axis=1)).tolist():
                # a stage's rows share their groups' geometry (a send/recv's: per direction round the ring)
                key = (s, r.axis, r.op, r.algorithm == "deepep", g, send_step(r) if r.op == "send/recv" else 0)
                if key not in seen:
                    seen[key] = _geometry(p, r, groups[g], mine, None if ranks is None else ranks[groups[g]])
                _group_loads(p, r, seen[key], n, node, nics, uplink)
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


def _geometry(p, r, group, mine, counted=None) -> tuple[int, list]:
    """Where one group of row ``r`` sends from the nodes ``mine`` (:func:`_group_loads`): (its
    number of nodes, per node of it there (node, the NICs of its members running ``r``, their
    send/recv crossing shares (:func:`_p2p_cross`; None for other ops), the group's members on the
    node, the share of its sends that goes up to the spine)). The same for every row of one op on
    one axis of the group (``r.op``, ``r.axis`` and whether ``r.algorithm`` is DeepEP's decide it);
    ``counted``: which members run ``r`` (its stage's; None: all)."""
    gn = p.node[group]
    n_nodes = len(np.unique(gn))
    ring = None if r.op == "all-to-all" else dict(zip(_ring_domains(p, group), _exits(p, r, group)))
    leaf = leaf_of(p.cluster, gn)
    mask = np.isin(gn, mine) & (True if counted is None else counted)
    out = []
    for nd in np.unique(gn[mask]):
        idx = np.flatnonzero((gn == nd) & (True if counted is None else counted))
        members = group[idx]
        relay = ring is None and r.algorithm != "deepep" and pxn(p.cluster)  # PXN: the peer's rail (PXN_SOURCE)
        rails = np.zeros_like(group) if relay else p.rail[group]
        up = (aligned_share(p, group, int(nd)) if r.algorithm == "deepep"  # RDMA to the same-index GPU
              else _spine_share(r.op, gn, rails, int(nd), leaf) if ring is None
              else float(ring.get(int(p.domain[members[0]]), False)))
        cross = _p2p_cross(gn, idx, r.axis == "pp", send_step(r)).tolist() if r.op == "send/recv" else None
        via = _relay_nics(p, group[gn != nd]) if relay else None
        out.append((int(nd), p.nic[members].tolist(), cross, int((gn == nd).sum()), up, via))
    return n_nodes, out


def _relay_nics(p, peers) -> list[int]:
    """The NICs of a node that PXN sends an all-to-all through to ``peers`` (ranks on other nodes): those
    on the peers' rails (:data:`PXN_SOURCE`), the node's bytes split evenly over them."""
    rails = {int(x) for x in p.rail[peers] if x >= 0}
    return [i for i, n in enumerate(p.cluster.node.nics) if n.rail in rails]


def _group_loads(p, r, geometry, passes, node, nics, uplink) -> None:
    """Add one group's traffic of row ``r`` to ``node``'s NICs and to the uplinks of the leaf
    holding the nodes its ``geometry`` (:func:`_geometry`) was taken on: what each of the
    group's nodes there sends out per call (link_bytes: one rank's ring bytes for a ring, each
    member's off-node share for all-to-all), split over the NICs its members use; a send/recv's
    each member's own crossing messages on its own NIC (:func:`_p2p_cross`)."""
    n_nodes, at = geometry
    for nd, nic, cross, here, up, via in at:
        for i, per_call in _nic_bytes(r, nic, cross, here, n_nodes, via).items():
            share = [per_call * r.per_step, per_call * layer_pass_calls(r, passes)]
            if nd == node:
                _acc(nics, i, share)
            if up:
                _acc(uplink, p.cluster.node.nics[i].rail, [up * x for x in share])


def _nic_bytes(r, nic: list, cross, here: int, n_nodes: int, via=None) -> dict[int, float]:
    """{NIC: bytes per call of row ``r``} that the members of one node running it (their NICs
    ``nic``; ``here`` of the group's members on the node) send out: a send/recv's crossing
    messages (``cross``, :func:`_p2p_cross`) each through its member's own NIC (NCCL's
    point-to-point goes through the GPU's nearest NIC), any other row's node bytes
    (:func:`~meshplan.comm.row.link_bytes`) split evenly over the NICs the members use, or over
    ``via`` where given (an all-to-all under PXN: the NICs on the peers' rails, :func:`_relay_nics`)."""
    if r.op == "send/recv" and r.split is None:
        out: dict[int, float] = {}
        for i, c in zip(nic, cross):
            if i >= 0 and c:
                out[i] = out.get(i, 0.0) + c * r.size_bytes
        return out
    off = r.split[1] if r.split is not None else (  # a row's own split: DeepEP's dispatch
        link_bytes(r.op, r.algorithm, r.group_size, r.size_bytes, n_nodes, here)[1])
    used = sorted({int(x) for x in (nic if via is None else via) if x >= 0})
    return {i: len(nic) * off / len(used) for i in used}


def _p2p_cross(gn, idx, chain: bool, step: int = 1) -> np.ndarray:
    """Per member at positions ``idx`` of a group whose members sit on nodes ``gn`` (group order):
    the share of its send/recv calls whose peer is on another node, each call moving its bytes
    once on the link between the two. A cp ring's sends (``chain`` False): each call sends to the
    member ``step`` places on round the ring (:func:`~meshplan.spec.axes.cp.send_step`: the next one, or
    the previous one in Transformer Engine's p2p backward), 1 where that one is on another node. A pipeline's
    (``chain``): its calls are the sends to the next stage and the receives from the previous
    one (the row counts both; backward the reverse), the crossing neighbours of the member over
    its neighbours (the sender's NIC carries the message out, the receiver's in).

    pp 4, stages 0,1 on node 0 and 2,3 on node 1: stage 1 sends to 2 across, receives from 0
    inside; a cp ring of 4 on the same nodes: ranks 1 and 3 send across (3 -> 0 round the ring).

    >>> gn = np.array([0, 0, 1, 1])
    >>> _p2p_cross(gn, np.arange(4), chain=True).tolist(), _p2p_cross(gn, np.arange(4), chain=False).tolist()
    ([0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 1.0])
    >>> _p2p_cross(gn, np.arange(4), False, step=-1).tolist()  # the other way round: ranks 0 and 2 send across
    [1.0, 0.0, 1.0, 0.0]
    """
    n = len(gn)
    if not chain:
        return (gn[(idx + step) % n] != gn[idx]).astype(float)
    out = np.zeros(len(idx))
    for k, i in enumerate(idx.tolist()):
        peers = [j for j in (i - 1, i + 1) if 0 <= j < n]
        out[k] = sum(int(gn[j] != gn[i]) for j in peers) / max(len(peers), 1)
    return out


def _exits(p, row, group) -> np.ndarray:
    """:func:`~meshplan.placement.spine.exit_crosses` of ``group`` for collective-table ``row``; a
    pipeline's send/recv runs along a chain of stages, not a ring: no hop from the last stage
    back to the first (the cp ring's dK/dV shift does wrap: rank cp - 1 sends to rank 0)."""
    out = exit_crosses(p, group)
    if row.op == "send/recv" and row.axis == "pp" and len(out):
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
