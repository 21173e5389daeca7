"""``benchmarks/bench_search.py --why`` (perf2): of the candidates the ranking planned for their step, those
whose exact step is above the cut (the last row's step + 1%) are the plans a bound at the exact step would
have spared, counted by (cp, pp > 1) with bound / exact."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.bench_module import bench


def _result():
    # 5 candidates: two rows (steps 10 s and 9 s, so the cut is 10 x 1.01 = 10.1 s), a cp 4 candidate at
    # 12 s with a bound of 9 s (9 / 12 = 0.75, above the cut), a cp 4 pp 2 candidate at 10.05 s (under the
    # cut: needed), and one planned for memory alone (no step: not counted among the step plans)
    e = lambda i, s: SimpleNamespace(index=i, step_s=s)
    exact = {0: e(0, 10.0), 1: e(1, 9.0), 2: e(2, 12.0), 3: e(3, 10.05), 4: e(4, None)}
    cands = SimpleNamespace(cp=np.array([1, 1, 4, 4, 1]), pp=np.array([1, 1, 1, 2, 1]))
    est = SimpleNamespace(step_lo=np.array([9.5, 8.5, 9.0, 9.9, 7.0]))
    return SimpleNamespace(exact=exact, top=[exact[1], exact[0]], candidates=cands, est=est)


def test_why_counts_the_plans_above_the_cut_by_cp(capsys):
    bench("bench_search", "bench_search_why").print_why(_result())
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("  why planned: 4 with a step, 1 memory alone; 1 with the step above the cut 10.100 s")
    assert out[1:] == ["    cp   1 pp 1  :    2 planned,    0 above the cut",
                       "    cp   4 pp 1  :    1 planned,    1 above the cut, bound / exact min 0.750 median 0.750",
                       "    cp   4 pp > 1:    1 planned,    0 above the cut"]
