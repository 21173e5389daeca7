"""Speed goal (issue 2): `meshplan plan` for Llama-3-405B on 16,384 GPUs in under 1 s wall.

Prints plans per second and the ratio of the goal to the measured wall time (> 1 means the
goal is met), for the in-process plan, the text report, the JSON, the ``note:`` lines `plan`
prints after a feasible plan (:func:`meshplan.cli.plan_cmds.closing_notes`: the axis-need re-plan
and the reshard-default re-plan, on top of build_plan) and the whole CLI (a fresh Python process,
imports included).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from meshplan.cli.plan_cmds import closing_notes
from meshplan.plan import build_plan
from meshplan.report.json_out import plan_to_dict
from meshplan.report.text import print_plan
from meshplan.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "llama3-405b_16384xh100_tp8-pp16-dp128.toml"
GOAL_S = 1.0


def best_of(fn, n=5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    cfg = load_config(CONFIG)
    plan = build_plan(cfg)
    rows = [("build_plan", best_of(lambda: build_plan(cfg))),
            ("text report", best_of(lambda: print_plan(plan, console=Console(file=io.StringIO(), width=160)))),
            ("JSON (every group)", best_of(lambda: plan_to_dict(plan))),
            ("notes (axis need, reshard default)", best_of(lambda: closing_notes(plan)))]
    with tempfile.TemporaryDirectory() as d:
        cli = [sys.executable, "-m", "meshplan.cli", "plan", str(CONFIG), "--json", f"{d}/p.json", "--force"]
        rows.append(("CLI plan --json (fresh process)",
                     best_of(lambda: subprocess.run(cli, capture_output=True, check=True), n=3)))
    print(f"Llama-3-405B, world {plan.world}, mesh {dict(zip(plan.mesh.layout.names, plan.mesh.layout.shape))}")
    print(f"{'stage':34s} {'wall (s)':>9s} {'per s':>8s} {'goal/wall':>10s}")
    for name, t in rows:
        print(f"{name:34s} {t:9.3f} {1 / t:8.1f} {GOAL_S / t:10.1f}")


if __name__ == "__main__":
    main()
