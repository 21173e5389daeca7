"""Which host is which node of the plan: torchrun's static rendezvous with ``--node-rank``
(:func:`static_rdzv_args`, the one rule of ``launch``'s ``torchrun.sh``, :func:`torchrun_script`, and of
``validate --nnodes``, :func:`meshplan.runtime.execution.launch.torchrun_argv`) and ``bind.sh``'s check that torchrun's GROUP_RANK is that node
(:func:`group_check_lines`), for :mod:`meshplan.placement.launch`.

Why static, not c10d (torch 2.13, read in torch/distributed/run.py and elastic/rendezvous/): the c10d
backend ignores ``--node-rank`` (run.py ``config_from_args`` warns "node_rank is only used for static
rdzv_backend") and numbers the nodes by their sorted descriptors, FQDN then pid
(dynamic_rendezvous.py ``_mark_rendezvous_complete``: ``enumerate(sorted(state.participants))``), so
which host becomes GROUP_RANK k, and gets node k's GPUs, NICs, NUMA bindings and ranks, follows host
names, not the plan. The static backend takes ``rdzv_configs["rank"] = args.node_rank`` (run.py) as
the group rank (elastic/agent/server/api.py: ``group_rank = rdzv_info.rank``; RANK = group_rank x
nproc + LOCAL_RANK), needs the endpoint of node 0, which hosts the TCPStore
(static_tcp_rendezvous.py: ``is_master = self.rank == 0``; ``--rdzv-endpoint`` stands for
``--master-addr/--master-port``, run.py ``get_rdzv_endpoint``), and ``--nnodes`` nodes.

The plan's node index of a host (:func:`node_lines`): with ``--hosts``, the host's place in that list
(its Slurm name ``SLURMD_NODENAME``, else ``hostname``, whole or up to the first '.'), since Slurm
numbers the allocation's nodes (``SLURM_NODEID``) in its own sorted order, not ``--nodelist``'s
(sbatch(1), ``--nodelist``); ``NODE_RANK`` must then agree. Without ``--hosts``: ``NODE_RANK``, else
``SLURM_NODEID``, and job.sbatch's endpoint is the allocation's first host, SLURM_NODEID 0.
"""

from __future__ import annotations

import re
import shlex
from typing import Optional

from meshplan.placement.assign import Placement


def _sh(argv) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def node_lines(hosts: tuple[str, ...], nodes: int, who: str, code: int) -> list[str]:
    """POSIX sh lines setting ``plan_node`` to this host's node index in the plan (empty when nothing
    says it: no ``--hosts``, NODE_RANK nor SLURM_NODEID); a host not in ``hosts``, a NODE_RANK that
    disagrees with the host list or one outside 0..nodes-1 stops with one line (``who``, exit ``code``).
    Host names were checked against a strict pattern (:func:`meshplan.placement.launch.check_options`)."""
    stop = f'>&2; exit {code}; fi'
    if not hosts:
        out = ['plan_node=${NODE_RANK:-${SLURM_NODEID:-}}']
    else:
        out = [f"plan_hosts={shlex.quote(' '.join(hosts))}  # the plan's node 0, 1, ... (meshplan launch --hosts)",
               'me=${SLURMD_NODENAME:-$(hostname)}', "plan_node=", "i=0",
               'for h in $plan_hosts; do',
               '  if [ "$h" = "$me" ] || [ "$h" = "${me%%.*}" ]; then plan_node=$i; fi; i=$((i + 1))', "done",
               f'if [ -z "$plan_node" ]; then echo "meshplan {who}: host $me is not one of the plan\'s hosts '
               f'($plan_hosts): run it there, or write the launch again with meshplan launch --hosts" {stop}',
               'if [ -n "${NODE_RANK:-}" ] && [ "$NODE_RANK" != "$plan_node" ]; then echo "meshplan '
               f'{who}: NODE_RANK=$NODE_RANK, but host $me is node $plan_node of the plan ($plan_hosts)" {stop}']
    return out + ['case "$plan_node" in *[!0-9]*|0?*) plan_node=x ;; esac  # not a node number',
                  f'if [ "$plan_node" = x ] || [ "${{plan_node:-0}}" -ge {nodes} ]; then echo "meshplan {who}: '
                  f'node rank ${{NODE_RANK:-${{SLURM_NODEID:-}}}} (NODE_RANK, else SLURM_NODEID) is not a node of the '
                  f'plan (0-{nodes - 1})" {stop}']


def group_check_lines(hosts: tuple[str, ...], nodes: int) -> list[str]:
    """bind.sh's lines: GROUP_RANK (torchrun's node) must be the plan's node of this host
    (:func:`node_lines`), else one line naming both and exit 1; skipped when nothing names the node."""
    return ["# Which node this host is in the plan (--hosts, else NODE_RANK or SLURM_NODEID, as torchrun.sh):",
            "# torchrun's GROUP_RANK must be it, or this host would run another node's ranks and bindings.",
            *node_lines(hosts, nodes, "bind.sh", 1),
            'if [ -n "$plan_node" ] && [ "${GROUP_RANK:-}" != "$plan_node" ]; then',
            '  echo "meshplan bind.sh: torchrun made host ${me:-$(hostname)} node GROUP_RANK=${GROUP_RANK:-unset}, but the '
            'plan puts node $plan_node here: run torchrun.sh (static rendezvous, --node-rank)" >&2; exit 1', "fi"]


def static_rdzv_args(nnodes: int, nproc_per_node: int, node_rank: object, endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's arguments of a static rendezvous (module docstring): ``--node-rank`` becomes
    torchrun's GROUP_RANK, so global rank = node_rank x nproc_per_node + LOCAL_RANK and rank ->
    node is the plan's, not host-name order as under c10d; ``endpoint`` HOST:PORT of node 0, which
    hosts the TCPStore. ``node_rank``, ``endpoint`` and ``rdzv_id`` may be shell words
    (``torchrun.sh``'s ``"$plan_node"``).

    >>> static_rdzv_args(2, 4, 1, "n0:29500", "meshplan-validate-w8")
    ['--nnodes=2', '--nproc-per-node=4', '--rdzv-backend=static', '--rdzv-endpoint=n0:29500', '--node-rank=1', '--rdzv-id=meshplan-validate-w8']
    """
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=static",
            f"--rdzv-endpoint={endpoint}", f"--node-rank={node_rank}", f"--rdzv-id={rdzv_id}"]


def torchrun_script(placement: Placement, opts) -> str:
    """``torchrun.sh``: the same command on every node, static rendezvous at node 0's endpoint (by
    default ``--rdzv-endpoint``, else the first of ``--hosts`` at ``--port``) with
    ``--node-rank`` this host's node of the plan (module docstring). ``opts``: a
    :class:`~meshplan.placement.launch.LaunchOptions`, already checked. Each refusal (no endpoint,
    no node rank, a host or NODE_RANK that is not the plan's) is one line and exit 1, as bind.sh's
    (docs/commands.md "meshplan launch"; newcomer trial nc55 #6: torchrun.sh exited 2)."""
    nodes, g = int(placement.node.max()) + 1, placement.cluster.node.gpus
    endpoint = opts.rdzv_endpoint or (f"{opts.hosts[0]}:{opts.port}" if opts.hosts else None)  # the plan's node 0
    default = f"${{MESHPLAN_RDZV_ENDPOINT:-{shlex.quote(endpoint)}}}" if endpoint else "${MESHPLAN_RDZV_ENDPOINT:-}"
    need = (['if [ -z "$plan_node" ]; then plan_node=0; fi'] if nodes == 1 else
            ['if [ -z "$plan_node" ]; then echo "meshplan torchrun.sh: set NODE_RANK=<0-'
             f'{nodes - 1}>, this host\'s node in the plan (Slurm sets SLURM_NODEID)" >&2; exit 1; fi'])
    return "\n".join([
        "#!/bin/sh",
        f"# meshplan launch: torchrun on each of {nodes} node(s), {g} processes per node, static rendezvous:",
        "# --node-rank is this host's node in the plan, so torchrun's GROUP_RANK (and the ranks, GPUs, NICs and",
        "# NUMA bindings bind.sh gives it) is the plan's; torch's c10d rendezvous ignores --node-rank and numbers",
        "# nodes by sorted host name (torch/distributed/run.py; elastic/rendezvous/dynamic_rendezvous.py).",
        "# Environment: MESHPLAN_RDZV_ENDPOINT (host:port of the plan's node 0, which hosts the TCPStore; default",
        "# below), NODE_RANK, else SLURM_NODEID (with --hosts: this host's place in the list, SLURMD_NODENAME",
        "# else hostname; Slurm numbers nodes in its own order, not --nodelist's), MESHPLAN_RDZV_ID (default",
        "# SLURM_JOB_ID, else 'meshplan'), MESHPLAN_LOCAL_ADDR (torchrun --local-addr), TORCHRUN (default: torchrun).",
        "set -eu",
        'here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)',
        f"endpoint={default}",
        'if [ -z "$endpoint" ]; then echo "meshplan torchrun.sh: set MESHPLAN_RDZV_ENDPOINT=host:port of node 0" >&2; '
        "exit 1; fi",
        *node_lines(opts.hosts, nodes, "torchrun.sh", 1), *need,
        "rdzv_id=${MESHPLAN_RDZV_ID:-${SLURM_JOB_ID:-meshplan}}",
        *env_lines(opts.env),
        "set --",
        'if [ -n "${MESHPLAN_LOCAL_ADDR:-}" ]; then set -- --local-addr="$MESHPLAN_LOCAL_ADDR"; fi',
        "# TORCHRUN is split into words on purpose (e.g. 'python -m torch.distributed.run')",
        "exec ${TORCHRUN:-torchrun} " + " ".join(static_rdzv_args(nodes, g, '"$plan_node"', '"$endpoint"', '"$rdzv_id"'))
        + ' --max-restarts=0 "$@" --no-python "$here/bind.sh" ' + _sh(opts.program), ""])


def env_lines(env: tuple[tuple[str, Optional[str], str], ...]) -> list[str]:
    """``torchrun.sh``'s lines for ``LaunchOptions.env``: each a comment saying why, then
    ``export NAME=value`` (quoted) or ``unset NAME``.

    >>> env_lines((("CUDA_DEVICE_MAX_CONNECTIONS", "1", "Megatron-LM asserts it"),))
    ['# CUDA_DEVICE_MAX_CONNECTIONS: Megatron-LM asserts it', 'export CUDA_DEVICE_MAX_CONNECTIONS=1']

    A launch script's ``${NAME:-default}`` (:func:`meshplan.interop.megatron_env.script_env`) keeps
    its form, the default quoted: the environment's value still wins, as in the script.

    >>> env_lines((("NCCL_IB_TIMEOUT", "${NCCL_IB_TIMEOUT:-19}", "exported by job.sh"),))[1]
    'export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}'
    """
    out = []
    for name, value, why in env:
        default = re.fullmatch(r"\$\{" + re.escape(name) + r":-(.*)\}", value or "", re.S)
        given = f"${{{name}:-{shlex.quote(default.group(1).strip(chr(34)))}}}" if default else shlex.quote(value or "")
        out += [f"# {name}: {why}", f"unset {name}" if value is None else f"export {name}={given}"]
    return out
