"""Speed of the Chrome/Perfetto trace writer (``meshplan step --trace``, ``meshplan compare``'s
evidence folder, :mod:`meshplan.pipeline.trace`): for each config, the predicted step's trace
events (``StepTime.trace_events``) turned into the trace's text two ways, ``json.dumps`` of
:func:`~meshplan.pipeline.trace.trace_dict` (a dict per event, then the encoder's walk) and
:func:`~meshplan.pipeline.trace.trace_json` (one pass, what ``write_trace`` writes), checked to
be the same bytes; prints events, CPU seconds (``time.process_time``: less sensitive to other work
on a shared machine; best of ``--repeat``) and events/s of each. Building the events
(``trace_events``) is timed apart: both ways share it. No timed tests: times depend on the machine.

    PYTHONPATH=. python benchmarks/bench_trace.py [--repeat N] [CONFIG ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from meshplan.cli import small_pages
from meshplan.config import load_config
from meshplan.pipeline.trace import trace_dict, trace_json
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap

ROOT = Path(__file__).resolve().parent
#: 139,393 and 58,236 events (benchmarks/configs' GPT-1T at 512 GPUs: 11.8 million, minutes each way)
DEFAULT = (ROOT.parent / "examples" / "seed-64gpu.toml", ROOT.parent / "examples" / "llama3-405b_16384xh100_tp8-pp16-dp128.toml")


def best_cpu(fn, repeat: int) -> tuple[float, object]:
    """(least CPU seconds of ``repeat`` calls of ``fn``, its last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        c0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - c0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    small_pages()  # as the command (meshplan.cli.main)
    print(f"{'config':40s} {'events':>10s} {'trace_events s':>14s} {'dumps(trace_dict) s':>19s} {'events/s':>10s} "
          f"{'trace_json s':>12s} {'events/s':>10s} same")
    for path in a.configs or DEFAULT:
        plan = build_plan(load_config(path))
        st = step_time(plan, Overlap())
        ranks = dict(enumerate(st.example_ranks))
        t_ev, events = best_cpu(lambda: st.trace_events(True), a.repeat)
        n = len(events)
        t_old, old = best_cpu(lambda: json.dumps(trace_dict(events, {}, ranks), separators=(",", ":")), a.repeat)
        t_new, new = best_cpu(lambda: trace_json(events, {}, ranks), a.repeat)
        print(f"{path.stem:40s} {n:10,d} {t_ev:14.3f} {t_old:19.3f} {n / t_old:10,.0f} {t_new:12.3f} {n / t_new:10,.0f} "
              f"{'yes' if old == new else 'NO'}")


if __name__ == "__main__":
    main()
