"""How many passes of a stage gather their FSDP units, per candidate: the layers' and the
root's (:func:`gathering_passes`, from the schedule's order and
:func:`~meshplan.comm.fsdp_rows.fsdp_gather_flags`, :func:`_gathers`), the routed experts'
(:func:`expert_gathers`), the head's own unit apart or gathered again (:func:`head_unit_apart`,
:func:`head_regathers`), the passes of the end chunks (:func:`end_chunk_passes`), and the chunks
the timeline holds gathered at chunk 0's first backward (:func:`chunks_held`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from meshplan.comm.fsdp_rows import fsdp_gather_flags
from meshplan.config import Config
from meshplan.memory.deepspeed_fetch import config_reuse
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import SHARDING
from meshplan.pipeline.orders import CLOSED_FORM, order_arrays, stage_orders
from meshplan.memory.schedule import stage_op_arrays
from meshplan.pipeline.unshard_window import held_after, pipeline_window, unshards_first
from meshplan.search.memory import Stages
from meshplan.search.window_rows import evicted_rows
from meshplan.search.space import FSDP_SHARDINGS, Candidates, accumulates, candidate_schedule


def head_unit_apart(cfg: Config, c: Candidates) -> np.ndarray:
    """(candidates, 1) 1 where the stage holding the output layer has [norm, output] as an FSDP
    unit of its own (:func:`meshplan.comm.fsdp_rows.fsdp_units`: torchtitan's units, but a tied
    model at pp 1, one unit of both ends; a V's two chunk roots), else 0."""
    t, m = cfg.training, cfg.model
    titan = t.framework == "torch" and t.zero3_engine != "deepspeed-2021" and not t.fsdp_root_unit  # torchtitan_units
    apart = (c.pp > 1) | (c.vpp > 1) | np.bool_(not m.tied_embeddings)
    return (np.bool_(titan) & apart | (c.vpp > 1))[:, None].astype(np.float64)


def head_regathers(cfg: Config, c: Candidates) -> np.ndarray:
    """(candidates, 1) 1 where every backward all-gathers the [norm, output] unit again before
    the head's backward (``training.reshard_head_after_forward``, which the search keeps on
    FSDP candidates with ``reshard_after_forward``, :func:`~meshplan.search.space.candidate_config`):
    a unit of its own (:func:`head_unit_apart`) over more than one rank, pp 1 and vpp 1 under
    ``grad_accumulation = "sync"`` (each micro-batch's backward; with pp > 1 or accumulation only
    the gathering passes do, not counted here: the bound stays below the step), else 0."""
    if not cfg.training.reshard_head_after_forward:
        return np.zeros((len(c), 1))
    on = np.isin(c.sh, FSDP_SHARDINGS) & (c.rf > 0) & (c.fsdp > 1) & (c.pp == 1) & (c.vpp == 1) \
        & ~accumulates(cfg, c.pp, c.sh)
    return on[:, None] * head_unit_apart(cfg, c)


def expert_gathers(st: Stages, c: Candidates) -> np.ndarray:
    """MoE layers per chunk (the fewest of the stage's chunks) whose forward waits for an
    efsdp all-gather of the experts, (candidates, pp): none where the stage's collective table
    (:func:`meshplan.plan.table_stage`: its own for the first and last stage, stage 1's for
    the middle ones) has no MoE layer, hence no expert row."""
    p = st.k.shape[1]
    table = np.array([0 if k == 0 else p - 1 if k == p - 1 else 1 for k in range(p)])
    # the other vpp - 1 chunks hold at most the longest chunk's layers each
    fewest = np.maximum(st.n_moe - (c.vpp[:, None] - 1) * st.n_chunk_hi, 0)
    return np.where(st.n_moe[:, table] > 0, fewest, 0)


def gathering_passes(cfg: Config, c: Candidates, st: Stages, root: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward passes per step (candidates, pp) that all-gather their chunk's FSDP
    units on each stage when pp > 1, summed over the stage's chunks: the passes that find the
    chunk sharded (:func:`meshplan.comm.fsdp_rows.fsdp_gather_flags`, the rule the collective
    table and the timeline count); with pp 1 the same rule under ``training.grad_accumulation``
    (:func:`~meshplan.search.space.accumulates`: ``no_sync`` reshards after every backward but
    the last, ``no_sync_unsharded`` keeps the units gathered), else 0: every unit gathers
    (``f_core``). ``root``: the root unit's passes, pp 1 only (it never reshards after forward,
    :class:`meshplan.schedule.unit_times.UnitTimes`). Under torch's multi-stage schedules a chunk's
    first pass, and a pass whose chunk the schedule's window evicted (vpp > 3,
    :func:`~meshplan.pipeline.unshard_window.evicted`), gathers too, but from the UNSHARD torch
    issues before it (:mod:`meshplan.schedule.window_unshard`), where the gathers may hide behind
    the compute or the wait for input before it: such a pass is not counted (the step bound adds
    each counted pass's first all-gather, unhidden), even where a reshard after forward made it gather."""
    p = st.k.shape[1]
    g = np.zeros((2, len(c), p))
    if p == 1:
        acc = accumulates(cfg, c.pp, c.sh)
        micro, keep = st.m[:, 0], (c.rf > 0) & (not root)
        for mm, r in sorted(set(zip(micro[acc].tolist(), keep[acc].tolist()))):
            rows = acc & (micro == mm) & (keep == r)
            flags = fsdp_gather_flags(candidate_schedule(1), 1, mm, 1, 0, r,
                                      reshard_after_backward=cfg.training.grad_accumulation == "no_sync")
            g[0, rows, 0] = sum(1 for (_, kind, _), on in flags.items() if on and kind == "F")
            g[1, rows, 0] = sum(1 for (_, kind, _), on in flags.items() if on and kind == "B")
        return g[0], g[1]
    m, v, ps, rf = (np.asarray(a, dtype=np.int64) for a in (st.m[:, 0], c.vpp, c.ps, c.rf > 0))
    code = ((m * (int(v.max()) + 1) + v) * (int(ps.max()) + 1) + ps) * 2 + rf  # one int per distinct key
    window = pipeline_window(cfg.training.framework, p)
    for key in np.unique(code).tolist():
        rows = code == key
        j = int(np.argmax(rows))
        g[:, rows, :] = _gathers(candidate_schedule(int(v[j]), int(ps[j])), p, int(m[j]), int(v[j]), bool(rf[j]),
                                 window)[:, None, :]
    return g[0], g[1]


@lru_cache(maxsize=None)
def _gathers(schedule, p: int, m: int, v: int, reshard: bool, window: int = 0) -> np.ndarray:
    """(2, p): gathering F and B passes per step of each stage (see :func:`gathering_passes`),
    resharding after forward or not (``reshard``): :func:`_gathers_both`'s."""
    return _gathers_both(schedule, p, m, v, window)[int(reshard)]


@lru_cache(maxsize=None)
def _gathers_both(schedule, p: int, m: int, v: int, window: int = 0) -> np.ndarray:
    """(2 reshard, 2, p): gathering F and B passes per step of each stage (see
    :func:`gathering_passes`), without and with resharding after forward:
    :func:`_chunk_gathers` summed over the chunks."""
    return _chunk_gathers(schedule, p, m, v, window).sum(axis=-1)


@lru_cache(maxsize=None)
def _chunk_gathers(schedule, p: int, m: int, v: int, window: int = 0) -> np.ndarray:
    """(2 reshard, 2, p, v): gathering F and B passes per step of each stage's chunks, without
    and with resharding after forward: :func:`~meshplan.comm.fsdp_rows.fsdp_gather_flags`'s
    rule on the stages' orders as arrays (:func:`~meshplan.pipeline.orders.stage_orders`, every
    stage at once, for both, :func:`_rows_gathers`; one stage at a time where the stages' orders
    differ in length): a pass gathers in the pass when it is its chunk's first (but where torch
    UNSHARDs it before, :func:`~meshplan.pipeline.unshard_window.unshards_first`, other than stage
    0's first op, whose UNSHARD at the step's start it waits for whole), or follows a
    forward of the chunk that resharded, unless it finds the chunk evicted by ``window`` (torch's
    window of local stages, :func:`~meshplan.pipeline.unshard_window.evicted` on every row,
    :func:`~meshplan.search.window_rows.evicted_rows`, on the whole order: gathered from the
    UNSHARD before, :func:`gathering_passes`); a backward leaves the chunk gathered."""
    own_first = not unshards_first(schedule, window)  # the first pass gathers itself
    orders = [order_arrays(schedule, p, m, v, s)[::2] for s in range(p)] if str(schedule) not in CLOSED_FORM else None
    if orders is None or len({len(k) for k, _ in orders}) == 1:  # as many ops on every stage: all at once
        kind, _, chunk = stage_orders(str(schedule), p, m, v) if orders is None else (
            np.stack([k for k, _ in orders]), None, np.stack([c for _, c in orders]))
        return _rows_gathers(kind, chunk, np.arange(p), v, window, own_first)
    return np.concatenate([_rows_gathers(k[None], c[None], np.array([s]), v, window, own_first)
                           for s, (k, c) in enumerate(orders)], axis=2)


def _rows_gathers(kind: np.ndarray, chunk: np.ndarray, stage: np.ndarray, v: int, window: int,
                  own_first: bool) -> np.ndarray:
    """(2 reshard, 2, rows, v): :func:`_chunk_gathers` of the orders ``kind``, ``chunk`` ((rows, ops)
    each, as many ops on every row) of the stages ``stage`` ((rows,))."""
    rows = len(stage)
    keep = kind < 2  # F and B (a W pass neither gathers nor reshards): as many on every row
    ev = evicted_rows(chunk, window)[keep].reshape(rows, -1)
    kind, chunk = kind[keep].reshape(rows, -1), chunk[keep].reshape(rows, -1)
    if v > 1:
        o = np.argsort(chunk.astype(np.int16), axis=1, kind="stable")  # radix sort: v < 2^15 chunks
        kind, chunk, ev = (np.take_along_axis(a, o, axis=1) for a in (kind, chunk, ev))
    first = np.ones(chunk.shape, dtype=bool)
    first[:, 1:] = chunk[:, 1:] != chunk[:, :-1]
    after_f = np.zeros(chunk.shape, dtype=bool)
    after_f[:, 1:] = kind[:, :-1] == 0
    after_f &= ~first  # a forward of the same chunk before
    fwd = kind == 0
    first &= own_first | (stage == 0)[:, None] & (chunk == 0)  # stage 0's op 0 has no lead: its gathers all exposed
    slot = np.arange(rows)[:, None] * v + chunk  # (row, chunk) as one int for one bincount
    out = np.zeros((2, 2, rows, v))
    for r, gathers in enumerate((first & ~ev, (first | after_f) & ~ev)):
        out[r, 0] = np.bincount(slot[gathers & fwd], minlength=rows * v).reshape(rows, v)
        out[r, 1] = np.bincount(slot[gathers & ~fwd], minlength=rows * v).reshape(rows, v)
    return out


def end_chunk_passes(c: Candidates, st: Stages, window: int = 0) -> dict[str, np.ndarray]:
    """Of :func:`gathering_passes`' passes with pp > 1 (candidates, pp): those of each stage's
    first chunk (``f0``, ``b0``) and last chunk (``fl``, ``bl``). The model's first virtual
    stage is stage 0's first chunk, its last the head stage's last chunk (``st.last``): the
    chunks that may hold the embedding or the output layer alone (``st.n_chunk`` 0, the Llama 3
    split at one slot per virtual stage), and the one whose backward runs the head's."""
    p = st.k.shape[1]
    out = {k: np.zeros((len(c), p)) for k in ("f0", "b0", "fl", "bl")}
    if p == 1:
        return out
    m, v, ps, rf = (np.asarray(a, dtype=np.int64) for a in (st.m[:, 0], c.vpp, c.ps, c.rf > 0))
    code = ((m * (int(v.max()) + 1) + v) * (int(ps.max()) + 1) + ps) * 2 + rf  # one int per distinct key
    for key in np.unique(code).tolist():
        rows = code == key
        j = int(np.argmax(rows))
        g = _chunk_gathers(candidate_schedule(int(v[j]), int(ps[j])), p, int(m[j]), int(v[j]), window)[int(rf[j])]
        for name, kind, chunk in (("f0", 0, 0), ("b0", 1, 0), ("fl", 0, -1), ("bl", 1, -1)):
            out[name][rows] = g[kind, :, chunk][None, :]
    return out


def chunks_held(c: Candidates, st: Stages, window: int, rows: np.ndarray) -> np.ndarray:
    """(candidates, pp) chunks the memory timeline holds gathered at the end of chunk 0's first
    backward on each stage of the interleaved rows ``rows`` ((candidates, 1) bool; the others 0)
    kept gathered from their forwards: :func:`~meshplan.pipeline.unshard_window.held_after` of
    each stage's order (:func:`~meshplan.memory.schedule.stage_op_arrays`, one schedule run of
    ``st.m_run`` micro-batches), once per (micro-batches, vpp). Under torch's window at vpp > 3
    the chunks torch keeps UNSHARDed across that op, those prefetched for a later op included
    (405B pp 16 vpp 4, m 32, stage 1: 3 chunks, one of them all-gather outputs)."""
    p = st.k.shape[1]
    out = np.zeros((len(c), p), dtype=np.int64)
    on = rows[:, 0] & (c.vpp > 1)
    m, v = st.m_run[:, 0], c.vpp
    for mm, vv in sorted(set(zip(m[on].tolist(), v[on].tolist()))):
        out[on & (m == mm) & (v == vv)] = _held(candidate_schedule(vv), p, mm, vv, window)
    return out


@lru_cache(maxsize=None)
def _held(schedule, p: int, m: int, v: int, window: int) -> np.ndarray:
    """(p,) :func:`chunks_held` of each stage of one (schedule, pp, micro-batches, vpp, window)."""
    out = np.zeros(p, dtype=np.int64)
    for s in range(p):
        phase, chunk, _ = stage_op_arrays(schedule, s, p, m, v)
        at = np.flatnonzero((phase == 1) & (chunk == 0))
        out[s] = held_after(chunk, int(at[0]), window) if at.size else 0
    return out


def deepspeed_backward_shares(cfg: Config, c: Candidates) -> tuple[np.ndarray, np.ndarray]:
    """(candidates, 1) each: the layers' backward all-gathers of a DeepSpeed ZeRO-3 row of one
    stage (zero3 under :attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`
    ``"deepspeed"``, pp 1) as their shares of a layer's unit, summed over the layers and the last
    layer's (the first the backward needs): :attr:`meshplan.memory.deepspeed_fetch.ReuseBytes.backward`
    at ``[memory] deepspeed_max_reuse_elements`` of the candidate's plan input
    (:func:`~meshplan.search.candidate.candidate_config`), once per (tp, ep, etp, recompute), as
    the collective table and the rank timeline count them; NaN on other rows (the bound's ``n`` and 1)."""
    total, last = np.full((len(c), 1), np.nan), np.full((len(c), 1), np.nan)
    on = (c.sh == SHARDING.index("zero3")) & (c.pp == 1) & (c.vpp == 1)
    if cfg.training.searched_zero3_engine != "deepspeed" or not on.any():
        return total, last
    keys = np.stack([c.tp, c.ep, c.etp, c.rc], axis=1)
    for key in np.unique(keys[on], axis=0):
        rows = on & (keys == key).all(axis=1)
        reuse = config_reuse(candidate_config(cfg, c, int(np.flatnonzero(rows)[0])))
        if reuse is not None:
            total[rows] = sum(sum(x) for x in reuse.backward)
            last[rows] = sum(reuse.backward[-1]) if reuse.backward else 0.0
    return total, last
