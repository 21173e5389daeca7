"""Weak-path bytes of a placement (:func:`weak_bytes`): per axis, its groups' ring hops between
NVLink domains, between rails through the spine and across the CPU link, each times the axis's
weight (bytes one rank sends per step on it: :func:`weights_from_table`, or the frequency order
:data:`DEFAULT_WEIGHTS`). :func:`meshplan.placement.choice.choose_placement` scores its
candidates by it.

>>> from meshplan.catalog import system
>>> from meshplan.mesh.resolve import resolve_mesh
>>> from meshplan.placement.assign import place
>>> from meshplan.spec.mesh import MeshSpec
>>> mesh = resolve_mesh(MeshSpec(names=["tp", "dp_shard"], shape=[8, 8]), world=64)
>>> weak_bytes(mesh, place(system("seed-8x8-2nic", 8), 64), {"tp": 1000.0}).network_bytes
64000.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import numpy as np

from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Mesh
from meshplan.placement.assign import Placement, distinct, group_locality
from meshplan.placement.spine import pxn, spine_hops
from meshplan.spec.axes.registry import AXES, placement_weights

#: Relative weights (not bytes) when no collective table is given, each axis's own
#: (:attr:`~meshplan.spec.axes.base.AxisDef.weights`): the seed's frequency order tp > cp > ep >
#: dp_shard > dp_replicate > pp, each ten times the next; sp sits with cp, etp with tp, efsdp
#: with dp_shard, a plain dp axis with dp_replicate.
DEFAULT_WEIGHTS = placement_weights()
#: Axes whose collectives are all-to-alls (the routed experts' dispatch and combine), scored by
#: their off-domain bytes, not ring hops (:class:`AxisCost`).
ALL_TO_ALL_AXES = ("ep",)
#: The expert mesh's axes: the expert axes' own and the derived ones they bring (efsdp).
_EXPERT = tuple(k for a in AXES.values() if a.expert for k in a.weights)


def weights_from_table(rows: Iterable) -> dict[str, float]:
    """Bytes one rank sends per step on each axis: sum of ``sent_bytes_per_step`` (size x
    busbw factor x calls per step) over :class:`~meshplan.comm.row.CollectiveRow`
    rows, keyed by the row's axis name (the traffic unit of ``step`` and ``compare``)."""
    out: dict[str, float] = {}
    for r in rows:
        out[r.axis] = out.get(r.axis, 0.0) + float(r.sent_bytes_per_step)
    return out


def weights_from_plan(plan) -> dict[str, float]:
    """:func:`weights_from_table` of each stage table of ``plan.collectives``, the largest
    value per axis (the busiest stage role); empty when the plan has no table."""
    out: dict[str, float] = {}
    for rows in plan.collectives.values():
        for axis, w in weights_from_table(rows).items():
            out[axis] = max(out.get(axis, 0.0), w)
    return out


@dataclass(frozen=True)
class AxisCost:
    """Weak-path traffic of one axis, all its groups together. Hops are ring hops: NCCL
    orders a ring domain by domain, so a group spread over k NVLink domains has k hops
    between domains (none when k = 1), each carrying about one buffer S per collective
    ((n-1)/n S for all-gather and reduce-scatter, 2(n-1)/n S for all-reduce; S is counted).
    ``spine_hops``: those hops that cross the spine, hop by hop in NCCL's rank-order ring
    (:func:`meshplan.placement.spine.spine_hops`: to another leaf's scalable unit, or between
    domains on different rails; an all-to-all axis's on an NVLink node to another leaf only, NCCL's PXN
    sending each message on the peer's rail, :func:`meshplan.placement.spine.pxn`). ``socket_hops``: hops across the CPU link: between socket blocks of one node
    when the GPU fabric is no faster than PCIe, plus each member's share (k/n) of its
    group's network hops when its NIC sits on the other socket.

    An all-to-all axis (:data:`ALL_TO_ALL_AXES`) runs no ring: each rank sends S/n to every
    peer (nccl-tests doc/PERFORMANCE.md; :func:`meshplan.comm.nccl_algorithms.all_to_all_time`),
    so a member with g members in its own NVLink domain sends (n - g)/(n - 1) of its bytes
    (the weight, (n-1)/n S) off the domain. Its ``network_hops`` (``kind`` "all-to-all") is
    that fraction summed over every member of every group: ep 16 over 2 nodes on 256 ranks,
    256 x 8/15 = 136.5 (the ring count, 2 hops x 16 groups = 32, was 4.3x short)."""

    axis: str
    weight: float
    network_hops: float
    spine_hops: int
    socket_hops: float
    kind: str = "ring"

    @property
    def network_bytes(self) -> float:
        return self.weight * self.network_hops

    @property
    def spine_bytes(self) -> float:
        return self.weight * self.spine_hops

    @property
    def socket_bytes(self) -> float:
        return self.weight * self.socket_hops


@dataclass(frozen=True)
class Score:
    """Weak-path bytes per step (in the weights' unit) of one placement, by axis."""

    by_axis: dict[str, AxisCost]

    @property
    def network_bytes(self) -> float:
        return float(sum(c.network_bytes for c in self.by_axis.values()))

    @property
    def spine_bytes(self) -> float:
        return float(sum(c.spine_bytes for c in self.by_axis.values()))

    @property
    def socket_bytes(self) -> float:
        return float(sum(c.socket_bytes for c in self.by_axis.values()))

    @property
    def total(self) -> float:
        """network + spine + socket: a spine hop is counted on top of its network hop."""
        return self.network_bytes + self.spine_bytes + self.socket_bytes


def _axis_cost(axis: str, weight: float, groups: np.ndarray, p: Placement) -> AxisCost:
    loc = group_locality(p, groups)
    k, n = loc.domains, groups.shape[1]
    net = np.where(k > 1, k, 0).astype(float)
    if axis in ALL_TO_ALL_AXES and n > 1:  # per member: its bytes to the peers of other domains
        dom = p.domain[groups]
        same = (dom[:, :, None] == dom[:, None, :]).sum(axis=2)  # g of each member, itself included
        net = ((n - same) / (n - 1)).sum(axis=1)
    spine = spine_hops(p, groups, rails=not (axis in ALL_TO_ALL_AXES and pxn(p.cluster)))  # PXN: the peer's rail
    node = p.cluster.node
    socket = 0.0
    if node.fabric.bandwidth_bytes_per_s <= node.pcie.bandwidth_bytes_per_s:
        blocks = distinct(p.node[groups] * len(node.sockets) + p.socket[groups])
        socket += float(np.where(loc.nodes > 1, blocks - loc.nodes, np.where(blocks > 1, blocks, 0)).sum())
    if node.nics:
        nic_socket = np.array([x.socket for x in node.nics] + [-1])[p.nic]
        far = ((p.nic >= 0) & (nic_socket != p.socket))[groups].sum(axis=1)
        socket += float((net * far / n).sum())
    hops = float(net.sum()) if axis in ALL_TO_ALL_AXES and n > 1 else int(net.sum())
    return AxisCost(axis, float(weight), hops, int(spine.sum()), socket,
                    "all-to-all" if axis in ALL_TO_ALL_AXES and n > 1 else "ring")


def scored_axes(mesh: Mesh, weights: Mapping[str, float]) -> dict[str, float]:
    """The weights that apply to ``mesh``: axes it has with degree > 1. Raises ConfigError
    for a negative or non-numeric weight."""
    known = set(mesh.all_axes()) | set(mesh.layout.names)
    out = {}
    for axis, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            raise ConfigError(f"weights.{axis}", f"{w!r} is not a byte count >= 0")
        if axis in known and mesh.degree(axis) > 1:
            out[axis] = float(w)
    return out


def weak_bytes(mesh: Mesh, placement: Placement, weights: Optional[Mapping[str, float]] = None) -> Score:
    """Weak-path bytes per step of ``placement`` (see :class:`AxisCost`): for every weighted
    axis, weight x (network hops, spine hops, socket hops). ``weights``: bytes per step per
    rank by axis (:func:`weights_from_table`), default :func:`default_weights`."""
    w = scored_axes(mesh, default_weights(mesh) if weights is None else weights)
    return Score({a: _axis_cost(a, x, mesh.groups(a), placement) for a, x in w.items()})


def default_weights(mesh: Mesh) -> dict[str, float]:
    """:data:`DEFAULT_WEIGHTS` for the mesh's own axes and its expert axes (derived axes
    such as HSDP's dp only split the batch; their traffic runs on their parts)."""
    own = set(mesh.layout.names) | (set(_EXPERT) if mesh.ep * mesh.etp > 1 else set())
    return {a: w for a, w in DEFAULT_WEIGHTS.items() if a in own and mesh.degree(a) > 1}
