"""Data parallelism: ``dp_replicate`` (HSDP's replica axis: gradients all-reduced over it)
and ``dp`` (one data axis whose meaning is ``training.sharding``: DDP replicas or ZeRO/FSDP
shards). The batch arithmetic is theirs: micro-batches per step = global_batch /
(micro_batch x dp), dp = replicate x shard, cp excluded (handed case C1).

>>> from types import SimpleNamespace as N
>>> t = N(global_batch=64, micro_batch=2)
>>> DP.rules[0].check(None, t, N(dp=8, mb=2))[1]
('micro-batches per step = global_batch 64 / (micro_batch 2 * dp 8) = 4 (dp = replicate x shard, cp excluded)',)
>>> DP.rules[0].check(None, t, N(dp=6, mb=2))[0]
('global_batch 64 is not divisible by micro_batch 2 * dp 6 = 12',)
"""

from __future__ import annotations

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, Rule, SearchColumn


def _batch_bad(m, t, d):
    return t.global_batch % (d.mb * d.dp) != 0


def micro_batches(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per optimizer step per dp rank, 0 when ``micro_batch x dp`` does not
    divide the global batch.

    >>> micro_batches(64, 2, 8), micro_batches(64, 2, 6)
    (4, 0)
    """
    return 0 if global_batch % (micro_batch * dp) else global_batch // (micro_batch * dp)


def _batch(m, t, d):
    dp, mb, gb = d.dp, t.micro_batch, t.global_batch
    if _batch_bad(m, t, d):
        return (f"global_batch {gb} is not divisible by micro_batch {mb} * dp {dp} = {mb * dp}",), ()
    return (), (f"micro-batches per step = global_batch {gb} / (micro_batch {mb} * dp {dp}) = {gb // (mb * dp)} "
                f"(dp = replicate x shard, cp excluded)",)


DP_REPLICATE = AxisDef(
    doc="HSDP replica axis (gradients all-reduced)",
    torchtitan=("dp_replicate",),
    divides=(Dim.BATCH,),
    collectives=(CollectiveKind("all-reduce", "dp_replicate", "backward", "each FSDP unit's gradient shard"),),
    search=SearchColumn(column="dpr", option="dp_replicate"),
    weights={"dp_replicate": 10.0},
)

DP = AxisDef(
    doc="data parallel; replicas or ZeRO/FSDP shards per ``training.sharding``",
    megatron=("dp",),
    rules=(Rule("batch", 90, "global_batch not divisible by micro_batch * dp", _batch_bad, _batch),),
    divides=(Dim.BATCH,),
    shards=("optimizer state (zero1)", "gradients (zero2)", "parameters (zero3)"),
    collectives=(CollectiveKind("all-reduce", "loss", "backward", "every gradient (DDP, one per bucket, over dp x cp)"),),
    weights={"dp": 10.0},
)
