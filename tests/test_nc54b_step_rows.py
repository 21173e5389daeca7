"""step's first-occurrence row of the tp backward all-reduce says it merges a layer's calls
(newcomer trial 54 #9: 59.5 us against 29.5 us in plan's table, unexplained)."""

import json
from pathlib import Path

import pytest

from tests.cli_run import plan_file, run_captured

JOB = Path(__file__).resolve().parent / "data" / "nc54b" / "job70b.toml"


def test_norm_grad_all_reduce_row_says_it_is_two_calls(tmp_path):
    """Llama-3-70B, tp 8 with SP under torch: each layer's two RMSNorm weights (attention and MLP
    norms) get their Partial gradients all-reduced over tp, and the final norm once: 2 x 80 + 1 =
    161 calls a micro-batch of 16,384 B (8192 bf16 weights), the plan's table row
    'tp backward all-reduce'. The step puts them in one event per layer of 161 / 80 = 2.0125
    calls, so its duration is 2.0125 x the table's time of one call, and the row says so."""
    p = plan_file(JOB)
    [row] = [r for r in p.stage(0).collectives if (r.axis, r.phase, r.op) == ("tp", "backward", "all-reduce")]
    assert (row.size_bytes, row.per_microbatch) == (16384, 161)
    out = tmp_path / "s.json"
    r = run_captured("step", JOB, "--json", out)
    assert r.returncode == 0
    [t] = [c for c in json.loads(out.read_text())["collectives"]
           if (c["stream"], c["phase"], c["op"]) == ("tp", "backward", "all-reduce")]
    assert t["calls"] == pytest.approx(161 / 80)
    assert t["duration_s"] == pytest.approx(161 / 80 * row.time_s, rel=1e-9)
    line = next(x for x in r.stdout.splitlines() if x.startswith("  tp            backward all-reduce"))
    assert line.endswith(f"(one event for 2.01 calls, {row.time_s * 1e3:.4f} ms each)")
    assert all("calls" not in c for c in json.loads(out.read_text())["collectives"] if c["op"] != "all-reduce")
