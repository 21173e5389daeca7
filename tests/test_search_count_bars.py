"""The search page's count bars (``--html``) name each rule and its one-line reason, as the text's
``candidates per outcome`` lines do (one source: :func:`meshplan.report.search.outcome_rows`)."""

from __future__ import annotations

import re
from html import unescape

from meshplan.config import load_config
from meshplan.report.html_pages import search_page
from meshplan.report.search import count_lines
from meshplan.search.driver import search
from tests.configs import llama8b_node_search

#: Llama-3-8B on one dgx-h100, seq 8192, global batch 16, micro-batch 2, pp 1, cp 1, tp 1 or 2,
#: recompute none or full, parameters resharded, sharding zero1 or zero3: 2 x 2 x 2 = 8 candidates.
#: The 4 zero1 rows fall to rule 'framework' (framework torch has no engine sharding the optimizer
#: alone); of the 4 zero3 rows, tp 1 without recompute does not fit (tests/test_search_headroom.py's
#: same 4 rows: 3 fit), rule 'memory'.
CONFIG = llama8b_node_search(["zero1", "zero3"])

#: One bar row: outcome, why, count, then the bar's cell.
BAR = re.compile(r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>([\d,]+)</td><td style=\"text-align:left\"><div ")


def test_bars_name_each_rule_with_its_reason_and_count(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(CONFIG)
    r = search(load_config(path, require_mesh=False), workers=1)
    bars = [(unescape(o), unescape(w), int(n.replace(",", ""))) for o, w, n in BAR.findall(search_page(r, "s"))]
    framework = "zero1 under framework torch: no torch engine shards the optimizer alone (torchtitan cannot run it)"
    assert bars == [("rejected, rule 'framework'", framework, 4), ("feasible", "", 3),
                    ("rejected, rule 'memory'", "memory peak > usable", 1)]
    # the text prints the same names, reasons and counts
    assert count_lines(r) == ["candidates per outcome (8 in all):", "  feasible: 3",
                              f"  rejected, rule 'framework' ({framework}): 4",
                              "  rejected, rule 'memory' (memory peak > usable): 1"]
