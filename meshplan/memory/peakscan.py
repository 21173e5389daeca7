"""The peak of one step's memory timeline on arrays: the running bytes per kind over a
:class:`~meshplan.memory.passtable.PassTable` and its templates, without expanding the events
(issue 11 item 4: ``meshplan step`` of pp 128 x 4,096 micro-batches in under 1 s).

With ``cur_n`` the bytes per kind before pass n (an exclusive cumulative sum
of the templates' net change per kind), the peak is the first pass maximising ``sum(cur_n)
+`` its template's largest prefix total, and the maximum of kind k is ``max_n cur_n[k] +``
the template's largest prefix of k (and 0): the reference's running loop, as array
reductions (``argmax`` returns the first maximum, as the loop's strict ``>`` keeps it).
Integer arithmetic throughout, so the results are equal, not close.

:func:`meshplan.memory.reference.scan` is the same scan pass by pass in Python;
tests/test_memory_fast.py checks that both give the peak (when, what dominates it) and the
maxima per kind equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from meshplan.memory.passes import KINDS
from meshplan.memory.passtable import PassTable, present

_K = {k: i for i, k in enumerate(KINDS)}


def template_stats(entries: tuple) -> tuple[np.ndarray, int, int, np.ndarray]:
    """(net per kind, max prefix total, its offset, max prefix per kind) of one template,
    bytes (int64 arrays over :data:`KINDS`; offset: event index in the template).

    >>> [x.tolist() if hasattr(x, "tolist") else x for x in template_stats(((None, "activations", 5, ""),
    ...  (None, "activations", -2, ""), (None, "temporaries", 4, "")))][:3]
    [[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 4], 7, 2]
    """
    vec, kmax = [0] * len(KINDS), [0] * len(KINDS)  # Python ints: one loop step per event, no numpy scalars
    best, at, total = None, 0, 0
    for i, (_, kind, delta, _) in enumerate(entries):
        k = _K[kind]
        vec[k] += delta
        total += delta
        if vec[k] > kmax[k]:
            kmax[k] = vec[k]
        if best is None or total > best:
            best, at = total, i
    return np.array(vec, dtype=np.int64), (best if best is not None else 0), at, np.array(kmax, dtype=np.int64)


def at_offset(cur: np.ndarray, entries: tuple, off: int) -> np.ndarray:
    """Bytes per kind after event ``off`` of a pass that starts at ``cur``."""
    out = cur.copy()
    for _, kind, delta, _ in entries[:off + 1]:
        out[_K[kind]] += delta
    return out


@dataclass(frozen=True, eq=False)
class Scores:
    """What the peak scan reduces (see the module docstring): ``score`` (passes,) the
    largest running total inside each pass (int64 minimum for an empty template),
    ``after_first`` (kinds,) the largest bytes of each kind over passes 1 on, bytes."""

    score: np.ndarray
    after_first: np.ndarray

    def with_init_event(self, init_best: int, kind: str, delta: int) -> Scores:
        """The scores once the init template (pass 0 only) ends with one more event of
        ``delta`` bytes of ``kind`` (the timeline's fragmentation allowance) and its largest
        prefix total is ``init_best``: every later pass starts ``delta`` higher, in total
        and in ``kind``; nothing else changes, so nothing is scanned again.

        >>> Scores(np.array([5, 9, 7]), np.zeros(len(KINDS), np.int64)).with_init_event(6, "fragmentation", 2).score.tolist()
        [6, 11, 9]
        """
        score = self.score.copy()
        live = score[1:] != np.iinfo(np.int64).min
        score[1:][live] += delta
        score[0] = init_best
        after = self.after_first.copy()
        after[_K[kind]] += delta
        return Scores(score, after)


def _stat_arrays(stats: list) -> tuple[np.ndarray, ...]:
    """(net per kind, max prefix per kind, max prefix total, its offset) as arrays, one row per template."""
    return (np.array([s[0] for s in stats]), np.array([s[3] for s in stats]),
            np.array([s[1] for s in stats], dtype=np.int64), np.array([s[2] for s in stats]))


def scores(table: PassTable, templates: Sequence[tuple], stats: list) -> Scores:
    """:class:`Scores` of a pass table (``stats``: :func:`template_stats` of each template)."""
    vec, tk, best, _ = _stat_arrays(stats)
    tid = table.template
    net = vec.sum(axis=1)[tid]
    live = np.array([bool(t) for t in templates])[tid]
    return Scores(np.where(live, np.cumsum(net) - net + best[tid], np.iinfo(np.int64).min),
                  _kind_max_after_first(vec, tk, tid))


def peak(table: PassTable, templates: Sequence[tuple], stats: list, sc: Scores) -> tuple[int, int, np.ndarray, dict]:
    """(peak pass index, offset in it, bytes per kind at the peak, max per kind) from the
    scores (``argmax``: the first maximum, as the reference's strict ``>``)."""
    vec, tk, _, off = _stat_arrays(stats)
    tid = table.template
    any_live = any(bool(templates[t]) for t in present(tid, len(templates)).tolist())
    n = int(np.argmax(sc.score)) if any_live else 0
    o = int(off[tid[n]]) if any_live else 0
    cur = np.bincount(tid[:n], minlength=len(templates)) @ vec  # bytes per kind before pass n
    kmax = np.maximum(np.maximum(tk[tid[0]], 0), sc.after_first)
    return n, o, at_offset(cur, templates[tid[n]], o), {k: int(kmax[i]) for i, k in enumerate(KINDS)}


def scan(table: PassTable, templates: Sequence[tuple], stats: Optional[list] = None) -> tuple[int, int, np.ndarray, dict]:
    """(peak pass index, offset in it, bytes per kind at the peak, max per kind) on arrays
    (see the module docstring). ``stats``: :func:`template_stats` of each template when the
    caller has them."""
    stats = [template_stats(t) for t in templates] if stats is None else stats
    return peak(table, templates, stats, scores(table, templates, stats))


def init_only_at_first(table: PassTable) -> bool:
    """Whether the init template (0) is used by pass 0 alone and a later pass exists (then
    :meth:`Scores.with_init_event` applies)."""
    return len(table) > 1 and int(table.template[0]) == 0 and not (table.template[1:] == 0).any()


def _kind_max_after_first(vec: np.ndarray, tk: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Per kind, the largest ``cur_n + tk`` over passes n >= 1. Kinds no pass between the
    first and the last changes hold the first pass's net from pass 1 on; a cumulative sum
    runs only over the others (often activations alone)."""
    rest = tid[1:]
    if not len(rest):
        return np.zeros(vec.shape[1], dtype=np.int64)
    moving = np.flatnonzero(vec[present(rest[:-1])].any(axis=0))
    out = vec[tid[0]] + tk[present(rest)].max(axis=0)
    step = vec[:, moving].T[:, rest]  # (moving kinds, passes)
    cur = np.cumsum(step, axis=1) - step + vec[tid[0], moving][:, None]
    out[moving] = (cur + tk[:, moving].T[:, rest]).max(axis=1)
    return out
