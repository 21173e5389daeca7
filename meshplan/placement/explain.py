"""One-line explanations of a :class:`~meshplan.placement.choice.Choice`: each decision with
the assumption behind it, and a warning wherever the seed's placement rule fails (a tensor
degree larger than the fast domain, an NVLink domain larger than a node, a NIC map that is
not GPU k -> NIC k, a NIC across the CPU link, data groups across rails).

Source of the rule and its assumptions: the seed's "Map logical groups to physical domains"
and its knowledge check ("assumes faster intra-node links, enough local GPUs for the tensor
degree, compatible local matrix shapes, and no alternative fabric hierarchy").
"""

from __future__ import annotations

from math import prod

import numpy as np

from meshplan.placement.assign import PER_LAYER_AXES, GroupLocality, group_locality, same_rails
from meshplan.pipeline.registry import get
from meshplan.placement.topology_node import check_identity_nic_map
from meshplan.placement.score import ALL_TO_ALL_AXES
from meshplan.placement.spine import PXN_SOURCE, pxn
from meshplan.spec.search import TIE
from meshplan.units import traffic_gb

_DENSE_PER_LAYER = ("tp", "cp", "sp")


def _fmt(x: float, in_bytes: bool) -> str:
    return traffic_gb(x) if in_bytes else f"{x:.6g}"


def _name(c, axis: str) -> str:
    """``axis`` as output prints it (``c.labels``: the experts' data axis ``efsdp`` is ``edp`` where
    the sharding replicates the experts, :func:`meshplan.spec.wording.expert_data_axis`)."""
    return c.labels.get(axis, axis)


def _where(c) -> tuple[int, int, str]:
    """(GPUs per domain, GPUs per node, the domain's name) of the choice's cluster."""
    node = c.placement.cluster.node
    d = node.nvlink_domain_gpus or node.gpus
    return d, node.gpus, ("node" if d == node.gpus else f"{d}-GPU NVLink domain")


def explain(c) -> tuple[list[str], list[str]]:
    """(decisions, warnings) of choice ``c``, one line each."""
    dec: list[str] = [_weights_line(c)]
    warn: list[str] = []
    locs = {a: group_locality(c.placement, c.mesh.groups(a)) for a in _axes(c)}
    for axis, loc in locs.items():
        if axis in PER_LAYER_AXES:
            (dec if loc.max_domains == 1 else warn).append(_per_layer(c, axis, loc))
        elif axis == "pp":
            dec.append(_pp_line(c, loc, locs))
        else:  # data, shard and other axes (dp, dp_replicate, dp_shard, fsdp, efsdp, loss, user-named)
            line, ok = _data(c, axis, loc)
            (dec if ok else warn).append(line)
    dec += _nic_lines(c, warn)
    dec += _pxn_line(c, locs)
    warn += _hierarchy(c)
    dec.append(_result(c))
    return dec, warn


def _pxn_line(c, locs: dict[str, GroupLocality]) -> list[str]:
    """A decision on NCCL's PXN (:func:`~meshplan.placement.spine.pxn`) where an all-to-all axis's groups
    span nodes: its sends go on the peer's rail, so its spine bytes count leaf crossings only."""
    axes = [a for a in ALL_TO_ALL_AXES if a in locs and locs[a].max_nodes > 1]
    if not axes or not pxn(c.placement.cluster):
        return []
    return [f"{', '.join(axes)}'s all-to-all across nodes: NCCL's PXN (NCCL_PXN_DISABLE=0, its default; "
            f"{PXN_SOURCE.split(', ')[0]}) relays each send over NVLink to the GPU by the NIC on the peer's rail, so it crosses the spine only "
            "between scalable units (so counted in the spine bytes)"]


def _pp_line(c, loc: GroupLocality, locs: dict[str, GroupLocality]) -> str:
    """The pp decision: how often a micro-batch crosses a stage boundary under the choice's
    schedule (:meth:`~meshplan.pipeline.base.PipelineSchedule.crossings`: once with one chunk
    per rank, v times looped, twice for a V), and where pp's traffic ranks in the tally
    (``c.weights``): "the lightest traffic" only where no axis sends less; else the lighter axes
    with their bytes (and whether their groups cross nodes too, ``locs``), and pp's groups said to
    span the nodes the rank order puts them on, not to be there for being light."""
    sched = get(get(c.schedule).for_chunks(c.vpp))
    n = sched.crossings(loc.size, c.vpp) if loc.size > 1 else 1
    how = "once" if n == 1 else "twice" if n == 2 else f"{n} times"
    chunks = f", {c.vpp} chunks per rank" if c.vpp > 1 else ""
    head = f"pp {loc.size}: each micro-batch crosses a stage boundary {how} each way ({sched.name}{chunks})"
    in_bytes = c.weights_source != "default"
    assumes = "" if in_bytes else " (assumes activations are small next to tp traffic)"
    mine = c.weights.get("pp")
    lighter = sorted((a for a, w in c.weights.items() if a != "pp" and mine is not None and w < mine),
                     key=lambda a: c.weights[a])
    if not lighter:
        return f"{head}, the lightest traffic; groups span {loc.max_nodes} node(s){assumes}"
    across = [a for a in lighter if a in locs and locs[a].max_nodes > 1]
    less = "; ".join(_sends_less(c, axes, cross) for axes, cross in ((across, True),
                     ([a for a in lighter if a not in across], False)) if axes)
    order = "the chosen rank order" if c.changed else "the mesh's rank order"
    return (f"{head}; its {_fmt(mine, in_bytes)} per rank is not the lightest traffic: {less}; groups span "
            f"{loc.max_nodes} node(s) where {order} puts them, not for being light"
            + ("" if c.searched else f" ({choose_hint()} weighs the orders)"))


def _sends_less(c, axes: list[str], cross: bool) -> str:
    """``dp 2.4 GB and efsdp 11.1 GB send less and cross nodes too`` (``cross``) of the axes
    that send less than pp (:func:`_pp_line`), with their weights.

    >>> from types import SimpleNamespace as S
    >>> _sends_less(S(weights={"dp": 2.4e9}, weights_source="collective table", labels={}), ["dp"], True)
    'dp 2.4 GB sends less and crosses nodes too'
    """
    one = len(axes) == 1
    names = " and ".join(f"{_name(c, a)} {_fmt(c.weights[a], c.weights_source != 'default')}" for a in axes)
    return f"{names} send{'s' * one} less" + (f" and cross{'es' * one} nodes too" if cross else "")


def _axes(c) -> list[str]:
    """Axes to explain: the weighted ones, plus mesh axes of degree > 1 (mesh order)."""
    mesh = c.mesh
    out = [a for a in mesh.layout.names if mesh.degree(a) > 1]
    return out + [a for a in c.weights if a not in out]


def _weights_line(c) -> str:
    in_bytes = c.weights_source != "default"
    parts = ", ".join(f"{_name(c, a)} {_fmt(w, in_bytes)}" for a, w in sorted(c.weights.items(), key=lambda kv: -kv[1]))
    if in_bytes:
        return f"weights: bytes each rank sends per step by axis ({c.weights_source}; GB = 1e9 B): {parts}"
    return (f"weights: no collective table, so the frequency order tp > cp > ep > dp_shard > dp_replicate > pp "
            f"in relative units, each 10x the next: {parts} (assumes per-layer traffic dominates)")


def _per_layer(c, axis: str, loc: GroupLocality) -> str:
    """Decision when ``axis`` stays in one domain, else the warning naming the cost."""
    d_gpus, n_gpus, dom = _where(c)
    node = c.placement.cluster.node
    if loc.max_domains == 1:
        if d_gpus > n_gpus:
            return (f"{axis} {loc.size} fits the {dom}: {axis} groups span up to {loc.max_nodes} nodes of "
                    f"{n_gpus} GPUs inside it (assumes the NVLink switches join the domain's nodes as fast as "
                    f"inside a node)")
        if node.fabric.bandwidth_bytes_per_s <= node.pcie.bandwidth_bytes_per_s:
            sock = "inside one socket" if not loc.crosses_sockets else "across sockets"
            return (f"{axis} {loc.size} fits the {n_gpus}-GPU node: {axis} groups inside a node, {sock} "
                    f"(assumes {node.fabric.name} inside the node faster than the NICs)")
        return (f"{axis} {loc.size} fits the {d_gpus}-GPU NVLink domain: {axis} groups inside a node "
                f"(assumes NVLink faster than the NICs)")
    names = ("ep", "etp") if axis in ("ep", "etp") else _DENSE_PER_LAYER
    parts = [(a, c.mesh.degree(a)) for a in names if c.mesh.degree(a) > 1]
    need = prod(d for _, d in parts)
    b = c.weights_source != "default"
    cost = c.after.by_axis.get(axis)
    tail = "" if cost is None or c.after.total <= 0 else (
        f": {_hops(cost)} x {_fmt(cost.weight, b)} (the bytes each rank sends per step"
        f"{', each hop carrying them' if cost.kind != 'all-to-all' else ''}) = {_fmt(cost.network_bytes, b)} per step "
        f"({100 * cost.network_bytes / c.after.total:.1f}% of the weak-path bytes)")
    spans = (f"each {axis} group spans {loc.max_domains} {'nodes' if dom == 'node' else 'NVLink domains'} (up to "
             f"{loc.max_per_node} member{'s' if loc.max_per_node > 1 else ''} per node) and every layer's {axis} "
             f"collectives cross the network{tail}")
    if loc.size <= d_gpus and need <= d_gpus:
        where = f"{d_gpus}-GPU node" if dom == "node" else dom
        return (f"{axis} {loc.size} fits the {where} but the axis order puts it across: {spans}; "
                f"put {axis} innermost ({choose_hint()})")
    why = (f"{axis} {loc.size} > {d_gpus} GPUs per {dom}" if loc.size > d_gpus else
           " * ".join(f"{a} {d}" for a, d in parts) + f" = {need} > {d_gpus} GPUs per {dom}")
    return (f"{why}: the rule 'per-layer groups inside the fast domain' fails; {spans}; keep the per-layer axes "
            f"within {d_gpus} GPUs (trade the excess for pp or dp) or use a larger NVLink domain")


def _rails_of(c, loc: GroupLocality, row: int) -> list[int]:
    return sorted({int(r) for r in c.placement.rail[loc.groups[row]] if r >= 0})


def _rail_counts(c, loc: GroupLocality) -> str:
    first = c.placement.rail[loc.groups[:, 0]]
    vals, counts = np.unique(first, return_counts=True)
    if len(vals) > 4 and (counts == counts[0]).all():
        return f"{len(vals)} rails, {int(counts[0])} group{'s' if counts[0] > 1 else ''} each"
    return ", ".join(f"rail {int(v)}: {int(n)} group{'s' if n > 1 else ''}" for v, n in zip(vals, counts))


def _units(c, axis: str) -> str:
    """``; its rings cross the spine between scalable units of 32 nodes: 9,135.8 GB per step``
    where a one-rail axis's ring hops leave their leaf (:mod:`meshplan.placement.spine`)."""
    cost = c.after.by_axis.get(axis)
    if not cost or not cost.spine_hops:
        return ""
    per = c.placement.cluster.network[0].nodes_per_domain
    return (f"; its rings cross the spine between scalable units of {per} nodes ({cost.spine_hops} of "
            f"{cost.network_hops} hops): {_fmt(cost.spine_bytes, c.weights_source != 'default')} per step")


def _data(c, axis: str, loc: GroupLocality) -> tuple[str, bool]:
    """(line, is it a decision) for a data or shard axis."""
    d_gpus, n_gpus, dom = _where(c)
    name = _name(c, axis)
    if loc.max_domains == 1:
        return (f"{name} {loc.size} stays inside one {dom}: no NIC traffic, rails unused"
                + (" (data groups can stay inside a large NVLink domain)" if d_gpus > n_gpus else ""), True)
    same = same_rails(c.placement, loc.groups)
    if not same.all():
        row = int(np.flatnonzero(~same)[0])
        cost = c.after.by_axis.get(axis)
        extra = f"; {_fmt(cost.spine_bytes, c.weights_source != 'default')} per step cross the spine" if cost else ""
        return (f"{name} group {_short(loc.groups[row])} uses rails {_rails_of(c, loc, row)} that differ between "
                f"nodes ({int((~same).sum())} of {loc.n_groups} groups): its inter-node hops go through the spine"
                f"{extra}; place members on the same local GPUs in every node", False)
    if loc.max_per_node == 1 and loc.max_rails <= 1:
        return (f"{name} {loc.size} spans {loc.max_domains} {'nodes' if dom == 'node' else 'domains'}, one member per "
                f"node at the same local GPU: each group on one rail ({_rail_counts(c, loc)}) "
                f"(assumes a rail-optimized fabric: NIC k of every node on leaf k){_units(c, axis)}", True)
    return (f"{name} {loc.size} spans {loc.max_domains} {'nodes' if dom == 'node' else 'domains'} with "
            f"{loc.max_per_node} members per node on the same local GPUs in every node: group 0 uses rails "
            f"{_rails_of(c, loc, 0)} in every node, so each ring channel can stay on one rail (a group of "
            f"{loc.size} over {loc.max_nodes} nodes cannot use one rail; assumes NCCL keeps a channel on one NIC "
            f"index across nodes)", True)


def _short(ranks) -> str:
    r = [int(x) for x in ranks]
    return "[" + ",".join(map(str, r)) + "]" if len(r) <= 8 else "[" + ",".join(map(str, r[:3])) + f",...,{r[-1]}]"


def _nic_lines(c, warn: list[str]) -> list[str]:
    """The NIC decision, with where the index map GPU k -> NIC k would pick a farther NIC than
    the bindings do (:func:`~meshplan.placement.topology_node.check_identity_nic_map`: a note on
    the decision, since the bindings written already bind each GPU to its switch's NIC; newcomer
    trial nc52 was told to "bind GPU 1 to mlx5_0" as a warning on a node whose bindings did); the
    cross-socket warning goes to ``warn``."""
    node = c.placement.cluster.node
    if not node.nics:
        if c.after.network_bytes > 0:
            warn.append(f"node {node.name} lists no NIC: network traffic cannot be bound to a NIC; "
                        "give the node's NICs (meshplan.placement.topology reads them from nvidia-smi topo -m)")
        return []
    nic = [node.nic_of(g) for g in range(node.gpus)]
    pairs = " ".join(f"{g}:{node.nics[n].name}" for g, n in enumerate(nic))
    far = [g for g in range(node.gpus) if node.nics[nic[g]].socket != node.socket_of(g)]
    off_switch = [g for g in range(node.gpus) if g not in node.nics[nic[g]].gpus]
    line = (f"NICs: each rank uses a NIC under its GPU's PCIe switch (NodeSpec.nic_of, round-robin over a "
            f"switch's NICs), GPU:NIC {pairs} (assumes GPUDirect RDMA through the switch)")
    if off_switch:
        line += f"; GPUs {off_switch} have none and use a NIC on their socket"
    ident = check_identity_nic_map(node)
    if ident:  # the bindings already pair each GPU with its switch's NIC: a note, not a warning (nc52)
        line += (f"; GPU k is not under NIC k on {node.name} for {len(ident)} GPUs ({ident[0]}): the bindings "
                 f"above do that (NodeSpec.nic_of); a script of its own that binds local_rank % {len(node.nics)} "
                 "would not (topology_node.check_identity_nic_map)")
    if far:
        cost = c.after.socket_bytes
        warn.append(f"GPUs {far} have no NIC on their socket: their network traffic crosses the CPU link "
                    f"({_fmt(cost, c.weights_source != 'default')} socket bytes per step in all); add a NIC per socket")
    return [line]


def _hierarchy(c) -> list[str]:
    d_gpus, n_gpus, dom = _where(c)
    if d_gpus <= n_gpus:
        return []
    world = c.mesh.world
    span = "fits in one domain" if world <= d_gpus else f"spans {-(-world // d_gpus)} domains"
    return [f"NVLink domain of {d_gpus} GPUs spans {d_gpus // n_gpus} nodes of {n_gpus}: the within-node rule "
            f"changes: tensor groups may span nodes inside the domain, and data groups need NIC rails only "
            f"where they leave it (world {world} {span}); bandwidth inside the domain is taken as the node's "
            f"fabric ({c.placement.cluster.node.fabric.name})"]


def _result(c) -> str:
    """The choice in one line; when the step-time model scored it, the predicted steps."""
    b = c.weights_source != "default"
    before, after = c.before, c.after
    if not c.changed:
        given = ("node-major" if np.array_equal(c.placement.global_gpu, np.arange(c.mesh.world))
                 else "given rank_to_gpu")
        parts = (f"{_fmt(before.total, b)}: network {_fmt(before.network_bytes, b)}, spine "
                 f"{_fmt(before.spine_bytes, b)}, socket {_fmt(before.socket_bytes, b)}")
        if not c.searched:
            return f"{given} placement as given: weak-path bytes (all ranks, per step) {parts} (not searched)"
        if c.step_before_s is not None:
            return (f"kept the {given} placement: no candidate predicts a step more than {TIE:.0%} shorter than its "
                    f"{c.step_before_s:.4f} s (step-time model; {TIE:.0%} is the tie threshold, a judgement, not the model's measured error: "
                    f"docs/fidelity.md; weak-path bytes {parts})")
        return f"kept the {given} placement: no candidate has fewer weak-path bytes ({parts})"
    order = ", ".join(str(f) for f in list(reversed(c.outer)) + list(reversed(c.inner)))
    how = (f"equivalent to mesh names {list(c.equivalent_names)} with node-major ranks" if c.equivalent_names else
           "apply it with torchrun's node-major RANK = global GPU and a DeviceMesh built from rank_to_gpu "
           "reshaped to the mesh shape")
    step = ("" if c.step_before_s is None else
            f"predicted step {c.step_before_s:.4f} s -> {c.step_after_s:.4f} s (step-time model); ")
    return (f"chose physical order ({order}) outermost first: {step}weak-path bytes {_fmt(before.total, b)} -> "
            f"{_fmt(after.total, b)} (network {_fmt(after.network_bytes, b)}, spine {_fmt(after.spine_bytes, b)}, "
            f"socket {_fmt(after.socket_bytes, b)}); {how}")


def choose_hint(command: str = "place") -> str:
    """The command that searches the rank -> GPU permutation, as a warning names it for the
    command the user ran (``meshplan launch --choose`` binds what ``place --choose`` finds).

    >>> choose_hint(), choose_hint("launch")
    ('meshplan place --choose', 'meshplan launch --choose')
    """
    return f"meshplan {command} --choose"


def _hops(cost) -> str:
    """What an axis's network hops count (:class:`~meshplan.placement.score.AxisCost`): ring hops,
    or an all-to-all's rank-buffers off the domain ((n - g)/(n - 1) of each rank's bytes)."""
    if cost.kind == "all-to-all":
        return (f"{cost.network_hops:.1f} (the sum over the ranks of (n - g)/(n - 1), the share of its all-to-all "
                f"bytes a rank sends outside its NVLink domain of g members)")
    return f"{cost.network_hops} ring hops between NVLink domains"
