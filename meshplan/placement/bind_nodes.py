"""``bind.sh``'s node tables (:func:`meshplan.placement.launch.bind_script`): which nodes share one
LOCAL_RANK table (:func:`shared_nodes`: a node-major placement on one node type repeats the same
bindings on every node, but for the RANK, GROUP_RANK x G + LOCAL_RANK's offset), the
``case $LOCAL_RANK`` each table is written as (:func:`local_case`), and the numactl check before
them with its opt-out (:data:`NUMA_CHECK`, :func:`numactl_exec`). Newcomer finding: 4,096 ranks
on 512 dgx-h100 wrote one block per host, 18,449 lines (1.3 MB).
"""

from __future__ import annotations

import json
import shlex

#: bind.sh's check before a rank execs under numactl (newcomer trial 23: ``exec numactl ...`` on a host
#: without it failed with ``numactl: not found``, exit 127, naming neither the package nor a way around):
#: ``MESHPLAN_NO_NUMA=1`` execs the program without the binding (``numa`` empty, :func:`numactl_exec`).
NUMA_CHECK = [
    "numa=1  # MESHPLAN_NO_NUMA=1: run the program without numactl's core and memory binding",
    'if [ "${MESHPLAN_NO_NUMA:-}" = 1 ]; then numa=',
    "elif ! command -v numactl >/dev/null 2>&1; then",
    '  echo "meshplan bind.sh: numactl not found on this host: install it (apt-get install numactl, or dnf install '
    'numactl), or run with MESHPLAN_NO_NUMA=1 to start the ranks without core and memory binding" >&2; exit 127',
    "fi"]


def numactl_exec(cpu: list[str]) -> str:
    """The argv prefix ``cpu`` as bind.sh writes it before ``"$@"``: numactl's only where ``$numa``
    is set (:data:`NUMA_CHECK`), ``${numa:+numactl --physcpubind=0-13 --membind=0}``; another
    prefix (taskset) as it is.

    >>> numactl_exec(["numactl", "--physcpubind=0-13", "--membind=0"]), numactl_exec(["taskset", "-c", "0-13"])
    ('${numa:+numactl --physcpubind=0-13 --membind=0}', 'taskset -c 0-13')
    """
    words = " ".join(shlex.quote(str(a)) for a in cpu)
    return f"${{numa:+{words}}}" if cpu[:1] == ["numactl"] else words


def local_case(ranks: list[tuple[dict, str, str]], pad: str) -> list[str]:
    """``case $LOCAL_RANK``: for each (binding, the RANK it expects, its mesh rank in words) the
    RANK check, the exports and the exec; any other LOCAL_RANK refused."""
    out = [f'{pad}case "${{LOCAL_RANK:-}}" in']
    for b, expect, mesh in sorted(ranks, key=lambda x: x[0]["local_rank"]):
        out += [f"{pad}{b['local_rank']}) # {mesh}: GPU {b['gpu']} ({b['device']}), "
                f"socket {b['socket']}, cores {b['cores']}, NIC {b['nic'] or '-'}",
                f"{pad}  expect {expect}",
                f"{pad}  export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in b["env"].items()),
                f'{pad}  exec {numactl_exec(b["cpu"]) + " " if b["cpu"] else ""}"$@" ;;']
    return out + [f'{pad}*) echo "meshplan bind.sh: no binding for node $GROUP_RANK local rank '
                  '${LOCAL_RANK:-unset}" >&2; exit 1 ;;', f"{pad}esac"]


def shared_nodes(by_node: dict[int, list[dict]], gpus: int) -> list[int]:
    """The nodes whose bindings are one LOCAL_RANK table: the most common one, shared by at least
    two nodes (ties: the lowest node's), each rank's RANK and mesh rank taken relative to its
    node's first GPU (``node x gpus``); empty when no two nodes share one."""
    def key(node: int) -> str:
        return json.dumps([[b["local_rank"], b["process_rank"] - node * gpus, b["rank"] - node * gpus, b["gpu"],
                            b["device"], b["socket"], b["cores"], b["nic"], b["env"], b["cpu"]]
                           for b in sorted(by_node[node], key=lambda b: b["local_rank"])])
    keys = {n: key(n) for n in sorted(by_node)}
    counts: dict[str, int] = {}
    for k in keys.values():
        counts[k] = counts.get(k, 0) + 1
    best = max(counts, key=lambda k: counts[k])  # max keeps the first of a tie: the lowest node's
    return [n for n, k in keys.items() if k == best] if counts[best] > 1 else []


def node_list(shared: list[int], nodes: int, own: list[int]) -> str:
    """``1-511`` (every node but ``own``) or the shared nodes listed."""
    if len(shared) + len(own) == nodes and shared == list(range(shared[0], shared[-1] + 1)):
        return f"{shared[0]}-{shared[-1]}"
    return ", ".join(map(str, shared))
