"""Context parallelism (``cp``): each sequence split over cp ranks as 2 load-balanced chunks
(Llama 3's all-gather CP; K and V all-gathered over cp in every attention layer).

>>> from types import SimpleNamespace as N
>>> t = N(seq_len=8192)
>>> CP.rules[0].check(None, t, N(cp=4))[1]
('cp 4: each rank holds 2048 tokens per sequence as 2 chunks of 1024 (load-balanced causal split)',)
>>> CP.rules[0].check(None, N(seq_len=100), N(cp=8))[0]
('seq_len 100 is not divisible by 2 * cp (16) for load-balanced causal CP',)
"""

from __future__ import annotations

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, Rule, SearchColumn


def _seq_bad(m, t, d):
    return (d.cp > 1) & (t.seq_len % (2 * d.cp) != 0)


def _seq(m, t, d):
    s, cp = t.seq_len, d.cp
    if cp <= 1:
        return (), ()
    if _seq_bad(m, t, d):
        return (f"seq_len {s} is not divisible by 2 * cp ({2 * cp}) for load-balanced causal CP",), ()
    return (), (f"cp {cp}: each rank holds {s // cp} tokens per sequence as 2 chunks of {s // (2 * cp)} "
                f"(load-balanced causal split)",)


CP = AxisDef(
    doc="context parallel (sequence split for attention)",
    torchtitan=("cp",), megatron=("cp",),
    rules=(Rule("seq_cp", 70, "seq_len not divisible by 2 * cp", _seq_bad, _seq),),
    divides=(Dim.SEQUENCE,),
    shards=("activations", "parameters, gradients, optimizer state (with dp_shard, as fsdp)"),
    collectives=(CollectiveKind("all-gather", "cp", "forward", "K and V of the whole sequence"),
                 CollectiveKind("all-gather", "cp", "backward", "K and V again where the layer is recomputed"),
                 CollectiveKind("reduce-scatter", "cp", "backward", "dK and dV")),
    search=SearchColumn(column="cp", option="cp"),
    weights={"cp": 1e4},
)
