"""Peak allocated memory of run 3's one-rank H200 runs (benchmarks/gpu_h200/run3/one_rank.json)
against today's reduced plan of each (``bench rank``'s, :mod:`meshplan.runtime.validation.one_rank`),
with what the harness holds between steps beyond the plan's cuBLAS workspace set aside (see
benchmarks/gpu_h200/README.md, "Peak allocated, itemised"). No GPU needed: the measured bytes are
the JSON's.

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_h200_peaks.py
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    import gpu_measure as g
    from meshplan.config import config_from_dict
    from meshplan.runtime.validation.one_rank_plan import predict, reduced_data

    runs = json.loads((ROOT / "benchmarks" / "gpu_h200" / "run3" / "one_rank.json").read_text())
    print(f"{'run (gpu_measure.RUNS)':<62} {'measured':>9} {'was':>9} {'plan':>9} {'harness':>9} {'rest':>9}  (GiB, rest MB)")
    for (name, path, over, layers), ev in zip(g.RUNS, runs):
        data = g.merge(tomllib.loads((ROOT / path).read_text()), json.loads(json.dumps(over)))
        _, p = predict(config_from_dict(reduced_data(data, layers, "dgx-h200")))
        row = ev["rows"]["peak_allocated_bytes"]
        held = ev["held"]["other_bytes"] - p.peak_by_kind.get("workspace", 0)
        rest = row["measured"] - held - p.peak_allocated_bytes
        print(f"{name[:62]:<62} {row['measured'] / 2**30:>9.3f} {row['predicted'] / 2**30:>9.3f} "
              f"{p.peak_allocated_bytes / 2**30:>9.3f} {held / 2**30:>9.3f} {rest / 1e6:>9.1f}  at {p.peak_where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
