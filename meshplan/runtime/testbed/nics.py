"""Each rank on the NIC its placement gives it, on a netns testbed; bytes per NIC predicted.

**Choosing the NIC.** torchrun gives every local worker of a node the same environment, so
the testbed run (:func:`node_env`) passes the node's NIC addresses in
``MESHPLAN_TESTBED_ADDRS`` (``nic0=10.77.0.2,nic1=10.77.1.2``) and each worker, before
``init_process_group``, calls :func:`apply_rank_nic`: its NIC is ``placement.nic[rank]``
of the plan (``plan.json``; the testbed cluster's ``NICSpec.gpus`` put local rank ``g`` on
NIC ``g mod K``: :func:`local_nic`), and it sets ``GLOO_SOCKET_IFNAME`` (gloo reads it each
time a process group is created: ``ProcessGroupGloo``'s default device) and
``MESHPLAN_BIND_ADDR``. A worker without a plan (``meshplan bench comm --testbed``) calls
:func:`apply_local_nic`, the same choice from ``LOCAL_RANK`` alone. The rendezvous store
stays at node 0's nic0.

**Binding the connecting side.** gloo binds the socket it *listens* on to the interface's
address, but the socket it *connects* from is not bound (gloo ``transport/tcp``: socket,
then connect), so the kernel would pick its source by the destination's route: out the NIC
on the peer's rail. A small ``LD_PRELOAD`` library (:data:`SHIM_C`, compiled with ``cc``
once, :func:`bind_shim`) binds every unbound TCP socket of a worker to
``MESHPLAN_BIND_ADDR`` before ``connect`` (not for 127.0.0.0/8), so with the testbed's
source routes (:mod:`meshplan.runtime.testbed.routes`) a rank's traffic leaves by its own
NIC and crosses the spine to a peer on another rail. Without a C compiler the run goes on
unbound and says so.

**Prediction** (:func:`predict_nic_bytes`): payload bytes per (node, NIC) from the plan's
collective table, each row ``per_step`` times per step, times the steps the worker ran
(recorded, memory, timed and profiled steps). Measured: each node's counters read by its
lowest rank before the first step and after the last (``nic_counters.json``, between
barriers), so set-up and anything after the steps are outside. gloo's algorithms, each
group in its rank order (:data:`RING_STEP`): all-reduce is a ring, every member sends
``2(n-1)/n x S`` to the previous member; reduce-scatter runs as an all-reduce of the full
buffer ``S`` (so ``2(n-1)/n``, twice NCCL's ``(n-1)/n``); all-gather is a ring, ``(n-1)/n x
S`` to the next member; all-to-all sends ``S/n`` to every other member. A transfer counts on the sender NIC's tx and the receiver NIC's rx
when the two ranks sit on different nodes (the same node is loopback). Send/recv and
broadcast rows are not predicted (listed). Not in the prediction: TCP/IP headers and ACKs,
the store, gloo's connection set-up, DeviceMesh creation and the final barrier.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

from meshplan.plan import Plan

ADDRS_ENV = "MESHPLAN_TESTBED_ADDRS"
BIND_ENV = "MESHPLAN_BIND_ADDR"

SHIM_C = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
/* meshplan testbed: bind an unbound TCP socket to $MESHPLAN_BIND_ADDR before connect(). */
typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);
int connect(int fd, const struct sockaddr *to, socklen_t len) {
  static connect_fn real;
  if (!real) real = (connect_fn)dlsym(RTLD_NEXT, "connect");
  const char *src = getenv("MESHPLAN_BIND_ADDR");
  if (src && to && to->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    const struct sockaddr_in *dst = (const struct sockaddr_in *)to;
    struct sockaddr_in me, b = {0};
    socklen_t ml = sizeof me, tl = sizeof(int);
    int type = 0, one = 1;
    if ((ntohl(dst->sin_addr.s_addr) >> 24) != 127
        && getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) == 0 && type == SOCK_STREAM
        && getsockname(fd, (struct sockaddr *)&me, &ml) == 0 && me.sin_family == AF_INET
        && me.sin_addr.s_addr == htonl(INADDR_ANY) && me.sin_port == 0
        && inet_pton(AF_INET, src, &b.sin_addr) == 1) {
      b.sin_family = AF_INET;
      setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
      bind(fd, (struct sockaddr *)&b, sizeof b);
    }
  }
  return real(fd, to, len);
}
"""


def bind_shim(cache_dir=None) -> tuple[Optional[str], str]:
    """``(path of the compiled LD_PRELOAD library, note)``, or ``(None, why)`` without ``cc``.

    Compiled once per source text into ``cache_dir`` (default: the temporary folder), atomically.
    """
    folder = Path(cache_dir or tempfile.gettempdir())
    path = folder / f"meshplan-bindshim-{hashlib.sha256(SHIM_C.encode()).hexdigest()[:12]}.so"
    if path.exists():
        return str(path), f"connecting sockets bound to the rank's NIC (LD_PRELOAD {path})"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler: gloo's connecting sockets are unbound and leave by the peer's rail"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = Path(tmp, "shim.c"), Path(tmp, "shim.so")
        src.write_text(SHIM_C)
        cp = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-ldl"],
                            capture_output=True, text=True, timeout=60)
        if cp.returncode != 0:
            return None, f"`cc` failed ({cp.stderr.strip()[:200]}): gloo's connecting sockets are unbound"
        os.chmod(out, 0o755)
        os.replace(out, path)
    return str(path), f"connecting sockets bound to the rank's NIC (LD_PRELOAD {path})"


def node_env(tb, node: int, shim: Optional[str]) -> dict[str, str]:
    """Environment of node ``node``'s torchrun: its NIC addresses and the bind library."""
    env = {ADDRS_ENV: ",".join(f"{tb.ifname(k)}={tb.addr(node, k)}" for k in range(tb.nics_per_node))}
    if shim:
        env["LD_PRELOAD"] = shim
    return env


def local_nic(local_rank: int, nics: int) -> int:
    """NIC index of local rank ``local_rank`` on a node with ``nics`` NICs: ``local_rank mod
    nics``, as the testbed cluster's ``NICSpec.gpus`` assign them.

    >>> [local_nic(g, 2) for g in range(4)], [local_nic(g, 1) for g in range(3)]
    ([0, 1, 0, 1], [0, 0, 0])
    """
    return local_rank % nics


def _node_addrs(text: str) -> dict[str, str]:
    """``nic0=10.77.0.2,nic1=10.77.1.2`` (:data:`ADDRS_ENV`, NIC order) -> ``{nic: address}``."""
    return dict(kv.split("=", 1) for kv in text.split(","))


def apply_local_nic(environ=os.environ) -> Optional[dict]:
    """In a worker on the testbed without a plan: set ``GLOO_SOCKET_IFNAME`` and
    ``MESHPLAN_BIND_ADDR`` to NIC :func:`local_nic` ``(LOCAL_RANK, K)`` of the node's
    :data:`ADDRS_ENV`; returns ``{nic, addr}``, or None outside a testbed run.

    >>> env = {ADDRS_ENV: "nic0=10.77.0.2,nic1=10.77.1.2", "LOCAL_RANK": "3"}
    >>> apply_local_nic(env), env["GLOO_SOCKET_IFNAME"], env[BIND_ENV]
    ({'nic': 'nic1', 'addr': '10.77.1.2'}, 'nic1', '10.77.1.2')
    """
    addrs = environ.get(ADDRS_ENV)
    if not addrs:
        return None
    by_nic = list(_node_addrs(addrs).items())
    name, addr = by_nic[local_nic(int(environ.get("LOCAL_RANK", 0)), len(by_nic))]
    environ["GLOO_SOCKET_IFNAME"], environ[BIND_ENV] = name, addr
    return {"nic": name, "addr": addr}


def apply_rank_nic(plan: dict, rank: int, environ=os.environ) -> Optional[dict]:
    """In a worker on the testbed: set ``GLOO_SOCKET_IFNAME`` and ``MESHPLAN_BIND_ADDR`` to
    the NIC the plan's placement gives ``rank``; returns ``{nic, addr, rail}``, or None
    outside a testbed run (no ``MESHPLAN_TESTBED_ADDRS``). Raises RuntimeError when torchrun
    started the rank on another node than the placement's."""
    addrs = environ.get(ADDRS_ENV)
    if not addrs:
        return None
    p = plan["placement"]
    node = int(environ.get("GROUP_RANK", p["node"][rank]))
    if p["node"][rank] != node or p["local_gpu"][rank] != int(environ.get("LOCAL_RANK", p["local_gpu"][rank])):
        raise RuntimeError(f"rank {rank} runs as node {node} local rank {environ.get('LOCAL_RANK')} but the "
                           f"placement puts it on node {p['node'][rank]} GPU {p['local_gpu'][rank]}")
    name = p["nic_names"][p["nic"][rank]]
    addr = _node_addrs(addrs)[name]
    environ["GLOO_SOCKET_IFNAME"], environ[BIND_ENV] = name, addr
    return {"nic": name, "addr": addr, "rail": p["rail"][rank]}


#: Ring direction of gloo's algorithms, in group-rank order: all-reduce sends to rank - 1
#: (gloo/allreduce.cc, ring: "send ... to rank - 1", receive from rank + 1), all-gather to
#: rank + 1; a 4-member group across the testbed's nodes moved the bytes these predict.
RING_STEP = {"all-reduce": -1, "reduce-scatter": -1, "all-gather": +1}


def _sends(op: str, group: list[int], size: float) -> list[tuple[int, int, float]]:
    """(sender, receiver, bytes) of one call of ``op`` on ``group`` (gloo; module docstring).

    >>> _sends("all-reduce", [0, 2, 4], 300.0)
    [(0, 4, 400.0), (2, 0, 400.0), (4, 2, 400.0)]
    """
    n = len(group)
    if n < 2:
        return []
    if op == "all-to-all":
        return [(a, b, size / n) for a in group for b in group if a != b]
    per = (1 if op == "all-gather" else 2) * (n - 1) / n * size
    return [(group[i], group[(i + RING_STEP[op]) % n], per) for i in range(n)]


def predict_nic_bytes(plan: Plan, steps: int) -> tuple[dict, list[str]]:
    """``{(node, nic): {"tx": B, "rx": B, "tx_groups": {label: B}, "rx_groups": ...}}`` over ``steps`` steps, and
    the rows left out (see the module docstring). Every NIC of every node is present."""
    mesh, p = plan.mesh, plan.placement
    nics = len(plan.config.cluster.node.nics)
    out: dict[tuple[int, int], dict[str, Any]] = {(n, k): {"tx": 0.0, "rx": 0.0, "tx_groups": {}, "rx_groups": {}} for n in range(plan.config.cluster.nodes)
           for k in range(nics)}
    skipped = []
    stage = {r: plan.stage_of(r) for r in range(plan.world)}
    for k in sorted({s.table_stage for s in stage.values()}):
        for row in plan.stage(k).collectives:
            if row.op not in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all"):
                skipped.append(f"stage {k} {row.axis} {row.phase} {row.op}")
                continue
            groups = {tuple(mesh.group_of(r, row.axis)) for r in range(plan.world) if stage[r].table_stage == k}
            for g in sorted(groups):
                for a, b, nbytes in _sends(row.op, list(g), row.size_bytes):
                    if p.node[a] == p.node[b]:
                        continue
                    total = nbytes * row.per_step * steps
                    label = f"{row.axis} {list(g)}"
                    for end, side in ((a, "tx"), (b, "rx")):
                        nic = out[(int(p.node[end]), int(p.nic[end]))]
                        nic[side] += total
                        nic[f"{side}_groups"][label] = nic[f"{side}_groups"].get(label, 0.0) + total
    return out, sorted(set(skipped))


def measured_nic_bytes(plan, folder: Path) -> tuple[dict, int]:
    """``({(node, nic): (tx, rx)}, steps)``: each node's NIC counters around the steps, as
    the node's lowest rank read them (``rank<r>/nic_counters.json``, between barriers)."""
    names = [n.name for n in plan.config.cluster.node.nics]
    out, steps = {}, 0
    for node in range(plan.config.cluster.nodes):
        r = min(x for x in range(plan.world) if plan.placement.node[x] == node)
        data = json.loads((folder / f"rank{r}" / "nic_counters.json").read_text())
        steps = data["steps"]
        for k, name in enumerate(names):
            b, a = data["before"][name], data["after"][name]
            out[(node, k)] = (a[0] - b[0], a[1] - b[1])
    return out, steps


def nic_rows(plan, folder: Path, run_bytes: Optional[dict] = None) -> list[dict]:
    """predicted_vs_measured rows: tx and rx bytes of every testbed NIC over the steps
    (:func:`measured_nic_bytes`) against :func:`predict_nic_bytes`; the note names the
    groups each NIC carried and, from ``run_bytes``, the whole run's bytes (set-up included)."""
    meas, steps = measured_nic_bytes(plan, folder)
    pred, skipped = predict_nic_bytes(plan, steps)
    nics = plan.config.cluster.node.nics
    rows = []
    for (node, k), v in sorted(pred.items()):
        ranks = [r for r in range(plan.world) if plan.placement.node[r] == node and plan.placement.nic[r] == k]
        for i, side in enumerate(("tx", "rx")):
            carried = ", ".join(f"{g} {b / 2**20:.2f} MiB" for g, b in sorted(v[f"{side}_groups"].items()))
            m, pr = meas[(node, k)][i], v[side]
            run = (run_bytes or {}).get(f"node{node} {nics[k].name}", {}).get(f"{side}_bytes")
            rows.append(dict(quantity=f"NIC node{node} {nics[k].name} {side} bytes", unit="B", predicted=pr,
                             measured=m, measured_min=None, rank=",".join(map(str, ranks)) or "-",
                             error=(m / pr - 1) if pr else None,
                             note=f"rail {nics[k].rail}; carried {carried or 'no group'}; predicted: gloo payload x {steps} "
                                  "steps (ring; reduce-scatter as a full-buffer all-reduce); measured: interface "
                                  "counters around the steps, headers and barriers included"
                                  + (f"; whole run {run / 2**20:.2f} MiB" if run is not None else "")
                                  + (f"; not predicted: {', '.join(skipped)}" if skipped else "")))
    return rows


def read_nic_bytes(path: str = "/proc/net/dev") -> dict[str, list[int]]:
    """``{ifname: [tx_bytes, rx_bytes]}`` of this process's network namespace (``/proc/net/dev``)."""
    out = {}
    for line in Path(path).read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        f = rest.split()
        out[name.strip()] = [int(f[8]), int(f[0])]
    return out


def snapshot_nics(barrier) -> dict[str, list[int]]:
    """:func:`read_nic_bytes` between two ``barrier()`` calls, so that no rank's traffic
    before or after the barrier pair falls on the wrong side of the reading."""
    barrier()
    snap = read_nic_bytes()
    barrier()
    return snap
