"""The :class:`~meshplan.spec.cluster.NodeSpec` a read topology gives (:func:`node_from_topology`:
its sockets and NICs from a :class:`~meshplan.placement.topology.TopoMatrix`, the catalog node's
measured curves kept unless its GPUs or NVLink differ: :func:`curve_difference`), the lines that
say what it changed (:func:`topology_notes`), and the check of the index NIC map GPU k -> NIC k
against it (:func:`check_identity_nic_map`).

NIC affinity is a property of the PCIe tree, not of indices (NVIDIA/nccl issue 1405: GPUs
0-3 share a switch with NICs 1, 3, 4, 5). A GPU's NICs are those at its closest level when
that is ``PIX`` or ``PXB`` (same switch); ``NODE``/``PHB``: same socket, other switch;
``SYS``: other socket. :meth:`NodeSpec.nic_of` round-robins a switch's GPUs over its NICs.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from pydantic import ValidationError

from meshplan.errors import ConfigError
from meshplan.limits import bound_message
from meshplan.placement.cpus import physical_cores
from meshplan.placement.topology import LEVELS, SAME_SWITCH, TopoMatrix
from meshplan.spec.cluster import GPUSpec, NICSpec, NodeSpec, SocketSpec


def _sockets(topo: TopoMatrix, base: NodeSpec, threads_per_core) -> tuple[list[SocketSpec], dict, list[int]]:
    """Sockets (one per NUMA node holding a GPU, or a NIC when the XML says so) ordered by
    NUMA id (or first CPU), the map NUMA key -> socket index, and each GPU's socket. A
    socket without CPU affinity takes the base's core count when the socket counts agree."""
    keys = [numa if numa is not None else cpus for numa, cpus in zip(topo.gpu_numa, topo.gpu_cpus)]
    groups: dict = {}
    for gpu, key, cpus in zip(topo.gpus, keys, topo.gpu_cpus):
        groups.setdefault(key, ([], set()))[0].append(gpu)
        groups[key][1].update(cpus)
    for numa in topo.nic_numa:
        if numa is not None and numa not in groups:
            groups[numa] = ([], set(dict(topo.numa_cpus).get(numa, ())))
    order = sorted(groups, key=lambda k: (0, k, ()) if isinstance(k, int) else (1, min(k, default=0), k))
    cores = physical_cores([tuple(sorted(groups[k][1])) for k in order], threads_per_core)
    same = len(base.sockets) == len(order)
    cores = [c if c > 0 else (base.sockets[i].cores if same else 0) for i, c in enumerate(cores)]
    if 0 in cores:
        raise ConfigError(topo.source, f"NUMA node {order[cores.index(0)]} has no CPU affinity and {base.name} "
                                       "has no matching socket; give a topology with CPU Affinity")
    index = {k: i for i, k in enumerate(order)}
    try:
        sockets = [SocketSpec(gpus=sorted(groups[k][0]), cores=cores[i]) for i, k in enumerate(order)]
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(topo.source, f"topology gives an invalid socket: {bound_message(first) or first['msg']}") \
            from None
    return sockets, index, [index[k] for k in keys]


def _nic_socket(topo: TopoMatrix, j: int, gpu_socket: list[int], index: dict) -> int:
    """Socket of NIC j: its NUMA node (XML), else the socket of a GPU it is not SYS to,
    else of a NIC it is not SYS to."""
    if topo.nic_numa[j] is not None:
        return index[topo.nic_numa[j]]
    for k in [j] + [k for k, lvl in enumerate(topo.nic_nic[j]) if lvl not in ("SYS", "X")]:
        near = [gpu_socket[i] for i in range(len(topo.gpus)) if topo.gpu_nic[i][k] != "SYS"]
        if near:
            return near[0]
    raise ConfigError(topo.source, f"NIC {topo.nics[j]} is SYS to every GPU: its socket is unknown; "
                                   "use NCCL's topology dump (NCCL_TOPO_DUMP_FILE), which names its NUMA node")


def near_gpus(topo: TopoMatrix, name: str) -> list[int]:
    """The GPUs under NIC ``name``'s PCIe switch: level ``PIX`` or ``PXB`` (:data:`SAME_SWITCH`).
    Empty for a front-end or storage NIC (``mlx5_bond_0`` on the host bridge: ``NODE``/``SYS``)."""
    j = topo.nics.index(name)
    return [gpu for i, gpu in enumerate(topo.gpus) if topo.gpu_nic[i][j] in SAME_SWITCH]


def _chosen_nics(topo: TopoMatrix, base: NodeSpec, nics: Optional[Sequence[str]]) -> list[str]:
    """``nics`` when given; the base's names when the topology has them all; else the NICs
    with a GPU under their PCIe switch (:func:`near_gpus`; every NIC when none has one), in
    natural name order."""
    if nics is not None:
        unknown = [n for n in nics if n not in topo.nics]
        if unknown:
            raise ConfigError("nics", f"{', '.join(unknown)} not in {topo.source} (has {', '.join(topo.nics)}); "
                                      "name NICs the topology lists")
        return list(nics)
    if base.nics and all(n.name in topo.nics for n in base.nics):
        return [n.name for n in base.nics]
    near = [n for n in topo.nics if near_gpus(topo, n)]
    return sorted(near or topo.nics, key=_natural)


def _natural(name: str) -> list:
    """Sort key: ``name``'s digit runs compared as numbers (by length without leading zeros, then
    digits: no int() of an unbounded run), the text between them as text. ``re.split`` with a
    group alternates text and digits, so every position compares like with like.

    >>> sorted(["mlx5_10", "mlx5_9", "mlx5_1" + "0" * 5000], key=_natural)[:2]
    ['mlx5_9', 'mlx5_10']
    """
    return [(len(t.lstrip("0")), t.lstrip("0"), t) if i % 2 else t for i, t in enumerate(re.split(r"([0-9]+)", name))]


def _nic_rate(topo: TopoMatrix, base: NodeSpec, name: str) -> float:
    """The XML's speed, else the base NIC of that name's rate, else the base's first NIC's."""
    same = [n for n in base.nics if n.name == name] or list(base.nics)
    speed = topo.nic_speed_gbit_per_s[topo.nics.index(name)]
    if speed or same:
        return speed or same[0].rate_gbit_per_s
    raise ConfigError("nics", f"no rate for {name}: {topo.source} gives none and {base.name} has no NIC; "
                              "use the NCCL XML dump (it has speed=) or a base node with NICs")


#: ``NodeSpec.busbw`` classes measured on the node's NVLink (nccl-tests on its GPUs through
#: NVSwitch, catalog/nccl.toml): a topology keeps them only when its GPU-GPU links are that NVLink.
NVLINK_CURVES = ("nvlink", "nvls")


def nvlink_difference(topo: TopoMatrix, base: NodeSpec) -> Optional[str]:
    """Why ``topo``'s GPU-GPU links are not ``base``'s NVLink, or None when they match: every
    two GPUs of one NVLink domain (``base.nvlink_domain_gpus``, the node when 0) joined by
    ``NV#`` with one # for every pair (an NVSwitch node, as the curves were measured), equal to
    ``base.nvlinks_per_gpu`` when the catalog states it (H100: NV18, A100: NV12). The GPU model
    is :func:`gpu_difference`'s.

    >>> from meshplan.catalog import node
    >>> from meshplan.placement.topology import parse_nvidia_smi_topo
    >>> text = "\\tGPU0\\tGPU1\\nGPU0\\t X \\tNV8\\nGPU1\\tNV8\\t X \\n"
    >>> base = node("dgx-h100").model_copy(update={"gpus": 2, "nvlink_domain_gpus": 2})
    >>> nvlink_difference(parse_nvidia_smi_topo(text), base)
    'GPUs are joined by NV8, dgx-h100 by NV18'
    """
    d = min(base.nvlink_domain_gpus or base.gpus, base.gpus)
    levels: dict[str, tuple[int, int]] = {}
    for i, a in enumerate(topo.gpus):
        for j, b in enumerate(topo.gpus):
            lvl = topo.gpu_gpu[i][j]
            if a < b and a // d == b // d:
                if not lvl.startswith("NV"):
                    return f"GPUs {a} and {b} are joined by {lvl}, not NVLink"
                levels.setdefault(lvl, (a, b))
    if len(levels) > 1:
        pairs = ", ".join(f"{lvl} ({a}-{b})" for lvl, (a, b) in sorted(levels.items()))
        return f"GPU pairs have different NVLink counts: {pairs}, not one NVSwitch count"
    want = f"NV{base.nvlinks_per_gpu}"
    if levels and base.nvlinks_per_gpu and want not in levels:
        return f"GPUs are joined by {next(iter(levels))}, {base.name} by {want}"
    return None


def gpu_difference(topo: TopoMatrix, gpu: Optional[GPUSpec]) -> Optional[str]:
    """Why ``topo``'s GPUs are not ``gpu``, or None when they may be: an NCCL XML's ``sm``
    (compute capability x 10) other than ``gpu.cuda_sm``. None when either is unknown
    (``nvidia-smi topo -m`` does not name the GPU)."""
    if gpu is None or not gpu.cuda_sm:
        return None
    other = sorted({sm for sm in topo.gpu_sm if sm is not None and sm != gpu.cuda_sm})
    if other:
        return f"its GPUs are sm {', '.join(map(str, other))}, {gpu.name} is sm {gpu.cuda_sm}"
    return None


def curve_difference(topo: TopoMatrix, base: NodeSpec, gpu: Optional[GPUSpec] = None) -> Optional[str]:
    """Why ``base``'s NVLink curves do not hold on ``topo``'s node (:func:`gpu_difference`, then
    :func:`nvlink_difference`), or None when they do."""
    return gpu_difference(topo, gpu) or nvlink_difference(topo, base)


def _kept_busbw(topo: TopoMatrix, base: NodeSpec, gpu: Optional[GPUSpec]) -> dict:
    """``base.busbw`` without :data:`NVLINK_CURVES` when :func:`curve_difference` finds one."""
    if curve_difference(topo, base, gpu) is None:
        return dict(base.busbw)
    return {k: v for k, v in base.busbw.items() if k not in NVLINK_CURVES}


def node_from_topology(topo: TopoMatrix, base: NodeSpec, nics: Optional[Sequence[str]] = None,
                       threads_per_core: Optional[int] = None, gpu: Optional[GPUSpec] = None) -> NodeSpec:
    """``base`` with sockets and NICs read from ``topo``; fabric, PCIe link, NVLink domain,
    (unless the XML gives ``speed``) NIC rates and the measured ``busbw`` curves stay those of
    ``base``, but for the NVLink curves when the topology's GPUs are not ``gpu`` (the cluster's,
    when given) or its GPU-GPU links are not ``base``'s NVLink (:func:`curve_difference`;
    :func:`topology_notes` says which were dropped and why).

    - Sockets: one per NUMA node holding a GPU (or, from the XML, a NIC), with its GPUs
      and its physical cores = logical CPUs of the affinity / threads per core (2 when the
      list is two runs with the sibling offset, ``0-55,112-167`` -> 56; see
      :func:`meshplan.placement.cpus.physical_cores`).
    - NICs: ``nics`` when given; else the base's NIC names when the topology has them all
      (so storage NICs drop out), else the NICs with a GPU under their PCIe switch
      (:func:`near_gpus`: a front-end ``mlx5_bond_0`` drops out) in natural name order. A NIC's ``gpus``
      are the GPUs for which it is among the nearest NICs at level PIX or PXB (same PCIe
      switch); ``rail``: the base's rails when the NICs are the base's, else the index.

    Raises ConfigError when the GPU count differs from ``base`` or a NIC's socket or rate
    cannot be told.
    """
    if sorted(topo.gpus) != list(range(base.gpus)):
        raise ConfigError(topo.source, f"topology has GPUs {list(topo.gpus)} but {base.name} has {base.gpus}; "
                                       f"pick a base node with {len(topo.gpus)} GPUs")
    sockets, index, gpu_socket = _sockets(topo, base, threads_per_core)
    names = _chosen_nics(topo, base, nics)
    cols = [topo.nics.index(n) for n in names]
    under: dict[str, list[int]] = {n: [] for n in names}
    for i, dev in enumerate(topo.gpus):
        levels = [topo.gpu_nic[i][j] for j in cols]
        best = min(levels, key=LEVELS.index, default="SYS")
        if best in SAME_SWITCH:
            for n, lvl in zip(names, levels):
                if lvl == best:
                    under[n].append(dev)
    rails = {n.name: n.rail for n in base.nics} if [n.name for n in base.nics] == names else {}
    try:
        specs = [NICSpec(name=n, rate_gbit_per_s=_nic_rate(topo, base, n), gpus=sorted(under[n]),
                         socket=_nic_socket(topo, j, gpu_socket, index), rail=rails.get(n, k))
                 for k, (n, j) in enumerate(zip(names, cols))]
        return NodeSpec(
            name=base.name, gpus=base.gpus, fabric=base.fabric, pcie=base.pcie, sockets=sockets, nics=specs,
            nvlink_domain_gpus=base.nvlink_domain_gpus, nvlinks_per_gpu=base.nvlinks_per_gpu,
            busbw=_kept_busbw(topo, base, gpu),
            source=f"sockets and NICs from {topo.source}; fabric, PCIe, NIC rates and measured curves from {base.name}")
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        why = bound_message(first) or first["msg"].removeprefix("Value error, ")
        raise ConfigError(topo.source, f"topology gives an invalid node ({where}: {why}); pass the unmodified "
                                       "output of `nvidia-smi topo -m` or NCCL_TOPO_DUMP_FILE") from None


def topology_notes(topo: TopoMatrix, base: NodeSpec, node: NodeSpec, nics: Optional[Sequence[str]] = None,
                   gpu: Optional[GPUSpec] = None) -> list[str]:
    """What ``--topology`` changed beyond sockets and NIC affinity, one line each (the CLI
    prints them as ``note:``): the measured curves dropped (:func:`curve_difference`), the
    NICs with no GPU under their PCIe switch left out of the compute NICs (unless ``nics``
    names them), and NICs shared by unequal GPU counts (:meth:`NodeSpec.nic_of`). ``node``:
    :func:`node_from_topology`'s result for ``topo`` and ``base``."""
    out = []
    why = curve_difference(topo, base, gpu)
    dropped = [k for k in NVLINK_CURVES if k in base.busbw]
    if why and dropped:
        out.append(f"{topo.source}: {why}: {base.name}'s measured {' and '.join(dropped)} busbw curves "
                   f"(measured on its GPUs and NVLink) are dropped; its intra-node collectives are timed at the "
                   f"fabric's line rate ({base.fabric.name}, {base.fabric.bandwidth_gb_per_s:g} GB/s)")
    kept = {n.name for n in node.nics}
    far = [n for n in topo.nics if n not in kept and not near_gpus(topo, n)]
    if far and nics is None:
        verb, them = ("has", "its") if len(far) == 1 else ("have", "their")
        out.append(f"{topo.source}: {', '.join(far)} {verb} no GPU under {them} PCIe switch (no PIX or PXB): "
                   f"not {'a compute NIC' if len(far) == 1 else 'compute NICs'}, left out of the plan and of "
                   "NCCL_IB_HCA")
    share = _sharing(node)
    if share:
        out.append(f"{topo.source}: {share}")
    return out


def _sharing(node: NodeSpec) -> str:
    """``3 compute NICs for 8 GPUs share unevenly (3/3/2 GPUs per NIC): mlx5_0 GPUs 0,1,2; ...``
    when the NICs serve unequal GPU counts by :meth:`NodeSpec.nic_of`; "" otherwise."""
    served: dict[int, list[int]] = {k: [] for k in range(len(node.nics))}
    for gpu in range(node.gpus):
        k = node.nic_of(gpu)
        if k is not None:
            served[k].append(gpu)
    counts = [len(g) for g in served.values()]
    if len(set(counts)) <= 1:
        return ""
    each = "; ".join(f"{node.nics[k].name} GPUs {','.join(map(str, g)) or 'none'}" for k, g in served.items())
    return (f"{len(node.nics)} compute NICs for {node.gpus} GPUs share unevenly ({'/'.join(map(str, counts))} GPUs "
            f"per NIC): {each}")


def _closeness(node: NodeSpec, gpu: int, nic: int) -> tuple[int, str]:
    """(0, "same PCIe switch") / (1, "same socket, other switch") / (2, "other socket")."""
    spec = node.nics[nic]
    if gpu in spec.gpus:
        return 0, "same PCIe switch"
    if spec.socket == node.socket_of(gpu):
        return 1, "same socket, other switch"
    return 2, "other socket"


def check_identity_nic_map(node: NodeSpec) -> list[str]:
    """One line per GPU for which the index shortcut GPU k -> NIC k (k mod the NIC count,
    as ``local_rank % n_nics`` launch scripts do) lands on a farther NIC than the topology's
    (:meth:`NodeSpec.nic_of`). Empty when the shortcut is as good everywhere.

    >>> from meshplan.catalog import node
    >>> check_identity_nic_map(node("dgx-h100"))
    []
    >>> check_identity_nic_map(node("seed-8x8-2nic"))[0]
    'GPU 1: index map gives nic1 (other socket) but the topology gives nic0 (same PCIe switch); bind GPU 1 to nic0'
    """
    out = []
    for gpu in range(node.gpus):
        real = node.nic_of(gpu)
        if real is None:
            continue
        naive = gpu % len(node.nics)
        (rn, rw), (nn, nw) = _closeness(node, gpu, real), _closeness(node, gpu, naive)
        if nn > rn:
            out.append(f"GPU {gpu}: index map gives {node.nics[naive].name} ({nw}) but the topology gives "
                       f"{node.nics[real].name} ({rw}); bind GPU {gpu} to {node.nics[real].name}")
    return out
