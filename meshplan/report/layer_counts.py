"""Why a collective row's "per layer" cell is not whole (:func:`per_layer_words`): the calls of
a row issued per micro-batch said per layer, per MoE layer, per dense layer, or as calls outside
the layer loop (the embedding's, the head's, the loss's), under the plan's collective tables
(:func:`meshplan.report.text._cadence_lines`).

An MoE model's FSDP units (:func:`meshplan.comm.fsdp_rows.fsdp_units`): each layer is one unit of
its kind, so a stage of ``d`` dense and ``m`` MoE layers gathers ``d`` dense-layer units and ``m``
MoE-layer units per micro-batch, two rows of cadence ``every layer`` (each of its own bytes); with
the routed experts apart (efsdp, :func:`meshplan.mesh.tpsplit.experts_apart`) an MoE layer's unit
is its non-expert part and its experts are a third row (axis efsdp). Counted over all ``d + m``
layers those read as calls outside the layers (DeepSeek-V2-Lite: 1 dense, 26 MoE).
"""

from __future__ import annotations

#: Axes whose collectives run in the MoE layers alone: their calls are counted per MoE layer
#: (efsdp: the routed experts' own FSDP unit of each MoE layer).
EXPERT_ROW_AXES = ("ep", "etp", "efsdp")
#: Axes (as the collective table shows them) whose "every layer" rows are a layer's FSDP unit.
FSDP_ROW_AXES = ("fsdp", "dp_shard", "dp_replicate", "dp")
#: Cadences of a layer's FSDP unit rows (:func:`meshplan.comm.fsdp_rows._unit_rows`; HSDP's all-reduce).
UNIT_CADENCES = ("every layer", "every layer (HSDP replicas)")


def per_layer_words(row, moe_layers: int = 0, experts_apart: bool = False) -> str:
    """Why ``row``'s "per layer" cell is not whole; "" for a whole figure or a row not issued per
    micro-batch. ``moe_layers``: the stage's MoE layers (0: not an MoE model, or unknown);
    ``experts_apart``: the routed experts in a unit of their own (module docstring).

    - an expert axis's row (:data:`EXPERT_ROW_AXES`) or a row issued every MoE layer: ``(52 calls
      per micro-batch: 2 per MoE layer x 26 MoE layers)``;
    - an MoE model's layer-unit rows (:data:`UNIT_CADENCES` on :data:`FSDP_ROW_AXES`), one call per
      unit: ``(1 call per micro-batch: 1 per dense layer x 1 dense layer, the dense layer's unit)``,
      ``(26 calls per micro-batch: 1 per MoE layer x 26 MoE layers, the MoE layer's non-expert unit)``;
    - else the calls over the stage's layers (``per_microbatch / per_layer``) and those left over,
      issued outside the layer loop: ``(per layer 2.14 = 15 calls / 7 layers: 2 per layer + 1
      outside them)``, or under one per layer ``(1 call per micro-batch, outside the layers)``.
    """
    if not row.per_microbatch or not row.per_layer or float(row.per_layer).is_integer():
        return ""
    n = row.per_microbatch
    calls = f"{n} call{'s' if n > 1 else ''}"
    layers = round(n / row.per_layer)
    dense = layers - moe_layers
    axis, cadence = getattr(row, "axis", None), getattr(row, "cadence", "")
    if moe_layers and (axis in EXPERT_ROW_AXES or cadence.startswith("every MoE layer")) and n % moe_layers == 0:
        return f" ({calls} per micro-batch: {n // moe_layers} per MoE layer x {_layers(moe_layers, 'MoE')})"
    if moe_layers and dense and axis in FSDP_ROW_AXES and cadence in UNIT_CADENCES and n in (moe_layers, dense):
        moe_unit = "MoE layer's non-expert unit" if experts_apart else "MoE layer's unit"
        if moe_layers == dense:  # as many of each: the row's count cannot tell its unit
            return f" ({calls} per micro-batch: the dense or the {moe_unit}, 1 per layer of its kind x {n})"
        if n == dense:
            return f" ({calls} per micro-batch: 1 per dense layer x {_layers(dense, 'dense')}, the dense layer's unit)"
        return f" ({calls} per micro-batch: 1 per MoE layer x {_layers(moe_layers, 'MoE')}, the {moe_unit})"
    each, left = divmod(n, layers)
    if not each:
        return f" ({calls} per micro-batch, outside the layers)"
    return f" (per layer {row.per_layer:.2f} = {calls} / {layers} layers: {each} per layer + {left} outside them)"


def _layers(n: int, kind: str) -> str:
    """``n`` layers of ``kind``: "1 dense layer", "26 MoE layers"."""
    return f"{n} {kind} layer{'s' if n > 1 else ''}"
