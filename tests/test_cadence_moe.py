"""plan's "when each row is issued" counts of an expert axis, per MoE layer (newcomer nc33)."""

from pathlib import Path

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.text import _per_layer_words


def test_ep_rows_counted_per_moe_layer():
    """DeepSeek-V2-Lite (27 layers, layer 0 dense, 26 MoE) at dp_shard 256 x ep 8, full AC: the ep
    all-to-all dispatch and combine are 2 forward calls per MoE layer, 52 per micro-batch, printed as
    '52 calls / 27 layers: 1 per layer + 25 outside them'; backward 2 replayed by the recompute + 2
    of the backward itself = 4 per MoE layer, 104 calls (was '3 per layer + 23 outside them')."""
    plan = build_plan(load_config(Path(__file__).parent / "data" / "nc33" / "dsv2lite_ep8.toml"))
    moe = sum(plan.config.model.is_moe_layer(i) for ch in plan.stages[0] for i in ch)
    assert moe == 26
    rows = [r for r in plan.collectives["stage 0"] if r.axis == "ep" and r.size_bytes == 402_653_184]
    words = {r.phase: _per_layer_words(r, moe) for r in rows}
    assert words == {"forward": " (52 calls per micro-batch: 2 per MoE layer x 26 MoE layers)",
                     "backward": " (104 calls per micro-batch: 4 per MoE layer x 26 MoE layers)"}
    assert "outside them" in _per_layer_words(rows[0])  # without the MoE count: the old words
