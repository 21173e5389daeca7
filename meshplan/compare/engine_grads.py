"""The gradient dtype each engine keeps on its own (``training.grad_dtype``), so that ``meshplan
compare`` weighs two engines whose gradients differ because of the engine as the engine choice
it is, not as a different workload (newcomer trial nc52: Megatron-DeepSpeed's BF16_Optimizer, fp32
gradients, against DeepSpeed ZeRO-3, bf16 ones, was refused with ``training.grad_dtype differs``).
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan.spec.training_fields import DEEPSPEED_ZERO3, deepspeed_grad_dtype

#: The key :func:`meshplan.compare.differences.config_differences` moves from the workload to the knobs.
GRAD_DTYPE = "training.grad_dtype"


def engine_grads(t: Any) -> tuple[str, str]:
    """(the dtype of the step's gradients the engine of training ``t`` keeps on its own, the
    engine in words, with the source that sets it):

    - DeepSpeed's BF16_Optimizer (:attr:`~meshplan.spec.training.TrainingSpec.bf16_optimizer`):
      fp32, the optimizer is the one DeepSpeed picks for bf16 with fp32 ``grad_accum_dtype``
      (deepspeedai/DeepSpeed edaa722 ``runtime/engine.py:1994-1996``);
    - DeepSpeed's ZeRO stages 1-3: :func:`~meshplan.spec.training_fields.deepspeed_grad_dtype`
      with ``grad_accum_dtype`` unset, the model's dtype;
    - Megatron-LM's DDP: fp32 ``main_grad`` under bf16 (NVIDIA/Megatron-LM d98e8a6
      ``megatron/training/arguments.py:1214-1216``: ``--bf16`` sets
      ``accumulate_allreduce_grads_in_fp32``), the parameters' dtype otherwise;
    - torch (FSDP2, DDP): autograd accumulates ``.grad`` in the parameter's dtype.

    >>> from meshplan.spec.training import TrainingSpec
    >>> T = lambda **kw: TrainingSpec(global_batch=8, seq_len=16, **kw)
    >>> engine_grads(T(sharding="zero1", zero12_engine="deepspeed", framework="megatron", grad_dtype="fp32"))[0]
    'fp32'
    >>> engine_grads(T(zero3_engine="deepspeed"))[0], engine_grads(T(framework="megatron", sharding="zero1"))[0]
    ('bf16', 'fp32')
    """
    stage = {"zero1": 1, "zero2": 2}.get(t.sharding) if t.zero12_engine == "deepspeed" else \
        3 if t.sharding == "zero3" and t.zero3_engine in DEEPSPEED_ZERO3 else None
    if t.bf16_optimizer:
        return "fp32", "DeepSpeed's BF16_Optimizer (fp32 gradients; DeepSpeed engine.py:1994-1996)"
    if stage is not None:
        return (deepspeed_grad_dtype(stage, t.param_dtype),
                f"DeepSpeed ZeRO-{stage} (gradients in the model's dtype, grad_accum_dtype unset)")
    if t.framework == "megatron":
        return ("fp32" if t.param_dtype == "bf16" else t.param_dtype,
                "Megatron-LM's DDP (--bf16 keeps fp32 main_grad; Megatron-LM arguments.py:1214-1216)")
    return t.param_dtype, "torch (.grad in the parameter's dtype)"


def engine_grad_dtype(a: Any, b: Any) -> Optional[str]:
    """The note ``compare`` prints when trainings ``a`` and ``b`` differ in ``grad_dtype`` only
    as their engines do (each side's is its engine's own, :func:`engine_grads`, and the engines
    differ); None otherwise (a genuinely different workload, which compare refuses)."""
    (da, ea), (db, eb) = engine_grads(a), engine_grads(b)
    if a.grad_dtype == b.grad_dtype or ea == eb or (a.grad_dtype, b.grad_dtype) != (da, db):
        return None
    return (f"{GRAD_DTYPE} {da} against {db} follows from each side's engine ({ea}; {eb}): compared as part of "
            "the engine choice, not as a different workload")
