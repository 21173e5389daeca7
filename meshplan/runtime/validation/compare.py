"""Line up recorded collectives with meshplan's collective table.

Both sides become a tally keyed by ``(axis, phase, op, size_bytes, dtype)``: a recorded
collective's axis is the first mesh axis, then derived axis, whose group of the recording
rank equals the collective's rank list (the name :func:`meshplan.comm.collectives.collective_table`
shows); a table row counts ``per_microbatch`` times (``per_step`` for once-per-step rows),
since a dry run is one micro-batch and one optimizer step.

Axes with the same groups are one axis to the comparison (:func:`canonical_axis`): with
dp_shard 4 and ep 4 the ep group is the dp_shard group, and an expert unit's efsdp group is
the dp_shard group when ep is 1. Both sides then use the first such axis in
``Mesh.all_axes()`` order, except that an all-to-all on the ep group is named ``ep``.

Dropless MoE routing (``dropless``): the token all-to-alls on ep carry as many rows as the
router sent this step (the plan's table: the balanced expectation), so both sides key them
by :data:`ROUTED` instead of bytes, and count them; the per-expert count exchange (int64,
fixed size) keeps its bytes.

>>> from collections import Counter
>>> differences(Counter({("tp", "forward", "all-reduce", 8, "fp32"): 5}),
...             Counter({("tp", "forward", "all-reduce", 8, "fp32"): 4}))
['tp forward all-reduce 8 B fp32: torch 5, meshplan 4']
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import model_groups
from meshplan.runtime.execution.recorder import Collective


#: One-time set-up traffic, not part of a training step: torch.distributed.pipelining's
#: static-mode warm-up vote on the first step. Left out of the comparison and the arrival
#: skew (kept in the files).
SETUP_PHASES = ("schedule-setup",)


#: The size key of a dropless run's token all-to-all (module docstring).
ROUTED = "routed"


def size_key(op: str, dtype: str, size, dropless: bool):
    """``size``, or :data:`ROUTED` for a dropless run's token all-to-all (not int64).

    >>> size_key("all-to-all", "fp32", 4096, True), size_key("all-to-all", "int64", 64, True)
    ('routed', 64)
    """
    return ROUTED if dropless and op == "all-to-all" and dtype != "int64" else size


def axis_of(mesh: Mesh, rank: int, group: Iterable[int], op: str = "", extra: Optional[dict] = None) -> str:
    """Name of the axis whose group of ``rank`` is ``group`` (``ep`` for an all-to-all on
    the ep group, else the first in ``Mesh.all_axes()``, then the first of ``extra``, the
    rank's groups that depend on the model: ``{"kv_replica": [0, 1]}``,
    :func:`rank_extra_groups`); ``?[ranks]`` when none is."""
    group = list(group)
    hits = [axis for axis in mesh.all_axes() if mesh.group_of(rank, axis) == group]
    hits += [name for name, ranks in (extra or {}).items() if list(ranks) == group]
    if not hits and mesh.group_of(rank, "efsdp") == group:  # ep = etp = 1, tp > 1: experts over fsdp x tp
        hits = ["efsdp"]
    if op == "all-to-all" and "ep" in hits:
        return "ep"
    return hits[0] if hits else f"?{group}"


def canonical_axis(mesh: Mesh, rank: int, axis: str, op: str = "", extra: Optional[dict] = None) -> str:
    """The name a table row's ``axis`` gets in the comparison: that of the recorded
    collective on the same group (:func:`axis_of`); ``axis`` itself when no axis of
    ``Mesh.all_axes()`` has its group (efsdp when ep = etp = 1 and tp > 1, which
    :func:`axis_of` names efsdp too). ``extra``: as :func:`axis_of` (a table row on
    ``kv_replica`` is named like a recorded collective on that group)."""
    group = (extra or {})[axis] if axis in (extra or {}) else mesh.group_of(rank, axis)
    name = axis_of(mesh, rank, group, op, extra)
    return axis if name.startswith("?") else name


def rank_extra_groups(mesh: Mesh, model, rank: int) -> dict[str, list[int]]:
    """``rank``'s group in each model-dependent group set
    (:func:`meshplan.mesh.tpsplit.model_groups`: ``kv_replica`` when tp > kv_heads)."""
    groups = model_groups(mesh, model, own_runtime=True)
    return {name: [int(r) for r in g[(g == rank).any(axis=1)][0]] for name, g in groups.items()}


def tally_records(records: list[Collective], mesh: Mesh, rank: int, extra: Optional[dict] = None,
                  dropless: bool = False) -> Counter:
    """Recorded collectives counted by (axis, phase, op, size_bytes, dtype); ``extra``: the
    rank's model-dependent groups (:func:`rank_extra_groups`); ``dropless``: see :func:`size_key`."""
    return Counter((axis_of(mesh, rank, r.group, r.op, extra), r.phase, r.op,
                    size_key(r.op, r.dtype, r.size_bytes, dropless), r.dtype) for r in records)


def tally_table(rows, mesh: Mesh | None = None, rank: int = 0, per_step: bool = False,
                extra: Optional[dict] = None, dropless: bool = False) -> Counter:
    """Rows of :func:`meshplan.comm.collectives.collective_table` counted the same way:
    ``per_microbatch`` times (``per_step`` for once-per-step rows), or ``per_step`` times
    when ``per_step``. ``mesh``: name axes as :func:`canonical_axis` does for ``rank``."""
    out: Counter = Counter()
    for r in rows:
        n = r.per_step if per_step else r.per_microbatch if r.per_microbatch else r.per_step
        size = int(r.size_bytes) if float(r.size_bytes).is_integer() else r.size_bytes
        size = size_key(r.op, r.dtype, size, dropless)
        axis = canonical_axis(mesh, rank, r.axis, r.op, extra) if mesh is not None else r.axis
        out[(axis, r.phase, r.op, size, r.dtype)] += n
    return out


def differences(recorded: Counter, predicted: Counter) -> list[str]:
    """One line per key whose counts differ: ``axis phase op bytes dtype: torch n, meshplan m``."""
    out = []
    for key in sorted(set(recorded) | set(predicted), key=str):
        if recorded[key] != predicted[key]:
            axis, phase, op, size, dtype = key
            out.append(f"{axis} {phase} {op} {size} B {dtype}: torch {recorded[key]}, meshplan {predicted[key]}")
    return out
