"""The search's one pointer to the first row shown clear of every row warning it gives
(meshplan/report/search_clear.py): headroom under 15% of usable memory free, a V schedule under
activation checkpointing, any other runtime warning of the plan. A newcomer's Llama-3-70B search
(16 dgx-h100, pp 4/8, zbv/dualpipev, recompute full) got two warnings that each named a row the
other warned about; now each warning keeps its line on row 1 and one line points to a row with none.

The space (8 GPUs of 6 GB, the 8-layer model of tests/test_search.py, micro-batch 4, zero3,
tp 1/2, cp 1, recompute none/full, pp_schedules 1f1b/zbv/dualpipev, reshard_after_forward false: the
rule v-reshard rejects a V schedule over FSDP2 resharded after forward). Usable: 6e9 B less the 10%
reserve = 5.4e9 B = 5.03 GiB; a row keeps the 15% margin where its peak is at most 0.85 x 5.4e9 =
4.59e9 B. A row runs a V schedule under activation checkpointing where its recompute is full (a
torchtitan activation_checkpoint.mode "full") and its schedule zbv or dualpipev at pp > 1.
"""

from __future__ import annotations

import jsonschema
import pytest

from meshplan.memory.constraints import usable_bytes
from meshplan.plan_runtime import config_warnings, position_warning
from meshplan.report.json_docs import schema_of
from meshplan.report.search import search_to_dict, table_lines
from meshplan.report.search_clear import HEADROOM, SPLIT_AC, clear_lines, clear_verdict, export_warnings, row_warnings
from meshplan.search.candidate import candidate_config
from meshplan.search.driver import search
from test_search import SMALL, config

SPACE = dict(micro_batch=[4], tp=[1, 2], cp=[1], sharding=["zero3"], reshard_after_forward=[False],
             tp_comm_overlap=[False], uneven_stages=[False], recompute=["none", "full"],
             pp_schedules=["1f1b", "zbv", "dualpipev"])
MARGIN_PEAK_B = 0.85 * 0.9 * 6e9  # the highest peak that keeps 15% of the usable memory free
CHECKED = ("the row warnings: under 15% of usable memory free, a split-backward schedule under activation "
           "checkpointing (zbv, dualpipev, zb_h1 under framework torch), a runtime warning of the plan (plan and step "
           "print it)")


def _search(pp, model=None, tier=False):
    """Ranked by step alone (``[search] headroom_tier = false``) unless ``tier``: the pointer's
    cases need a row 1 with warnings, which the headroom tiers (the default) list after a clear row."""
    return search(config(1, 6.0, model=model, pp=pp, headroom_tier=tier, **SPACE), workers=1)


def _by_hand(r) -> list[tuple[str, ...]]:
    """Each row's warnings from its peak and its label alone (the definitions above)."""
    out = []
    for e in r.top:
        label = r.candidates.label(e.index)
        split = ", full, " in label and label.endswith(("zbv", "dualpipev")) and label.startswith("pp ")
        out.append(tuple([HEADROOM] * (e.peak_bytes > MARGIN_PEAK_B) + [SPLIT_AC] * split))
    return out


@pytest.fixture(scope="module")
def to_pp8():
    """pp 2/4/8: 5 rows; row 1 zbv under full AC at 4.67 GiB, rows 2-4 over the margin, row 5
    pp 8 (1F1B) at 3.36 GiB."""
    return _search([2, 4, 8])


def test_row_1_with_two_warnings_points_to_the_first_clear_row(to_pp8):
    """Rows (the search's order; peaks from their memory timelines): 1 pp 2 x dp_shard 4 zbv kept
    gathered, full: 4.67 GiB > 4.59e9 B = 4.27 GiB, and a V schedule under AC: both warnings; 2 pp 2 x
    dp_shard 2 x tp 2, none, vpp 4, 4.42 GiB, 0.1272 s: headroom (vppevict's window re-gathers, timed at
    their pass, had moved it from 0.1269 s to 0.1278 s, within 1% of its vpp 2 twin's 0.1286 s, and the
    tie rule listed vpp 2; timed from torch's UNSHARD, schedule.window_unshard, they hide behind the ops
    before their pass: 0.1272 s, 1.1% under vpp 2's); 3 pp 4 x dp_shard 2 zbv, full, 4.53 GiB: both;
    4 pp 4 x tp 2 zbv, none (no AC, no data axis): 4.88 GiB, headroom; 5 pp 8, full, vpp 1 (1F1B), 3.36
    GiB: none, so row 5 is the first clear row: 1 - 3.36 / 5.03 = 33.1% free. The old lines named
    row 2 (the first without a V schedule, over the margin) and no row (headroom, rows 2-4 shown
    first) in turn. Every row is kept gathered, the default under torch with pp > 1
    (TrainingSpec.reshard_default), so no label says so (searchraf: ", keep gathered" on rows 1, 2
    and 4 before). (kvheads: rows 3 and 4 swapped. Without the repeat_kv copies ([memory] kv_expanded
    false, SDPA reads the KV heads) pp 4 x dp_shard 2 (tp 1: each copy op 2 x 8192 x (16 + 4) x 128 x 2 B
    = 83,886,080 B, 28.24 us at 2.97 TB/s; 3 a layer under full, 2 layers a stage, 8 micro-batches of 4:
    1.36 ms) went 0.15593 -> 0.15458 s and pp 4 x tp 2 (at tp 2 half the bytes, 14.12 us, 2 a layer at
    none, 16 micro-batches: 0.90 ms) is 0.15316 s; the two are now within 1% (0.92%), where the tie rule
    lists the lower tp*pp*cp*ep first, 4 against 8 (meshplan.search.rank.TOWARD); steps read from the model
    at kv_expanded false and true.)"""
    r = to_pp8
    labels = [r.candidates.label(e.index) for e in r.top]
    assert labels == ["pp 2 x dp_shard 4, mb 4, full, vpp 2, zero3, zbv",
                      "pp 2 x dp_shard 2 x tp 2, mb 4, none, vpp 4, zero3",
                      "pp 4 x dp_shard 2, mb 4, full, vpp 2, zero3, zbv",
                      "pp 4 x tp 2, mb 4, none, vpp 2, zero3, zbv",
                      "pp 8, mb 4, full, vpp 1, zero3"]
    three, four = r.top[2].step_s, r.top[3].step_s   # kvheads: within the 1% tie band, the lower tp*pp first
    assert four < three and round((three - four) / three, 4) == 0.0092
    assert round(2 * 3 * 8 * 2 * 8192 * 20 * 128 * 2 / 2.97e12 * 1e3, 2) == 1.36   # pp 4 x dp_shard 2's copies
    assert round(2 * 2 * 16 * 2 * 8192 * 10 * 128 * 2 / 2.97e12 * 1e3, 2) == 0.90   # pp 4 x tp 2's
    assert usable_bytes(r.config.cluster, r.config.training) == pytest.approx(5.4e9)
    v = clear_verdict(r)
    assert list(v.warnings) == _by_hand(r) == [(HEADROOM, SPLIT_AC), (HEADROOM,), (HEADROOM, SPLIT_AC), (HEADROOM,), ()]
    assert v.first == 5
    one, five = r.top[0], r.top[4]
    free = 1 - five.peak_bytes / 5.4e9
    assert round(free, 3) == 0.331
    lines = table_lines(r)
    (pointer,) = clear_lines(r)
    assert pointer == (
        "warning: row 1 has 2 of the search's row warnings (under 15% of usable memory free; a split-backward schedule under "
        f"activation checkpointing); row 5 is the first row shown with none of them (pp 8, mb 4, full, vpp 1, zero3: "
        f"peak {five.peak_bytes / 2**30:.1f} GiB, {free:.1%} free; step {five.step_s:.3f} s, "
        f"{five.step_s / one.step_s - 1:.2%} longer than row 1's {one.step_s:.3f} s); {CHECKED}")
    # each warning keeps its own line on row 1, the pointer comes after them, once; the third is the setting
    # line (newcomer 34: framework torch on an H100, h100-small-hbm, is torchtitan's measured setting,
    # spec/accuracy.settings_of), a caveat on the model's error, not a row warning the pointer counts
    head = [k for k, x in enumerate(lines) if x.startswith(("warning: rows 1, 2, 3, 4 keep", "warning: row 1 ("))]
    assert len(head) == 3 and "lies where meshplan's step error" in lines[head[2]]
    assert lines.index(pointer) == max(head) + 1
    assert sum("is the first row" in x for x in lines) == 1


def test_json_carries_it(to_pp8):
    doc = search_to_dict(to_pp8)
    first = doc["first_clear_row"]
    assert first["row"] == 5 and first["line"] == clear_lines(to_pp8)[0].removeprefix("warning: ")
    assert [d["warnings"] for d in doc["top"]] == first["row_warnings"] == [list(w) for w in _by_hand(to_pp8)]
    assert list(jsonschema.Draft202012Validator(schema_of("search")).iter_errors(doc)) == []


def test_export_of_a_warned_row_repeats_the_pointer(to_pp8):
    """--export 4 (pp 4 x tp 2 zbv, over the margin; row 3 before kvheads, test above): the headroom
    words for row 4, then the pointer with row 4 as its subject, row 5's step against row 4's; --export 5
    (clear) writes neither; --export 1 the line under the table."""
    r = to_pp8
    words, pointer = export_warnings(r, (4, ""))
    assert words.startswith("row 4 keeps less than 15% of the usable memory free (#4 pp 4 x tp 2, mb 4, none, vpp 2")
    assert pointer.startswith("row 4 has 1 of the search's row warnings (under 15% of usable memory free); row 5 is "
                              "the first row shown with none of them (pp 8, mb 4, full, vpp 1, zero3: ")
    assert f"longer than row 4's {r.top[3].step_s:.3f} s); " in pointer
    assert export_warnings(r, (5, "")) == ()
    assert "warning: " + export_warnings(r, (1, ""))[-1] == clear_lines(r)[0]


def test_the_headroom_tiers_put_the_clear_row_first_and_the_pointer_goes(to_pp8):
    """The same search with the headroom tiers (the default): rows 1-4 above are each over the margin
    and each mesh has a setting that keeps it (trial 23, meshplan/search/headroom.py tier_order), so each
    is shown at its fastest such setting (the fastest clear candidate of its mesh planned) and its tight
    first setting is named in a line; row 5 (pp 8) is shown as it was. Every row is clear, so no pointer
    is printed and --json's first_clear_row is row 1, and no headroom warning."""
    r = _search([2, 4, 8], tier=True)
    mesh = {e.index: r.candidates.label(e.index).split(", mb")[0] for e in r.exact.values()}
    assert sorted(mesh[e.index] for e in r.top) == sorted(mesh[e.index] for e in to_pp8.top)
    assert all(e.peak_bytes <= MARGIN_PEAK_B for e in r.top) and r.tiered_past == []
    assert [(mesh[a.index], b.index) for a, b in r.safer] == [(mesh[e.index], t.index) for e in r.top
                                                               for t in to_pp8.top[:4] if mesh[t.index] == mesh[e.index]]
    for e in r.top:  # the fastest clear candidate of its mesh among those planned
        clear = [x.step_s for x in r.exact.values() if mesh[x.index] == mesh[e.index] and x.complete and x.feasible
                 and x.peak_bytes <= MARGIN_PEAK_B]
        assert e.step_s == min(clear)
    assert clear_lines(r) == [] and clear_verdict(r).first == 1
    assert not any("keep less than 15%" in x or "keeps less than 15%" in x for x in table_lines(r))


def test_no_row_clear_names_each_warning_with_its_setting():
    """pp 2/4 ranked by step alone (headroom tiers off: with them each mesh is shown at a setting
    that keeps the margin, as above): the first 4 rows of the search above, no pp 8 row: every row
    over the margin (4 of 4),
    rows 1 and 3 under a V schedule with AC (2 of 4; rows 1 and 4 before kvheads, first test): no row is clear; [memory]
    fragmentation_fraction = 0.15 leaves the first out of a search, [search] pp_schedules = ["1f1b"]
    (zbv and dualpipev dropped from the three) the second."""
    r = _search([2, 4])
    assert [r.candidates.label(e.index).split(", mb")[0] for e in r.top] == [
        "pp 2 x dp_shard 4", "pp 2 x dp_shard 2 x tp 2", "pp 4 x dp_shard 2", "pp 4 x tp 2"]
    v = clear_verdict(r)
    assert list(v.warnings) == _by_hand(r) and v.first is None
    assert clear_lines(r) == [
        "warning: row 1 has 2 of the search's row warnings (under 15% of usable memory free; a split-backward schedule under "
        "activation checkpointing); no row shown is clear of them (under 15% of usable memory free: 4 of 4, left out "
        "by [memory] fragmentation_fraction = 0.15; a split-backward schedule under activation checkpointing: 2 of 4, left out by "
        f"[search] pp_schedules = [\"1f1b\"]); {CHECKED}"]
    doc = search_to_dict(r)["first_clear_row"]
    assert doc["row"] is None and doc["line"] == clear_lines(r)[0].removeprefix("warning: ")


def test_the_workload_s_position_warning_is_not_a_row_warning():
    """A model built for 1,024 positions at seq 2,048: plan warns on every config of the workload
    (position_warning), so it would make no row clear; the pointer leaves it out, the row-1 fact
    unchanged (two warnings, row 5 clear at pp 2/4/8 as above)."""
    r = _search([2, 4, 8], model=dict(SMALL, max_position=1024))
    (position,) = position_warning(r.config.model, 2048)
    assert position in config_warnings(candidate_config(r.config, r.candidates, r.top[4].index))
    assert [row_warnings(r, e) for e in r.top] == _by_hand(r) and clear_verdict(r).first == 5
