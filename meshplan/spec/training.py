"""Training contract: batch, sequence, dtypes, optimizer, sharding, recompute, reserve.

The class the rest of meshplan uses, :class:`TrainingSpec`, documents every field and checks
their combinations; it is built in layers, one module per concern: the fields and their
framework defaults (:mod:`meshplan.spec.training_fields`), the engine rules
(:mod:`meshplan.spec.training_engines`), the precision rules
(:mod:`meshplan.spec.training_precision`), the checks of the fields' combinations
(:mod:`meshplan.spec.training_checks`).
"""

from __future__ import annotations

from meshplan.spec.training_checks import TrainingChecks


class TrainingSpec(TrainingChecks):
    """What one optimizer step must do and how state is kept.

    ``global_batch``: sequences per optimizer step; ``seq_len``: tokens per sequence;
    ``micro_batch``: sequences per data-parallel rank per forward pass.
    ``sharding``: ``none`` (DDP), ``zero1`` (optimizer state and fp32 master sharded),
    ``zero2`` (+ gradients), ``zero3`` (+ parameters: FSDP, ``reshard_after_forward``
    chooses ZeRO-3 (true) or keeps gathered parameters from forward to backward (false); unset, it
    follows the runtime at each mesh's pp: false under framework torch with FSDP2 and pp > 1, as
    torchtitan runs it, else true: :meth:`reshard_default`, resolved by :meth:`at_pp`),
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
    ``megatron_runtime`` (framework ``megatron``): the Megatron-LM generation the step model
    follows where they differ, ``"2022"`` (NVIDIA/Megatron-LM 2755bcb, June 2022: ``get_batch``
    with its mask kernels and timer syncs in every chunk on every stage, the SP embedding
    all-reduced, the step timers' and three syncs per pipeline p2p call) or ``"core"`` (Megatron
    Core at d98e8a6: ``get_batch`` on the first and last stages only, each tensor copied and
    broadcast on its own, the embedding reduce-scattered under SP, no timer syncs, one sync per
    blocking p2p call; :mod:`meshplan.compute.megatron_core` lists each difference with its source
    lines, and what stays 2022's). Unset: ``"2022"``, the generation the development set's runs
    measured (Korthikanti et al. 2022, Narayanan et al. 2021), so that the accuracy meshplan reports
    is the accuracy of what it runs; ``meshplan import megatron`` of a current script sets ``"core"``.
    ``dataloader_attention_mask`` (``megatron_runtime = "core"``): the data loader builds the
    ``[b, 1, s, s]`` boolean attention mask that ``get_batch`` copies and broadcasts (Megatron-LM's
    ``--create-attention-mask-in-dataloader``; unset: true, its default; false:
    ``--no-create-attention-mask-in-dataloader``).
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
    coalesced gathers (a module's parameters gathered as one flat buffer, ``all_gather_coalesced``),
    one coalesced reduce-scatter per ipg bucket of ``reduce_bucket_size`` gradients
    (:mod:`meshplan.comm.deepspeed_ipg`), gradients kept and reduced in the parameter dtype as above, and
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
    ``zero_hpz_partition_size``, ``zero_quantized_weights``, ``zero_quantized_gradients``
    (``zero3_engine = "deepspeed"`` only): DeepSpeed ZeRO++'s hpZ (a secondary parameter partition
    over that many consecutive ranks; default 1, none), qwZ (int8 parameter all-gathers) and qgZ
    (across nodes, int4 all-to-alls in place of the gradient reduce-scatter), as DeepSpeed runs them
    (:mod:`meshplan.comm.zeropp`; docs/input.md "DeepSpeed ZeRO++").
    ``zero0_engine`` (sharding none): ``ddp`` or ``deepspeed``, DeepSpeed's engine without ZeRO
    (what a DeepSpeed stage 0 config imports to). It changes nothing in the plan of sharding none
    (one data-parallel all-reduce of the gradients either way); it tells a search which runtime the
    config runs, so that its zero1 and zero2 rows run DeepSpeed's ZeRO-1/2 and its zero3 rows its
    ZeRO-3 (:attr:`searched_zero12_engine`, :attr:`searched_zero3_engine`), as the search of a
    stage 1, 2 or 3 DeepSpeed config plans them: the stages a DeepSpeed user switches to by
    changing ``zero_optimization.stage``. Not with bf16 parameters (a config error): DeepSpeed then
    runs ``BF16_Optimizer``, written sharding ``zero1`` under ``zero12_engine = "deepspeed"`` with
    ``grad_dtype = "fp32"`` (:attr:`bf16_optimizer`).
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
    ``offload_optimizer`` (DeepSpeed's ZeRO-1/2/3 engines): ``cpu`` is DeepSpeed's
    ``zero_optimization.offload_optimizer.device = "cpu"`` (ZeRO-Offload): the fp32 master
    weights, Adam's moments and the fp32 gradient partition live in pinned host memory, the step
    runs DeepSpeedCPUAdam on the host and copies the updated 16-bit partition back
    (:mod:`meshplan.memory.offload`); ``none`` (default) keeps them on the GPU.
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
    waited for; with virtual stages (``align_param_gather``, Megatron-LM's default there) the
    schedule issues chunks 0 and 1's buckets before the forward, which waits for chunk 0's whole
    gather (:func:`meshplan.schedule.step_end.param_gather_exposed_s`) (NVIDIA/Megatron-LM d98e8a6 ``megatron/core/distributed/distributed_data_parallel.py``
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
    ``grad_clip_norm``: the norm the gradients are clipped to (unset: 1.0, the default of all
    three: torchtitan ``training.max_norm``, Megatron-LM ``--clip-grad``, DeepSpeed
    ``gradient_clipping`` since v0.19.3); it changes no time or memory, only what an export
    writes, so an imported ``--clip-grad 0.3`` is exported as 0.3, not dropped to the default.
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
    ``pp_p2p_overlap`` (``framework = "megatron"``, pp > 1): Megatron-LM's ``overlap_p2p_comm``,
    on unless ``--no-overlap-p2p-communication`` (``arguments.py:3118-3120`` at NVIDIA/Megatron-LM
    d98e8a6, ``store_false``; the default since 4eeff55, 2023-10-12; added in f9283c5, 2023-05-31,
    so Megatron-LM 2022 ran without it: set false for such runs). Unset: on. Under the
    interleaved schedule the steady state's sends and receives are issued without waiting and
    each receive is waited for just before the unit that needs it; the warm-up and cool-down
    calls still wait (:meth:`meshplan.pipeline.interleaved.Interleaved1F1B.p2p_calls`). Without
    interleaving Megatron-LM turns it off (``arguments.py:1010-1018``), so 1F1B's calls wait
    either way; at pp 2 Megatron-LM refuses interleaving without it (``arguments.py:1005-1009``).
    ``pp_p2p_overlap_warmup_flush``: its ``--overlap-p2p-communication-warmup-flush`` (default off;
    ``model_parallel_config.py:422-428``, refused without overlap, 570-575): the warm-up and
    cool-down calls too are issued without waiting, every transfer asynchronous. Under framework
    torch, ``torch.distributed.pipelining`` waits where its schedule class does, with no such flag
    (:func:`meshplan.schedule.overlap_policy.p2p_mode`): ``pp_p2p_overlap = false`` is refused there.
    ``pp_ep_overlap`` (framework torch, DualPipeV with pp > 1 and ep > 1): torchtitan's
    ``parallelism.pipeline_parallel_expert_parallel_overlap`` (default true, pytorch/torchtitan e347b1e
    ``torchtitan/config/job_config.py``:420): the schedule's forward/backward pairs run as one
    ``OVERLAP_F_B`` action, the ep all-to-alls of one micro-batch beside the other's compute
    (:mod:`meshplan.pipeline.dualpipev`); with activation checkpointing torchtitan raises
    NotImplementedError (``distributed/dual_pipe_v.py``:32-53), an infeasible plan
    (:func:`meshplan.plan_runtime.dualpipev_ep_ac_reasons`); false runs the pairs one after the other.
    ``pp_engine``: who runs the pipeline: ``framework`` (default: Megatron-LM's or torch's own
    schedule) or ``deepspeed``, DeepSpeed's ``PipelineEngine`` running Megatron-DeepSpeed's
    ``GPTModelPipe`` (framework ``megatron`` under ``zero0_engine`` or ``zero12_engine = "deepspeed"``):
    its ``TrainSchedule`` (1F1B, one chunk a stage, each send and receive a blocking call of its
    own, :attr:`meshplan.pipeline.sim_types.PipelineSpec.serial_p2p`), the
    tp-partitioned activations rebuilt on every use, with one more all-gather of each stage's own
    output in backward, and, with bf16 and fp32 gradients, ``BF16_Optimizer``'s fp32 accumulation
    after every micro-batch (:mod:`meshplan.compute.deepspeed_pipe`); Megatron-LM's p2p timer syncs
    are not run under it.
    ``recompute`` (activation checkpointing): ``selective`` and ``full`` as Megatron-LM
    (``--recompute-activations``: the attention core; ``--recompute-granularity full``: every
    layer keeps its input only); ``layer`` and ``op`` as torchtitan's selective AC
    (``[activation_checkpoint] mode = "selective"``): ``layer`` checkpoints every
    ``ac_freq``-th layer in full (``selective_ac_option = "<ac_freq>"``: torchtitan counts
    the blocks it wraps, 1-based, and wraps those whose count is a multiple of ac_freq; the
    count runs over the rank's own layers), ``op`` saves the outputs of matmuls (all but every
    second mm of a layer), of SDPA and of reduce-scatters, and recomputes the rest
    (``selective_ac_option = "op"``). ``recompute_num_layers`` n (``full`` under framework megatron):
    Megatron-LM's block recompute (``--recompute-method block --recompute-num-layers n``), the first n
    layers of each model chunk checkpointed in full, the others keeping all their activations
    (:meth:`layer_recomputed`); unset, every layer (``--recompute-method uniform
    --recompute-num-layers 1``; uniform with n > 1, n layers under one checkpoint, is planned as that
    too). :attr:`recompute_name` names each in the runtime's words
    (:mod:`meshplan.spec.recompute_words`).
    ``recompute_modules`` (``selective`` under ``framework = "megatron"``): Megatron-LM's
    ``--recompute-modules``, default ``("core_attn",)``; which activations each module does not keep
    and which forward kernels it replays: :mod:`meshplan.spec.recompute_modules` (docs/input.md).
    ``grad_dtype``, ``optimizer_dtype``, ``master_dtype``: what the persistent state keeps per
    parameter (:mod:`meshplan.memory.state`): the gradient buffer's dtype, both Adam moments', and
    the master copy's (``master_weights``, below fp32 parameters): ``fp32`` (default), ``fp16`` or
    ``int16``, Transformer Engine's ``FusedAdam`` keeping only the 16 low bits of the fp32 master
    beside a bf16 parameter (:attr:`master_bytes`). Megatron-LM's ``--use-precision-aware-optimizer``
    sets them (``--main-grads-dtype``, ``--exp-avg-dtype``/``--exp-avg-sq-dtype``,
    ``--main-params-dtype``: :mod:`meshplan.interop.megatron_precision`).
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
    ``fp8_tp``: whether torchtitan applies torchao's float8 TP styles to the tensorwise float8
    Linears (default true, :meth:`float8_tp_gathers`); false: torch's plain TP, the gathers in
    the compute dtype and the casts after them, as under rowwise. torchtitan's parallelize checks
    the converter name ``"float8"`` (``enable_float8_linear = "float8" in
    job_config.model.converters``, ``models/llama3/infra/parallelize.py``:77 at 73a0e69, v0.2.2),
    which its registry renamed ``"quantize.linear.float8"`` (8a2686c, 2025-09-30): a job TOML with
    that name runs its float8 GEMMs under plain TP (:mod:`meshplan.interop.torchtitan_float8`).
    ``fp8_param_gather``: Megatron-LM's ``--fp8-param-gather`` (framework megatron, sharding zero1):
    Transformer Engine's linear weights are fp8 parameters (1 B a value, with their transpose on a
    TN-only GPU, no bf16 copy) and the distributed optimizer all-gathers them at 1 B a value
    (:mod:`meshplan.memory.te_fp8`).
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
    ``cp_attention`` (cp > 1): ``ring``, torch's ``context_parallel`` ring attention as torchtitan
    runs it (torch 2.13 ``_templated_ring_attention``: per layer one all-gather of the local K and
    V after ``repeat_kv``, at the q heads, in the compute dtype; its backward gathers them again
    and shifts the fp32 dK/dV accumulators round the cp ring, cp all-to-alls;
    :func:`meshplan.spec.axes.cp.cp_rows`), or ``allgather``, Llama 3's all-gather CP as
    meshplan's own runtime runs it (K and V at the KV heads gathered, dK/dV reduce-scattered), the
    only one ``validate`` runs, or ``p2p``, Transformer Engine's p2p ring as Megatron-LM runs it
    (``--cp-comm-type p2p``: the local K/V at the KV heads sent to the next cp rank beside each of
    cp attention steps, the backward sending K/V and dK/dV in the compute dtype;
    :func:`meshplan.spec.axes.cp.p2p_rows`). Unset: ``ring`` under ``framework = "torch"`` with
    ``flash_attention`` (torch's ring runs the fused SDPA kernels only: ``ring`` is refused without
    it; ``allgather`` then), ``p2p``
    under ``megatron`` (:attr:`cp_kind`; ``ring`` is refused under megatron, ``p2p`` under torch).
    ``cp_rotate`` (torch's ring only): how the ring moves K and V, torch's ``set_rotate_method``
    (torchtitan's ``parallelism.context_parallel_rotate_method``): ``allgather`` (default), one
    all-gather of the whole sequence's K/V before the first SDPA call, or ``alltoall``, ``cp - 1``
    shifts of the local K/V to the next cp rank, each beside one SDPA call
    (:func:`meshplan.spec.axes.cp.ring_rows`).
    ``moe_dispatcher``: how the routed tokens travel over ep: ``alltoall`` (default; Megatron-LM's
    ``--moe-token-dispatcher-type alltoall``, torchtitan's all-to-all: one copy per routed expert)
    or ``deepep`` (Megatron-LM's ``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend
    deepep``, framework ``megatron`` only: DeepEP's normal kernels send a token once per destination
    node over RDMA and fan it out over NVLink there; :mod:`meshplan.comm.deepep`). Under deepep a
    capacity factor drops the same copies but sends no padding (Megatron-LM refuses
    ``--moe-pad-expert-input-to-capacity`` there; :mod:`meshplan.compute.routing`). It runs over ep
    x etp ranks (Megatron-LM's ``tp_ep`` group; etp > 1: each rank its own tokens, to every etp rank
    of a destination ep rank), whose size must be one DeepEP has a kernel config for (a given mesh's
    other size is an error), and each rank of a stage with MoE layers holds DeepEP's buffer from init
    (:mod:`meshplan.memory.deepep_buffers`).
    """
