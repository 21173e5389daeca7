"""Per-rank launch bindings from a :class:`~meshplan.placement.assign.Placement`: the GPU each
process sees, the NIC NCCL may use, the CPU cores and memory node it runs on.

Conventions (each one a choice; the docstrings say which):

- Launch. torchrun gives process RANK = node * nproc_per_node + LOCAL_RANK and sets
  LOCAL_RANK and GROUP_RANK (the node). When every rank sits on its node-major node
  (``placement.node[r] == r // gpus_per_node``: the default, or a permutation inside nodes)
  the process of RANK r is mesh rank r and only its visible GPU changes ("node-major").
  Otherwise ("by-gpu") the process on global GPU g has RANK g and hosts mesh rank
  ``argsort(rank_to_gpu)[g]``: build the DeviceMesh from ``rank_to_gpu`` reshaped to the
  mesh shape (``DeviceMesh("cuda", mesh=...)``), since init_device_mesh numbers ranks
  node-major.
- Environment: :func:`meshplan.placement.nccl_env.rank_env`, the same as ``meshplan launch``
  writes (CUDA_DEVICE_ORDER=PCI_BUS_ID, and NCCL_CROSS_NIC=0 on a network oversubscribed between
  rails), besides the GPU and NIC variables below.
- Visible GPU. ``visible="one"`` (the usual way): CUDA_VISIBLE_DEVICES is the rank's own
  local GPU and the process uses ``cuda:0`` (``torch.cuda.set_device(LOCAL_RANK)`` would
  fail for LOCAL_RANK > 0). ``visible="all"``: every process of a node sees the node's GPUs
  listed in LOCAL_RANK order, so ``cuda:LOCAL_RANK`` is its GPU.
- NIC. ``transport="ib"``: NCCL_IB_HCA with the ``=`` prefix, which makes NCCL match the
  names exactly (without it ``mlx5_1`` also selects ``mlx5_10``..``mlx5_19``; NVIDIA NCCL
  user guide, Environment Variables, NCCL_IB_HCA), port 1 unless the name has one.
  ``transport="socket"``: NCCL_SOCKET_IFNAME ``=name`` (exact), GLOO_SOCKET_IFNAME ``name``
  and NCCL_IB_DISABLE=1, where ``name`` is an IP interface: ``socket_ifname`` when given,
  else the NIC's ``ifname`` (:class:`~meshplan.spec.cluster.NICSpec`); a NIC without one is
  a ConfigError naming ``--socket-ifname`` (its ``name`` is an HCA such as ``mlx5_0``, which
  NCCL_SOCKET_IFNAME would match no interface with). Under ``ib``, ``socket_ifname`` is the
  bootstrap interface (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME). ``nic_scope="node"`` (the
  default, :data:`NIC_SCOPE`) lists the node's compute NICs, the same list for every rank of a
  node, and lets NCCL choose by its own topology search: the NIC under the GPU's PCIe switch
  for its rings and trees, and PXN (on by default, NCCL_PXN_DISABLE=0), which moves a
  send/recv over NVLink to the GPU whose NIC is on the peer's rail. ``"rank"`` lists only the
  rank's NIC (NodeSpec.nic_of: under its PCIe switch): opt-in, at the cost :data:`RANK_SCOPE_TRADE` names.
- CPU. ``numactl --physcpubind=a-b --membind=<socket>`` and ``taskset -c a-b`` with the
  cores of :func:`meshplan.placement.assign.core_table`; core k is taken as logical CPU k (the
  first hardware thread of each core on Linux) and NUMA node = socket index (one NUMA node
  per socket: not so under SNC/NPS modes).

>>> from meshplan.catalog import system
>>> from meshplan.placement.assign import place
>>> b = bindings(place(system("dgx-h100", 1), 8), 5)
>>> b["nic"], b["env"]["NCCL_IB_HCA"], b["numactl"]
('mlx5_9', '=mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_9:1,mlx5_10:1,mlx5_11:1', 'numactl --physcpubind=70-83 --membind=1')
>>> bindings(place(system("dgx-h100", 1), 8), 5, nic_scope="rank")["env"]
{'CUDA_VISIBLE_DEVICES': '5', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID', 'NCCL_IB_HCA': '=mlx5_9:1'}
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Optional

import numpy as np

from meshplan.errors import ConfigError
from meshplan.fileio import write_output
from meshplan.placement.assign import Placement
from meshplan.placement.nccl_env import env_comments, rank_env
from meshplan.spec.cluster import NICSpec

_CHOICES = {"transport": ("ib", "socket"), "nic_scope": ("rank", "node"), "visible": ("one", "all")}
#: The NICs each rank's NCCL may use unless ``--nic-scope`` says otherwise: every compute NIC of the node, the
#: same NCCL_IB_HCA for each rank of a node. NCCL's maintainers advise against a different NCCL_IB_HCA per rank
#: (NVIDIA/nccl#1478: rings then fail to build) and against limiting it to one NIC (NVIDIA/nccl#1591: NCCL
#: assumes a rail-optimized fabric and picks the NIC nearest each GPU itself); only with every NIC listed can
#: PXN relay a send/recv through the NIC on the peer's rail (NCCL user guide, Environment Variables,
#: NCCL_PXN_DISABLE, NCCL_P2P_PXN_LEVEL).
NIC_SCOPE = "node"
#: What ``--nic-scope rank`` trades, printed when it is chosen (``place``, ``launch``).
RANK_SCOPE_TRADE = ("--nic-scope rank gives each rank only the HCA under its PCIe switch: a fixed NIC per rank, but "
                    "a different NCCL_IB_HCA per rank of a node, which NCCL does not support (NVIDIA/nccl#1478), "
                    "hides the node's other NICs from its NCCL, so PXN cannot relay through the NIC on a peer's "
                    "rail and no channel uses a second NIC; the default --nic-scope node lists every NIC and lets "
                    "NCCL pick the nearest")
#: What ``launch`` binds and ``place`` prints unless ``--visible`` says otherwise: every GPU of the node
#: visible, the process on ``cuda:{LOCAL_RANK}``, as torchtitan's and Megatron-LM's training scripts
#: expect (``torch.cuda.set_device(LOCAL_RANK)``; :mod:`meshplan.placement.launch`).
LAUNCH_VISIBLE = "all"
_SAFE = re.compile(r"[A-Za-z0-9_.:=,+@%/-]*")


def launch_mode(placement: Placement) -> str:
    """"node-major" when every rank r runs on node r // gpus_per_node, else "by-gpu"."""
    g = placement.cluster.node.gpus
    return "node-major" if np.array_equal(placement.node, np.arange(placement.world) // g) else "by-gpu"


def _check(opts: dict) -> None:
    for k, v in opts.items():
        if v not in _CHOICES[k]:
            raise ConfigError("--" + k.replace("_", "-"), f"{v!r} is not one of {list(_CHOICES[k])}")  # the CLI options


def _nics(placement: Placement, rank: int, scope: str) -> list[NICSpec]:
    nics, i = placement.cluster.node.nics, int(placement.nic[rank])
    if i < 0:
        return []
    return list(nics) if scope == "node" else [nics[i]]


def _ifnames(nics: list[NICSpec], node: str) -> list[str]:
    """The IP interfaces of ``nics`` (module docstring, NIC); ConfigError naming
    --socket-ifname for a NIC without one."""
    missing = [n.name for n in nics if n.ifname is None]
    if missing:
        raise ConfigError("--socket-ifname", f"--transport socket sets NCCL_SOCKET_IFNAME, which names IP interfaces, "
                                             f"but node {node}'s NIC {missing[0]} has no IP interface name (ifname); "
                                             "give --socket-ifname IFACE (e.g. eth0) or ifname on each "
                                             "cluster.node.nics entry")
    return list(dict.fromkeys(n.ifname for n in nics if n.ifname is not None))


def _nic_env(nics: list[NICSpec], node: str, transport: str, port: int,
             socket_ifname: Optional[str] = None) -> dict[str, str]:
    if transport == "socket":
        names = [socket_ifname] if socket_ifname else _ifnames(nics, node) if nics else []
        return {"NCCL_SOCKET_IFNAME": "=" + ",".join(names), "GLOO_SOCKET_IFNAME": ",".join(names),
                "NCCL_IB_DISABLE": "1"} if names else {}
    hcas = list(dict.fromkeys(n.name for n in nics))
    env = {"NCCL_IB_HCA": "=" + ",".join(n if ":" in n else f"{n}:{port}" for n in hcas)} if hcas else {}
    if socket_ifname:  # the bootstrap (and gloo) interface
        env.update(NCCL_SOCKET_IFNAME="=" + socket_ifname, GLOO_SOCKET_IFNAME=socket_ifname)
    return env


def _process(placement: Placement, rank: int, mode: str) -> tuple[int, int]:
    """(process RANK, LOCAL_RANK) hosting mesh rank ``rank`` under launch ``mode``."""
    g = placement.cluster.node.gpus
    proc = rank if mode == "node-major" else int(placement.global_gpu[rank])
    return proc, proc % g


def _visible_all(placement: Placement, mode: str) -> dict[int, str]:
    """Per node, its GPUs in LOCAL_RANK order (for ``visible="all"``)."""
    out: dict[int, list] = {}
    for r in range(placement.world):
        out.setdefault(int(placement.node[r]), []).append((_process(placement, r, mode)[1], int(placement.local_gpu[r])))
    return {n: ",".join(str(g) for _, g in sorted(pairs)) for n, pairs in out.items()}


def bindings(placement: Placement, rank: int, transport: str = "ib", nic_scope: str = NIC_SCOPE,
             visible: str = "one", port: int = 1, socket_ifname: Optional[str] = None) -> dict:
    """Binding of mesh rank ``rank`` (see the module docstring for each convention):
    rank, process_rank and local_rank (torchrun's RANK and LOCAL_RANK of the process that
    hosts it), node, gpu (local index), device, socket, cores, nic, env (variables to
    export), numactl and taskset prefixes. ``socket_ifname``: the IP interface (module
    docstring, NIC). Raises ConfigError for an unknown option, a rank out of range, or a
    socket transport without an IP interface name."""
    return all_bindings(placement, transport=transport, nic_scope=nic_scope, visible=visible, port=port,
                        ranks=[rank], socket_ifname=socket_ifname)[0]


def all_bindings(placement: Placement, transport: str = "ib", nic_scope: str = NIC_SCOPE, visible: str = "one",
                 port: int = 1, ranks=None, socket_ifname: Optional[str] = None) -> list[dict]:
    """:func:`bindings` of ``ranks`` (default every rank), in that order."""
    _check({"transport": transport, "nic_scope": nic_scope, "visible": visible})
    p, mode = placement, launch_mode(placement)
    ranks = range(p.world) if ranks is None else ranks
    for rank in ranks:
        if not 0 <= rank < p.world:
            raise ConfigError("rank", f"{rank} outside 0..{p.world - 1}")
    seen = _visible_all(p, mode) if visible == "all" else {}
    return [_binding(p, int(r), mode, transport, nic_scope, visible, port, seen, socket_ifname) for r in ranks]


def _binding(p: Placement, rank: int, mode: str, transport: str, nic_scope: str, visible: str, port: int,
             seen: dict[int, str], socket_ifname: Optional[str] = None) -> dict:
    proc, local = _process(p, rank, mode)
    node, gpu, sock = int(p.node[rank]), int(p.local_gpu[rank]), int(p.socket[rank])
    lo, hi = int(p.core_first[rank]), int(p.core_last[rank])
    cores = f"{lo}-{hi}" if hi > lo else str(lo)
    env = rank_env(p.cluster, str(gpu) if visible == "one" else seen[node],
                   _nic_env(_nics(p, rank, nic_scope), p.cluster.node.name, transport, port, socket_ifname),
                   transport, nic_scope)
    nic = int(p.nic[rank])
    return {"rank": rank, "process_rank": proc, "local_rank": local, "node": node, "gpu": gpu,
            "device": "cuda:0" if visible == "one" else f"cuda:{local}", "socket": sock, "cores": cores,
            "nic": p.cluster.node.nics[nic].name if nic >= 0 else None, "env": env,
            "numactl": f"numactl --physcpubind={cores} --membind={sock}", "taskset": f"taskset -c {cores}"}


def _q(value: str) -> str:
    """``value`` as one sh word: double-quoted when it holds only characters that mean
    nothing to sh (``_SAFE``), else single-quoted by ``shlex.quote`` (no expansion at all)."""
    return f'"{value}"' if _SAFE.fullmatch(value) else shlex.quote(value)


def _c(value) -> str:
    """``value`` for a ``#`` comment line: printable ASCII kept, anything else (a newline
    would end the comment and start a command) written as a ``\\xNN`` escape.

    >>> _c("mlx5_0\\nrm -rf ~")
    'mlx5_0\\\\x0arm -rf ~'
    """
    return "".join(ch if " " <= ch <= "~" else f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
                   for ch in str(value))


def to_sh(placement: Placement, **opts) -> str:
    """A POSIX sh launcher: per node (GROUP_RANK) a case on LOCAL_RANK that exports the
    rank's variables and execs the command under numactl. Use it as torchrun's program:
    ``torchrun --nnodes N --nproc-per-node G --no-python ./bind.sh python train.py``."""
    rows, mode, cl = all_bindings(placement, **opts), launch_mode(placement), placement.cluster
    out = ["#!/bin/sh",
           f"# meshplan bindings: {placement.world} ranks on {cl.nodes} node(s) x {cl.node.gpus} GPUs "
           f"({_c(cl.node.name)}); launch {mode}",
           f"# torchrun --nnodes {int(placement.node.max()) + 1} --nproc-per-node {cl.node.gpus} "
           "--no-python ./THIS_FILE python train.py ...",
           "# torchrun sets GROUP_RANK (node) and LOCAL_RANK (process on the node)."]
    out += ["# What each variable does:"] + [_c(x) for x in env_comments(
        cl, rows, opts.get("transport", "ib"), opts.get("nic_scope", NIC_SCOPE), opts.get("visible", "one"))]
    if mode == "by-gpu":
        out.append("# Ranks are placed by rank_to_gpu: process RANK = global GPU; build the DeviceMesh from it.")
    out += ["set -eu", 'case "$GROUP_RANK" in']
    by_node: dict[int, list[dict]] = {}
    for b in rows:
        by_node.setdefault(b["node"], []).append(b)
    for node in sorted(by_node):
        out += [f"{node})", '  case "$LOCAL_RANK" in']
        for b in sorted(by_node[node], key=lambda b: b["local_rank"]):
            env = " ".join(f"{k}={_q(v)}" for k, v in b["env"].items())
            nic = _c(b["nic"] or "-")
            out += [f"  {b['local_rank']}) # rank {b['rank']}: GPU {b['gpu']}, socket {b['socket']}, NIC {nic}",
                    f"    export {env}", f'    exec {b["numactl"]} "$@" ;;']
        out += ['  *) echo "meshplan: no binding for node $GROUP_RANK local rank $LOCAL_RANK" >&2; exit 1 ;;',
                "  esac ;;"]
    out += ['*) echo "meshplan: no binding for node $GROUP_RANK" >&2; exit 1 ;;', "esac", ""]
    return "\n".join(out)


def write_bindings(path, placement: Placement, fmt: str = "json", force: bool = False, **opts) -> Path:
    """Write :func:`all_bindings` as a JSON list (``fmt="json"``) or :func:`to_sh`
    (``fmt="sh"``, made executable) with :func:`meshplan.fileio.write_output`: atomic, an
    existing file refused unless ``force`` (ConfigError naming --bindings)."""
    if fmt not in ("json", "sh"):
        raise ConfigError("--format", f"{fmt!r} is not one of ['json', 'sh']")
    text = (json.dumps(all_bindings(placement, **opts), indent=2) + "\n" if fmt == "json"
            else to_sh(placement, **opts))
    return write_output(path, text, force=force, field="--bindings", mode=0o755 if fmt == "sh" else 0o644)
