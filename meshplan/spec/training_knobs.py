"""Which ``[training]`` fields are the plan's design choices (:data:`PLAN_KNOBS`, which ``meshplan
compare`` weighs as it weighs the mesh) and how each acts on a training (:meth:`TrainingKnobs.knob_acts`).
Split from :mod:`meshplan.spec.training_engines` (review rv48: past the project's 400 lines);
:class:`TrainingKnobs` adds the method to the engine rules, and every caller reaches it through
:class:`meshplan.spec.training.TrainingSpec`.
"""

from __future__ import annotations

from meshplan.spec.training_engines import TrainingEngines
from meshplan.spec.training_fields import DEEPSPEED_ZERO3, FUSED_QKV_REVISIONS


# The [training] fields that are design choices of the plan (how the step runs), which
# ``meshplan compare`` weighs as it weighs the mesh; every other field is the workload (what
# the step computes: batch, sequence, the model's dtypes and reductions, optimizer, clipping,
# MoE routing, the HBM kept free) and must be equal on both sides. ``vocab_pad_divisor`` is
# the framework's layout of the same vocabulary (the loss is over V either way; unset it
# follows ``framework``), so a knob with it.
# The float8 settings are knobs: ``linear_dtype`` (which GEMMs run in float8), ``fp8_recipe``
# and ``fp8_output_layer`` (how scaled, whether the head is converted), ``fp8_tp`` (whether TP
# gathers in float8), ``fp8_all_gather``
# (the bytes FSDP gathers), ``fp8_param_gather`` (Megatron-LM's parameters kept and gathered in fp8): a float8 step and a bf16 step of one model, batch and sequence are
# both timed and sized in full (the GEMMs at the fp8 peak, :meth:`float8_linear`), so compare
# weighs float8 against bf16 as it weighs recompute (newcomer trial 29 was refused it).
# ``param_dtype`` is how the runtime stores the weights that its optimizer updates (unset it
# follows the framework and engine, ``TrainingSpec._runtime_param_dtype``: torchtitan's fp32,
# Megatron-LM's bf16 with fp32 main copies), so a knob with them. ``cp_attention`` is how the
# runtime runs CP's attention (Megatron-LM's ``--cp-comm-type``), not what it computes: a knob
# (newcomer trial 31 was refused p2p against all_gather), and ``cp_rotate`` how torch's ring moves
# K/V (torchtitan's context_parallel_rotate_method; newcomer trial 53). DeepSpeed ZeRO++'s three keys are how
# DeepSpeed's ZeRO-3 moves the same gathers and reductions (meshplan.comm.zeropp): knobs.
# ``recompute_modules`` refines ``recompute = "selective"`` as the float8 knobs refine linear_dtype
# (what Megatron-LM recomputes, not what the step computes), ``pp_engine`` is who runs the pipeline
# schedule (as zero3_engine is who runs ZeRO-3), ``megatron_runtime`` and ``dataloader_attention_mask``
# how Megatron-LM's generation loads the batch: knobs (each refused before as a workload difference).
# ``recompute_num_layers`` (Megatron-LM's block recompute) refines ``recompute = "full"`` as ``ac_freq``
# refines ``layer``: which layers are checkpointed, not what the step computes.
PLAN_KNOBS = ("micro_batch", "sharding", "reshard_after_forward", "reshard_head_after_forward", "recompute", "ac_freq", "recompute_num_layers",
              "flash_attention",
              "tp_comm_overlap", "framework", "zero3_engine", "contiguous_gradients", "zero12_engine", "overlap_comm",
              "overlap_grad_reduce", "overlap_param_gather", "megatron_fsdp", "grad_accumulation", "fp8_all_gather", "torch_compile", "torch_compile_loss", "torch_norm", "optimizer_impl", "pp_schedule_runs", "pp_p2p_overlap", "pp_p2p_overlap_warmup_flush", "pp_ep_overlap", "vocab_pad_divisor",
              "param_dtype", "moe_dispatcher", "linear_dtype", "fp8_recipe", "fp8_output_layer", "fp8_tp", "fp8_param_gather", "cp_attention", "cp_rotate",
              "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
              "megatron_runtime", "dataloader_attention_mask", "recompute_modules", "pp_engine", "op_sac_policy")

#: The float8 knobs that refine ``linear_dtype = "fp8"``: they act only on a side that runs it.
_FP8_REFINEMENTS = ("fp8_recipe", "fp8_output_layer", "fp8_tp", "fp8_all_gather", "fp8_param_gather")


class TrainingKnobs(TrainingEngines):
    """The plan knobs of a training as they act (module docstring)."""

    @property
    def torchtitan_revision(self) -> str:
        """The torchtitan commit whose model code ``framework = "torch"`` plans: ``op_sac_policy``'s
        (:data:`meshplan.spec.training_fields.OpSacPolicy`; its op-level SAC under ``recompute =
        "op"``, its model code at every recompute), "" under another framework.

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).torchtitan_revision for kw in (
        ...  {}, {"op_sac_policy": "b5bcd76"}, {"op_sac_policy": "b5bcd76", "framework": "megatron"})]
        ['238fa99', 'b5bcd76', '']
        """
        return self.op_sac if self.framework == "torch" else ""

    @property
    def fuses_qkv(self) -> bool:
        """Whether a layer without MLA projects Q, K and V with one GEMM: Megatron-LM's
        ``linear_qkv`` (framework megatron), or torchtitan's ``wqkv`` at a revision of
        :data:`~meshplan.spec.training_fields.FUSED_QKV_REVISIONS` (:attr:`torchtitan_revision`);
        the GEMM is :func:`meshplan.compute.kernel_time.qkv_fused_ops`'.

        >>> from meshplan.spec.training import TrainingSpec
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).fuses_qkv for kw in (
        ...  {}, {"op_sac_policy": "b5bcd76"}, {"framework": "megatron"})]
        [False, True, True]
        """
        return self.framework == "megatron" or self.torchtitan_revision in FUSED_QKV_REVISIONS

    def knob_acts(self, knob: str) -> tuple[bool, object]:
        """(whether plan knob ``knob``, a :data:`PLAN_KNOBS` field, applies to this training's
        sharding and engine, its value as it acts): ``zero3_engine`` at sharding zero3 only,
        ``zero12_engine`` at zero1 and zero2 only, ``overlap_comm`` under a DeepSpeed engine that
        reads it (:attr:`overlaps_comm`), ``contiguous_gradients`` under DeepSpeed's ZeRO-3
        (:attr:`contiguous_grads`), ``linear_dtype`` as the dtype the Linear GEMMs run in (unset:
        the compute dtype), ``fp8_recipe``, ``fp8_output_layer``, ``fp8_tp`` and ``fp8_all_gather`` under
        ``linear_dtype = "fp8"`` only, ``cp_attention`` as :attr:`cp_kind` (unset: the framework's
        default), ``megatron_runtime`` under framework megatron as the generation it plans (unset:
        ``"2022"``), ``dataloader_attention_mask`` under that ``"core"`` generation as
        :attr:`core_attention_mask` (unset: true), ``recompute_modules`` under Megatron-LM's
        ``selective`` only (what it reads them under, :func:`meshplan.spec.recompute_modules.config_notes`),
        ``op_sac_policy`` under ``recompute = "op"`` or framework torch (the revision's model code:
        :attr:`torchtitan_revision`); every other knob applies, as given. ``meshplan compare`` lists
        a knob only where it applies to both sides, by the value it acts with
        (:func:`meshplan.compare.differences.config_differences`).

        >>> from meshplan.spec.training import TrainingSpec
        >>> z2 = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed")
        >>> z2.knob_acts("zero3_engine"), z2.knob_acts("overlap_comm"), z2.knob_acts("contiguous_gradients")
        ((False, 'fsdp2'), (True, False), (True, True))
        >>> bf16 = TrainingSpec(global_batch=8, seq_len=16, compute_dtype="bf16")
        >>> bf16.knob_acts("linear_dtype"), bf16.knob_acts("fp8_recipe")
        ((True, 'bf16'), (False, 'tensorwise'))
        >>> mg = TrainingSpec(global_batch=8, seq_len=16, framework="megatron")
        >>> mg.knob_acts("megatron_runtime"), bf16.knob_acts("megatron_runtime"), mg.knob_acts("dataloader_attention_mask")
        ((True, '2022'), (False, None), (False, None))
        """
        value = getattr(self, knob)
        if knob == "linear_dtype":
            return True, self.linear_dtype or self.compute_dtype
        if knob == "cp_attention":  # how CP runs attention, as it acts (unset: the framework's own)
            return True, self.cp_kind
        if knob == "cp_rotate":  # how torch's ring moves K/V: acts on its ring only
            return self.cp_kind == "ring" and self.framework == "torch", value
        if knob in _FP8_REFINEMENTS:
            return self.linear_dtype == "fp8", value
        deepspeed3 = self.sharding == "zero3" and self.zero3_engine in DEEPSPEED_ZERO3
        if knob == "zero3_engine":
            return self.sharding == "zero3", value
        if knob == "zero12_engine":
            return self.sharding in ("zero1", "zero2"), value
        if knob == "overlap_comm":
            return self.zero12_engine == "deepspeed" or self.zero3_engine == "deepspeed", self.overlaps_comm
        if knob in ("pp_p2p_overlap", "pp_p2p_overlap_warmup_flush"):  # Megatron-LM's flags; unset overlap: on
            return self.framework == "megatron", value if knob != "pp_p2p_overlap" else value is not False
        if knob == "contiguous_gradients":
            acts = deepspeed3 or self.deepspeed_zero12
            return acts, self.contiguous_grads if acts else value
        if knob.startswith("zero_hpz") or knob.startswith("zero_quantized"):  # DeepSpeed ZeRO++ (comm.zeropp)
            return self.sharding == "zero3" and self.zero3_engine == "deepspeed", value
        return self._megatron_knob_acts(knob, value)

    def _megatron_knob_acts(self, knob: str, value: object) -> tuple[bool, object]:
        """:meth:`knob_acts` of Megatron-LM's generation, its data loader's mask and its recompute
        modules (that method's docstring); every other knob applies, as given."""
        if knob == "megatron_runtime":  # unset plans 2022 (TrainingFields.megatron_core)
            return self.framework == "megatron", ("core" if self.megatron_core else "2022") \
                if self.framework == "megatron" else value
        if knob == "dataloader_attention_mask":
            return self.megatron_core, self.core_attention_mask if self.megatron_core else value
        if knob == "recompute_modules":
            return self.framework == "megatron" and self.recompute == "selective", value
        if knob == "op_sac_policy":  # torchtitan's op-level SAC, and its model code under torch (torchtitan_revision)
            return self.recompute == "op" or self.framework == "torch", value
        return True, value
