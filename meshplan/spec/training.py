"""Training contract: batch, sequence, dtypes, optimizer, sharding, recompute, reserve."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshplan.limits import BOUNDS
from meshplan.spec.wording import recompute_words, runtime

Dtype = Literal["fp32", "bf16", "fp16", "fp8"]


# The [training] fields that are design choices of the plan (how the step runs), which
# ``meshplan compare`` weighs as it weighs the mesh; every other field is the workload (what
# the step computes: batch, sequence, the model's dtypes and reductions, optimizer, clipping,
# MoE routing, the HBM kept free) and must be equal on both sides. ``vocab_pad_divisor`` is
# the framework's layout of the same vocabulary (the loss is over V either way; unset it
# follows ``framework``), so a knob with it.
# ``fp8_all_gather`` (torchtitan's float8 all-gather of the float8 Linear weights) is a knob: it
# changes the bytes FSDP gathers, not what the GEMMs compute; ``linear_dtype``, ``fp8_recipe``
# and ``fp8_output_layer`` (which GEMMs run in float8, how scaled) are the workload's numerics.
# ``param_dtype`` is how the runtime stores the weights that its optimizer updates (unset it
# follows the framework and engine, ``TrainingSpec._runtime_param_dtype``: torchtitan's fp32,
# Megatron-LM's bf16 with fp32 main copies), so a knob with them.
PLAN_KNOBS = ("micro_batch", "sharding", "reshard_after_forward", "reshard_head_after_forward", "recompute", "ac_freq", "flash_attention",
              "tp_comm_overlap", "framework", "zero3_engine", "contiguous_gradients", "zero12_engine", "overlap_comm",
              "overlap_grad_reduce", "overlap_param_gather", "megatron_fsdp", "grad_accumulation", "fp8_all_gather", "torch_compile", "torch_compile_loss", "torch_norm", "optimizer_impl", "pp_schedule_runs", "vocab_pad_divisor",
              "param_dtype")

#: The weights of ``nn.Linear`` modules (torchtitan's model files; Megatron-LM's Transformer Engine
#: linears): attention (dense and MLA), the dense MLP and the shared experts, the MoE router's gate
#: and the output layer. Everything else is a norm, an embedding, a bias or a routed experts'
#: grouped weight (``GroupedExperts``, which the Linear converter leaves alone).
LINEAR_WEIGHTS = frozenset({"wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w_gate", "w_up", "w_down",
                            "shared_w_gate", "shared_w_up", "shared_w_down", "router", "output"})


def deepspeed_grad_dtype(stage: int, model: str, accum: Optional[str] = None) -> str:
    """The dtype DeepSpeed keeps the step's gradients in under ZeRO ``stage`` (1, 2, 3) with the
    model in ``model`` (``bf16``, ``fp16``, ``fp32``: its ``bf16`` / ``fp16`` sections) and
    ``data_types.grad_accum_dtype`` ``accum`` (None: unset). The one default of
    ``training.grad_dtype`` under DeepSpeed's engines, for a meshplan TOML
    (:meth:`TrainingSpec._deepspeed_grads`) and the DeepSpeed JSON reader alike
    (:mod:`meshplan.interop.deepspeed`). Read in deepspeedai/DeepSpeed at edaa722:

    - ``runtime/engine.py:1485-1496`` ``get_data_types``: ``grad_accum_dtype`` unset is the model's
      dtype; ``_do_optimizer_sanity_check`` (1978-2021) runs ZeRO's own optimizer for every stage,
      except bf16 with fp32 ``grad_accum_dtype`` at stage 1 (``BF16_Optimizer``, which the reader
      refuses).
    - stage 2 (``runtime/zero/stage_1_and_2.py:1678-1680``): ``grads_in_partition`` is allocated in
      ``self.dtype``, the parameters' dtype, whatever ``grad_accum_dtype`` says: the model's dtype.
    - stage 1 (``stage_1_and_2.py:354-360``, ``_fill_param_grad_accum_attribute``): ``param.grad``
      in the model's dtype, or, when ``gradient_accumulation_dtype`` differs from it, each
      micro-batch's gradient accumulated into ``param.grad_accum`` in that dtype: ``accum``.
    - stage 3 (``runtime/zero/stage3.py:742-744``): ``grad_partitions_flat_buffer`` in
      ``gradient_accumulation_dtype``: ``accum``, else the model's dtype (v0.3.13 likewise kept
      ``grads_in_partition`` in ``torch.half``).

    Each stage converts the rank's partition to fp32 only inside ``step``, one group at a time:
    a transient, not this state.

    >>> [deepspeed_grad_dtype(s, "bf16") for s in (1, 2, 3)]
    ['bf16', 'bf16', 'bf16']
    >>> deepspeed_grad_dtype(1, "fp16", "fp32"), deepspeed_grad_dtype(2, "fp16", "fp32"), deepspeed_grad_dtype(3, "bf16", "fp32")
    ('fp32', 'fp16', 'fp32')
    """
    return model if stage == 2 or accum is None else accum


#: ``training.zero3_engine`` values that are DeepSpeed's ZeRO stage 3.
DEEPSPEED_ZERO3 = ("deepspeed", "deepspeed-2021")


class TrainingSpec(BaseModel):
    """What one optimizer step must do and how state is kept.

    ``global_batch``: sequences per optimizer step; ``seq_len``: tokens per sequence;
    ``micro_batch``: sequences per data-parallel rank per forward pass.
    ``sharding``: ``none`` (DDP), ``zero1`` (optimizer state and fp32 master sharded),
    ``zero2`` (+ gradients), ``zero3`` (+ parameters: FSDP, ``reshard_after_forward``
    chooses ZeRO-3 (true) or keeps gathered parameters from forward to backward (false)),
    ``hsdp`` (zero3 within dp_shard, replicated over dp_replicate).
    ``reshard_head_after_forward`` (torchtitan's units, :attr:`torchtitan_units`, with
    ``reshard_after_forward``): the unit holding the output layer, ``[norm, output]`` (tied:
    ``[embedding, norm, output]``), is resharded after forward as well and all-gathered again
    for its backward, as torchtitan's ``fsdp_reshard_after_forward = "always"`` wraps it
    (``apply_fsdp_to_decoder``: ``reshard_after_forward=policy == "always"`` for that unit;
    ``"default"`` and ``"never"`` keep it gathered). Off (default): kept gathered from its forward
    to its backward.
    ``optimizer``: ``adamw`` (default), ``adam`` or ``sgd``. The default is what both
    frameworks run unless told otherwise: torchtitan's default optimizer is AdamW (``[optimizer]
    name = "AdamW"``, weight decay 0.1: ``torchtitan/config/job_config.py`` ``Optimizer`` at
    pytorch/torchtitan 238fa99; ``default_adamw`` in ``components/optimizer/optimizer.py`` at
    b5bcd76), and Megatron-LM's default ``--optimizer adam`` decouples the weight decay
    (``OptimizerConfig.decoupled_weight_decay = True``, ``megatron/core/optimizer/optimizer_config.py``;
    ``__init__.py`` builds ``torch.optim.AdamW`` or FusedAdam with ``adam_w_mode``; NVIDIA/Megatron-LM
    d98e8a6): AdamW. Adam and AdamW keep the same two states; only torch's foreach step differs
    (AdamW's decay is one more pass, :func:`meshplan.schedule.optimizer_step.foreach_adam_bytes`).
    ``memory_reserve``: fraction of HBM kept free (allocator, NCCL, headroom).
    ``vocab_pad_divisor``: the vocabulary is padded to a multiple of ``vocab_pad_divisor x tp``
    (:func:`meshplan.spec.axes.tp.padded_vocab`). Unset, it follows the framework: 128 under
    ``framework = "megatron"`` (Megatron-LM's ``--make-vocab-size-divisible-by`` default,
    ``_vocab_size_with_padding``), 1 under ``torch``: torchtitan builds the embedding and the
    output layer with the tokenizer's ``vocab_size`` as given (``nn.Embedding(vocab_size, dim)``,
    ``nn.Linear(dim, vocab_size)`` in ``torchtitan/models/llama3/model``) and tp shards their
    rows with DTensor, unevenly where tp does not divide V (``torch.chunk``: ``ceil(V / tp)``
    rows on the first ranks), which divisor 1 models by the largest shard.
    ``grad_reduce_dtype``: dtype of the gradient reduction over the data axes: ``fp32``
    (Megatron-LM's DDP and distributed optimizer reduce fp32 main gradients,
    ``--accumulate-allreduce-grads-in-fp32``), ``bf16``, ``fp16`` (DeepSpeed's
    ``communication_data_type``) or ``param`` (the parameter dtype); unset: the parameter dtype
    under ``zero12_engine = "deepspeed"`` (DeepSpeed reduces in the model's dtype), else
    ``reduce_dtype`` for zero1/zero2/zero3/hsdp (FSDP2's ``MixedPrecisionPolicy``); for
    ``none`` the parameter dtype (torch DDP reduces the gradients as they are), except fp32 under
    ``framework = "megatron"`` with bf16 parameters (Megatron-LM's ``arguments.py`` sets
    ``accumulate_allreduce_grads_in_fp32`` for every bf16 run: "bfloat16 requires gradient
    accumulation and all-reduce to be done in fp32"; later versions unless ``--grad-reduce-in-bf16``).
    ``tp_comm_overlap``: TP collectives overlap the GEMMs of their block (Megatron-LM
    ``--tp-comm-overlap``, Transformer Engine userbuffers; torchtitan's
    ``enable_async_tensor_parallel``, which needs ``torch_compile``: its parallelize raises "Async
    TP requires torch.compile"); off: they block (torchtitan's default). With sequence parallelism
    the step model runs each fused op as the runtime decomposes it (:mod:`meshplan.compute.asynctp`;
    torch's unfused TP collectives still block).
    ``framework``: whose runtime order the step model follows where they differ: ``torch``
    (torchtitan: DTensor tensor parallelism; a block's input-gradient collective is issued
    after its linears' backward, input and weight gradients, and blocks the next block) or
    ``megatron`` (Megatron-LM: the input-gradient all-reduce or reduce-scatter of the
    column-parallel linears runs during their weight-gradient GEMMs, and with sequence
    parallelism their input is all-gathered again in backward, during their input-gradient
    GEMM, because only its sequence shard is saved; ``LinearWithGradAccumulationAndAsyncCommunication``;
    the gradients reduced after the backward, except Megatron FSDP's overlapped reduce-scatters
    under zero2, zero3 and hsdp: :func:`meshplan.schedule.overlap_policy.config_overlap`).
    ``validate`` runs torch: it takes ``torch`` only.
    ``torch_compile``: under ``framework = "torch"``, the model and loss run under torch.compile
    (torchtitan ``[compile] enable``), which fuses each chain of elementwise ops between the GEMMs
    into one kernel; off (torchtitan's default), torch runs them one kernel each
    (:mod:`meshplan.compute.torch_eager`). Megatron-LM runs its own kernels either way.
    torchtitan compiles each TransformerBlock only (``apply_compile``: 9dec370
    ``parallelisms/parallelize_llama.py``, b5bcd76 ``distributed/compile.py``): the final norm runs
    eagerly whatever ``torch_compile`` says (kernel by kernel under ``torch_norm = "decomposed"``).
    ``torch_compile_loss`` (with ``torch_compile``): the cross entropy compiled too (torchtitan
    ``[compile] components`` with "loss", its default; 820504e ``components/loss.py`` compiles it
    with ``training.compile``); false: eager, as at 9dec370, whose ``train.py`` has the loss
    compile commented out ("compiling loss function causes CUDA errors").
    ``torch_norm``: the RMSNorm module under ``framework = "torch"``: ``"fused"`` (one kernel
    each way: torch's ``nn.RMSNorm``, torchtitan's norm since 2025) or ``"decomposed"``
    (torchtitan's own ``RMSNorm`` before it, ``model.norm_type = "rmsnorm"`` at 9dec370: upcast,
    ``pow``, ``mean``, ``rsqrt``, products and casts, one kernel each when not compiled,
    :func:`meshplan.compute.torch_eager.rmsnorm_bytes`; torch.compile fuses them).
    ``optimizer_impl``: how torch runs the Adam/AdamW step under ``framework = "torch"``
    (:func:`meshplan.schedule.optimizer_step.optimizer_step_bytes`). ``"fused"`` (the default, as in
    torchtitan since its ``[optimizer] implementation`` key, default "fused": 820504e
    ``config_manager.py``, b5bcd76 ``components/optimizer/optimizer.py``): torch's
    ``_fused_adam_``, one pass. ``"foreach"``: torch's ``_multi_tensor_adam``, eight passes
    (torchtitan 9dec370, the commit of its Dec 2024 H100 tables: ``optimizer.py`` passes
    ``"foreach": not fused`` with ``--optimizer.fused`` a store_true flag, default false).
    Megatron-LM runs apex/TE's fused Adam: ``"fused"`` only. SGD's step is the same either way.
    ``zero3_engine``: which runtime shards the parameters under ``sharding = "zero3"``:
    ``fsdp2`` (torch FSDP2: one unit per layer, one coalesced all-gather and reduce-scatter
    each) or ``deepspeed-2021`` (DeepSpeed ZeRO stage 3 v0.3.13-v0.5.4, Mar-Oct 2021, before
    v0.5.5 coalesced its all-gathers, DeepSpeed PR #1188; the engine of Narayanan et al.
    SC'21's ZeRO-3 runs): one all-gather per parameter tensor, in forward and again in
    backward, over the whole data-parallel group with list-based outputs, and gradient buckets
    all-reduced (v0.3.13's default ``contiguous_gradients`` false; the persistent parameters
    gathered again every step; :mod:`meshplan.comm.deepspeed`). Its gradients are reduced
    in the parameter dtype (``allreduce_bucket`` reduces ``param.grad``; DeepSpeed at
    edaa722 casts to ``communication_data_type``, unset the model's dtype, ``stage3.py:1798-1799``)
    unless ``grad_reduce_dtype`` says otherwise, and kept, partitioned, in the parameter dtype
    unless ``grad_dtype`` is given (DeepSpeed's ``data_types.grad_accum_dtype``). ``deepspeed``:
    DeepSpeed's ZeRO stage 3 since v0.5.5 (what a DeepSpeed stage 3 config imports to, and what a
    search under ``zero12_engine = "deepspeed"`` plans its zero3 rows with): FSDP2's per-layer
    coalesced gathers and reduce-scatters (a module's parameters gathered as one flat buffer,
    ``all_gather_coalesced``), gradients kept and reduced in the parameter dtype as above, and
    none of FSDP2's copies on the compute stream: the split of the gathered buffer into the
    parameters runs on DeepSpeed's all-gather stream and the gradients' copy into the reduce
    bucket on its reduce stream, so they lengthen those collectives instead
    (:func:`meshplan.comm.fsdp2.compute_stream_copies`).
    ``contiguous_gradients`` (sharding zero3, or zero1/zero2 under ``zero12_engine = "deepspeed"``):
    DeepSpeed's ``zero_optimization.contiguous_gradients``,
    the gradient path of ``zero3_engine = "deepspeed-2021"``: false (default: v0.3.12-v0.4.2's
    ``ZERO3_OPTIMIZATION_CONTIGUOUS_GRADIENTS_DEFAULT``, the version the engine's gathers are read
    in) all-reduces flat buckets of ``reduce_bucket_size`` elements; true (DeepSpeed's default
    from v0.4.3, c9fee8214, PR #1199) copies each gradient into the bucket's buffer and
    reduce-scatters every gradient on its own (:mod:`meshplan.comm.deepspeed`). Under ``deepspeed``
    (unset: true, that DeepSpeed's default, :attr:`contiguous_grads`) it chooses the memory of the
    gradient bucket only (:func:`meshplan.memory.buffers.deepspeed3_ipg_bytes`: the ipg buffer of
    ``reduce_bucket_size`` elements when true); under DeepSpeed's ZeRO-1/2 (unset: true) likewise,
    its ipg buffers (:meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_bucket_bytes`: none when
    false); under ``fsdp2`` it changes nothing; it is kept so
    that an imported DeepSpeed config's value applies when the engine is switched.
    ``zero0_engine`` (sharding none): ``ddp`` or ``deepspeed``, DeepSpeed's engine without ZeRO
    (what a DeepSpeed stage 0 config imports to). It changes nothing in the plan of sharding none
    (one data-parallel all-reduce of the gradients either way); it tells a search which runtime the
    config runs, so that its zero1 and zero2 rows run DeepSpeed's ZeRO-1/2 and its zero3 rows its
    ZeRO-3 (:attr:`searched_zero12_engine`, :attr:`searched_zero3_engine`), as the search of a
    stage 1, 2 or 3 DeepSpeed config plans them: the stages a DeepSpeed user switches to by
    changing ``zero_optimization.stage``.
    ``zero12_engine``: which runtime reduces the gradients under ``sharding = "zero1"`` or
    ``"zero2"``: ``megatron`` (Megatron-LM's distributed optimizer: reduce-scatters of gradient
    buckets, :func:`meshplan.comm.dp_rows._zero2_rows`) or ``deepspeed`` (DeepSpeed's
    ``stage_1_and_2.py`` since v0.12.4, PR #4695: one all-reduce per bucket of whole
    parameters, ``[memory] grad_bucket_elements`` = ``reduce_bucket_size``, default 5e8;
    zero2 every micro-batch in the backward hooks, zero1 once per step; in
    ``communication_data_type``, else the parameter dtype; :mod:`meshplan.comm.deepspeed_zero12`).
    ``overlap_comm`` (``zero12_engine = "deepspeed"`` or ``zero3_engine = "deepspeed"``): DeepSpeed's
    ``zero_optimization.overlap_comm``; unset, DeepSpeed's default for the stage (:attr:`overlaps_comm`:
    false at stages 1 and 2, true at stage 3). ZeRO-1/2: the bucket all-reduces run on a side stream
    and overlap the backward (two bucket buffers held); off they run on the compute stream and
    block it. ZeRO-3 (edaa722): the parameter all-gathers run on their own stream
    (``parameter_offload.py:189-190``, ``__allgather_stream``, prefetched ahead of use) and the
    gradient reduce-scatters on ``reduce_and_partition_stream`` (``stage3.py:335-336``), each a
    side stream under ``overlap_comm`` and the default (compute) stream without it, where every
    gather and reduce-scatter blocks the compute
    (:func:`meshplan.schedule.overlap_policy.config_overlap`).
    ``overlap_grad_reduce``, ``overlap_param_gather`` (``framework = "megatron"``, sharding ``none``
    or ``zero1`` under ``zero12_engine = "megatron"``: Megatron-LM's DDP buffers): its
    ``--overlap-grad-reduce`` and ``--overlap-param-gather`` (default off). ``overlap_grad_reduce``
    splits the gradient buffer into buckets of ``max(40e6, 1e6 x dp)`` elements (``[memory]
    grad_bucket_elements`` when set, ``--ddp-bucket-size``) and a bucket's all-reduce (none) or
    reduce-scatter (zero1) is issued once every gradient in it is ready in the last micro-batch's
    backward (the buffer in reverse registration order, so the last layers' buckets first),
    overlapping the rest of the backward; off, one bucket reduced after the whole backward.
    ``overlap_param_gather`` (zero1 with ``overlap_grad_reduce``, as Megatron-LM asserts) all-gathers
    the updated parameters bucket by bucket in the next forward: the first forward pre-hook
    issues the first bucket and waits for it, each later bucket issued when the previous one is
    waited for (NVIDIA/Megatron-LM d98e8a6 ``megatron/core/distributed/distributed_data_parallel.py``
    lines 131-137 and ``_make_backward_post_hook`` / ``_make_forward_pre_hook``;
    ``param_and_grad_buffer.py`` ``register_grad_ready``, ``finish_param_sync``; ``arguments.py``
    lines 1024-1029). Under Megatron FSDP (zero2, zero3, hsdp) both are forced on whatever the
    flags say (:func:`meshplan.schedule.overlap_policy.config_overlap`): the keys are refused there.
    ``megatron_fsdp`` (``framework = "megatron"``, sharding none or zero1): Megatron-LM runs them
    with Megatron FSDP (``--use-megatron-fsdp --data-parallel-sharding-strategy no_shard`` or
    ``optim``) instead of its DDP buffers and distributed optimizer. It plans as them: the same
    state (parameters and gradient buffer whole on every rank; under optim the fp32 main weights and
    optimizer state sharded over dp x cp) and the same reductions, once per step in the last
    micro-batch (``is_delay_grad_reduce``), per unit in its backward under ``overlap_grad_reduce``,
    else all-reduced (no_shard) or reduce-scattered (optim) after it, and optim's parameters
    all-gathered after the step (in the next forward under ``overlap_param_gather``)
    (megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:326-337, 1284-1347 and
    param_and_grad_buffer.py:2325-2345 at NVIDIA/Megatron-LM d98e8a6); the output names the engine
    and ``export --to megatron`` writes its flags. zero2, zero3 and hsdp run Megatron FSDP whatever
    it says.
    ``grad_clip``: gradient-norm clipping before the optimizer step (torchtitan
    ``training.max_norm`` 1.0 and Megatron-LM ``--clip-grad`` 1.0 by default): one read of the
    gradients for the norm and one read and write to scale them
    (:func:`meshplan.schedule.optimizer_step.optimizer_step_bytes`).
    ``grad_accumulation``: what FSDP2 (zero3, hsdp) does on the micro-batches of a step before
    the last one (gradient accumulation, pp 1). ``sync`` (FSDP2's default): every micro-batch
    reduce-scatters its gradients and reshards after backward. ``no_sync``:
    ``set_requires_gradient_sync(False)`` on those micro-batches: no reduce-scatter, each
    unit's unsharded gradient accumulates in the reduce dtype until the last micro-batch
    (FSDP2 ``FSDPParam.to_accumulated_grad_if_needed``), parameters resharded after backward
    as usual. ``no_sync_unsharded``: also ``set_reshard_after_backward(False)``: parameters
    stay gathered from a backward to the next forward, so only micro-batch 0's forward
    all-gathers (what ``torch.distributed.pipelining`` does itself with pp > 1). The last
    micro-batch always syncs and reshards.
    ``pp_schedule_runs`` (pp > 1, ``framework = "torch"``): the step's micro-batches run as this
    many back-to-back pipeline schedules, as torchtitan runs gradient accumulation under pp: its
    train step calls ``schedule.step()`` once per accumulation step (``global_batch_size /
    (local_batch_size x dp)``), each over ``local_batch_size / microbatch_size`` micro-batches, so
    each run fills and drains the pipeline, and ``PipelineStage.perform_reduce_grad`` reduces the
    FSDP gradients and reshards the parameters at the end of every run (torch 2.13
    ``distributed/pipelining/stage.py``). Megatron-LM and DeepSpeed run one schedule over all the
    step's micro-batches (1, the default). With pp 1 it changes nothing (each micro-batch is its
    own forward and backward either way).
    ``recompute`` (activation checkpointing): ``selective`` and ``full`` as Megatron-LM
    (``--recompute-activations``: the attention core; ``--recompute-granularity full``: every
    layer keeps its input only); ``layer`` and ``op`` as torchtitan's selective AC
    (``[activation_checkpoint] mode = "selective"``): ``layer`` checkpoints every
    ``ac_freq``-th layer in full (``selective_ac_option = "<ac_freq>"``: torchtitan counts
    the blocks it wraps, 1-based, and wraps those whose count is a multiple of ac_freq; the
    count runs over the rank's own layers), ``op`` saves the outputs of matmuls (all but every
    second mm of a layer), of SDPA and of reduce-scatters, and recomputes the rest
    (``selective_ac_option = "op"``). :attr:`recompute_name` names each in the runtime's words
    (:mod:`meshplan.spec.wording`).
    ``compute_dtype``: the dtype of activations (what autograd saves, what TP, CP and PP send)
    and of every GEMM that is not a float8 Linear; FSDP2's ``MixedPrecisionPolicy.param_dtype``.
    ``linear_dtype = "fp8"``: float8 training as torchtitan's float8 converter (torchao
    ``Float8Linear``, ``[model] converters = ["quantize.linear.float8"]``) and Megatron-LM's
    ``--fp8-format`` (Transformer Engine linears) run it: only the GEMMs of the converted
    ``nn.Linear`` modules (:meth:`float8_linear`) run in fp8 (forward, data- and weight-gradient:
    their input, weight and output gradient are cast to fp8 per GEMM, the output is in the
    compute dtype); the attention core, norms, embeddings and routed experts stay in the compute
    dtype, and so do the activations: ``Float8Linear`` saves its high-precision input for
    backward (torchao ``float8_linear.py``, ``matmul_with_hp_or_float8_args``:
    ``ctx.save_for_backward(input_hp, weight_hp_t)``). Unset: every GEMM in the compute dtype.
    ``fp8_recipe``: torchao's float8 scaling (torchtitan ``recipe_name``; ``rowwise_with_gw_hp``
    read as rowwise): ``tensorwise`` (default) or ``rowwise``. The GEMMs are timed alike; under
    torchtitan's async TP the recipe decides which gathers fuse (rowwise: none, as torchtitan runs
    its TP gathers in bf16 and casts after; :mod:`meshplan.compute.asynctp`). Under
    ``framework = "torch"`` with sequence parallelism, tensorwise scaling makes the TP
    all-gathers of the float8 Linears' inputs and output gradients move float8
    (:meth:`float8_tp_gathers`); rowwise keeps torch's plain TP, every collective in the compute
    dtype.
    ``fp8_output_layer``: the output layer is converted too (torchtitan's ``filter_fqns``
    without "output"; default: excluded, as torchtitan's presets and Megatron-LM do).
    ``fp8_all_gather``: torchtitan's ``enable_fsdp_float8_all_gather``: FSDP2 all-gathers the
    float8 Linear weights in float8 (1 byte), while norms and embeddings stay in the compute
    dtype in the same unit's buffer (one uint8 all-gather per unit), and the float8 scales
    take one all-reduce (max) of one fp32 amax per float8 weight per step
    (``precompute_float8_dynamic_scale_for_fsdp``); a tied output layer is the embedding and
    is gathered in the compute dtype. Gradients are reduce-scattered in the reduce dtype
    either way.
    ``moe_capacity_factor``, ``moe_dropless``, ``moe_hottest_expert_share``: MoE routing
    (:mod:`meshplan.compute.routing`, :meth:`RoutingOptions.of
    <meshplan.compute.routing.RoutingOptions.of>` resolves them): the capacity factor f of the
    dropping dispatch (``C = ceil(f x tokens x top_k / experts)``, Megatron-LM
    ``--moe-expert-capacity-factor``), dropless routing (no capacity, nothing dropped:
    torchtitan, Megatron-LM without a capacity factor), and the busiest expert's share of the
    token copies (unset: balanced, 1 / experts). Both unset: the engine's own default, dropless
    under both frameworks (torchtitan's token-choice MoE has no capacity; Megatron-LM's
    ``moe_expert_capacity_factor`` defaults to None, dropless); ``moe_dropless = false`` alone:
    capacity factor 1.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    global_batch: int = Field(gt=0, le=BOUNDS["global_batch"].value)
    seq_len: int = Field(gt=0, le=BOUNDS["seq_len"].value)
    micro_batch: int = Field(default=1, gt=0, le=BOUNDS["micro_batch"].value)
    param_dtype: Dtype  # unset: the runtime's (_runtime_param_dtype)
    compute_dtype: Dtype = "bf16"
    grad_dtype: Dtype = "fp32"
    optimizer_dtype: Dtype = "fp32"
    reduce_dtype: Dtype = "fp32"
    master_weights: bool = True
    optimizer: Literal["adam", "adamw", "sgd"] = "adamw"
    sharding: Literal["none", "zero1", "zero2", "zero3", "hsdp"] = "zero3"
    reshard_after_forward: bool = True
    reshard_head_after_forward: bool = False
    recompute: Literal["none", "selective", "full", "layer", "op"] = "selective"
    ac_freq: int = Field(default=1, ge=1)
    flash_attention: bool = True
    memory_reserve: float = Field(default=0.10, ge=0, lt=1)
    vocab_pad_divisor: int = Field(gt=0, le=BOUNDS["vocab_pad_divisor"].value)
    grad_reduce_dtype: Optional[Literal["fp32", "bf16", "fp16", "param"]] = None
    tp_comm_overlap: bool = False
    grad_clip: bool = True
    framework: Literal["torch", "megatron"] = "torch"
    torch_compile: bool = False
    torch_norm: Literal["fused", "decomposed"] = "fused"
    torch_compile_loss: bool = True
    optimizer_impl: Literal["fused", "foreach"] = "fused"
    zero3_engine: Literal["fsdp2", "deepspeed", "deepspeed-2021"] = "fsdp2"
    contiguous_gradients: Optional[bool] = None
    zero12_engine: Literal["megatron", "deepspeed"] = "megatron"
    zero0_engine: Literal["ddp", "deepspeed"] = "ddp"
    overlap_comm: Optional[bool] = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    megatron_fsdp: bool = False
    grad_accumulation: Literal["sync", "no_sync", "no_sync_unsharded"] = "sync"
    pp_schedule_runs: int = Field(default=1, ge=1, le=BOUNDS["global_batch"].value)
    linear_dtype: Optional[Literal["fp8"]] = None
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    fp8_all_gather: bool = False
    fp8_output_layer: bool = False
    moe_capacity_factor: Optional[float] = Field(default=None, gt=0)
    moe_dropless: Optional[bool] = None
    moe_hottest_expert_share: Optional[float] = Field(default=None, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _framework_padding(cls, data):
        """``vocab_pad_divisor`` unset: the framework's (class docstring).

        >>> TrainingSpec(global_batch=8, seq_len=16).vocab_pad_divisor
        1
        >>> TrainingSpec(global_batch=8, seq_len=16, framework="megatron").vocab_pad_divisor
        128
        """
        if isinstance(data, dict) and data.get("vocab_pad_divisor") is None:
            data = {**data, "vocab_pad_divisor": 128 if data.get("framework") == "megatron" else 1}
        return data

    @model_validator(mode="before")
    @classmethod
    def _runtime_param_dtype(cls, data):
        """``param_dtype`` unset: the dtype the runtime keeps the parameters in. ``fp32`` under
        ``framework = "torch"`` with FSDP2 (sharding zero3 or hsdp, ``zero3_engine = "fsdp2"``) or
        DDP (sharding none), the runtimes torch has: torchtitan builds the model
        in ``training.dtype``, default ``"float32"`` (``torchtitan/trainer.py:358``,
        ``utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype])``;
        ``torchtitan/config/configs.py:87``), and mixed precision is FSDP2's
        ``MixedPrecisionPolicy(param_dtype=mixed_precision_param, reduce_dtype=...)``
        (``torchtitan/distributed/fsdp.py``; pytorch/torchtitan at b5bcd76): fp32 shards, bf16
        all-gathers and compute, no separate master copy (DDP: ``torch.autocast``). ``bf16``
        under Megatron-LM (``--bf16``: bf16 model, fp32 main parameters in the optimizer), its
        distributed optimizer that meshplan plans for zero1/zero2 under torch without DeepSpeed
        (:attr:`has_zero1_engine`), and DeepSpeed's engines (bf16 model, fp32 master partition).

        >>> [TrainingSpec(global_batch=8, seq_len=16, sharding=s).param_dtype for s in ("zero3", "hsdp", "none")]
        ['fp32', 'fp32', 'fp32']
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).param_dtype for kw in ({"framework": "megatron"},
        ...  {"sharding": "zero1"}, {"sharding": "zero2", "zero12_engine": "deepspeed"},
        ...  {"zero3_engine": "deepspeed-2021"})]
        ['bf16', 'bf16', 'bf16', 'bf16']
        """
        if isinstance(data, dict) and data.get("param_dtype") is None:
            torch = data.get("framework", "torch") == "torch" and data.get("sharding", "zero3") in ("none", "zero3", "hsdp") \
                and data.get("zero3_engine", "fsdp2") == "fsdp2"
            data = {**data, "param_dtype": "fp32" if torch else "bf16"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_grads(cls, data):
        """``grad_dtype`` unset under a DeepSpeed engine (``zero3_engine`` ``deepspeed`` or ``deepspeed-2021``, or
        ``zero12_engine = "deepspeed"`` with sharding zero1 or zero2): DeepSpeed's, by
        :func:`deepspeed_grad_dtype`, the one rule the DeepSpeed JSON reader applies too.

        >>> TrainingSpec(global_batch=8, seq_len=16, param_dtype="fp16", zero3_engine="deepspeed-2021").grad_dtype
        'fp16'
        >>> TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed-2021", grad_dtype="fp32").grad_dtype
        'fp32'
        >>> [TrainingSpec(global_batch=8, seq_len=16, sharding=s, zero12_engine="deepspeed").grad_dtype
        ...  for s in ("zero1", "zero2")]
        ['bf16', 'bf16']
        """
        if not isinstance(data, dict) or data.get("grad_dtype") is not None:
            return data
        stage = {"zero1": 1, "zero2": 2}.get(data.get("sharding", "zero3")) \
            if data.get("zero12_engine") == "deepspeed" else 3 if data.get("zero3_engine") in DEEPSPEED_ZERO3 else None
        if stage is not None:
            data = {**data, "grad_dtype": deepspeed_grad_dtype(stage, data.get("param_dtype", "bf16"))}
        return data

    @model_validator(mode="after")
    def _check(self):
        if self.micro_batch > self.global_batch:
            raise ValueError(f"micro_batch {self.micro_batch} > global_batch {self.global_batch}")
        if self.ac_freq != 1 and self.recompute != "layer":
            raise ValueError(f"ac_freq is torchtitan's per-layer checkpointing interval; set recompute = \"layer\" "
                             f"or remove it (recompute is {self.recompute!r})")
        if self.compute_dtype == "fp8":
            raise ValueError("compute_dtype \"fp8\" would make activations, norms and gathers 1 byte; float8 "
                             "training runs only the Linear GEMMs in fp8 with bf16 activations: set compute_dtype = "
                             "\"bf16\" and linear_dtype = \"fp8\"")
        if (self.fp8_all_gather or self.fp8_output_layer or self.fp8_recipe != "tensorwise") \
                and self.linear_dtype != "fp8":
            key = "fp8_all_gather" if self.fp8_all_gather else "fp8_output_layer" if self.fp8_output_layer \
                else "fp8_recipe"
            raise ValueError(f"{key} applies to the float8 Linear layers; set linear_dtype = \"fp8\" or remove it")
        if self.torch_norm != "fused" and self.framework != "torch":
            raise ValueError("torch_norm is the RMSNorm module of framework \"torch\" (Megatron-LM runs its own "
                             "kernels): remove it")
        if self.fp8_all_gather and self.fp8_recipe == "rowwise":
            raise ValueError("fp8_all_gather is tensorwise scaling only (torchtitan refuses it with a rowwise "
                             "recipe_name): remove it or set fp8_recipe = \"tensorwise\"")
        if self.fp8_all_gather and self.sharding not in ("zero3", "hsdp"):
            raise ValueError(f"fp8_all_gather is FSDP2's float8 all-gather (sharding zero3 or hsdp); sharding "
                             f"{self.sharding!r} gathers nothing: remove it")
        if self.zero3_engine != "fsdp2" and self.sharding != "zero3":
            raise ValueError(f"zero3_engine {self.zero3_engine!r} is DeepSpeed's ZeRO stage 3 (sharding zero3); "
                             f"sharding {self.sharding!r} has no parameter gathers: remove the key")
        if self.zero3_engine != "fsdp2" and (self.grad_accumulation != "sync" or not self.reshard_after_forward
                                             or self.fp8_all_gather):
            raise ValueError(f"zero3_engine {self.zero3_engine!r} gathers every parameter in forward and again in "
                             "backward and reduces every micro-batch: remove grad_accumulation, reshard_after_forward "
                             "and fp8_all_gather (FSDP2 options)")
        if self.contiguous_gradients and self.sharding != "zero3" and not self.deepspeed_zero12:
            raise ValueError(f"contiguous_gradients is DeepSpeed's zero_optimization.contiguous_gradients (sharding "
                             f"zero3, or zero1/zero2 with zero12_engine = \"deepspeed\"); sharding {self.sharding!r}"
                             f" under zero12_engine {self.zero12_engine!r}: remove it")
        if self.zero0_engine != "ddp" and self.sharding != "none":
            raise ValueError(f"zero0_engine {self.zero0_engine!r} is DeepSpeed's engine without ZeRO (sharding none); "
                             f"sharding {self.sharding!r}: remove the key (zero12_engine or zero3_engine name its engine)")
        if self.zero12_engine != "megatron" and self.sharding not in ("zero1", "zero2"):
            raise ValueError(f"zero12_engine {self.zero12_engine!r} is DeepSpeed's ZeRO stage 1/2 (sharding zero1 or "
                             f"zero2); sharding {self.sharding!r} does not run it: remove the key")
        if self.overlap_comm and self.zero12_engine != "deepspeed" and self.zero3_engine != "deepspeed":
            raise ValueError("overlap_comm is DeepSpeed's zero_optimization.overlap_comm (sharding zero1 or zero2 with "
                             "zero12_engine = \"deepspeed\", or zero3 with zero3_engine = \"deepspeed\"): set the "
                             "engine or remove it")
        self._check_megatron_overlap()
        if self.tp_comm_overlap and self.framework == "torch" and not self.torch_compile:
            raise ValueError("tp_comm_overlap under framework \"torch\" is torchtitan's async TP, which needs "
                             "torch.compile (torchtitan raises \"Async TP requires torch.compile\"): set "
                             "torch_compile = true, or remove tp_comm_overlap")
        if not self.torch_compile_loss and not self.torch_compile:
            raise ValueError("torch_compile_loss = false leaves the loss eager beside a compiled model; without "
                             "torch_compile everything runs eagerly already: remove the key")
        if self.optimizer_impl != "fused" and self.framework != "torch":
            raise ValueError(f"optimizer_impl {self.optimizer_impl!r} is torch's multi-tensor Adam; framework "
                             f"{self.framework!r} runs apex/TE's fused Adam: remove the key")
        if self.torch_compile and self.framework != "torch":
            raise ValueError(f"torch_compile is torch.compile of a torch model; framework {self.framework!r} runs its "
                             f"own kernels: remove the key")
        if self.reshard_head_after_forward and not (self.torchtitan_units and self.reshard_after_forward):
            raise ValueError("reshard_head_after_forward is torchtitan's fsdp_reshard_after_forward = \"always\" "
                             "(framework torch, sharding zero3 or hsdp with FSDP2, reshard_after_forward true); "
                             f"here framework {self.framework!r}, sharding {self.sharding!r}, reshard_after_forward "
                             f"{str(self.reshard_after_forward).lower()}: remove it")
        if self.grad_accumulation != "sync" and self.sharding not in ("zero3", "hsdp"):
            raise ValueError(f"grad_accumulation {self.grad_accumulation!r} is an FSDP2 mode (sharding zero3 or "
                             f"hsdp); sharding {self.sharding!r} keeps the default 'sync': remove the key")
        if self.pp_schedule_runs > 1 and self.framework != "torch":
            raise ValueError(f"pp_schedule_runs {self.pp_schedule_runs} is torchtitan's gradient accumulation under pp "
                             f"(one schedule.step() per accumulation step); framework {self.framework!r} runs one "
                             f"schedule over the step's micro-batches: remove the key")
        return self

    def _check_megatron_overlap(self) -> None:
        """``overlap_grad_reduce`` / ``overlap_param_gather`` only where Megatron-LM's DDP buffers
        run (class docstring), the second only with the first and the distributed optimizer;
        ``megatron_fsdp`` only under Megatron-LM's own engines."""
        if self.megatron_fsdp and (self.framework != "megatron" or self.zero12_engine != "megatron"
                                   or self.zero3_engine != "fsdp2" or self.zero0_engine != "ddp"):
            raise ValueError("megatron_fsdp is Megatron-LM's --use-megatron-fsdp (framework \"megatron\", without a "
                             "DeepSpeed engine): remove it or set framework = \"megatron\"")
        key = "overlap_grad_reduce" if self.overlap_grad_reduce else "overlap_param_gather"
        if not (self.overlap_grad_reduce or self.overlap_param_gather):
            return
        if self.framework != "megatron":
            raise ValueError(f"{key} is Megatron-LM's --{key.replace('_', '-')} (framework \"megatron\"); framework "
                             f"{self.framework!r} overlaps its reductions as its runtime does: remove it")
        if self.sharding not in ("none", "zero1") or self.zero12_engine != "megatron":
            runs = "runs DeepSpeed's engine (overlap_comm)" if self.zero12_engine != "megatron" else \
                "runs Megatron FSDP, which forces both on"
            raise ValueError(f"{key} applies to Megatron-LM's DDP buffers (sharding none or zero1, zero12_engine "
                             f"\"megatron\"); sharding {self.sharding!r} {runs}: remove it")
        if self.overlap_param_gather and not (self.overlap_grad_reduce and self.sharding == "zero1"):
            raise ValueError("overlap_param_gather needs overlap_grad_reduce and sharding \"zero1\" (Megatron-LM asserts "
                             "--overlap-grad-reduce and --use-distributed-optimizer): set them or remove it")

    def layer_recomputed(self, position: int) -> bool:
        """Whether the layer at ``position`` (0-based, among the rank's stage layers) is
        checkpointed in full: every layer under ``full``, every ``ac_freq``-th under ``layer``.

        >>> t = TrainingSpec(global_batch=8, seq_len=16, recompute="layer", ac_freq=3)
        >>> [t.layer_recomputed(i) for i in range(6)]
        [False, False, True, False, False, True]
        """
        if self.recompute == "layer":
            return (position + 1) % self.ac_freq == 0
        return self.recompute == "full"

    @property
    def torchtitan_units(self) -> bool:
        """Whether the model's ends are FSDP2 units as torchtitan wraps them (framework torch,
        FSDP2 sharding): the embedding one unit, resharded after forward as the layers are,
        ``[norm, output]`` another, not resharded after forward unless
        ``reshard_head_after_forward`` (torchtitan
        ``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder`` at b5bcd76, 2026-08-21;
        these units since #1094, 83e6941), at every pp on the stages holding them (torchtitan
        applies it to each pipeline model part); tied embeddings: one unit of the three, resharded
        only with ``reshard_head_after_forward`` (under pp the first stage's embedding alone,
        likewise). DeepSpeed's ZeRO-3 (``zero3_engine = "deepspeed"``) has the same ends: it fetches
        each module's parameters at its own forward (``fetch_sub_module``), the embedding alone,
        released after it and fetched again in backward once the parameters used in between pass
        ``stage3_max_reuse_distance`` (1e9 elements; a model of more than 1e9 parameters), the
        output layer kept for its backward, which follows at once. Megatron and
        DeepSpeed-2021 keep one root unit of both ends.

        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3").torchtitan_units
        True
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero3_engine="deepspeed-2021").torchtitan_units
        False
        """
        return self.framework == "torch" and self.sharding in ("zero3", "hsdp") and self.zero3_engine != "deepspeed-2021"

    @property
    def searched_zero3_engine(self) -> str:
        """The engine a search's zero3 candidates run under (:func:`meshplan.search.candidate.candidate_config`):
        ``zero3_engine``, except that DeepSpeed's ZeRO-1/2 (``zero12_engine = "deepspeed"``, a DeepSpeed
        stage 1 or 2 config) and its engine without ZeRO (``zero0_engine = "deepspeed"``, stage 0) plan
        them with DeepSpeed's ZeRO-3, ``deepspeed``: the same runtime at
        another stage, not FSDP2.

        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").searched_zero3_engine
        'deepspeed'
        >>> TrainingSpec(global_batch=8, seq_len=16).searched_zero3_engine
        'fsdp2'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", zero0_engine="deepspeed").searched_zero3_engine
        'deepspeed'
        """
        deepspeed = self.zero12_engine == "deepspeed" or self.zero0_engine == "deepspeed"
        return "deepspeed" if self.zero3_engine == "fsdp2" and deepspeed else self.zero3_engine

    @property
    def searched_zero12_engine(self) -> str:
        """The engine a search's zero1 and zero2 candidates run under
        (:func:`meshplan.search.candidate.candidate_config`): ``zero12_engine``, except that DeepSpeed's
        ZeRO-3 (``zero3_engine = "deepspeed"``, a DeepSpeed stage 3 config) and its engine without
        ZeRO (``zero0_engine = "deepspeed"``, stage 0) plan them with
        DeepSpeed's ZeRO-1/2, ``deepspeed``: the same runtime at another ``zero_optimization.stage``,
        as :attr:`searched_zero3_engine` does the other way (ZeRO-3 of 2021 keeps ``megatron``:
        its DeepSpeed, v0.3.13-v0.5.4, predates the ZeRO-1/2 engine meshplan models, v0.12.4).

        >>> TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed").searched_zero12_engine
        'deepspeed'
        >>> TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed-2021").searched_zero12_engine
        'megatron'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", zero0_engine="deepspeed").searched_zero12_engine
        'deepspeed'
        """
        return "deepspeed" if self.zero3_engine == "deepspeed" or self.zero0_engine == "deepspeed" else self.zero12_engine

    def knob_acts(self, knob: str) -> tuple[bool, object]:
        """(whether plan knob ``knob``, a :data:`PLAN_KNOBS` field, applies to this training's
        sharding and engine, its value as it acts): ``zero3_engine`` at sharding zero3 only,
        ``zero12_engine`` at zero1 and zero2 only, ``overlap_comm`` under a DeepSpeed engine that
        reads it (:attr:`overlaps_comm`), ``contiguous_gradients`` under DeepSpeed's ZeRO-3
        (:attr:`contiguous_grads`); every other knob applies, as given. ``meshplan compare`` lists
        a knob only where it applies to both sides, by the value it acts with
        (:func:`meshplan.config.config_differences`).

        >>> z2 = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed")
        >>> z2.knob_acts("zero3_engine"), z2.knob_acts("overlap_comm"), z2.knob_acts("contiguous_gradients")
        ((False, 'fsdp2'), (True, False), (True, True))
        """
        value = getattr(self, knob)
        deepspeed3 = self.sharding == "zero3" and self.zero3_engine in DEEPSPEED_ZERO3
        if knob == "zero3_engine":
            return self.sharding == "zero3", value
        if knob == "zero12_engine":
            return self.sharding in ("zero1", "zero2"), value
        if knob == "overlap_comm":
            return self.zero12_engine == "deepspeed" or self.zero3_engine == "deepspeed", self.overlaps_comm
        if knob == "contiguous_gradients":
            acts = deepspeed3 or self.deepspeed_zero12
            return acts, self.contiguous_grads if acts else value
        return True, value

    @property
    def overlaps_comm(self) -> bool:
        """DeepSpeed's ``zero_optimization.overlap_comm`` in effect: ``overlap_comm`` when given,
        else DeepSpeed's default, true at stage 3 and false at stages 1 and 2
        (deepspeedai/DeepSpeed edaa722 ``runtime/zero/config.py:138`` ``overlap_comm: Optional[bool]
        = None`` and ``overlap_comm_valid``, 382-386: ``self.overlap_comm = self.stage ==
        ZeroStageEnum.weights``): true under ``zero3_engine = "deepspeed"``, false otherwise.

        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).overlaps_comm for kw in (
        ...  {"zero3_engine": "deepspeed"}, {"zero3_engine": "deepspeed", "overlap_comm": False},
        ...  {"sharding": "zero2", "zero12_engine": "deepspeed"}, {})]
        [True, False, False, False]
        """
        if self.overlap_comm is not None:
            return self.overlap_comm
        return self.sharding == "zero3" and self.zero3_engine == "deepspeed"

    @property
    def moe_routing(self) -> tuple[float, bool]:
        """The MoE routing as it resolves, (capacity factor, dropless): a capacity factor given
        means dropping with it; ``moe_dropless`` given is that choice (false: factor 1); neither
        given is the engine's own default, dropless under either framework: torchtitan's
        ``TokenChoiceTopKRouter`` and ``GroupedExperts`` run every routed copy (pytorch/torchtitan
        b5bcd76 ``torchtitan/models/common/moe.py``), and Megatron-LM's
        ``moe_expert_capacity_factor: Optional[float] = None`` ("None means no token will be
        dropped", NVIDIA/Megatron-LM d98e8a6 ``megatron/core/transformer/transformer_config.py``
        line 917; ``megatron/training/arguments.py`` line 2373 builds ``--moe-expert-capacity-factor``
        from that field with ``ArgumentGroupFactory(TransformerConfig)``). The one rule;
        :meth:`meshplan.compute.routing.RoutingOptions.of` and the exporters read it.

        >>> t = lambda **kw: TrainingSpec(global_batch=8, seq_len=16, **kw).moe_routing
        >>> t(), t(framework="megatron"), t(moe_capacity_factor=1.25), t(moe_dropless=False)
        ((1.0, True), (1.0, True), (1.25, False), (1.0, False))
        """
        f, d = self.moe_capacity_factor, self.moe_dropless
        dropless = d if d is not None else f is None
        return (1.0 if f is None else f), bool(dropless)

    @property
    def contiguous_grads(self) -> bool:
        """DeepSpeed's ``zero_optimization.contiguous_gradients`` in effect:
        ``contiguous_gradients`` when given, else the default of the engine's DeepSpeed: false
        under ``zero3_engine = "deepspeed-2021"`` (v0.3.12-v0.4.2), true under ``deepspeed`` and
        under DeepSpeed's ZeRO-1/2 (``zero12_engine = "deepspeed"``; edaa722
        ``runtime/zero/config.py:102``, ``contiguous_gradients: bool = True``, one field for every stage).

        >>> [TrainingSpec(global_batch=8, seq_len=16, zero3_engine=e).contiguous_grads for e in ("deepspeed", "deepspeed-2021")]
        [True, False]
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").contiguous_grads
        True
        """
        if self.contiguous_gradients is not None:
            return self.contiguous_gradients
        return self.zero3_engine == "deepspeed" or self.deepspeed_zero12

    @property
    def deepspeed_zero12(self) -> bool:
        """Whether DeepSpeed's ZeRO-1/2 engine runs this training: sharding zero1 or zero2 under
        ``zero12_engine = "deepspeed"``."""
        return self.sharding in ("zero1", "zero2") and self.zero12_engine == "deepspeed"

    @property
    def has_op_recompute(self) -> bool:
        """Whether the training's framework has torchtitan's op-level selective AC
        (``recompute = "op"``): torch with FSDP2, not Megatron-LM nor either DeepSpeed engine
        (ZeRO-3 of 2021, or ZeRO-1/2 under ``zero12_engine = "deepspeed"``: DeepSpeed's config has
        no key for it, so an export to it could not say it); what ``meshplan search`` tries.

        >>> TrainingSpec(global_batch=8, seq_len=16).has_op_recompute
        True
        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).has_op_recompute for kw in (
        ...  {"framework": "megatron"}, {"sharding": "zero1", "zero12_engine": "deepspeed"})]
        [False, False]
        """
        return not self.op_recompute_blocker

    @property
    def op_recompute_blocker(self) -> str:
        """The field whose runtime has no op-level selective AC (:attr:`has_op_recompute`):
        ``framework`` (Megatron-LM), ``zero12_engine`` (DeepSpeed's ZeRO-1/2), ``zero0_engine``
        (DeepSpeed without ZeRO), ``zero3_engine`` (DeepSpeed's ZeRO-3); empty where the runtime has it.

        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").op_recompute_blocker
        'zero12_engine'
        """
        if self.framework != "torch":
            return "framework"
        if self.zero12_engine != "megatron":
            return "zero12_engine"
        if self.zero0_engine != "ddp":
            return "zero0_engine"
        return "zero3_engine" if self.zero3_engine != "fsdp2" else ""

    @property
    def has_zero1_engine(self) -> bool:
        """Whether a runtime runs sharding ``zero1`` (optimizer state and master weights sharded,
        parameters and gradients whole) under this training: not under ``framework = "torch"``
        without DeepSpeed's engine (``zero12_engine = "deepspeed"``). meshplan's zero1 under the
        default ``zero12_engine = "megatron"`` is Megatron-LM's distributed optimizer (one
        reduce-scatter of the gradient buffer, one all-gather of the parameters per step); torch
        has no such engine: FSDP2's ``fully_shard`` always shards the parameters
        (``reshard_after_forward=False`` keeps them gathered between forward and backward,
        ZeRO-2-like, torch 2.13 ``distributed/fsdp/_fully_shard/_fully_shard.py``), torch's
        ``ZeroRedundancyOptimizer`` runs under DDP (every gradient all-reduced, then the updated
        shards broadcast: not the collectives meshplan plans for zero1), torchtitan has no key for
        either and meshplan's own runtime does not build it
        (:mod:`meshplan.runtime.execution.parallelize`). The search rejects zero1 candidates where
        it is false (rule ``framework``), plan and step warn.

        >>> [TrainingSpec(global_batch=8, seq_len=16, **kw).has_zero1_engine for kw in
        ...  ({}, {"framework": "megatron"}, {"sharding": "zero1", "zero12_engine": "deepspeed"})]
        [False, True, True]
        """
        return self.framework != "torch" or self.searched_zero12_engine == "deepspeed"

    @property
    def recompute_name(self) -> str:
        """The recompute policy in its runtime's words, the runtime told by this training alone
        (:func:`meshplan.spec.wording.runtime`; the text of a config read from a DeepSpeed JSON
        passes its origin there).

        >>> TrainingSpec(global_batch=8, seq_len=16, flash_attention=False).recompute_name
        'Megatron-LM selective recompute (--recompute-activations: attention core)'
        """
        return recompute_words(self, runtime(self))

    def float8_linear(self, tensor) -> bool:
        """Whether the GEMMs of weight ``tensor`` (a :class:`~meshplan.spec.model.Tensor`) run in
        float8 (``linear_dtype = "fp8"``): the one rule for the GEMM timing and the float8
        all-gather. As torchtitan's ``module_filter_fn`` (components/quantization/utils.py):
        ``nn.Linear`` weights (:data:`LINEAR_WEIGHTS`) whose two dims are multiples of 16
        (float8 tensor cores), not filtered: the output layer only with ``fp8_output_layer``;
        under ``framework = "megatron"`` the router stays in the compute dtype (Megatron-Core's
        ``TopKRouter`` multiplies with ``torch.nn.functional.linear``, not a Transformer Engine
        linear).

        >>> from meshplan.spec.model import Tensor
        >>> t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8")
        >>> [t.float8_linear(Tensor(n, r * c, "column", rows=r)) for n, r, c in
        ...  [("wq", 64, 32), ("router", 60, 32), ("attn_norm", 32, 1), ("output", 128, 32)]]
        [True, False, False, False]
        """
        if self.linear_dtype != "fp8" or tensor.name not in LINEAR_WEIGHTS:
            return False
        if (tensor.name == "output" and not self.fp8_output_layer) or (
                tensor.name == "router" and self.framework == "megatron"):
            return False
        rows = tensor.rows or tensor.numel
        return rows % 16 == 0 and (tensor.numel // rows) % 16 == 0

    def gather_dtype(self, tensor) -> Dtype:
        """The dtype FSDP2 all-gathers one weight in (a :class:`~meshplan.spec.model.Tensor`):
        float8 for a float8 Linear weight (:meth:`float8_linear`) under ``fp8_all_gather``
        (not a tied output layer: that weight is the embedding's), else the compute dtype.

        >>> from meshplan.spec.model import Tensor
        >>> t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8", fp8_all_gather=True)
        >>> [t.gather_dtype(Tensor(n, 16 * r, s, rows=r)) for n, r, s in [("wq", 64, "column"),
        ...  ("wo_bias", 1, "replicated"), ("attn_norm", 1, "replicated"), ("output", 128, "vocab")]]
        ['fp8', 'bf16', 'bf16', 'bf16']
        """
        if self.fp8_all_gather and self.float8_linear(tensor) and not tensor.tied:
            return "fp8"
        return self.compute_dtype

    @property
    def float8_tp_gathers(self) -> bool:
        """Whether TP (under sequence parallelism) all-gathers the float8 Linears' inputs and
        output gradients in float8: float8 Linears (``linear_dtype``) with tensorwise scaling
        (``fp8_recipe``) under ``framework = "torch"``. torchtitan applies torchao's float8 TP
        styles then (9dec370 ``parallelisms/parallelize_llama.py`` ``apply_tp``; 820504e
        ``models/llama3/parallelize_llama.py``: ``enable_float8_tensorwise_tp = enable_float8_linear
        and not float8_is_rowwise``), and torchao (eab345c ``torchao/float8/float8_tensor_parallel.py``)
        casts before the redistribute: ``PrepareFloat8ModuleInput`` casts the attention's and the
        MLP's Shard(1) input to float8 e4m3 before its Shard(1) -> Replicate all-gather ("so that
        if there are multiple float8 users of the input activation, we perform fp8 allgather only
        once"); ``Float8RowwiseParallel._prepare_output_fn`` reduce-scatters the wo / w2 output
        in the compute dtype, then wraps it in ``NoopFwToFloat8BwDynamic`` (backward: cast to
        float8 e5m2), so backward casts the output gradient before the reduce-scatter's mirror
        all-gather; the float8 tensor's all-gather moves its 1-byte data (``float8_ops.py``
        ``allgather_fp8``). The input gradients stay in the compute dtype (the float8 cast's
        backward passes the gradient through), so the reduce-scatters do. Not the embedding's
        and the output layer's collectives (plain ``RowwiseParallel`` / ``ColwiseParallel``).

        >>> t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8")
        >>> t.float8_tp_gathers, t.model_copy(update={"fp8_recipe": "rowwise"}).float8_tp_gathers
        (True, False)
        """
        return self.linear_dtype == "fp8" and self.fp8_recipe == "tensorwise" and self.framework == "torch"

    @property
    def peak_dtype(self) -> Dtype:
        """The dtype whose dense peak MFU divides by: fp8 when the Linear GEMMs run in fp8
        (``linear_dtype``; the bound they run against), else the compute dtype. torchtitan's
        own MFU divides by the bf16 peak in both cases (``get_peak_flops``)."""
        return self.linear_dtype or self.compute_dtype

    @property
    def optimizer_states(self) -> int:
        """Optimizer state tensors per parameter: Adam keeps two moments (Kingma & Ba 2015)."""
        return 2 if self.optimizer in ("adam", "adamw") else 0

    @property
    def keeps_master(self) -> bool:
        """An fp32 master copy exists when parameters are stored below fp32."""
        return self.master_weights and self.param_dtype != "fp32"

    @property
    def fsdp_reduce_dtype(self) -> Dtype:
        """The dtype of the FSDP reduce-scatter (and HSDP's all-reduce of its output) of a
        zero3/hsdp plan under this training, whatever sharding ``training`` itself names (the
        search asks it for candidates of every sharding): ``grad_reduce_dtype`` when set, else
        the parameter dtype under DeepSpeed's ZeRO-3 (:attr:`searched_zero3_engine`: it reduces in
        ``communication_data_type``, unset the model's dtype),
        else ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``). It is
        :attr:`gradient_reduce_dtype` of the zero3/hsdp plan: the one rule for the collective
        table's FSDP rows, the memory timeline's reduce-scatter input, FSDP2's copy-in and the
        search's bounds and timing.

        >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="hsdp", grad_reduce_dtype="bf16")
        >>> t.fsdp_reduce_dtype, t.reduce_dtype, t.gradient_reduce_dtype
        ('bf16', 'fp32', 'bf16')
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none").fsdp_reduce_dtype
        'fp32'
        """
        if self.grad_reduce_dtype is not None:
            return self.param_dtype if self.grad_reduce_dtype == "param" else self.grad_reduce_dtype
        if self.sharding != "hsdp" and self.searched_zero3_engine != "fsdp2":  # DeepSpeed's communication_data_type
            return self.param_dtype  # unset (its zero3 rows under DeepSpeed's ZeRO-1/2 too: searched_zero3_engine)
        return self.reduce_dtype

    @property
    def zero12_reduce_dtype(self) -> Dtype:
        """The dtype of a zero1/zero2 plan's gradient reduction under this training, whatever
        sharding ``training`` itself names (the search asks it for its zero1 candidates):
        ``grad_reduce_dtype`` when set, else the parameter dtype under ``zero12_engine =
        "deepspeed"`` (DeepSpeed's ``communication_data_type`` unset), else ``reduce_dtype``. It
        is :attr:`gradient_reduce_dtype` of the zero1/zero2 plan: the collective table's
        reduce-scatter (or DeepSpeed's bucket all-reduces) and the search's timing.

        >>> t = TrainingSpec(global_batch=8, seq_len=16, grad_reduce_dtype="bf16")
        >>> t.zero12_reduce_dtype, t.model_copy(update={"sharding": "zero1"}).gradient_reduce_dtype, t.reduce_dtype
        ('bf16', 'bf16', 'fp32')
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed").zero12_reduce_dtype
        'bf16'
        """
        if self.grad_reduce_dtype is not None:
            return self.param_dtype if self.grad_reduce_dtype == "param" else self.grad_reduce_dtype
        # DeepSpeed: communication_data_type unset is the model's dtype (engine.py
        # ``communication_data_type``: fp16 / bf16 when enabled, else fp32)
        return self.param_dtype if self.zero12_engine == "deepspeed" else self.reduce_dtype

    @property
    def gradient_reduce_dtype(self) -> Dtype:
        """The dtype gradients are reduced in over the data axes (see ``grad_reduce_dtype``).

        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none").gradient_reduce_dtype  # torch: fp32 params
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", param_dtype="bf16").gradient_reduce_dtype
        'bf16'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", grad_reduce_dtype="fp32").gradient_reduce_dtype
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3").gradient_reduce_dtype
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", framework="megatron").gradient_reduce_dtype
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, param_dtype="fp16", zero3_engine="deepspeed-2021").gradient_reduce_dtype
        'fp16'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed").gradient_reduce_dtype
        'bf16'
        """
        if self.sharding in ("zero3", "hsdp"):
            return self.fsdp_reduce_dtype
        if self.sharding in ("zero1", "zero2"):
            return self.zero12_reduce_dtype
        if self.grad_reduce_dtype is None:  # DDP (sharding none)
            return "fp32" if self.framework == "megatron" and self.param_dtype == "bf16" else self.param_dtype
        return self.param_dtype if self.grad_reduce_dtype == "param" else self.grad_reduce_dtype
