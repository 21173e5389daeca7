"""The search's one verdict on its rows against every warning it gives a row: which of them each
row shown has (:func:`row_warnings`), the first row shown with none (:func:`clear_verdict`) and
the one line that points to it (:func:`clear_line`), printed under the table after the row-1
warnings, on the ``--html`` page, in ``--json``'s ``first_clear_row`` and in the header of
``search --export`` of a row that has one.

The row warnings the search gives (:data:`HEADROOM`, :data:`SPLIT_AC`, and any other of the plan's
runtime warnings):

- :data:`HEADROOM`: the planned peak leaves under
  :data:`~meshplan.spec.memory.ALLOCATOR_FRAGMENTATION` (15%) of the usable memory free while
  ``[memory] fragmentation_fraction`` is below it (:func:`meshplan.report.search_lines.tight`,
  the table's headroom warning; GMLake, ASPLOS 2024);
- :data:`SPLIT_AC`: a split-backward schedule (zbv, dualpipev, zb_h1) under activation checkpointing with framework
  torch (:func:`meshplan.pipeline.split_backward_ac.split_backward_ac_warning`, the table's split-AC warning;
  torchtitan issue #773, pytorch issue #136766);
- any other of :func:`meshplan.plan_runtime.config_warnings` of the row's config, named by the
  words before its first ``": "`` (the schedule's, e.g. ZB-V with FSDP2 over a data axis, and
  zero1 without an engine, both rejected by rules today, so no row shown has one), less
  :func:`~meshplan.plan_runtime.position_warning`, which is the workload's, the same on every row.

Before this module each warning named its own "first row without it", and the two pointed to each
other's problem rows (a newcomer's Llama-3-70B search on 16 dgx-h100: the headroom warning's row was
a DualPipeV row under full AC, the split-AC warning's row had 0.6 GiB free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from meshplan.memory.constraints import usable_bytes
from meshplan.pipeline.split_backward_ac import split_backward_ac_warning
from meshplan.plan_runtime import config_warnings, position_warning
from meshplan.report.search_lines import export_headroom, tight
from meshplan.search.candidate import candidate_config
from meshplan.search.driver import SearchResult
from meshplan.search.explain import relative
from meshplan.search.rank import variant_label
from meshplan.spec.memory import ALLOCATOR_FRAGMENTATION
from meshplan.units import GiB

#: The headroom warning's name as the pointer lists it.
HEADROOM = f"under {ALLOCATOR_FRAGMENTATION:.0%} of usable memory free"
#: The split-backward warning's name as the pointer lists it.
SPLIT_AC = "a split-backward schedule under activation checkpointing"
#: Every row warning the search checks, as the pointer's last clause lists them.
CHECKED = (HEADROOM, SPLIT_AC + " (zbv, dualpipev, zb_h1 under framework torch)",
           "a runtime warning of the plan (plan and step print it)")
#: The setting that leaves each named warning out of a search.
SETTINGS = {HEADROOM: f"[memory] fragmentation_fraction = {ALLOCATOR_FRAGMENTATION:g}"}


def row_warnings(r: SearchResult, e) -> tuple[str, ...]:
    """The row warnings (module docstring) candidate ``e`` of ``r`` has, by name, in the order
    :data:`HEADROOM`, :data:`SPLIT_AC`, the others; empty when it is clear."""
    cc = candidate_config(r.config, r.candidates, e.index)
    assert cc.mesh is not None  # a candidate's config always carries its mesh
    split = split_backward_ac_warning(cc.training, cc.mesh.pp_schedule, int(r.candidates.pp[e.index]))
    workload = position_warning(r.config.model, r.config.training.seq_len, r.config.training.framework)
    others = [w.split(": ", 1)[0] for w in config_warnings(cc) if w not in split and w not in workload]
    usable = usable_bytes(r.config.cluster, r.config.training)
    return tuple([HEADROOM] * tight(r, e, usable) + [SPLIT_AC] * bool(split) + others)


@dataclass(frozen=True)
class ClearVerdict:
    """The rows shown against the row warnings: ``warnings`` per row shown (row k at k - 1),
    ``first`` the first row (1 = the top) with none, None where no row shown is clear."""

    warnings: tuple[tuple[str, ...], ...]
    first: Optional[int]


def clear_verdict(r: SearchResult) -> ClearVerdict:
    """:class:`ClearVerdict` of the rows shown (``r.top``)."""
    warned = tuple(row_warnings(r, e) for e in r.top)
    return ClearVerdict(warned, next((k for k, w in enumerate(warned, 1) if not w), None))


def clear_line(r: SearchResult, v: ClearVerdict, subject: str = "row 1", e=None) -> Optional[str]:
    """The pointer for ``subject`` (``row 1``; ``search --export``: ``row 3``, ``variant 1b``), the
    candidate ``e`` (default row 1) whose row warnings are listed: how many it has and which, then the
    first row shown with none (its label, peak, free share and step against ``e``'s) or that no row
    shown is clear, with how many rows shown have each warning and the setting that leaves it out of
    a search (:func:`_settings`), and the warnings checked. None where ``e`` has none (the table prints no pointer)."""
    e = r.top[0] if e is None else e
    own = row_warnings(r, e) if e is not r.top[0] else v.warnings[0]
    if not own:
        return None
    head = f"{subject} has {len(own)} of the search's row warnings ({'; '.join(own)})"
    if v.first is None:
        tail = f"no row shown is clear of them{_settings(r, v)}"
    else:
        x = r.top[v.first - 1]
        usable, whose = usable_bytes(r.config.cluster, r.config.training), f"{subject}'s"
        tail = (f"row {v.first} is the first row shown with none of them ({r.candidates.label(x.index)}: peak "
                f"{x.peak_bytes / GiB:.1f} GiB, {(usable - x.peak_bytes) / usable:.1%} free; step {x.step_s:.3f} s, "
                f"{relative(x.step_s / e.step_s - 1, whose)} {e.step_s:.3f} s)")
    return f"{head}; {tail}; the row warnings: {', '.join(CHECKED)}"


def _settings(r: SearchResult, v: ClearVerdict) -> str:
    """The clause of :func:`clear_line` where no row shown is clear: per row warning the rows shown
    have, most rows first, how many have it and the one setting that leaves it out of a search
    (``[search] pp_schedules`` without zbv, dualpipev and zb_h1 for :data:`SPLIT_AC`; ``[memory]
    fragmentation_fraction = 0.15`` for :data:`HEADROOM`: the plan reserves the margin, so no row is
    under it); a runtime warning of the plan with no setting named."""
    kept = [s for s in r.config.search.pp_schedules if s not in ("zbv", "dualpipev", "zb_h1")] or ["1f1b"]
    settings = SETTINGS | {SPLIT_AC: "[search] pp_schedules = [" + ", ".join(f'"{s}"' for s in kept) + "]"}
    counts: dict[str, int] = {}
    for w in v.warnings:
        for name in w:
            counts[name] = counts.get(name, 0) + 1
    parts = [f"{n}: {counts[n]} of {len(v.warnings)}" + (f", left out by {settings[n]}" if n in settings else "")
             for n in sorted(counts, key=lambda n: -counts[n])]
    return f" ({'; '.join(parts)})"


def clear_lines(r: SearchResult) -> list[str]:
    """The pointer under the table (:func:`clear_line` for row 1) as a ``warning:`` line; none
    where there is no row or row 1 has no row warning."""
    if not r.top:
        return []
    line = clear_line(r, clear_verdict(r))
    return [] if line is None else ["warning: " + line]


def export_warnings(r: SearchResult, pick: tuple[int, str]) -> tuple[str, ...]:
    """What ``search --export`` writes as ``warning:`` lines of its header (printed and in the file)
    for the row it writes (``pick``: row n, or with a letter row 1's variant ``1b``), beside the
    plan's own warnings on its config: the headroom warning's words for it
    (:func:`meshplan.report.search_lines.export_headroom`) and, where it has a row warning, the
    pointer :func:`clear_line` with it as the subject, the same line as under the table for row 1."""
    n, letter = pick
    e = r.variants[[variant_label(k) for k in range(len(r.variants))].index(f"{n}{letter}")] if letter else r.top[n - 1]
    line = clear_line(r, clear_verdict(r), f"variant {n}{letter}" if letter else f"row {n}", e)
    return export_headroom(r, pick) + (() if line is None else (line,))


def clear_to_dict(r: SearchResult) -> Optional[dict[str, Any]]:
    """``--json``'s ``first_clear_row``: ``row`` (1 = the top; null where no row shown is clear),
    ``row_warnings`` (per row shown, by name), ``checked`` (:data:`CHECKED`) and ``line`` (the
    pointer printed, without ``warning:``; null where row 1 has none); null without rows."""
    if not r.top:
        return None
    v = clear_verdict(r)
    return {"row": v.first, "row_warnings": [list(w) for w in v.warnings], "checked": list(CHECKED),
            "line": clear_line(r, v)}
