"""The unit timelines of a step, keyed: :class:`UnitTimes` builds one
:func:`~meshplan.schedule.rank_timeline.forward_unit` / :func:`~meshplan.schedule.backward_pass.backward_unit`
per distinct (stage, chunk, kind, last gradient unit, FSDP flags, reduce) and indexes every
unit of the simulated pipeline into them (:meth:`UnitTimes.index`, on arrays).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from meshplan.comm.fsdp_rows import fsdp_gather_flags
from meshplan.pipeline.fast import KINDS, Flat
from meshplan.pipeline.simulate import Event, PipelineSpec, stage_order
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.unit_sim import UnitSim
from meshplan.schedule.window_unshard import hidden_lead, unshard_leads


def _grad_kind(spec: PipelineSpec) -> str:
    return "W" if spec.sched.splits_backward else "B"


class UnitTimes:
    """Unit timelines of a step, one simulation per distinct (stage, chunk, kind, last
    gradient unit, FSDP flags, reduce). FSDP flags (gather layers, gather root): without pp
    every pass gathers (the backward only where the table has a backward all-gather) and
    every gradient pass reduce-scatters; with pp they follow
    :func:`meshplan.comm.fsdp_rows.fsdp_gather_flags` and the chunk's last gradient unit,
    and so do they with pp 1 under ``training.grad_accumulation`` ``no_sync`` (parameters
    resharded after every backward) or ``no_sync_unsharded`` (kept gathered). ``window``: torch's
    window of unsharded local stages (:func:`~meshplan.pipeline.unshard_window.pipeline_window`):
    under its multi-stage schedules a chunk's first pass, and at vpp > 3 a pass that finds its chunk
    evicted, gathers from the UNSHARD torch issues before it (the step's start, or ops earlier):
    such a pass's key carries the seconds from the UNSHARD to the pass's start
    (:attr:`leads`, set by :func:`~meshplan.schedule.window_unshard.simulate_unshards`; infinite,
    the gathers hidden, until then; None for every other pass).
    A chunk whose costs and stage collectives equal an earlier stage's (the middle stages)
    reuses its timelines: they are pure functions of those inputs, times from the unit start.
    Under DeepSpeed ZeRO++ hpZ micro-batch 0's forward units are keyed apart (:attr:`first`, the
    key's last element) and timed with :meth:`~meshplan.schedule.comm_times.CommTimes.first_microbatch`:
    their gathers over the whole group and the secondary copies, the later passes' over the
    secondary group."""

    def __init__(self, spec: PipelineSpec, chunks, comms, w, ov, reshard: bool, fsdp: bool,
                 accumulation: str = "sync", reshard_root: bool = False, window: int = 0):
        self.spec, self.chunks, self.comms, self.w, self.ov = spec, chunks, comms, w, ov
        self.cache: dict = {}
        self.shared: dict = {}
        self.flags: dict = {}
        # stage -> ((chunk, kind, mb), i, b) of its UNSHARDs (window_unshard); -> (chunk, kind, mb) -> lead seconds
        self.unshards: dict = {}
        self.leads: dict = {}
        self.first = any(c.first for c in comms)  # hpZ: micro-batch 0's forward timed apart
        # each stage's chunk whose last gradient unit is the stage's last unit (its FSDP reduce,
        # torch's perform_reduce_grad, is then the stage's tail; backward_pass.backward_unit)
        self.final = {s: stage_order(spec.schedule, spec.p, spec.m, spec.v, s)[-1].chunk
                      for s in range(spec.p)} if fsdp and spec.p > 1 else {}
        if fsdp and (spec.p > 1 or accumulation != "sync"):
            rab = spec.p == 1 and accumulation == "no_sync"
            for s in range(spec.p):
                self.flags[s] = _flag_arrays(spec.schedule, spec.p, spec.m, spec.v, s, bool(reshard),
                                             bool(reshard_root), rab, window)
                got = unshard_leads(spec.schedule, spec.p, spec.m, spec.v, s, window) if spec.p > 1 else ()
                if got:
                    self.unshards[s] = got
                    self.leads[s] = {k: math.inf for k, _, _ in got}

    def key(self, s: int, chunk: int, kind: str, mb: int) -> tuple:
        last = kind == _grad_kind(self.spec) and mb == self.spec.m - 1
        if s in self.flags:
            lay, root = self.flags[s]
            at = (chunk, int(kind != "F"), mb)  # W follows its B's flags
            gather = (bool(lay[at]), bool(root[at]))
        else:
            gather = (True, True)
        lead = self.leads[s].get((chunk, kind, mb)) if s in self.leads and kind != "W" else None
        return (s, chunk, kind, last, gather, last or not self.flags, lead, self.first and kind == "F" and mb == 0)

    def by_key(self, k: tuple) -> UnitSim:
        if k not in self.cache:
            s, chunk, kind = k[0], k[1], k[2]
            ch, comm = self.chunks[s][chunk], self.comms[s].first_microbatch() if k[7] else self.comms[s]
            stage_last = self.final.get(s, 0) == chunk
            twins = self.shared.setdefault(k[2:] + (stage_last,), [])
            sim = next((x for c, m, x in twins if c == ch and m == comm), None)
            if sim is None and k[6] is not None and k[6] < math.inf:  # its UNSHARD's gathers hidden: as at lead inf
                sim = hidden_lead(self.by_key(k[:6] + (math.inf,) + k[7:]), k[6])
            if sim is None:
                if kind == "F":
                    sim = forward_unit(ch, comm, self.w, self.ov, gather_layers=k[4][0], gather_root=k[4][1],
                                       lead_s=k[6])
                else:
                    uk = "Bx" if kind == "B" and self.spec.sched.splits_backward else kind
                    sim = backward_unit(uk, ch, comm, self.w, self.ov, last_grad_unit=k[3], gather=k[4][0], reduce=k[5],
                                        deferred=self.spec.p > 1, stage_last=stage_last, gather_root=k[4][1],
                                        lead_s=k[6])
                twins.append((ch, comm, sim))
            self.cache[k] = sim
        return self.cache[k]

    def get(self, s: int, chunk: int, kind: str, mb: int) -> UnitSim:
        return self.by_key(self.key(s, chunk, kind, mb))

    def of_event(self, e: Event) -> UnitSim:
        return self.get(e.stage, e.args["chunk"], e.args["kind"], e.args["mb"])

    def _flag_arrays(self, f: Flat, last: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gl, gr, red) of every flat unit from the FSDP flags (:meth:`index`)."""
        sp, n = self.spec, len(f.kind)
        gl, gr, red = np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64), last.astype(np.int64)
        fb = np.where(f.kind == KINDS.index("F"), 0, 1)  # W follows its B's flags
        for s, (lay, root) in self.flags.items():
            sl = slice(s * f.length, (s + 1) * f.length)
            gl[sl], gr[sl] = lay[f.chunk[sl], fb[sl], f.mb[sl]], root[f.chunk[sl], fb[sl], f.mb[sl]]
        return gl, gr, red

    def index(self, f: Flat) -> tuple[list[tuple], np.ndarray]:
        """(the distinct keys of the flat units, the index into them of every flat unit): the
        key :meth:`key` gives each unit, on arrays."""
        sp = self.spec
        last = (f.kind == KINDS.index(_grad_kind(sp))) & (f.mb == sp.m - 1)
        # without FSDP flags every unit's gl, gr and red are 1: added as a number, not as three
        # arrays of 10^6 ones (each costs ms of page faults in the command's cold run)
        gl: "int | np.ndarray" = 1
        gr: "int | np.ndarray" = 1
        red: "int | np.ndarray" = 1
        if self.flags:
            gl, gr, red = self._flag_arrays(f, last)
        vals, lead = self._lead_ids(f)
        first: "int | np.ndarray" = ((f.kind == KINDS.index("F")) & (f.mb == 0)).astype(np.int64) if self.first else 0
        # ((((((stage v + chunk) 3 + kind) 2 + last) 2 + gl) 4 + 2 gr + red) leads + lead) 2 + first, in place
        code = f.stage
        for mul, x in ((sp.v, f.chunk), (len(KINDS), f.kind), (2, last), (2, gl), (2, gr), (2, red), (len(vals), lead),
                       (2, first)):
            code *= mul
            code += x
        uniq, inv = _unique_small(code)
        keys = []
        for c in uniq.tolist():
            first_, c = bool(c & 1), c >> 1
            lead_, c = vals[c % len(vals)], c // len(vals)
            red_, gr_, gl_ = c & 1, (c >> 1) & 1, (c >> 2) & 1
            c >>= 3
            last_ = c & 1
            c >>= 1
            kind, c = c % len(KINDS), c // len(KINDS)
            keys.append((c // sp.v, c % sp.v, KINDS[kind], bool(last_), (bool(gl_), bool(gr_)), bool(red_), lead_,
                         first_))
        return keys, inv

    def _lead_ids(self, f: Flat) -> tuple[list, "int | np.ndarray"]:
        """(the distinct leads, None first; each flat unit's index into them): :attr:`leads`, W none."""
        ids: dict = {None: 0}
        out: "int | np.ndarray" = 0
        for s in self.leads:
            table = np.zeros((self.spec.v, 2, self.spec.m), dtype=np.int64)
            for (c, kind, mb), x in self.leads[s].items():
                table[c, int(kind != "F"), mb] = ids.setdefault(x, len(ids))
            if isinstance(out, int):
                out = np.zeros(len(f.kind), dtype=np.int64)
            sl = slice(s * f.length, (s + 1) * f.length)
            out[sl] = np.where(f.kind[sl] == KINDS.index("W"), 0,
                               table[f.chunk[sl], np.minimum(f.kind[sl], 1), f.mb[sl]])
        return list(ids), out


def _unique_small(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(code, return_inverse=True)`` for non-negative integer codes below a small
    bound (here p v 192 x leads: stage, chunk and flag bits), by a table of the codes present instead of
    a sort of every unit (10^6 units at pp 128 x 4,096 micro-batches).

    >>> [a.tolist() for a in _unique_small(np.array([5, 2, 5, 0]))]
    [[0, 2, 5], [2, 1, 2, 0]]
    """
    if not len(code):
        return np.unique(code, return_inverse=True)
    present = np.zeros(int(code.max()) + 1, dtype=bool)
    present[code] = True
    uniq = np.flatnonzero(present)
    rank = np.cumsum(present) - 1
    return uniq, rank[code]


@lru_cache(maxsize=256)
def _flag_arrays(schedule, p: int, m: int, v: int, stage: int, reshard: bool, reshard_root: bool,
                 reshard_after_backward: bool, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """FSDP gather flags of ``stage``'s passes (:func:`meshplan.comm.fsdp_rows.fsdp_gather_flags`)
    as two read-only int arrays (v, 2, m), indexed [chunk, 0 forward / 1 backward, micro-batch]:
    the layers' units and the root units (kept gathered unless resharded as the layers:
    ``reshard_root``, training.reshard_head_after_forward, torchtitan's "always"); 0 where the
    stage's order has no such pass. One Python pass over the order per distinct stage, shared
    by the plans of a search (the middle stages' orders repeat)."""
    lay = fsdp_gather_flags(schedule, p, m, v, stage, reshard, reshard_after_backward, window)
    root = fsdp_gather_flags(schedule, p, m, v, stage, reshard and reshard_root, reshard_after_backward, window)
    out = np.zeros((2, v, 2, m), dtype=np.int64)
    for (c, kind, mb), g in lay.items():
        out[:, c, int(kind != "F"), mb] = g, root[(c, kind, mb)]
    out.flags.writeable = False
    return out[0], out[1]
