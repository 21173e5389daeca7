"""The kernels a training contract's framework chooses, as :class:`~meshplan.compute.ops.Workload`
fields: Megatron-LM's fused QKV, gradient-accumulation fusion and own kernels, torch's eager
elementwise ops and decomposed norms, each framework's fused attention (:data:`SDPA_KERNELS`,
:data:`MDS_KERNELS`) and context-parallel ring (:func:`framework_kernels`), and the Linears that run
in float8 (:func:`float8_gemms`). One rule for the step model and the search's bound.
"""

from __future__ import annotations

from functools import lru_cache

from meshplan.spec.model import ModelSpec
from meshplan.spec.wording import DEEPSPEED, zero_runtime


def framework_kernels(training) -> dict:
    """The :class:`~meshplan.compute.ops.Workload` fields a training contract's framework sets (``training``: a
    :class:`~meshplan.spec.training.TrainingSpec`): Megatron-LM projects Q, K and V with one
    GEMM (``fused_qkv``) and, with fp32 gradients, accumulates weight gradients into them
    inside the GEMM (``fp32_wgrad_accumulation``: its ``gradient_accumulation_fusion``, on by
    default); torch does neither, but torchtitan b5bcd76's llama3 and qwen3 flavors project Q, K and V
    with one ``wqkv`` Linear (``fused_qkv``: :attr:`~meshplan.spec.training_knobs.TrainingKnobs.fuses_qkv`,
    the revision ``training.op_sac_policy`` names; MLA has no wk or wv to fuse:
    :func:`~meshplan.compute.shapes.fused_qkv_parts`). Megatron-LM also runs its own kernels around the GEMMs
    (``megatron_ops``, :mod:`meshplan.compute.megatron`). The fused attention is the
    framework's too (``attention_kernels``, :data:`SDPA_KERNELS`): torch runs
    ``F.scaled_dot_product_attention`` (measured as such where the catalog has "SDPA" rows), whose
    flash backend is FlashAttention-2 (PyTorch 2.2
    release notes: "FlashAttention-2 support in scaled_dot_product_attention"; torchtitan's
    ``ScaledDotProductAttention`` orders the backends FLASH, EFFICIENT, MATH and puts cuDNN first
    only on compute capability 10.0, ``models/attention.py``), so FA2's published rates, not
    FA3's, on an H100; Megatron-LM keeps the catalog's order (Transformer Engine's fused
    attention: FA3 where the catalog has it). Megatron-DeepSpeed
    (:attr:`~meshplan.spec.training_engines.TrainingEngines.megatron_deepspeed`) runs no Transformer
    Engine attention: its ``--use-flash-attn-v2`` calls ``flash_attn_varlen_func`` of the flash-attn
    package's ``flash_attn.flash_attn_interface`` (microsoft/Megatron-DeepSpeed f4157be
    ``megatron/model/transformer.py:50-55, 409``), FlashAttention-2 (Dao-AILab/flash-attention 0251105
    ``flash_attn/flash_attn_interface.py:1391``; FlashAttention-3 is the separate ``flash_attn_3``
    package built from ``hopper/``, ``hopper/setup.py:36``), so FA2's rates (:data:`MDS_KERNELS`; its
    FlashAttention-1 and Triton switches are timed so too, for want of their rows).
    One rule for the step model and the search's bound.
    ``framework`` itself rides along (the QKV widths past the KV heads, :class:`~meshplan.compute.ops.Workload`).
    torch without ``training.torch_compile`` runs its elementwise ops eagerly (``torch_eager``,
    :mod:`meshplan.compute.torch_eager`), and its norms kernel by kernel under ``training.torch_norm =
    "decomposed"`` (``decomposed_norm``); the head's final norm is never compiled
    (``decomposed_head_norm``) and the loss eager unless compiled with ``torch_compile_loss``
    (``eager_loss``; both: torchtitan compiles the TransformerBlocks alone, TrainingSpec); Megatron-LM's own kernels are :mod:`~meshplan.compute.megatron`'s.
    torch's context parallelism is its ring attention (``torch_ring_attention``,
    :mod:`meshplan.compute.ring_attention`) unless ``training.cp_attention = "allgather"``
    (:attr:`~meshplan.spec.training.TrainingSpec.cp_ring`, the rule the CP rows read too);
    Megatron-LM's is Transformer Engine's p2p ring (``te_ring_attention``,
    :attr:`~meshplan.spec.training.TrainingSpec.cp_p2p`) unless ``cp_attention = "allgather"``.

    >>> from meshplan.spec.training import TrainingSpec
    >>> framework_kernels(TrainingSpec(global_batch=8, seq_len=16, framework="megatron", grad_dtype="fp32"))
    {'fused_qkv': True, 'fp32_wgrad_accumulation': True, 'megatron_ops': True, 'attention_kernels': (), \
'torch_eager': False, 'decomposed_norm': False, 'eager_loss': False, 'decomposed_head_norm': False, \
'sp_layout_copies': False, 'torch_ring_attention': False, 'cp_alltoall': False, 'te_ring_attention': True, 'framework': 'megatron', \
'megatron_core': False, 'core_attention_mask': False, 'op_sac_policy': '238fa99', \
'shared_beside_combine': False, 'no_grad_bda': True}
    >>> framework_kernels(TrainingSpec(global_batch=8, seq_len=16))["torch_eager"]
    True
    >>> framework_kernels(TrainingSpec(global_batch=8, seq_len=16))["attention_kernels"]
    ('SDPA', 'FA2')
    """
    megatron = training.framework == "megatron"
    # under DeepSpeed's PipelineEngine (Megatron-DeepSpeed's GPTModelPipe) no Megatron DDP keeps a main_grad:
    # the weight-gradient GEMMs write the bf16 .grad, which BF16_Optimizer accumulates in fp32 after the
    # backward (compute.deepspeed_pipe)
    fp32_wgrad = megatron and training.grad_dtype == "fp32" and training.pp_engine != "deepspeed"
    return {"fused_qkv": training.fuses_qkv, "fp32_wgrad_accumulation": fp32_wgrad,
            "megatron_ops": megatron,
            "attention_kernels": MDS_KERNELS if training.megatron_deepspeed else () if megatron else SDPA_KERNELS,
            "torch_eager": not megatron and not training.torch_compile,
            "decomposed_norm": not megatron and not training.torch_compile and training.torch_norm == "decomposed",
            "eager_loss": not megatron and not (training.torch_compile and training.torch_compile_loss),
            "decomposed_head_norm": not megatron and training.torch_norm == "decomposed",
            "sp_layout_copies": not megatron, "torch_ring_attention": training.cp_ring,
            "cp_alltoall": training.cp_ring and training.cp_rotate == "alltoall",
            "te_ring_attention": training.cp_p2p, "framework": training.framework,
            "megatron_core": training.megatron_core, "core_attention_mask": training.core_attention_mask,
            "op_sac_policy": training.op_sac,
            "shared_beside_combine": training.framework == "torch" and training.moe_dispatcher == "deepep",
            "no_grad_bda": megatron and not training.megatron_core and training.pp_engine != "deepspeed"
            and zero_runtime(training) != DEEPSPEED}


@lru_cache(maxsize=64)
def float8_gemms(model: ModelSpec, training) -> dict:
    """The :class:`~meshplan.compute.ops.Workload` fields of a training contract's float8 Linears: ``linear_dtype``
    and ``float8_gemms``, the names of the weights whose GEMMs run in it
    (:meth:`~meshplan.spec.training.TrainingSpec.float8_linear`, the one rule, over a dense
    and an MoE layer and the output layer of ``model``; the output's dims unpadded, as
    torchtitan does not pad the vocabulary). Empty without ``linear_dtype``.

    >>> from meshplan import catalog
    >>> from meshplan.spec.training import TrainingSpec
    >>> f = float8_gemms(catalog.model("llama3-8b"), TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8"))
    >>> f["linear_dtype"], sorted(f["float8_gemms"])
    ('fp8', ['w_down', 'w_gate', 'w_up', 'wk', 'wo', 'wq', 'wv'])
    """
    if training.linear_dtype is None:
        return {}
    kinds = {model.is_moe_layer(i): i for i in range(model.layers)}
    tensors = [x for i in kinds.values() for x in model.layer_tensors(i)] + model.head_tensors(model.vocab)
    return {"linear_dtype": training.linear_dtype, "fp8_rowwise": training.fp8_recipe == "rowwise",
            "fp8_tp": training.fp8_tp,
            "fp8_all_gather": training.fp8_all_gather, "float8_gemms": frozenset(x.name for x in tensors if training.float8_linear(x))}


#: The fused-attention kernels torch's ``scaled_dot_product_attention`` runs on an NVIDIA GPU
#: before compute capability 10.0: rows measured of SDPA itself where the catalog has them
#: (``meshplan bench attention --grid``: kernel "SDPA"; H200, M1, where torch 2.11 ran cuDNN's
#: fused attention), else its flash backend's published rates, FlashAttention-2
#: (:func:`framework_kernels`).
SDPA_KERNELS = ("SDPA", "FA2")

#: The attention kernel Megatron-DeepSpeed's flash switches run (:func:`framework_kernels`): FlashAttention-2.
MDS_KERNELS = ("FA2",)
