"""Staged validation evidence (issue 14 item 6: "run two nodes, then four, then eight; at each
scale compare message curves, rank arrival skew, local kernels and checkpoint behaviour with
the prediction"). At each world size of ``meshplan validate --worlds``, from the files the
workers of that launch wrote, four kinds of predicted-against-measured rows:

1. **Message curves** (``message_curves.csv``): every ``(axis, op)`` of the plan's table
   (send/recv excluded) timed by the in-run probe over :data:`~meshplan.runtime.validation.probe.CURVE_SIZES`
   (1 KiB to 4 MiB, powers of 4), all groups of the axis at once, against
   :func:`meshplan.comm.row.path_time` for the same (op, ranks, size) on the axis's
   path of the plan's cluster (the CPU testbed's loopback, or the netns testbed's NICs).
   nccl-tests columns: ``algbw = S / t``, ``busbw = algbw x busbw_factor(op, n)``
   (nccl-tests doc/PERFORMANCE.md; :func:`meshplan.comm.alphabeta.busbw`).
2. **Arrival skew** (``arrival_skew.csv``): for every collective of the recorded step (step 0)
   on every group, each member's entry time (``Collective.entry_s``, ``time.time()`` when the
   rank issued it; one clock on one host, across hosts shifted by :func:`clock_offsets`),
   skew = latest minus earliest arrival, and which rank came last. Predicted slack: 0 s for a
   group whose members all sit in one pipeline stage, since every member runs the same units
   on the same shapes (SPMD; the step model, :mod:`meshplan.schedule.rank_timeline`, simulates
   one rank per stage, so it predicts no wait between members); not predicted for a group
   that spans stages (a tied embedding's first and last stage).
3. **Kernels** (``kernels.csv``): each distinct local GEMM (forward, data and weight gradient)
   and the local attention (forward, backward) timed before the launch
   (:mod:`meshplan.runtime.validation.kerneltimes`, one thread, divided by the rank's core
   share) against the kernel-efficiency model on the testbed's "GPU": GEMMs by
   :func:`meshplan.compute.gemm.gemm_time` without a measured table (the tile/wave/roofline
   model), attention by :func:`meshplan.compute.layer.layer_cost`'s flash model.
4. **Checkpoint** (``checkpoint.csv``): per rank the DCP save and load seconds and the bytes of
   its ``.distcp`` files against :func:`meshplan.checkpoint_bytes.dcp_write_bytes` (and the times at
   ``--checkpoint-gbps``).

Everything here is a pure function of the plan and the files; :func:`staged_world` gathers a
world's rows, :func:`write_staged` writes ``staged.json`` and the CSVs; their sections of ``summary.md``
are :func:`meshplan.runtime.validation.summary.world_lines` and
:func:`~meshplan.runtime.validation.summary.cross_world_lines`.

Skew of one all-reduce on group (0, 1, 2) entered at 10.000, 10.003 and 10.001 s:

>>> rows = arrival_skew({r: [{"op": "all-reduce", "group": [0, 1, 2], "size_bytes": 8, "phase": "forward",
...                           "entry_s": t}] for r, t in ((0, 10.0), (1, 10.003), (2, 10.001))})
>>> round(rows[0]["skew_s"], 6), rows[0]["last_rank"], rows[0]["first_rank"]
(0.003, 1, 0)
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from meshplan.checkpoint_bytes import checkpoint_size, dcp_write_bytes
from meshplan.comm.alphabeta import algbw, busbw
from meshplan.comm.row import Path as LinkPath
from meshplan.comm.row import path_time
from meshplan.compute.gemm import gemm_time
from meshplan.compute.kernel_time import issue_floor
from meshplan.compute.layer import layer_cost
from meshplan.runtime.validation.compare import SETUP_PHASES
from meshplan.schedule.workload import workload_of

P2P = ("send", "recv", "send/recv")
SKEW_PREDICTION = ("0 s: every member of a group within one pipeline stage runs the same units on the same "
                   "shapes (SPMD), and the step model (meshplan.schedule.rank_timeline) simulates one rank per "
                   "stage, so it predicts no wait between members; groups spanning stages are not predicted")


def percentile(values, q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation between the two nearest
    ranks of the sorted values, position ``(n - 1) q`` (numpy's default, "linear").

    >>> percentile([0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 0.9), percentile([1, 2], 0.5)
    (90.0, 1.5)
    """
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def clock_offsets(clocks: dict[int, dict]) -> dict[int, float]:
    """Seconds to subtract from each rank's ``time.time()`` to put every rank on one clock.
    ``clocks``: rank -> ``{"host", "barrier_exit_s"}`` (the worker's ``collectives.json``
    ``clock``: when the rank left the barrier before the recorded step). On one host every
    rank reads the same clock: all 0. Across hosts each rank's barrier exit is taken as the
    same instant: offset = its exit minus rank 0's (the barrier's own spread, a few network
    latencies, stays in the skew).

    >>> clock_offsets({0: {"host": "a", "barrier_exit_s": 5.0}, 1: {"host": "a", "barrier_exit_s": 5.2}})
    {0: 0.0, 1: 0.0}
    >>> clock_offsets({0: {"host": "a", "barrier_exit_s": 5.0}, 1: {"host": "b", "barrier_exit_s": 7.5}})
    {0: 0.0, 1: 2.5}
    """
    if len({c.get("host") for c in clocks.values()}) <= 1:
        return {r: 0.0 for r in clocks}
    ref = clocks[min(clocks)]["barrier_exit_s"]
    return {r: c["barrier_exit_s"] - ref for r, c in clocks.items()}


def arrival_skew(records: dict[int, list[dict]], offsets: Optional[dict[int, float]] = None,
                 axis_of: Optional[Callable[[int, tuple, str], str]] = None,
                 stage_of: Optional[Callable[[int], int]] = None) -> list[dict]:
    """One row per collective call of every group: the k-th call of a group on each member
    (members issue a group's calls in the same order: the evidence checks it) paired across
    members; point-to-point and set-up calls left out. ``records``: rank -> its recorded
    collectives (``op``, ``group``, ``size_bytes``, ``phase``, ``entry_s``), in issue order;
    ``offsets``: :func:`clock_offsets`; ``axis_of(rank, group, op)`` names the axis,
    ``stage_of(rank)`` the pipeline stage (for the prediction). Row: ``axis``, ``group``,
    ``phase``, ``op``, ``size_bytes``, ``call`` (k, from 0), ``skew_s`` (latest minus earliest
    entry), ``first_rank``, ``last_rank``, ``arrivals_s`` (each member's entry after the
    earliest, in group order), ``predicted_s`` (0, or None across stages: :data:`SKEW_PREDICTION`).
    A group whose members recorded different numbers of calls is paired up to the shortest."""
    offsets = offsets or {}
    seqs: dict[tuple, dict[int, list[dict]]] = {}
    for rank, recs in records.items():
        for c in recs:
            if c["op"] not in P2P and c.get("phase") not in SETUP_PHASES:
                seqs.setdefault(tuple(c["group"]), {}).setdefault(rank, []).append(c)
    rows = []
    for group, by in sorted(seqs.items()):
        members = [r for r in group if r in by]
        if len(members) < 2:
            continue
        for k in range(min(len(by[r]) for r in members)):
            t = {r: by[r][k]["entry_s"] - offsets.get(r, 0.0) for r in members}
            first, last = min(members, key=lambda r: (t[r], r)), max(members, key=lambda r: (t[r], -r))
            c = by[members[0]][k]
            same_stage = stage_of is None or len({stage_of(r) for r in members}) == 1
            rows.append(dict(axis=axis_of(members[0], group, c["op"]) if axis_of else "", group=list(group),
                             phase=c.get("phase", ""), op=c["op"], size_bytes=c["size_bytes"], call=k,
                             skew_s=t[last] - t[first], first_rank=first, last_rank=last,
                             arrivals_s=[t[r] - t[first] for r in members],
                             predicted_s=0.0 if same_stage else None))
    return rows


def skew_summary(rows: list[dict]) -> dict:
    """Distribution of the rows' ``skew_s``: ``count``, ``median_s``, ``p90_s``
    (:func:`percentile`), ``max_s``; ``last_rank`` the rank that arrived last most often
    (ties: the lowest) with ``last_count`` and ``last_share``; ``by_axis`` the same per axis
    (without the last rank). Empty rows: ``count`` 0 and None for the rest.

    >>> s = skew_summary([dict(axis="tp", skew_s=x, last_rank=r) for x, r in ((0.001, 1), (0.003, 1), (0.002, 0))])
    >>> s["median_s"], round(s["p90_s"], 6), s["max_s"], s["last_rank"], s["last_count"]
    (0.002, 0.0028, 0.003, 1, 2)
    """
    if not rows:
        return dict(count=0, median_s=None, p90_s=None, max_s=None, last_rank=None, last_count=0, last_share=None,
                    by_axis={})
    skews = [r["skew_s"] for r in rows]
    lasts = Counter(r["last_rank"] for r in rows)
    last, n = min(lasts.items(), key=lambda kv: (-kv[1], kv[0]))
    by_axis = {}
    for axis in sorted({r["axis"] for r in rows}):
        xs = [r["skew_s"] for r in rows if r["axis"] == axis]
        by_axis[axis] = dict(count=len(xs), median_s=statistics.median(xs), p90_s=percentile(xs, 0.9), max_s=max(xs))
    return dict(count=len(rows), median_s=statistics.median(skews), p90_s=percentile(skews, 0.9), max_s=max(skews),
                last_rank=last, last_count=n, last_share=n / len(rows), by_axis=by_axis)


def _axis_paths(plan) -> dict[str, LinkPath]:
    """axis name as the table shows it -> its :class:`meshplan.comm.row.Path`."""
    paths: dict[str, LinkPath] = {}
    for rows in plan.collectives.values():
        for r in rows:
            paths.setdefault(r.axis, r.path)
    return paths


def curve_rows(plan, curves: dict) -> list[dict]:
    """Measured message-curve points (``curves.json`` rows of
    :func:`~meshplan.runtime.validation.probe.run_probe`) against
    :func:`meshplan.comm.row.path_time` on the axis's path for the same op, ranks and
    buffer, with nccl-tests' algbw and busbw (bytes/s) of both."""
    paths, cluster = _axis_paths(plan), plan.config.cluster
    out = []
    for m in curves.get("rows", []):
        op, n, size = m["op"], m["n_ranks"], m.get("buffer_bytes", m["size_bytes"])
        alg, pred = path_time(op, n, size, paths[m["axis"]], cluster)
        t = m["time_s"]
        out.append(dict(axis=m["axis"], op=op, n_ranks=n, size_bytes=size, algorithm=alg,
                        predicted_time_s=pred, measured_time_s=t, error=t / pred - 1 if pred else None,
                        predicted_algbw_bytes_per_s=algbw(size, pred), measured_algbw_bytes_per_s=algbw(size, t),
                        predicted_busbw_bytes_per_s=busbw(op, n, size, pred),
                        measured_busbw_bytes_per_s=busbw(op, n, size, t), iters=m["iters"]))
    return out


def kernel_rows(plan, measured: list[dict]) -> list[dict]:
    """Each measured kernel (``gemm_table.json`` rows: GEMMs ``m, n, k, seconds``; attention
    ``forward_s, backward_s``) against the kernel-efficiency model on the plan's "GPU": GEMMs by
    :func:`meshplan.compute.gemm.gemm_time` without a table (floored by
    :func:`meshplan.compute.kernel_time.issue_floor`, as the step model does), attention by the
    flash model of :func:`meshplan.compute.layer.layer_cost` without a table."""
    gpu, dtype = plan.config.cluster.gpu, plan.config.training.compute_dtype
    out = []

    def row(kernel, shape, pred, meas, note):
        out.append(dict(kernel=kernel, shape=shape, predicted_s=pred, measured_s=meas,
                        error=meas / pred - 1 if pred else None, note=note))

    for m in measured:
        if m.get("op") == "attention":
            w = replace(workload_of(plan), recompute="none")
            ops = [o for o in layer_cost(plan.config.model, gpu, w).ops if o.kind == "attention" and not o.recompute]
            shape = f"b{m['batch']} h{m['q_heads']}/{m['kv_heads']} s{m['seq_q']}x{m['seq_kv']} d{m['head_dim']}"
            for phase, key, name in (("forward", "forward_s", "attention forward"),
                                     ("backward_input", "backward_s", "attention backward")):
                sel = [o for o in ops if o.phase == phase]
                row(name, shape, sum(o.seconds for o in sel), m[key], sel[0].note if sel else "")
            continue
        e = gemm_time(gpu, m["m"], m["n"], m["k"], m.get("dtype", dtype))
        row("gemm", f"{m['m']}x{m['n']}x{m['k']}", issue_floor(gpu, e.seconds), m["seconds"], e.explanation)
    return out


def checkpoint_rank_rows(plan, records: list[dict], bytes_per_s: Optional[float] = None) -> list[dict]:
    """Per rank (``checkpoint.json`` of each): DCP bytes written against
    :func:`meshplan.checkpoint_bytes.dcp_write_bytes` of its stage, save and load seconds against
    those bytes (load: all it holds, :func:`meshplan.checkpoint_bytes.checkpoint_size`) at
    ``bytes_per_s`` (None without ``--checkpoint-gbps``). Records with an ``error`` keep it."""
    if not records:
        return []
    written = dcp_write_bytes(plan.state, plan.mesh, plan.config.model)  # KV copies saved once, as the runtime does
    held = checkpoint_size(plan.state, plan.mesh).per_rank_bytes
    out = []
    for rec in sorted(records, key=lambda x: x["rank"]):
        r = rec["rank"]
        if "error" in rec:
            out.append(dict(rank=r, predicted_bytes=None, measured_bytes=None, bytes_error=None, predicted_save_s=None,
                            save_s=None, predicted_load_s=None, load_s=None, note=rec["error"]))
            continue
        pred = written[min(plan.stage_of(r).index, len(written) - 1)]
        out.append(dict(rank=r, predicted_bytes=pred, measured_bytes=rec["bytes_written"],
                        bytes_error=rec["bytes_written"] / pred - 1 if pred else None,
                        predicted_save_s=pred / bytes_per_s if bytes_per_s else None, save_s=rec["save_s"],
                        predicted_load_s=held / bytes_per_s if bytes_per_s else None, load_s=rec["load_s"],
                        note="" if bytes_per_s else "times not predicted: give --checkpoint-gbps"))
    return out


def _json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def staged_world(plan, folder: Path, axis_of: Callable[[int, tuple, str], str],
                 checkpoint_bytes_per_s: Optional[float] = None) -> dict:
    """The four kinds of rows of one world from its folder (module docstring): ``curves``,
    ``curve_wall_s`` (seconds the curves took in the run), ``skew`` (rows), ``skew_summary``,
    ``skew_prediction``, ``kernels``, ``checkpoint``; ``missing`` names the kinds without files
    (no probe, pp > 1 has no checkpoint)."""
    world = plan.world
    missing = []
    curves = _json(folder / "rank0" / "curves.json")
    if curves is None:
        missing.append("message curves (run without the probe)")
    colls = {r: _json(folder / f"rank{r}" / "collectives.json") for r in range(world)}
    clocks = {r: c["clock"] for r, c in colls.items() if c and "clock" in c}
    offsets = clock_offsets(clocks) if len(clocks) == world else {}
    stage = lambda r: plan.stage_of(r).index
    skew = arrival_skew({r: c["records"] for r, c in colls.items() if c}, offsets, axis_of, stage)
    gemm = _json(folder / "gemm_table.json")
    ck = [x for x in (_json(folder / f"rank{r}" / "checkpoint.json") for r in range(world)) if x is not None]
    if not ck:
        missing.append("checkpoint (no DCP save in this run: pipeline stages are not saved yet)")
    return dict(world=world, curves=curve_rows(plan, curves) if curves else [],
                curve_wall_s=curves.get("wall_s") if curves else None, skew=skew, skew_summary=skew_summary(skew),
                skew_prediction=SKEW_PREDICTION, skew_clock="one host: time.time() on every rank" if len(
                    {c.get("host") for c in clocks.values()}) <= 1 else "several hosts: each rank's time.time() "
                "shifted by its exit from the barrier before the recorded step",
                kernels=kernel_rows(plan, gemm["rows"]) if gemm else [],
                checkpoint=checkpoint_rank_rows(plan, ck, checkpoint_bytes_per_s), missing=missing)


def csv_text(rows: list[dict]) -> str:
    """Rows as CSV text (the first row's keys as the header; a list cell as JSON); "" for none."""
    if not rows:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows([{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows])
    return buf.getvalue()


def write_staged(folder: Path, staged: dict, write_text: Callable[[Path, str], None]) -> None:
    """``staged.json`` and ``message_curves.csv``, ``arrival_skew.csv``, ``kernels.csv``,
    ``checkpoint.csv`` (a CSV for each kind with rows) through ``write_text`` (atomic)."""
    write_text(folder / "staged.json", json.dumps(staged, indent=1))
    for name, key in (("message_curves", "curves"), ("arrival_skew", "skew"), ("kernels", "kernels"),
                      ("checkpoint", "checkpoint")):
        if staged[key]:
            write_text(folder / f"{name}.csv", csv_text(staged[key]))
