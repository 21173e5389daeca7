"""Speed goal (issue 11 item 4): `meshplan step` of any config up to 16,384 GPUs, pp 128 and
4,096 micro-batches in at most 1 s.

For each config under benchmarks/configs/ (GPT 1T, 512 GPUs pp 64 x 3,072 micro-batches, and
16,384 GPUs at pp 128 / 4,096 micro-batches under 1F1B, ZB-H1 and interleaved 1F1B, the 1F1B and
interleaved ones also with ``training.framework = "megatron"``: blocking pipeline sends, the
simulation's other loop), prints the units simulated and the wall time of each phase the `step`
command runs: build_plan (config to plan, memory timeline included; `memory` is the timelines of
every stage alone, computed again on arrays by meshplan/memory/passtable.py and peakscan.py: 9-22 s pass by pass
before, benchmarks/configs; not a phase of the command), step_time (unit timelines + pipeline
simulation + stage ends), the network verdict and the bubble hint (its re-plans where the bubble is
15% of the step or more), the critical path, and the link report (timings,
concurrency, edge loads of stage 0); ``command``: the sum of the command's phases (build_plan,
step_time, verdict, critical path, links; not the interpreter's start-up and imports, nor the
printing and JSON writing). Each cell is ``wall/cpu``: wall seconds, then CPU seconds of this
process (user + sys, ``time.process_time``: less sensitive to other work on a shared machine);
the last line names the config with the most CPU seconds of the command. Best of ``--repeat``
runs (default 1) per cell; no timed tests: times depend on the machine. The first run of a
process pays for its first touch of fresh memory (in a VM: 3-40 ms per 12 MB array of 1.5 M
units), as the command does; numpy arrays in small pages, as the command allocates them
(:func:`meshplan.cli.small_pages`).

    PYTHONPATH=. python benchmarks/bench_step.py [--repeat N] [CONFIG ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from meshplan.cli import small_pages
from meshplan.config import load_config
from meshplan.memory.timeline import memory_timelines
from meshplan.plan import build_plan
from meshplan.schedule.bubble_hint import bubble_hint
from meshplan.schedule.linkload import concurrency, edge_loads
from meshplan.schedule.readiness import timings
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import network_verdict, rebuilt_step
from meshplan.schedule.waits import bubble_wait

ROOT = Path(__file__).resolve().parent
GOAL_S = 1.0
#: The phases `meshplan step` runs (``memory`` is computed again here only to show its share).
COMMAND = ("build_plan", "step_time", "verdict", "critical path", "links")


def phases(path: Path) -> tuple[dict[str, float], dict[str, float], object]:
    """Wall and CPU seconds of each phase of `meshplan step` on ``path``, and (plan, StepTime)."""
    t: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def lap(name, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        t[name], cpu[name] = time.perf_counter() - t0, time.process_time() - c0
        return out

    cfg = load_config(path)
    plan = lap("build_plan", lambda: build_plan(cfg))
    if plan.timelines:  # an Infeasible mesh has none
        lap("memory", lambda: memory_timelines(plan))
    st = lap("step_time", lambda: step_time(plan, Overlap()))
    if plan.feasible:  # an infeasible mesh prints only its would-be step and exits 1
        again = rebuilt_step(plan, lambda a: step_time(a, Overlap()))
        lap("verdict", lambda: network_verdict(plan, st, again, bw=bubble_wait(st)) + bubble_hint(plan, st, again))
        lap("critical path", st.critical_path)
        lap("links", lambda: (timings(st), concurrency(st), edge_loads(plan, st)))
    t["command"] = sum(v for k, v in t.items() if k in COMMAND)
    cpu["command"] = sum(v for k, v in cpu.items() if k in COMMAND)
    return t, cpu, (plan, st)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    small_pages()  # as the command (meshplan.cli.main)
    paths = a.configs or sorted((ROOT / "configs").glob("*.toml"))
    cols = ("build_plan", "memory", "step_time", "verdict", "critical path", "links", "command")
    print(f"{'config':46s} {'units':>9s} " + " ".join(f"{c:>13s}" for c in cols) + f" {'step (s)':>10s}")
    worst = ("", 0.0)
    for path in paths:
        best: dict[str, float] = {}
        best_cpu: dict[str, float] = {}
        for _ in range(a.repeat):
            t, cpu, (plan, st) = phases(path)
            best = {k: min(v, best.get(k, v)) for k, v in t.items()}
            best_cpu = {k: min(v, best_cpu.get(k, v)) for k, v in cpu.items()}
        units = len(st.pipeline.end)
        cells = " ".join(f"{best[c]:6.3f}/{best_cpu[c]:<6.3f}" if c in best else f"{'-':>13s}" for c in cols)
        fit = "" if plan.feasible else " (does not fit)"
        print(f"{path.stem:46s} {units:9,d} {cells} {st.step_s:10.3f}{fit}")
        worst = max(worst, (path.stem, best_cpu["command"]), key=lambda x: x[1])
    print(f"goal: the whole step command <= {GOAL_S:.0f} s; cells are wall/CPU seconds per phase; the most CPU: "
          f"{worst[0]} {worst[1]:.3f} s")


if __name__ == "__main__":
    main()
