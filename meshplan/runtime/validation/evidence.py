"""Compare one measured run with its plan and write the evidence: collectives per rank
against the collective table, measured step/phase times against the step-time model,
measured peak memory against the memory timeline. ``summary.md`` for a person:
:mod:`meshplan.runtime.validation.summary`.

Collectives: each rank's recorded step (``rank<r>/collectives.json``) is tallied by
(axis, phase, op, bytes, dtype) with :func:`~meshplan.runtime.validation.compare.tally_records` and set
against the table of ``stage 0`` counted per step (``per_step``: the recorded step is a
whole step of ``micro_batches`` micro-batches). Every differing key of every rank is a
difference; so is a DeviceMesh group that differs from the plan's rank list, and a group
whose members issued its collectives in different orders (:func:`order_differences`).

Times: per rank the median of the timed steps; the slowest rank is the measurement (SPMD:
every rank waits for the slowest at each collective). Predicted by
:func:`meshplan.schedule.steptime.step_time` with the measured GEMM table: ``forward`` = the F units
(embedding, layers, output layer and loss), ``backward`` = the B units, ``optimizer`` = the
optimizer step. Relative error = measured / predicted - 1. Collective time: the table's
alpha-beta time of every call of the step, summed as if none overlapped, against the
``gloo:*`` events in each rank's profiled step (their count is the recorded count when the
trace is complete); it separates communication-model error from compute-model error. Peak memory: the worker's
measurement (method named in each row) against the most loaded stage's timeline peak.
Times and memory gate the result only with a tolerance (``tolerance``); collectives and
groups always do, and so do the checkpoint bytes the busiest rank wrote, within
:data:`CHECKPOINT_BYTES_TOLERANCE` (state, not timing: a rank's experts missing from the DCP
files is lost state, not noise), and the ``memory max: params`` row of an FSDP2 run, within
:data:`~meshplan.runtime.validation.memcheck.KIND_TOLERANCE` (:func:`~meshplan.runtime.validation.memcheck.params_gate`).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Optional

from meshplan.checkpoint_bytes import checkpoint_size
from meshplan.compute.routing import RoutingOptions
from meshplan.plan import Plan
from meshplan.runtime.execution.recorder import Collective
from meshplan.runtime.execution.worker import write_atomic, write_json
from meshplan.runtime.validation.breakdown import breakdown_rows
from meshplan.runtime.validation.memcheck import memory_kind_rows, params_gate
from meshplan.runtime.validation.op_order import op_order
from meshplan.runtime.validation.compare import (SETUP_PHASES, axis_of, differences, rank_extra_groups, size_key,
                                                 tally_records, tally_table)
from meshplan.runtime.validation.probe import calibrated_plan
from meshplan.runtime.validation.routerload import router_rows
from meshplan.runtime.validation.staged import csv_text, staged_world, write_staged
from meshplan.schedule.steptime import step_time


def tally_table_per_step(rows, mesh=None, extra=None, dropless: bool = False) -> Counter:
    """Table rows counted once per step (``per_step``), keyed like the recorded tally
    (axes named by :func:`~meshplan.runtime.validation.compare.canonical_axis` when ``mesh`` is given;
    ``extra``: rank 0's model-dependent groups, :func:`~meshplan.runtime.validation.compare.rank_extra_groups`;
    ``dropless``: token all-to-alls keyed by count, :func:`~meshplan.runtime.validation.compare.size_key`)."""
    return tally_table(rows, mesh, per_step=True, extra=extra, dropless=dropless)


def _load(folder: Path, rank: int, name: str) -> dict:
    return json.loads((folder / f"rank{rank}" / name).read_text())


def _records(data: dict) -> list[Collective]:
    return [Collective(**{**r, "group": tuple(r["group"]), "in_shapes": tuple(map(tuple, r["in_shapes"])),
                          "out_shapes": tuple(map(tuple, r["out_shapes"]))}) for r in data["records"]
            if r.get("phase") not in SETUP_PHASES]


def compare_collectives(plan: Plan, folder: Path) -> tuple[list[str], list[dict], dict]:
    """(differences, CSV rows, per-rank group differences) of every rank."""
    tables: dict[int, Counter] = {}  # by the stage whose table it is (Plan.stage: middle stages share stage 1's)
    by_line: dict[str, list[int]] = {}
    tallies = {}
    groups = {}
    per_rank = {}
    records = {r: _records(_load(folder, r, "collectives.json")) for r in range(plan.world)}
    dropless = plan.config.model.is_moe and RoutingOptions.of(plan.config.training).dropless
    for r in range(plan.world):
        stage = plan.stage_of(r)  # each rank against its own pipeline stage's table
        if stage.table_stage not in tables:
            tables[stage.table_stage] = tally_table_per_step(stage.collectives, plan.mesh,
                                                             rank_extra_groups(plan.mesh, plan.config.model, 0),
                                                             dropless)
        per_rank[r] = tables[stage.table_stage]
        tallies[r] = tally_records(records[r], plan.mesh, r, rank_extra_groups(plan.mesh, plan.config.model, r),
                                   dropless)
        for line in differences(tallies[r], per_rank[r]):
            by_line.setdefault(line, []).append(r)
        g = _load(folder, r, "startup.json")["group_differences"]
        if g:
            groups[r] = g
    diffs = [f"ranks {_ranks(rs)}: {line}" for line, rs in by_line.items()]
    diffs += ["order: " + d for d in order_differences(records, dropless)]
    diffs += [f"rank {r} groups: {d}" for r, ds in groups.items() for d in ds]
    keys = sorted({k for t in per_rank.values() for k in t} | {k for t in tallies.values() for k in t}, key=str)
    rows = [dict(axis=k[0], phase=k[1], op=k[2], size_bytes=k[3], dtype=k[4], meshplan=per_rank[0][k],
                 **{f"rank{r}": tallies[r][k] for r in range(plan.world)},
                 **({f"meshplan_rank{r}": per_rank[r][k] for r in range(plan.world)} if len(tables) > 1 else {}))
            for k in keys]
    return diffs, rows, groups


def order_differences(records: dict[int, list], dropless: bool = False) -> list[str]:
    """Every member of a group must issue the group's collectives in the same order (a
    backend pairs the k-th call of each member; a different order deadlocks or mixes data).
    ``records``: rank -> its recorded :class:`~meshplan.runtime.execution.recorder.Collective` list in
    issue order. Point-to-point ops are left out (they pair sender and receiver, not a group).
    ``dropless``: a token all-to-all's bytes differ by rank (each sends what it routed), so it
    is compared by op and dtype (:func:`~meshplan.runtime.validation.compare.size_key`).
    Returns one line per member whose sequence differs from the group's lowest rank.

    >>> from meshplan.runtime.execution.recorder import Collective
    >>> c = lambda op, n: Collective(op, op, (0, 1), n, "fp32", (), ())
    >>> order_differences({0: [c("all-gather", 8), c("all-reduce", 4)], 1: [c("all-gather", 8), c("all-reduce", 4)]})
    []
    >>> order_differences({0: [c("all-gather", 8), c("all-reduce", 4)], 1: [c("all-reduce", 4), c("all-gather", 8)]})
    ["group [0, 1]: rank 1's call 1 is all-reduce 4 B fp32, rank 0's is all-gather 8 B fp32"]
    """
    seqs: dict[tuple, dict[int, list]] = {}
    for rank, recs in records.items():
        for c in recs:
            if c.op not in ("send", "recv", "send/recv"):
                size = size_key(c.op, c.dtype, c.size_bytes, dropless)
                seqs.setdefault(tuple(c.group), {}).setdefault(rank, []).append((c.op, size, c.dtype))
    out = []
    name = lambda call: "nothing" if call is None else f"{call[0]} {call[1]} B {call[2]}"
    for group, by in sorted(seqs.items()):
        ref_rank = min(by)
        ref = by[ref_rank]
        for rank in sorted(set(group) & set(records)):
            seq = by.get(rank, [])
            if seq != ref:
                k = next((i for i, (a, b) in enumerate(zip(seq, ref)) if a != b), min(len(seq), len(ref)))
                at = lambda s: s[k] if k < len(s) else None
                out.append(f"group {list(group)}: rank {rank}'s call {k + 1} is {name(at(seq))}, rank {ref_rank}'s is "
                           f"{name(at(ref))}")
    return out


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def measured_times(plan, folder: Path) -> dict:
    """Per quantity (step, forward, backward, optimizer): median over the timed steps of
    each rank; ``max``/``min`` over ranks and the slowest rank."""
    per_rank = {}
    for r in range(plan.world):
        steps = [s for s in _load(folder, r, "timings.json")["steps"] if s["kind"] == "measured"]
        if not steps:
            raise ValueError(f"rank {r} has no measured steps in timings.json")
        med = lambda f: statistics.median(f(s) for s in steps)
        per_rank[r] = {"step": med(lambda s: s["step_s"]),
                       "forward": med(lambda s: s["phases_s"]["forward"] + s["phases_s"]["loss"]),
                       "backward": med(lambda s: s["phases_s"]["backward"]),
                       "optimizer": med(lambda s: s["phases_s"]["optimizer"])}
    return {q: {"max": max(v[q] for v in per_rank.values()), "min": min(v[q] for v in per_rank.values()),
                "slowest_rank": max(per_rank, key=lambda r: per_rank[r][q])} for q in per_rank[0]}


def predicted_times(plan, table) -> tuple[Optional[dict], str]:
    """Predicted seconds per quantity from :func:`meshplan.schedule.steptime.step_time`, or (None, why)."""
    try:
        st = step_time(plan, table=table)
    except Exception as e:  # the step-time model is optional here; say why it is missing
        return None, f"no step-time prediction: {type(e).__name__}: {e}"
    units = [e for e in st.pipeline.events if e.stage == 0 and e.stream == "compute"]
    post = {e.name: e.dur_s for e in st.post_events if e.stage == 0}
    pred = {"step": st.step_s, "forward": sum(e.dur_s for e in units if e.args.get("kind") == "F"),
            "backward": sum(e.dur_s for e in units if e.args.get("kind") in ("B", "W")),
            "optimizer": post.get("optimizer step", 0.0)}
    return pred, "meshplan.schedule.steptime.step_time with the measured GEMM table; " + "; ".join(st.lines()[:3])


def calibrated_rows(plan, folder: Path, table, meas: dict) -> tuple[list[dict], str, object]:
    """Rows ``<quantity> time (calibrated)``: the same step-time model with each collective's
    time per call taken from the run's own probe (``rank0/probe.json``,
    :mod:`meshplan.runtime.validation.probe`) instead of alpha-beta; none without a probe. Returns
    (rows, note, the calibrated plan or None)."""
    path = folder / "rank0" / "probe.json"
    if not path.exists():
        return [], "no collective probe", None

    cplan, lines = calibrated_plan(plan, json.loads(path.read_text()))
    pred, _ = predicted_times(cplan, table) if cplan is not None else (None, "")
    note = "collective probe (seconds per call measured after the steps, every group of the axis at once): " + \
        "; ".join(lines)
    if pred is None:
        return [], note, None
    return [dict(quantity=f"{q} time (calibrated)", unit="s", predicted=pred[q], measured=m["max"],
                 measured_min=m["min"], rank=m["slowest_rank"], error=(m["max"] / pred[q] - 1) if pred[q] else None,
                 note="step-time model with each collective's time per call from this run's probe")
            for q, m in meas.items()], note, cplan


def calibration_line(rows: list[dict]) -> Optional[str]:
    """One line when the calibrated step is further from the measured step than the plain
    one (newcomer trial 21: +560% plain, +865% calibrated on 4 ranks over 2 cores), saying
    why and what to do; None otherwise. Calibration replaces only the collectives' alpha-beta
    times by this machine's probe (compute is already this machine's: GEMMs and attention
    timed in-process), so when the probe is faster than alpha-beta the calibrated step shrinks
    while the part the model does not time (``step part: the rest``: host, Python, ranks
    time-sharing cores) stays: the gap is not the collectives'."""
    by = {r["quantity"]: r for r in rows}
    plain, cal = by.get("step time"), by.get("step time (calibrated)")
    if not plain or not cal or plain["error"] is None or cal["error"] is None or abs(cal["error"]) <= abs(plain["error"]):
        return None
    ms = lambda r, k: f"{r[k] * 1e3:.1f} ms" if r and r.get(k) is not None else "n/a"
    coll, ccoll, rest = by.get("collective time (sum)"), by.get("collective time (sum) (calibrated)"), \
        by.get("step part: the rest")
    return (f"calibrated further off than plain ({cal['error']:+.0%} vs {plain['error']:+.0%}): this machine's probe "
            f"timed the plan's collectives at {ms(ccoll, 'predicted')} per step against the cluster description's "
            f"{ms(coll, 'predicted')} (alpha-beta), so the gap is not the collectives' cost (compute is already this "
            f"machine's timed GEMMs and attention); it is what the model does not time, `step part: the rest` "
            f"{ms(rest, 'measured')} measured vs {ms(rest, 'predicted')} predicted (host and Python time, ranks "
            "waiting for cores): to test the model, run no more ranks than cores (--worlds), or on GPUs")


def trace_collective_s(path: Path) -> tuple[float, int]:
    """(seconds, count) of gloo's collective events (``gloo:*``, on gloo's worker threads)
    in one rank's profiled step: the time collectives were in flight, waits for peers
    included; it may overlap compute. (0, 0) for a trace without them (NCCL)."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    hits = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("gloo:")]
    return sum(e.get("dur", 0) for e in hits) * 1e-6, len(hits)


def _collective_rows(folder: Path, plan, cplan=None) -> list[dict]:
    """Predicted total collective time of one step (table rows: time per call x calls per
    step, as if none overlapped) against the gloo events of each rank's profiled step; with
    ``cplan`` (the probe's times, not alpha-beta) a second row labelled " (calibrated)" against
    the same events. Each rank's trace (megabytes of JSON) is read once for both rows."""
    meas = {r: trace_collective_s(folder / f"rank{r}" / "trace.json") for r in range(plan.world)}
    if not any(n for _, n in meas.values()):
        return []
    worst = max(meas, key=lambda r: meas[r][0])
    out = []
    for p, label in ((plan, ""), (cplan, " (calibrated)")):
        if p is None:
            continue
        pred = sum(r.time_s * r.per_step for r in p.stage(0).collectives)
        calls = sum(r.per_step for r in p.stage(0).collectives)
        source = "the probe's" if label else "the alpha-beta"
        out.append(dict(quantity="collective time (sum)" + label, unit="s", predicted=pred, measured=meas[worst][0],
                        measured_min=min(v[0] for v in meas.values()), rank=worst,
                        error=(meas[worst][0] / pred - 1) if pred else None,
                        note=f"predicted: {calls} table calls x {source} time per call, none overlapped; measured: "
                             f"{meas[worst][1]} gloo:* events of the profiled step (profiler on)"))
    return out


#: Relative error allowed on the checkpoint bytes written per rank, always gated. The bytes
#: are the state's, exact in the plan; the files add serialization headers and DCP splits
#: replicated whole tensors between replicas unevenly: +0.6% to +4.0% measured
#: (tests/test_checkpoint_writes.py, DDP at world 4), +2% at dp_shard 16 x ep 8 (world 16).
#: 20% is the margin the memory rows give the state (memcheck). A rank whose experts DCP
#: dropped as replicas wrote -62% (dp_shard 8 x ep 8, efsdp 1, before ep_global's fix). Only a
#: deficit is gated: the plan splits replicated tensors evenly between their replicas, while
#: DCP's deduplication gives each whole tensor to one of them, so the busiest rank writes at
#: least the even split and, on a small scaled model of few tensors, much more (validate-slice's
#: mini tp 4 x dp 2 on the 2 x 4 testbed: +59%); state that is missing only shows as less.
CHECKPOINT_BYTES_TOLERANCE = 0.20


def checkpoint_gate(rows: list[dict]) -> list[str]:
    """One line per ``checkpoint bytes written per rank`` row more than
    :data:`CHECKPOINT_BYTES_TOLERANCE` under the plan (an excess is DCP's uneven deduplication, reported
    in the table, not gated); empty when none (or no checkpoint was written).

    >>> checkpoint_gate([dict(quantity="checkpoint bytes written per rank", unit="B",
    ...                       predicted=16_022_592, measured=6_046_554, error=6_046_554 / 16_022_592 - 1)])
    ['checkpoint bytes written per rank: measured 6.047e+06 B vs predicted 1.602e+07 (-62%, tolerance 20%): state is missing from the DCP files']
    """
    return [f"{r['quantity']}: measured {r['measured']:.4g} {r['unit']} vs predicted {r['predicted']:.4g} "
            f"({r['error']:+.0%}, tolerance {CHECKPOINT_BYTES_TOLERANCE:.0%}): state is missing from "
            "the DCP files" for r in rows if r["quantity"] == "checkpoint bytes written per rank"
            and r.get("error") is not None and r["error"] < -CHECKPOINT_BYTES_TOLERANCE]


def checkpoint_rows(plan, folder: Path, bytes_per_s: Optional[float] = None) -> list[dict]:
    """DCP save after the steps (``rank<r>/checkpoint.json``): the most bytes a rank wrote
    against :func:`meshplan.checkpoint_bytes.dcp_write_bytes` of the plan (replicated shards
    written once, split between their replicas), and the slowest rank's save and load times
    against those bytes (load: all it holds) at ``bytes_per_s`` (``--checkpoint-gbps``; not
    predicted without it). No rows when the run wrote none (pp > 1)."""
    files = [folder / f"rank{r}" / "checkpoint.json" for r in range(plan.world)]
    recs = [json.loads(f.read_text()) for f in files if f.exists()]
    errors = [x for x in recs if "error" in x]
    if errors:
        return [dict(quantity="checkpoint bytes written per rank", unit="B", predicted=None, measured=None,
                     measured_min=None, rank=errors[0]["rank"], error=None,
                     note=f"DCP save failed on {len(errors)} rank(s): {errors[0]['error']}")]
    if not recs:
        return []
    size = checkpoint_size(plan.state, plan.mesh, plan.config.model)  # KV copies saved once, as the runtime does
    pred = size.written_per_rank_bytes
    top = max(recs, key=lambda x: x["bytes_written"])
    rows = [dict(quantity="checkpoint bytes written per rank", unit="B", predicted=pred, measured=top["bytes_written"],
                 measured_min=min(x["bytes_written"] for x in recs), rank=top["rank"],
                 error=top["bytes_written"] / pred - 1 if pred else None,
                 note="DCP FileSystemWriter files of the busiest rank (tensor data + serialization headers); "
                      "predicted: its share, replicated shards split between their replicas")]
    for q, key, nbytes in (("checkpoint save time", "save_s", pred), ("checkpoint load time", "load_s",
                                                                       size.per_rank_bytes)):
        slow = max(recs, key=lambda x: x[key])
        want = nbytes / bytes_per_s if bytes_per_s else None
        rows.append(dict(quantity=q, unit="s", predicted=want, measured=slow[key],
                         measured_min=min(x[key] for x in recs), rank=slow["rank"],
                         error=slow[key] / want - 1 if want else None,
                         note=f"slowest rank; predicted {nbytes:.0f} B at the stated per-rank bandwidth"
                              if want else "not predicted: give --checkpoint-gbps"))
    return rows


def compare_world(plan, folder: Path, table, tolerance: Optional[float] = None,
                  checkpoint_bytes_per_s: Optional[float] = None) -> dict:
    """The comparison of one world (see the module docstring)."""
    diffs, coll_rows, groups = compare_collectives(plan, folder)
    order = op_order(plan, folder)  # pp > 1: the executed per-rank op order against the plan's
    diffs += order["differences"] if order else []
    meas = measured_times(plan, folder)
    pred, pred_note = predicted_times(plan, table)
    rows = []
    for q, m in meas.items():
        p = pred[q] if pred else None
        rows.append(dict(quantity=f"{q} time", unit="s", predicted=p, measured=m["max"], measured_min=m["min"],
                         rank=m["slowest_rank"], error=(m["max"] / p - 1) if p else None,
                         note="median of timed steps, slowest rank" + ("" if pred else "; not predicted")))
    cal_rows, cal_note, cplan = calibrated_rows(plan, folder, table, meas)
    rows += cal_rows
    n_time = len(rows)
    rows += _collective_rows(folder, plan, cplan)
    slow = meas["step"]["slowest_rank"]
    prof = [s["step_s"] for s in _load(folder, slow, "timings.json")["steps"] if s["kind"] == "profiled"]
    if prof:
        rows += breakdown_rows(cplan or plan, table, folder, slow, prof[0])
    mem = [_load(folder, r, "memory.json") for r in range(plan.world)]
    tl = plan.timeline
    worst = max(range(plan.world), key=lambda r: mem[r]["peak_bytes"])
    p_mem = tl.peak.total_bytes if tl is not None else None
    rows.append(dict(quantity="peak memory", unit="B", predicted=p_mem, measured=mem[worst]["peak_bytes"],
                     measured_min=min(m["peak_bytes"] for m in mem), rank=worst,
                     error=(mem[worst]["peak_bytes"] / p_mem - 1) if p_mem else None,
                     note=f"{mem[worst]['method']}; predicted: memory timeline peak at "
                          + (tl.peak.where() if tl is not None else "n/a")))
    if tl is not None:
        rows += memory_kind_rows(tl, mem[worst], worst)
    rows += checkpoint_rows(plan, folder, checkpoint_bytes_per_s)
    rows += router_rows(plan, folder)
    gated = []
    if tolerance is not None:  # the calibrated times when the run had a probe, else the pre-run ones
        times = [r for r in rows[:n_time] if r["quantity"].endswith("(calibrated)")] or rows[:n_time]
        for row in times + [r for r in rows if r["quantity"] == "peak memory"]:
            if row["error"] is not None and abs(row["error"]) > tolerance:
                gated.append(f"{row['quantity']}: measured {row['measured']:.4g} {row['unit']} vs predicted "
                             f"{row['predicted']:.4g} ({row['error']:+.0%}, tolerance {tolerance:.0%})")
    gated += checkpoint_gate(rows) + params_gate(rows)
    n = len(_load(folder, 0, "collectives.json")["records"])
    ok = not diffs and not gated
    msg = (f"collectives match the plan exactly on all {plan.world} ranks ({n} per step on rank 0); groups match"
           if not diffs else f"{len(diffs)} collective/group difference(s)")
    if order:
        msg += f"; {order['line']}"
    if gated:
        msg += f"; outside the tolerance: {'; '.join(gated)}"
    staged = staged_world(plan, folder, lambda r, g, op: axis_of(plan.mesh, r, g, op, rank_extra_groups(
        plan.mesh, plan.config.model, r)), checkpoint_bytes_per_s)
    return {"ok": ok, "message": msg, "differences": diffs + gated, "collectives": coll_rows,
            "predicted_vs_measured": rows, "prediction_note": pred_note, "calibration_note": cal_note,
            "calibration_line": calibration_line(rows),
            "group_differences": groups, "staged": staged, "op_order": order}


def write_world_evidence(folder: Path, result: dict) -> None:
    """collectives.csv, predicted_vs_measured.{csv,json} and comparison.json (the world's
    result with its comparison), each atomic."""
    comp = result["comparison"]
    write_atomic(folder / "collectives.csv", csv_text(comp["collectives"]))
    write_atomic(folder / "predicted_vs_measured.csv", csv_text(comp["predicted_vs_measured"]))
    write_json(folder / "predicted_vs_measured.json", comp["predicted_vs_measured"])
    if comp.get("staged"):
        write_staged(folder, comp["staged"], write_atomic)
    write_json(folder / "comparison.json", result)
