"""Launching one process per node namespace of a netns testbed (:mod:`meshplan.runtime.testbed.netns`).

:func:`torchrun_argv` is the torchrun command of one node (static rendezvous at node 0's
nic0: the c10d rendezvous does not cross these namespaces). :func:`launch_per_node` runs a
command inside every node namespace (``ip netns exec``), each in its own process group, and
waits: the first node to exit non-zero, or the deadline, stops every other group (SIGTERM,
then SIGKILL), and every group is ended before it returns. Each node's outcome is a
:class:`NodeResult` with the tail of its output; the whole is a :class:`LaunchResult` whose
``message`` says who failed and how.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from meshplan.errors import ConfigError

if TYPE_CHECKING:
    from meshplan.runtime.testbed.netns import Testbed


def torchrun_argv(testbed: Testbed, node: int, nproc_per_node: int, script_argv: Sequence[str],
                  master_port: int = 29500) -> list[str]:
    """torchrun command for ``node`` with the static rendezvous at node 0's nic0.

    The c10d rendezvous does not work across these namespaces. Set GLOO_SOCKET_IFNAME per
    rank (``nic<k>`` from the placement) in the worker before ``init_process_group``.
    """
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={testbed.nodes}",
            f"--node-rank={node}", f"--nproc-per-node={nproc_per_node}",
            f"--master-addr={testbed.master_addr}", f"--master-port={master_port}", *script_argv]


@dataclass
class NodeResult:
    """One node's process. ``status``: ok, failed (non-zero exit), timeout (killed at the
    deadline) or stopped (killed because another node failed)."""

    node: int
    argv: list[str]
    status: str = "running"
    returncode: Optional[int] = None
    elapsed_s: float = 0.0
    stdout_tail: str = ""
    stderr_tail: str = ""
    _popen: Optional[subprocess.Popen] = field(default=None, repr=False, compare=False)
    _t0: float = field(default=0.0, repr=False, compare=False)

    @property
    def proc(self) -> subprocess.Popen:
        """The node's process (:func:`_start` sets it)."""
        if self._popen is None:
            raise RuntimeError(f"node {self.node} was never started")
        return self._popen


@dataclass
class LaunchResult:
    """Outcome of :func:`launch_per_node`; ``message`` says who failed and how."""

    ok: bool
    timed_out: bool
    failed_node: Optional[int]
    message: str
    results: list[NodeResult] = field(default_factory=list)


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is in process group ``pgid``."""
    for entry in os.scandir("/proc"):
        try:
            stat = Path(entry.path, "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()      # state, ppid, pgrp, ...
        if fields and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _alive(r: NodeResult) -> bool:
    r.proc.poll()                                        # reap the leader first
    return _group_alive(r.proc.pid)


def _stop_all(procs: Sequence[NodeResult], grace_s: float) -> list[int]:
    """SIGTERM every live process group, SIGKILL after ``grace_s``; returns nodes that survived."""
    alive = [r for r in procs if _alive(r)]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for r in alive:
            try:
                os.killpg(r.proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.02)
            alive = [r for r in alive if _alive(r)]
    return [r.node for r in alive]


def _tail(path: Path, lines: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 65536))
        return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])


def _start(tb: Testbed, node: int, argv: list[str], env: dict, cwd, logs: Path) -> NodeResult:
    with open(logs / f"node{node}.out", "wb") as fo, open(logs / f"node{node}.err", "wb") as fe:
        popen = subprocess.Popen(["ip", "netns", "exec", tb.node_ns(node), *argv], stdin=subprocess.DEVNULL,
                                 stdout=fo, stderr=fe, env=env, cwd=cwd, start_new_session=True)
    return NodeResult(node, argv, _popen=popen, _t0=time.monotonic())


def _wait(procs: Sequence[NodeResult], timeout_s: float) -> Optional[NodeResult]:
    """Poll until all exit (None), one fails (returned) or the deadline passes (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in procs:
            rc = r.proc.poll()
            if rc is not None and r.status == "running":
                r.status, r.returncode, r.elapsed_s = ("ok" if rc == 0 else "failed"), rc, time.monotonic() - r._t0
                if rc != 0:
                    return r
        if all(r.status != "running" for r in procs):
            return None
        time.sleep(0.02)
    return None


def _summary(procs: Sequence[NodeResult], failed: Optional[NodeResult], timeout_s: float, survivors) -> str:
    hung = [r.node for r in procs if r.status == "timeout"]
    if failed is not None:
        msg = (f"node {failed.node} ({' '.join(failed.argv)[:120]}) exited with code {failed.returncode} after "
               f"{failed.elapsed_s:.1f} s; other nodes stopped. Last stderr:\n{failed.stderr_tail or '(empty)'}")
    elif hung:
        msg = f"timeout after {timeout_s:g} s: nodes {hung} still running were killed"
    else:
        msg = f"all {len(procs)} nodes exited 0"
    return msg + (f"; WARNING: process groups of nodes {survivors} survived SIGKILL" if survivors else "")


def launch_per_node(testbed: Testbed, cmd_for_node: Callable[[int], Sequence[str]], timeout_s: float, *,
                    env_for_node: Optional[Callable[[int], Mapping[str, str]]] = None, cwd=None,
                    log_dir=None, grace_s: float = 2.0, tail_lines: int = 20) -> LaunchResult:
    """Run ``cmd_for_node(i)`` inside each node namespace (``ip netns exec``), one process group each.

    Waits up to ``timeout_s``; the first node to exit non-zero, or the deadline, stops every
    other group (SIGTERM, SIGKILL after ``grace_s``). Every group is ended before returning,
    even on an exception. Output goes to ``log_dir/node<i>.{out,err}`` (a temporary folder
    when None); the last ``tail_lines`` lines are in the results.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ConfigError("timeout_s", f"{timeout_s!r} must be a positive number of seconds")
    argvs = [[str(a) for a in cmd_for_node(i)] for i in range(testbed.nodes)]
    envs = [{**os.environ, **(env_for_node(i) if env_for_node else {})} for i in range(testbed.nodes)]
    procs: list[NodeResult] = []
    with tempfile.TemporaryDirectory(prefix=f"mp-{testbed.prefix}-logs-") as tmp:
        logs = Path(log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(testbed.nodes):
                procs.append(_start(testbed, i, argvs[i], envs[i], cwd, logs))
            failed = _wait(procs, timeout_s)
        finally:
            survivors = _stop_all(procs, grace_s)
        for r in procs:
            if r.status == "running":
                r.status = "stopped" if failed else "timeout"
                r.returncode, r.elapsed_s = r.proc.poll(), time.monotonic() - r._t0
            r.stdout_tail = _tail(logs / f"node{r.node}.out", tail_lines)
            r.stderr_tail = _tail(logs / f"node{r.node}.err", tail_lines)
    ok = all(r.status == "ok" for r in procs)
    return LaunchResult(ok, any(r.status == "timeout" for r in procs), failed.node if failed else None,
                        _summary(procs, failed, timeout_s, survivors), procs)
