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

from dataclasses import replace

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


def _search(pp, model=None, tier=False, schedules=None):
    """Ranked by step alone (``[search] headroom_tier = false``) unless ``tier``: the pointer's
    cases need a row 1 with warnings, which the headroom tiers (the default) list after a clear row.
    ``schedules``: ``[search] pp_schedules`` (SPACE's if None)."""
    space = dict(SPACE, pp_schedules=schedules) if schedules else SPACE
    return search(config(1, 6.0, model=model, pp=pp, headroom_tier=tier, **space), workers=1)


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
    """pp 2/4/8: 5 rows; row 1 pp 2 x dp_shard 2 x tp 2 (no AC) at 4.42 GiB, over the margin; rows 2, 4
    and 5 clear, row 3 over the margin."""
    return _search([2, 4, 8])


def _v_first(r):
    """``r`` with the DualPipeV row of pp 4 x dp_shard 2 under full AC put first, in row 1's place (its
    mesh's row is interleaved vpp 2, row 4): the case of a row 1 with two warnings, which this space no
    longer ranks first (the first test). (The ZB-V row of pp 2 x dp_shard 4 under full AC was this row:
    since the timeline counts its lagging W passes, 5,785,462,784 B, it exceeds usable memory:
    tests/test_search_split_ac.py.)"""
    (v,) = [e for e in r.exact.values() if r.candidates.label(e.index) == DPV_PP4]
    return replace(r, top=[v, *r.top[1:]])


DPV_PP4 = "pp 4 x dp_shard 2, mb 4, full, vpp 2, zero3, dualpipev"


def test_row_1_with_two_warnings_points_to_the_first_clear_row(to_pp8):
    """Rows (the search's order; peaks from their memory timelines): 1 pp 2 x dp_shard 2 x tp 2, none,
    vpp 4, 4.42 GiB > 4.59e9 B = 4.27 GiB: headroom; 2 pp 2 x dp_shard 4, full, vpp 4, 4.00 GiB: clear;
    3 pp 4 x tp 2, none, vpp 2 (interleaved): 4.55 GiB, headroom; 4 pp 4 x dp_shard 2, full, vpp 2
    (interleaved), 3.71 GiB: clear; 5 pp 8, full, vpp 1 (1F1B), 3.36 GiB: clear. So row 2 is the first
    clear row: 1 - 4.30e9 / 5.4e9 = 20.4% free. Before W's forward replays were timed, ZB-V under full AC
    was row 1 at pp 2 (0.124 s) and row 3 at pp 4; each W of theirs now replays the layer's forward 9
    times (one per parameter group, meshplan.memory.wlag.weight_groups: 4 micro-batches x 4 layers a rank
    x 9 x 1.411 ms = 0.203 s more at pp 2, tests/test_search_split_ac.py), so they step 0.327 s and
    0.379 s and their meshes show interleaved 1F1B (0.132 s, 0.169 s). (kvheads' 1% tie between pp 4 x
    dp_shard 2 zbv and pp 4 x tp 2 zbv is gone with it: 0.169 s against 0.153 s.) Row 3 was pp 4 x tp 2
    under ZB-V (no AC, 4.88 GiB) until the timeline counted the V schedules' lagging W passes: its stage 3
    holds 7 lagging chunk passes of one layer at the cool-down's first W (tests/test_vshape_memory.py),
    5,478,490,112 B > 5.4e9, so the mesh shows interleaved 1F1B (0.159 s, 4,889,903,104 B). Every row is kept
    gathered, the default under torch with pp > 1 (TrainingSpec.reshard_default), so no label says so.
    Row 1 with both warnings is the DualPipeV row put first (:func:`_v_first`): 5,268,733,952 B over the
    margin and a V schedule under AC; its pointer names row 2, whose step is the shorter."""
    r = to_pp8
    labels = [r.candidates.label(e.index) for e in r.top]
    assert labels == ["pp 2 x dp_shard 2 x tp 2, mb 4, none, vpp 4, zero3",
                      "pp 2 x dp_shard 4, mb 4, full, vpp 4, zero3",
                      "pp 4 x tp 2, mb 4, none, vpp 2, zero3",
                      "pp 4 x dp_shard 2, mb 4, full, vpp 2, zero3",
                      "pp 8, mb 4, full, vpp 1, zero3"]
    assert usable_bytes(r.config.cluster, r.config.training) == pytest.approx(5.4e9)
    v = clear_verdict(r)
    assert list(v.warnings) == _by_hand(r) == [(HEADROOM,), (), (HEADROOM,), (), ()]
    assert v.first == 2
    two = r.top[1]
    assert round(1 - two.peak_bytes / 5.4e9, 3) == 0.204
    lines = table_lines(r)
    (pointer,) = clear_lines(r)
    assert pointer.startswith("warning: row 1 has 1 of the search's row warnings (under 15% of usable memory free); "
                              "row 2 is the first row shown with none of them (pp 2 x dp_shard 4, mb 4, full, vpp 4")
    # the headroom line (rows 1, 3), the setting line (newcomer 34: framework torch on an H100,
    # h100-small-hbm, is torchtitan's measured setting, spec/accuracy.settings_of), then the pointer, once
    head = [k for k, x in enumerate(lines) if x.startswith(("warning: rows 1, 3 keep", "warning: row 1 ("))]
    assert len(head) == 2 and "lies where meshplan's step error" in lines[head[1]]
    assert lines.index(pointer) == max(head) + 1
    assert sum("is the first row" in x for x in lines) == 1

    z = _v_first(r)
    one = z.top[0]
    assert one.step_s > 2 * two.step_s  # 0.354 s against 0.132 s: the replays
    assert list(clear_verdict(z).warnings) == _by_hand(z) == [(HEADROOM, SPLIT_AC), (), (HEADROOM,), (), ()]
    (pointer,) = clear_lines(z)
    free = 1 - two.peak_bytes / 5.4e9
    assert pointer == (
        "warning: row 1 has 2 of the search's row warnings (under 15% of usable memory free; a split-backward schedule under "
        f"activation checkpointing); row 2 is the first row shown with none of them (pp 2 x dp_shard 4, mb 4, full, vpp 4, "
        f"zero3: peak {two.peak_bytes / 2**30:.1f} GiB, {free:.1%} free; step {two.step_s:.3f} s, "
        f"{1 - two.step_s / one.step_s:.2%} shorter than row 1's {one.step_s:.3f} s); {CHECKED}")


def test_json_carries_it(to_pp8):
    doc = search_to_dict(to_pp8)
    first = doc["first_clear_row"]
    assert first["row"] == 2 and first["line"] == clear_lines(to_pp8)[0].removeprefix("warning: ")
    assert [d["warnings"] for d in doc["top"]] == first["row_warnings"] == [list(w) for w in _by_hand(to_pp8)]
    assert list(jsonschema.Draft202012Validator(schema_of("search")).iter_errors(doc)) == []


def test_export_of_a_warned_row_repeats_the_pointer(to_pp8):
    """--export 3 (pp 4 x tp 2 zbv, no AC, over the margin; row 4 before W's replays were timed, first
    test): the headroom words for row 3, then the pointer with row 3 as its subject, naming row 2 (the
    first clear row shown, above it) with row 2's step against row 3's; --export 2 (clear) writes
    neither; --export 1 the line under the table."""
    r = to_pp8
    words, pointer = export_warnings(r, (3, ""))
    assert words.startswith("row 3 keeps less than 15% of the usable memory free (#3 pp 4 x tp 2, mb 4, none, vpp 2")
    assert pointer.startswith("row 3 has 1 of the search's row warnings (under 15% of usable memory free); row 2 is "
                              "the first row shown with none of them (pp 2 x dp_shard 4, mb 4, full, vpp 4, zero3: ")
    assert f"shorter than row 3's {r.top[2].step_s:.3f} s); " in pointer
    assert export_warnings(r, (2, "")) == ()
    assert "warning: " + export_warnings(r, (1, ""))[-1] == clear_lines(r)[0]


def test_the_headroom_tiers_put_the_clear_row_first_and_the_pointer_goes(to_pp8):
    """The same search with the headroom tiers (the default): rows 1 and 3 above are over the margin
    and each mesh has a setting that keeps it (trial 23, meshplan/search/headroom.py tier_order), so each
    is shown at its fastest such setting (the fastest clear candidate of its mesh planned) and its tight
    first setting is named in a line; rows 2, 4 and 5, clear, are shown as they were. Every row is clear,
    so no pointer is printed and --json's first_clear_row is row 1, and no headroom warning. (Rows 1-4 were
    each over the margin before W's forward replays were timed: two were ZB-V rows under full AC.)"""
    r = _search([2, 4, 8], tier=True)
    mesh = {e.index: r.candidates.label(e.index).split(", mb")[0] for e in r.exact.values()}
    assert sorted(mesh[e.index] for e in r.top) == sorted(mesh[e.index] for e in to_pp8.top)
    assert all(e.peak_bytes <= MARGIN_PEAK_B for e in r.top) and r.tiered_past == []
    assert [(mesh[a.index], b.index) for a, b in r.safer] == [(mesh[e.index], t.index) for e in r.top
                                                               for t in to_pp8.top if mesh[t.index] == mesh[e.index]
                                                               and t.peak_bytes > MARGIN_PEAK_B]
    assert len(r.safer) == 2
    for e in r.top:  # the fastest clear candidate of its mesh among those planned
        clear = [x.step_s for x in r.exact.values() if mesh[x.index] == mesh[e.index] and x.complete and x.feasible
                 and x.peak_bytes <= MARGIN_PEAK_B]
        assert e.step_s == min(clear)
    assert clear_lines(r) == [] and clear_verdict(r).first == 1
    assert not any("keep less than 15%" in x or "keeps less than 15%" in x for x in table_lines(r))


def test_no_row_clear_names_each_warning_with_its_setting():
    """pp 2/4 with the V schedules alone, ranked by step alone (headroom tiers off: with them each mesh
    is shown at a setting that keeps the margin, as above): 1 pp 4 x dp_shard 2 dualpipev, full, 4.91 GiB:
    both (ZB-V's pp 4 row is 7% slower); 2 pp 2 x dp_shard 2 x tp 2 zbv, full, 3.46 GiB: a V schedule under
    AC; 3 pp 4 x tp 2 dualpipev, full, 3.05 GiB: the same. Every row warned, so no row is clear: 3 of 3 V rows
    under AC, left out by [search] pp_schedules = ["1f1b"], and 1 of 3 over the margin, left out by [memory]
    fragmentation_fraction = 0.15. The rows that led before the timeline counted the V schedules' lagging W
    passes (pp 4 x tp 2 zbv, none, 4.88 GiB; pp 2 x dp_shard 4 zbv, full, 4.67 GiB) now exceed usable memory
    (5,478,490,112 and 5,785,462,784 B > 5.4e9: tests/test_search_split_ac.py), and the pp 2 x dp_shard 2 x
    tp 2 zbv row (3.04 GiB before) holds its lagging output gradients too (3.46 GiB). (With 1F1B in the
    schedules, as this test searched before W's forward replays were timed, the interleaved rows now
    rank first and row 2 is clear: first test.)"""
    r = _search([2, 4], schedules=["zbv", "dualpipev"])
    assert [r.candidates.label(e.index) for e in r.top] == [
        DPV_PP4, "pp 2 x dp_shard 2 x tp 2, mb 4, full, vpp 2, zero3, zbv",
        "pp 4 x tp 2, mb 4, full, vpp 2, zero3, dualpipev"]
    v = clear_verdict(r)
    assert list(v.warnings) == _by_hand(r) == [(HEADROOM, SPLIT_AC), (SPLIT_AC,), (SPLIT_AC,)]
    assert v.first is None
    assert clear_lines(r) == [
        "warning: row 1 has 2 of the search's row warnings (under 15% of usable memory free; a split-backward schedule "
        "under activation checkpointing); no row shown is clear of them (a split-backward schedule under activation "
        "checkpointing: 3 of 3, left out by [search] pp_schedules = [\"1f1b\"]; under 15% of usable memory free: 1 of 3, "
        f"left out by [memory] fragmentation_fraction = 0.15); {CHECKED}"]
    doc = search_to_dict(r)["first_clear_row"]
    assert doc["row"] is None and doc["line"] == clear_lines(r)[0].removeprefix("warning: ")


def test_the_workload_s_position_warning_is_not_a_row_warning():
    """A model built for 1,024 positions at seq 2,048: plan warns on every config of the workload
    (position_warning), so it would make no row clear; the pointer leaves it out, the row-1 fact
    unchanged (one warning, row 2 clear at pp 2/4/8 as above)."""
    r = _search([2, 4, 8], model=dict(SMALL, max_position=1024))
    (position,) = position_warning(r.config.model, 2048)
    assert position in config_warnings(candidate_config(r.config, r.candidates, r.top[4].index))
    assert [row_warnings(r, e) for e in r.top] == _by_hand(r) and clear_verdict(r).first == 2
