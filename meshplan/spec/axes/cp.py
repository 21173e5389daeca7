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
from meshplan.spec.axes.tp import local_heads
from meshplan.units import dtype_bytes


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


def cp_rows(add, c) -> None:
    """The cp rows of one stage's collective table (:data:`~meshplan.spec.axes.base.RowBuilder`):
    per layer, K and V of the whole sequence all-gathered in the forward
    (``b x s x local KV heads x (d_head + d_v)`` in the compute dtype; MLA: the up-projected
    per-head K and V), again in the backward of a recomputed layer, and dK, dV
    reduce-scattered in the backward (Llama 3's all-gather CP; torchtitan's context parallel).

    All-gather CP (Llama 3, Dubey et al. 2024, 3.3.2; :mod:`meshplan.runtime.execution.cp`): per
    layer in forward one all-gather of the local K and V stacked in one buffer (full buffer
    ``2 * b * s * kv_heads_local * d_head`` in compute dtype, K/V heads before the GQA repeat;
    multi-head latent attention: ``b * s * heads_local * (d_qk + d_v)``, the up-projected K and V),
    and its autograd backward, one reduce-scatter (sum) of dK and dV of the same size. Full
    recompute replays the gather (the checkpoint replays a layer up to its last saved tensor,
    which comes after the gather), so backward also has one all-gather per layer; the
    reduce-scatter stays one per layer (only the replayed graph is differentiated). Measured
    with torch 2.13 on the fake process group and gloo (``tests/test_table_vs_torch.py``,
    ``tests/test_validate_cp.py``)."""
    if c.mesh.degree("cp") <= 1:
        return
    t = c.training
    _, kv_l, _ = local_heads(c.model, c.mesh.degree("tp"))
    kv_full = t.micro_batch * t.seq_len * kv_l * (c.model.d_head + c.model.d_v) * dtype_bytes(t.compute_dtype)
    nl = len(c.layers)
    replayed = sum(t.layer_recomputed(k) for k in range(nl))  # checkpointed layers (full, torchtitan per-layer AC)
    add("cp", "forward", "all-gather", kv_full, t.compute_dtype, nl, "every layer (K and V)", "attention")
    if replayed:  # the checkpoint's replay of the forward gathers K and V again
        add("cp", "backward", "all-gather", kv_full, t.compute_dtype, replayed,
            "every layer, recomputed (K and V)" if replayed == nl else "every checkpointed layer, recomputed (K and V)",
            "recomputed attention")
    add("cp", "backward", "reduce-scatter", kv_full, t.compute_dtype, nl, "every layer (dK and dV)",
        "previous layer's backward")


CP = AxisDef(
    doc="context parallel (sequence split for attention)",
    torchtitan=("cp",), megatron=("cp",),
    rules=(Rule("seq_cp", 70, "seq_len not divisible by 2 * cp", _seq_bad, _seq),),
    divides=(Dim.SEQUENCE,),
    shards=("activations", "parameters, gradients, optimizer state (with dp_shard, as fsdp)"),
    collectives=(CollectiveKind("all-gather", "cp", "forward", "K and V of the whole sequence"),
                 CollectiveKind("all-gather", "cp", "backward", "K and V again where the layer is recomputed"),
                 CollectiveKind("reduce-scatter", "cp", "backward", "dK and dV")),
    rows=cp_rows,
    search=SearchColumn(column="cp", option="cp"),
    weights={"cp": 1e4},
)
