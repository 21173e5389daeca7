"""The headroom warning under the search's table (newcomer trial 15: a top row at 2.1% free with
the default 0% allocator allowance): where row 1 keeps less than
:data:`~meshplan.spec.memory.ALLOCATOR_FRAGMENTATION` (15%, PyTorch's caching allocator's measured
fragmentation, GMLake, ASPLOS 2024) of the usable memory free, the line gives its free GiB and
percent and the knob that reserves headroom (``[memory] fragmentation_fraction``); the first row
shown clear of it (and of every other row warning) is the one pointer of
tests/test_search_clear.py; the text and the --html page print the same line. These tests rank by
step alone (``[search] headroom_tier = false``, ``search --rank-tight``), where the tight row is
row 1; by default the headroom tiers list it after the clear row (tests/test_search_tiers.py)."""

from __future__ import annotations

import html

import pytest

from meshplan.config import load_config
from meshplan.memory.constraints import usable_bytes
from meshplan.report.html_pages import search_page
from meshplan.report.search import headroom_lines
from meshplan.report.search_clear import clear_lines
from meshplan.search.driver import search
from meshplan.units import GiB
from tests.configs import llama8b_node_search


def config(top: int, tier: bool) -> str:
    """Llama-3-8B on one dgx-h100, seq 8192, global batch 16, zero3 resharded, micro-batch 2, pp 1,
    cp 1, tp 1 or 2, recompute none or full: 4 candidates, 3 fit; ``top`` rows shown, ranked by
    headroom tier or by step alone."""
    return llama8b_node_search(["zero3"], top=top, headroom_tier=tier)


def _search(tmp_path, top: int = 10, tier: bool = False):
    path = tmp_path / "h.toml"
    path.write_text(config(top=top, tier=tier))
    return search(load_config(path, require_mesh=False), workers=1)


def test_tight_top_names_its_free_memory_and_the_pointer_the_first_row_that_keeps_the_margin(tmp_path):
    """Usable: the H100 SXM5's runtime total 79.11 GiB (catalog device_memory_gib) less the 10% reserve
    = 76,449,344,126.976 B = 71.20 GiB; the 15% margin leaves a peak of at most 0.85 x 71.20 = 60.52
    GiB. Row 1 (dp_shard 4 x tp 2, no recompute, 1.850 s: 1.852 s less 2 x 1.1388 ms of SM contention
    under FSDP2's reduce-scatter stream, tests/test_search_tiers.py) peaks at 62.76 GiB (its memory timeline, a
    real run): over 60.52, so tight, 71.20 - 62.76 = 8.44 GiB = 11.9% free. Row 2 (dp_shard 8, full
    recompute, 2.195 s) peaks at 28.35 GiB: under 60.52, so it is the first row that keeps the margin,
    1 - 28.35 / 71.20 = 60.2% free (at the datasheet's 67.06 GiB: 6.4% and 57.7%), and (pp 1: no
    pipeline schedule) the first clear of every row warning: the pointer line names it. The
    warning names row 1 and the knob; with the tiers off the order is by step (row 1 is the faster,
    however tight).
    (kvheads: no repeat_kv copies, [memory] kv_expanded false; each op moves K and V in at the KV heads and
    out at the q heads, at 2.97 TB/s: dp_shard 4 x tp 2 (20 local heads, 16384 tokens: 167,772,160 B, 56.49 us;
    2 a layer x 32 layers x 2 micro-batches = 7.23 ms) 1.84996 -> 1.84273 s, dp_shard 8 at full (40 heads,
    335,544,320 B, 112.98 us; 3 a layer x 32 x 1 = 10.85 ms) 2.19543 -> 2.18458 s, dp_shard 2 x tp 4 (10
    heads, 83,886,080 B, 28.24 us; 2 x 32 x 4 = 7.23 ms) 2.09522 -> 2.08799 s; peaks unchanged.)"""
    r = _search(tmp_path)
    usable = usable_bytes(r.config.cluster, r.config.training)
    assert usable == pytest.approx(0.9 * 79.11 * 2**30) and round(usable / GiB, 2) == 71.20
    assert [round(e.step_s, 3) for e in r.top] == [1.843, 2.185]
    copy = lambda heads, tokens: 2 * tokens * heads * 128 * 2 / 2.97e12   # noqa: E731  kvheads: one copy op
    assert (round(1.84996 - 128 * copy(20, 16384), 5), round(2.19543 - 96 * copy(40, 16384), 5)) == (1.84273, 2.18458)
    one, two = r.top
    assert one.peak_bytes > 0.85 * usable > two.peak_bytes
    assert (round((usable - one.peak_bytes) / GiB, 1), round(1 - one.peak_bytes / usable, 3)) == (8.4, 0.119)
    assert headroom_lines(r) == [
        "warning: row 1 keeps less than 15% of the usable memory free (#1 dp_shard 4 x tp 2, mb 2, none, vpp 1, zero3: "
        "peak 62.8 of 71.2 GiB, 8.4 GiB = 11.9% free) at [memory] fragmentation_fraction 0%; PyTorch's caching "
        "allocator was measured to lose about 15% to fragmentation in LLM training (GMLake, ASPLOS 2024): set [memory] "
        "fragmentation_fraction = 0.15 to plan with it"]
    (pointer,) = clear_lines(r)  # 2.18458 / 1.84273 - 1 = 18.55% longer (18.67% before kvheads, 2.1953 / 1.8500)
    assert pointer.startswith("warning: row 1 has 1 of the search's row warnings (under 15% of usable memory free); "
                              "row 2 is the first row shown with none of them (dp_shard 8, mb 2, full, vpp 1, zero3: "
                              "peak 28.3 GiB, 60.2% free; step 2.185 s, 18.55% longer than row 1's 1.843 s); ")
    page = search_page(r, "h.toml")
    assert html.escape(headroom_lines(r)[0]) in page and html.escape(pointer) in page  # one source for the page


def test_tight_top_alone_says_no_row_keeps_the_margin(tmp_path):
    """--top 1: row 1 is the only row shown, so the pointer says none is clear, with the one
    setting that leaves the headroom warning out of a search."""
    (pointer,) = clear_lines(_search(tmp_path, top=1))
    assert pointer.startswith("warning: row 1 has 1 of the search's row warnings (under 15% of usable memory free); no "
                              "row shown is clear of them (under 15% of usable memory free: 1 of 1, left out by "
                              "[memory] fragmentation_fraction = 0.15); the row warnings: ")


def test_export_of_a_tight_row_prints_the_same_warning(tmp_path):
    """Newcomer trial 17: `search --export 1` wrote the tight top row without a word. The export
    prints the search's line for the row it writes (its header's ``warning:``, also in the file);
    row 2 (57.7% free) gets none; the pointer is test_search_clear.py's."""
    from meshplan.report.search_lines import export_headroom
    r = _search(tmp_path)
    (one,) = export_headroom(r, (1, ""))
    assert "warning: " + one == headroom_lines(r)[0]  # one row tight: the same words
    assert export_headroom(r, (2, "")) == ()


def test_search_export_cli_prints_and_writes_it(tmp_path, capsys):
    from tests.cli_run import run_main
    path = tmp_path / "h.toml"
    path.write_text(config(top=10, tier=False))
    assert run_main("search", path, "--export", 1, "-o", tmp_path / "row1.toml") == 0
    flat = " ".join(capsys.readouterr().out.split())  # the console wraps the table's line
    head = "warning: row 1 keeps less than 15% of the usable memory free"
    warned = [head + x.split("to plan with it")[0] + "to plan with it" for x in flat.split(head)[1:]]
    assert len(warned) == 2 and warned[0] == warned[1]  # under the table, and the export's header
    pointer = ("warning: row 1 has 1 of the search's row warnings (under 15% of usable memory free); row 2 is the first "
               "row shown with none of them")  # the pointer too, under the table and in the header
    assert flat.count(pointer) == 2
    written = " ".join((tmp_path / "row1.toml").read_text().split())
    assert f"# {warned[0]}" in written and f"# {pointer}" in written
    assert run_main("search", path, "--export", 2, "-o", tmp_path / "row2.toml") == 0
    assert " ".join(capsys.readouterr().out.split()).count(head) == 1  # the table's only
    assert "keeps less than 15%" not in (tmp_path / "row2.toml").read_text()
