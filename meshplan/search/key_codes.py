"""Distinct rows of a few integer key columns, for :func:`meshplan.search.memory.lookup`: each
row as one mixed-radix int64 code, then its distinct codes in ascending order (the order
``np.unique`` gives) and each row's place among them. Where the codes span few values (at most
:data:`DENSE_SPAN`, or four per row) a table over the span replaces ``np.unique``'s sort of
every row: the same distinct keys, in the same order, with the same inverse.
"""

from __future__ import annotations

import numpy as np

#: Largest code span a dense table covers (bool and int64 per value: 9 B each, ~37 MB at most).
DENSE_SPAN = 1 << 22


def distinct_rows(keys: list[np.ndarray]) -> tuple[list[list[int]], np.ndarray]:
    """(the distinct rows of ``keys`` (columns, each (n,) non-negative ints) as lists of Python
    ints, ascending by the mixed-radix code (first column least significant), and (n,) the place
    of each row among them)."""
    cols = [np.asarray(k, dtype=np.int64) for k in keys]
    code, radix, spans = np.zeros(cols[0].shape, dtype=np.int64), 1, []
    for col in cols:  # mixed-radix code of each row (np.unique on rows is slow)
        span = int(col.max()) + 1 if col.size else 1
        code, radix = code + col * radix, radix * span
        spans.append(span)
    if radix <= max(DENSE_SPAN, 4 * code.size) and not (code < 0).any():
        seen = np.zeros(radix, dtype=bool)
        seen[code] = True
        uniq = np.flatnonzero(seen)
        place = np.zeros(radix, dtype=np.int64)
        place[uniq] = np.arange(len(uniq))
        at, rest = [], uniq
        for span in spans:  # each column's value from the code: its digit
            at.append(rest % span)
            rest = rest // span
        return np.stack(at, axis=1).tolist(), place[code]
    if radix < 2**62:
        _, first, inv = np.unique(code, return_index=True, return_inverse=True)
    else:
        _, first, inv = np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)
    return np.stack([col[first] for col in cols], axis=1).tolist(), inv.reshape(-1)
