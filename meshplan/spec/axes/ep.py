"""Expert parallelism (``ep``) and expert tensor parallelism (``etp``, 1 or tp): the dense
block ``dp_shard x cp x tp`` re-factored as ``(efsdp, ep, etp)`` for the routed experts
(torchtitan ParallelDims; Megatron-Core's expert decomposition). ``efsdp`` shards the
routed experts' parameters as ``fsdp`` does the dense ones.

>>> from types import SimpleNamespace as N
>>> m = N(is_moe=True, experts=8, moe_ffn=1536)
>>> [bool(EP.rules[1].bad(m, None, N(ep=e))) for e in (1, 3, 8)]
[False, True, False]
"""

from __future__ import annotations

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, Rule, SearchColumn, divisors


def _block_bad(m, t, d):
    return (d.dps * d.cp * d.tp) % (d.ep * d.etp) != 0


def _experts_bad(m, t, d):
    return (m.experts % d.ep != 0) & m.is_moe


def _experts(m, t, d):
    if d.ep > 1 and not m.is_moe:
        return (f"ep {d.ep} on a dense model ({m.name} has no experts)",), ()
    if not m.is_moe:
        return (), ()
    if _experts_bad(m, t, d):
        return (f"experts {m.experts} are not divisible by ep {d.ep}",), ()
    reasons = _token_split(t, d)
    efsdp = d.dps * d.cp * d.tp // (d.ep * d.etp)
    return reasons, (f"experts: {m.experts} / ep {d.ep} = {m.experts // d.ep} per rank; "
                     f"expert mesh efsdp {efsdp} x ep {d.ep} x etp {d.etp}",)


def _token_split(t, d) -> tuple[str, ...]:
    """The tp ranks split a micro-batch's ``b * s/cp`` tokens ``tp/etp`` ways before routing
    (:mod:`meshplan.runtime.execution.moe`): an uneven split gives the ranks different token
    counts, so ranks sizing their expert capacity from them would send all-to-alls of
    different sizes and hang; the split must be even."""
    tp, etp, cp = d.tp, d.etp, d.cp
    tok = t.micro_batch * (t.seq_len // cp)
    if tp > etp and (tok * etp) % tp:
        return (f"MoE: micro_batch x seq_len / cp = {tok} tokens do not split evenly over tp {tp} / etp "
                f"{etp} = {tp // etp} ranks before routing; the ranks would size different expert "
                "capacities and hang on mismatched all-to-all shapes",)
    return ()


def _etp_bad(m, t, d):
    return (m.moe_ffn % d.etp != 0) & m.is_moe


def _etp(m, t, d):
    return ((f"expert_ffn {m.moe_ffn} is not divisible by etp {d.etp}",) if _etp_bad(m, t, d) else ()), ()


EP = AxisDef(
    doc="expert parallel; re-factors the dense dp_shard*cp*tp block",
    expert=True,
    torchtitan=("ep",), megatron=("ep",),
    rules=(Rule("expert_block", 10, "ep * etp does not divide dp_shard * cp * tp", _block_bad,
                where="meshplan.mesh.resolve.resolve_mesh (the expert mesh)"),
           Rule("experts", 60, "experts not divisible by ep", _experts_bad, _experts)),
    divides=(Dim.EXPERTS,),
    shards=("routed experts' parameters, gradients, optimizer state (with efsdp)",),
    collectives=(CollectiveKind("all-to-all", "ep", "forward", "dispatch and combine: routed tokens x h"),
                 CollectiveKind("all-to-all", "ep", "backward", "their gradients"),
                 CollectiveKind("all-gather", "efsdp", "forward", "one MoE layer's routed experts"),
                 CollectiveKind("all-gather", "efsdp", "backward", "one MoE layer's routed experts (resharded)"),
                 CollectiveKind("reduce-scatter", "efsdp", "backward", "their gradients"),
                 CollectiveKind("all-reduce", "efsdp", "backward", "their gradients (DDP)"),
                 CollectiveKind("reduce-scatter", "efsdp", "step", "their gradients (ZeRO-1/2)"),
                 CollectiveKind("all-gather", "efsdp", "step", "their updated parameters (ZeRO-1/2)")),
    search=SearchColumn(column="ep", option="ep",
                        values=lambda cfg, row: divisors(cfg.cluster.world)),
    weights={"ep": 1e3, "efsdp": 1e2},
)

ETP = AxisDef(
    doc="expert tensor parallel (1 or tp)",
    expert=True,
    torchtitan=("etp",), megatron=("etp",),
    rules=(Rule("expert_ffn", 40, "expert_ffn not divisible by etp", _etp_bad, _etp),),
    divides=(Dim.EXPERT_FFN,),
    shards=("routed experts' parameters, gradients, optimizer state",),
    search=SearchColumn(column="etp", option="etp",
                        values=lambda cfg, row: sorted({1, row["tp"]})),
    weights={"etp": 1e5},
)
