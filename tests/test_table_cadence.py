"""The collective table's cadence lines and the network verdict's bytes list (issue 11
follow-ups): values derived by hand from the rows' counts."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.layer_counts import per_layer_words as _per_layer_words
from meshplan.report.text import print_plan
from meshplan.schedule.verdict import _sent_items
from meshplan.units import GB
from tests.conftest import EXAMPLES


def _row(per_microbatch: int, layers: int):
    return SimpleNamespace(per_microbatch=per_microbatch, per_layer=per_microbatch / layers)


def test_per_layer_words_split_whole_layers_from_the_rest():
    # 161 = 2 x 80 + 1; 15 = 2 x 7 + 1; one call over 7 layers is outside them; 160 / 80 is whole
    assert _per_layer_words(_row(161, 80)) == " (per layer 2.01 = 161 calls / 80 layers: 2 per layer + 1 outside them)"
    assert _per_layer_words(_row(15, 7)) == " (per layer 2.14 = 15 calls / 7 layers: 2 per layer + 1 outside them)"
    assert _per_layer_words(_row(1, 7)) == " (1 call per micro-batch, outside the layers)"
    assert _per_layer_words(_row(3, 80)) == " (3 calls per micro-batch, outside the layers)"
    assert _per_layer_words(_row(160, 80)) == ""
    assert _per_layer_words(SimpleNamespace(per_microbatch=0, per_layer=0.0)) == ""


def test_sent_items_drop_zero_gb_and_name_the_replay():
    sent = {"forward all-to-all": 444e9, "backward all-to-all": 888e9,
            "forward all-gather": 0.063e9, "backward all-gather": 0.063e9}
    assert _sent_items(sent) == ("forward all-to-all 444 GB, "
                                 "backward all-to-all 888 GB (444 GB of it the recompute's replay)")
    # no recompute: backward all-to-all equals the forward one (dispatch and combine gradients)
    assert _sent_items({"forward all-to-all": 3 * GB, "backward all-to-all": 3 * GB}) == \
        "forward all-to-all 3 GB, backward all-to-all 3 GB"


def test_plan_prints_the_sp_norm_cadence_and_its_per_layer_split():
    plan = build_plan(load_config(EXAMPLES / "seed-64gpu.toml"))
    con = Console(width=160, record=True)
    print_plan(plan, console=con)
    text = con.export_text()
    assert "when each row is issued:" in text
    assert ("every norm (SP weight gradients): tp backward all-reduce 16,384 B "
            "(per layer 2.01 = 161 calls / 80 layers: 2 per layer + 1 outside them)") in text
