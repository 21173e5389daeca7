"""Line up recorded collectives with meshplan's collective table.

Both sides become a tally keyed by ``(axis, phase, op, size_bytes, dtype)``: a recorded
collective's axis is the first mesh axis, then derived axis, whose group of the recording
rank equals the collective's rank list (the name :func:`meshplan.collectives.collective_table`
shows); a table row counts ``per_microbatch`` times (``per_step`` for once-per-step rows),
since a dry run is one micro-batch and one optimizer step.

>>> from collections import Counter
>>> differences(Counter({("tp", "forward", "all-reduce", 8, "fp32"): 5}),
...             Counter({("tp", "forward", "all-reduce", 8, "fp32"): 4}))
['tp forward all-reduce 8 B fp32: torch 5, meshplan 4']
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from ..mesh import Mesh
from .recorder import Collective


def axis_of(mesh: Mesh, rank: int, group: Iterable[int]) -> str:
    """Name of the axis whose group of ``rank`` is ``group``; ``?[ranks]`` when none is."""
    group = list(group)
    for axis in mesh.all_axes():
        if mesh.group_of(rank, axis) == group:
            return axis
    return f"?{group}"


def tally_records(records: list[Collective], mesh: Mesh, rank: int) -> Counter:
    """Recorded collectives counted by (axis, phase, op, size_bytes, dtype)."""
    return Counter((axis_of(mesh, rank, r.group), r.phase, r.op, r.size_bytes, r.dtype) for r in records)


def tally_table(rows) -> Counter:
    """Rows of :func:`meshplan.collectives.collective_table` counted the same way."""
    out = Counter()
    for r in rows:
        n = r.per_microbatch if r.per_microbatch else r.per_step
        size = int(r.size_bytes) if float(r.size_bytes).is_integer() else r.size_bytes
        out[(r.axis, r.phase, r.op, size, r.dtype)] += n
    return out


def differences(recorded: Counter, predicted: Counter) -> list[str]:
    """One line per key whose counts differ: ``axis phase op bytes dtype: torch n, meshplan m``."""
    out = []
    for key in sorted(set(recorded) | set(predicted), key=str):
        if recorded[key] != predicted[key]:
            axis, phase, op, size, dtype = key
            out.append(f"{axis} {phase} {op} {size} B {dtype}: torch {recorded[key]}, meshplan {predicted[key]}")
    return out
