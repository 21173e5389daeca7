"""Consistency of a node's NICs with its GPUs and sockets, as written in a config's
``[cluster.node]`` or the catalog (:func:`node_warnings`): one ``warning:`` line per finding,
never an error, since real nodes can be odd (a storage NIC beside the GPUs' ones, a GPU with no
NIC of its own). ``plan``, ``step`` and ``place`` print them (:func:`meshplan.cli.loading._load`),
once each, before the plan (newcomer trial nc61 #4: a GPU under two NICs, a GPU under none, a
NIC on the other socket than its GPUs, rail 7 on a 4-NIC node and a 50 Gb/s NIC among 400 Gb/s
ones were all taken without a word).

What each rule reads (:class:`~meshplan.spec.cluster.NICSpec`): a NIC's ``gpus`` are the GPUs
under its PCIe switch, so a GPU listed under two NICs must be listed with the same peers (DGX
A100: GPUs 0-1 under both mlx5_0 and mlx5_1, ``nvidia-smi topo -m`` PIX for both), else the node
has two switches above one GPU; its ``socket`` is the CPU socket (NUMA node) of that switch,
which is its GPUs' socket; ``rail`` k is the leaf that NIC k of every node connects to in a
rail-optimized fabric, so a node of N NICs has rails 0..N-1; and a node's compute NICs are one
model (every catalog node's are: nodes.toml), which the catalog's ``nic`` curve is read against.
"""

from __future__ import annotations

from meshplan.spec.cluster import NodeSpec

#: Where the user checks each fact of a node: the tool that prints it.
_TOPO = "nvidia-smi topo -m"


def node_warnings(node: NodeSpec) -> list[str]:
    """``warning:`` lines for ``node``'s NICs that contradict its GPUs, sockets or each other
    (module docstring); empty for a consistent node, as every catalog node is.

    >>> from meshplan.catalog import node
    >>> [n for n in ("dgx-a100", "dgx-h100", "dgx-h200") if node_warnings(node(n))]
    []
    >>> h = node("dgx-h100")
    >>> nics = [h.nics[0].model_copy(update={"rate_gbit_per_s": 50.0, "rail": 9}), *h.nics[1:]]
    >>> for w in node_warnings(h.model_copy(update={"nics": nics})):
    ...     print(w)
    warning: cluster.node.nics.0 (mlx5_0): rail 9, but the node has 8 NICs (rails 0-7 in a rail-optimized fabric: NIC k on leaf k); check its rail
    warning: cluster.node.nics: rates differ, mlx5_0 50 Gb/s against 400 Gb/s for the 7 others; the catalog's nic curve is read against the first NIC's rate: check rate_gbit_per_s (ibstat's Rate, in Gb/s)
    """
    if not node.nics:
        return []
    return [*_shared_gpus(node), *_gpus_without_nic(node), *_sockets(node), *_rails(node), *_rates(node)]


def _field(node: NodeSpec, i: int) -> str:
    return f"cluster.node.nics.{i} ({node.nics[i].name})"


def _shared_gpus(node: NodeSpec) -> list[str]:
    """A GPU listed under NICs whose GPU lists differ (two PCIe switches above one GPU)."""
    out = []
    for g in range(node.gpus):
        under = [i for i, n in enumerate(node.nics) if g in n.gpus]
        if len({tuple(sorted(node.nics[i].gpus)) for i in under}) > 1:
            said = " and ".join(f"{node.nics[i].name} (gpus {sorted(node.nics[i].gpus)})" for i in under)
            out.append(f"warning: cluster.node.nics: GPU {g} is under {said}, which list different GPUs; a GPU is "
                       f"under one PCIe switch: check each NIC's gpus ({_TOPO}: PIX/PXB)")
    return out


def _gpus_without_nic(node: NodeSpec) -> list[str]:
    """GPUs no NIC lists: they use a NIC on their socket (:meth:`NodeSpec.nic_of`)."""
    listed = {g for n in node.nics for g in n.gpus}
    none = [g for g in range(node.gpus) if g not in listed]
    if not none:
        return []
    who = f"GPU {none[0]} is" if len(none) == 1 else f"GPUs {none} are"
    return [f"warning: cluster.node.nics: {who} under no NIC, so it shares a NIC of its socket (or has none); "
            f"check each NIC's gpus ({_TOPO}: the NIC under each GPU's PCIe switch)"]


def _sockets(node: NodeSpec) -> list[str]:
    """A NIC whose socket is not its GPUs' socket."""
    out = []
    for i, n in enumerate(node.nics):
        other = sorted({node.socket_of(g) for g in n.gpus} - {n.socket})
        if other:
            out.append(f"warning: {_field(node, i)}: socket {n.socket}, but its gpus {sorted(n.gpus)} are on socket "
                       f"{', '.join(map(str, other))} (cluster.node.sockets); check its socket ({_TOPO}: NUMA "
                       f"Affinity) and gpus")
    return out


def _rails(node: NodeSpec) -> list[str]:
    """A rail index beyond the node's NIC count."""
    k = len(node.nics)
    return [f"warning: {_field(node, i)}: rail {n.rail}, but the node has {k} NICs (rails 0-{k - 1} in a "
            f"rail-optimized fabric: NIC k on leaf k); check its rail" for i, n in enumerate(node.nics) if n.rail >= k]


def _rates(node: NodeSpec) -> list[str]:
    """NICs of different line rates, the odd ones named against the most common rate."""
    rates = [n.rate_gbit_per_s for n in node.nics]
    if len(set(rates)) < 2:
        return []
    common = max(set(rates), key=lambda r: (rates.count(r), r))
    odd = ", ".join(f"{n.name} {n.rate_gbit_per_s:g} Gb/s" for n in node.nics if n.rate_gbit_per_s != common)
    return [f"warning: cluster.node.nics: rates differ, {odd} against {common:g} Gb/s for the {rates.count(common)} "
            f"others; the catalog's nic curve is read against the first NIC's rate: check rate_gbit_per_s (ibstat's "
            f"Rate, in Gb/s)"]
