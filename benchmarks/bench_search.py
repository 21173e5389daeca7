"""Speed goal (issue 5, item 4): ``meshplan search`` exhaustive for Llama-3-405B on 16,384
H100 GPUs within 10 s on 2 cores.

Prints, per config: candidates enumerated and valid, the wall time of each phase
(enumerate + rules, the vectorised estimate, the exact ranking, planning candidates near
the memory limit, the best rejected one), candidates per second (all candidates / total
wall, and the vectorised phase alone), how many were planned exactly, and the ratio of the
goal to the wall time (> 1 means the goal is met). Run on 2 cores:
``taskset -c 0,1 .venv/bin/python benchmarks/bench_search.py``.

Usage: ``bench_search.py [CONFIG ...] [--workers N] [--settle-max N] [--profile N] [--why]`` (default: the
405B example and the seed example; workers = CPUs this process may use). ``--profile N`` runs
each search under cProfile (use ``--workers 1``: the forked workers' time is not seen) and prints
its N functions of largest cumulative and own time; the wall times then include the profiler's
overhead. ``cpu``: user + sys seconds of the search, workers included.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import time
from dataclasses import replace
from pathlib import Path

from meshplan.search.driver import search
from meshplan.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "examples" / "llama3-405b_16384xh100_tp8-pp16-dp128.toml", ROOT / "examples" / "seed-64gpu.toml"]
GOAL_S = 10.0


def cpu_s() -> float:
    """CPU seconds (user + sys) of this process and of its finished children (the search's
    forked workers, joined when it returns)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench(path: Path, workers: int, settle_max: int | None, profile: int = 0, why: bool = False) -> None:
    cfg = load_config(path, require_mesh=False)
    if settle_max is not None:
        cfg = replace(cfg, search=cfg.search.model_copy(update={"settle_max": settle_max}))
    prof = cProfile.Profile() if profile else None
    t0, c0 = time.perf_counter(), cpu_s()
    if prof:
        prof.enable()
    r = search(cfg, workers=workers)
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    n, counts = len(r.candidates), r.counts()
    valid = n - sum(v for k, v in counts.items() if k not in ("feasible", "undecided", "memory", "gemm"))
    vector = r.timings.get("enumerate", 0) + r.timings.get("estimate", 0)
    print(f"{path.name}: {n:,} candidates, {valid:,} pass the validity rules, {counts['feasible']:,} feasible, "
          f"{counts['undecided']:,} undecided; {len(r.exact)} planned exactly; workers {workers}")
    for phase, t in r.timings.items():
        print(f"  {phase:16s} {t:8.2f} s")
    print(f"  {'total':16s} {wall:8.2f} s   candidates/s {n / wall:,.0f} (vectorised phase: {n / vector:,.0f}/s)   "
          f"goal {GOAL_S:g} s / wall = {GOAL_S / wall:.2f}")
    print(f"  {'cpu':16s} {cpu:8.2f} s   (user + sys, this process and its workers: less sensitive than wall "
          f"to other work on a shared machine)")
    for k, e in enumerate(r.top[:3], 1):
        print(f"  #{k} {r.candidates.label(e.index)}: step {e.step_s:.3f} s, MFU {e.mfu:.1%}, "
              f"peak {e.peak_bytes / 2**30:.1f} GiB")
    if r.explanation is not None:
        print(f"  {r.explanation.line()}")
    print(f"  top proven exact: {r.proven}")
    if why:
        print_why(r)
    if prof:
        for key in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(profile)
            print(f"  profile by {key}:")
            print("\n".join("    " + line for line in out.getvalue().splitlines()[4:] if line.strip()))


def print_why(r) -> None:
    """Why the ranking planned what it planned (``--why``): of the candidates planned for their step, those
    whose exact step is above the stopping cut (here the last row's step + 1%, the rule's window,
    :func:`meshplan.search.rank.needed`; the headroom tiers may place the search's own cut a little
    elsewhere) needed no plan with an exact bound: their step-time lower bound was loose. Counted by
    (cp, pp > 1), with min / median of bound / exact; ``r.est.step_lo`` is the bound of step 5 (the
    ranking's queue may have tightened it further the same way before planning)."""
    steps = {i: e.step_s for i, e in r.exact.items() if e.step_s is not None}
    if not r.top or not steps:
        return
    cut = max(t.step_s for t in r.top) * 1.01
    c, by = r.candidates, {}
    for i, s in steps.items():
        key = (int(c.cp[i]), int(c.pp[i]) > 1)
        by.setdefault(key, []).append((float(r.est.step_lo[i]) / s, s > cut))
    loose = sum(x for v in by.values() for _, x in v)
    print(f"  why planned: {len(steps)} with a step, {len(r.exact) - len(steps)} memory alone; {loose} with the step above "
          f"the cut {cut:.3f} s (a bound at the exact step would have left them unplanned); by (cp, pp > 1):")
    for (cp, pp), v in sorted(by.items()):
        ratios = sorted(q for q, x in v if x)
        tail = f", bound / exact min {ratios[0]:.3f} median {ratios[len(ratios) // 2]:.3f}" if ratios else ""
        print(f"    cp {cp:3d} {'pp > 1' if pp else 'pp 1  '}: {len(v):4d} planned, {len(ratios):4d} above the cut{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", type=Path, default=CONFIGS)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count())
    ap.add_argument("--settle-max", type=int, default=None, help="override [search] settle_max")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="run under cProfile and print the N functions of largest cumulative and own time")
    ap.add_argument("--why", action="store_true",
                    help="count the candidates planned for their step whose step is above the cut, by (cp, pp > 1)")
    args = ap.parse_args()
    for path in args.configs:
        bench(path, args.workers, args.settle_max, args.profile, args.why)


if __name__ == "__main__":
    main()
