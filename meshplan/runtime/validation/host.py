"""The host a measured run shares: its cores and load, and whether measured times can be
read as the model's error (issue 13 item 7).

A rank of ``validate`` is a process that wants a core for the whole step (gloo on CPU spins
and computes; on a GPU it drives its device). When the ranks and the work already running
on the host need more cores than the process may use, ranks are descheduled inside the step
and the step time measures the scheduler, not the model. Recorded per world (in
``comparison.json`` as ``host``, and in ``summary.md``):

- ``cores``: logical CPUs this process may run on (``os.sched_getaffinity(0)``; what
  torchrun's children inherit), ``cpu_count``: the host's (``os.cpu_count()``);
- ``load_before`` / ``load_after``: the 1-minute load average (``os.getloadavg()[0]``:
  runnable plus uninterruptible tasks, exponentially averaged over 1 minute, Linux
  ``/proc/loadavg``) before the ranks start and after they end;
- ``reliable`` and ``why``: measured times are marked unreliable when the ranks outnumber the
  cores, or when the load before the run plus the ranks exceeds the cores (``HIGH_LOAD``: the
  other work alone keeps that share of the cores busy).

>>> verdict(4, {"cores": 2, "cpu_count": 2, "load": 0.1}, {"cores": 2, "cpu_count": 2, "load": 3.9})["why"]
['4 ranks on 2 cores: ranks time-share cores']
>>> verdict(2, {"cores": 8, "cpu_count": 8, "load": 7.0}, {"cores": 8, "cpu_count": 8, "load": 8.0})["why"]
['host load 7.00 (1-minute average before the run) + 2 ranks > 8 cores']
"""

from __future__ import annotations

import os


def state() -> dict:
    """``{"cores", "cpu_count", "load"}`` of this host now (see the module docstring)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        load = None
    return {"cores": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "load": load}


def verdict(ranks: int, before: dict, after: dict) -> dict:
    """The ``host`` record of a run of ``ranks`` ranks between host states ``before`` and
    ``after`` (:func:`state`): cores, loads, ``reliable`` and the reasons ``why`` not."""
    cores, load = before["cores"], before["load"]
    why = []
    if ranks > cores:
        why.append(f"{ranks} ranks on {cores} cores: ranks time-share cores")
    elif load is not None and load + ranks > cores:
        why.append(f"host load {load:.2f} (1-minute average before the run) + {ranks} ranks > {cores} cores")
    return {"ranks": ranks, "cores": cores, "cpu_count": before["cpu_count"], "load_before": load,
            "load_after": after["load"], "reliable": not why, "why": why}


def mark(rows: list[dict], host: dict) -> None:
    """Append ``unreliable: <why>`` to the note of every time row (unit ``s``) of a
    predicted-against-measured table when ``host`` says measured times are unreliable."""
    if host["reliable"]:
        return
    for row in rows:
        if row.get("unit") == "s":
            row["note"] = (row.get("note") or "") + f"; unreliable: {'; '.join(host['why'])}"


def line(host: dict) -> str:
    """One line for summary.md and the console."""
    load = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    head = (f"host: {host['ranks']} ranks, {host['cores']} cores usable of {host['cpu_count']}, load (1 min) "
            f"{load(host['load_before'])} before, {load(host['load_after'])} after")
    return head + ("" if host["reliable"] else f"; measured times UNRELIABLE: {'; '.join(host['why'])} "
                   "(the step-time error then measures the scheduler, not the model)")
