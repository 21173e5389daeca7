"""The degrees of ``meshplan search``'s space (:mod:`meshplan.search.space`): every factorization
of the world over the registered dense search axes (:func:`dense_meshes`, ``[search]`` narrowing each
axis, its ``bound`` capping it), then each dense mesh times the expert axes' degrees
(:func:`expert_meshes`: ep, etp under an MoE model). Arrays of int64 degrees, one row per mesh, one
column per axis in mesh order.
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.spec.axes.base import divisors
from meshplan.spec.axes.registry import AXES, search_axes


def _allowed(values, allowed) -> list[int]:
    return [v for v in values if allowed is None or v in allowed]


def dense_meshes(cfg: Config) -> np.ndarray:
    """Every dense mesh with product = world, one column per registered dense search axis in
    mesh order (``(pp, dp_replicate, dp_shard, cp, tp)``): array (k, axes). Each axis takes
    the divisors of the world the outer axes leave (``[search]`` narrows them, its ``bound``
    caps them), the remainder axis (dp_shard) what is left."""
    o, world = cfg.search, cfg.cluster.world
    cols = [c for n, c in search_axes() if not AXES[n].expert]
    free = [k for k, c in enumerate(cols) if not c.remainder]
    rest = [k for k, c in enumerate(cols) if c.remainder]
    caps = [(c.bound(cfg) if c.bound is not None else None) or world for c in cols]  # a degree is at most the world
    out: list[tuple[int, ...]] = []

    def walk(j: int, left: int, row: list[int]) -> None:
        if j == len(free):
            if not rest and left != 1:  # no remainder axis: the free ones must make the world
                return
            full = list(row) + [left] * len(rest)  # one remainder axis takes what is left
            degs = [0] * len(cols)
            for k, v in zip(free + rest, full):
                degs[k] = v
            ok = all(_option_ok(o, cols[k], degs[k]) for k in rest)
            if ok and all(degs[k] <= caps[k] for k in range(len(cols))):
                out.append(tuple(degs))
            return
        col = cols[free[j]]
        for v in _allowed(divisors(left), getattr(o, col.option, None)):
            walk(j + 1, left // v, row + [v])

    walk(0, world, [])
    return np.array(out, dtype=np.int64).reshape(-1, len(cols))


def _option_ok(o, col, v: int) -> bool:
    allowed = getattr(o, col.option, None)
    return allowed is None or v in allowed


def expert_meshes(cfg: Config, dense: np.ndarray) -> np.ndarray:
    """Dense meshes x every registered expert axis's degrees: (k, dense + expert axes).
    Dense models: each expert axis 1. An expert axis's values see the dense row and the expert
    axes before it (etp sees ep: :func:`meshplan.spec.axes.ep.etp_values`)."""
    dense_cols = [c.column for n, c in search_axes() if not AXES[n].expert]
    experts = [c for n, c in search_axes() if AXES[n].expert]
    if not cfg.model.is_moe:
        return np.hstack([dense, np.ones((len(dense), len(experts)), dtype=np.int64)])
    o, rows = cfg.search, []
    for d in dense:
        named = dict(zip(dense_cols, (int(x) for x in d)))
        combos: list[tuple[int, ...]] = [()]
        for k, col in enumerate(experts):
            combos = [c + (v,) for c in combos for v in _allowed(
                col.values(cfg, named | {e.column: x for e, x in zip(experts[:k], c)}) if col.values else [1],
                getattr(o, col.option, None))]
        rows += [(*d, *c) for c in combos]
    return np.array(rows, dtype=np.int64).reshape(-1, len(dense_cols) + len(experts))
