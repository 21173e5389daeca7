"""The memory lower bound of Megatron-LM's ``block`` rows at a given n (:func:`block_lower`) and
each row's least n, the smallest whose bound fits (:func:`least_block`), vectorised over the search's
candidates (:mod:`meshplan.search.block_recompute` says what the rows are and how the exact planner
picks n from the least one). Kept apart from that module, which the validity rules import, since the
bounds import those rules.
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.memory.constraints import usable_bytes
from meshplan.search.bounds import bounds
from meshplan.search.columns import RECOMPUTE, Candidates
from meshplan.search.memory import Tables, stage_layout, state


def block_lower(cfg: Config, tables: Tables, c: Candidates, n: np.ndarray) -> np.ndarray:
    """Lower bound of each row's timeline peak, bytes (candidates,), a ``block`` row's at b = ``n``
    (candidates,; :func:`meshplan.search.bounds.bounds`' ``block``), every other row's as the search's."""
    out = np.zeros(len(c))
    for p in np.unique(c.pp).tolist():
        at = np.flatnonzero(c.pp == p)
        g = c.take(at)
        st = stage_layout(cfg, g, int(p))
        out[at] = bounds(cfg, tables, g, st, state(cfg, tables, g, st), block=np.asarray(n)[at])[0].max(axis=1)
    return out


def least_block(cfg: Config, tables: Tables, c: Candidates) -> np.ndarray:
    """Each ``block`` row's least n (candidates,; 0 on other rows): the smallest b from 0 to its
    largest chunk's layers ``rk`` whose :func:`block_lower` fits the usable memory with ``[search]
    memory_margin`` (the limit over which the search rejects a row by its bound), by a bisection
    vectorised over the rows (the bound falls as b grows); ``rk`` where none short of it does.
    No plan at a smaller b fits (its peak is at least the bound)."""
    out = np.zeros(len(c), dtype=np.int64)
    rows = np.flatnonzero(c.rc == RECOMPUTE.index("block"))
    if not len(rows) or c.rk is None:
        return out
    g = c.take(rows)
    limit = usable_bytes(cfg.cluster, cfg.training) * (1 + cfg.search.memory_margin)
    lo, hi = np.zeros(len(g), dtype=np.int64), c.rk[rows]  # the bound at rk keeps no layer whole
    while (lo < hi).any():
        act = np.flatnonzero(lo < hi)  # the rows not yet settled
        mid = (lo[act] + hi[act]) // 2
        fits = block_lower(cfg, tables, g.take(act), mid) <= limit
        hi[act], lo[act] = np.where(fits, mid, hi[act]), np.where(fits, lo[act], mid + 1)
    out[rows] = lo
    return out
