"""The passes of one step on arrays: which template each pass repeats, as a table of passes
(issue 11 item 4: ``meshplan step`` of pp 128 x 4,096 micro-batches in under 1 s).

:mod:`meshplan.memory.reference` is the exact model written pass by pass in Python (one
loop step per micro-batch on each of the p stages: 9-22 s of ``build_plan`` on
benchmarks/configs); this module computes the same passes and templates with a few numpy
operations per stage (and :mod:`meshplan.memory.peakscan` the peak), and tests/test_memory_fast.py checks that both give every
event, the peak (when, what dominates it) and the maxima per kind equal.

**Which template a pass repeats.** A pass is built by
:class:`~meshplan.memory.passes.PassBuilder` from its key (phase, chunk, FSDP units
already unsharded when it starts, first / last backward of the chunk, the pipeline schedule's
RESHARD after it, its UNSHARDs before it). The units
unsharded after a pass are a function of the units before it and of the pass's token
(the key less the units; the all-gather outputs of another chunk's UNSHARD change no unit's
state, the pass of that chunk that waits for them does): ``after = (before - units of the chunk) | what the pass left
unsharded``. So the passes of a stage are a finite automaton over its token sequence. Its
states (sets of unsharded units) are closed over from the empty set under the stage's
distinct tokens (a handful: two phases x chunks x the first/last flags); each pass is then
a map state -> state, and the state before pass i is the composition of the maps of passes
0 .. i-1 applied to the empty set: a prefix scan, done by doubling (``log2 n`` numpy
gathers of n x states). A pass of one chunk reads and changes only that chunk's units, so
the automaton runs per chunk over the chunk's own ops (:func:`_keys_by_chunk`): v automata
of a few states, not one over their product (2^v states with interleaving and resharding).
Templates are numbered as the reference numbers them, by first use (init 0, then the
passes', then the step's). A stage of up to :data:`WALK_MAX_OPS` passes skips the closure:
one walk over its ops applies the same transitions in order (:func:`_keys_walk`), building
only the passes the stage runs.

The peak over these passes is :mod:`meshplan.memory.peakscan`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, overload

import numpy as np

from meshplan.memory.pass_sizes import StageSizes
from meshplan.memory.passes import PassBuilder

PHASES = ("init", "forward", "backward", "step")


@dataclass(frozen=True)
class Pass:
    """One pass of the schedule: its phase (init, forward, backward, step), chunk,
    micro-batch, the template of its events and the index of its first event."""

    phase: str
    chunk: int
    microbatch: Optional[int]
    template: int
    first_event: int


@dataclass(frozen=True, eq=False)
class PassTable(Sequence[Pass]):
    """The passes of one step as columns, one row per pass (``phase``: index into
    :data:`PHASES`; ``microbatch`` -1 for init and step); indexing and iterating give
    :class:`Pass` objects, built on demand.

    >>> t = PassTable.of([Pass("init", 0, None, 0, 0), Pass("forward", 0, 3, 1, 4)])
    >>> len(t), t[-1], t[:1] == (Pass("init", 0, None, 0, 0),)
    (2, Pass(phase='forward', chunk=0, microbatch=3, template=1, first_event=4), True)
    """

    phase: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    template: np.ndarray
    first_event: np.ndarray

    @staticmethod
    def of(passes: Sequence[Pass]) -> PassTable:
        """The table of a list of passes."""
        col = lambda f: np.array([f(p) for p in passes], dtype=np.int64)  # noqa: E731
        return PassTable(col(lambda p: PHASES.index(p.phase)), col(lambda p: p.chunk),
                         col(lambda p: -1 if p.microbatch is None else p.microbatch), col(lambda p: p.template),
                         col(lambda p: p.first_event))

    def shifted(self, events: int) -> PassTable:
        """Every pass after the first starting ``events`` later (events added to init)."""
        first = self.first_event.copy()
        first[1:] += events
        return PassTable(self.phase, self.chunk, self.microbatch, self.template, first)

    def __len__(self) -> int:
        return len(self.phase)

    def _row(self, i: int) -> Pass:
        mb = int(self.microbatch[i])
        return Pass(PHASES[self.phase[i]], int(self.chunk[i]), None if mb < 0 else mb, int(self.template[i]),
                    int(self.first_event[i]))

    @overload
    def __getitem__(self, i: int) -> Pass: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Pass, ...]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._row(j) for j in range(*i.indices(len(self))))
        if not -len(self) <= i < len(self):
            raise IndexError(f"pass {i} outside 0..{len(self) - 1}")
        return self._row(i % len(self))

    def __iter__(self) -> Iterator[Pass]:
        return (self._row(i) for i in range(len(self)))

    def __eq__(self, other) -> bool:
        cols = ("phase", "chunk", "microbatch", "template", "first_event")
        return isinstance(other, PassTable) and all(np.array_equal(getattr(self, c), getattr(other, c)) for c in cols)

    __hash__ = None  # type: ignore[assignment]


def backward_flags(phase: np.ndarray, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the first and the last backward (phase 1) of each chunk among the ops.

    >>> [m.astype(int).tolist() for m in backward_flags(np.array([0, 1, 0, 1, 1]), np.array([0, 0, 1, 1, 0]))]
    [[0, 1, 0, 1, 0], [0, 0, 0, 1, 1]]
    """
    first, last = np.zeros(len(phase), bool), np.zeros(len(phase), bool)
    back = phase == 1
    for c in present(chunk):
        b = np.flatnonzero(back & (chunk == c))
        if len(b):
            first[b[0]] = last[b[-1]] = True
    return first, last


def present(values: np.ndarray, size: int = 0) -> np.ndarray:
    """The distinct values of an array of small non-negative ints, ascending (``np.unique``
    without the sort).

    >>> present(np.array([3, 0, 3, 1])).tolist()
    [0, 1, 3]
    """
    return np.flatnonzero(np.bincount(values, minlength=size)) if len(values) else np.zeros(0, np.int64)


def first_use_order(values: np.ndarray) -> np.ndarray:
    """The distinct values of a small-int array in the order of their first occurrence.

    >>> first_use_order(np.array([4, 2, 4, 0, 2])).tolist()
    [4, 2, 0]
    """
    used = present(values)
    first = np.array([int(np.argmax(values == u)) for u in used.tolist()], dtype=np.int64)  # one pass per value
    return used[np.argsort(first)]


def _automaton(sizes: StageSizes, tokens: np.ndarray, pre_of: Sequence[tuple], built: Optional[dict] = None,
               passes: Optional[list] = None, chunk: Optional[int] = None) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """States closed over from the empty set: ``(next state, key index)``, each (states,
    tokens), and the built passes ``(key, template)`` by key index. A token is (phase 0/1,
    chunk, first, last, released after, waits for its UNSHARD, index into ``pre_of`` of the
    chunks UNSHARDed before it) as one row of ``tokens`` (:func:`pass_table`). ``built`` and ``passes``: the
    passes built so far, by key and by key index, extended in place (default: new ones). ``chunk``: the
    tokens are that chunk's alone, and :class:`_Entangled` is raised if a pass leaves a unit
    of another chunk unsharded (its states would then not be the chunk's own)."""
    units = {c: frozenset(sizes.chunk_units(c)) for c in {int(t[1]) for t in tokens}}
    states: list[frozenset] = [frozenset()]
    index = {states[0]: 0}
    built = {} if built is None else built
    passes = [] if passes is None else passes
    nxt, kid = [], []
    s = 0
    while s < len(states):
        row_n, row_k = [], []
        for ph, c, f, la, ev, wt, pre in tokens.tolist():
            key = ("backward" if ph else "forward", c, states[s] & units[c], bool(f), bool(la), bool(ev), bool(wt),
                   pre_of[pre])
            if key not in built:
                events, g_out = _build(sizes, key)
                passes.append((key, events))
                built[key] = (len(passes) - 1, g_out)
            k, g_out = built[key]
            if chunk is not None and not g_out <= units[c]:
                raise _Entangled
            after = (states[s] - units[c]) | g_out
            if after not in index:
                index[after] = len(states)
                states.append(after)
            row_n.append(index[after])
            row_k.append(k)
        nxt.append(row_n)
        kid.append(row_k)
        s += 1
    return np.array(nxt, dtype=np.int64), np.array(kid, dtype=np.int64), passes


def _build(sizes: StageSizes, key: tuple) -> tuple[tuple, frozenset]:
    """The events of the pass ``key`` (phase, chunk, units gathered when it starts, first, last,
    released after, waits for its UNSHARD, (chunks UNSHARDed before it, its lag bytes):
    :class:`PassBuilder`'s arguments) and the units it leaves unsharded."""
    b = PassBuilder(sizes, key[0], key[1], key[2], first=key[3], last=key[4], evict=key[5], waits=key[6],
                    unshard=key[7][0], lag=key[7][1])
    return b.build(), frozenset(b.gathered)


class _Entangled(Exception):
    """A pass of one chunk left a unit of another chunk unsharded (:func:`_keys_by_chunk`)."""


def _keys_by_chunk(sizes: StageSizes, tokens: np.ndarray, tok: np.ndarray,
                   pre_of: Sequence[tuple]) -> tuple[np.ndarray, list[tuple]]:
    """(key index of each op, the built passes): :func:`_keys_on_states` on the tokens without
    the UNSHARDs before each pass (column 6: another chunk's all-gather outputs change no unit's
    state), then each op that has some keyed with them, each such pass built once (a few per
    stage: the closure over every (state, token) pair would build them all)."""
    base, inv = _unique_rows(np.column_stack([tokens[:, :6], np.zeros(len(tokens), np.int64)]))
    key, passes = _keys_on_states(sizes, base, inv[tok], pre_of)
    if not tokens[:, 6].any():  # no UNSHARD before any pass
        return key, passes
    pre = tokens[tok, 6]
    index = {k: i for i, (k, _) in enumerate(passes)}
    for op in np.flatnonzero(pre).tolist():
        k = passes[key[op]][0][:7] + (pre_of[pre[op]],)
        if k not in index:
            passes.append((k, _build(sizes, k)[0]))
            index[k] = len(passes) - 1
        key[op] = index[k]
    return key, passes


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_inverse=True)`` of a (tokens, columns) array of small
    non-negative ints, through one int per row (each column a digit of base its maximum + 1,
    the first the most significant: the same ascending order): a 1-d unique, not a sort of
    row views.

    >>> [a.tolist() for a in _unique_rows(np.array([[1, 0], [0, 2], [1, 0]]))]
    [[[0, 2], [1, 0]], [1, 0, 1]]
    """
    base = rows.max(axis=0) + 1 if len(rows) else np.ones(rows.shape[1], np.int64)
    weight = np.concatenate([np.cumprod(base[:0:-1])[::-1], [1]]).astype(np.int64)
    _, first, inv = np.unique(rows @ weight, return_index=True, return_inverse=True)
    return rows[first], inv.reshape(-1)


def _keys_on_states(sizes: StageSizes, tokens: np.ndarray, tok: np.ndarray,
                    pre_of: Sequence[tuple]) -> tuple[np.ndarray, list[tuple]]:
    """(key index of each op, the built passes): one automaton per chunk over that chunk's
    ops alone. A pass of chunk c reads and changes only the units of c (its key holds
    ``state & units of c``, and it leaves unsharded units of c only, checked), so the state a
    pass finds is the union of each chunk's own: with v chunks of two states each, v automata
    of two states instead of one of 2^v (256 at vpp 8), and the same keys. Falls back to
    :func:`_automaton` over all chunks where a unit is in two chunks or a pass crosses them."""
    built: dict = {}
    passes: list = []
    key = np.empty(len(tok), dtype=np.int64)
    tchunk = tokens[:, 1]
    chunks = present(tchunk).tolist()  # every token is some op's (pass_table's)
    every = [u for c in chunks for u in sizes.chunk_units(c)]
    try:
        if len(set(every)) < len(every):  # a unit in two chunks: the states do not split
            raise _Entangled
        for c in chunks:
            rows = np.flatnonzero(tchunk == c)
            nxt, kid, _ = _automaton(sizes, tokens[rows], pre_of, built, passes, chunk=c)
            if len(chunks) == 1:  # the chunk's ops are all the ops, its tokens all the tokens
                key = states_before(nxt[:, tok].T) if len(nxt) > 1 else np.zeros(len(tok), np.int64)
                key = kid[key, tok]
                break
            ops = np.flatnonzero(tchunk[tok] == c)
            local = np.zeros(len(tokens), dtype=np.int64)
            local[rows] = np.arange(len(rows))
            t = local[tok[ops]]
            state = states_before(nxt[:, t].T) if len(nxt) > 1 else np.zeros(len(t), np.int64)
            key[ops] = kid[state, t]
    except _Entangled:
        nxt, kid, passes = _automaton(sizes, tokens, pre_of)
        state = states_before(nxt[:, tok].T) if len(nxt) > 1 else np.zeros(len(tok), np.int64)
        key = kid[state, tok]
    return key, passes


#: A stage of at most this many passes finds each pass's key by walking its ops in order
#: (:func:`_keys_walk`); a longer one by the automaton's prefix scan (:func:`_keys_by_chunk`).
#: The two give the same keys; the walk builds only the passes the stage runs, where the
#: automaton's closure builds every (state, token) pair: 31,216 passes built for 19,478 run in
#: a Llama-3-405B search with per-layer AC (benchmarks/bench_search.py); past about a thousand
#: passes the walk's Python loop costs more than the scan (measured: GPT 1T at pp 64 with 1F1B,
#: no FSDP, every stage's timeline: 0.04 s both ways at 1,024 passes a stage, 0.09-0.12 s walked
#: against 0.055 s scanned at 4,096).
WALK_MAX_OPS = 1024


def _keys_walk(sizes: StageSizes, tokens: np.ndarray, tok: np.ndarray,
               pre_of: Sequence[tuple]) -> tuple[np.ndarray, list[tuple]]:
    """:func:`_keys_by_chunk`'s (key index of each op, the built passes) by one walk over the
    ops: the state (units unsharded) before each op, from the empty set, each (state, token)
    transition built once, each pass once, numbered by first use."""
    rows = [(int(ph), int(c), bool(f), bool(la), bool(ev), bool(wt), pre_of[pre])
            for ph, c, f, la, ev, wt, pre in tokens.tolist()]
    units = {c: frozenset(sizes.chunk_units(c)) for c in {r[1] for r in rows}}
    built: dict = {}
    passes: list = []
    step: dict = {}  # (state, token) -> (key index, state after)
    state: frozenset = frozenset()
    out = []
    for t in tok.tolist():
        hit = step.get((state, t))
        if hit is None:
            ph, c, f, la, ev, wt, pre = rows[t]
            key = ("backward" if ph else "forward", c, state & units[c], f, la, ev, wt, pre)
            if key not in built:
                events, g_out = _build(sizes, key)
                passes.append((key, events))
                built[key] = (len(passes) - 1, g_out)
            k, g_out = built[key]
            hit = step[(state, t)] = (k, (state - units[c]) | g_out)
        out.append(hit[0])
        state = hit[1]
    return np.array(out, dtype=np.int64), passes


def states_before(maps: np.ndarray) -> np.ndarray:
    """State before each op (0 before the first) given each op's map state -> state as
    rows of ``maps`` (n, states): the prefix composition by doubling.

    >>> states_before(np.array([[1, 0], [1, 1], [0, 0]])).tolist()  # 0 -> 1 -> 1 -> 0
    [0, 1, 1]
    """
    g = maps.copy()
    d = 1
    while d < len(g):
        g[d:] = np.take_along_axis(g[d:], g[:-d], axis=1)  # apply op i-d's prefix, then op i's
        d *= 2
    return np.concatenate([[0], g[:-1, 0]]).astype(np.int64, copy=False)


def pass_table(sizes: StageSizes, phase: np.ndarray, chunk: np.ndarray, mb: np.ndarray,
               evict: Optional[np.ndarray] = None, waits: Optional[np.ndarray] = None,
               unshard: Optional[dict[int, tuple]] = None,
               lag: Optional[np.ndarray] = None) -> tuple[PassTable, list[tuple]]:
    """The passes (init, one per op, step) and templates of a stage whose ops are the
    arrays ``phase`` (0 forward, 1 backward), ``chunk``, ``mb``
    (:func:`meshplan.memory.schedule.stage_op_arrays`); ``evict`` (bool per op, default none):
    the ops after which the pipeline schedule's window reshards their chunk
    (:func:`meshplan.pipeline.unshard_window.released_after`); ``waits`` (bool per op) and
    ``unshard`` (op -> the chunks UNSHARDed before it, where any): torch's UNSHARD actions
    (:class:`~meshplan.memory.passes.PassBuilder`), default none; ``lag`` (bytes per op, default 0):
    the output gradients a V-shaped schedule's lagging W passes hold during it. Neither an UNSHARD of
    another chunk nor a lag changes a unit's state, so both go in one column of the tokens, an index
    into the distinct (UNSHARDed chunks, lag) pairs."""
    first, last = backward_flags(phase, chunk)
    n = len(phase)
    ev = np.zeros(n, np.int64) if evict is None else np.asarray(evict, np.int64)
    wt = np.zeros(n, np.int64) if waits is None else np.asarray(waits, np.int64)
    pre_ids: dict[tuple, int] = {((), 0): 0}
    pre = np.zeros(n, np.int64)
    unshard = unshard or {}
    held = np.zeros(n, np.int64) if lag is None else np.asarray(lag, np.int64)
    for k in list(unshard) + [k for k in np.flatnonzero(held).tolist() if k not in unshard]:
        pre[k] = pre_ids.setdefault((unshard.get(k, ()), int(held[k])), len(pre_ids))
    pre_of = list(pre_ids)
    width = int(np.max(chunk)) + 1 if n else 1
    code = ((((((pre * width + np.asarray(chunk, np.int64)) * 2 + phase) * 2 + first) * 2 + last) * 2 + ev) * 2
            + wt)
    codes = present(code)
    lut = np.zeros(codes[-1] + 1, np.int64)
    lut[codes] = np.arange(len(codes))
    tok = lut[code]
    rest = codes >> 5
    tokens = np.stack([(codes >> 4) & 1, rest % width, (codes >> 3) & 1, (codes >> 2) & 1, (codes >> 1) & 1,
                       codes & 1, rest // width], axis=1)
    key, built = (_keys_walk if len(tok) <= WALK_MAX_OPS else _keys_by_chunk)(sizes, tokens, tok, pre_of)
    order = first_use_order(key)
    rank = np.zeros(len(built), np.int64)
    rank[order] = np.arange(1, len(order) + 1)
    templates = [sizes.init] + [built[k][1] for k in order] + [sizes.step]
    tid = np.concatenate([[0], rank[key], [len(templates) - 1]]).astype(np.int64, copy=False)
    lengths = np.array([len(t) for t in templates], dtype=np.int64)[tid]
    table = PassTable(phase=np.concatenate([[0], np.asarray(phase) + 1, [3]]).astype(np.int64, copy=False),
                      chunk=np.concatenate([[0], chunk, [0]]).astype(np.int64, copy=False),
                      microbatch=np.concatenate([[-1], mb, [-1]]).astype(np.int64, copy=False), template=tid,
                      first_event=np.concatenate([[0], np.cumsum(lengths)[:n + 1]]).astype(np.int64, copy=False))
    return table, templates
