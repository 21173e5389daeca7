"""Expert parallelism (``ep``) and expert tensor parallelism (``etp``, 1 or tp): the dense
block ``dp_shard x cp x tp`` re-factored as ``(efsdp, ep, etp)`` for the routed experts
(torchtitan ParallelDims; Megatron-Core's expert decomposition). ``efsdp`` shards the
routed experts' parameters as ``fsdp`` does the dense ones.

>>> from types import SimpleNamespace as N
>>> m = N(is_moe=True, experts=8, moe_ffn=1536)
>>> [bool(EP.rules[1].bad(m, None, N(ep=e))) for e in (1, 3, 8)]
[False, True, False]

How FSDP2 shards the routed experts over efsdp (:func:`expert_shard_dim`) is this axis's
rule too: torchtitan's, so the collective table, the search and the runtime agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, Rule, SearchColumn, divisors
from meshplan.spec.axes.moe_tp import torch_etp, torch_etp_bad, torch_etp_rule
from meshplan.spec.wording import expert_data_axis


def expert_shard_dim(experts: int, efsdp: int, ep: int) -> int:
    """Tensor dim FSDP2 shards the routed experts' weights on over efsdp: 1 when
    ``efsdp x ep > experts``, else 0 (the expert dim).

    torchtitan ``apply_fsdp`` (``torchtitan/models/llama4/infra/parallelize.py``, also used by
    DeepSeek-V3 and Qwen3): EP already cuts dim 0 to ``experts / ep`` experts per rank, and
    sharding those over more efsdp ranks than there are (FSDP2's default ``Shard(0)`` pads dim 0
    to a multiple of the shard degree) would gather padding rows, so past that point it passes
    ``shard_placement_fn`` returning ``Shard(1)``. With ep 1 it compares the data-parallel
    degree with the experts the same way (efsdp x 1). Weights (E, f, h) and (E, h, f): dim 1 is
    the expert width for w_gate/w_up and the hidden size for w_down.

    Mixtral (8 experts) at ep 8, efsdp 4: dim 1; at ep 2, efsdp 4: dim 0 (4 local experts,
    one per efsdp rank):

    >>> expert_shard_dim(8, 4, 8), expert_shard_dim(8, 4, 2), expert_shard_dim(8, 32, 1)
    (1, 0, 1)
    """
    return 1 if efsdp * ep > experts else 0


def _fsdp2(t, d):
    """True where FSDP2 shards the routed experts: sharding zero3 (FSDP2 engine) or hsdp. The
    search's candidates carry their sharding as a column (``Candidates.fsdp2``); one mesh reads
    ``training.sharding``."""
    col = getattr(d, "fsdp2", None)
    on = col if col is not None else t.sharding in ("zero3", "hsdp")
    return on & (t.zero3_engine != "deepspeed-2021")


def _uneven_dim1_bad(m, t, d):
    """Experts sharded on dim 1 (efsdp x ep > experts, :func:`expert_shard_dim`) whose dim 1
    does not split evenly over efsdp: the expert width ``expert_ffn / etp`` (w_gate, w_up) or
    the hidden size (w_down)."""
    efsdp = d.dps * d.cp * d.tp // (d.ep * d.etp)
    efsdp = efsdp + (efsdp == 0)  # ep * etp not dividing the block: the expert_block rule's
    dim1 = (efsdp * d.ep > m.experts) & (efsdp > 1)
    uneven = ((m.moe_ffn // d.etp) % efsdp != 0) | (m.hidden % efsdp != 0)
    return m.is_moe & dim1 & uneven & _fsdp2(t, d)


def _uneven_dim1(m, t, d):
    if not _uneven_dim1_bad(m, t, d):
        return (), ()
    efsdp = d.dps * d.cp * d.tp // (d.ep * d.etp)
    return (f"routed experts sharded on dim 1 (efsdp {efsdp} x ep {d.ep} > experts {m.experts}, torchtitan's "
            f"shard_placement_fn): expert_ffn {m.moe_ffn} / etp {d.etp} and hidden {m.hidden} must both divide by "
            f"efsdp {efsdp}; FSDP2 refuses uneven sharding on dim 1 (torch NotImplementedError)",), ()


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
                     f"expert mesh {expert_data_axis(t.sharding)} {efsdp} x ep {d.ep} x etp {d.etp}",)


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


def _megatron_sp_bad(m, t, d):
    """Megatron-LM trains an MoE model with tp > 1 only under sequence parallelism: MoELayer.forward
    raises ``ValueError`` when training with an attention tp group > 1 and ``sequence_parallel``
    off (``megatron/core/transformer/moe/moe_layer.py``:636-640 at NVIDIA/Megatron-LM d98e8a6; the
    YAML argument path asserts the same, ``megatron/training/yaml_arguments.py``:335-338, and
    ``ModelParallelConfig.__post_init__`` warns for ep > 1 with tp > 1,
    ``megatron/core/model_parallel_config.py``:560-565). The search's candidates run sequence
    parallel wherever tp > 1 (``Candidates.sp``), so only a given mesh breaks it."""
    return m.is_moe & (t.framework == "megatron") & (d.tp > 1) & (d.sp == 0)


def megatron_sp_reason(tp: int, ep: int) -> str:
    """The reason (with its fix) of the ``megatron_moe_sp`` rule, which ``export --to megatron``
    gives too (:func:`meshplan.plan_runtime.export_refusals`)."""
    return (f"framework megatron: MoE with tp {tp} (ep {ep}) needs sequence parallelism (Megatron-LM's MoELayer "
            "raises ValueError in training without it); fix: set [mesh] sequence_parallel = true "
            "(--sequence-parallel)")


def _megatron_sp(m, t, d):
    return ((megatron_sp_reason(d.tp, d.ep),) if _megatron_sp_bad(m, t, d) else ()), ()


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
           Rule("experts", 60, "experts not divisible by ep", _experts_bad, _experts),
           Rule("expert_dim1", 65, "experts on dim 1 (efsdp x ep > experts) not divisible by efsdp",
                _uneven_dim1_bad, _uneven_dim1),
           Rule("megatron_moe_sp", 67, "framework megatron: MoE with tp > 1 without sequence parallelism",
                _megatron_sp_bad, _megatron_sp)),
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


def etp_values(framework: str, row: Mapping[str, int], is_moe: bool = True, v022: bool = False) -> list[int]:
    """The search's etp degrees for a row of degrees ``row`` (``tp``, and ``ep`` once chosen): 1 or
    tp, and under framework torch on an MoE model only the one torchtitan at b5bcd76 runs
    (:func:`~meshplan.spec.axes.moe_tp.torch_etp`: 1 with ep > 1, tp at ep 1); ``v022``: the plan targets torchtitan <= v0.2.2
    (:attr:`~meshplan.spec.training.TrainingSpec.torchtitan_v022`), which runs 1 or tp with ep > 1.

    >>> etp_values("torch", {"tp": 4, "ep": 8}), etp_values("torch", {"tp": 4, "ep": 1}), etp_values("megatron", {"tp": 4, "ep": 8})
    ([1], [4], [1, 4])
    >>> etp_values("torch", {"tp": 4, "ep": 8}, v022=True)  # torchtitan <= v0.2.2 runs etp 1 or tp with ep > 1
    [1, 4]
    """
    if framework == "torch" and v022 and row.get("ep", 1) > 1:
        return sorted({1, row["tp"]})
    if framework == "torch" and (is_moe or row.get("ep", 1) > 1):
        return [torch_etp(row.get("ep", 1), row["tp"])]
    return sorted({1, row["tp"]})


ETP = AxisDef(
    doc="expert tensor parallel (1 or tp)",
    expert=True,
    torchtitan=("etp",), megatron=("etp",),
    rules=(Rule("expert_ffn", 40, "expert_ffn not divisible by etp", _etp_bad, _etp),
           Rule("torch_etp", 68,
                "framework torch: etp other than torchtitan's (1 with ep > 1, or tp under torchtitan <= v0.2.2; "
                "tp at ep 1 on an MoE model)",
                torch_etp_bad, torch_etp_rule)),
    divides=(Dim.EXPERT_FFN,),
    shards=("routed experts' parameters, gradients, optimizer state",),
    search=SearchColumn(column="etp", option="etp", values=lambda cfg, row: etp_values(
        cfg.training.framework, row, cfg.model.is_moe, cfg.training.torchtitan_v022)),
    weights={"etp": 1e5},
)


def ep_refusal(ep: int, experts: int, block: int, etp: int = 1) -> str:
    """Why ``ep`` is not a valid expert-parallel degree for ``experts`` routed experts on a dense
    block ``dp_shard x cp x tp`` of ``block`` ranks at expert tensor parallelism ``etp`` (the
    ``experts`` and ``expert_block`` rules above); "" where it is valid.

    >>> ep_refusal(8, 256, 64), ep_refusal(8, 12, 64), ep_refusal(8, 256, 12)
    ('', 'experts 12 are not divisible by ep 8', 'ep 8 x etp 1 does not divide the dense block dp_shard x cp x tp = 12')
    """
    if experts % ep:
        return f"experts {experts} are not divisible by ep {ep}"
    if block % (ep * etp):
        return f"ep {ep} x etp {etp} does not divide the dense block dp_shard x cp x tp = {block}"
    return ""


def ep_choices(experts: int, block: int, etp: int = 1) -> list[int]:
    """Every valid ep (:func:`ep_refusal` empty), smallest first.

    >>> ep_choices(256, 64), ep_choices(64, 32, etp=2)
    ([1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16])
    """
    return [e for e in divisors(block) if not ep_refusal(e, experts, block, etp)]


def ep_reason(experts: int, ep: int, etp: int, block: int, nodes: int, per_node: int,
              deepep: Optional[tuple[float, float, int]] = None) -> str:
    """The plan's ``axis ep:`` line: the experts per rank, why this ep (the only valid one, or one of
    :func:`ep_choices` as the config's mesh gives it, where a user or ``search --export`` put it), and
    what its all-to-alls cross: one ep group (rank 0's) on ``nodes`` nodes with ``per_node`` of its
    ranks on each: NVLink inside one node, else the NICs for the ``ep - per_node`` peers of each rank
    on other nodes (DeepSeek-V3 at ep 64 on dgx-h100: 56 of 63). Under ``training.moe_dispatcher =
    "deepep"`` (``deepep``: a token's copies across nodes and its NVLink fan-out copies, and the
    routed copies top_k, as :func:`meshplan.comm.deepep.copies` gives them; the spec layer takes the
    numbers, not the model) what the dispatch crosses instead: one copy per other destination node,
    over the ep x etp group (``nodes`` and ``per_node`` then that group's).

    >>> print(ep_reason(256, 64, 1, 64, 8, 8))
    capacity: 256 experts split 64 ways (4 per rank); ep 64 as the config's mesh gives it (chosen by the user, or a `meshplan search --export` row): valid ep 1, 2, 4, 8, 16, 32, 64 (ep divides the 256 experts and ep x etp 1 the dense block dp_shard x cp x tp = 64); its all-to-alls cross the NICs: the group spans 8 nodes, 8 ranks on each, so each rank sends to 56 of its 63 peers over the network (ep <= 8 keeps the group inside one node)
    >>> print(ep_reason(8, 8, 1, 8, 1, 8))
    capacity: 8 experts split 8 ways (1 per rank); ep 8 as the config's mesh gives it (chosen by the user, or a `meshplan search --export` row): valid ep 1, 2, 4, 8 (ep divides the 8 experts and ep x etp 1 the dense block dp_shard x cp x tp = 8); its all-to-alls stay inside one node, over NVLink
    >>> print(ep_reason(256, 64, 1, 64, 8, 8, (3.1754, 6.4394, 8)).split(" = 64); ", 1)[1])
    its deepep dispatch crosses the NICs: the group spans 8 nodes, 8 ranks on each, and a token goes once to each other node holding one of its experts: 3.18 of its 8 routed copies per token cross nodes, then 6.44 NVLink fan-out copies inside the destination nodes (meshplan.comm.deepep; ep <= 8 keeps the group inside one node)
    """
    valid = ep_choices(experts, block, etp)
    why = ("the only valid ep > 1" if [e for e in valid if e > 1] == [ep] else "as the config's mesh gives it "
           "(chosen by the user, or a `meshplan search --export` row)")
    head = (f"capacity: {experts} experts split {ep} ways ({experts // ep} per rank); ep {ep} {why}: valid ep "
            f"{', '.join(map(str, valid))} (ep divides the {experts} experts and ep x etp {etp} the dense block "
            f"dp_shard x cp x tp = {block})")
    what = "its all-to-alls" if deepep is None else "its deepep dispatch"
    if nodes <= 1:
        return f"{head}; {what} {'stay' if deepep is None else 'stays'} inside one node, over NVLink"
    span = f"the group spans {nodes} nodes, {per_node} ranks on each"
    if deepep is not None:
        across, nvlink, top_k = deepep
        return (f"{head}; {what} crosses the NICs: {span}, and a token goes once to each other node holding one of "
                f"its experts: {across:.2f} of its {top_k} routed copies per token cross nodes, then {nvlink:.2f} "
                f"NVLink fan-out copies inside the destination nodes (meshplan.comm.deepep; "
                f"{'ep x etp' if etp > 1 else 'ep'} <= {per_node} keeps the group inside one node)")
    return (f"{head}; {what} cross the NICs: {span}, so each rank sends to {ep - per_node} of its {ep - 1} peers "
            f"over the network (ep <= {per_node} keeps the group inside one node)")
