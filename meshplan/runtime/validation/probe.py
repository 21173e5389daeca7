"""In-run collective probe: every distinct collective of the plan's table timed inside the
validate launch, under the run's own load, so that the step-time model can be re-evaluated
with measured collective times (the "calibrated" rows of the evidence).

Why: on the CPU testbed W ranks share C cores (W > C). A collective then waits until every
member is scheduled, so its cost is set by the operating system's scheduling far more than
by bytes or ring steps (measured here: a 256 B all-reduce over 4 of 8 ranks on 2 cores took
6-42 ms, against 0.45 ms for 2 ranks on 2 cores), and by the load of the other processes at
that moment. A calibration from another launch (``meshplan bench comm``) measures another
load; the probe measures this one. It is the nccl-tests step of a GPU validation (time each
group's collectives at the sizes the plan uses, then predict with them) done in the same
processes, after the timed and profiled steps so it cannot disturb them.

Message curves (:func:`curve_spec`, issue 14 item 6): the same timing, after the probe and on
the same groups, for every ``(axis, op)`` of the table over :data:`CURVE_SIZES` (1 KiB to
4 MiB), :data:`CURVE_BUDGET_S` per point; compared with the comm model in
:mod:`meshplan.runtime.validation.staged`.

Method: :func:`probe_spec` lists, per table row kind ``(axis, op, size)`` (send/recv excluded:
its pairs are the pipeline's, not a group's), every group of the axis. The worker
(:func:`run_probe`) creates each axis's groups once (every rank creates every group, in the
same order), then for each entry runs the op on all groups of the axis at the same time (as
in a training step, where every group of an axis communicates together): two untimed
calls, then at least ``MIN_ITERS`` timed calls and until ``budget_s`` is spent (the stop is
decided collectively, so every member makes the same calls); the entry's time is the median
per call, averaged over the group (nccl-tests reports the group's mean). Buffers are fp32 of
the table's full-buffer size (nccl-tests ``S``; :func:`meshplan.runtime.bench.comm.chunked`).

:func:`calibrated_plan` returns the plan with each table row's ``time_s`` replaced by the
probe's time for its ``(axis, op, size)``; :func:`meshplan.schedule.steptime.step_time` reads those
rows, so compute, overlap and schedule are the model's and only the per-call collective
times are measured.

>>> spec = [{"axis": "tp", "op": "all-gather", "size_bytes": 1024, "groups": [[0, 1], [2, 3]]}]
>>> [(e["axis"], e["op"], e["size_bytes"]) for e in spec]
[('tp', 'all-gather', 1024)]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Optional

from meshplan.mesh.tpsplit import model_groups
from meshplan.plan import Plan
from meshplan.runtime.bench.comm import chunked

MIN_ITERS = 3
PROBED_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def probe_spec(plan: Plan) -> list[dict]:
    """One entry per distinct ``(axis, op, size_bytes)`` of the plan's collective tables
    (ops in :data:`PROBED_OPS`): ``{"axis", "op", "size_bytes", "groups"}``, ``groups`` every
    rank list of the axis (ascending), as :meth:`meshplan.mesh.resolve.Mesh.groups` gives them."""
    seen, out = set(), []
    extra = model_groups(plan.mesh, plan.config.model, own_runtime=True)  # kv_replica: no mesh axis
    for rows in plan.collectives.values():
        for r in rows:
            key = (r.axis, r.op, int(r.size_bytes))
            if r.op not in PROBED_OPS or key in seen:
                continue
            seen.add(key)
            every = extra[r.axis] if r.axis in extra else plan.mesh.groups(r.axis)
            groups = sorted(sorted(int(x) for x in g) for g in every.tolist())
            out.append({"axis": r.axis, "op": r.op, "size_bytes": key[2], "groups": groups})
    return sorted(out, key=lambda e: (e["axis"], e["op"], e["size_bytes"]))


#: Message sizes of the in-run message curves (:func:`curve_spec`): powers of 4 from 1 KiB to
#: 4 MiB, seven sizes; 4 MiB is where the CPU testbed's loopback all-reduce reaches its
#: plateau bus bandwidth (cpu_testbed.toml: ~0.5 GB/s at 4-16 MiB).
CURVE_SIZES = tuple(1024 * 4 ** i for i in range(7))
#: Seconds per curve point after its ``MIN_ITERS`` calls (a 4 MiB point is a few calls):
#: the 35 points of a tp 2 + SP x FSDP2 mesh (5 axis/op kinds x 7 sizes) take 2-4 s of a
#: 4-rank launch of about 45 s on 2 cores.
CURVE_BUDGET_S = 0.05


def curve_spec(plan: Plan, sizes=CURVE_SIZES) -> list[dict]:
    """The message curve of every ``(axis, op)`` of the plan's tables (ops in
    :data:`PROBED_OPS`; send/recv pairs are the pipeline's, not a group's): one entry per size
    of ``sizes``, in :func:`probe_spec`'s format, so :func:`run_probe` times them the same way
    (every group of the axis at once)."""
    kinds = {(e["axis"], e["op"]): e["groups"] for e in probe_spec(plan)}
    return [{"axis": axis, "op": op, "size_bytes": int(size), "groups": groups}
            for (axis, op), groups in sorted(kinds.items()) for size in sizes]


def run_probe(rank: int, spec: list[dict], budget_s: float = 0.2, handles: Optional[dict] = None) -> dict:
    """Time every entry of ``spec`` (see the module docstring); every rank must call it with
    the same ``spec``. Returns ``{"budget_s", "wall_s", "rows": [{axis, op, size_bytes,
    buffer_bytes, n_ranks, time_s, iters}]}``; ``time_s`` is the group's mean of per-rank
    medians (seconds per call), ``wall_s`` this call's seconds. ``handles``: axis -> this
    rank's ProcessGroup, filled here and reused by a later call (the probe, then the
    message curves: the groups are created once)."""
    import torch
    import torch.distributed as dist

    from meshplan.runtime.bench.comm_worker import collective_buffers, collective_call

    device = torch.device("cpu")
    handles = {} if handles is None else handles  # torch ProcessGroup per axis
    rows = []
    t_start = time.perf_counter()
    for e in spec:
        groups = e["groups"]
        if e["axis"] not in handles:  # every rank creates every group of the axis, same order
            made = [dist.new_group(g) for g in groups]
            handles[e["axis"]] = next(h for g, h in zip(groups, made) if rank in g)
        mine, group = handles[e["axis"]], next(g for g in groups if rank in g)
        n = len(group)
        count, size = chunked(e["size_bytes"], n)
        inp, out, _ = collective_buffers(e["op"], count, n, group.index(rank), device)
        call = collective_call(e["op"], inp, out, mine)
        for _ in range(2):
            call()
        dist.barrier(group=mine)
        times, t_end = [], time.perf_counter() + budget_s
        while True:  # the stop is collective: every member makes the same calls
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
            if len(times) >= MIN_ITERS:
                flag = torch.tensor([float(time.perf_counter() >= t_end)])
                dist.all_reduce(flag, group=mine, op=dist.ReduceOp.MAX)
                if flag.item():
                    break
        med = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(med, group=mine)
        rows.append(dict(axis=e["axis"], op=e["op"], size_bytes=e["size_bytes"], buffer_bytes=size, n_ranks=n,
                         time_s=med.item() / n, iters=len(times)))
    dist.barrier()
    return {"budget_s": budget_s, "wall_s": time.perf_counter() - t_start, "rows": rows}


def calibrated_plan(plan: Plan, probe: dict) -> tuple[Optional[Plan], list[str]]:
    """``plan`` with each table row's ``time_s`` replaced by the probe's time for its
    ``(axis, op, size)`` (rows the probe did not time keep the model's), and one line per
    probed kind: measured against the alpha-beta model's time. (None, []) for an empty probe."""
    measured = {(r["axis"], r["op"], int(r["size_bytes"])): r["time_s"] for r in probe.get("rows", [])}
    if not measured:
        return None, []
    lines, seen = [], set()
    tables = {}
    for stage, rows in plan.collectives.items():
        new = []
        for r in rows:
            key = (r.axis, r.op, int(r.size_bytes))
            if key in measured:
                if key not in seen:
                    seen.add(key)
                    lines.append(f"{r.axis} {r.op} {key[2]} B over {r.group_size}: measured {measured[key] * 1e3:.3g} ms, "
                                 f"alpha-beta {r.time_s * 1e3:.3g} ms")
                r = replace(r, time_s=measured[key])
            new.append(r)
        tables[stage] = new
    return replace(plan, collectives=tables), lines
