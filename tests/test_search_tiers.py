"""The headroom tiers of ``meshplan search`` (meshplan/search/headroom.py): two newcomer trials
found the search ranking first a row at 0.5% of usable memory free and ``--export 1`` writing it.
By default the rows that keep 15% of the usable memory free (PyTorch's caching allocator was measured
to lose about that to fragmentation, GMLake, ASPLOS 2024) come first, the tight ones after, marked;
``[search] headroom_tier = false`` or ``search --rank-tight`` ranks by step alone.

The space is tests/test_search_headroom.py's with tp 2 or 4 and no recompute (trial 23: with full
recompute in the space each mesh is shown at its fastest setting that keeps the headroom,
tests/test_newcomer23_choose.py, so the tight mesh here has no other setting): Llama-3-8B on one dgx-h100,
2 feasible candidates. Usable: the H100's runtime total 79.11 GiB less the 10% reserve =
76,449,344,126.976 B (71.20 GiB); a row is tight where its peak exceeds 0.85 x that = 64.98e9 B (60.52
GiB). The fastest row, dp_shard 4 x tp 2 (1.850 s; 1.852 s before FSDP2's reduce-scatters ran beside the
all-gathers, its backward's kernels then under fewer collective-holding intervals: SM contention 7.5523 ->
6.4135 ms a backward unit, x 2 micro-batches, -2.28 ms; dp_shard 2 x tp 4 +0.0386 ms x 4, 2.095 s still), peaks at 62.8 GiB = 67.38e9 B: tight (1 - 67.38 /
76.45 = 11.9% free). The next, dp_shard 2 x tp 4 (2.095 s), peaks at 39.0 GiB = 41.87e9 B: clear
(45.2% free). (At the datasheet's 72e9 B usable: 6.4% and 41.8%.) Steps and peaks are the plan's (build_plan + step_time).
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from meshplan.config import load_config
from meshplan.report.json_docs import schema_of
from meshplan.report.search import search_to_dict, table_lines, top_table
from meshplan.search.driver import search
from meshplan.memory.headroom import tight
from meshplan.search.headroom import tiered
from meshplan.units import GiB
from tests.configs import llama8b_node_search

TIGHT = "dp_shard 4 x tp 2, mb 2, none, vpp 1, zero3"
CLEAR = "dp_shard 2 x tp 4, mb 2, none, vpp 1, zero3"


def _write(tmp_path, tier: bool = True):
    path = tmp_path / "t.toml"
    path.write_text(llama8b_node_search(["zero3"], top=10, headroom_tier=tier, tp=[2, 4], recompute=["none"]))
    return path


def _search(tmp_path, tier: bool = True):
    return search(load_config(_write(tmp_path, tier), require_mesh=False), workers=1)


def _labels(r) -> list[str]:
    return [r.candidates.label(e.index) for e in r.top]


def test_tight_is_a_peak_over_85_percent_of_usable_below_the_allowance():
    """0.85 x 72e9 = 61.2e9 B: just over is tight, just under clear; with the plan's own allowance
    at 15% (fragmentation_fraction 0.15) nothing is; arrays element by element."""
    assert tight(61.3e9, 72e9, 0.0) and not tight(61.1e9, 72e9, 0.0)
    assert not tight(61.3e9, 72e9, 0.15) and tight(61.3e9, 72e9, 0.149)
    assert tight([61.3e9, 61.1e9], 72e9, 0.0).tolist() == [True, False]
    assert tiered([7, 3, 5, 1], [True, False, True, False]) == [3, 1, 7, 5]  # each tier keeps its order


def test_clear_row_first_tight_row_after_with_its_mark(tmp_path):
    """Default: the clear row (2.095 s) is row 1, the faster tight one (1.850 s) row 2, its peak
    cell marked; one line counts them and names the opt-out; the line on the top says the tiers,
    not the tie rule, put it first: 2.0952 / 1.8500 - 1 = 13.26% longer; 2.08799 / 1.84273 - 1 = 13.31%
    since kvheads.
    (kvheads: no repeat_kv copies, [memory] kv_expanded false; each op moves K and V in at the KV heads and
    out at the q heads, at 2.97 TB/s: dp_shard 4 x tp 2 (20 local heads, 16384 tokens: 167,772,160 B, 56.49 us;
    2 a layer x 32 layers x 2 micro-batches = 7.23 ms) 1.84996 -> 1.84273 s, dp_shard 2 x tp 4 (10
    heads, 83,886,080 B, 28.24 us; 2 x 32 x 4 = 7.23 ms) 2.09522 -> 2.08799 s; peaks unchanged.)"""
    r = _search(tmp_path)
    assert _labels(r) == [CLEAR, TIGHT] and r.safer == []
    assert [round(e.step_s, 3) for e in r.top] == [2.088, 1.843]
    copy = lambda heads: 2 * 16384 * heads * 128 * 2 / 2.97e12   # noqa: E731  kvheads: one copy op (docstring)
    assert (round(2.09522 - 256 * copy(10), 5), round(1.84996 - 128 * copy(20), 5)) == (2.08799, 1.84273)
    assert round(1.85224 - 2 * (7.5523 - 6.4135) / 1e3, 3) == 1.850  # 1.85224: the step before
    assert [round(e.peak_bytes / GiB, 1) for e in r.top] == [39.0, 62.8]
    # usable: the H100's runtime total 79.11 GiB x 0.9 = 76,449,344,126.976 B; tight above 0.85 of it =
    # 64,981,942,507.9 B = 60.52 GiB (was 0.85 x 72e9 = 61.2e9 B): 62.8 GiB is over, 39.0 under
    assert 0.85 * r.usable_bytes == pytest.approx(0.85 * 79.11 * 2**30 * 0.9) == pytest.approx(64_981_942_507.9)
    cols, rows = top_table(r)
    peak = cols.index("peak GiB")
    assert [x[peak] for x in rows] == ["39.0", "62.8 tight"]
    lines = table_lines(r)
    assert ("headroom tiers: 1 of 2 rows keeps under 15% of the usable memory free (marked \"tight\" in the peak "
            "column) and is listed after the 1 that keeps it, each tier by the order rule; search --rank-tight (or "
            "[search] headroom_tier = false) ranks by step time alone") in lines
    assert ("top's step 2.088 s is 13.31% longer than the fastest's (#2, 1.843 s): listed first by the headroom tiers: "
            "it keeps 45.2% of the usable memory free, row 2 (first by the order rule) 11.9%, under 15%; parts against "
            "#2: ") in r.explanation.line()
    assert not any(x.startswith("warning: row 1 has") for x in lines)  # row 1 has no row warning: no pointer
    # its one row-1 line is the setting caveat (newcomer 34: framework torch on an H100 is torchtitan's measured
    # setting, spec/accuracy.settings_of), which the pointer does not count
    assert [x for x in lines if x.startswith("warning: row 1 ")] == [
        x for x in lines if x.startswith("warning: row 1 (") and "lies where meshplan's step error" in x] != []
    assert any(x.startswith("warning: row 2 keeps less than 15%") for x in lines)


def test_json_carries_the_tier(tmp_path):
    r = _search(tmp_path)
    doc = search_to_dict(r)
    assert [d["tier"] for d in doc["top"]] == ["clear", "tight"]
    tiers = doc["headroom_tiers"]
    assert tiers["on"] and tiers["tight_rows"] == [2] and tiers["moved"] == [r.top[1].index]
    assert tiers["line"].startswith("headroom tiers: 1 of 2 rows keeps under 15%")
    assert doc["first_clear_row"]["row"] == 1
    assert doc["top_vs_runner_up"]["tiers"] is True
    assert list(jsonschema.Draft202012Validator(schema_of("search")).iter_errors(doc)) == []


def test_opt_out_ranks_by_step_alone(tmp_path):
    """[search] headroom_tier = false: the tight row first, still marked; the line says the tiers
    are off; the top's line is the plain one (11.7% = 1 - 1.8500 / 2.0952 shorter than #2; 11.6% at 1.852 s)."""
    r = _search(tmp_path, tier=False)
    assert _labels(r) == [TIGHT, CLEAR] and r.tiered_past == []
    cols, rows = top_table(r)
    assert rows[0][cols.index("peak GiB")] == "62.8 tight"
    lines = table_lines(r)
    assert ("headroom tiers off ([search] headroom_tier = false, or search --rank-tight): by step time alone; 1 of 2 "
            "rows keeps under 15% of the usable memory free (marked \"tight\" in the peak column)") in lines
    assert r.explanation.line().startswith("top's step is 11.7% shorter than #2's: ")
    assert search_to_dict(r)["headroom_tiers"]["on"] is False


def test_cli_export_follows_the_order_shown_and_rank_tight_opts_out(tmp_path, capsys):
    """--export 1 writes the clear row (dp_shard 2 x tp 4) without the headroom warning;
    --rank-tight makes the tight row row 1 and --export 1 writes it with the warning."""
    from tests.cli_run import run_main
    path = _write(tmp_path)
    assert run_main("search", path, "--export", 1, "-o", tmp_path / "one.toml", "--json", tmp_path / "s.json") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "headroom tiers: 1 of 2 rows keeps under 15%" in out and "62.8 tight" in out
    written = (tmp_path / "one.toml").read_text()
    assert 'names = ["dp_shard", "tp"]\nshape = [2, 4]' in written and "keeps less than 15%" not in written
    assert [d["tier"] for d in json.loads((tmp_path / "s.json").read_text())["top"]] == ["clear", "tight"]
    assert run_main("search", path, "--rank-tight", "--export", 1, "-o", tmp_path / "fast.toml") == 0
    capsys.readouterr()
    fast = (tmp_path / "fast.toml").read_text()
    assert 'names = ["dp_shard", "tp"]\nshape = [4, 2]' in fast and "# warning: row 1 keeps less than 15% of the usable memory free" in " ".join(fast.split())
