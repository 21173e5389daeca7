"""The search's per-key gather table (gather_passes._chunk_gathers) runs on every stage at once
(search.window_rows.evicted_rows, one radix sort per key) instead of a loop over the stages: a
speed change (405B example: the table's 219 keys 0.73 -> 0.46 CPU s), which must leave every
number as it was. These tests hold it to the rule it replaced: unshard_window.evicted row by row,
and the former per-stage loop (kept below as the reference) on every schedule the search runs."""

import numpy as np
import pytest

from meshplan.pipeline.fast import order_arrays
from meshplan.pipeline.orders import stage_orders
from meshplan.pipeline.unshard_window import evicted, unshards_first
from meshplan.search.gather_passes import _chunk_gathers
from meshplan.search.window_rows import evicted_rows
from meshplan.spec.mesh import Schedule


def _per_stage(schedule, p: int, m: int, v: int, window: int = 0) -> np.ndarray:
    """The former _chunk_gathers (base 32642db8): one stage's order at a time."""
    out = np.zeros((2, 2, p, v))
    own_first = not unshards_first(schedule, window)
    for s in range(p):
        kind, _, chunk = order_arrays(schedule, p, m, v, s)
        ev = evicted(chunk, window)
        keep = kind < 2
        kind, chunk, ev = kind[keep], chunk[keep], ev[keep]
        if v > 1:
            o = np.argsort(chunk, kind="stable")
            kind, chunk, ev = kind[o], chunk[o], ev[o]
        first = np.concatenate([[True], chunk[1:] != chunk[:-1]])
        after_f = np.concatenate([[False], kind[:-1] == 0]) & ~first
        fwd = kind == 0
        first &= own_first | (s == 0) & (chunk == 0)
        for r, gathers in enumerate((first & ~ev, (first | after_f) & ~ev)):
            out[r, 0, s] = np.bincount(chunk[gathers & fwd], minlength=v)
            out[r, 1, s] = np.bincount(chunk[gathers & ~fwd], minlength=v)
    return out


def test_evicted_rows_by_hand():
    # unshard_window's example (p 2, m 2, v 4, rank 0): op 14 (chunk 0) follows op 1 with chunks
    # 1, 2, 3 between, 3 >= the window of 3: evicted. Op 10 (chunk 2, previous op 5) has only
    # chunk 3 between, op 12 (chunk 1, previous 3) chunks 2 and 3: kept. First ops never.
    row = [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]
    got = evicted_rows(np.array([row, row[::-1]]), 3)
    assert np.flatnonzero(got[0]).tolist() == [14]
    # reversed: op 14 (chunk 3, previous op 1) has chunks 2, 1, 0 between
    assert np.flatnonzero(got[1]).tolist() == [14]
    assert not evicted_rows(np.array([row]), 4).any()  # 4 chunks fit a window of 4
    assert not evicted_rows(np.array([row]), 0).any()  # no window


@pytest.mark.parametrize("window", [2, 3])
def test_evicted_rows_equal_evicted_row_by_row(window):
    rng = np.random.default_rng(7)
    for v in (3, 4, 6):
        ch = rng.integers(0, v, size=(5, 40))
        ch[1] %= 2  # a row with fewer chunks than the others
        want = np.stack([evicted(r, window) for r in ch])
        assert np.array_equal(evicted_rows(ch, window), want)
    _, _, chunk = stage_orders("interleaved_1f1b", 4, 8, 5)
    assert np.array_equal(evicted_rows(chunk, 3), np.stack([evicted(r, 3) for r in chunk]))


def test_evicted_rows_in_blocks(monkeypatch):
    # a long order goes a few stages at a time: the same rows as in one block
    import meshplan.search.window_rows as wr
    _, _, chunk = stage_orders("interleaved_1f1b", 4, 12, 6)
    whole = evicted_rows(chunk, 3)
    monkeypatch.setattr(wr, "BLOCK", 1)
    assert np.array_equal(evicted_rows(chunk, 3), whole)
    assert whole.any()  # vpp 6 > the window of 3: some ops find their chunk evicted


@pytest.mark.parametrize("schedule,v", [(Schedule.ONE_F_ONE_B, 1), (Schedule.GPIPE, 1), (Schedule.ZB_H1, 1),
                                        (Schedule.INTERLEAVED_1F1B, 2), (Schedule.INTERLEAVED_1F1B, 4),
                                        (Schedule.INTERLEAVED_1F1B, 5), (Schedule.ZBV, 2), (Schedule.DUALPIPEV, 2)])
def test_chunk_gathers_equal_the_per_stage_loop(schedule, v):
    for p in (2, 3, 4):
        for m in (1, 3, 4, 8):
            if schedule == Schedule.INTERLEAVED_1F1B and m % p:
                continue  # torch's interleaved 1F1B wants m a multiple of pp
            for window in (0, 3):
                got = _chunk_gathers.__wrapped__(schedule, p, m, v, window)
                assert np.array_equal(got, _per_stage(schedule, p, m, v, window)), (schedule, p, m, v, window)


def test_distinct_rows_dense_table_equals_unique():
    # search.memory.lookup's keys (search.key_codes): where the code span is small a table over
    # it replaces np.unique; the keys must come in np.unique's order with the same inverse.
    # By hand: rows (tp, ep) = (2, 1), (1, 0), (2, 1), (0, 1): codes tp + 3 ep = 5, 1, 5, 3,
    # distinct ascending 1, 3, 5 -> keys [1, 0], [0, 1], [2, 1]; places 2, 0, 2, 1.
    from meshplan.search.key_codes import distinct_rows
    at, inv = distinct_rows([np.array([2, 1, 2, 0]), np.array([1, 0, 1, 1])])
    assert at == [[1, 0], [0, 1], [2, 1]] and inv.tolist() == [2, 0, 2, 1]
    rng = np.random.default_rng(3)
    for n, hi in ((0, (2, 3)), (7, (9, 1, 17)), (5000, (64, 8, 3)), (5000, (10**6, 10**6, 10**3))):  # last: np.unique
        keys = [rng.integers(0, h, n) for h in hi]
        span = [int(k.max()) + 1 if n else 1 for k in keys]  # the mixed-radix code, first column least significant
        code = keys[0] + span[0] * keys[1] + span[0] * span[1] * keys[2] if n else np.zeros(0, np.int64)
        _, first, want = np.unique(code, return_index=True, return_inverse=True)
        at, inv = distinct_rows(keys)
        assert at == np.stack([k[first] for k in keys], axis=1).tolist() and np.array_equal(inv, want.reshape(-1))
