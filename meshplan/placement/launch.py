"""``meshplan launch``: a multi-node torchrun command, a Slurm sbatch script and a per-rank
bindings wrapper for a :class:`~meshplan.placement.assign.Placement`.

Three files, in one folder (:func:`write_launch`):

- ``bind.sh``: torchrun's program (``--no-python``). It first checks that torchrun's node
  ``GROUP_RANK`` is the node the plan puts on this host (its place in ``--hosts``, else
  ``NODE_RANK`` or ``SLURM_NODEID``; :func:`meshplan.placement.rendezvous.group_check_lines`), else
  stops with one line. For the process of node ``GROUP_RANK``
  and ``LOCAL_RANK`` it checks that torchrun's ``RANK`` is the one the placement expects,
  exports that rank's environment (below) and execs the training command under ``numactl``
  (or ``taskset``) with the rank's cores and memory node; without ``numactl`` on the host it stops
  with one line naming the package and ``MESHPLAN_NO_NUMA=1``, which runs the ranks unbound
  (:data:`~meshplan.placement.bind_nodes.NUMA_CHECK`). Nodes with the same bindings by
  LOCAL_RANK (every node of a node-major placement on one node type) share one table, the
  RANK checked as ``GROUP_RANK x G + LOCAL_RANK``'s offset; a node that differs keeps its own.
- ``torchrun.sh``: ``torchrun --nnodes N --nproc-per-node G`` with the static rendezvous at
  ``MESHPLAN_RDZV_ENDPOINT`` (default: the endpoint given at generation; the plan's node 0 hosts
  its TCPStore) and ``--node-rank`` this host's node in the plan (:mod:`meshplan.placement.rendezvous`,
  which cites torch's source: the c10d backend ignores ``--node-rank`` and numbers nodes by sorted
  host name, so the plan's NIC, NUMA and rail placement would land on whichever host sorts there).
  ``TORCHRUN`` overrides the command (e.g. ``python -m torch.distributed.run``).
- ``job.sbatch``: ``sbatch`` script: one task per node, all the node's GPUs and cores
  (``--exclusive``), the plan's node 0 as the rendezvous endpoint (the first of ``--hosts``, else
  the allocation's first host), and
  ``srun`` running ``torchrun.sh`` on every node with ``--cpu-bind=none`` (the wrapper binds)
  and ``--cpus-per-task`` given again (:func:`_srun`: Slurm >= 22.05 srun does not inherit it),
  found from the submit directory (``SLURM_SUBMIT_DIR``), not by the absolute path it was
  written at (:func:`sbatch_script`); the folder must be on a filesystem the nodes share.
- ``bindings.json``: every rank's binding and environment (:func:`launch_bindings`).

Environment of each rank (``env`` of :func:`launch_bindings`, each explained in ``bind.sh``
from :data:`meshplan.placement.nccl_env.ENV_DOC`, whose module cites each one's source; built by
:func:`meshplan.placement.nccl_env.rank_env`, which ``place --bindings`` uses too: the same
variables, ``place``'s ``--visible one`` only changing CUDA_VISIBLE_DEVICES):

- ``CUDA_VISIBLE_DEVICES`` lists the node's GPUs in LOCAL_RANK order, so a script that
  uses ``cuda:{LOCAL_RANK}`` (torchtitan's train.py: ``torch.device(f"cuda:{LOCAL_RANK}")``)
  gets its planned GPU and still sees every GPU of the node (nothing hidden, so CUDA and NCCL
  see the node as it is). Hiding all but one GPU (``place --bindings``' default ``visible="one"``) breaks such scripts
  for LOCAL_RANK > 0.
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA numbers devices fastest-first by default; the
  catalog's and ``nvidia-smi``'s GPU indices are PCI bus order (CUDA C programming guide,
  "CUDA Environment Variables").
- InfiniBand (``transport="ib"``): ``NCCL_IB_HCA==<nic>:<port>,...`` (exact match, see
  :mod:`meshplan.placement.bindings`): every compute NIC of the node (``nic_scope="node"``, the
  default: NCCL picks the nearest and can use PXN) or the rank's own (``"rank"``), plus the
  bootstrap interface ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` when ``socket_ifname``
  is given; ``NCCL_CROSS_NIC=0`` (every ring and tree on one rail) only with ``nic_scope="node"``
  on a rail-optimized node whose network is oversubscribed between rails, else not written
  (NCCL's default 2: :func:`meshplan.placement.nccl_env.cross_nic`, which says why).
- Sockets (``transport="socket"``): ``NCCL_SOCKET_IFNAME==<iface>``, ``GLOO_SOCKET_IFNAME``,
  ``NCCL_IB_DISABLE=1``, ``<iface>`` an IP interface: ``socket_ifname`` for every rank, else
  the rank's NIC's ``ifname``; without either a ConfigError names ``--socket-ifname``
  (the catalog's NIC names are InfiniBand HCAs, which no IP interface is called).

Every value that comes from input (program arguments, endpoint, host names, NIC names, job
name) is either checked against a strict pattern (:func:`check_options`; a ConfigError
names the option) or written through :func:`shlex.quote`.

>>> from meshplan.catalog import system
>>> from meshplan.placement.assign import place
>>> b = launch_bindings(place(system("dgx-h100", 2), 16), LaunchOptions(program=("python", "train.py")))
>>> b[9]["process_rank"], b[9]["local_rank"], b[9]["env"]["CUDA_VISIBLE_DEVICES"], b[9]["nic"]
(9, 1, '0,1,2,3,4,5,6,7', 'mlx5_3')
>>> b[9]["env"]["NCCL_IB_HCA"], "NCCL_CROSS_NIC" in b[9]["env"]   # non-blocking spine: NCCL's default
('=mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_9:1,mlx5_10:1,mlx5_11:1', False)
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshplan.errors import ConfigError
from meshplan.fileio import check_destination, write_output
from meshplan.output_ledger import edited_files, edited_words, owned, remember
from meshplan.placement.assign import Placement
from meshplan.placement.bind_nodes import NUMA_CHECK, local_case, node_list, shared_nodes
from meshplan.placement.bindings import LAUNCH_VISIBLE, NIC_SCOPE, all_bindings, launch_mode
from meshplan.placement.nccl_env import env_comments
from meshplan.placement import rendezvous
from meshplan.placement.rendezvous import group_check_lines
from meshplan.placement.slurm_lines import find_folder_lines, local_folder_note, srun_lines  # noqa: F401 (local_folder_note: launch's API)

_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$|^\[[0-9A-Fa-f:.]+\]$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")
CPU_BIND = ("numactl", "taskset", "none")

#: bind.sh's lines on why numactl binds memory strictly (``--membind``, numactl(8): allocations past the
#: node fail), not ``--preferred`` (falls back): NVIDIA's DGX ``bind.sh`` (MLPerf training) ``--mem=node``.
MEMBIND_COMMENT = [
    "# numactl --membind (strict), as NVIDIA's bind.sh for DGX clusters does (--mem=node, its default): a rank's",
    "# host memory (pinned buffers for its GPU's copies) only from its GPU's socket. numactl(8): an allocation past",
    "# that node fails; --preferred would spill to the far socket instead, slowing host-GPU copies unnoticed.",
    "# A job that needs more host memory than a socket holds (CPU offload): meshplan launch --cpu-bind taskset",
    "# (cores only, memory local first with fallback, the kernel's default)."]

@dataclass(frozen=True)
class LaunchOptions:
    """What ``meshplan launch`` writes. ``program``: the training command (argv); the
    rendezvous endpoint ``host:port`` (None: Slurm's first host at ``port``); ``hosts``:
    Slurm ``--nodelist``; ``transport``/``nic_scope`` as in :mod:`~meshplan.placement.bindings`;
    ``socket_ifname``: the bootstrap interface under ``ib``, the data interface under
    ``socket``; ``cpu_bind``: numactl, taskset
    or none; Slurm ``job_name``, ``partition``, ``time_limit``; ``env``: variables ``torchrun.sh``
    exports to every process (name, value, or None to unset it, why: a comment above it), such as
    Megatron-LM's ``CUDA_DEVICE_MAX_CONNECTIONS`` (:func:`meshplan.interop.megatron_env.launch_env`)."""

    program: tuple[str, ...]
    rdzv_endpoint: Optional[str] = None
    port: int = 29500
    hosts: tuple[str, ...] = ()
    transport: str = "ib"
    nic_scope: str = NIC_SCOPE
    socket_ifname: Optional[str] = None
    cpu_bind: str = "numactl"
    job_name: str = "meshplan"
    partition: Optional[str] = None
    time_limit: str = "01:00:00"
    env: tuple[tuple[str, Optional[str], str], ...] = ()


def parse_endpoint(text: str, field_name: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``host:port`` -> (host, port); ConfigError naming ``field_name`` otherwise.

    >>> parse_endpoint("node-001:29500")
    ('node-001', 29500)
    >>> parse_endpoint("a;rm -rf /:1")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --rdzv-endpoint: 'a;rm -rf /:1' is not HOST:PORT (host: letters, digits, '.', '-'; port 1-65535)
    """
    host, sep, port = text.rpartition(":")
    bad = ConfigError(field_name, f"{text!r} is not HOST:PORT (host: letters, digits, '.', '-'; port 1-65535)")
    if not sep or not _HOST.match(host) or not (port.isascii() and port.isdigit() and len(port) <= 5) \
            or not 1 <= int(port) <= 65535:
        raise bad
    return host, int(port)


def check_program(program) -> None:
    """ConfigError naming PROGRAM for a training command bind.sh cannot run: none, or a first word
    that is a Python file (``train.py``): bind.sh ``exec "$@"`` runs it as a command
    (torchrun ``--no-python``), which works only for an executable file with a ``#!`` line, found on
    PATH unless it has a ``/``; ``python train.py`` always runs.

    >>> check_program(("python", "train.py"))
    >>> check_program(("train.py", "--steps", "10"))
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: PROGRAM: 'train.py' is a Python file, but bind.sh execs the program as a command (torchrun --no-python), so it runs only if executable, with a #! line, and on PATH; give -- python train.py --steps 10
    """
    if not program:
        raise ConfigError("PROGRAM", "give the training command after `--`, e.g. -- python train.py")
    if program[0].endswith(".py"):
        raise ConfigError("PROGRAM", f"{program[0]!r} is a Python file, but bind.sh execs the program as a command "
                                     f"(torchrun --no-python), so it runs only if executable, with a #! line, and on "
                                     f"PATH; give -- python {_sh(program)}")


def check_options(placement: Placement, opts: LaunchOptions) -> None:
    """ConfigError (naming the option) for anything :func:`write_launch` would not write safely."""
    check_program(opts.program)
    if opts.rdzv_endpoint is not None:
        parse_endpoint(opts.rdzv_endpoint)
    if not 1 <= opts.port <= 65535:
        raise ConfigError("--port", f"{opts.port} is not a TCP port (1-65535)")
    for h in opts.hosts:
        if not _HOST.match(h):
            raise ConfigError("--hosts", f"{h!r} is not a host name (letters, digits, '.', '-')")
    nodes = int(placement.node.max()) + 1
    if opts.hosts and len(opts.hosts) != nodes:
        raise ConfigError("--hosts", f"{len(opts.hosts)} hosts given, the placement uses {nodes} nodes")
    for name, value in (("--job-name", opts.job_name), ("--partition", opts.partition),
                        ("--socket-ifname", opts.socket_ifname)):
        if value is not None and not _NAME.match(value):
            raise ConfigError(name, f"{value!r}: use 1-64 letters, digits, '_', '.', '-'")
    if not _TIME.match(opts.time_limit):
        raise ConfigError("--time", f"{opts.time_limit!r} is not a Slurm time (e.g. 01:00:00 or 2-00:00:00)")
    if opts.cpu_bind not in CPU_BIND:
        raise ConfigError("--cpu-bind", f"{opts.cpu_bind!r} is not one of {list(CPU_BIND)}")
    for nic in placement.cluster.node.nics:
        for name in (nic.name, nic.ifname or "x"):
            if not _NAME.match(name):
                raise ConfigError("cluster.node.nics", f"NIC name {name!r}: use letters, digits, '_', '.', '-'")


def launch_bindings(placement: Placement, opts: LaunchOptions) -> list[dict]:
    """Every mesh rank's binding (:func:`meshplan.placement.bindings.all_bindings` with the
    node's GPUs visible in LOCAL_RANK order), its ``env`` completed as the module docstring
    says, and ``cpu``: the argv prefix that binds its cores (empty with ``cpu_bind="none"``)."""
    check_options(placement, opts)
    rows = all_bindings(placement, transport=opts.transport, nic_scope=opts.nic_scope, visible=LAUNCH_VISIBLE,
                        socket_ifname=opts.socket_ifname)
    for b in rows:  # env: nccl_env.rank_env, as place --bindings writes it
        b["cpu"] = ({"numactl": ["numactl", f"--physcpubind={b['cores']}", f"--membind={b['socket']}"],
                     "taskset": ["taskset", "-c", b["cores"]], "none": []})[opts.cpu_bind]
    return rows


def _sh(argv) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def bind_script(placement: Placement, opts: LaunchOptions) -> str:
    """``bind.sh`` (see the module docstring): per GROUP_RANK and LOCAL_RANK, a RANK check,
    the rank's exports and ``exec <cpu binding> "$@"``. Nodes whose bindings are the same by
    LOCAL_RANK (:func:`~meshplan.placement.bind_nodes.shared_nodes`: every rank's GPU, cores, NIC
    and environment, its RANK and mesh rank the node's first plus LOCAL_RANK's offset) share one
    ``case $LOCAL_RANK``,
    which checks ``RANK = GROUP_RANK x G + offset``; the others keep their own (a node with
    another GPU order, a partial last node). First, GROUP_RANK must be this host's node in the
    plan (:func:`~meshplan.placement.rendezvous.group_check_lines`). 4,096 ranks on 512 dgx-h100:
    70 lines (5.7 kB; 65 with ``cpu_bind="none"``, without :data:`MEMBIND_COMMENT`), not 18,449 (1.3 MB)."""
    rows, cl, g = launch_bindings(placement, opts), placement.cluster, placement.cluster.node.gpus
    by_node: dict[int, list[dict]] = {}
    for b in rows:
        by_node.setdefault(b["node"], []).append(b)
    nodes, shared = max(by_node) + 1, shared_nodes(by_node, g)
    out = ["#!/bin/sh",
           f"# meshplan launch: per-rank bindings of {placement.world} ranks on {nodes} "
           f"node(s) x {g} GPUs ({cl.node.name}); launch {launch_mode(placement)}.",
           "# torchrun's program (--no-python): torchrun sets GROUP_RANK, LOCAL_RANK and RANK.",
           "# What each variable does:"]
    out += env_comments(cl, rows, opts.transport, opts.nic_scope)
    if opts.cpu_bind == "numactl":
        out += MEMBIND_COMMENT
    if launch_mode(placement) == "by-gpu":
        out.append("# Ranks are placed by rank_to_gpu: process RANK = global GPU; build the DeviceMesh from "
                   "bindings.json's mesh ranks (DeviceMesh(..., mesh=...)), not init_device_mesh.")
    out += ["set -eu", "expect() {", '  if [ "${RANK:-}" != "$1" ]; then',
            '    echo "meshplan bind.sh: node $GROUP_RANK local rank $LOCAL_RANK has RANK=${RANK:-unset}, '
            'expected $1 (nproc-per-node or node count differs from the plan)" >&2; exit 1', "  fi", "}",
            *group_check_lines(opts.hosts, nodes),
            'node=${GROUP_RANK:-}', 'case "$node" in', f"  ''|*[!0-9]*|0?*) node={nodes} ;;  # not a node number",
            "esac",
            f'if [ "$node" -ge {nodes} ]; then',
            '  echo "meshplan bind.sh: no binding for node ${GROUP_RANK:-unset}" >&2; exit 1', "fi"]
    if opts.cpu_bind == "numactl":
        out += NUMA_CHECK
    own = sorted(set(by_node) - set(shared))
    if own:
        out.append('case "$node" in')
        for node in own:
            out += [f"{node})", *local_case([(b, str(b["process_rank"]), f"mesh rank {b['rank']}")
                                             for b in by_node[node]], "  "), "  ;;"]
        out.append("esac")
    if shared:
        first = by_node[shared[0]]
        out += [f"# node{'s' if len(shared) > 1 else ''} {node_list(shared, nodes, own)}: the same bindings "
                f"by LOCAL_RANK; RANK = GROUP_RANK x {g} + offset"]
        if len(shared) + len(own) < nodes:  # nodes the placement leaves out have no binding
            out.append(f'case "$node" in {"|".join(map(str, shared))}) ;; *) echo "meshplan bind.sh: no binding '
                       'for node $node" >&2; exit 1 ;; esac')
        base = shared[0] * g
        out += local_case([(b, f"$((node * {g} + {b['process_rank'] - base}))",
                             f"mesh rank GROUP_RANK x {g} + {b['rank'] - base}") for b in first], "")
    else:
        out.append('echo "meshplan bind.sh: no binding for node $node" >&2; exit 1')
    return "\n".join(out + [""])


def torchrun_script(placement: Placement, opts: LaunchOptions) -> str:
    """``torchrun.sh`` (see the module docstring; :func:`meshplan.placement.rendezvous.torchrun_script`)."""
    check_options(placement, opts)
    return rendezvous.torchrun_script(placement, opts)


def sbatch_script(placement: Placement, opts: LaunchOptions, folder: Path) -> str:
    """``job.sbatch`` (see the module docstring); ``folder``: where ``torchrun.sh`` lies, as
    ``--out`` gave it. sbatch runs a copy of the script from Slurm's spool, so its own path is
    not the folder: the job finds it from the directory sbatch ran in (``SLURM_SUBMIT_DIR``, the
    job's working directory by default, sbatch's man page), as Slurm scripts name their files:
    ``folder`` under it when relative (``sbatch out/launch/x/job.sbatch`` from where ``meshplan
    launch`` ran, as its ``run:`` line says), ``folder`` itself when absolute, else the submit
    directory itself (``cd out/launch/x && sbatch job.sbatch``); ``MESHPLAN_LAUNCH_DIR`` overrides
    it. Not found: one line naming both and that the nodes must share the folder (exit 1)."""
    check_options(placement, opts)
    nodes, node = int(placement.node.max()) + 1, placement.cluster.node
    cores = sum(s.cores for s in node.sockets)
    head = [f"#SBATCH --job-name={opts.job_name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={node.gpus}", f"#SBATCH --cpus-per-task={cores}", "#SBATCH --exclusive",
            f"#SBATCH --time={opts.time_limit}"]
    if opts.hosts:
        head.append(f"#SBATCH --nodelist={','.join(opts.hosts)}")
    if opts.partition:
        head.append(f"#SBATCH --partition={opts.partition}")
    endpoint = (shlex.quote(opts.rdzv_endpoint) if opts.rdzv_endpoint  # the plan's node 0 (torchrun.sh: rendezvous)
                else shlex.quote(f"{opts.hosts[0]}:{opts.port}") if opts.hosts
                else f'"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):{opts.port}"')
    return "\n".join(["#!/bin/bash", *head,
                      f"# meshplan launch: {placement.world} ranks, {nodes} node(s) x {node.gpus} GPUs ({node.name}).",
                      "# One srun task per node runs torchrun.sh; the plan's node 0 hosts the rendezvous: "
                      + (f"{opts.hosts[0]}, the first of --hosts (Slurm's SLURM_NODEID order is its own)." if opts.hosts
                         else "SLURM_NODEID 0, the allocation's first host."),
                      "set -euo pipefail",
                      f"export MESHPLAN_RDZV_ENDPOINT=${{MESHPLAN_RDZV_ENDPOINT:-{endpoint}}}",
                      'export MESHPLAN_RDZV_ID="$SLURM_JOB_ID"', *find_folder_lines(folder), *srun_lines(cores)])


FILES = ("bind.sh", "torchrun.sh", "job.sbatch", "bindings.json")


def check_launch_folder(folder, force: bool = False) -> Path:
    """``folder`` (``--out``) checked as :func:`write_launch` writes it: a writable folder (its
    parent must exist) holding none of :data:`FILES` unless ``force`` (or each is meshplan's own
    unchanged output under out/, :func:`meshplan.output_ledger.owned`); else a ConfigError naming
    --out and --force. ``meshplan launch`` calls it before planning, and :func:`write_launch` again."""
    folder = check_destination(folder, "--out", force=True, folder=True)
    taken = [name for name in FILES if (folder / name).exists() and not owned(folder / name)]
    if taken and not force:  # the files edited since meshplan wrote them, by name; else the first taken
        edits = [name for name in edited_files(folder) if name in taken]
        what = f"{folder}: {edited_words(edits)}" if edits else f"{folder / taken[0]} exists"
        raise ConfigError("--out", f"{what}; choose another folder or pass --force to replace it")
    return folder


def write_launch(folder, placement: Placement, opts: LaunchOptions, force: bool = False) -> list[Path]:
    """Write :data:`FILES` into ``folder`` (scripts 0755, JSON 0644). Refuses, before writing
    anything, when one of them exists unless ``force`` (ConfigError naming --out); the folder is
    recorded as meshplan's own under out/ (:func:`meshplan.output_ledger.remember`), so a rerun replaces it."""
    folder = check_launch_folder(folder, force)
    texts = {"bind.sh": bind_script(placement, opts), "torchrun.sh": torchrun_script(placement, opts),
             "job.sbatch": sbatch_script(placement, opts, folder),
             "bindings.json": json.dumps(launch_bindings(placement, opts), indent=1) + "\n"}
    paths = [write_output(folder / name, texts[name], force=True, mode=0o644 if name.endswith(".json") else 0o755,
                          create_folders=True) for name in FILES]
    remember(folder)
    return paths
