"""Context parallelism (``cp``): each sequence split over cp ranks as 2 load-balanced chunks;
K and V exchanged over cp in every attention layer, by torch's ring attention (its K/V
all-gathered or, ``training.cp_rotate = "alltoall"``, shifted rank to rank: :func:`ring_rows`),
Transformer Engine's p2p ring (Megatron-LM's) or Llama 3's all-gather CP (``training.cp_attention``,
:func:`cp_rows`).

>>> from types import SimpleNamespace as N
>>> t = N(seq_len=8192)
>>> CP.rules[0].check(None, t, N(cp=4))[1]
('cp 4: each rank holds 2048 tokens per sequence as 2 chunks of 1024 (load-balanced causal split)',)
>>> CP.rules[0].check(None, N(seq_len=100), N(cp=8))[0]
('seq_len 100 is not divisible by 2 * cp (16) for load-balanced causal CP',)
"""

from __future__ import annotations

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, Rule, SearchColumn
from meshplan.spec.axes.tp import local_heads, sdpa_kv_heads
from meshplan.spec.training_fields import CP_FLEX_REVISIONS
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


def _te_backend_bad(m, t, d):
    """Megatron-LM runs context parallelism only inside Transformer Engine's attention with its
    flash or fused backend (``flash_attention`` true): Megatron-Core's own DotProductAttention
    (``--attention-backend local``) asserts ``context_parallel_size == 1`` ("Context parallelism
    is only supported by TEDotProductAttention!", ``megatron/core/transformer/dot_product_attention.py``:57-59
    at NVIDIA/Megatron-LM d98e8a6), and Transformer Engine's ``get_attention_backend`` disables
    UnfusedDotProductAttention under CP (``dot_product_attention/utils.py``:1169-1173 at
    NVIDIA/TransformerEngine d0067d0), which leaves ``--attention-backend unfused`` no backend."""
    return (d.cp > 1) & (t.framework == "megatron") & (not t.flash_attention)


def megatron_cp_attention_reason(cp: int) -> str:
    """The reason (with its fix) of the ``megatron_cp_attention`` rule (:func:`_te_backend_bad`),
    which ``export --to megatron`` gives too (:func:`meshplan.plan_runtime.export_refusals`)."""
    return (f"framework megatron: cp {cp} runs only in Transformer Engine's flash or fused attention (Megatron-Core's "
            "local attention asserts cp 1, TE's unfused backend refuses CP); fix: set training.flash_attention = true "
            "(--attention-backend flash, fused or auto) or cp 1")


def _te_backend(m, t, d):
    return ((megatron_cp_attention_reason(d.cp),) if _te_backend_bad(m, t, d) else ()), ()


def _flex_bad(m, t, d):
    """torchtitan at a revision of :data:`~meshplan.spec.training_fields.CP_FLEX_REVISIONS` (named by
    ``training.op_sac_policy`` under framework torch) runs CP only under flex attention; meshplan plans
    torch's CP as the SDPA ring (:func:`torch_cp_flex_reason`)."""
    return (d.cp > 1) & (t.framework == "torch") & (t.op_sac_policy in CP_FLEX_REVISIONS)


def torch_cp_flex_reason(cp: int, revision: str) -> str:
    """The reason (with its fix) of rule ``torch_cp_flex`` (:func:`_flex_bad`), in torchtitan's words
    (pytorch/torchtitan b5bcd76 ``models/common/decoder.py`` 173-183, ``Decoder.Config.update_from_config``)."""
    return (f"framework torch at torchtitan {revision} (training.op_sac_policy): cp {cp} needs flex attention, which "
            "meshplan does not plan (its torch CP is the SDPA ring): \"Context Parallel is not supported with "
            "ScaledDotProductAttention or VarlenAttention. Use FlexAttention or disable CP.\" (models/common/"
            f"decoder.py:173-183 at {revision}); fix: cp 1, or training.op_sac_policy = \"238fa99\" (torchtitan "
            "<= v0.2.2, whose CP runs SDPA)")


def _flex(m, t, d):
    return ((torch_cp_flex_reason(d.cp, t.op_sac_policy),) if _flex_bad(m, t, d) else ()), ()


def kv_elements(model, micro_batch, seq_len, heads):
    """Elements of the whole sequence's K and V at ``heads`` local heads, ``b x s x heads x
    (d_head + d_v)`` (scalars or numpy arrays alike): the one size of every cp row
    (:func:`cp_rows`) and of the search's bound (:mod:`meshplan.search.comm_bounds`)."""
    return micro_batch * seq_len * heads * (model.d_head + model.d_v)


def ring_shift_bytes(kv_elems, cp):
    """Bytes of one of torch's ring dK/dV shifts (:func:`ring_rows`): the fp32 dK and dV of the
    rank's ``1/cp`` of the sequence, ``kv_elems`` (:func:`kv_elements` at the heads the SDPA reads,
    :func:`~meshplan.spec.axes.tp.sdpa_kv_heads`) ``// cp x 4 B``;
    scalars or numpy arrays alike (the table's row, the search's bound).

    >>> ring_shift_bytes(4096, 4)
    4096
    """
    return kv_elems // cp * dtype_bytes("fp32")


def cp_rows(add, c) -> None:
    """The cp rows of one stage's collective table (:data:`~meshplan.spec.axes.base.RowBuilder`),
    torch's ring attention (:func:`ring_rows`) where ``training.cp_ring``
    (:attr:`~meshplan.spec.training.TrainingSpec.cp_ring`), else all-gather CP: per layer, K and V
    of the whole sequence all-gathered in the forward
    (``b x s x local KV heads x (d_head + d_v)`` in the compute dtype; MLA: the up-projected
    per-head K and V), again in the backward of a recomputed layer, and dK, dV
    reduce-scattered in the backward (Llama 3's all-gather CP, meshplan's runtime).

    All-gather CP (Llama 3, Dubey et al. 2024, 3.3.2; :mod:`meshplan.runtime.execution.cp`): per
    layer in forward one all-gather of the local K and V stacked in one buffer (full buffer
    ``2 * b * s * kv_heads_local * d_head`` in compute dtype, K/V heads before the GQA repeat;
    multi-head latent attention: ``b * s * heads_local * (d_qk + d_v)``, the up-projected K and V),
    and its autograd backward, one reduce-scatter (sum) of dK and dV of the same size. Full
    recompute replays the gather (the checkpoint replays a layer up to its last saved tensor,
    which comes after the gather), so backward also has one all-gather per layer; the
    reduce-scatter stays one per layer (only the replayed graph is differentiated). Measured
    with torch 2.13 on the fake process group and gloo (``tests/test_table_vs_torch.py``,
    ``tests/test_validate_cp.py``). Megatron-LM's ``--cp-comm-type all_gather``
    (``cp_attention = "allgather"``) has these rows; its default, Transformer Engine's p2p ring,
    :func:`p2p_rows`. Under Megatron-LM the gather is Transformer Engine's, inside the attention
    function (``AttnFuncWithCPAndKVAllGather``, NVIDIA/TransformerEngine d0067d0
    ``dot_product_attention/context_parallel.py``): its forward saves the local K and V
    (``f16_tensors = (q, k, v, out_f16)``) and its backward gathers them again
    (``gather_along_first_dim`` of k and v) before reduce-scattering dK and dV, so backward has one
    more all-gather per layer; and selective recompute, which checkpoints ``core_attention``,
    replays the forward's gather too (:func:`_core_replayed`). meshplan's runtime gathers before the
    core, outside what its selective recompute replays."""
    if c.mesh.degree("cp") <= 1:
        return
    if c.training.cp_ring:
        ring_rows(add, c)
        return
    if c.training.cp_p2p:
        p2p_rows(add, c)
        return
    t = c.training
    _, kv_l, _ = local_heads(c.model, c.mesh.degree("tp"))
    kv_full = kv_elements(c.model, t.micro_batch, t.seq_len, kv_l) * dtype_bytes(t.compute_dtype)
    nl, replayed = len(c.layers), _core_replayed(c) if t.framework == "megatron" else _replayed(c)
    add("cp", "forward", "all-gather", kv_full, t.compute_dtype, nl, "every layer (K and V)", "attention")
    if replayed:  # the checkpoint's replay of the forward gathers K and V again
        add("cp", "backward", "all-gather", kv_full, t.compute_dtype, replayed, _replay_cadence(replayed, nl),
            "recomputed attention")
    if t.framework == "megatron":  # TE's AttnFuncWithCPAndKVAllGather saves the local K/V and gathers them again
        add("cp", "backward", "all-gather", kv_full, t.compute_dtype, nl,
            "every layer, again in Transformer Engine's backward (K and V)", "the attention backward")
    add("cp", "backward", "reduce-scatter", kv_full, t.compute_dtype, nl, "every layer (dK and dV)",
        "previous layer's backward")


def _replayed(c) -> int:
    """The stage's checkpointed layers (full, torchtitan's per-layer AC, Megatron-LM's block recompute:
    :meth:`~meshplan.comm.stage_context.StageContext.layer_recomputed`), whose replay gathers K and V again."""
    return sum(c.layer_recomputed(k) for k in range(len(c.layers)))


def _core_replayed(c) -> int:
    """The stage's layers whose backward replays Megatron-LM's core attention, with the CP
    exchange Transformer Engine runs inside it (:func:`p2p_rows`, all-gather CP under Megatron-LM):
    every layer under selective recompute (Megatron-LM's default ``--recompute-modules
    core_attn``: attention.py ``_checkpointed_attention_forward``), else the checkpointed ones
    (:func:`_replayed`)."""
    return len(c.layers) if c.training.recompute == "selective" else _replayed(c)


def _replay_cadence(replayed: int, nl: int) -> str:
    return "every layer, recomputed (K and V)" if replayed == nl else "every checkpointed layer, recomputed (K and V)"


def ring_rows(add, c) -> None:
    """torch's ring attention rows (``training.cp_ring``), read in torch 2.13
    ``distributed/tensor/experimental/_context_parallel/_attention.py`` with ``_cp_options``'
    defaults (``convert_to_f32`` True, load balance on, ``rotate_method`` ALL_GATHER: torchtitan's
    ``context_parallel_rotate_method`` default "allgather"). K and V are the SDPA's, at the local
    heads it reads (:func:`~meshplan.spec.axes.tp.sdpa_kv_heads` of ``[memory] kv_expanded``,
    ``c.kv_expanded``): the KV heads by default (torchtitan ff0829c, v0.2.2, and later pass
    ``enable_gqa=True`` to SDPA, no ``repeat_kv``: e347b1e ``models/llama3/model/model.py``:201, 275,
    295; the ring's K/V are the SDPA's own arguments), the q heads with ``kv_expanded`` (torchtitan's
    ``repeat_kv`` before SDPA until then). ``S = b x s x those heads x (d_head + d_v)`` elements,
    the whole sequence's K and V; Llama-3-70B at tp 8, 128k tokens, micro-batch 1, bf16:
    ``131072 x 1 x 256 x 2`` = 67,108,864 B at its 1 local KV head, 8x that at its 8 q heads.
    Per layer and micro-batch:

    - forward, one all-gather of ``S`` in the compute dtype: ``_templated_ring_attention`` step 0
      calls ``rotater.exchange_buffers`` (``_AllGatherRotater``: one ``all_gather_single`` of the
      concatenated local K and V) before the first SDPA call and waits for it
      (``next_buffer``) at step 1, before the second: it runs beside the first (causal, local) call;
    - backward, one more all-gather of ``S`` (``_templated_ring_attention_backward``'s own
      ``kv_rotater``, whatever the recompute), likewise beside the first SDPA backward call, and
      one more of a checkpointed layer's replayed forward;
    - backward, ``cp`` shifts of the fp32 dK and dV accumulators (``dkv_rotater``,
      ``_AllToAllRotater``: ``permute_tensor`` to rank + 1, an ``all_to_all_single`` in which each
      rank sends its whole buffer to one peer, nccl-tests' ``sendrecv_perf`` pattern: a
      send/recv of ``4 S / cp`` bytes, the local ``b x s/cp`` tokens' dK and dV in fp32,
      ``accum_dtype``), one at the end of every step ``i`` of ``range(cp)``, each waited for at the
      next step after its SDPA backward call, the last after the loop, before the gradients
      return: exposed.

    Under ``training.cp_rotate = "alltoall"`` (``rotate_method`` ALL_TO_ALL) no all-gather runs:
    the K/V move as ``cp - 1`` shifts of the local ``S / cp`` a pass (:func:`alltoall_kv_rows`)."""
    t, nl, cp = c.training, len(c.layers), c.mesh.degree("cp")
    q_l, kv_l, _ = local_heads(c.model, c.mesh.degree("tp"))
    elems = kv_elements(c.model, t.micro_batch, t.seq_len, sdpa_kv_heads(q_l, kv_l, c.kv_expanded))
    kv, replayed = elems * dtype_bytes(t.compute_dtype), _replayed(c)
    if t.cp_rotate == "alltoall":
        alltoall_kv_rows(add, c, kv // cp, replayed)
    else:
        _allgather_kv_rows(add, c, kv, replayed)
    shift = ring_shift_bytes(elems, cp)
    add("cp", "backward", "send/recv", shift, "fp32", nl * (cp - 1),
        f"every layer, {cp - 1} of its {cp} ring shifts, fp32 (dK and dV)", "the next SDPA backward call (beside it)")
    add("cp", "backward", "send/recv", shift, "fp32", nl, "every layer, its last ring shift, fp32 (dK and dV)",
        "the attention backward's end (exposed)")


def _allgather_kv_rows(add, c, kv: int, replayed: int) -> None:
    """torch's ring K/V rows under ``rotate_method`` ALL_GATHER (:func:`ring_rows`): ``kv`` bytes gathered."""
    t, nl = c.training, len(c.layers)
    add("cp", "forward", "all-gather", kv, t.compute_dtype, nl, "every layer, torch ring attention (K and V)",
        "the second SDPA call (beside the first)")
    add("cp", "backward", "all-gather", kv, t.compute_dtype, nl, "every layer, ring backward's own gather (K and V)",
        "the second SDPA backward call (beside the first)")
    if replayed:
        add("cp", "backward", "all-gather", kv, t.compute_dtype, replayed, _replay_cadence(replayed, nl),
            "the replayed second SDPA call")


#: Cadence mark of torch's ring K/V shifts under ``rotate_method`` ALL_TO_ALL (:func:`alltoall_kv_rows`),
#: kept apart from the fp32 dK/dV shifts by the rank timeline (a row group of their own).
A2A_KV = "all-to-all rotation (K and V)"


def alltoall_kv_rows(add, c, local: int, replayed: int) -> None:
    """torch's ring K/V rows under ``training.cp_rotate = "alltoall"`` (torchtitan's
    ``parallelism.context_parallel_rotate_method = "alltoall"``, pytorch/torchtitan v0.2.2
    73a0e69 ``config/job_config.py``:446, passed to ``set_rotate_method`` in
    ``distributed/utils.py``:205-216), read in torch 2.13 (cf30153)
    ``distributed/tensor/experimental/_context_parallel/_attention.py``: ``_AllToAllRotater``
    (lines 253-270: ``permute_tensor`` of the buffer to ``dsts = [1, ..., cp - 1, 0]``, rank + 1,
    an ``all_to_all_single`` in which each rank sends its whole buffer to one peer, a send/recv),
    created for the K/V by ``_create_rotater`` (lines 303-314) in both passes; ``local`` bytes each:
    the rank's own ``s / cp`` tokens' K and V at the same heads as the all-gather's (:func:`ring_rows`),
    in the compute dtype. Per layer and micro-batch:

    - forward (``_templated_ring_attention``, lines 427-441): at step ``i < cp - 1`` the current
      K/V concatenated and sent before the step's SDPA call, waited for (``next_buffer``) at step
      ``i + 1`` before that step's call: ``cp - 1`` shifts, each beside one call;
    - backward (``_templated_ring_attention_backward``, lines 519-534): ``kv_rotater`` the same,
      ``cp - 1`` shifts each beside one SDPA backward call, on the cp stream with the fp32 dK/dV
      shifts (``dkv_rotater``, ALL_TO_ALL whatever the method: :func:`ring_rows`' last rows);
    - a checkpointed layer's replayed forward: ``cp - 1`` more."""
    t, nl, cp, d = c.training, len(c.layers), c.mesh.degree("cp"), c.training.compute_dtype
    add("cp", "forward", "send/recv", local, d, nl * (cp - 1), f"every layer, {cp - 1} of its {cp} ring steps, "
        + A2A_KV, "the next SDPA call (beside the step's own)")
    add("cp", "backward", "send/recv", local, d, nl * (cp - 1), f"every layer, {cp - 1} of its {cp} ring backward "
        "steps, " + A2A_KV, "the next SDPA backward call (beside the step's own)")
    if replayed:
        which = "every layer" if replayed == nl else "every checkpointed layer"
        add("cp", "backward", "send/recv", local, d, replayed * (cp - 1), f"{which}, recomputed, {cp - 1} ring steps, "
            + A2A_KV, "the replayed next SDPA call")


#: Cadence mark of Transformer Engine's p2p backward steps that send K, V, dK and dV in one buffer
#: (:func:`p2p_rows`): twice the size of its other sends, kept apart by the rank timeline.
P2P_PACKED = "(K, V, dK and dV)"
#: Cadence mark of Transformer Engine's p2p backward steps (:func:`p2p_rows`), whose ring runs the
#: other way round (:func:`send_step`).
P2P_BACKWARD = "backward p2p ring step"


def send_step(row) -> int:
    """Which neighbour round the cp ring each rank of a cp send/recv ``row`` sends to: ``-1``
    (rank - 1) for Transformer Engine's p2p backward steps (:data:`P2P_BACKWARD`:
    ``AttnFuncWithCPAndKVP2P.backward`` sets ``send_dst = cp_global_ranks[(rank - 1) % cp_size ...]``
    and ``recv_src`` rank + 1, d0067d0 lines 2229-2230), ``+1`` otherwise: TE's forward and a
    replayed forward (lines 1418-1419), torch's dK/dV shifts (``_AllToAllRotater``'s ``dsts``
    ``[1, ..., cp - 1, 0]``).

    >>> from types import SimpleNamespace as N
    >>> send_step(N(cadence="every layer, the last " + P2P_BACKWARD + " (dK and dV)")), send_step(N(cadence="x"))
    (-1, 1)
    """
    return -1 if P2P_BACKWARD in row.cadence else 1


def p2p_rows(add, c) -> None:
    """Transformer Engine's p2p ring rows (``training.cp_p2p``: Megatron-LM's default
    ``--cp-comm-type p2p``), read in NVIDIA/TransformerEngine d0067d0
    ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``
    ``AttnFuncWithCPAndKVP2P`` (fp8 attention off; forward lines 1690-1715, backward 2397-2401 and
    2459-2495, 2717). K and V are the attention's inputs at the KV
    heads (Megatron-LM passes ``num_query_groups`` per tp rank; TE's flash and fused backends take
    them as they are, no GQA repeat), the rank's own ``s / cp`` tokens: ``KV = b x s/cp x local KV
    heads x (d_head + d_v)`` elements in the compute dtype (``fwd_nominal_dtype = q.dtype``),
    concatenated into one buffer (``torch.cat((k.view(-1), v.view(-1)))``). Each forward send/recv goes
    to rank + 1 and comes from rank - 1 (``flash_attn_p2p_communicate``, isend/irecv; lines 1418-1419),
    each backward one the other way round (lines 2229-2230, :func:`send_step`). Per layer and
    micro-batch:

    - forward, ``cp`` steps; at step ``i < cp - 1`` the current K/V buffer is sent before the
      step's attention call and waited for at step ``i + 1`` (``send_recv_reqs[(i + 1) % 2]``):
      ``cp - 1`` send/recv of ``KV``, each beside one call;
    - backward, ``cp`` steps, each send issued before the step's attention backward call and
      waited for after it (``wait until dKV is received``): step 0 sends K and V (``KV``), steps 1 to
      ``cp - 2`` the K and V with the dK and dV accumulated so far in one buffer of
      ``(2, *kv.shape)``, ``kv.dtype`` (``2 KV``), the last step the dK and dV alone (``KV``): ``2
      (cp - 1) KV`` bytes in ``cp`` calls, nothing after the loop;
    - a replayed core attention (Megatron-LM's selective recompute checkpoints
      ``core_attention``, attention.py ``_checkpointed_attention_forward``; full recompute the whole
      layer) runs the forward again in backward: ``cp - 1`` more sends of ``KV``."""
    t, nl, cp = c.training, len(c.layers), c.mesh.degree("cp")
    _, kv_l, _ = local_heads(c.model, c.mesh.degree("tp"))
    kv = kv_elements(c.model, t.micro_batch, t.seq_len // cp, kv_l) * dtype_bytes(t.compute_dtype)
    d, replayed = t.compute_dtype, _core_replayed(c)
    add("cp", "forward", "send/recv", kv, d, nl * (cp - 1), f"every layer, {cp - 1} of its {cp} p2p ring steps "
        "(K and V)", "the step's attention call (beside it)")
    if replayed:
        which = "every layer" if replayed == nl else "every checkpointed layer"
        add("cp", "backward", "send/recv", kv, d, replayed * (cp - 1),
            f"{which}, recomputed, {cp - 1} p2p ring step{'s' * (cp > 2)} (K and V)", "the replayed step's attention call")
    add("cp", "backward", "send/recv", kv, d, nl, f"every layer, the first {P2P_BACKWARD} (K and V)",
        "the step's attention backward call (beside it)")
    if cp > 2:
        add("cp", "backward", "send/recv", 2 * kv, d, nl * (cp - 2), f"every layer, {cp - 2} middle {P2P_BACKWARD}s "
            + P2P_PACKED, "the step's attention backward call (beside it)")
    add("cp", "backward", "send/recv", kv, d, nl, f"every layer, the last {P2P_BACKWARD} (dK and dV)",
        "the step's attention backward call (beside it)")


CP = AxisDef(
    doc="context parallel (sequence split for attention)",
    torchtitan=("cp",), megatron=("cp",),
    rules=(Rule("seq_cp", 70, "seq_len not divisible by 2 * cp", _seq_bad, _seq),
           Rule("megatron_cp_attention", 72, "framework megatron: cp > 1 without flash or fused attention",
                _te_backend_bad, _te_backend),
           Rule("torch_cp_flex", 73, "framework torch at torchtitan b5bcd76: cp > 1 without flex attention",
                _flex_bad, _flex)),
    divides=(Dim.SEQUENCE,),
    shards=("activations", "parameters, gradients, optimizer state (with dp_shard, as fsdp)"),
    collectives=(CollectiveKind("all-gather", "cp", "forward", "K and V of the whole sequence (p2p ring and the "
                                "all-to-all rotation: none)"),
                 CollectiveKind("send/recv", "cp", "forward", "K and V to the next rank, cp - 1 times (Transformer "
                                "Engine's p2p ring; torch's ring with cp_rotate \"alltoall\")"),
                 CollectiveKind("all-gather", "cp", "backward", "K and V again where the layer is recomputed (ring: "
                                "and in every backward)"),
                 CollectiveKind("reduce-scatter", "cp", "backward", "dK and dV (all-gather CP)"),
                 CollectiveKind("send/recv", "cp", "backward", "fp32 dK and dV shifted cp times round the ring "
                                "(torch's ring attention); K, V, dK and dV cp times (the p2p ring)")),
    rows=cp_rows,
    search=SearchColumn(column="cp", option="cp"),
    weights={"cp": 1e4},
)
