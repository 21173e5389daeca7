"""What a recompute policy replays in a layer's backward (:mod:`meshplan.compute.ops`'
conventions): a forward op re-run (:func:`replay`), the GEMMs torchtitan's op-level selective AC
saves (:func:`op_sac_kept`), the ops full AC leaves out (:func:`full_ac_not_replayed`),
torchtitan's per-layer AC as a per-layer policy (:func:`layer_workload`), and the forward kernels
Megatron-LM's selective recompute modules replay beyond the attention core (:func:`module_replays`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

from meshplan.compute import asynctp, float8, ring_attention
from meshplan.compute.elementwise import activation_elements
from meshplan.compute.kernel_time import memory_op
from meshplan.compute.ops import Cost, Op, Workload
from meshplan.compute.shapes import Gemm
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training_fields import FUSED_QKV_REVISIONS, OpSacPolicy


def replay(o: Op) -> Op:
    """Forward op ``o`` re-run in backward by recompute: ``replace(o, name=o.name + " (recompute)",
    phase="backward_input", model_flops=0.0, recompute=True)``, built directly (a layer has
    dozens, the search asks thousands of layers)."""
    return Op(name=o.name + " (recompute)", block=o.block, phase="backward_input", kind=o.kind, seconds=o.seconds,
              model_flops=0.0, hardware_flops=o.hardware_flops, size_bytes=o.size_bytes, recompute=True, note=o.note,
              steps=o.steps)


#: Forward GEMMs of a Llama layer whose outputs torchtitan's op-level selective AC saves (the
#: odd-numbered mms of a Llama block: wq, wk, wv, wo, w1 gate, w3 up, w2 down; GeLU MLP: w_up,
#: w_down): :func:`op_sac_saved_mms` of :func:`op_sac_mms`, kept by
#: :func:`meshplan.memory.op_sac.op_sac_terms`.
OP_SAC_SAVED_GEMMS = ("wq", "wv", "w_gate", "w_down")
OP_SAC_SAVED_GEMMS_GELU = ("wq", "wv", "w_up")
#: Forward kernels op-level AC does not replay beside the saved GEMMs and SDPA: async TP's
#: partial sum and the restride of wo's input belong to the fused GEMM + reduce-scatter, whose
#: output the policy saves (:func:`meshplan.compute.asynctp.restride_bytes`); the
#: float8 amaxes, whose ``aten.abs`` and ``aten.max`` outputs torchtitan's ``_save_list`` saves
#: "for low precision training" (9dec370 ``parallelisms/parallelize_llama.py``); torch CP's ring
#: merge, inside the SDPA op whose output the policy saves.
OP_SAC_NOT_REPLAYED = ("async-TP partial sum", asynctp.RESTRIDE, float8.AMAX, ring_attention.MERGE)


def full_ac_replays_whole(megatron: bool, eager: bool) -> bool:
    """Whether a fully checkpointed layer's replay re-runs its whole forward, its closing TP
    collective too: under Megatron-LM (``megatron``: ``CheckpointFunction`` re-runs the layer), and
    under torch uncompiled (``eager``): torchtitan wraps each block in ``ptd_checkpoint_wrapper``
    (non-reentrant ``torch.utils.checkpoint``) with ``early_stop=False`` since 25413d2 (#1580, for
    the MoE all-to-all): 238fa99 ``config/job_config.py`` line 675 ``early_stop: bool = False``, passed
    at ``distributed/activation_checkpoint.py`` 45, 135, 154; b5bcd76 ``activation_checkpoint.py``
    180 and 285 pass ``early_stop=False`` outright. Without early stop torch 2.13's
    ``_checkpoint_hook`` runs the recompute to its end (``utils/checkpoint.py`` 1128-1131 raise
    ``_StopRecomputationError`` only when ``target_frame.early_stop``). Compiled (torch, not
    ``eager``) AOTAutograd's min-cut partitioner keeps in the backward graph only the recomputed nodes
    the backward reads (:func:`full_ac_not_replayed`). The one rule of the layer's ops, the
    timeline (:func:`meshplan.schedule.layer_timeline.replay_scatters`) and the collective table
    (:func:`meshplan.comm.tp_rows._tp_layer_ops`)."""
    return megatron or eager


def full_ac_not_replayed(w: Workload) -> tuple[str, ...]:
    """Forward ops of a dense layer that torch's full AC does not replay, compiled: what only feeds
    the MLP's closing reduce-scatter, which the backward never needs (the block's output goes to
    the next layer, and the reduce-scatter's and the residual add's backward need no saved tensor):
    AOTAutograd's min-cut partitioner puts in the backward graph only the recomputed nodes the
    backward reads, so w_down's GEMM, async TP's partial sum after it and the scatter's layout copy
    go. Eager torch (``torch_eager``; torchtitan's ``early_stop=False``) and Megatron-LM re-run the
    whole layer (:func:`full_ac_replays_whole`): nothing is left out. The timeline leaves the
    replayed MLP's closing collective out likewise (:func:`meshplan.schedule.layer_timeline.replay_scatters`).
    (Before tt50 the eager replay was taken to stop early, after w_down: torch's default
    ``early_stop=True``, which torchtitan turned off in 25413d2.)

    >>> full_ac_not_replayed(Workload(seq_len=8, megatron_ops=True)), full_ac_not_replayed(Workload(seq_len=8, torch_eager=True))
    ((), ())
    >>> full_ac_not_replayed(Workload(seq_len=8))
    ('SP layout copy (scatter, mlp)', 'async-TP partial sum (w_down)', 'w_down')
    """
    if full_ac_replays_whole(w.megatron_ops, w.torch_eager):
        return ()
    return ("SP layout copy (scatter, mlp)", "async-TP partial sum (w_down)", "w_down")


#: The forward op of Megatron-LM's JIT'd bias-dropout-add (:func:`meshplan.compute.elementwise.elementwise_ops`).
BIAS_DROPOUT_ADD = "residual add + dropout"


def no_grad_forward(gpu: GPUSpec, w: Workload, ops: list[Op], hidden: int) -> list[Op]:
    """``ops`` as the first forward of a full-recompute layer runs them under Megatron-LM 2022
    (``w.no_grad_bda``): ``CheckpointFunction.forward`` runs the layer under ``torch.no_grad()``
    (NVIDIA/Megatron-LM 2755bcb ``megatron/mpu/random.py`` lines 310-321), and the TorchScript
    ``bias_dropout_add_fused_train`` is called without ``enable_grad`` (``model/transformer.py``
    lines 592-596: ``bias_dropout_add_exec_handler`` is ``nullcontext`` at torch >= 1.10, nvfuser),
    so no autodiff graph: nvfuser's rule for ``aten::dropout`` makes the dropout's output alone a
    fusion output, where autodiff's ``aten::native_dropout`` also outputs the mask
    (pytorch/pytorch 004700b ``torch/csrc/jit/codegen/cuda/parser.cpp``, the two parse rules'
    ``value_map.emplace``). Each :data:`BIAS_DROPOUT_ADD` forward op then writes no bool mask:
    ``row_tokens x hidden`` x 1 B fewer (in, residual and out remain). The replay in backward runs
    with grad and keeps its mask (:func:`replay` of the unchanged op); the attention's dropout is
    eager ``native_dropout`` and writes its mask either way.

    >>> from meshplan import catalog
    >>> a100 = catalog.gpu("a100-sxm-80gb")
    >>> w = Workload(seq_len=2048, micro_batch=4, tp=8, dropout=True, megatron_ops=True, no_grad_bda=True)
    >>> o = memory_op(a100, BIAS_DROPOUT_ADD, "attn_post", "forward", 7 * 8192 * 6144)
    >>> [round(x.size_bytes / 8192 / 6144) for x in no_grad_forward(a100, w, [o], 6144)]
    [6]
    """
    if not (w.no_grad_bda and w.dropout):
        return ops
    mask = w.row_tokens * hidden  # bool, 1 B an element
    return [memory_op(gpu, o.name, o.block, o.phase, o.size_bytes - mask)
            if o.phase == "forward" and o.name == BIAS_DROPOUT_ADD else o for o in ops]


def op_sac_mms(*, mla: bool, q_lora: bool, gated: bool, mlp: bool, fused_qkv: bool = False) -> tuple[str, ...]:
    """The ``aten.mm`` calls of one layer's forward in the order torchtitan's op-level SAC policy
    counts them (meshplan's GEMM names): the attention's (MLA: ``wq`` or ``wq_a, wq_b``, then
    ``wkv_a, wkv_b, wo``; else ``wq, wk, wv, wo``, or with ``fused_qkv`` ``wqkv, wo``: one mm for
    Q, K and V, as :func:`op_sac_fuses_qkv` says torchtitan b5bcd76 runs them), then the MLP's (``mlp``: a dense MLP or an MoE
    layer's shared experts; gated ``w_gate`` (w1), ``w_up`` (w3), ``w_down`` (w2), GeLU ``w_up,
    w_down``). Not counted: the MoE router's gate, which the policy force-recomputes by shape
    before counting (``per_op_sac_force_recompute_mm_shapes_by_fqns``, default
    ``["moe.router.gate"]``), and the routed experts, whose ``torch._grouped_mm`` is not an
    ``aten.mm`` (and not in the save list: recomputed). The shared experts run after the routed
    ones (``MoE.forward``), so their mms follow the attention's.

    Source: pytorch/torchtitan 238fa99 (the parent of 9810191, the last commit that reads TOML
    job configs): ``distributed/activation_checkpoint.py`` ``_apply_op_sac`` lines 99-122 (the mm
    counter restarts per checkpointed block; ``to_save = func in op_sac_save_list and not (func ==
    aten.mm and count % 2 == 0)``); ``models/deepseek_v3/model/model.py`` ``Attention.forward``
    lines 270-322 (wq or wq_a/wq_b, wkv_a, wkv_b, attention, wo); ``models/moe/moe.py``
    ``FeedForward.forward`` line 68 (``w2(silu(w1(x)) * w3(x))``) and ``MoE.forward`` lines 473-529.

    >>> op_sac_mms(mla=True, q_lora=False, gated=True, mlp=True)
    ('wq', 'wkv_a', 'wkv_b', 'wo', 'w_gate', 'w_up', 'w_down')
    >>> op_sac_mms(mla=False, q_lora=False, gated=True, mlp=False)  # Qwen3 MoE: no shared expert
    ('wq', 'wk', 'wv', 'wo')
    >>> op_sac_mms(mla=False, q_lora=False, gated=True, mlp=True, fused_qkv=True)  # Llama 3 at b5bcd76
    ('wqkv', 'wo', 'w_gate', 'w_up', 'w_down')
    """
    gqa = ("wqkv", "wo") if fused_qkv else ("wq", "wk", "wv", "wo")
    attn = ((("wq_a", "wq_b") if q_lora else ("wq",)) + ("wkv_a", "wkv_b", "wo")) if mla else gqa
    return attn + (((("w_gate",) if gated else ()) + ("w_up", "w_down")) if mlp else ())


def op_sac_saved_mms(mms: tuple[str, ...]) -> tuple[str, ...]:
    """The mms of ``mms`` (:func:`op_sac_mms`) whose outputs the policy saves: the odd-numbered
    (1st, 3rd, ...); every second one is recomputed.

    >>> op_sac_saved_mms(op_sac_mms(mla=False, q_lora=False, gated=True, mlp=True)) == OP_SAC_SAVED_GEMMS
    True
    >>> op_sac_saved_mms(op_sac_mms(mla=True, q_lora=True, gated=True, mlp=True))
    ('wq_a', 'wkv_a', 'wo', 'w_up')
    """
    return mms[0::2]


#: torchtitan's op-level SAC policies meshplan models (``training.op_sac_policy``, its one list:
#: :data:`meshplan.spec.training_fields.OpSacPolicy`): the commit each follows, and what differs
#: (:func:`op_sac_fuses_qkv`).
OP_SAC_POLICIES: tuple[str, ...] = get_args(OpSacPolicy)


def op_sac_fuses_qkv(policy: str, mla: bool) -> bool:
    """Whether the op-level SAC policy ``policy`` (:data:`OP_SAC_POLICIES`) counts Q, K and V as one
    ``aten.mm`` (``wqkv``): b5bcd76 on a layer without MLA, 238fa99 never.

    pytorch/torchtitan 238fa99 (and e347b1e, v0.2.2: the same ``_apply_op_sac`` and save lists):
    ``models/llama3/model/model.py`` and ``models/qwen3/model/model.py`` project with separate
    ``wq``, ``wk``, ``wv`` Linears; the save lists are per model (``models/llama3/infra/parallelize.py``
    lines 36-51, ``models/qwen3/infra/parallelize.py`` 39-54, ``models/deepseek_v3/infra/parallelize.py``
    33-48: ``aten.mm``, the SDPA kernels, ``reduce_scatter_tensor``, ``aten.max``, flex attention;
    deepseek_v3's also ``all_to_all_single``). b5bcd76 (``distributed/activation_checkpoint.py``):
    one save set for every model (``_get_default_save_ops`` lines 31-94: torch's
    ``compute_intensive_ops`` (``aten.mm``, ``bmm``, ``addmm``, the flash and efficient SDPA, ``_scaled_mm``:
    torch 2.13 ``_functorch/partitioners.py`` ``get_default_op_list``) plus the SDPA variants,
    ``aten.max``, flex attention, ``aten.linear``, ``topk``, ``reduce_scatter_tensor``,
    ``all_to_all_single``); ``SelectiveAC._wrap_block`` lines 243-274 keeps the rule: every second
    ``aten.mm`` (or ``aten.linear``) recomputed, the count per checkpointed block, the router's
    gate shape force-recomputed. What changes the layer's saved tensors: the llama3 and qwen3 flavors
    build ``fuse_qkv=True`` (``models/llama3/__init__.py`` 77, 131-339; ``models/qwen3/__init__.py``
    99, 144, 218-578; from 3396a4b, #3714), one ``wqkv`` Linear (``models/common/attention.py``
    ``FusedQKVLinear`` 722-810, ``GQAttention.forward`` 925), so the attention's mms are ``wqkv, wo``;
    DeepSeek's MLA is unchanged (``models/deepseek_v3/model.py`` 93-151: ``wq`` or ``wq_a, wq_b``,
    ``wkv_a, wkv_b, wo``). The rest changes nothing meshplan times: ``bmm`` and ``addmm`` (no
    torchtitan model of the catalog's calls them in a block: no Linear bias), ``topk`` (the router's,
    memory-bound), ``aten.linear`` (a leaf only on backends that do not decompose it, not CUDA).

    >>> op_sac_fuses_qkv("b5bcd76", False), op_sac_fuses_qkv("b5bcd76", True), op_sac_fuses_qkv("238fa99", False)
    (True, False, False)
    """
    return policy in FUSED_QKV_REVISIONS and not mla


def op_sac_saves_all_to_all(policy: str, mla: bool, shared: bool) -> bool:
    """Whether torchtitan's op-level SAC policy ``policy`` (:data:`OP_SAC_POLICIES`) saves the MoE
    dispatch's and combine's ``all_to_all_single`` outputs (so its recompute issues no EP all-to-all)
    for an MoE model with multi-head latent attention (``mla``) or shared experts (``shared``).
    238fa99's save lists are per model: ``models/deepseek_v3/infra/parallelize.py`` 33-48 (MLA; line 41
    ``_c10d_functional.all_to_all_single``) and ``models/llama4/infra/parallelize.py`` 51-66 (shared
    experts: ``MoEArgs.num_shared_experts`` 1, ``models/moe/moe.py`` 24; line 59) save it;
    ``models/qwen3/infra/parallelize.py`` 39-54 does not (Qwen3's MoE flavours have no shared expert,
    ``models/qwen3/__init__.py`` 137, 160, 183), so the dispatch and combine are replayed in the
    recompute. meshplan takes an MoE model without MLA or shared experts as Qwen3's (gpt_oss, whose
    list saves it, has attention sinks meshplan does not model). b5bcd76: one list for every model
    (``distributed/activation_checkpoint.py`` ``_get_default_save_ops`` 31-94, ``all_to_all_single``
    among them): saved.

    >>> [op_sac_saves_all_to_all(p, m, s) for p, m, s in (("238fa99", False, False), ("238fa99", True, False),
    ...                                                   ("238fa99", False, True), ("b5bcd76", False, False))]
    [False, True, True, True]
    """
    return policy != "238fa99" or mla or shared


def op_replays_ep(model: ModelSpec, training) -> bool:
    """Whether an MoE layer's op-level SAC replay (``training.recompute = "op"``) issues the EP
    all-to-alls again: :func:`op_sac_saves_all_to_all` false for ``model`` and the training's
    ``op_sac_policy``. The one rule of the timeline (``Workload.op_replays_ep``), the collective
    table (:func:`meshplan.comm.ep_rows.ep_rows`), the kept activations
    (:mod:`meshplan.memory.workingset`) and the search's bound (:mod:`meshplan.search.layer_chains`)."""
    return training.recompute == "op" and model.is_moe and not op_sac_saves_all_to_all(
        training.op_sac, model.is_mla, bool(model.shared_experts))


def layer_mms(model: ModelSpec, moe: bool, policy: str = "238fa99") -> tuple[str, ...]:
    """:func:`op_sac_mms` of a dense (``moe`` False) or MoE layer of ``model`` under op-level SAC
    policy ``policy`` (:func:`op_sac_fuses_qkv`)."""
    return op_sac_mms(mla=model.is_mla, q_lora=model.q_lora_rank is not None, gated=model.gated_mlp,
                      mlp=not moe or bool(model.shared_experts), fused_qkv=op_sac_fuses_qkv(policy, model.is_mla))


def op_sac_replayed(model: ModelSpec, moe: bool, policy: str = "238fa99") -> dict[str, float]:
    """The share of each forward GEMM (meshplan's names, :func:`meshplan.compute.shapes.layer_gemms`)
    that torchtitan's op-level selective AC (``policy``: :data:`OP_SAC_POLICIES`) replays in
    backward: 0 for a saved mm, 1 for a recomputed one; an MoE layer's shared experts run as one
    fused gate-and-up GEMM here (``shared_w_up``, twice the width), half of which replays where one
    of w1 and w3 is saved; b5bcd76's fused ``wqkv`` stands for meshplan's ``wq``, ``wk``, ``wv``.
    GEMMs not listed (the router, the routed experts) replay whole.

    DeepSeek-V2-Lite (MLA without a query latent, 2 shared experts): wq, wkv_b, w1 and w2 saved:

    >>> from meshplan import catalog
    >>> op_sac_replayed(catalog.model("deepseek-v2-lite"), True)
    {'wq': 0.0, 'wkv_a': 1.0, 'wkv_b': 0.0, 'wo': 1.0, 'shared_w_up': 0.5, 'shared_w_down': 0.0}

    Llama 3 8B: 238fa99 replays wk, wo, w3 (up); b5bcd76's mms wqkv, wo, w1, w3, w2 replay wo and w3:

    >>> [n for n, r in op_sac_replayed(catalog.model("llama3-8b"), False, "b5bcd76").items() if r]
    ['wo', 'w_up']
    """
    mms = layer_mms(model, moe, policy)
    saved = set(op_sac_saved_mms(mms))
    out = {n: 0.0 if n in saved else 1.0 for n in mms}
    if "wqkv" in out:
        out.update(dict.fromkeys(("wq", "wk", "wv"), out.pop("wqkv")))
    if moe and "w_up" in out:
        out["shared_w_up"] = sum(out.pop(n) for n in ("w_gate", "w_up") if n in out) / (2 if model.gated_mlp else 1)
        out["shared_w_down"] = out.pop("w_down")
    return out


def op_sac_kept(model: ModelSpec, policy: str = "238fa99") -> tuple[str, ...]:
    """Forward GEMMs of a dense layer whose outputs torchtitan's op-level selective AC saves, so
    its recompute skips them (:func:`op_sac_replayed`); the attention kernel is saved too."""
    return op_sac_saved_mms(layer_mms(model, False, policy))


def layer_workload(w: Workload, checkpointed: bool) -> Workload:
    """The workload of one layer under a per-layer recompute
    (:meth:`~meshplan.spec.training.TrainingSpec.layer_recomputed`): torchtitan's per-layer AC
    (``recompute = "layer"``) or Megatron-LM's block recompute (``full`` with
    ``recompute_num_layers``, where ``checkpointed`` is false past the chunk's first n layers):
    ``full`` for a checkpointed layer, ``none`` otherwise; other policies unchanged (under
    ``full`` every layer is ``checkpointed``).

    >>> from meshplan.compute.ops import Workload
    >>> [layer_workload(Workload(seq_len=8, recompute=r), k).recompute for r, k in (("layer", True), ("full", False), ("op", False))]
    ['full', 'none', 'op']
    """
    if w.recompute in ("layer", "full"):
        return replace(w, recompute="full" if checkpointed else "none")
    return w


#: Forward ops of ``mla_up_proj``'s function (multi_latent_attention.py 850-980 at NVIDIA/Megatron-LM
#: d98e8a6, ``qkv_up_proj_and_rope_apply``): the q up-projection (``linear_q_up_proj``, or
#: ``linear_q_proj`` without a query latent: ``wq``), the kv up-projection, each with its fused
#: latent norm (``TELayerNormColumnParallelLinear`` under ``--qk-layernorm``), and RoPE.
MLA_UP_PROJ = ("wq_b", "wq", "wkv_b", "q_a norm", "kv_a norm", "rope")
#: The forward activation kernels of an MLP (:func:`meshplan.compute.elementwise.elementwise_ops`).
ACTIVATIONS = ("silu x up", "silu", "gelu")


def module_replays(gpu: GPUSpec, model: ModelSpec, gemms: list[Gemm], ops: list[Op], parts: frozenset) -> list[Op]:
    """The forward ops of one layer (``ops``, its forward and backward; ``gemms`` its forward
    GEMMs) that Megatron-LM's selective recompute ``parts`` (:func:`meshplan.spec.recompute_modules.layer_parts`)
    replay in backward, as :func:`replay` ops, beyond the attention core's (``core_attn``,
    :func:`meshplan.compute.layer.layer_costs`): ``attn_norm``, ``mlp_norm`` the norm;
    ``mla_up_proj`` :data:`MLA_UP_PROJ`; ``mlp`` the dense MLP's forward with its fused norm
    (Transformer Engine's ``linear_fc1``); ``moe`` the MoE block's whole forward (router,
    permutations, routed and shared experts); ``shared_experts`` the shared experts' GEMMs and
    their share of the activation; ``moe_act`` the routed experts' share of the activation (shares
    by :func:`~meshplan.compute.elementwise.activation_elements`). Inside ``moe``, ``shared_experts``
    and ``moe_act`` replay once more (their checkpoints run again in ``moe``'s replay:
    :mod:`meshplan.spec.recompute_modules`). The replayed modules' tensor-parallel and expert
    collectives (the MLP's all-gather and reduce-scatter, ``moe``'s dispatch and combine) are the
    collective table's (:func:`meshplan.spec.recompute_modules.replayed_tp_ops`), issued around
    these ops by the timeline (:func:`meshplan.schedule.layer_timeline.module_replay`, with
    :func:`shared_replay_seconds`).

    >>> from meshplan import catalog
    >>> from meshplan.compute.layer import layer_cost
    >>> w = Workload(seq_len=4096, recompute_modules=("core_attn", "mlp"), framework="megatron", megatron_ops=True)
    >>> c = layer_cost(catalog.model("llama3-8b"), catalog.gpu("h100-sxm5-80gb"), w)
    >>> [o.name for o in c.ops if o.recompute and o.block != "attn"]
    ['mlp norm (recompute)', 'w_gate (recompute)', 'w_up (recompute)', 'w_down (recompute)', 'silu x up (recompute)']
    """
    fwd = [o for o in ops if o.phase == "forward" and not o.recompute]
    out = [o for o in fwd if (o.name == "attn norm" and "attn_norm" in parts) or (
        o.name == "mlp norm" and ("mlp_norm" in parts or "mlp" in parts)) or (
        o.name in MLA_UP_PROJ and "mla_up_proj" in parts) or (o.block == "mlp" and parts & {"mlp", "moe"})]
    act = activation_elements(model, gemms)
    total = sum(act.values())
    for part, share in (("shared_experts", "shared_w_up"), ("moe_act", "expert_w_up")):
        if part not in parts or not total:
            continue
        out += [o for o in fwd if part == "shared_experts" and o.name.startswith("shared_") and o.kind == "gemm"]
        out += [memory_op(gpu, f"{o.name} ({part})", o.block, "forward", o.size_bytes * act.get(share, 0.0) / total)
                for o in fwd if o.name in ACTIVATIONS and act.get(share)]
    return [replay(o) for o in out]


def shared_replay_seconds(c: Cost) -> float:
    """Seconds of one replay of the shared experts under ``shared_experts`` (:func:`module_replays`'
    ops, among the layer cost ``c``'s): their GEMMs once each (a ``moe`` replay runs them once more, counted
    with the MoE block's) and their share of the activation (``(shared_experts)``); 0 without
    shared experts. DeepSeek-V2-Lite's (2 shared experts, s 4096, tp 2 + SP, H100 catalog kernels):
    shared_w_up 68.96 + shared_w_down 36.96 + its activation share 11.65 = 117.57 us, once though ``moe`` lists
    the GEMMs twice:

    >>> from meshplan import catalog
    >>> from meshplan.compute.layer import layer_cost
    >>> w = Workload(seq_len=4096, tp=2, sp=True, recompute="selective", framework="megatron",
    ...              megatron_ops=True, recompute_modules=("core_attn", "moe", "shared_experts"))
    >>> c = layer_cost(catalog.model("deepseek-v2-lite"), catalog.gpu("h100-sxm5-80gb"), w, layer=5)
    >>> round(shared_replay_seconds(c) * 1e6, 1)
    117.6
    """
    gemms = {o.name: o.seconds for o in c.ops if o.recompute and o.kind == "gemm" and o.name.startswith("shared_")}
    return sum(gemms.values()) + sum(o.seconds for o in c.ops if o.recompute and "(shared_experts)" in o.name)
