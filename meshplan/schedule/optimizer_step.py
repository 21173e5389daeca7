"""The optimizer step's HBM traffic and time: its passes over one rank's persistent state
(:func:`optimizer_step_bytes`, torch's foreach Adam: :func:`foreach_adam_bytes`) at achievable
bandwidth (:func:`optimizer_step_s`). Scalars or numpy arrays: the exact step
(:func:`meshplan.schedule.step_end._optimizer_s`) and the search's bound
(:mod:`meshplan.search.timing`) call the same functions.
"""

from __future__ import annotations




#: Shardings whose gradients live in a contiguous buffer zeroed every step (Megatron-LM's DDP
#: and distributed optimizer, ``zero_grad_buffer``); FSDP2 frees its sharded gradients.
ZEROED_GRAD_BUFFER = ("none", "zero1", "zero2")


def optimizer_step_bytes(params, grads, master, optimizer, training, zero_grads=None):
    """HBM bytes read and written by one rank's optimizer step, as a sum of its passes over the
    persistent state (``params``, ``grads``, ``master``, ``optimizer``: the rank's bytes of each
    kind, :mod:`meshplan.memory.state`; scalars or numpy arrays of any shape):

    - norm (``training.grad_clip``): one read of the gradients (torch ``clip_grad_norm_``'s
      foreach norm; Megatron-LM ``clip_grad_norm_fp32``'s ``multi_tensor_l2norm``);
    - clip: one read and one write of the gradients (``clip_grad_norm_`` multiplies by the
      clamped coefficient; Megatron's ``multi_tensor_scale``; counted as in torch, which
      always scales);
    - update (Adam: apex ``multi_tensor_adam``, torch's fused AdamW, ``training.optimizer_impl =
      "fused"``): reads the copy it updates (the fp32 master when kept, else the parameters), the
      gradients and the optimizer states; writes the copy and the states. Torch's foreach Adam
      (``"foreach"``, :func:`foreach_adam_bytes`) makes eight passes instead;
    - copy (when a master is kept): reads the master, writes the 16-bit parameters (Megatron's
      ``_copy_main_params_to_model_params``);
    - zero (``zero_grads``; None: ``training.sharding`` in :data:`ZEROED_GRAD_BUFFER`, Megatron-LM's
      contiguous main-gradient buffer, ``zero_grad_buffer`` each step; a bool array where the
      search varies the sharding): one write of the gradients. FSDP2 (zero3, hsdp) frees its
      sharded gradients (``zero_grad(set_to_none=True)``): no pass;
    - scale (``training.framework = "megatron"`` with that zeroed buffer): one read and one write
      of the gradients. Megatron-LM divides the whole main-gradient buffer by the data-parallel
      size in place before reducing it, at every dp size, 1 included (NVIDIA/Megatron-LM 2755bcb
      ``megatron/model/distributed.py`` ``allreduce_gradients``: ``buffer_.data /=
      get_data_parallel_world_size()``; ``optimizer/distrib_optimizer.py`` ``reduce_model_grads``:
      ``gbuf.data /= data_parallel_world_size``).

    - unscale (``training.framework = "megatron"`` with fp16 parameters: Megatron-LM gives ``--fp16``
      a grad scaler, bf16 none): one read and one write of the gradients
      (NVIDIA/Megatron-LM 2755bcb ``megatron/optimizer/optimizer.py`` ``_unscale_main_grads_and_check_for_nan``:
      ``torch._amp_foreach_non_finite_check_and_unscale_`` over the fp32 main gradients, in place).

    Megatron's bf16 mixed precision (2 B params, 4 B main grads, 4 B master, 8 B Adam states):
    4 + 8 + 28 + 6 + 4 + 8 = 58 B per parameter, fp16 8 B more (66 B); torch's with the same state, 50 B.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="none", param_dtype="bf16")
    >>> optimizer_step_bytes(2, 4, 4, 8, t), optimizer_step_bytes(2, 4, 4, 8, t.model_copy(update={"framework": "megatron"}))
    (50, 58)
    >>> optimizer_step_bytes(2, 4, 4, 8, t.model_copy(update={"framework": "megatron", "param_dtype": "fp16"}))
    66
    >>> optimizer_step_bytes(4, 4, 0, 8, t.model_copy(update={"sharding": "zero3", "grad_clip": False, "param_dtype": "fp32"}))
    28
    """
    updated = master if training.keeps_master else params
    norm_clip = 3 * grads if training.grad_clip else 0
    if training.optimizer_impl == "foreach" and training.optimizer in ("adam", "adamw"):
        update = foreach_adam_bytes(updated, grads, optimizer, training.optimizer == "adamw")
    else:
        update = 2 * (updated + optimizer) + grads
    copy = master + params if training.keeps_master else 0
    if zero_grads is None:
        zero_grads = training.sharding in ZEROED_GRAD_BUFFER
    passes = 3 if training.framework == "megatron" else 1  # zero; Megatron also scales by 1/dp (read, write)
    unscale = 2 * grads if training.framework == "megatron" and training.param_dtype == "fp16" else 0
    return norm_clip + update + copy + passes * grads * zero_grads + unscale


def foreach_adam_bytes(updated, grads, states, decoupled: bool):
    """HBM bytes of torch's foreach Adam/AdamW update (``_multi_tensor_adam``, torch/optim/adam.py;
    read at pytorch/pytorch 005941e, the same passes in AdamW's ``_multi_tensor_adamw``), ``updated``,
    ``grads``, ``states`` the rank's bytes of the updated copy, the gradients and both moments
    (``exp_avg`` and ``exp_avg_sq``, half each). One kernel per pass, each streaming its operands
    (non-capturable path; the step counters and bias corrections are scalars):

    1. ``_foreach_mul_(params, 1 - lr * wd)`` (AdamW's decoupled decay, torchtitan's
       weight_decay 0.1): read and write the copy, 2 ``updated``;
    2. ``_foreach_lerp_(exp_avgs, grads, 1 - beta1)``: ``states`` + ``grads``;
    3. ``_foreach_mul_(exp_avg_sqs, beta2)``: ``states``;
    4. ``_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)``: ``states`` + ``grads`` (the
       one gradient tensor passed twice, read once from HBM: the same thread loads both);
    5. ``_foreach_sqrt(exp_avg_sqs)``: a new ``exp_avg_sq``-sized temporary, ``states``;
    6. ``_foreach_div_`` by sqrt(1 - beta2^t): ``states``; 7. ``_foreach_add`` of eps: ``states``;
    8. ``_foreach_addcdiv_(params, exp_avgs, denom, step_size)``: 2 ``updated`` + ``states``.

    4 x updated + 7 x states + 2 x grads (2 x updated without the decay): 80 B a parameter with
    fp32 copy, gradients and moments, against 28 B for the fused kernel's one pass.

    >>> foreach_adam_bytes(4, 4, 8, True), foreach_adam_bytes(4, 4, 8, False)
    (80, 72)
    """
    return (4 if decoupled else 2) * updated + 7 * states + 2 * grads


def optimizer_step_s(params, grads, master, optimizer, training, hbm_bandwidth_bytes_per_s, zero_grads=None):
    """Seconds of the optimizer step of one rank: memory-bound, its passes
    (:func:`optimizer_step_bytes`) at ``hbm_bandwidth_bytes_per_s`` (callers pass
    :func:`meshplan.compute.kernel_time.optimizer_bandwidth`: measured Triad, or the datasheet for a GPU
    without catalog data). Scalars or numpy arrays of any shape (the search calls it on
    (candidates, stages) arrays).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="none", param_dtype="bf16")
    >>> optimizer_step_s(2e9, 4e9, 4e9, 8e9, t, 1.7e12) == 50e9 / 1.7e12
    True
    """
    return optimizer_step_bytes(params, grads, master, optimizer, training, zero_grads) / hbm_bandwidth_bytes_per_s
