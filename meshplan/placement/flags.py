"""Placement findings (:func:`placement_flags`): where an axis's process groups land on the
hardware against the seed's section "Map logical groups to physical domains". Groups that talk
inside every layer (tp, cp, sp, ep, etp) belong in the smallest fast domain; data or sharding
groups that cross nodes should sit on corresponding local positions, so on one NIC rail. The
localities they read are :mod:`meshplan.placement.assign`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional

import numpy as np

from meshplan.mesh.resolve import Mesh
from meshplan.placement.assign import (DATA_AXES, PER_LAYER_AXES, SHARD_AXES, GroupLocality, Placement,
                                       axis_locality)
from meshplan.spec.training import TrainingSpec

_DENSE_PER_LAYER = ("tp", "cp", "sp")


@dataclass(frozen=True)
class Flag:
    """One placement finding: ``severity`` "fault" (a placement fault another axis order would
    fix: the mesh still runs, slower, so it does not make the plan infeasible; handed case C3),
    "warn" (a weak path) or "info"; ``message`` is one line with the numbers."""

    axis: str
    severity: str
    message: str


def _fmt_group(ranks) -> str:
    """``[1,3,5]``; groups over 8 ranks as ``[0,8,16,...,120] (16 ranks)``."""
    r = [int(x) for x in ranks]
    if len(r) <= 8:
        return "[" + ",".join(map(str, r)) + "]"
    return "[" + ",".join(map(str, r[:3])) + f",...,{r[-1]}] ({len(r)} ranks)"


def _witness(loc: GroupLocality, bad: np.ndarray, example_rank: Optional[int]) -> tuple[int, int]:
    """(row, rank) naming an offending group: the one holding ``example_rank`` if it
    offends, else the first offending group and its first member."""
    if example_rank is not None:
        hit = np.flatnonzero((loc.groups == example_rank).any(axis=1) & bad)
        if hit.size:
            return int(hit[0]), int(example_rank)
    row = int(np.flatnonzero(bad)[0])
    return row, int(loc.groups[row, 0])


def _domain_words(p: Placement) -> tuple[str, str]:
    node = p.cluster.node
    big = node.nvlink_domain_gpus not in (0, node.gpus)
    return ("NVLink domain", "NVLink domains") if big else ("node", "nodes")


def _need(parts) -> tuple[int, str]:
    """Product of (name, degree) pairs and its arithmetic, e.g. (8, 'tp 4 * cp 2 = 8')."""
    n = prod(d for _, d in parts)
    return n, " * ".join(f"{a} {d}" for a, d in parts) + (f" = {n}" if len(parts) > 1 else "")


def _per_layer_flags(axis: str, loc: GroupLocality, mesh: Mesh, p: Placement, ex) -> list[Flag]:
    """Per-layer groups leaving the NVLink domain (fault when an axis order would put every
    group inside one domain: the per-layer axes fit in one and their product divides it; else
    warn) or crossing sockets on a PCIe-only node (warn)."""
    one, many = _domain_words(p)
    if loc.max_domains > 1:
        names = ("ep", "etp") if axis in ("ep", "etp") else _DENSE_PER_LAYER
        need, expr = _need([(a, mesh.degree(a)) for a in names if mesh.degree(a) > 1])
        cap = p.domain_gpus
        row, r = _witness(loc, loc.domains > 1, ex)
        order = need <= cap and cap % need == 0  # else no axis order keeps every group inside a domain
        hint = (f"{expr} fits in one {cap}-GPU {one}: put these axes innermost (last in names)" if order
                else f"{expr} does not divide the {cap} GPUs of a {one}, so some groups straddle {many} in any "
                f"axis order: use degrees whose product divides {cap}" if need <= cap
                else f"{expr} > {cap} GPUs per {one}: some per-layer traffic must leave it")
        return [Flag(axis, "fault" if order else "warn",
                     f"{axis} groups span {loc.max_domains} {many}: {axis} collectives run every layer "
                     f"over the network; {axis}({r}) = {_fmt_group(loc.groups[row])}; {hint}")]
    node = p.cluster.node
    if loc.crosses_sockets and node.fabric.bandwidth_bytes_per_s <= node.pcie.bandwidth_bytes_per_s:
        row, r = _witness(loc, loc.cross_socket, ex)
        socks = sorted({int(s) for s in p.socket[loc.groups[row]]})
        return [Flag(axis, "warn",
                     f"{axis}({r}) = {_fmt_group(loc.groups[row])} spans sockets {socks} of a node whose GPUs "
                     f"talk over {node.fabric.name} ({node.fabric.bandwidth_gb_per_s:g} GB/s): {axis} "
                     f"collectives run every layer across the CPU link; keep {axis} groups on one socket")]
    return []


def shard_traffic(training: Optional[TrainingSpec]) -> tuple[str, str]:
    """What a shard axis's (dp_shard, fsdp, efsdp) groups send, as (the collectives a group
    crossing domains runs on, the same with its gradient reduction), by ``training.sharding``
    and the ZeRO-1/2 engine: the cadence of :mod:`meshplan.comm.dp_rows`'s rows. zero3 and hsdp
    (FSDP2, ZeRO-3) gather each layer's parameters in forward and backward and reduce-scatter its
    gradients; zero1 reduces the gradients once per step and all-gathers the updated parameters
    once after the optimizer, zero2 the same but reduces every micro-batch; under
    ``zero12_engine = "deepspeed"`` the reduction is an all-reduce of buckets; none (DDP) an
    all-reduce per step. ``None`` (no training contract): zero3's, TrainingSpec's default.

    >>> shard_traffic(TrainingSpec(global_batch=8, seq_len=8, micro_batch=1, sharding="zero1"))[0]
    "each step's gradient reduce-scatter and parameter all-gather (zero1: once per step, not per layer)"
    """
    if training is None or training.sharding in ("zero3", "hsdp"):
        return "every layer's all-gather", "every layer's all-gather and reduce-scatter"
    if training.sharding == "none":
        return ("each step's gradient all-reduce (sharding none: DDP)",) * 2
    reduce = "all-reduce" if training.zero12_engine == "deepspeed" else "reduce-scatter"
    if training.sharding == "zero1":
        return (f"each step's gradient {reduce} and parameter all-gather (zero1: once per step, not per layer)",) * 2
    return (f"every micro-batch's gradient {reduce} and each step's parameter all-gather (zero2: parameters "
            "gathered once per step, not per layer)",) * 2


def _rail_flags(axis: str, loc: GroupLocality, mesh: Mesh, p: Placement, ex,
                training: Optional[TrainingSpec]) -> list[Flag]:
    """Data/shard groups that leave the NVLink domain on more than one rail (warn). The
    derived ``dp`` (dp_replicate x dp_shard) is skipped: in HSDP it only splits the batch;
    its gradient traffic runs on dp_shard and dp_replicate, checked on their own."""
    if axis == "dp" and "dp" not in mesh.layout.names:
        return []
    bad = ~loc.rail_ok
    if not bad.any():
        return []
    row, r = _witness(loc, bad, ex)
    rails = sorted({int(x) for x in p.rail[loc.groups[row]]})
    when = shard_traffic(training)[1] if axis in SHARD_AXES else "every step's gradient all-reduce"
    return [Flag(axis, "warn",
                 f"{axis} group of rank {r} = {_fmt_group(loc.groups[row])} uses rails "
                 f"{{{','.join(map(str, rails))}}}: {int(bad.sum())} of {loc.n_groups} groups cross rails on "
                 f"{when}; place members on the same local GPU indices on every node")]


def _shard_flags(axis: str, loc: GroupLocality, mesh: Mesh, p: Placement, ex,
                 training: Optional[TrainingSpec]) -> list[Flag]:
    """A shard group (dp_shard, fsdp) that leaves the NVLink domain although it and the
    per-layer axes outside it fit in one domain: the axis order, not capacity, put it there
    (C3's swapped HSDP). Fault, naming the collectives that cross (:func:`shard_traffic`)."""
    if axis not in ("dp_shard", "fsdp") or loc.max_domains == 1:
        return []
    inside = mesh.axes_of(axis)
    need, expr = _need([(axis, loc.size)] + [(a, mesh.degree(a)) for a in _DENSE_PER_LAYER
                                             if mesh.degree(a) > 1 and a not in inside])
    if need > p.domain_gpus:
        return []
    one, many = _domain_words(p)
    names = mesh.layout.names
    start = names.index(inside[0])
    inner = [a for a in names[start:] if a not in inside and a not in _DENSE_PER_LAYER]
    row, r = _witness(loc, loc.domains > 1, ex)
    return [Flag(axis, "fault",
                 f"{axis}({r}) = {_fmt_group(loc.groups[row])} crosses {many} on {shard_traffic(training)[0]}; "
                 f"{expr} fits in one {p.domain_gpus}-GPU {one}: move {', '.join(inner) or 'the inner axes'} "
                 f"outside {axis}")]


def placement_flags(mesh: Mesh, placement: Placement, example_rank: Optional[int] = None,
                    training: Optional[TrainingSpec] = None) -> list[Flag]:
    """Placement findings for every axis of ``mesh`` (seed: "Map logical groups to physical
    domains"), in ``mesh.all_axes()`` order.

    - tp, cp, sp, ep, etp (every layer): leaving the NVLink domain (the node by default) is
      a fault when an axis order would keep them inside one, else a warning; crossing sockets
      is a warning only when the GPU fabric is no faster than PCIe (otherwise the GPUs talk
      over NVLink whatever the socket).
    - dp, dp_replicate, dp_shard, fsdp, efsdp leaving the domain on more than one rail: warn.
    - dp_shard / fsdp leaving the domain when it would fit inside one: fault.
    - pp leaving the node: info (the usual axis to cross nodes).

    ``example_rank``: name the offending group holding this rank when there is one.
    ``training``: the contract whose sharding says what the shard groups send (every layer's
    all-gather under zero3, once per step under zero1/zero2: :func:`shard_traffic`).
    Raises ConfigError if the mesh and placement have different world sizes.
    """
    flags: list[Flag] = []
    many = _domain_words(placement)[1]
    for axis, loc in axis_locality(mesh, placement).items():
        if axis in PER_LAYER_AXES:
            flags += _per_layer_flags(axis, loc, mesh, placement, example_rank)
        if axis in DATA_AXES:
            flags += _shard_flags(axis, loc, mesh, placement, example_rank, training)
            flags += _rail_flags(axis, loc, mesh, placement, example_rank, training)
        if axis == "pp" and loc.max_domains > 1:
            flags.append(Flag(axis, "info", f"pp groups span {loc.max_domains} {many}: stage-to-stage "
                                            f"sends (once per microbatch) cross the network, as expected"))
    return flags
