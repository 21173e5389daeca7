"""plan's "when each row is issued" counts of an expert axis, per MoE layer (newcomer nc33)."""

from pathlib import Path

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.layer_counts import per_layer_words as _per_layer_words


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


def test_fsdp_units_of_an_moe_model_named_per_kind_of_layer():
    """The same plan's FSDP rows (cadence "every layer"): DeepSeek-V2-Lite's 27 layers are layer 0
    dense (the catalog's dense_layers 1, HF ``first_k_dense_replace``) and 26 MoE, each layer its own
    FSDP unit (comm.fsdp_rows.fsdp_units), the routed experts apart (256 GPUs at dp_shard 256 x ep 8:
    efsdp 256 / 8 = 32 shards the experts, fsdp 256 the rest: mesh.tpsplit.experts_apart). So per
    micro-batch, no pp: 1 all-gather (forward), 1
    (backward, resharded after forward) and 1 reduce-scatter of the dense layer's unit; 26 of each
    of the MoE layers' non-expert unit; 26 of each of the experts' efsdp unit. Over the 27 layers
    those read 0.04 and 0.96 per layer, which the table called "1 call per micro-batch, outside
    the layers" and "26 calls per micro-batch, outside the layers" (fails before the fix: those words)."""
    plan = build_plan(load_config(Path(__file__).parent / "data" / "nc33" / "dsv2lite_ep8.toml"))
    rows = plan.collectives["stage 0"]
    unit = [r for r in rows if r.axis == "dp_shard" and r.cadence == "every layer"]
    experts = [r for r in rows if r.axis == "efsdp"]
    assert sorted(r.per_microbatch for r in unit) == [1, 1, 1, 26, 26, 26] and len(experts) == 3
    words = {(r.phase, r.op, r.per_microbatch): _per_layer_words(r, 26, True) for r in unit}
    dense = " (1 call per micro-batch: 1 per dense layer x 1 dense layer, the dense layer's unit)"
    moe = " (26 calls per micro-batch: 1 per MoE layer x 26 MoE layers, the MoE layer's non-expert unit)"
    assert words == {(p, op, n): dense if n == 1 else moe for p, op, n in words}
    assert {_per_layer_words(r, 26, True) for r in experts} == {
        " (26 calls per micro-batch: 1 per MoE layer x 26 MoE layers)"}
    # the experts in the layer's unit (experts_apart False): the MoE layer's whole unit
    assert _per_layer_words(unit[-1], 26) == (
        " (26 calls per micro-batch: 1 per MoE layer x 26 MoE layers, the MoE layer's unit)")
    # a root unit's row stays outside the layers
    root = next(r for r in rows if r.cadence == "per root (embedding)")
    assert _per_layer_words(root, 26, True) == " (1 call per micro-batch, outside the layers)"
