"""Placement: which physical GPU, socket, CPU cores, NIC and rail each rank uses, and where
each axis's process groups land on that hardware.

The mesh's coordinates describe logical ownership; "a separate placement map relates each
coordinate to a physical GPU, CPU locality, and network interface" (seed, parallel mesh
design). The checks follow the seed's section "Map logical groups to physical domains":
groups that talk inside every layer (tp, cp, sp, ep, etp) belong in the smallest fast domain,
and data or sharding groups that cross nodes should sit on corresponding local positions, so
on one NIC rail; the findings themselves are :mod:`meshplan.placement.flags`'.

Worked example (C3: 2 nodes x 8 GPUs, ranks node-major, names (pp, dp, tp) = (2, 1, 8)):

>>> from meshplan.spec.cluster import ClusterSpec
>>> link = {"name": "l", "bandwidth_gb_per_s": 450.0, "latency_us": 3.0}
>>> pcie = {"name": "pcie", "bandwidth_gb_per_s": 63.0, "latency_us": 5.7}
>>> node = {"name": "n", "gpus": 8, "fabric": link, "pcie": pcie,
...         "sockets": [{"gpus": [0, 1, 2, 3], "cores": 56}, {"gpus": [4, 5, 6, 7], "cores": 56}],
...         "nics": [{"name": f"mlx5_{g}", "rate_gbit_per_s": 400.0, "gpus": [g],
...                   "socket": g // 4, "rail": g} for g in range(8)]}
>>> gpu = {"name": "g", "peak_tflops": {"bf16": 989.0}, "hbm_gb": 80.0,
...        "hbm_bandwidth_tb_per_s": 3.35, "sms": 132, "source": "-"}
>>> cluster = ClusterSpec(gpu=gpu, node=node, nodes=2)
>>> p = place(cluster, 16)
>>> rank_row(p, 13)
{'rank': 13, 'node': 1, 'gpu': 5, 'socket': 1, 'cores': '70-83', 'nic': 'mlx5_5', 'rail': 5}
>>> from meshplan.mesh.resolve import resolve_mesh
>>> from meshplan.spec.mesh import MeshSpec
>>> mesh = resolve_mesh(MeshSpec(names=["pp", "dp", "tp"], shape=[2, 1, 8]), world=16)
>>> loc = axis_locality(mesh, p)
>>> loc["tp"].link, loc["pp"].link, loc["pp"].rail_aligned
('nvlink', 'network', True)
>>> from meshplan.placement.flags import placement_flags
>>> [f.severity for f in placement_flags(mesh, p)]
['info']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Mesh
from meshplan.spec.cluster import ClusterSpec, NodeSpec
from meshplan.units import counted

#: Axes whose groups communicate inside every layer (seed: "tensor ranks communicate inside
#: each layer"); ``sp`` is the user-named sequence axis (Ulysses-style all-to-all).
PER_LAYER_AXES = ("tp", "cp", "sp", "ep", "etp")
#: Data or sharding axes: the seed's "gradient or sharding collectives".
DATA_AXES = ("dp", "dp_replicate", "dp_shard", "fsdp", "efsdp")
#: Shard axes gather parameters before every layer (FSDP all-gather, reduce-scatter).
SHARD_AXES = ("dp_shard", "fsdp", "efsdp")


@dataclass(frozen=True, eq=False)
class Placement:
    """Per-rank hardware coordinates; every array has shape (world,) and is indexed by rank.

    ``node``, ``local_gpu`` (0..gpus_per_node-1), ``global_gpu`` (node * gpus_per_node +
    local_gpu), ``socket`` (index into ``node.sockets``), ``nic`` (index into ``node.nics``,
    -1 when the node has none), ``rail`` (that NIC's rail, -1 if none), ``domain`` (NVLink
    domain: global_gpu // nvlink_domain_gpus, or the node when that is 0), ``core_first`` /
    ``core_last`` (inclusive CPU core range within the node, see :func:`core_table`).
    Arrays are read-only.
    """

    cluster: ClusterSpec
    node: np.ndarray
    local_gpu: np.ndarray
    global_gpu: np.ndarray
    socket: np.ndarray
    nic: np.ndarray
    rail: np.ndarray
    domain: np.ndarray
    core_first: np.ndarray
    core_last: np.ndarray

    @property
    def world(self) -> int:
        return int(self.node.size)

    def row(self, rank: int) -> dict:
        """:func:`rank_row` of ``rank``."""
        return rank_row(self, rank)

    @property
    def domain_gpus(self) -> int:
        """GPUs in one NVLink domain (the node's GPUs when ``nvlink_domain_gpus`` is 0)."""
        return self.cluster.node.nvlink_domain_gpus or self.cluster.node.gpus


def core_table(node: NodeSpec) -> tuple[np.ndarray, np.ndarray]:
    """First and last CPU core (inclusive) of each local GPU: two arrays (gpus_per_node,).

    Rule: socket s owns node cores ``off_s .. off_s + cores_s - 1`` (``off_s`` = cores of
    the sockets before it). Its n GPUs, in ascending GPU order, each get ``share = cores_s
    // n`` consecutive cores: GPU i of the socket gets ``off_s + i*share`` onwards. The
    ``cores_s - n*share`` leftover cores at the top stay free (OS, data loader). A socket with
    fewer cores than GPUs gives GPU i the single core ``off_s + i*cores_s // n`` (shared).
    Example: 56 cores, GPUs 4-7 on socket 1 -> GPU 5 gets cores 70-83.
    """
    first = np.zeros(node.gpus, dtype=np.int64)
    last = np.zeros(node.gpus, dtype=np.int64)
    off = 0
    for sock in node.sockets:
        gpus = sorted(sock.gpus)
        n, share = len(gpus), sock.cores // max(len(sock.gpus), 1)
        for i, g in enumerate(gpus):
            lo = off + (i * share if share else i * sock.cores // n)
            first[g], last[g] = lo, lo + max(share, 1) - 1
        off += sock.cores
    return first, last


def _node_tables(node: NodeSpec) -> dict[str, np.ndarray]:
    """Per-local-GPU lookup tables (gpus_per_node,): socket, nic, rail, core_first, core_last."""
    socket = np.array([node.socket_of(g) for g in range(node.gpus)], dtype=np.int64)
    nic = np.array([-1 if node.nic_of(g) is None else node.nic_of(g) for g in range(node.gpus)],
                   dtype=np.int64)
    rails = np.array([n.rail for n in node.nics] + [-1], dtype=np.int64)
    first, last = core_table(node)
    return {"socket": socket, "nic": nic, "rail": rails[nic], "core_first": first, "core_last": last}


def _check_rank_to_gpu(rank_to_gpu, world: int, n_gpus: int) -> np.ndarray:
    field = "mesh.rank_to_gpu"
    arr = np.asarray(rank_to_gpu)
    if arr.ndim != 1 or arr.size != world:
        raise ConfigError(field, f"has {arr.size} entries for world {world}; give one global GPU index per rank")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(field, f"entries must be integers (got {arr.dtype}); give global GPU indices 0..{n_gpus - 1}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= n_gpus))
    if bad.size:
        r = int(bad[0])
        raise ConfigError(field, f"rank {r} -> GPU {int(arr[r])} is outside 0..{n_gpus - 1}; "
                                 f"use global GPU indices (node * gpus_per_node + local GPU)")
    order = np.argsort(arr, kind="stable")
    dup = np.flatnonzero(arr[order][1:] == arr[order][:-1])
    if dup.size:
        a, b = int(order[dup[0]]), int(order[dup[0] + 1])
        raise ConfigError(field, f"ranks {a} and {b} both map to GPU {int(arr[a])}; give each rank its own GPU")
    return arr


def place(cluster: ClusterSpec, world: int, rank_to_gpu: Optional[list[int]] = None) -> Placement:
    """Place ``world`` ranks on ``cluster``.

    Default node-major: rank r runs on global GPU r (node r // gpus_per_node, local GPU
    r % gpus_per_node). ``rank_to_gpu[r]`` overrides it: distinct global GPU indices, one per
    rank, a permutation of a subset of ``range(cluster.world)``. Vectorised: per-node lookup
    tables of length gpus_per_node indexed by local GPU.

    Raises ConfigError("world") if ``world`` < 1 or exceeds the cluster's GPUs, and
    ConfigError("mesh.rank_to_gpu") for a wrong length, an index out of range or a GPU
    given twice.
    """
    node_spec, n_gpus = cluster.node, cluster.world
    if world < 1 or world > n_gpus:
        raise ConfigError("world", f"world {world} does not fit the cluster's {n_gpus} GPUs "
                                   f"({counted(cluster.nodes, 'node')} x {node_spec.gpus}); use 1..{n_gpus} ranks or add nodes")
    if rank_to_gpu is None:
        gpu = np.arange(world, dtype=np.int64)
    else:
        gpu = _check_rank_to_gpu(rank_to_gpu, world, n_gpus)
    local = gpu % node_spec.gpus
    tables = {k: v[local] for k, v in _node_tables(node_spec).items()}
    domain_gpus = node_spec.nvlink_domain_gpus or node_spec.gpus
    arrays = dict(node=gpu // node_spec.gpus, local_gpu=local, global_gpu=gpu,
                  domain=gpu // domain_gpus, **tables)
    for a in arrays.values():
        a.flags.writeable = False
    return Placement(cluster=cluster, **arrays)


def rank_row(placement: Placement, rank: int) -> dict:
    """One rank's placement for printing: node, local gpu, socket, cores ("0-13"), NIC name
    ("-" if none) and rail (None if none). Raises ConfigError if ``rank`` is out of range."""
    if not 0 <= rank < placement.world:
        raise ConfigError("rank", f"{rank} outside 0..{placement.world - 1}")
    p, nics = placement, placement.cluster.node.nics
    lo, hi = int(p.core_first[rank]), int(p.core_last[rank])
    nic = int(p.nic[rank])
    return {"rank": rank, "node": int(p.node[rank]), "gpu": int(p.local_gpu[rank]),
            "socket": int(p.socket[rank]), "cores": f"{lo}-{hi}" if hi > lo else str(lo),
            "nic": nics[nic].name if nic >= 0 else "-", "rail": int(p.rail[rank]) if nic >= 0 else None}


def distinct(values: np.ndarray, ignore_negative: bool = False) -> np.ndarray:
    """Distinct values per row of a (n_groups, size) array: shape (n_groups,)."""
    srt = np.sort(values, axis=1)
    new = np.ones(srt.shape, dtype=bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    if ignore_negative:
        new &= srt >= 0
    return new.sum(axis=1)


def _max_run(values: np.ndarray) -> np.ndarray:
    """Largest number of equal values per row (members on the busiest node): (n_groups,)."""
    n, s = values.shape
    srt = np.sort(values, axis=1)
    start = np.ones(srt.shape, dtype=bool)
    start[:, 1:] = srt[:, 1:] != srt[:, :-1]
    pos = np.flatnonzero(start.reshape(-1))
    lengths = np.diff(np.append(pos, n * s))
    out = np.zeros(n, dtype=np.int64)
    np.maximum.at(out, pos // s, lengths)
    return out


@dataclass(frozen=True, eq=False)
class GroupLocality:
    """Where the groups of one axis land. ``groups``: (n_groups, size) ranks. Per-group
    arrays (n_groups,): ``nodes``, ``domains`` (NVLink domains), ``rails`` (distinct rails of
    members with a NIC), ``per_node`` (members on the busiest node), ``cross_socket`` (some
    node holds members on more than one socket), ``rail_ok`` (the group stays in one NVLink
    domain, or all its members use one rail). Properties give the worst group."""

    groups: np.ndarray
    nodes: np.ndarray
    domains: np.ndarray
    rails: np.ndarray
    per_node: np.ndarray
    cross_socket: np.ndarray
    rail_ok: np.ndarray

    @property
    def size(self) -> int:
        return int(self.groups.shape[1])

    @property
    def n_groups(self) -> int:
        return int(self.groups.shape[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nodes.max())

    @property
    def max_domains(self) -> int:
        return int(self.domains.max())

    @property
    def leaves_node(self) -> bool:
        return self.max_nodes > 1

    @property
    def crosses_sockets(self) -> bool:
        return bool(self.cross_socket.any())

    @property
    def max_rails(self) -> int:
        return int(self.rails.max())

    @property
    def max_per_node(self) -> int:
        return int(self.per_node.max())

    @property
    def rail_aligned(self) -> bool:
        """Every group that leaves its NVLink domain keeps all members on one rail (seed:
        "align data or sharding groups across corresponding local positions")."""
        return bool(self.rail_ok.all())

    @property
    def link(self) -> str:
        """"local" (size 1), "nvlink" (every group inside one NVLink domain, by default the
        node) or "network" (some group spans domains)."""
        if self.size == 1:
            return "local"
        return "nvlink" if self.max_domains == 1 else "network"


def group_locality(placement: Placement, groups: np.ndarray) -> GroupLocality:
    """Locality of ``groups`` (n_groups, size), as from ``Mesh.groups(axis)``. Vectorised:
    O(n_groups * size log size). Raises ConfigError if a rank is outside the placement."""
    g = np.asarray(groups, dtype=np.int64)
    if g.ndim != 2 or g.size == 0:
        raise ConfigError("groups", f"expected a non-empty (n_groups, size) array, got shape {g.shape}")
    if g.min() < 0 or g.max() >= placement.world:
        raise ConfigError("groups", f"ranks {int(g.min())}..{int(g.max())} outside the placement's 0..{placement.world - 1}")
    p = placement
    node = p.node[g]
    nodes = distinct(node)
    n_sockets = len(p.cluster.node.sockets)
    domains = distinct(p.domain[g])
    rail = p.rail[g]
    rail_ok = (domains == 1) | (distinct(rail) == 1)
    for i in np.flatnonzero(~rail_ok):  # several members per node: the same rails on every node
        rail_ok[i] = _same_rails_per_node(node[i], rail[i])
    return GroupLocality(groups=g, nodes=nodes, domains=domains, rails=distinct(rail, ignore_negative=True),
                         per_node=_max_run(node), cross_socket=distinct(node * n_sockets + p.socket[g]) > nodes,
                         rail_ok=rail_ok)


def _same_rails_per_node(node_row: np.ndarray, rail_row: np.ndarray) -> bool:
    """Whether every node of a group holds its members on the same rails: then each ring
    channel (one per local position) crosses nodes on one rail (NCCL's rail-aligned rings)."""
    per: dict[int, list[int]] = {}
    for n, r in zip(node_row.tolist(), rail_row.tolist()):
        per.setdefault(n, []).append(r)
    return len({tuple(sorted(v)) for v in per.values()}) == 1


def axis_locality(mesh: Mesh, placement: Placement) -> dict[str, GroupLocality]:
    """:func:`group_locality` of every axis in ``mesh.all_axes()`` (mesh, derived, expert)."""
    _check_world(mesh, placement)
    return {a: group_locality(placement, mesh.groups(a)) for a in mesh.all_axes()}


def _check_world(mesh: Mesh, placement: Placement) -> None:
    if mesh.world != placement.world:
        raise ConfigError("mesh", f"mesh has {mesh.world} ranks but the placement {placement.world}; place mesh.world ranks")


def same_rails(p: Placement, groups: np.ndarray) -> np.ndarray:
    """Per group (n_groups,): every NVLink domain the group touches holds members on the same
    set of rails (one rail, or e.g. rails {t, t+4} in every node), so NCCL can keep each
    ring channel on one rail. Members without a NIC count as rail -1."""
    rail = p.rail[groups] + 1
    domains = distinct(p.domain[groups])
    return distinct(p.domain[groups] * (int(rail.max()) + 1) + rail) == domains * distinct(rail)
