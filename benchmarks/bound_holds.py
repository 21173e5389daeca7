"""The search's step-time lower bound against the exact step on every candidate of a config
(issue lbound): the search prunes on the bound (:mod:`meshplan.search.best_first`), so a bound
above the exact step can prune the best mesh and break "the top is exact".

For each valid candidate (the search's rules, :func:`meshplan.search.space.first_reason`): the
vectorised bound (:func:`meshplan.search.estimate.estimate`), the bound refined on the exact
pipeline schedule (:func:`meshplan.search.estimate.refine`) and the exact step
(``build_plan`` + ``step_time``, the search's step-only evaluation); a line per candidate with
``--all``, else only those whose bound is above the exact step (relative slack 1e-9, the search's
``BOUND_SLACK``), then a summary (count, min / median / max of refined bound / exact).

Run: PYTHONPATH=. .venv/bin/python benchmarks/bound_holds.py CONFIG [--cluster dgx-h100 --nodes 16]
[--every K] [--all]   (a foreign config, torchtitan or Megatron-LM, needs --cluster and --nodes;
``--every K`` takes every K-th valid candidate, for the larger spaces).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.search.best_first import BOUND_SLACK
from meshplan.search.estimate import estimate, refine
from meshplan.search.exact import STEP_ALONE, Planner
from meshplan.search.space import OK, enumerate_candidates, first_reason


def check(path: str, cluster: str | None, nodes: int | None, every: int, show_all: bool) -> int:
    """Print the candidates of ``path`` (every ``every``-th) whose bound exceeds the exact step; the count."""
    opts = ImportOptions(cluster=cluster, nodes=nodes) if cluster else ImportOptions()
    cfg = load_any(path, None, opts, require_mesh=False, foreign=cluster is not None)
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    est = estimate(cfg, c, code)
    vec = est.step_lo.copy()
    ok = np.flatnonzero(code == OK)[::every]
    refine(cfg, c, est, ok)
    planner = Planner(cfg, c)
    ratios, bad, t0 = [], 0, time.time()
    for i in ok.tolist():
        e = planner((i, STEP_ALONE))
        if not e.feasible or e.step_s is None:
            continue
        over = max(vec[i], est.step_lo[i]) > e.step_s * (1 + BOUND_SLACK)
        ratios.append(est.step_lo[i] / e.step_s)
        bad += over
        if over or show_all:
            print(f"{'ABOVE ' if over else ''}{c.label(i)}: bound {vec[i]:.5f} s, refined {est.step_lo[i]:.5f} s, "
                  f"exact {e.step_s:.5f} s", flush=True)
    r = np.sort(ratios)
    print(f"{path}: {len(ok)} valid candidates checked, {len(r)} evaluated, {bad} with the bound above the exact "
          f"step; refined bound / exact min {r[0]:.3f}, median {r[len(r) // 2]:.3f}, max {r[-1]:.5f} "
          f"({time.time() - t0:.0f} s)")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--cluster")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    raise SystemExit(1 if check(a.config, a.cluster, a.nodes, a.every, a.all) else 0)


if __name__ == "__main__":
    main()
