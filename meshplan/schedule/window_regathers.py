"""The chunk re-gathers of torch's unshard window in a plan's words: under framework torch with
pp > 1 and more local stages than the window holds (vpp > 3,
:data:`~meshplan.pipeline.unshard_window.TORCH_WINDOW`), the pipeline runtime reshards a chunk the
next ops do not use and all-gathers it again before its next pass
(:mod:`meshplan.pipeline.unshard_window`), even where ``reshard_after_forward`` is false. The
passes that gather only for that reason are those :func:`~meshplan.comm.fsdp_rows.fsdp_gather_flags`
(the rule the collective table counts with) flags with the window and not without it
(:func:`stage_regathers`). The reshard note (:mod:`meshplan.schedule.reshard_note`) and the
collective table's cadence lines (:func:`cadence_words`) say them.
"""

from __future__ import annotations

from collections import Counter

from meshplan.comm.fsdp_rows import fsdp_gather_flags
from meshplan.pipeline.unshard_window import TORCH_WINDOW, pipeline_window
from meshplan.spec.mesh_words import stage_list


def _window(plan) -> int:
    """The plan's window where it evicts (vpp above it), else 0."""
    w = pipeline_window(plan.config.training.framework, plan.pp)
    return w if len(plan.stages[0]) > w > 0 else 0


def stage_regathers(plan, stage: int) -> Counter:
    """Chunk re-gathers per step of ``stage``, keyed (local chunk, ``"F"`` or ``"B"``): the
    passes whose all-gather :func:`~meshplan.comm.fsdp_rows.fsdp_gather_flags` counts with the
    window and not without it, for the layer units (resharded after forward as
    ``training.reshard_after_forward`` says), times ``training.pp_schedule_runs``. Empty where the
    window evicts nothing (vpp <= 3, Megatron-LM, pp 1)."""
    w = _window(plan)
    if not w:
        return Counter()
    args = (plan.spec.pp_schedule, plan.pp, plan.run_micro_batches, len(plan.stages[0]), stage,
            plan.config.training.reshard_after_forward)
    with_w, without = fsdp_gather_flags(*args, window=w), fsdp_gather_flags(*args, window=0)
    out = Counter((c, k) for (c, k, mb), g in with_w.items() if g and not without[(c, k, mb)])
    return Counter({key: n * plan.schedule_runs for key, n in out.items()})


def _passes(plan, stage: int, kind: str) -> tuple[int, int]:
    """(chunk re-gathers, layers they all-gather) of ``kind`` per step on ``stage``."""
    got = stage_regathers(plan, stage)
    chunks = plan.stages[stage]
    return (sum(n for (c, k), n in got.items() if k == kind),
            sum(n * len(chunks[c]) for (c, k), n in got.items() if k == kind))


def note_words(plan) -> str:
    """`` except where torch's 3-stage unshard window at vpp 4 evicts a chunk: 7 chunk re-gathers
    per step on stages 0-1 (2 forward, 5 backward), ..., see the collective table``, or "" where
    the window evicts nothing. Stages of equal counts grouped; more than three groups as a range
    with stage 0's."""
    per = [(_passes(plan, s, "F")[0], _passes(plan, s, "B")[0]) for s in range(plan.pp)]
    if not any(f + b for f, b in per):
        return ""
    groups: dict = {}
    for s, fb in enumerate(per):
        groups.setdefault(fb, []).append(s)
    what = "chunk re-gathers per step"
    if len(groups) <= 3:
        said = ", ".join(f"{f + b}{f' {what}' if i == 0 else ''} on {stage_list(ss)} ({f} forward, {b} backward)"
                         for i, ((f, b), ss) in enumerate(groups.items()))
    else:
        tot = [f + b for f, b in per]
        said = f"{min(tot)} to {max(tot)} {what} per stage (stage 0: {per[0][0]} forward, {per[0][1]} backward)"
    return (f", except where torch's {TORCH_WINDOW}-stage unshard window at vpp {len(plan.stages[0])} evicts a "
            f"chunk: {said}; see the collective table")


def cadence_words(plan, stage: int, row) -> str:
    """Why a pipelined ``every layer`` FSDP all-gather row of ``stage`` counts what it does where
    the window re-gathers: `` (30 per step = 20 layers at their chunk's first forward + 10 layers
    of 2 chunk re-gathers of torch's 3-stage unshard window, vpp 4)``; "" elsewhere, and where the
    sum does not give the row's count (resharded after forward: every pass gathers anyway)."""
    if plan.config.training.reshard_after_forward or row.op != "all-gather" or row.per_microbatch \
            or row.cadence != "every layer" or row.phase not in ("forward", "backward"):
        return ""
    kind = "F" if row.phase == "forward" else "B"
    chunks, layers = _passes(plan, stage, kind)
    if not chunks:
        return ""
    first = sum(len(c) for c in plan.stages[stage]) * plan.schedule_runs if kind == "F" else 0
    if first + layers != row.per_step:
        return ""
    why = f"{layers} layers of {chunks} chunk re-gather{'s' if chunks > 1 else ''} of torch's {TORCH_WINDOW}-stage " \
          f"unshard window, vpp {len(plan.stages[0])}"
    head = f"{first} layers at their chunk's first forward + " if first else ""
    return f" ({row.per_step} per step = {head}{why})"
