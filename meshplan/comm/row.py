"""One row of the collective table (:class:`CollectiveRow`): a collective kind on one group
axis in one phase, its payload, counts and dtype, the link class its group crosses
(:class:`Path`, :func:`axis_path`), the NCCL algorithm (ring, tree, NVLS, hierarchical) and
its alpha-beta time there (:func:`path_time`, :func:`meshplan.comm.nccl_algorithms.collective_time`,
on the node's measured nccl-tests curves where the catalog has them), and the bytes it puts
on NVLink and on the network (:func:`link_bytes`).

``size_bytes`` is the full buffer S as nccl-tests prints it (all-gather output,
reduce-scatter input, all-reduce buffer). The rows themselves, technique by technique, are
built by :func:`meshplan.comm.collectives.collective_table`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np

from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.nccl_algorithms import collective_time
from meshplan.comm.nccl_protocols import REFERENCE_STEP_S
from meshplan.mesh.resolve import Mesh
from meshplan.spec.cluster import ClusterSpec


@dataclass(frozen=True)
class Path:
    """Link class a group's collective crosses, the bandwidth each rank gets on it (bytes/s)
    and the per-step latency scale against NCCL's defaults (1 = NCCL's constants). Across
    nodes: ``nodes`` spanned, ``ranks_per_node`` of the group on a node, and
    ``nic_bandwidth_bytes_per_s``, the share of its own NIC a rank gets while every group of
    the axis runs (all-to-all's cross-node bytes leave through it). ``calibrated``: the link
    class carries the user's nccl-tests fit (:func:`meshplan.comm.calibration_apply.apply_calibration`),
    timed as :func:`meshplan.comm.nccl_algorithms.collective_time` says."""

    kind: str  # "local" | "nvlink" | "network"
    bandwidth_bytes_per_s: float
    note: str
    latency_scale: float = 1.0
    nodes: int = 1
    ranks_per_node: int = 0
    nic_bandwidth_bytes_per_s: float = 0.0
    calibrated: bool = False


@dataclass(frozen=True)
class CollectiveRow:
    """One collective kind on one axis in one phase (see :mod:`meshplan.comm.collectives`).
    ``waits``: what compute waits on it; ``depth``: how many compute ops wait on it;
    ``host_s``: host seconds per call that delay the compute's issue (DeepSpeed ZeRO-3's
    list-based calls, :func:`meshplan.comm.deepspeed.host_seconds`; 0 for the others);
    ``copy_s``: GPU seconds per call of FSDP2's copy on the compute stream, the copy-out after
    an all-gather or the copy-in before a reduce-scatter (:mod:`meshplan.comm.fsdp2`: bytes at
    the catalog's BabelStream Triad, never below the issue floor; 0 for the others)."""

    axis: str
    phase: str
    op: str
    group_size: int
    n_groups: int
    example_ranks: tuple[int, ...]
    size_bytes: float
    dtype: str
    per_microbatch: int
    per_step: int
    cadence: str
    path: Path
    time_s: float
    waits: str = ""
    depth: int = 0
    algorithm: str = "ring"
    per_layer: float = 0.0
    host_s: float = 0.0
    copy_s: float = 0.0
    split: Optional[tuple[float, float]] = None

    @property
    def algorithm_shown(self) -> str:
        """The algorithm column of the printed tables: ``p2p`` for a send/recv, which NCCL runs as one
        point-to-point transfer (no ring or tree; its time is still :func:`path_time`'s, whose
        ``algorithm`` names the curve family it was timed on), else :attr:`algorithm`."""
        return "p2p" if self.op == "send/recv" else self.algorithm
    @property
    def algbw_bytes_per_s(self) -> float:
        return self.size_bytes / self.time_s if self.time_s else 0.0

    @property
    def busbw_bytes_per_s(self) -> float:
        """algbw x the op's busbw factor (nccl-tests PERFORMANCE.md); a deepep row's size is already
        the bytes one rank puts on its bottleneck link (its NIC across nodes, :mod:`meshplan.comm.ep_rows`),
        so its busbw is its algbw, comparable to that link's rate."""
        if self.algorithm == "deepep":
            return self.algbw_bytes_per_s
        return self.algbw_bytes_per_s * busbw_factor(self.op, self.group_size)

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends per call: S x busbw factor ((n-1)/n S for all-gather,
        reduce-scatter and all-to-all, 2(n-1)/n S for all-reduce; nccl-tests PERFORMANCE.md); a row
        with its own ``split`` (DeepEP's dispatch) the sum of its NVLink and network bytes."""
        if self.split is not None:
            return float(sum(self.split))
        return self.size_bytes * busbw_factor(self.op, self.group_size)

    @property
    def sent_bytes_per_step(self) -> float:
        """Bytes one rank sends per step on this row: :attr:`sent_bytes` x ``per_step``. The
        one traffic unit of every report (printed in GB, 1e9 B)."""
        return self.sent_bytes * self.per_step

    @property
    def link_bytes(self) -> tuple[float, float]:
        """(NVLink, network) bytes one rank of rank 0's group sends per call: all of
        :attr:`sent_bytes` on the fabric inside a node or NVLink domain, nothing with no
        peers, and across nodes the split of :func:`link_bytes` for the row's algorithm on its
        path's ``nodes`` and ``ranks_per_node``; a row that states its own ``split`` (DeepEP's
        dispatch, :mod:`meshplan.comm.deepep`) gives that."""
        if self.split is not None:
            return self.split
        if self.path.kind == "local":
            return 0.0, 0.0
        if self.path.kind == "nvlink":
            return self.sent_bytes, 0.0
        return link_bytes(self.op, self.algorithm, self.group_size, self.size_bytes, self.path.nodes,
                          self.path.ranks_per_node)


def link_bytes(op: str, algorithm: str, n: int, size_bytes: float, nodes: int,
               ranks_per_node: int) -> tuple[float, float]:
    """(NVLink, network) bytes one rank sends per call of ``op`` on ``size_bytes`` (nccl-tests
    S) over a group of ``n`` ranks spread on ``nodes`` nodes, ``ranks_per_node`` (g) of them
    on each, when ``algorithm`` (the table's choice, :func:`path_time`) runs it. The two
    parts are what the rank puts on its NVLink and what leaves its node through a NIC; a node
    sends g x the network part. With g = 1 (or no node count) every byte crosses the network.

    - ring (every op but all-to-all; NCCL's multi-node rings enter and leave each node once
      per channel, NCCL ``graph/rings.cc``; with one channel per NIC every GPU is the exit of
      one): of the rank's ring bytes ``sent = busbw_factor(op, n) S`` (nccl-tests
      PERFORMANCE.md), ``(g-1)/g`` go to its NVLink neighbour and ``1/g`` through a NIC, so a
      node sends one rank's ring bytes, as each ring edge carries them;
    - hierarchical (:func:`meshplan.comm.nccl_algorithms.collective_time`): inside the node the
      reduce-scatter and/or all-gather over g ranks on S (``(g-1)/g S`` each), across nodes
      the op over the ``nodes`` ranks of the same local index on S/g;
    - tree all-reduce (NCCL's double binary tree: inside a node a chain of g ranks, across
      nodes a tree of chains, each of the two trees on S/2, NCCL ``graph/trees.cc``): each of
      the g - 1 chain hops carries S/2 up and S/2 down per tree, ``2 (g-1)/g S`` per rank on
      NVLink; the N - 1 tree edges between nodes carry S/2 each way per tree, so a node sends
      ``2 (N-1)/N S`` on average, ``2 (N-1)/N S / g`` per rank: the hierarchical all-reduce's
      split;
    - pairwise all-to-all (:func:`meshplan.comm.nccl_algorithms.all_to_all_time`): S/n to each
      peer, ``(g-1)/n S`` to the node's own and ``(n-g)/n S`` through the NIC;
    - send/recv (a pipeline's activations and gradients, the cp ring's dK/dV shift): each call moves
      its S once, from the rank to one peer, on the one link between them: NVLink, or the
      sender's NIC (and the receiver's) when the peer is on another node. With the g members of
      a node consecutive in the group's order (the placement fills a node with consecutive
      coordinates), one of a node's g hops leaves it (a ring's, and a chain's but at its end),
      so a node sends S through a NIC per call, the boundary rank's whole message: per rank
      ``(g-1)/g S`` on NVLink and ``S/g`` on the network, the ring's split with busbw factor 1.
      (Averaging the chain's N - 1 crossing hops over its n - 1 hops instead, ``(N-1)/(n-1) S``
      per rank, left a node sending ``g (N-1)/(n-1) S``, 8/15 S at 2 x 8, where its boundary
      rank's NIC carries S.)

    2 nodes x 8 GPUs, ring all-gather of 16 GB: 15 GB sent, 7/8 on NVLink, 1/8 on the NIC;
    hierarchical: 7/8 x 16 GB inside, (1/2) x 16/8 GB across:

    >>> link_bytes("all-gather", "ring", 16, 16e9, 2, 8)
    (13125000000.0, 1875000000.0)
    >>> link_bytes("all-gather", "hierarchical", 16, 16e9, 2, 8)
    (14000000000.0, 1000000000.0)
    >>> link_bytes("all-reduce", "tree", 16, 16e9, 2, 8)
    (28000000000.0, 2000000000.0)
    >>> link_bytes("all-to-all", "pairwise", 16, 16e9, 2, 8)
    (7000000000.0, 8000000000.0)

    A send/recv of 16 GB between 2 x 8 ranks: 7 of a node's 8 sends on NVLink, one leaves it:

    >>> link_bytes("send/recv", "ring", 16, 16e9, 2, 8)
    (14000000000.0, 2000000000.0)
    """
    sent = size_bytes * busbw_factor(op, n)
    g = min(max(ranks_per_node, 1), n)
    big_n = max(nodes, 1)
    if g <= 1 or big_n <= 1:
        return 0.0, sent
    if algorithm == "pairwise" or op == "all-to-all":
        return (g - 1) / n * size_bytes, (n - g) / n * size_bytes
    if algorithm in ("hierarchical", "tree") and op != "send/recv":  # a send/recv: one message, any curve
        local = {"all-reduce": ("reduce-scatter", "all-gather"), "all-gather": ("all-gather",),
                 "reduce-scatter": ("reduce-scatter",)}.get(op, (op,))
        return (sum(busbw_factor(o, g) for o in local) * size_bytes,
                busbw_factor(op, big_n) * size_bytes / g)
    return sent * (g - 1) / g, sent / g


def axis_path(mesh: Mesh, placement, cluster: ClusterSpec, axis: str) -> Path:
    """Path of ``axis``'s collectives when all its groups run at once (SPMD).

    Inside one node (or NVLink domain): the fabric's per-GPU bandwidth. Across nodes: on
    each node, every group with members there sends its ring traffic out through its
    members' affine NICs; per-rank bandwidth = min(fabric, NIC bandwidth of the NICs used on
    the node / groups leaving the node), taken at node 0. For all-to-all, each rank's own
    NIC share: its NIC's rate / the node-0 ranks of all the axis's groups that use that NIC,
    the smallest over group 0's members on node 0 (the link-load model's per-NIC sharing,
    :func:`meshplan.schedule.linkload.edge_loads`). Latency scales are the link's per-step
    latency over :data:`~meshplan.comm.nccl_protocols.REFERENCE_STEP_S`.
    """
    return groups_path(mesh.groups(axis), placement, cluster)


def groups_path(groups: np.ndarray, placement, cluster: ClusterSpec) -> Path:
    """:func:`axis_path` of any set of rank groups (n_groups, size) that run at once: an
    axis's, or the KV replica groups inside tp (:func:`meshplan.mesh.tpsplit.kv_replica_groups`)."""
    if groups.shape[1] == 1:
        return Path("local", float("inf"), "no peers")
    node = placement.node[groups]
    fabric = cluster.node.fabric
    if (placement.domain[groups] == placement.domain[groups][:, :1]).all():
        return Path("nvlink", fabric.bandwidth_bytes_per_s, fabric.name, fabric.latency_s / REFERENCE_STEP_S["nvlink"],
                    calibrated=fabric.calibrated)
    nics = cluster.node.nics
    tier = cluster.network[0].latency_s / REFERENCE_STEP_S["network"] if cluster.network else 1.0
    calibrated = bool(cluster.network) and cluster.network[0].calibrated
    if not nics:
        return Path("network", cluster.node.pcie.bandwidth_bytes_per_s, "no NIC in catalog: PCIe bound", tier,
                    calibrated=cluster.node.pcie.calibrated)
    n0 = int(node[0, 0])
    on_node = np.flatnonzero((node == n0).any(axis=1))
    members = groups[on_node][node[on_node] == n0]
    used = sorted({int(i) for i in placement.nic[members] if i >= 0})
    nic_bw = sum(nics[i].bandwidth_bytes_per_s for i in used)
    bw = min(fabric.bandwidth_bytes_per_s, nic_bw / len(on_node))
    rails = np.unique(placement.rail[groups[0]])
    users = Counter(int(i) for i in placement.nic[members] if i >= 0)
    own = [int(i) for i in placement.nic[groups[0][node[0] == n0]] if i >= 0]
    share = min((nics[i].bandwidth_bytes_per_s / users[i] for i in own), default=0.0)
    return Path("network", bw, _nic_note(groups[on_node], node[on_node], n0, placement, nics, rails), tier,
                len(np.unique(node[0])), int((node[0] == n0).sum()), share, calibrated)


def _nic_note(groups: np.ndarray, node: np.ndarray, n0: int, placement, nics, rails: np.ndarray) -> str:
    """How the axis's groups on node ``n0`` (rows of ``groups``, group 0 first) use its NICs, per
    group: ``8 group(s) per node, each on its own NIC(s) (group 0: mlx5_0); rails [0]`` where no two
    groups share a NIC, else ``1 group(s) per node on NIC(s) mlx5_0,...: shared by 2 groups``."""
    own = [sorted({int(i) for i in placement.nic[g[nd == n0]] if i >= 0}) for g, nd in zip(groups, node)]
    names = ",".join(nics[i].name for i in own[0])
    sharers = sum(1 for o in own if set(o) & set(own[0]))
    how = (f"on NIC(s) {names}" if len(groups) == 1 else f"each on its own NIC(s) (group 0: {names})"
           if sharers == 1 else
           f"group 0 on NIC(s) {names}, shared by {sharers} groups")
    return f"{len(groups)} group(s) per node, {how}; rails {rails.tolist()}"


def path_time(op: str, n: int, size_bytes: float, path: Path, cluster: ClusterSpec,
              nccl_era: str = "current") -> tuple[str, float]:
    """(algorithm, seconds) of ``op`` over ``n`` ranks on a ``size_bytes`` buffer (nccl-tests
    ``S``) along ``path`` (:func:`axis_path`) of ``cluster``:
    :func:`meshplan.comm.nccl_algorithms.collective_time` with the path's bandwidth, kind, latency
    scale, nodes and NIC share, and the cluster's fabric, library and measured curves. The
    one call behind every table row and the predicted message curves of ``validate``
    (:mod:`meshplan.runtime.validation.staged`). ``nccl_era`` "2021": NCCL 2.8-2.9, the
    library of DeepSpeed ZeRO-3 of 2021, without the hierarchical algorithm."""
    return collective_time(op, n, size_bytes, path.bandwidth_bytes_per_s, path.kind, nvls=cluster.node.fabric.nvls,
                           latency_scale=path.latency_scale, nodes=path.nodes,
                           intra_bandwidth_bytes_per_s=cluster.node.fabric.bandwidth_bytes_per_s,
                           library=cluster.collective_library, curves=cluster.node.busbw,
                           nic_bandwidth_bytes_per_s=path.nic_bandwidth_bytes_per_s,
                           ranks_per_node=path.ranks_per_node, nccl_era=nccl_era, calibrated=path.calibrated)
