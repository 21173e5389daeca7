"""The search's speed-ups that must not change a number (issue 11 item 7): the ranking's queue
tightening bounds lazily (:mod:`meshplan.search.frontier`), a step-only and a memory-only
evaluation merged into a complete one (:func:`meshplan.search.exact.merge`)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.search import best_first
from meshplan.search.driver import search
from meshplan.search.estimate import refine
from meshplan.search.exact import PLAN_ONLY, SIMULATE, STEP_ONLY, Planner, merge
from meshplan.search.frontier import Frontier
from meshplan.search.space import OK, enumerate_candidates, first_reason
from test_search import CASES, config


def test_frontier_tightens_the_front_and_reorders():
    # bounds 1, 2, 3, 4; tightening raises candidate 0 to 3.5 and candidate 1 to 5: after the
    # front is tightened the queue is 2 (3), 0 (3.5), 3 (4), 1 (5)
    lo = np.array([1.0, 2.0, 3.0, 4.0])
    calls = []

    def tighten(idx):
        calls.append(sorted(int(i) for i in idx))
        lo[idx[idx == 0]], lo[idx[idx == 1]] = 3.5, 5.0
    q = Frontier(np.arange(4), lo, tighten, np.zeros(4, bool), block=2, most=10)
    assert q.next_bound(1) == 3.0 and calls == [[0, 1], [2]]
    assert [int(i) for i in q.pop(2)] == [2, 0] and [int(i) for i in q.pop(5)] == [3, 1] and len(q) == 0
    assert q.next_bound(1) == float("inf")


def test_frontier_stops_tightening_at_most():
    lo = np.array([1.0, 2.0, 3.0])
    tight = np.array([True, False, False])

    def tighten(idx):
        lo[idx] += 10
    q = Frontier(np.arange(3), lo, tighten, tight, block=1, most=2)  # one tightened already: one left
    assert [int(i) for i in q.pop(3)] == [0, 2, 1] and lo.tolist() == [1.0, 12.0, 3.0]


def test_step_only_and_memory_only_merge_to_the_simulated_evaluation():
    cfg = config(**CASES["16"])
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    ok = np.flatnonzero(code == OK)
    planner = Planner(cfg, c)
    pipelined = [int(i) for i in ok if c.pp[i] > 1][:3]
    flat = [int(i) for i in ok if c.pp[i] == 1][:3]
    fits = unfit = 0
    for i in pipelined + flat:
        full = planner((i, SIMULATE))
        step, memory = planner((i, STEP_ONLY)), planner((i, PLAN_ONLY))
        assert not step.complete and step.breakdown == full.breakdown and step.step_s == full.step_s
        got = merge(step, memory), merge(memory, step)
        if full.feasible:
            fits += 1
            assert got[0] == full and got[1] == full
        else:  # an unfit memory verdict keeps no step (the ranking drops it), as before
            unfit += 1
            assert got[0].feasible is False and got[0].peak_bytes == full.peak_bytes
    assert fits > 0


@pytest.mark.slow  # three searches of the 64-GPU case: 8.4 s on a loaded 2-core machine
def test_ranking_tightens_lazily_and_keeps_the_top(monkeypatch):
    # the same top and numbers with the queue's tightening off (only the near-top refine) and
    # with every refine off; the lazy tightening plans no more candidates exactly than either
    cfg = config(**CASES["64"], settle_max=0)
    lazy = search(cfg, workers=1)
    plain = search(config(**CASES["64"], settle_max=0, refine_max=0), workers=1)

    class Eager(Frontier):
        def _front(self, k):
            pass
    monkeypatch.setattr(best_first, "Frontier", Eager)
    eager = search(cfg, workers=1)
    key = lambda r: [(e.index, e.step_s, e.peak_bytes, e.goodput, e.breakdown) for e in r.top]  # noqa: E731
    assert key(lazy) == key(plain) == key(eager)
    assert len(lazy.exact) <= len(eager.exact) <= len(plain.exact)  # equal once the bounds count the copies (22)
    # a bound the queue tightened is still at most the exact step
    steps = {i: e.step_s for i, e in lazy.exact.items() if e.step_s is not None}
    idx = np.array(sorted(steps))
    est = lazy.est
    refine(cfg, lazy.candidates, est, idx)
    assert all(est.step_lo[i] <= steps[i] * (1 + 1e-9) for i in idx)
