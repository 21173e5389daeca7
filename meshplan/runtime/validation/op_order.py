"""The pipeline's executed per-rank op order against the plan's (``meshplan validate``, nc56 #7).

Each rank of a pp > 1 run records its stage computations of the recorded step in order
(:func:`meshplan.runtime.execution.pipelined_recorder.op_kind`: ``F``, ``B``, ``I``, ``W`` with the
micro-batch and torch's stage index), kept as ``ops`` of that step in ``rank<r>/timings.json``. The
plan's order of the rank's pipeline stage is the registered schedule's
(:meth:`meshplan.pipeline.base.PipelineSchedule.order`, at vpp > 1 that of ``for_chunks(vpp)``), once
per schedule run (``training.pp_schedule_runs``), labelled as torch's are: a split backward's ``B``
is torch's ``I``; torch's full backward under a split schedule (the first stage's, which has no input
gradient) counts as its ``I`` then ``W``, as tests/test_schedule_registry.py compares them; at vpp > 1
each op names its virtual stage (``.s<k>``).

>>> planned_ops("1f1b", 2, 3, 1, 0)
['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
>>> executed_ops([["F", 0, 1], ["B", 0, 1]], "1f1b", 1), executed_ops([["B", 0, 0]], "zbv", 2)
(['F0', 'B0'], ['I0.s0', 'W0.s0'])
>>> first_difference(["F0", "F1", "B0"], ["F0", "B0", "F1"])
'op 2 ran F1 where the plan has B0'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from meshplan.pipeline.registry import get

#: Ops shown per rank.
SHOWN = 12


def _label(kind: str, mb: int, stage: int, v: int) -> str:
    return f"{kind}{mb}" + (f".s{stage}" if v > 1 else "")


def planned_ops(schedule, p: int, m: int, v: int, rank_stage: int, runs: int = 1) -> list[str]:
    """The plan's ops of pipeline rank ``rank_stage`` (p stages, m micro-batches a schedule run, v
    chunks a rank), torch's labels (module docstring), ``runs`` times."""
    sched = get(get(schedule).for_chunks(v))
    b = "I" if sched.splits_backward else "B"
    one = [_label(b if u.kind == "B" else u.kind, u.mb, int(sched.virtual_stage(u.chunk, rank_stage, p, v)), v)
           for u in sched.order(p, m, v, rank_stage)]
    return one * runs


def executed_ops(ops: list, schedule, v: int) -> list[str]:
    """A rank's recorded ``[kind, micro-batch, stage]`` triples as labels; a full backward under a
    split schedule as its ``I`` and ``W``."""
    split = get(schedule).splits_backward
    out = []
    for kind, mb, stage in ops:
        kinds = ("I", "W") if split and kind == "B" else (kind,)
        out += [_label(k, mb, stage, v) for k in kinds]
    return out


def first_difference(ran: list[str], plan: list[str]) -> Optional[str]:
    """Where ``ran`` first leaves ``plan`` (1-based op number), or None when they are equal."""
    for i, (a, b) in enumerate(zip(ran, plan)):
        if a != b:
            return f"op {i + 1} ran {a} where the plan has {b}"
    if len(ran) != len(plan):
        return f"{len(ran)} ops ran where the plan has {len(plan)}"
    return None


def op_order(plan, folder: Path) -> Optional[dict]:
    """Every rank's executed order against the plan's, from ``folder``'s ``rank<r>/timings.json``
    (None when the run records none: pp 1). ``ranks``: rank -> {stage, ran (first :data:`SHOWN`),
    planned (the same count), difference (or None)}; ``differences``: one line per rank that differs;
    ``line``: the one-line verdict. Rank keys are strings, as comparison.json has them."""
    c = plan.config
    p, v = len(plan.stages), plan.vpp
    out, diffs = {}, []
    for r in range(plan.world):
        steps = json.loads((folder / f"rank{r}" / "timings.json").read_text())["steps"]
        rec = next((s for s in steps if s.get("kind") == "recorded" and "ops" in s), None)
        if rec is None:
            return None
        k = min(rec["pipeline_stages"])  # the rank's pipeline stage (its first chunk's virtual stage)
        ran = executed_ops(rec["ops"], c.mesh.pp_schedule, v)
        want = planned_ops(c.mesh.pp_schedule, p, plan.run_micro_batches, v, k, plan.schedule_runs)
        diff = first_difference(ran, want)
        out[str(r)] = {"stage": k, "ran": ran[:SHOWN], "planned": want[:SHOWN], "difference": diff}
        if diff:
            diffs.append(f"pipeline op order, rank {r} (stage {k}): {diff}")
    same = len(diffs) == 0
    line = (f"pipeline op order as planned on all {plan.world} ranks" if same
            else f"pipeline op order differs from the plan on {len(diffs)} of {plan.world} ranks")
    return {"ranks": out, "differences": diffs, "line": line}


def order_lines(order: dict) -> list[str]:
    """Markdown lines: the verdict, then each rank's first ops (ranks with the same ops on one line)
    and, where the run left the plan, where."""
    groups: dict[tuple, list[int]] = {}
    for r, d in order["ranks"].items():
        groups.setdefault((d["stage"], tuple(d["ran"]), d["difference"]), []).append(int(r))
    lines = [order["line"] + f" (first {SHOWN} ops per rank, as run):", ""]
    for (stage, ran, diff), ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        who = f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} (stage {stage})"
        lines.append(f"- {who}: {' '.join(ran)}" + (f"; differs: {diff}" if diff else ""))
    return lines + [""]
