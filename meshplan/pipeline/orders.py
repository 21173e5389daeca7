"""Pipeline stage orders on arrays: the (kind, micro-batch, chunk) of every unit of every stage
as integer arrays, equal to each schedule's :meth:`~meshplan.pipeline.base.PipelineSchedule.order`
(:func:`~meshplan.pipeline.simulate.stage_order`), for the array simulation
(:mod:`meshplan.pipeline.fast`), the memory timeline and the search. GPipe, 1F1B, interleaved
1F1B and ZB-H1 in closed form for all stages at once (10^6 units at pp 128 x 4,096
micro-batches); any other schedule (ZB-V, DualPipeV, a new one) from its unit list, stage by
stage; ``tests/test_fast_pipeline.py`` compares both with the lists. :func:`flat_units`: every
stage's order with the unit each one waits for, as flat indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from meshplan.pipeline.base import per_round
from meshplan.pipeline.pair_orders import KINDS, pairs as _pairs
from meshplan.pipeline.registry import get


def _zb_h1(p: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(kind, micro-batch) of ZB-H1 on every stage, (p, 3 m): per stage a grid of ``w``
    warm-up forwards, then per nb ``F(w + nb)`` while any is left, ``B(nb)``, ``W(nb - s)`` once
    ``nb >= s``, then the remaining W (:class:`~meshplan.pipeline.zb_h1.ZBH1`), kept by a mask
    that leaves exactly 3 m units on every row."""
    s = np.arange(p)[:, None]
    w = np.minimum(p - s - 1, m)
    i = np.arange(m)[None, :]
    # the (p, 5 m) grid filled in place, its middle as (p, m, 3) (F, B, W per nb): at pp 128 x
    # 4,096 micro-batches each fresh array of it costs ms of page faults in a cold run
    mb, keep = np.empty((p, 5 * m), dtype=np.int64), np.empty((p, 5 * m), dtype=bool)
    mid_mb, mid_keep = mb[:, m:4 * m].reshape(p, m, 3), keep[:, m:4 * m].reshape(p, m, 3)
    mb[:, :m] = mb[:, 4 * m:] = mid_mb[:, :, 1] = i
    np.add(w, i, out=mid_mb[:, :, 0])
    np.subtract(i, s, out=mid_mb[:, :, 2])
    np.less(i, w, out=keep[:, :m])
    np.less(mid_mb[:, :, 0], m, out=mid_keep[:, :, 0])
    mid_keep[:, :, 1] = True
    np.greater_equal(i, s, out=mid_keep[:, :, 2])
    np.greater_equal(i, np.maximum(0, m - s), out=keep[:, 4 * m:])
    kind = np.concatenate([np.zeros(m, np.int64), np.tile(np.arange(3), m), np.full(m, 2)])
    return np.broadcast_to(kind, mb.shape)[keep].reshape(p, 3 * m), mb[keep].reshape(p, 3 * m)


@lru_cache(maxsize=4)
def stage_orders(schedule: str, p: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind index into :data:`KINDS`, micro-batch, chunk) of every unit of every stage, each
    (p, units per stage), row s equal to :func:`~meshplan.pipeline.simulate.stage_order` of
    stage s; built for all stages at once on arrays (the orders of 1F1B, GPipe and
    interleaved 1F1B are :func:`_pairs` with the stage's warm-up; ZB-H1 :func:`_zb_h1`; the
    V-shaped ones from their unit lists), kept for the last few (schedule, p, m, v) and read-only
    (``meshplan step`` reads them for the memory timelines and again for the simulation).

    >>> k, mb, c = stage_orders("1f1b", 2, 3, 1)
    >>> [" ".join(f"{KINDS[a]}{b}" for a, b in zip(k[s], mb[s])) for s in range(2)]
    ['F0 F1 B0 F2 B1 B2', 'F0 B0 F1 B1 F2 B2']
    """
    z, s = np.zeros, np.arange(p)[:, None]
    if schedule in ("gpipe", "1f1b"):
        kind, mb = _pairs(np.full((p, 1), m) if schedule == "gpipe" else np.minimum(p - s - 1, m), m)
        out = kind, mb, z(kind.shape, dtype=np.int64)
    elif schedule == "zb_h1":
        kind, mb = _zb_h1(p, m)
        out = kind, mb, z(kind.shape, dtype=np.int64)
    elif schedule == "interleaved_1f1b":  # rounds of g micro-batches per chunk (g = p when p divides m)
        total, g, sched = m * v, int(per_round(p, m)), get(schedule)
        kind, fk = _pairs(sched.warmup(p, m, v, s), total)
        chunk = fk % (g * v)  # (in place below, as _pairs: no fresh array of 10^6 units)
        chunk //= g
        np.subtract(v - 1, chunk, out=chunk, where=kind != 0)  # backwards walk the chunks down
        within = fk % g
        np.floor_divide(fk, g * v, out=fk)  # fk becomes the micro-batch: (fk // (g v)) g + fk % g
        fk *= g
        fk += within
        out = kind, fk, chunk
    else:  # the others (ZB-V, DualPipeV): from the unit lists (as many units on every stage)
        rows = [_listed(schedule, p, m, v, st) for st in range(p)]
        out = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), np.stack([r[2] for r in rows])
    for col in out:
        col.flags.writeable = False
    return out


def order_arrays(schedule: str, p: int, m: int, v: int, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind index into :data:`KINDS`, micro-batch, chunk) of every unit of
    :func:`~meshplan.pipeline.simulate.stage_order` on stage ``s``, in order: row s of
    :func:`stage_orders` (read-only views).

    >>> k, mb, c = order_arrays("1f1b", 4, 5, 1, 1)
    >>> " ".join(f"{KINDS[a]}{b}" for a, b in zip(k, mb))
    'F0 F1 F2 B0 F3 B1 F4 B2 B3 B4'
    """
    if str(schedule) not in CLOSED_FORM:
        return _listed(schedule, p, m, v, s)
    kind, mb, chunk = stage_orders(str(schedule), int(p), int(m), int(v))
    return kind[s], mb[s], chunk[s]


#: Schedules whose orders :func:`stage_orders` builds in closed form for all stages at once.
CLOSED_FORM = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b")


def _listed(schedule: str, p: int, m: int, v: int, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order of stage ``s`` from the schedule's unit list, as (kind, micro-batch, chunk)."""
    rows = [(KINDS.index(u.kind), u.mb, u.chunk) for u in get(schedule).order(p, m, v, s)]
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    kinds, mbs, chunks = (np.array(col, dtype=np.int64) for col in zip(*rows))
    return kinds, mbs, chunks


@dataclass(frozen=True)
class Flat:
    """All units, stage-major (unit ``s * L + i`` is position i of stage s): ``kind``,
    ``mb``, ``chunk``; ``dep``: flat index of the unit it waits for (``N`` = none);
    ``cross``: the dependency is on another stage."""

    p: int
    length: int
    kind: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    dep: np.ndarray
    cross: np.ndarray

    @property
    def stage(self) -> np.ndarray:
        return np.arange(len(self.kind)) // self.length


def flat_units(schedule: str, p: int, m: int, v: int) -> Flat:
    """Orders of every stage and the dependency of each unit, as the reference's ``_dep``:
    F of virtual stage j waits for F of j-1, B of j for B of j+1 (the last virtual stage for
    its own F), W for its B."""
    kind, mb, chunk = (a.reshape(-1) for a in stage_orders(str(schedule), int(p), int(m), int(v)))
    length = len(kind) // p
    stage = np.repeat(np.arange(p), length)
    n, pv = p * length, p * v
    j = np.asarray(get(schedule).virtual_stage(chunk, stage, p, v), dtype=np.int64)
    # flat unit of (kind, virtual stage, mb), flattened: a stage's units of one kind and chunk
    # fill consecutive entries (micro-batches in order), so the scatter and the gather below
    # stay near in memory (the (kind, mb, virtual stage) order cost twice as much at 10^6 units)
    # (each index below computed in place: at 10^6 units every array of them costs ms to fill)
    where = np.full(3 * m * pv, n, dtype=np.int64)
    at = kind * pv  # (kind pv + j) m + mb
    at += j
    at *= m
    at += mb
    dj = np.arange(n)
    where[at] = dj
    # the gathers below write into arrays done with (mode "clip": unbuffered; every index is in
    # range), so no fresh array of 10^6 units: each costs ms of page faults in a cold run
    np.take(np.array([-1, 1, 0]), kind, out=dj, mode="clip")  # F: j - 1, B: j + 1, W: j
    dj += j
    np.minimum(dj, pv - 1, out=dj)
    np.maximum(dj, 0, out=dj)
    dkind = np.take(np.array([0, 1, 1]), kind, out=at, mode="clip")  # F: F, B: B, W: its B
    dkind[(kind == 1) & (j == pv - 1)] = 0  # B of the last virtual stage waits for its own F
    dkind *= pv  # (dkind pv + dj) m + mb
    dkind += dj
    dkind *= m
    dkind += mb
    dep = np.take(where, dkind, out=dj, mode="clip")
    dep[(kind == 0) & (j == 0)] = n
    stage *= length  # the stage's first flat unit
    outside = dep < stage
    stage += length
    outside |= dep >= stage
    cross = (dep < n) & outside
    return Flat(p, length, kind, mb, chunk, dep, cross)
