"""A tighter step-time lower bound for the candidates near the top of a search: the
pipeline schedule of :func:`meshplan.pipeline.simulate.simulate` evaluated exactly, on arrays, with
each unit's lower bound as its duration.

:func:`~meshplan.pipeline.simulate.simulate` is list scheduling with fixed orders: a unit starts when
its stage's previous unit has ended and its dependency has ended (plus the p2p send across
stages), so each unit's end is the longest path to it in a DAG fixed by (schedule, p, m, v).
That DAG is built once per (p, m, v) from the same orders, chunk-to-virtual-stage map (the
registered schedule's, :mod:`meshplan.pipeline.registry`) and dependencies, its units
grouped by depth, and the longest paths computed for a whole group of candidates at once,
one depth at a time. End times grow with durations, so unit
lower bounds (:func:`meshplan.search.layer_bounds.unit_bounds`) give stage ends no later than
``step_time``'s; each stage's end then gets its last unit's tail bound and its optimizer
step, as :func:`meshplan.schedule.steptime.step_time` adds them. Where the pipeline's calls block
(:func:`blocking_mode`: torch's 1F1B, Megatron-LM's), each unit's call holds its stage at least
``k x p2p`` after it (:func:`schedule_call_loads`, the simulator's calls; :func:`_walk`).

>>> import numpy as np
>>> dag = build_dag("1f1b", p=4, m=8, v=1)
>>> f, b = np.ones((1, 4, 1)), 2 * np.ones((1, 4, 1))
>>> float(stage_ends(dag, f, b, np.zeros((1, 1))).max())  # (m + p - 1)(F + B) = 33
33.0
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from meshplan.pipeline.fast import flat_units, rendezvous, simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec
from meshplan.pipeline.unshard_window import evicted, unshards_first
from meshplan.schedule.overlap_policy import P2PMode, p2p_mode
from meshplan.schedule.pipeline_exposure import transfer_loads
from meshplan.search.columns import Candidates, candidate_schedule
from meshplan.spec.mesh import Schedule


@dataclass(frozen=True)
class Dag:
    """Units of one schedule in a topological order: ``stage``, ``chunk``, ``mb``, ``backward``
    (0/1), ``prev`` (previous unit on the stage, or -1), ``dep`` (unit it waits for, or
    -1), ``cross`` (1 when ``dep`` is on another stage), ``levels`` (unit indices by
    depth), ``last`` (each stage's last unit), ``order`` (the units level by level: row
    ``j`` of :func:`stage_ends`'s array holds unit ``order[j]``), ``steps`` (the levels as
    :func:`stage_ends` walks them, :func:`_level_steps`), ``cross_rows`` (units, 1) by row: 1.0
    where the unit waits for a send from another stage, and ``last_row`` the rows of ``last``."""

    stage: np.ndarray
    chunk: np.ndarray
    mb: np.ndarray
    backward: np.ndarray
    prev: np.ndarray
    dep: np.ndarray
    cross: np.ndarray
    levels: tuple
    last: np.ndarray
    order: np.ndarray
    steps: tuple
    cross_rows: np.ndarray
    last_row: np.ndarray


@lru_cache(maxsize=64)
def build_dag(schedule: Schedule | str, p: int, m: int, v: int) -> Dag:
    """The DAG of ``schedule`` (1F1B or interleaved 1F1B: F and B units only), on arrays:
    the stage orders and dependencies of :func:`meshplan.pipeline.fast.flat_units` (units
    stage-major; equal to the reference simulation's, ``tests/test_fast_pipeline.py``), each
    unit's depth (1 + the larger of its previous unit's and its dependency's)."""
    f = flat_units(str(Schedule(schedule)), p, m, v)
    n = f.kind.size
    if (f.kind > 1).any():
        raise ValueError(f"{schedule}: weight-gradient units are not in the search's DAG")
    idx = np.arange(n)
    prev = np.where(idx % f.length > 0, idx - 1, -1)
    dep = np.where(f.dep < n, f.dep, -1)
    # depth = the unit's end when every unit lasts 1 and sends take 0, minus 1 (list scheduling
    # in rounds, :func:`meshplan.pipeline.fast.simulate_arrays`: O(units), exact integers)
    ones = simulate_arrays(PipelineSpec(Schedule(schedule), p, m, v, p2p_s=0.0), lambda flat: np.ones(flat.kind.size))
    depth = np.rint(ones.end).astype(np.int64) - 1
    order = np.argsort(depth, kind="stable")
    levels = tuple(np.split(order, np.flatnonzero(np.diff(depth[order])) + 1))
    last = np.arange(p) * f.length + f.length - 1
    cross = f.cross.astype(np.int64)
    row = np.empty(n, np.int64)
    row[order] = np.arange(n)
    sends = (cross * (dep >= 0)).astype(float)[order][:, None]
    return Dag(f.stage, f.chunk, f.mb, f.kind, prev, dep, cross, levels, last, order,
               _level_steps(levels, order, prev, dep, cross), sends, row[last])


def stage_ends(dag: Dag, f: np.ndarray, b: np.ndarray, p2p: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    """End of each stage's last unit (candidates, p), given unit durations ``f``, ``b`` of
    shape (candidates, p, v), ``p2p`` (candidates, 1) and ``extra`` (candidates, units: time
    added to each unit, e.g. its FSDP gathers; default none).

    The longest paths run unit-major, ``end`` of shape (units + 1, candidates): a level's
    predecessors are whole contiguous rows (candidate-major columns took 2.4x the CPU at pp 16 x
    64 micro-batches x 800 candidates, 6.8x at pp 32 x 128 x 400: strided gathers), and row
    ``units`` stays 0, so a unit without a previous unit or dependency (index -1) reads 0. Same floating-point
    operations as the level-by-level recurrence (``max(prev end, dep end + p2p x cross) +
    duration``; ``+ 0.0`` where there is none), so the same ends to the bit."""
    return _unit_major_ends(dag, f, b, p2p, None if extra is None else extra.T)


def _unit_major_ends(dag: Dag, f: np.ndarray, b: np.ndarray, p2p: np.ndarray, extra: np.ndarray | None) -> np.ndarray:
    """:func:`stage_ends` with ``extra`` unit-major, (units, candidates)."""
    o = dag.order
    return _walk(dag, _durations(dag, f, b, None if extra is None else extra[o], o), p2p)


def _durations(dag: Dag, f: np.ndarray, b: np.ndarray, extra: np.ndarray | None, units: np.ndarray) -> np.ndarray:
    """Durations (len(units), candidates) of the DAG's ``units``: F or B of its stage and
    chunk, plus ``extra`` (rows aligned with ``units``) where given."""
    back = (dag.backward[units] > 0)[:, None]
    st, ch = dag.stage[units], dag.chunk[units]
    dur = np.where(back, b[:, st, ch].T, f[:, st, ch].T)
    return dur if extra is None else dur + extra


def _walk(dag: Dag, dur: np.ndarray, p2p: np.ndarray, hold: np.ndarray | None = None) -> np.ndarray:
    """Stage ends (candidates, p) from the units' durations ``dur`` (units, candidates) by
    row, :func:`stage_ends`'s longest paths. The rows are the units level by level
    (``dag.order``), so a level writes, and reads its durations and sends from, one
    contiguous slice; only its predecessors are gathered. ``hold`` (units, candidates; by row):
    seconds the blocking call after each unit holds its stage at least (:func:`call_holds`): the
    stage's next unit starts no earlier than the unit's end plus them (``free``); a unit's
    consumer on another stage still reads its end (plus the send)."""
    end = np.zeros((dag.stage.size + 1, dur.shape[1]))
    free = end if hold is None else np.zeros_like(end)  # row ``units`` stays 0 in both
    sends = np.asarray(p2p, dtype=float).reshape(1, -1) * dag.cross_rows  # p2p x cross, 0.0 without a send
    for lo, hi, prev, dep, cross in dag.steps:
        ready = end[dep]
        if cross:
            ready += sends[lo:hi]
        np.maximum(free[prev], ready, out=ready)
        np.add(ready, dur[lo:hi], out=end[lo:hi])
        if hold is not None:
            np.add(end[lo:hi], hold[lo:hi], out=free[lo:hi])
    return np.ascontiguousarray(end[dag.last_row].T)


def blocking_mode(cfg, schedule: Schedule | str) -> P2PMode | None:
    """:func:`~meshplan.schedule.overlap_policy.p2p_mode` of ``cfg``'s training for ``schedule``
    where some pipeline call blocks its stage (torch 2.13's 1F1B and GPipe, Megatron-LM's 1F1B and
    interleaved 1F1B) and the step runs one schedule (``training.pp_schedule_runs`` 1: the bounds'
    single schedule over all m has more waited calls than the runs, each run's warm-up sends
    unwaited); None otherwise."""
    mode = p2p_mode(cfg.training, Schedule(schedule))
    return mode if mode.blocking_p2p and cfg.training.pp_schedule_runs == 1 else None


@lru_cache(maxsize=256)
def schedule_call_loads(schedule: Schedule | str, p: int, m: int, v: int, mode: P2PMode) -> np.ndarray:
    """``k`` of every blocking call of ``schedule`` at (p, m, v) under ``mode``, shape (p, L + 1):
    per stage its leading call, then the call after each unit of its order (0: no waited side):
    the simulator's own calls (:func:`meshplan.pipeline.calls.rendezvous` of the same
    :class:`~meshplan.pipeline.simulate.PipelineSpec` fields ``step_time`` gives it, counted by
    :func:`meshplan.schedule.pipeline_exposure.transfer_loads`, as ``step_time`` counts a call's
    transfers). Each such call holds its stage at least ``k x p2p_s`` after the unit before it
    ends (:func:`meshplan.pipeline.rounds.run_rounds`: ``max(post, peer posts) + k p2p_s``).

    torch 2.13's 1F1B, p 4, m 8 (:meth:`~meshplan.pipeline.one_f_one_b.OneFOneB.torch_p2p_calls`).
    Stage 1 (F0 F1 F2 B0 F3 B1 ... F7 B5 B6 B7) receives every unit's input in a waited call right
    before it (F0's in its leading call) and waits B7's send at the end: every call holds (its F0,
    F1, B5 and B6 go without a wait, w = 3, but each shares its call with the next receive).
    Stage 0 (F0 F1 F2 F3 B0 F4 B1 ... F7 B4 B5 B6 B7) receives only gradients: its warm-up's F0-F2
    go unwaited and a steady-state backward sends nothing, so only the calls after F3-F7 (a waited
    send and the next backward's receive) and after B4-B6 (a receive) hold:

    >>> mode = P2PMode(True, False, True)
    >>> schedule_call_loads("1f1b", 4, 8, 1, mode)[1].astype(int).tolist()
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    >>> schedule_call_loads("1f1b", 4, 8, 1, mode)[0].astype(int).tolist()
    [0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0]
    """
    spec = PipelineSpec(Schedule(schedule), p, m, v, p2p_s=0.0, **mode._asdict())
    f = flat_units(str(Schedule(schedule)), p, m, v)
    out = transfer_loads(rendezvous(spec, f), p, f.length)
    out.setflags(write=False)  # memoised: shared by every caller
    return out


def hold_loads(loads: np.ndarray, apart) -> np.ndarray:
    """The multiples of the fastest boundary's transfer that calls of ``k`` = ``loads`` hold at least:
    ``k`` through one link, ``ceil(k / 2)`` where the boundaries may take two
    (``apart``, :func:`meshplan.search.comm_bounds.p2p_links_apart`; broadcast against ``loads``):
    an NVLink transfer beside a NIC one takes the longer, not both.

    >>> hold_loads(np.array([0.0, 1.0, 2.0]), False).tolist(), hold_loads(np.array([0.0, 1.0, 2.0]), True).tolist()
    ([0.0, 1.0, 2.0], [0.0, 1.0, 1.0])
    """
    return np.where(apart, np.ceil(loads / 2), loads)


def call_holds(cfg, c: Candidates, m: np.ndarray, apart=False) -> tuple[np.ndarray, np.ndarray]:
    """(the ``k`` of the calls between each stage's units summed, its trailing call's ``k``), per
    candidate and stage (candidates, pp), of candidates ``c`` of one pp degree with ``m``
    micro-batches each (:func:`schedule_call_loads`; zeros where no call blocks,
    :func:`blocking_mode`); ``apart`` (per candidate): its boundaries may take two links, each
    ``k`` then :func:`hold_loads`' ``ceil(k / 2)``. Times ``p2p_s`` they are seconds each stage's compute stream cannot
    run: before its last unit ends, and after it (the stage's run ends at its last unit plus the
    larger of its tail and that call's hold, :func:`meshplan.schedule.step_end.stage_run_end`)."""
    p = int(c.pp[0]) if len(c) else 1
    inner, last = np.zeros((len(c), p)), np.zeros((len(c), p))
    if p == 1:
        return inner, last
    keys = np.stack([c.vpp, c.ps, np.asarray(m, dtype=np.int64)], axis=1)
    for v, ps, mm in np.unique(keys, axis=0).tolist():
        mode = blocking_mode(cfg, candidate_schedule(v, ps))
        if mode is None:
            continue
        loads = schedule_call_loads(candidate_schedule(v, ps), p, mm, v, mode)
        rows = np.all(keys == (v, ps, mm), axis=1)
        two = np.broadcast_to(np.asarray(apart), (len(c),))[rows][:, None]
        inner[rows] = np.where(two, hold_loads(loads[:, 1:-1], True).sum(axis=1), loads[:, 1:-1].sum(axis=1))
        last[rows] = np.where(two, hold_loads(loads[:, -1], True), loads[:, -1])
    return inner, last


def _level_steps(levels: tuple, order: np.ndarray, prev: np.ndarray, dep: np.ndarray, cross: np.ndarray) -> tuple:
    """Per depth level: (first row, end row, previous units' rows, dependencies' rows, whether
    a unit of the level has a cross-stage dependency), rows of :func:`stage_ends`'s
    level-ordered array (``order``); row ``units`` (the zero row) where a unit has no
    previous unit or dependency."""
    n = order.size
    row = np.empty(n + 1, np.int64)
    row[order], row[n] = np.arange(n), n  # index -1 (none) reads row n
    steps, lo = [], 0
    for idx in levels:
        hi = lo + idx.size
        c = cross[idx] * (dep[idx] >= 0)
        steps.append((lo, hi, row[prev[idx]], row[dep[idx]], bool(c.any())))
        lo = hi
    return tuple(steps)


@lru_cache(maxsize=64)
def gathering_units(schedule: Schedule | str, p: int, m: int, v: int, reshard: bool, window: int = 0) -> np.ndarray:
    """(2, units) of :func:`build_dag`'s units: 1 where the unit is a forward (row 0) or a
    backward (row 1) that all-gathers its chunk's FSDP units in the pass with pp > 1: the rule of
    :func:`meshplan.comm.fsdp_rows.fsdp_gather_flags` (the timeline's) on arrays, less the window's
    re-gathers: a pass
    gathers when it is its chunk's first on the stage, or follows a forward of the chunk that
    resharded (``reshard``), unless it finds it evicted by torch's window of ``window`` local
    stages (:func:`~meshplan.pipeline.unshard_window.evicted`, per stage; 0: none): then it is
    all-gathered from torch's UNSHARD ops before, where it may hide (:mod:`meshplan.schedule.window_unshard`),
    and the bound adds nothing for it, nor for a chunk's first pass under torch's multi-stage
    schedules (:func:`~meshplan.pipeline.unshard_window.unshards_first`: UNSHARDed before it too)
    but stage 0's first op's (its UNSHARD at the step's start, waited for whole); a backward
    leaves the chunk gathered."""
    dag = build_dag(schedule, p, m, v)
    ev = np.concatenate([evicted(dag.chunk[s * (dag.chunk.size // p):(s + 1) * (dag.chunk.size // p)], window)
                         for s in range(p)])  # units stage-major, each stage's in its order
    key = dag.stage * v + dag.chunk
    o = np.lexsort((np.arange(key.size), key))  # each (stage, chunk) in its order
    k, g = dag.backward[o], key[o]
    first = np.concatenate([[True], g[1:] != g[:-1]])
    after_f = np.concatenate([[False], k[:-1] == 0])
    flag = np.zeros(key.size)
    after_f &= ~first  # a forward of the same (stage, chunk) before
    # else UNSHARDed before it, as the window's re-gathers; stage 0's op 0 (chunk 0) waits for all of its gathers
    first &= (not unshards_first(schedule, window)) | ((g == 0) & (k == 0))
    flag[o] = (first | (reshard & after_f)) & ~ev[o]
    return np.stack([flag * (dag.backward == 0), flag * (dag.backward == 1)])


def pipeline_bound(u: dict, vpp: int, m: int, reshard: bool | None = None, window: int = 0,
                   loads: np.ndarray | None = None, apart=False) -> np.ndarray:
    """Step-time lower bound of candidates sharing (pp, vpp, m), from
    :func:`meshplan.search.layer_bounds.unit_bounds` ``u`` (module docstring); ``reshard``
    (``training.reshard_after_forward`` of them all; None: unknown) adds each gathering
    unit's ``f_extra`` or ``b_extra`` (pp > 1: the passes that find their chunk sharded); each
    chunk's last gradient unit gets ``b_red``. ``loads``: their blocking calls
    (:func:`schedule_call_loads`; None: asynchronous sends), each unit's call holding its stage
    ``k x p2p`` after it (:func:`_walk`), the last one's beside the tail; ``apart`` (per
    candidate): its boundaries may take two links, ``k`` as :func:`hold_loads` takes it."""
    n, p = u["f_core"].shape
    v = vpp
    f, b, long = _chunk_units(u, p, v)
    dag = build_dag(candidate_schedule(v), p, m, v)
    # every per-unit term below reads the unit's stage, chunk, kind, gather flags and whether it
    # is micro-batch m-1's: computed once per class of units alike in those (``rep``: one unit
    # each), then gathered to the units by row, the same operations on the same operands
    rep, row_class = unit_classes(candidate_schedule(v), p, m, v, reshard if p > 1 and "f_extra" in u else None,
                                  window)
    st, chunk, bwd, mb = dag.stage[rep], dag.chunk[rep], dag.backward[rep], dag.mb[rep]
    extra = None  # (classes, candidates)
    if reshard is not None and p > 1 and "f_extra" in u:
        extra = _gather_extra(u, p, m, v, reshard, window, rep, st, chunk)
    if "b_red" in u:
        # each chunk's last gradient unit (micro-batch m-1's backward) that does not end its stage's
        # order holds the compute stream for its FSDP2 copy-ins and its reductions
        # (grad_reduce.perform_reduce_grad): ``b_wait`` (at least ``b_red``), at the chunk's
        # length. The unit that ends the stage's order copies in and reduces after its end (its
        # send has left): nothing added to it, or its send would reach the next stage too late
        waits = (bwd == 1) & (mb == m - 1) & (chunk != dag.chunk[dag.last][st])
        hi = long[:, st, chunk].T if long is not None else np.zeros((st.size, 1), bool)
        w_lo, w_hi = u.get("b_wait", u["b_red"]), u.get("b_wait_hi", u.get("b_wait", u["b_red"]))
        red = waits[:, None] * np.where(hi, np.maximum(u["b_red"], w_hi).T[st], np.maximum(u["b_red"], w_lo).T[st])
        extra = red if extra is None else extra + red
    dur = _durations(dag, f, b, extra, rep)[row_class]
    if loads is None:
        return (_walk(dag, dur, u["p2p"]) + u["tail"] + u["end"]).max(axis=1)
    p2p = np.asarray(u["p2p"], dtype=float).reshape(1, -1)  # (1, candidates)
    two = np.broadcast_to(np.asarray(apart), (n,))
    k = loads[:, 1:].reshape(-1)[dag.order][:, None]
    hold = hold_loads(k, two[None, :]) * p2p  # the call after each unit, by row
    # the last unit's tail or its call's hold
    tail = np.maximum(u["tail"], hold_loads(loads[:, -1][None, :], two[:, None]) * p2p.T)
    return (_walk(dag, dur, u["p2p"], hold) + tail + u["end"]).max(axis=1)


def _chunk_units(u: dict, p: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(forward seconds, backward seconds, each of shape (candidates, p, v): every chunk's core,
    the embedding's on chunk 0 and the head's on chunk v - 1; where the Llama 3 split has longer
    chunks, which ones are: stage 0's last ``n_long``, the other stages' first, else None)."""
    f = np.repeat(u["f_core"][:, :, None], v, axis=2)
    b = np.repeat(u["b_core"][:, :, None], v, axis=2)
    long = None
    if "n_long" in u and np.any(u["n_long"]):  # the Llama 3 split's longer chunks (stage_layers:
        # stage 0's last n_long chunks, the other stages' first n_long)
        j, r = np.arange(v)[None, None, :], u["n_long"][:, :, None]
        k0 = (np.arange(p) == 0)[None, :, None]
        long = np.where(k0 & (p > 1), j >= v - r, j < r)
        f = np.where(long, u["f_core_hi"][:, :, None], f)
        b = np.where(long, u["b_core_hi"][:, :, None], b)
    f[:, :, 0] += u["emb_f"]
    b[:, :, 0] += u["emb_b"]
    f[:, :, v - 1] += u["head_f"]
    b[:, :, v - 1] += u["head_b"]
    return f, b, long


def _gather_extra(u: dict, p: int, m: int, v: int, reshard: bool, window: int, rep: np.ndarray, st: np.ndarray,
                  chunk: np.ndarray) -> np.ndarray:
    """Each unit class's FSDP gather seconds, shape (classes, candidates): ``f_extra`` or ``b_extra``
    where the pass finds its chunk sharded (:func:`gathering_units`); the last chunk's backwards
    take the head's backward off their first gather (the head stage's ``b_extra_head``); an end
    chunk without layers (``empty_end``: stage 0's first, the last stage's last) gathers none."""
    g = gathering_units(candidate_schedule(v), p, m, v, reshard, window)[:, rep]
    last = chunk == v - 1
    back = np.where(last[:, None], u.get("b_extra_head", u["b_extra"]).T[st], u["b_extra"].T[st])
    extra = g[0][:, None] * u["f_extra"].T[st] + g[1][:, None] * back
    if "empty_end" in u:
        end = ((st == 0) & (chunk == 0)) | ((st == p - 1) & last)
        extra = np.where(end[:, None] & u["empty_end"].T[st], 0.0, extra)
    return extra


@lru_cache(maxsize=64)
def unit_classes(schedule: Schedule | str, p: int, m: int, v: int, reshard: bool | None,
                 window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(one unit of each class, the class of each row of :func:`stage_ends`'s level-ordered
    array) of :func:`build_dag`'s units, a class being the units alike in what
    :func:`pipeline_bound` reads of a unit: stage, chunk, kind, micro-batch m-1 or not, and
    (``reshard`` not None) the forward and backward gather flags of :func:`gathering_units`.

    >>> rep, cls = unit_classes("1f1b", 2, 4, 1, None)  # per stage: F and B, those of micro-batch 3 apart
    >>> len(rep), cls.size
    (8, 16)
    """
    dag = build_dag(schedule, p, m, v)
    g = gathering_units(schedule, p, m, v, reshard, window) if reshard is not None else np.zeros((2, dag.stage.size))
    key = ((((dag.stage * v + dag.chunk) * 2 + dag.backward) * 2 + (dag.mb == m - 1)) * 2 + g[0]) * 2 + g[1]
    _, rep, inverse = np.unique(key.astype(np.int64)[dag.order], return_index=True, return_inverse=True)
    return dag.order[rep], inverse.reshape(-1)
