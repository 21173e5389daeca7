"""The lines ``meshplan search`` prints beside its top table, one source for the text
(:func:`meshplan.report.search.print_search`) and the HTML page
(:func:`meshplan.report.html_pages.search_page`): where the config's own ``[mesh]`` stands
(:func:`configured_lines`), the goodput line and whether the goodput column is shown
(:func:`goodput_line`, :func:`goodput_shared`), what the ``selective`` recompute of a row
models in the runtime's words (:func:`recompute_lines`), the headroom warning
(:func:`headroom_lines`), the warning on a row 1 that runs a split-backward schedule with activation
checkpointing under torch (:func:`split_ac_lines`), the rows shown at a setting that keeps the headroom
(:func:`safer_lines`) and the top mesh's other settings (:func:`variants_line`);
:func:`meshplan.report.search.table_lines` puts every line under the table in order.
"""

from __future__ import annotations

from typing import Optional

from meshplan.memory.constraints import Constraints, usable_bytes
from meshplan.pipeline.split_backward_ac import split_backward_ac_head, w_replay_words
from meshplan.plan import build_plan
from meshplan.plan_fidelity import plan_setting_line
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import RECOMPUTE
from meshplan.search.driver import SearchResult
from meshplan.memory.headroom import FRAGMENTATION_SOURCE, tight as tight_peak
from meshplan.search.headroom import tier_line
from meshplan.search.rank import top_heading, variant_label
from meshplan.search.split_ac import split_ac_table
from meshplan.spec.memory import ALLOCATOR_FRAGMENTATION
from meshplan.spec.search import TIE
from meshplan.spec.recompute_words import recompute_words
from meshplan.spec.wording import runtime
from meshplan.units import GiB


def configured_lines(r: SearchResult) -> list[str]:
    """Where the config's own ``[mesh]`` stands among the candidates
    (:meth:`meshplan.search.configured.Configured.line`: rank by step time, the top table's row,
    undecided counts), one line; none for a config without a ``[mesh]``."""
    return [r.configured.line()] if r.configured else []


def goodput_cell(goodput: Optional[float]) -> str:
    """A row's goodput as the column prints it: ``92.77%``, ``-`` where none was planned.

    >>> goodput_cell(0.927749), goodput_cell(None)
    ('92.77%', '-')
    """
    return f"{goodput:.2%}" if goodput is not None else "-"


def goodput_shared(r: SearchResult) -> Optional[str]:
    """The goodput of every row shown as the column prints it (:func:`goodput_cell`), where
    there are two rows or more and all print the same value; None otherwise (the column is
    shown). The Daly goodput (:mod:`meshplan.reliability`) reads the checkpoint's bytes (the
    persistent state, each distinct shard once) and the failure rate of the job's GPUs, neither
    of which the mesh changes but for a few replicated tensors (norms, KV heads), so at the
    default storage every row of a search usually prints the same."""
    cells = {goodput_cell(e.goodput) for e in r.top}
    return cells.pop() if len(r.top) > 1 and len(cells) == 1 and "-" not in cells else None


def goodput_line(r: SearchResult) -> str:
    """The goodput line under the top table (:meth:`meshplan.spec.search.SearchOptions.goodput_words`),
    where :func:`goodput_shared` drops the column led by that value, that it is the same for
    every candidate shown and why."""
    same = goodput_shared(r)
    words = "" if same is None else (
        f"{same} for every candidate shown, so no column: the checkpoint's bytes (the persistent state, each shard "
        f"written once) and the failure rate (of all {r.config.cluster.world:,} GPUs) do not depend on the mesh here")
    return r.config.search.goodput_words(words)


def recompute_lines(r: SearchResult) -> list[str]:
    """What recompute ``selective`` models, in the words of the runtime the search plans
    (:func:`meshplan.spec.recompute_words.recompute_words`: under torch Megatron-LM's core-attention
    recompute, which torchtitan has no option for), one line where a row shown or the best
    rejected one has it; none otherwise."""
    c, sel = r.candidates, RECOMPUTE.index("selective")
    rows = [e.index for e in r.top] + ([r.best_rejected.index] if r.best_rejected else [])
    if not any(int(c.rc[i]) == sel for i in rows):
        return []
    t = r.config.training.model_copy(update={"recompute": "selective"})
    return [f"recompute selective: {recompute_words(t, runtime(t, r.config.origin))}"]


def headroom_lines(r: SearchResult) -> list[str]:
    """A warning naming the rows shown whose headroom (usable memory less the planned peak) is
    under :data:`~meshplan.spec.memory.ALLOCATOR_FRAGMENTATION` (15%) of the usable memory while the
    plan's ``[memory] fragmentation_fraction`` (the allowance that reserves headroom in the plan) is
    below it: they fit only if the allocator fragments less than PyTorch's caching allocator was
    measured to. The first such row's free memory in GiB and percent. None otherwise. The order
    lists them after the clear rows by default (the headroom tiers, :func:`tier_lines`). The first
    row shown clear of this and every other row warning is the one pointer of
    :mod:`meshplan.report.search_clear`, not this line's."""
    usable = usable_bytes(r.config.cluster, r.config.training)
    under = [(k, e) for k, e in enumerate(r.top, 1) if tight(r, e, usable)]
    if not under:
        return []
    k, e = under[0]
    rows = f"row {k} keeps" if len(under) == 1 else f"rows {', '.join(str(i) for i, _ in under)} keep"
    return ["warning: " + _headroom_text(r, rows, str(k), e, usable)]


def split_ac_lines(r: SearchResult) -> list[str]:
    """Where row 1 runs a split-backward schedule with activation checkpointing under framework
    torch (:func:`meshplan.search.split_ac.split_ac_table`), one ``warning:`` line: row 1's label,
    the words the plan's warning on its config opens with (:func:`meshplan.pipeline.split_backward_ac.split_backward_ac_head`),
    the issues (torchtitan #773, pytorch #136766; the search's note, which counts all such candidates,
    gives what they report) and what its step counts of that (:func:`meshplan.pipeline.split_backward_ac.w_replay_words`:
    W's forward replays under eager full or per-layer AC, nothing else). None otherwise. Not a rank: the order
    stays the step's. The first row shown clear of this and every other row warning is the one
    pointer of :mod:`meshplan.report.search_clear`, not this line's."""
    c = r.candidates
    table = split_ac_table(r.config.training)

    def split(e) -> bool:
        return bool(table[c.rc[e.index], c.ps[e.index]] and c.pp[e.index] > 1)

    if not r.top or not split(r.top[0]):
        return []
    e = r.top[0]
    cc = candidate_config(r.config, c, e.index)
    assert cc.mesh is not None  # a candidate's config always carries its mesh
    head = split_backward_ac_head(cc.training, cc.mesh.pp_schedule, int(c.pp[e.index]))
    return [f"warning: row 1 ({c.label(e.index)}) runs {head}, reported far slower than interleaved 1F1B and to run "
            f"out of memory (torchtitan issue #773, pytorch issue #136766: see the note); {w_replay_words(cc.training)}"]


def setting_lines(r: SearchResult) -> list[str]:
    """Where row 1 lies in a setting whose step error was measured larger than the development set's
    (:func:`meshplan.plan_fidelity.plan_setting_line`: ZeRO-3 sharded across nodes, torch FSDP on A100,
    torch on H100, as :data:`~meshplan.spec.accuracy.FIDELITY` lists them), one ``warning:`` line naming
    it with its figures (newcomer trial 34: a Megatron FSDP mesh at dp_shard 512 across nodes ranked
    first with only the development set's error printed). Not a rank: the order stays the step's.
    Row 1's plan is built as the search's step-only evaluation built it (:class:`meshplan.search.exact.Planner`:
    no constraint rows, which do not depend on the mesh and which the line does not read; no memory
    timelines): 5 ms of CPU on the 405B example, not the 23 ms of a plan with its constraint rows. The
    search keeps no plan (an :class:`~meshplan.search.exact.Exact` crosses processes); carrying the
    settings on every Exact would cost each memory plan the sharded axis's locality (0.55 ms there, 52
    such plans: more than this one rebuild)."""
    if not r.top:
        return []
    e = r.top[0]
    plan = build_plan(candidate_config(r.config, r.candidates, e.index), Constraints((), r.usable_bytes),
                      memory=False, reports=False)
    line = plan_setting_line(f"row 1 ({r.candidates.label(e.index)})", plan)
    return [line] if line else []


def export_headroom(r: SearchResult, pick: tuple[int, str]) -> tuple[str, ...]:
    """The headroom warning of :func:`headroom_lines` for the one row ``search --export`` writes
    (``pick``: row n, or with a letter row 1's variant ``1b``), without its ``warning:`` (the
    export's header adds it, printed and in the file). Empty where the row keeps the margin
    or ``[memory] fragmentation_fraction`` already reserves it."""
    n, letter = pick
    usable = usable_bytes(r.config.cluster, r.config.training)
    labels = [variant_label(k) for k in range(len(r.variants))]
    e = (r.variants[labels.index(f"{n}{letter}")] if letter else r.top[n - 1])
    if not tight(r, e, usable):
        return ()
    words = f"variant {n}{letter} keeps" if letter else f"row {n} keeps"
    return (_headroom_text(r, words, f"{n}{letter}", e, usable),)


def tight(r: SearchResult, e, usable: float) -> bool:
    """Row ``e`` (planned whole) leaves under :data:`ALLOCATOR_FRAGMENTATION` of ``usable`` free
    while ``[memory] fragmentation_fraction`` is below it (:func:`meshplan.memory.headroom.tight`,
    the rule the headroom tiers order by)."""
    return e.complete and tight_peak(e.peak_bytes, usable, r.config.memory.fragmentation_fraction)


def tier_lines(r: SearchResult) -> list[str]:
    """Where a row shown is tight (:func:`tight`), one line: with ``[search] headroom_tier`` (the
    default) that those rows are listed after the clear ones, marked, and how to rank by step
    alone; without, that the order is the step's (:func:`meshplan.search.headroom.tier_line`).
    None where no row shown is tight."""
    usable = usable_bytes(r.config.cluster, r.config.training)
    n = sum(tight(r, e, usable) for e in r.top)
    return [tier_line(n, len(r.top), r.config.search.headroom_tier)] if n else []


def safer_lines(r: SearchResult) -> list[str]:
    """One line per row the headroom tiers showed at its mesh's fastest setting that keeps the
    headroom rather than its first by the rule, which is tight (:attr:`SearchResult.safer
    <meshplan.search.driver.SearchResult.safer>`, :func:`meshplan.search.headroom.tier_order`):
    ``row 1 (dp_shard 128) is shown at mb 2, full, vpp 1, zero3 (14.708 s, 75.7% free), its fastest
    setting that keeps 15% of the usable memory free; faster, mb 1, none, vpp 1, zero3 (11.212 s) keeps
    3.4% free (tight)``."""
    usable, out = usable_bytes(r.config.cluster, r.config.training), []
    at = {e.index: k for k, e in enumerate(r.top, 1)}
    for shown, first in r.safer:
        mesh, _ = r.candidates.label(shown.index).split(", mb ", 1)
        out.append(f"row {at.get(shown.index, '?')} ({mesh}) is shown at {_setting(r.candidates.label(shown.index), mesh)} "
                   f"({shown.step_s:.3f} s, {1 - shown.peak_bytes / usable:.1%} free), its fastest setting that keeps "
                   f"{ALLOCATOR_FRAGMENTATION:.0%} of the usable memory free; faster, "
                   f"{_setting(r.candidates.label(first.index), mesh)} ({first.step_s:.3f} s) keeps "
                   f"{1 - first.peak_bytes / usable:.1%} free (tight)")
    return out


def table_heading(r: SearchResult, n: int) -> str:
    """The top table's title (text and HTML) for its ``n`` rows: the rule's
    (:func:`meshplan.search.rank.top_heading`), and where the headroom tiers list a tight row after
    the clear ones, that they do (the tier line, :func:`tier_lines`, says how many); where they leave
    out a tight mesh the rule put before row 1 (the tiers rank the whole list before the cut,
    :mod:`meshplan.search.headroom`), that the rule's guarantee holds within each tier and that
    faster meshes under the headroom are left out."""
    head = top_heading(n, left_out=r.counts()["feasible"] > n)
    usable = usable_bytes(r.config.cluster, r.config.training)
    shown = {e.index for e in r.top}
    tiers = f"rows under {ALLOCATOR_FRAGMENTATION:.0%} of usable memory free listed last (headroom tiers)"
    if r.config.search.headroom_tier and any(e.index not in shown for e in r.tiered_past):
        return head.replace("than a row shown)", "than a row shown of its tier)") + f"; {tiers}, faster ones left out"
    if r.config.search.headroom_tier and any(tight(r, e, usable) for e in r.top):
        head += f"; {tiers}"
    return head


def peak_cell(r: SearchResult, e, usable: float) -> str:
    """A row's peak as the top table prints it, GiB, marked ``tight`` where it keeps under 15% of
    the usable memory free (:func:`tight`): ``62.8 tight``, ``28.3``."""
    return f"{e.peak_bytes / GiB:.1f}" + (" tight" if tight(r, e, usable) else "")


def _headroom_text(r: SearchResult, rows: str, tag: str, e, usable: float) -> str:
    """The words of the headroom warning for ``rows`` (``row 1 keeps``), its first row ``e``
    (``#tag``)."""
    frac, free = ALLOCATOR_FRAGMENTATION, usable - e.peak_bytes
    return (f"{rows} less than {frac:.0%} of the usable memory free (#{tag} "
            f"{r.candidates.label(e.index)}: peak {e.peak_bytes / GiB:.1f} of {usable / GiB:.1f} GiB, "
            f"{free / GiB:.1f} GiB = {free / usable:.1%} free) at [memory] fragmentation_fraction "
            f"{r.config.memory.fragmentation_fraction:.0%}; {FRAGMENTATION_SOURCE}: set [memory] "
            f"fragmentation_fraction = {frac:g} to plan with it")


def variants_line(r: SearchResult) -> list[str]:
    """One line naming the top mesh's other settings within 1% of the fastest step
    (:attr:`~meshplan.search.driver.SearchResult.variants`: at most 3, in the tie rule's order,
    each with its step and peak, led by its label for ``search --export``, ``1a``, ``1b``, ``1c``:
    :func:`~meshplan.search.rank.variant_label`), since every row is a distinct mesh; or that it has none. A
    variant whose sharding names the data axis otherwise than row 1's (a zero1/zero2 run, ``dp 16``,
    of a zero3 row, ``dp_shard 16``: :func:`meshplan.spec.mesh_words.mesh_text`) keeps its mesh's words."""
    if not r.top:
        return []
    mesh, _ = r.candidates.label(r.top[0].index).split(", mb ", 1)
    head = f"row 1's mesh ({mesh}) with other settings within {TIE:.0%} of the fastest step"
    if not r.variants:
        return [f"{head}: none (rows are distinct meshes, each with its first setting by the rule)"]
    parts = [f"{variant_label(k)} {_setting(r.candidates.label(e.index), mesh)} ({e.step_s:.3f} s"
             + (f", peak {e.peak_bytes / GiB:.2f} GiB)" if e.complete else ")") for k, e in enumerate(r.variants)]
    return [f"{head} (rows are distinct meshes): " + "; ".join(parts)]


def _setting(label: str, mesh: str) -> str:
    """A candidate's label less row 1's mesh words ``mesh``; whole where its own mesh words differ.

    >>> _setting("dp_shard 16, mb 2, none, vpp 1, zero3", "dp_shard 16")
    'mb 2, none, vpp 1, zero3'
    >>> _setting("dp 16, mb 1, none, vpp 1, zero2", "dp_shard 16")
    'dp 16, mb 1, none, vpp 1, zero2'
    """
    own, rest = label.split(", mb ", 1)
    return f"mb {rest}" if own == mesh else label
