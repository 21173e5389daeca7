"""Memory goal (issue 3): meshplan's timeline against PyTorch's own accounting.

For each configuration of tests/memcheck_cases.py (dense and GQA, with and
without SP, FSDP and HSDP, recompute none and full, 8 to 64 ranks) one rank trains a small
Llama on the fake process group under FSDPMemTracker; the table sets meshplan's prediction
beside the tracker: the maximum of each kind over the step and the peak (``--at-peak``:
the kinds at the peak too). Goal: peak within 5%, each kind within 10%.

    .venv/bin/python benchmarks/memory_vs_tracker.py [--at-peak] [--fake]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

PEAK_GOAL, KIND_GOAL = 0.05, 0.10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at-peak", action="store_true", help="also print the kinds at the peak")
    ap.add_argument("--fake", action="store_true", help="FakeTensorMode instead of real CPU tensors")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the cases are test data
    from memcheck_cases import CASES

    from meshplan.runtime.validation.memcheck import compare, table

    t0 = time.perf_counter()
    results = [compare(c.config(), c.name, fake=args.fake) for c in CASES]
    wall = time.perf_counter() - t0
    print(table(results, at_peak=args.at_peak))
    print()
    ok = True
    for c in results:
        worst = c.worst_kind()
        good = abs(c.peak.rel_error) <= PEAK_GOAL and abs(worst.rel_error) <= KIND_GOAL
        ok &= good
        print(f"{'ok  ' if good else 'MISS'} {c.name:<36} peak {c.peak.rel_error:+6.1%}  "
              f"worst kind {worst.kind} {worst.rel_error:+6.1%}")
    print(f"\n{len(results)} configurations in {wall:.1f} s; goal (peak within {PEAK_GOAL:.0%}, "
          f"each kind within {KIND_GOAL:.0%}): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
