"""Launch one torchrun job with a wall-clock timeout, always leaving nothing running, and
tell which rank failed.

torchrun starts each worker in a session of its own (torch elastic's SubprocessHandler:
``start_new_session=True``), so killing torchrun's process group does not reach them. The
launcher therefore (1) starts torchrun in a new session, (2) on timeout or exit collects the
whole process tree under torchrun from ``/proc`` (parent links), sends SIGTERM to torchrun
(whose agent stops its workers), waits ``grace_s``, then SIGKILLs every process of the tree
still alive; and (3) workers set ``PR_SET_PDEATHSIG`` (:func:`die_with_parent`) so that a
torchrun killed from outside takes its workers with it.

Who failed, from the files the workers write (``rank<r>/status.json``, see
:mod:`meshplan.runtime.execution.worker`) and from torchrun's "Root Cause (first observed failure)"
block (:func:`parse_root_cause`); :func:`diagnose` combines them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from meshplan.placement.rendezvous import static_rdzv_args

PHASE_ORDER = ("start-up", "forward", "loss", "backward", "optimizer", "writing trace", "finished")
RESULT_FILES = ("startup.json", "collectives.json", "memory.json", "timings.json", "trace.json")


@dataclass
class RunOutcome:
    """One torchrun job. ``returncode`` None when it was killed at the deadline;
    ``leftover_pids``: processes of the tree still alive after cleanup (should be empty)."""

    world: int
    argv: list[str]
    returncode: Optional[int]
    timed_out: bool
    elapsed_s: float
    log_path: str
    leftover_pids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass(frozen=True)
class Rendezvous:
    """Several hosts in one run: ``nnodes`` torchrun agents, this one ``node_rank`` (the plan's
    node: its ranks are node_rank x W / nnodes ...), the static rendezvous's TCPStore at
    ``endpoint`` (host:port of node 0, which hosts it), ``local_addr`` this host's address
    (torchrun ``--local-addr``) when its FQDN does not resolve elsewhere."""

    nnodes: int
    node_rank: int
    endpoint: str
    local_addr: Optional[str] = None


def torchrun_argv(world: int, module_argv: list[str], rdzv: Optional[Rendezvous] = None) -> list[str]:
    """``torchrun --standalone`` (c10d rendezvous on a free localhost port: no fixed port), or
    with ``rdzv`` the static rendezvous of ``world / nnodes`` processes per host at its endpoint
    with ``--node-rank``, ``launch``'s rule (:func:`meshplan.placement.rendezvous.static_rdzv_args`:
    torch 2.13's c10d ignores ``--node-rank`` and orders nodes by host name), rendezvous id
    ``meshplan-validate-w<world>``: one per world size.

    >>> torchrun_argv(4, ["m"], Rendezvous(2, 1, "n0:29500"))[3:9]
    ['--nnodes=2', '--nproc-per-node=2', '--rdzv-backend=static', '--rdzv-endpoint=n0:29500', '--node-rank=1', '--rdzv-id=meshplan-validate-w4']
    """
    if rdzv is None:
        head = ["--standalone", f"--nproc-per-node={world}"]
    else:
        head = static_rdzv_args(rdzv.nnodes, world // rdzv.nnodes, rdzv.node_rank, rdzv.endpoint,
                                f"meshplan-validate-w{world}")
        head += [f"--local-addr={rdzv.local_addr}"] if rdzv.local_addr else []
    return [sys.executable, "-m", "torch.distributed.run", *head, "--max-restarts=0", "--monitor-interval=0.1",
            "-m", *module_argv]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields and fields[0] != "Z":
            kids.setdefault(int(fields[1]), []).append(int(entry.name))
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (from /proc parent links)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2:].split()[0] != "Z"


def stop_tree(popen: subprocess.Popen, grace_s: float = 5.0) -> list[int]:
    """SIGTERM torchrun, SIGKILL whatever of its tree is left after ``grace_s``; returns the
    pids that survived (empty when all is gone)."""
    tree = process_tree(popen.pid)
    if popen.poll() is None:
        with _quiet():
            os.kill(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    tree = sorted(set(tree) | set(process_tree(popen.pid)) - {os.getpid()})
    for pid in tree:
        if _alive(pid):
            with _quiet():
                os.kill(pid, signal.SIGKILL)
    with _quiet():
        popen.wait(timeout=5)
    deadline = time.monotonic() + 5
    left = [p for p in tree if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, *rest):
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError, subprocess.TimeoutExpired))


def run_torchrun(world: int, module_argv: list[str], log_path: Path, timeout_s: float, env: Optional[dict] = None,
                 cwd: Optional[str] = None, grace_s: float = 5.0, rdzv: Optional[Rendezvous] = None) -> RunOutcome:
    """Run ``torchrun ... -m module_argv`` for at most ``timeout_s`` seconds (stdout and
    stderr to ``log_path``); with ``rdzv`` this host's share of a multi-host run
    (:func:`torchrun_argv`). Every process is gone when this returns (else listed)."""
    argv = torchrun_argv(world, module_argv, rdzv)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=full_env, cwd=cwd, start_new_session=True)
        timed_out = False
        try:
            popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            left = stop_tree(popen, grace_s)
    return RunOutcome(world, argv, None if timed_out else popen.returncode, timed_out, time.monotonic() - t0,
                      str(log_path), left)


_ROOT = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def parse_root_cause(log_text: str) -> Optional[tuple[int, int]]:
    """(rank, exit code) of torchrun's "Root Cause (first observed failure)" block, or None.

    >>> parse_root_cause("Root Cause (first observed failure):\\n[0]:\\n  rank      : 1 (local_rank: 1)\\n"
    ...                  "  exitcode  : -9 (pid: 7)")
    (1, -9)
    """
    m = _ROOT.search(log_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def read_status(folder: Path, world: int) -> dict[int, Optional[dict]]:
    """``rank -> status.json`` content (None when a rank wrote none or it is unreadable)."""
    out: dict[int, Optional[dict]] = {}
    for r in range(world):
        try:
            out[r] = json.loads((folder / f"rank{r}" / "status.json").read_text())
        except (OSError, ValueError):
            out[r] = None
    return out


def _key(st: Optional[dict]) -> tuple[int, int]:
    if st is None:
        return (-2, -1)
    phase = st.get("phase", "")
    return (int(st.get("step", -1)), PHASE_ORDER.index(phase) if phase in PHASE_ORDER else 0)


def _where(st: Optional[dict]) -> str:
    if st is None:
        return "no status written (did not start)"
    step = st.get("step", -1)
    return f"{st.get('phase')}" + (f" of step {step}" if step >= 0 else "")


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def diagnose(outcome: RunOutcome, folder: Path, timeout_s: float, pg_timeout_s: float) -> dict:
    """What went wrong: ``failed_ranks`` (the ranks named as the cause), ``message`` (one
    paragraph), ``ranks`` (each rank's last status and the result files it left, none of
    which count as a result)."""
    st = read_status(folder, outcome.world)
    log = Path(outcome.log_path).read_text(errors="replace") if Path(outcome.log_path).exists() else ""
    root = parse_root_cause(log)
    errors = {r: s["error"] for r, s in st.items() if s and s.get("state") == "error"}
    timeouts = [r for r, e in errors.items() if re.search(r"timed? ?out|timeout", e, re.I)]
    pending = [r for r, s in st.items() if not s or s.get("state") == "running"]
    keys = {r: _key(s) for r, s in st.items()}
    behind = [r for r in pending if keys[r] == min(keys[p] for p in pending)] if pending else []
    ahead = max(keys.values()) if keys else (-2, -1)
    parts = []
    if root and root[1] < 0 and root[0] not in timeouts:
        failed = [root[0]]
        parts.append(f"rank {root[0]} died ({_signal_name(root[1])}); its last status: {_where(st[root[0]])}")
    elif outcome.timed_out or timeouts:
        failed = [r for r in behind if keys[r] < ahead] or behind
        how = (f"the wall-clock limit of {timeout_s:g} s" if outcome.timed_out
               else f"the process-group timeout ({pg_timeout_s:g} s) in ranks {timeouts}")
        parts.append(f"the run was ended by {how}; " + (
            f"rank(s) {failed} hung: last at {_where(st[failed[0]])} while others reached "
            f"{max((_where(s) for s in st.values() if s and _key(s) == ahead), default='?')}"
            if failed and keys[failed[0]] < ahead else "no rank is behind the others (all at the same point: still "
            "progressing, or all waiting on one collective); if the ranks were progressing, give a larger --timeout-s"))
    elif errors:
        first = root[0] if root and root[0] in errors else min(errors)
        failed = [first]
        parts.append(f"rank {first} raised {errors[first]!r} during {_where(st[first])}")
    elif root:
        failed = [root[0]]
        parts.append(f"rank {root[0]} exited with {_signal_name(root[1])} during {_where(st[root[0]])}")
    else:
        failed = pending
        parts.append(f"torchrun exited with code {outcome.returncode}; ranks {pending} did not finish")
    if root and failed and root[0] not in failed:
        parts.append(f"torchrun's first observed failure was rank {root[0]} ({_signal_name(root[1])}), a rank "
                     "that waited on the failed one")
    if outcome.leftover_pids:
        parts.append(f"WARNING: processes {outcome.leftover_pids} survived SIGKILL")
    ranks = {r: {"status": s, "files": [f for f in RESULT_FILES if (folder / f"rank{r}" / f).exists()]}
             for r, s in st.items()}
    return {"failed_ranks": failed, "message": "; ".join(parts) + ".", "ranks": ranks,
            "root_cause": list(root) if root else None, "errors": {str(k): v for k, v in errors.items()}}
