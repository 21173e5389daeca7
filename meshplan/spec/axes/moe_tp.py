"""An MoE layer over the dense tp group: the etp torchtitan runs (:func:`torch_etp`, its rule
:func:`torch_etp_reason`: 1 with ep > 1, tp at ep 1, as at pytorch/torchtitan b5bcd76,
:data:`TORCH_ETP`), and the forward tp collectives of one MoE layer's MLP block under each
framework (:func:`moe_mlp_tp_ops`, the one rule the collective table and the rank timeline
follow). The ep and etp axes whose rules these are: :mod:`meshplan.spec.axes.ep`.
"""

from __future__ import annotations


#: torchtitan's etp, as at pytorch/torchtitan b5bcd76 (2026-08-21), the version the rest of meshplan's
#: torch framework follows. c4b409a "[MoE][4/n] deprecate expert tensor parallel (ETP)" (#3167,
#: 2026-04-30) removed the etp mesh axis, ``ExpertTensorParallel`` and
#: ``parallelism.expert_tensor_parallel_degree``; at b5bcd76 the routed experts' placement follows
#: ``enable_ep = expert_parallel_degree > 1`` (torchtitan/models/qwen3/model.py:101-105, the same in
#: the other MoE models' ``set_*_sharding_config``):
#:
#: - ep > 1: ``ParallelDims._validate`` checks only that ep divides dp_shard * cp * tp
#:   (torchtitan/distributed/parallel_dims.py:187-192), the sparse mesh is (pp, dp_replicate,
#:   efsdp, ep) with efsdp = dp_shard * cp * tp / ep (:280-282, :326-330), the routed experts'
#:   weights are ``Shard(0)`` on ep and whole otherwise (``expert_param_placement_sparse``,
#:   torchtitan/models/common/moe_sharding.py:29-47) and the tp ranks split the tokens (experts'
#:   input ``dense_sequence_parallel_placement``, :208-218; ``_tokens_per_expert_placement`` Partial
#:   on tp, :71-86): meshplan's etp 1.
#: - ep 1 with tp > 1: the dense family, the routed experts sharded over tp like a dense MLP,
#:   w1/w3 (E, F, D) ``Shard(1)`` and w2 (E, D, F) ``Shard(2)`` (``expert_param_placement_dense``,
#:   moe_sharding.py:50-68 with ``_GROUPED_EXPERTS_PARAM_LAYOUT``, torchtitan/models/qwen3/sharding.py:31-35),
#:   every tp rank taking all the tokens (experts' input ``Replicate`` on tp, moe_sharding.py:219-226;
#:   the MoE input all-gathered from the sequence shard under SP, :286-288) and the experts' output
#:   ``Partial`` on tp, reduce-scattered under SP or all-reduced (:230-239, :289-302); FSDP2 shards
#:   them with the block over the dense fsdp mesh (torchtitan/distributed/fsdp.py:282-316): meshplan's
#:   etp = tp, efsdp = dp_shard * cp.
#:
#: Before c4b409a (from aeb3a4b, #1555, 2025-08-13) ``ParallelDims._validate`` allowed etp 1 or tp
#: (c4b409a^ parallel_dims.py:76-77), etp = tp sharding each expert over tp (``ExpertTensorParallel``,
#: c4b409a^ distributed/expert_parallel.py:81-101).
TORCH_ETP = ("torchtitan has no expert tensor parallelism since c4b409a (#3167, 2026-04-30): with ep > 1 each "
             "routed expert is whole on its ep rank and the tp ranks split the tokens (etp 1; moe_sharding.py "
             "at b5bcd76)")

#: The ep 1 half of :data:`TORCH_ETP`'s comment, in a reason.
TORCH_ETP_EP1 = ("torchtitan at ep 1 shards every routed expert over tp like a dense MLP (w1/w3 Shard(1), w2 "
                 "Shard(2), every tp rank taking all the tokens: etp = tp; expert_param_placement_dense, "
                 "moe_sharding.py at b5bcd76)")


def torch_etp(ep, tp):
    """The etp torchtitan at b5bcd76 runs (:data:`TORCH_ETP`): 1 with ep > 1, tp at ep 1. Scalars or
    arrays of degrees (the search's columns) alike.

    >>> import numpy as np
    >>> torch_etp(8, 4), torch_etp(1, 4), torch_etp(np.array([1, 2, 1]), np.array([2, 2, 1])).tolist()
    (1, 4, [2, 1, 1])
    """
    return 1 + (ep == 1) * (tp - 1)


def experts_over_tp(framework: str, etp, tp):
    """Whether an MoE layer runs torchtitan's dense family at ep 1 (:data:`TORCH_ETP`): framework
    torch with etp = tp > 1, every routed expert sharded over tp and every tp rank taking all the
    tokens. Megatron-LM's etp > 1 is planned as expert shapes only (no etp rows). Scalars, or
    arrays of degrees (the search's columns, :func:`moe_mlp_blocks_tp`) alike.

    >>> experts_over_tp("torch", 2, 2), experts_over_tp("megatron", 2, 2), experts_over_tp("torch", 1, 1)
    (True, False, False)
    """
    return (framework == "torch") & (tp > 1) & (tp == etp)


def experts_over_tp_ops(sp: bool, shared_experts: bool) -> list[str]:
    """Forward tp collectives of one MoE layer's FFN under :func:`experts_over_tp`, in issue order
    (torchtitan b5bcd76 moe_sharding.py): with SP the MoE input's all-gather (``Shard(1) ->
    Replicate``, :286-288), then the ``Partial`` outputs reduce-scattered to the sequence shard, the
    shared experts' w2 (:184-196) and the routed experts' (:230-239) apart; without SP one
    all-reduce of their summed ``Partial`` output at the MoE boundary (:289-302), as a dense MLP.
    The backward is the mirror (the input's ``Partial`` gradient all-reduced without SP).

    >>> experts_over_tp_ops(True, True), experts_over_tp_ops(True, False), experts_over_tp_ops(False, True)
    (['all-gather', 'reduce-scatter', 'reduce-scatter'], ['all-gather', 'reduce-scatter'], ['all-reduce'])
    """
    return ["all-gather"] + ["reduce-scatter"] * (1 + bool(shared_experts)) if sp else ["all-reduce"]


def moe_mlp_tp_ops(framework: str, etp: int, tp: int, sp: bool, shared_experts: bool) -> list[str]:
    """Forward collectives over the dense tp group of one MoE layer's MLP block (tp > 1), in
    issue order: the one home of the rule the collective table (``comm.tp_rows._tp_layer_ops``)
    and the rank timeline (``Workload.moe_tp_ops``) both follow; the backward is the mirror.

    - :func:`experts_over_tp` (torchtitan at ep 1): :func:`experts_over_tp_ops`.
    - Otherwise the routed experts issue nothing over tp: each rank routes its own sequence shard
      (SP), and Megatron-LM moves the tokens over other groups. NVIDIA/Megatron-LM d98e8a6
      ``megatron/core/transformer/moe/moe_layer.py`` ``MoELayer.forward`` (:614-719) runs the router
      on the ``[s/tp, b, h]`` input and gathers nothing; ``token_dispatcher.py``'s dispatchers take
      ``self.tp_group = pg_collection.expt_tp`` (:86) and ``tp_ep`` (:87): ``MoEAlltoAllTokenDispatcher``
      all-to-alls over ep, all-gathers over etp (``dispatch_postprocess``, :741-751) and
      reduce-scatters back (``combine_preprocess``, :824-833), the table's etp rows
      (``comm.ep_rows._etp_rows``); none at ep = etp = 1. Megatron-LM defaults etp to tp
      (``megatron/training/arguments.py``:587-588), so a Megatron-LM run at ep 1 without
      ``--expert-tensor-parallel-size`` gathers the tokens over etp = tp on the etp rows, never
      twice over tp. A shared expert is a dense tp MLP (``shared_experts.py`` ``SharedExpertMLP(MLP)``
      on ``pg_collection.tp``, :102-135; torchtitan's likewise): with SP its input's all-gather
      and output's reduce-scatter, without SP one all-reduce.
    - torch without SP, etp 1: the tp ranks split the replicated tokens and all-gather the routed
      outputs (:mod:`meshplan.runtime.execution.moe`), first.

    >>> moe_mlp_tp_ops("megatron", 2, 2, True, False), moe_mlp_tp_ops("megatron", 1, 2, True, True)
    ([], ['all-gather', 'reduce-scatter'])
    >>> moe_mlp_tp_ops("torch", 2, 2, True, False), moe_mlp_tp_ops("torch", 1, 2, False, True)
    (['all-gather', 'reduce-scatter'], ['all-gather', 'all-reduce'])
    """
    if experts_over_tp(framework, etp, tp):
        return experts_over_tp_ops(sp, shared_experts)
    shared = (["all-gather", "reduce-scatter"] if sp else ["all-reduce"]) if shared_experts else []
    return ([] if sp else ["all-gather"]) + shared


def moe_mlp_blocks_tp(framework: str, etp, tp, shared_experts: bool):
    """Whether an MoE layer's MLP block opens and closes with the dense tp collectives under SP
    (:func:`moe_mlp_tp_ops` non-empty): the search's columns (arrays of degrees) or scalars.

    >>> import numpy as np
    >>> moe_mlp_blocks_tp("torch", np.array([1, 2, 4]), np.array([2, 2, 4]), False).tolist()
    [False, True, True]
    """
    return experts_over_tp(framework, etp, tp) | bool(shared_experts)


def torch_etp_bad(m, t, d):
    """Framework torch with an etp other than torchtitan's (:func:`torch_etp`): etp > 1 with ep > 1
    on any model (but etp = tp where the plan targets torchtitan <= v0.2.2, which runs it:
    :attr:`~meshplan.spec.training.TrainingSpec.torchtitan_v022`), or etp other than tp at ep 1 on an MoE model."""
    ep_bad = (d.ep > 1) & (d.etp != 1) & ~(t.torchtitan_v022 & (d.etp == d.tp))
    return (t.framework == "torch") & (ep_bad | (m.is_moe & (d.ep == 1) & (d.etp != torch_etp(d.ep, d.tp))))


def torch_etp_reason(etp: int, tp: int, ep: int, where: str = "mesh.shape") -> str:
    """The ``torch_etp`` rule's reason with its fix, the field given as ``where`` (``mesh.shape``
    for a meshplan TOML).

    >>> print(torch_etp_reason(4, 4, 4))
    framework torch: etp 4 with tp 4 and ep 4: torchtitan has no expert tensor parallelism since c4b409a (#3167, 2026-04-30): with ep > 1 each routed expert is whole on its ep rank and the tp ranks split the tokens (etp 1; moe_sharding.py at b5bcd76); fix: etp 1 in mesh.shape, or training.framework = "megatron", or training.op_sac_policy = "238fa99" (torchtitan <= v0.2.2, which runs etp = tp)
    >>> print(torch_etp_reason(1, 2, 1))
    framework torch: etp 1 with tp 2 and ep 1: torchtitan at ep 1 shards every routed expert over tp like a dense MLP (w1/w3 Shard(1), w2 Shard(2), every tp rank taking all the tokens: etp = tp; expert_param_placement_dense, moe_sharding.py at b5bcd76); fix: etp 2 in mesh.shape (or leave etp out), or training.framework = "megatron"
    """
    if ep == 1:
        return (f"framework torch: etp {etp} with tp {tp} and ep 1: {TORCH_ETP_EP1}; fix: etp {tp} in {where} (or "
                "leave etp out), or training.framework = \"megatron\"")
    return (f"framework torch: etp {etp} with tp {tp} and ep {ep}: {TORCH_ETP}; fix: etp 1 in {where}, or "
            "training.framework = \"megatron\"" + (f", or training.op_sac_policy = \"238fa99\" (torchtitan <= v0.2.2, "
                                                    f"which runs etp = tp)" if etp == tp else ""))


def torch_etp_rule(m, t, d):
    return ((torch_etp_reason(d.etp, d.tp, d.ep),) if torch_etp_bad(m, t, d) else ()), ()
