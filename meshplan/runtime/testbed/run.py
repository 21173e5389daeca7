"""``meshplan validate --testbed PREFIX``: run a world across the emulated nodes of a netns
testbed (:mod:`meshplan.runtime.testbed.netns`) instead of one machine's loopback.

One torchrun per node namespace with the static rendezvous at node 0's nic0
(:func:`~meshplan.runtime.testbed.launch.torchrun_argv`; the c10d rendezvous does not cross these
namespaces), ``W / nodes`` ranks per node, node-major as meshplan places ranks. Each rank
uses the NIC its placement gives it (``GLOO_SOCKET_IFNAME`` set in the worker, connecting
sockets bound to it: :mod:`meshplan.runtime.testbed.nics`); the testbed routes between
rails through its spine (:mod:`meshplan.runtime.testbed.routes`).

The cluster the plan is made for: ``nodes`` testbed nodes of ``W / nodes`` ranks, local
rank ``g`` under NIC ``g mod K`` (``NICSpec.gpus``), each NIC at the testbed's tbf rate,
loopback inside a node and one network tier (the rail bridge) with the loopback's per-step
latency (not measured across namespaces yet); compute as on the CPU testbed, each rank
getting ``cores / W`` of a core (all namespaces share the machine).
Per-NIC byte counters are read before and after the run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from meshplan.errors import ConfigError
from meshplan.runtime.execution.launch import RunOutcome
from meshplan.runtime.testbed.cpu import cpu_cluster
from meshplan.runtime.testbed.launch import launch_per_node, torchrun_argv
from meshplan.runtime.testbed.netns import counter_delta, load_testbed, read_counters, require_testbed
from meshplan.runtime.testbed.nics import bind_shim, local_nic, node_env
from meshplan.spec.cluster import ClusterSpec, NetworkTier, NICSpec


def testbed_cluster(prefix: str, world: int, option: str = "--worlds") -> tuple[ClusterSpec, str]:
    """The cluster of ``world`` ranks on testbed ``prefix`` (see the module docstring); a world
    the testbed's nodes do not divide is a ConfigError naming ``option``, the command's option
    that gave it (validate's ``--worlds``, validate-slice's ``--world``)."""

    tb = require_testbed(prefix)
    if world % tb.nodes:
        raise ConfigError(option, f"world {world} is not a multiple of the testbed's {tb.nodes} nodes")
    per_node = world // tb.nodes
    base, why = cpu_cluster(world)
    nics = [NICSpec(name=tb.ifname(k), ifname=tb.ifname(k), rate_gbit_per_s=tb.rate_mbit / 1000, rail=k, socket=0,
                    gpus=[g for g in range(per_node) if local_nic(g, tb.nics_per_node) == k])
            for k in range(tb.nics_per_node)]
    node = base.node.model_copy(update=dict(
        name=f"testbed-{prefix}", gpus=per_node, nics=nics,
        sockets=[base.node.sockets[0].model_copy(update=dict(gpus=list(range(per_node))))]))
    tier = NetworkTier(name="rail-bridge", latency_us=base.node.fabric.latency_us)
    why += (f"; testbed '{prefix}': {tb.nodes} nodes x {per_node} ranks, {tb.nics_per_node} NIC(s) per node at "
            f"{tb.rate_mbit:g} Mbit/s (tbf), local rank g on nic<g mod {tb.nics_per_node}> from the placement; "
            + bind_shim()[1])
    return ClusterSpec(name=f"testbed-{prefix}-{world}", collective_library="gloo", gpu=base.gpu, node=node,
                       nodes=tb.nodes, network=[tier],
                       source=why), why


def run_on_testbed(prefix: str, world: int, module_argv: list[str], folder: Path, timeout_s: float,
                   env: dict) -> tuple[RunOutcome, dict]:
    """Run the worker on every node of testbed ``prefix``; returns the outcome (with every
    node's output joined into ``torchrun.log``) and the per-NIC byte counts it moved."""

    tb = load_testbed(prefix)
    per_node = world // tb.nodes
    shim, _ = bind_shim()
    envs = [{"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **node_env(tb, i, shim), **env} for i in range(tb.nodes)]
    before = read_counters(tb)
    t0 = time.monotonic()
    res = launch_per_node(tb, lambda i: torchrun_argv(tb, i, per_node, ["-m", *module_argv]), timeout_s,
                          env_for_node=envs.__getitem__, log_dir=folder / "logs", cwd=os.getcwd())
    elapsed = time.monotonic() - t0
    delta = counter_delta(before, read_counters(tb))
    log = folder / "torchrun.log"
    log.write_text("\n".join((folder / "logs" / f"node{r.node}.{s}").read_text(errors="replace")
                             for r in res.results for s in ("out", "err")) + f"\n{res.message}\n")
    failed = next((r for r in res.results if r.status == "failed"), None)
    rc = 0 if res.ok else (failed.returncode if failed else 1)
    outcome = RunOutcome(world, res.results[0].argv if res.results else [], None if res.timed_out else rc,
                         res.timed_out, elapsed, str(log), [])
    counters = {f"node{n} {tb.ifname(k)}": {"tx_bytes": tx, "rx_bytes": rx} for (n, k), (tx, rx) in delta.items()}
    return outcome, counters
