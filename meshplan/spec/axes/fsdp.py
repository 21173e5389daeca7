"""Fully sharded data parallelism (``dp_shard``; torchtitan's ``fsdp`` is dp_shard x cp):
parameters, gradients and optimizer state sharded over the derived ``fsdp`` axis (FSDP2 /
ZeRO-3). In the search it is the remainder axis: world / (pp x dp_replicate x cp x tp)."""

from __future__ import annotations

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, SearchColumn

DP_SHARD = AxisDef(
    doc="FSDP/ZeRO shard axis (parameters/gradients/optimizer state sharded)",
    torchtitan=("dp_shard", "fsdp"),
    divides=(Dim.BATCH, Dim.PARAM_DIM0),  # FSDP2 Shard(0), padded
    shards=("parameters", "gradients", "optimizer state"),
    collectives=(CollectiveKind("all-gather", "fsdp", "forward", "one FSDP unit's parameters"),
                 CollectiveKind("all-gather", "fsdp", "backward", "one FSDP unit's parameters (resharded)"),
                 CollectiveKind("reduce-scatter", "fsdp", "backward", "one FSDP unit's gradients"),
                 CollectiveKind("all-reduce", "fsdp", "step", "float8 amax (fp8 all-gathers)"),
                 CollectiveKind("reduce-scatter", "fsdp", "step", "every gradient (ZeRO-1/2)"),
                 CollectiveKind("all-gather", "fsdp", "step", "the updated parameters (ZeRO-1/2)")),
    search=SearchColumn(column="dps", option="dp_shard", remainder=True),
    weights={"dp_shard": 1e2},
)
