"""Memory-timeline parameters: the optional ``[memory]`` table of a config.

Every transient the timeline adds that is not derived from the model, the mesh and the
training contract is a field here, with its default and the default's source, so no
factor is hidden. Units are bytes (``*_bytes``), elements (``*_elements``) or fractions.
:class:`MemoryOptions` documents every field and resolves the defaults that follow the training
contract; it is built in layers: the fields and their bounds (:mod:`meshplan.spec.memory_fields`),
the gradient buckets and DeepSpeed ZeRO-3's coordinator bytes (:mod:`meshplan.spec.memory_buckets`).

>>> MemoryOptions().comm_bytes_per_group == 4 * 2**20 * 16 * 2
True
"""

from __future__ import annotations

import numpy as np

from meshplan.errors import ConfigError
from meshplan.spec.deepspeed_memory import DEEPSPEED_MAX_LIVE_ELEMENTS, DEEPSPEED_PREFETCH_ELEMENTS
from meshplan.spec.deepspeed_reuse import DEEPSPEED_MAX_REUSE_ELEMENTS
from meshplan.spec.memory_buckets import MemoryBuckets
from meshplan.spec.training import TrainingSpec

# The [memory] fields that are runtime choices of the plan (prefetch depth, when FSDP reduces,
# the gradient bucket), which ``meshplan compare`` weighs as knobs; the others are stated
# assumptions about the software and the allocator (NCCL buffers, workspace, fragmentation,
# dropout, the loss kernel ...) that both sides of a comparison must share.
MEMORY_KNOBS = ("prefetch_layers", "forward_prefetch_layers", "fsdp_reduce", "grad_bucket_elements",
                "deepspeed_prefetch_elements", "deepspeed_max_live_elements", "deepspeed_max_reuse_elements")

#: Fragmentation of PyTorch's CUDA caching allocator in LLM training, as a fraction of the memory it
#: reserves: GMLake (Guo et al., ASPLOS 2024, arXiv 2401.08156, abstract and section 6) cut it by 15% on
#: average (up to 33%) across eight LLMs on A100-80GB against PyTorch's caching allocator, so at least that
#: much is lost there on average. Not applied (``fragmentation_fraction`` defaults to 0): ``search`` warns
#: when a row shown keeps less than this fraction of the usable memory free while the plan's allowance is
#: below it (:func:`meshplan.report.search.headroom_lines`).
ALLOCATOR_FRAGMENTATION = 0.15


class MemoryOptions(MemoryBuckets):
    """Stated parameters of :func:`meshplan.memory.timeline.memory_timeline`.

    - ``prefetch_layers``: FSDP units all-gathered ahead of the one being computed in
      backward. Default 1: FSDP2's implicit backward prefetch (``pre_backward`` issues the
      next unit's all-gather before the current unit's backward; torch ``fully_shard``
      docs, ``set_modules_to_backward_prefetch`` for more). 0: no prefetch.
    - ``forward_prefetch_layers``: the same in forward. Default 0: FSDP2 has no implicit
      forward prefetch; it keeps each unit's all-gather output until the next unit's
      copy-out instead, so the next all-gather overlaps this copy-out
      (``FSDPParamGroup.wait_for_unshard``). ``set_modules_to_forward_prefetch``: 1 or more
      (torch 2.13 keeps each output till the next copy-out then too; torchtitan sets 1 under
      ep > 1, which the timeline takes as at least 1: :func:`meshplan.memory.units.explicit_forward_prefetch`).
    - ``deepspeed_prefetch_elements``, ``deepspeed_max_live_elements`` (``training.zero3_engine =
      "deepspeed"``; DeepSpeed's ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``,
      unset 5e7 and 1e9): none are gathered ahead of the module being computed at a bucket of 0;
      else, in forward and in backward, those that take the gathered parameters to
      ``deepspeed_max_live_elements`` (DeepSpeed's ``PartitionedParameterCoordinator.fetch_sub_module``
      tops its prefetch up at every module's fetch: :func:`meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes`,
      the memory timeline's and the step's), in place of ``prefetch_layers`` / ``forward_prefetch_layers``.
    - ``deepspeed_max_reuse_elements`` (``training.zero3_engine = "deepspeed"``; DeepSpeed's
      ``stage3_max_reuse_distance``, unset 1e9): a parameter whose next use comes within this many
      elements is kept gathered after its module (:func:`meshplan.spec.deepspeed_reuse.reuse_kept`):
      on one pipeline stage the step and the collective table gather only the rest in backward (a
      layer twice, replay and backward, under full recompute at a short distance) and the memory
      timeline holds the kept bytes from forward to backward
      (:func:`meshplan.memory.deepspeed_fetch.deepspeed_reuse`); read, written back and weighed by ``compare``.
    - ``fsdp_reduce``: when FSDP (zero3/hsdp) reduce-scatters gradients. Not a free choice:
      it follows what :mod:`meshplan.comm.collectives` counts and the runtime runs
      (:meth:`fsdp_reduce_for`), so the memory verdict, the table and the step agree. With
      pp > 1 ``after_last``: ``torch.distributed.pipelining`` turns gradient sync and
      reshard-after-backward off for every micro-batch's backward
      (``_PipelineStageBase.backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)``,
      ``set_reshard_after_backward(False)``) and reduces once, in the ``REDUCE_GRAD`` action the
      schedule places after a stage's last backward (schedules.py ``_add_reduce_grad``,
      stage.py ``perform_reduce_grad``; torch 2.13): unsharded parameters stay gathered and
      unsharded gradients accumulate in the reduce dtype until then. With pp 1
      ``training.grad_accumulation`` decides: ``sync`` reduces every micro-batch
      (``per_microbatch``, FSDP2's default), ``no_sync``/``no_sync_unsharded`` ``after_last``.
      Unset (default): that rule. Set: only to state it; a value that contradicts it is an error.
    - ``grad_bucket_elements``: gradient bucket of the non-FSDP shardings (none, zero1,
      zero2). For ``none`` (torch DDP) it sets the bucket cap of the table's all-reduces, one per
      bucket, and where the step's timeline issues them as the buckets fill
      (:func:`meshplan.comm.dp_rows.ddp_buckets`, :func:`meshplan.schedule.grad_reduce.reduce_pieces`);
      None there: torch's ``bucket_cap_mb`` 25 MiB, the first bucket 1 MiB. For the memory
      model (the bucket held during backward by zero2, or by a reduce-dtype cast) None is
      Megatron-Core's default ``max(40 M, 1 M x dp_size)`` elements (:meth:`bucket_elements`)
      (``DistributedDataParallelConfig.bucket_size``; dp_size includes cp). ZeRO-1/2's per-step
      reduce-scatter and all-gather are timed as one call per stage whatever the bucket. Under
      ``training.zero12_engine = "deepspeed"`` it is ``reduce_bucket_size``, None there:
      DeepSpeed's 5e8 (:data:`DEEPSPEED_REDUCE_BUCKET_ELEMENTS`), for the all-reduces and
      the buffers alike (:mod:`meshplan.comm.deepspeed_zero12`, :meth:`grad_bucket_bytes`). FSDP
      (zero3/hsdp) always reduces one unit (one layer) at a time (FSDP2); DeepSpeed's ZeRO-3
      (``zero3_engine = "deepspeed"``) reduce-scatters once per ipg bucket of it, None there
      DeepSpeed's 5e8 (:mod:`meshplan.comm.deepspeed_ipg`: a Llama 3 70B layer at h^2 takes 8
      calls, at 5e8 2), besides its ipg buffer in the memory timeline.
    - ``nccl_buffsize_bytes`` x ``nccl_channels`` x ``nccl_peers`` per communicator (one per
      mesh axis with collectives): ``NCCL_BUFFSIZE`` default 4 MiB (NCCL environment
      variables docs); 16 channels and 2 peers (ring: previous and next rank) are stated
      assumptions: NCCL picks 2-32 channels per communicator by topology (read them from
      ``NCCL_DEBUG=INFO``). Allocated by NCCL outside PyTorch's caching allocator.
    - ``workspace_bytes``: cuBLAS workspace of the compute stream, PyTorch's default on
      sm90 (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, 8 x 4 MiB = 32 MiB;
      aten/src/ATen/cuda/CublasHandlePool.cpp).
    - ``fragmentation_fraction``: allocator allowance as a fraction of the peak of all the
      other kinds. Default 0: not modelled, ``training.memory_reserve`` is the headroom that
      covers it; set e.g. 0.05 to add 5%.
    - ``expandable_segments``: PyTorch's caching allocator runs with
      ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torch's default False; torchtitan's
      launch script sets it: 9dec370 ``run_llama_train.sh`` line 22, b5bcd76 ``run_train.sh`` line 43,
      so the torchtitan importer states it). Read by the simulated allocator whose reserved bytes
      ``meshplan memory`` prints beside the allocated peak (:mod:`meshplan.memory.allocator`).
    - ``reserved_verdict``: hold the allocator's simulated reserved peak plus the communication
      buffers, instead of the peak incl. communication buffers, against usable memory (``plan``'s verdict, ``memory``,
      ``step``, ``compare``). Default False: an allocator over the device's memory first frees its
      cached segments and retries (``malloc``'s ``release_cached_blocks``), so a reserved peak over
      it is a slower step (``num_alloc_retries``), an OOM only if the retry fails too, which the
      simulation (kind-level events, no device limit) does not decide: docs/conventions.md.
    - ``optimizer_temp_states``: temporaries of the optimizer step, in units of one
      optimizer-state shard (optimizer dtype). Unset (default): what
      ``training.optimizer_impl`` runs (:meth:`optimizer_temp_states_for`), read in torch
      2.13.0 (pytorch/pytorch cf30153, torch/optim/adam.py; ``AdamW`` in torch/optim/adamw.py
      is ``Adam`` with ``decoupled_weight_decay=True``, the same code paths): ``"fused"`` 0,
      ``_fused_adam`` only bumps the step counts in place and calls ``torch._fused_adamw_``
      (``_fused_adam_`` for Adam), whose kernel (aten/src/ATen/native/cuda/fused_adamw_impl.cu,
      ``multi_tensor_apply``) updates parameters and both moments in place, as apex/TE's
      FusedAdam does under ``framework = "megatron"``; ``"foreach"`` 1,
      ``_multi_tensor_adam`` allocates ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``,
      one state-sized tensor per parameter of the device's group, alive until the
      ``_foreach_addcdiv_`` that applies it (the gradient-sized copy that coupled weight decay
      makes for Adam with ``weight_decay != 0``, ``torch._foreach_add(device_grads, ...)``, is
      deleted before it). Set: the stated number.
    - ``logits_dtype``: logits the loss keeps for backward (Megatron's vocab-parallel cross
      entropy keeps the fp32 softmax; read under ``cross_entropy = "megatron"`` only: torch's eager
      loss sizes every logits-sized tensor in fp32, a compiled one in the compute dtype,
      :meth:`loss_logits_dtype`); ``dropout``: attention and residual dropout (False
      for Llama-style pretraining, True for GPT as in Korthikanti Table 2).
    - ``cross_entropy``: the loss's working set. ``megatron``: Megatron-Core's
      ``vocab_parallel_cross_entropy`` works in place on the logits (a compute-dtype copy
      only when ``logits_dtype`` differs) and its backward writes one logits gradient.
      ``torch``: eager ``F.cross_entropy(pred.float(), labels)`` (torchtitan 9dec370
      ``train.py``; ``log_softmax`` + ``nll_loss``), out of place: in forward the GEMM's
      compute-dtype logits, their fp32 ``.float()`` copy and the kept log-softmax live at
      once, and with tp > 1 (``loss_parallel()``, the decomposition in
      torch/distributed/tensor/parallel/loss.py) also ``x - max`` and ``exp(x - max)``; in
      backward the nll gradient and the log-softmax gradient live at once beside the kept
      log-softmax (tp > 1: the fused ``(zeros_like(x) + exp(x)) * grad_output``, three
      logits-sized tensors), then one is left for the upcast's backward to cast
      (:mod:`meshplan.memory.passes`). Measured with torch 2.13's profiler on CPU
      (tests/test_loss_memory.py, every logits-sized allocation of forward and backward) and,
      the backward, on an H200 (benchmarks/gpu_h200 run 3: the head's peaks within 6 MB once
      the harness's own held bytes are set aside). ``compiled``: the same loss under
      torch.compile (torchtitan's ``[compile] components`` with "loss"): AOTAutograd's
      partition saves the compute-dtype logits themselves (and two fp32 values a token)
      and its backward writes the compute-dtype logits gradient alone: no fp32 logits-sized
      tensor either way (measured on CPU inductor, tests/test_loss_memory.py), so the loss
      keeps ``training.compute_dtype`` logits whatever ``logits_dtype`` says. Default
      ``megatron``; a torchtitan job TOML states ``torch`` or ``compiled`` (its ``[compile]``:
      :mod:`meshplan.interop.torchtitan`). A native config under ``training.framework =
      "torch"`` keeps the default unless it states the loss (not yet the framework's by default:
      that moves the by-hand numbers of many tests, left for a later change).
    - ``sp_gathered_input``, ``unfused_norm``, ``kv_expanded``: activation variants of
      an implementation, all False for Megatron-Core (Korthikanti Table 2); True for what
      torch keeps for a DTensor SP Llama (all-gathered GEMM inputs), for ``rms_norm`` on CPU
      (decomposed: normalised input kept, four temporaries in backward) and for
      ``repeat_kv`` before SDPA (torchtitan before ff0829c; since then, v0.2.2, ``enable_gqa``: false);
      see :mod:`meshplan.memory.activations`. ``kv_expanded`` decides more than memory: the K/V heads
      torch's SDPA reads (:func:`meshplan.spec.axes.tp.sdpa_kv_heads`), so the ``repeat_kv`` copies
      (run only with it), torch's ring CP traffic (its K/V all-gathers or shifts and fp32 dK/dV shifts,
      :func:`meshplan.spec.axes.cp.ring_rows`), the ring's kernels and the search's cp bounds.
    - ``fused_glu``: the gated MLP's activation runs as one fused kernel that saves only its
      input, the ``2f``-wide fc1 output, and recomputes SiLU in backward (Megatron-Core's
      ``BiasSwiGLUFunction``/``SwiGLUFunction``, megatron/core/fusions/fused_bias_swiglu.py:
      ``ctx.save_for_backward(input_for_backward, bias)``; the product is kept by fc2 as its
      input), so ``3 f`` columns per token instead of ``4 f``
      (:mod:`meshplan.memory.activations`); the routed experts alike (``TEGroupedMLP``:
      ``weighted_bias_swiglu_impl``). Unset: Megatron-LM's default under ``training.framework =
      "megatron"`` (``--no-bias-swiglu-fusion`` unset, so ``bias_swiglu_fusion`` is True;
      megatron/training/argument_utils.py passes it as ``bias_activation_fusion`` for
      ``--swiglu``), off under ``torch`` (torchtitan's ``w2(silu(w1(x)) * w3(x))``). No effect
      on a non-gated MLP. :meth:`fused_glu_for` resolves it.
    - ``embedding_grad_full_vocab``: with tp > 1 the vocabulary-parallel embedding's weight
      gradient is first computed over the whole vocabulary on every rank, then
      reduce-scattered to the rank's rows: DTensor has no row-sharded strategy for
      ``embedding_dense_backward`` (torch/distributed/tensor/_ops/_embedding_ops.py, the
      ``Partial`` strategies), so torch's ``RowwiseParallel`` embedding does this (a
      transient ``V h`` in the compute dtype). False: Megatron's ``VocabParallelEmbedding``
      writes only its rows.
    - ``embedding_backward_work``: the working set of the embedding's backward on CUDA,
      beside its weight gradient: ``embedding_dense_backward``'s fp32 partial sums,
      ``grad_weight_per_segment`` of ``(tokens // 10 + min(tokens, vocab rows)) x hidden``
      (aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu: ``max_partial_segment =
      numel / NROWS_PER_THREAD + max_segments``, ``NROWS_PER_THREAD = 10``, ``acc_type``
      fp32 for bf16/fp16 gradients), and with tp > 1 under SP the output gradient all-gathered
      over tp (DTensor's ``RowwiseParallel`` embedding takes a replicated gradient) in place
      of its sequence-sharded dY. False (default) leaves both out; the one-rank GPU run
      states it (:data:`meshplan.runtime.validation.one_rank_plan.RUN_MEMORY`): 405B tp 8's peak
      within 4 MB (benchmarks/gpu_h200 run 3). Not the CPU kernel (no partial sums there).
    """

    def fsdp_reduce_for(self, training: TrainingSpec, pp: int) -> str:
        """When FSDP reduces on a plan with ``pp`` stages (class docstring, ``fsdp_reduce``):
        ``after_last`` when pp > 1 or ``training.grad_accumulation`` is not ``sync``, else
        ``per_microbatch``. ConfigError when ``fsdp_reduce`` is set to the other value.

        >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero3")
        >>> MemoryOptions().fsdp_reduce_for(t, 1), MemoryOptions().fsdp_reduce_for(t, 4)
        ('per_microbatch', 'after_last')
        >>> MemoryOptions(fsdp_reduce="per_microbatch").fsdp_reduce_for(t, 4)
        Traceback (most recent call last):
        meshplan.errors.ConfigError: memory.fsdp_reduce: 'per_microbatch' contradicts pp 4: torch.distributed.pipelining reduce-scatters once per step, after each stage's last backward (what the collective table and the step count); remove the key
        """
        rule = "per_microbatch" if pp == 1 and training.grad_accumulation == "sync" else "after_last"
        if self.fsdp_reduce is None or self.fsdp_reduce == rule:
            return rule
        if pp > 1:
            why = (f"pp {pp}: torch.distributed.pipelining reduce-scatters once per step, after each stage's last "
                   "backward (what the collective table and the step count); remove the key")
        elif rule == "per_microbatch":
            why = ("training.grad_accumulation 'sync' (the collective table reduce-scatters every micro-batch); "
                   "for one reduce after the last micro-batch set training.grad_accumulation = "
                   "\"no_sync_unsharded\" (parameters kept gathered) or \"no_sync\" and remove the key")
        else:
            why = (f"training.grad_accumulation {training.grad_accumulation!r} (one reduce-scatter after the last "
                   "micro-batch); remove the key")
        raise ConfigError("memory.fsdp_reduce", f"{self.fsdp_reduce!r} contradicts {why}")

    def fused_glu_for(self, training: TrainingSpec) -> bool:
        """Whether the gated MLP's activation is the fused SwiGLU (class docstring,
        ``fused_glu``): the field when set, else whether ``training.framework`` is megatron.

        >>> t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron")
        >>> MemoryOptions().fused_glu_for(t), MemoryOptions(fused_glu=False).fused_glu_for(t)
        (True, False)
        >>> MemoryOptions().fused_glu_for(t.model_copy(update={"framework": "torch"}))
        False
        """
        return self.fused_glu if self.fused_glu is not None else training.framework == "megatron"

    def loss_logits_dtype(self, training: TrainingSpec) -> str:
        """The dtype of the logits-sized tensors the loss keeps and makes: ``logits_dtype`` under
        Megatron's loss; the compute dtype under a compiled loss; fp32 under torch's eager loss,
        whatever ``logits_dtype`` says (class docstring, ``cross_entropy``): it runs on
        ``pred.float()``, and torch sizes each tensor after it in that copy's dtype. Its forward,
        ``cross_entropy_loss_symint`` (pytorch/pytorch 0321fa77, aten/src/ATen/native/LossNLL.cpp),
        is ``nll_loss_nd(log_softmax(self, class_dim, self.scalar_type()), ...)``: the log-softmax
        in the input's dtype; in backward (torch 2.13's derivatives.yaml, git cf30153c, as installed)
        ``nll_loss_forward``'s gradient is ``nll_loss_backward(grad, self, ...)``, shaped and typed as
        its input, the log-softmax, and ``_log_softmax``'s is ``_log_softmax_backward_data(grad, result,
        dim, self.scalar_type())``, in its input's dtype; under ``loss_parallel`` (tp > 1,
        torch/distributed/tensor/parallel/loss.py lines 197-221 and 470, torch 2.13) ``_log_softmax`` on an fp32 input casts nothing
        and the fused backward's ``zeros_like(x)``, ``exp`` and product are fp32 as well.
        tests/test_loss_memory.py measures the same allocations with either ``logits_dtype``.

        >>> t = TrainingSpec(global_batch=8, seq_len=16)
        >>> MemoryOptions().loss_logits_dtype(t), MemoryOptions(cross_entropy="compiled").loss_logits_dtype(t)
        ('fp32', 'bf16')
        >>> MemoryOptions(logits_dtype="bf16").loss_logits_dtype(t)
        'bf16'
        >>> MemoryOptions(cross_entropy="torch", logits_dtype="bf16").loss_logits_dtype(t)
        'fp32'
        """
        if self.cross_entropy == "compiled":
            return training.compute_dtype
        return "fp32" if self.cross_entropy == "torch" else self.logits_dtype

    @property
    def variants(self) -> dict[str, bool]:
        """The activation variants as keyword options of ``layer_terms``."""
        return {"sp_gathered_input": self.sp_gathered_input, "unfused_norm": self.unfused_norm,
                "kv_expanded": self.kv_expanded}

    @property
    def comm_bytes_per_group(self) -> int:
        """NCCL buffer bytes of one communicator: buffsize x channels x peers."""
        return self.nccl_buffsize_bytes * self.nccl_channels * self.nccl_peers

    def optimizer_temp_states_for(self, training: TrainingSpec) -> float:
        """State-sized temporaries of the optimizer step (class docstring,
        ``optimizer_temp_states``): the field when set, else 1 for torch's foreach Adam/AdamW
        (``training.optimizer_impl = "foreach"``), 0 for the fused step (and for SGD, which
        keeps no state).

        >>> t = TrainingSpec(global_batch=8, seq_len=16, optimizer="adamw")
        >>> MemoryOptions().optimizer_temp_states_for(t), MemoryOptions(optimizer_temp_states=2.0).optimizer_temp_states_for(t)
        (0.0, 2.0)
        >>> MemoryOptions().optimizer_temp_states_for(t.model_copy(update={"optimizer_impl": "foreach"}))
        1.0
        """
        if self.optimizer_temp_states is not None:
            return self.optimizer_temp_states
        return 1.0 if training.optimizer_impl == "foreach" and training.optimizer_states else 0.0

    def optimizer_temp_bytes(self, training: TrainingSpec, optimizer_bytes):
        """Temporaries of the optimizer step, bytes: :meth:`optimizer_temp_states_for`
        state-sized tensors, one state = ``optimizer_bytes / training.optimizer_states`` (the
        rank's optimizer state bytes over the states per parameter), rounded down; 0 without
        optimizer states. An int, or a numpy array for an array ``optimizer_bytes`` (the search's).

        >>> t = TrainingSpec(global_batch=8, seq_len=16, optimizer_impl="foreach")
        >>> MemoryOptions().optimizer_temp_bytes(t, 8_000_000), MemoryOptions().optimizer_temp_bytes(t.model_copy(update={"optimizer_impl": "fused"}), 8_000_000)
        (4000000, 0)
        """
        states = training.optimizer_states
        if not states:
            return 0 * optimizer_bytes
        optimizer_temp_states = self.optimizer_temp_states_for(training)
        out = np.floor(optimizer_temp_states * np.asarray(optimizer_bytes) / states).astype(np.int64)
        return out if np.ndim(out) else int(out)

    def knob_acts(self, knob: str, training: TrainingSpec) -> tuple[bool, object]:
        """(whether [memory] knob ``knob``, a :data:`MEMORY_KNOBS` field, applies under ``training``,
        its value as it acts), as :meth:`~meshplan.spec.training.TrainingSpec.knob_acts` for the
        [training] knobs: ``deepspeed_prefetch_elements``, ``deepspeed_max_live_elements`` and
        ``deepspeed_max_reuse_elements`` only
        under DeepSpeed's ZeRO-3 (``zero3_engine = "deepspeed"`` at sharding zero3, where
        :meth:`deepspeed_prefetch_bytes` reads them), unset DeepSpeed's 5e7, 1e9 and 1e9;
        ``grad_bucket_elements`` as :meth:`grad_bucket_acts`; every other knob applies, as given.
        ``meshplan compare`` lists a knob only where it applies to both sides, by that value, so a
        ZeRO-2 side has no ZeRO-3 prefetch knob and a given 1e9 is unset's 1e9.

        >>> z3 = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed")
        >>> z2 = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed")
        >>> MemoryOptions().knob_acts("deepspeed_max_live_elements", z3), MemoryOptions().knob_acts(
        ...     "deepspeed_max_live_elements", z2)
        ((True, 1000000000), (False, None))
        """
        if knob == "grad_bucket_elements":
            return True, self.grad_bucket_acts(training)
        value = getattr(self, knob)
        defaults = {"deepspeed_prefetch_elements": DEEPSPEED_PREFETCH_ELEMENTS,
                    "deepspeed_max_live_elements": DEEPSPEED_MAX_LIVE_ELEMENTS,
                    "deepspeed_max_reuse_elements": DEEPSPEED_MAX_REUSE_ELEMENTS}
        if knob in defaults:
            acts = training.sharding == "zero3" and training.zero3_engine == "deepspeed"
            return acts, (defaults[knob] if value is None else value) if acts else value
        return True, value
