"""torch's window evictions (:func:`meshplan.pipeline.unshard_window.evicted`) of every stage of a
pipeline at once, for the search's per-key tables (:func:`meshplan.search.gather_passes._chunk_gathers`):
the same rule on a (stages, ops) array instead of one stage's (ops,) order per call, so that the
search's hundreds of (schedule, pp, micro-batches, vpp) keys take a few numpy calls each instead of
one set per stage. Equal to :func:`~meshplan.pipeline.unshard_window.evicted` row by row
(tests/test_search_window_rows.py checks it on every stage of interleaved 1F1B orders).
"""

from __future__ import annotations

import numpy as np

#: Most elements of one (stages, chunks, ops) block at a time (int32: 16 MiB): longer orders go
#: a few stages at a time.
BLOCK = 1 << 22


def evicted_rows(chunk: np.ndarray, window: int) -> np.ndarray:
    """(p, n) bool: :func:`~meshplan.pipeline.unshard_window.evicted` of each row of ``chunk``
    ((p, n) local chunk of each compute op of each stage's order, in order): True where the
    window resharded the op's chunk since its previous op (``window`` or more distinct other
    chunks between them); False on a chunk's first op; all False for ``window`` 0 or where the
    window holds every chunk. The distinct count uses the largest chunk over all rows: a chunk a
    row lacks never occurs in it, so a row with fewer chunks counts the same as alone."""
    ch = np.asarray(chunk, dtype=np.int64)
    p, n = ch.shape
    if n == 0 or p == 0:
        return np.zeros((p, n), dtype=bool)
    v = int(ch.max()) + 1
    if window <= 0 or v <= window:  # no window (0), or it holds every chunk
        return np.zeros((p, n), dtype=bool)
    step = max(1, BLOCK // (v * (n + 1)))
    return np.concatenate([_evicted_block(ch[a:a + step], v, window) for a in range(0, p, step)])


def _evicted_block(ch: np.ndarray, v: int, window: int) -> np.ndarray:
    """(rows, n) bool: :func:`evicted_rows` of a few rows, ``v`` > ``window`` chunks. ``last[r, c, j]``,
    the last position <= j of row r holding chunk c (-1 where none), gives each op j > 0 its chunk's
    previous op ``prev = last[r, ch[r, j], j - 1]``; chunk c occurs strictly between them exactly
    when ``last[r, c, j - 1] > prev`` (never for the op's own chunk, whose last is ``prev``): the
    same distinct count as :func:`~meshplan.pipeline.unshard_window.evicted`'s first positions
    after ``prev``, without its gather of (v, n) positions."""
    rows, n = ch.shape
    idx = np.arange(n, dtype=np.int32)  # positions: an order holds fewer than 2^31 ops
    last = np.where(ch[:, None, :] == np.arange(v)[None, :, None], idx, np.int32(-1))  # (rows, v, n)
    np.maximum.accumulate(last, axis=2, out=last)
    before = last[:, :, :-1]  # as seen by ops 1..n-1
    prev = np.take_along_axis(before, ch[:, None, 1:], axis=1)  # (rows, 1, n - 1)
    out = np.zeros((rows, n), dtype=bool)
    out[:, 1:] = (prev[:, 0] >= 0) & ((before > prev).sum(axis=1) >= window)
    return out
