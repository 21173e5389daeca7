"""The lines ``meshplan search`` prints beside its top table, one source for the text
(:func:`meshplan.report.search.print_search`) and the HTML page
(:func:`meshplan.report.html_pages.search_page`): where the config's own ``[mesh]`` stands
(:func:`configured_lines`), the goodput line and whether the goodput column is shown
(:func:`goodput_line`, :func:`goodput_shared`), and what the ``selective`` recompute of a row
models in the runtime's words (:func:`recompute_lines`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.search.columns import RECOMPUTE
from meshplan.search.driver import SearchResult
from meshplan.spec.wording import recompute_words, runtime


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
    (:func:`meshplan.spec.wording.recompute_words`: under torch Megatron-LM's core-attention
    recompute, which torchtitan has no option for), one line where a row shown or the best
    rejected one has it; none otherwise."""
    c, sel = r.candidates, RECOMPUTE.index("selective")
    rows = [e.index for e in r.top] + ([r.best_rejected.index] if r.best_rejected else [])
    if not any(int(c.rc[i]) == sel for i in rows):
        return []
    t = r.config.training.model_copy(update={"recompute": "selective"})
    return [f"recompute selective: {recompute_words(t, runtime(t, r.config.origin))}"]
