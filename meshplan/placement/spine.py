"""Which ring hops of a group cross the spine: the one home of that rule, for ``place``'s
weak-path bytes (:func:`meshplan.placement.score.weak_bytes`) and ``step``'s rail uplinks
(:func:`meshplan.schedule.linkload.network_loads`).

NCCL orders a ring by rank: inside the communicator consecutive ranks, one NVLink domain after
the other (NCCL ``graph/rings.cc``: a multi-node ring enters and leaves each node once per
channel), and back from the last domain to the first. Of a group over N domains only its N hops
between domains use the network, each carrying one rank's ring bytes
(:func:`meshplan.comm.row.link_bytes`). In a rail-optimized fabric (NVIDIA DGX SuperPOD
RA-11333-001: NIC k of every node on its scalable unit's leaf k) a hop stays under one leaf
when both domains sit in the same scalable unit (``network[0].nodes_per_domain`` nodes; 0 = all)
and hold their members on the same rails (NCCL keeps a channel on one NIC rail,
``NCCL_CROSS_NIC``); otherwise it goes up its rail's leaf to the spine and down again.

Llama-3-70B, dp_shard 256 x tp 8 on 256 dgx-h100 (SUs of 32 nodes): a dp_shard group has one
member per node, all on one rail; its ring 0 -> 1 -> ... -> 255 -> 0 crosses the spine only
at 31 -> 32, 63 -> 64, ..., 255 -> 0: 8 of its 256 hops.

>>> import numpy as np
>>> from types import SimpleNamespace as P
>>> p = P(domain=np.arange(4), node=np.arange(4), rail=np.zeros(4, int),
...       cluster=P(network=[P(nodes_per_domain=2)]))
>>> exit_crosses(p, np.arange(4)).tolist()   # 0 -> 1 stays, 1 -> 2 and 3 -> 0 leave the SU
[False, True, False, True]
"""

from __future__ import annotations

import numpy as np


#: NCCL's PXN for point-to-point sends (an all-to-all is one send/recv per peer): NVIDIA/nccl 5067397
#: ``src/graph/search.cc``:1398-1470 (``ncclTopoGetNetDev``): with ``NCCL_PXN_DISABLE`` 0 (its default,
#: ``src/graph/paths.cc``:668) and ``NCCL_P2P_PXN_LEVEL`` 2 (its default, "use PXN as much as possible"),
#: a send to a peer leaves through the NIC local to the GPU of the peer's local index on the sender's node,
#: relayed to that GPU over NVLink (the proxy rank), when that GPU reaches the NIC over PCIe with GPUDirect
#: RDMA and the sender over NVLink. On a rail-optimized fabric the NIC of the peer's local index is on
#: the peer's rail, so every cross-node send stays on one rail: it crosses the spine only between scalable
#: units. Applied where the node's GPUs share an NVLink fabric (``fabric.name`` nvlink...). The relay's
#: NVLink copy (a send to another rail's peer crosses NVLink once more) is not added to the NVLink edge.
PXN_SOURCE = "NVIDIA/nccl 5067397 src/graph/search.cc:1398-1470, src/graph/paths.cc:668 (NCCL_PXN_DISABLE=0)"


def pxn(cluster) -> bool:
    """Whether NCCL's PXN routes ``cluster``'s cross-node sends (:data:`PXN_SOURCE`): its node's GPUs on
    an NVLink fabric with NICs."""
    node = cluster.node
    return bool(node.nics) and node.fabric.name.startswith("nvlink")


def leaf_of(cluster, node: np.ndarray) -> np.ndarray:
    """Scalable unit (leaf) of each node index: ``node // nodes_per_domain`` of the innermost
    network tier, 0 for every node when the leaf holds all (0) or there is no network."""
    per = cluster.network[0].nodes_per_domain if cluster.network else 0
    return np.asarray(node) // per if per else np.zeros_like(np.asarray(node))


def exit_crosses(p, group: np.ndarray, rails: bool = True) -> np.ndarray:
    """Per NVLink domain of ``group`` (ranks, in rank order), in ring order (first appearance):
    whether the ring hop leaving it for the next domain crosses the spine (another leaf, or
    another set of rails: members without a NIC count as rail -1; ``rails`` False: another leaf
    only, an all-to-all under :func:`pxn`). Shape (domains,); all False for a group inside one domain."""
    _, first, inv = np.unique(p.domain[group], return_index=True, return_inverse=True)
    n = len(first)
    if n < 2:
        return np.zeros(n, dtype=bool)
    ring = np.argsort(first)  # ring position -> distinct domain (ascending id)
    pos = np.empty(n, dtype=np.int64)
    pos[ring] = np.arange(n)  # distinct domain -> ring position
    mask = np.zeros(n, dtype=np.int64)  # the rails of each domain's members, one bit each
    np.bitwise_or.at(mask, pos[inv.reshape(-1)], np.left_shift(1, p.rail[group].astype(np.int64) + 1))
    leaf = leaf_of(p.cluster, p.node[group][first[ring]])
    nxt = np.append(np.arange(1, n), 0)
    return (leaf != leaf[nxt]) | (rails & (mask != mask[nxt]))


def spine_hops(p, groups: np.ndarray, rails: bool = True) -> np.ndarray:
    """Ring hops that cross the spine per group of ``groups`` (n_groups, size): shape (n_groups,).
    Groups inside one NVLink domain have none. ``rails``: as :func:`exit_crosses`."""
    g = np.asarray(groups)
    dom = np.sort(p.domain[g], axis=1)
    multi = (dom[:, 1:] != dom[:, :-1]).any(axis=1) if g.shape[1] > 1 else np.zeros(len(g), bool)
    out = np.zeros(len(g), dtype=np.int64)
    for i in np.flatnonzero(multi):
        out[i] = int(exit_crosses(p, g[i], rails).sum())
    return out


def pair_crosses(rail_a: np.ndarray, leaf_a: np.ndarray, rail_b: np.ndarray, leaf_b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) whether a direct send from each member a to each member b on another node
    crosses the spine (all-to-all's pairwise sends): another rail or another leaf."""
    return (rail_a[:, None] != rail_b[None, :]) | (leaf_a[:, None] != leaf_b[None, :])


def aligned_share(p, group: np.ndarray, home: int) -> float:
    """Share of node ``home``'s DeepEP RDMA sends within ``group`` (ranks, in group order) that
    cross the spine. DeepEP's internode kernels send a token over RDMA to the GPU of the same local
    index on each destination node and forward it there over NVLink (deepseek-ai/DeepEP README,
    "Normal kernels with NVLink and RDMA forwarding"; ``internode.cu``: ``rdma_rank = rank /
    NUM_MAX_NVL_PEERS``, the peer of ``nvl_rank`` i is ``nvl_rank`` i of the other RDMA rank): the
    i-th member of the group on ``home`` sends to the i-th member on each other node, so a pair
    crosses only where those two sit on different rails or leaves (:func:`pair_crosses`); the
    share is over every such (member on ``home``, peer) pair, uniform routing weighing the peers
    alike. 0 where ``home`` holds no member or the group is on one node. Two nodes, two rails,
    the members of node 1 listed rail-swapped: each pair crosses rails.

    >>> from types import SimpleNamespace as P
    >>> p = P(node=np.array([0, 0, 1, 1]), rail=np.array([0, 1, 0, 1]), cluster=P(network=[P(nodes_per_domain=0)]))
    >>> aligned_share(p, np.array([0, 1, 2, 3]), 0), aligned_share(p, np.array([0, 1, 3, 2]), 0)
    (0.0, 1.0)
    """
    node = p.node[group]
    nodes = [int(n) for n in dict.fromkeys(node.tolist())]
    if home not in nodes or len(nodes) < 2:
        return 0.0
    mine = group[node == home]
    leaf = leaf_of(p.cluster, p.node)
    crosses, pairs = 0, 0
    for other in (n for n in nodes if n != home):
        theirs = group[node == other]
        k = min(len(mine), len(theirs))
        a, b = mine[:k], theirs[:k]
        crosses += int(((p.rail[a] != p.rail[b]) | (leaf[a] != leaf[b])).sum())
        pairs += k
    return crosses / pairs if pairs else 0.0
