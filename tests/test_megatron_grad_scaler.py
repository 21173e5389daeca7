"""Megatron-LM's fp16 grad scaler in the optimizer step (audit of the 175B step against
NVIDIA/Megatron-LM 2755bcb, ``megatron/optimizer/__init__.py``: ``--fp16`` gets a
``DynamicGradScaler``, bf16 none without ``--loss-scale``; ``optimizer.py``
``MixedPrecisionOptimizer.step`` -> ``_unscale_main_grads_and_check_for_nan``, lines 392-430)."""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute.megatron import stage_param_tensors
from meshplan.compute.megatron_cost import megatron_step_cost
from meshplan.schedule.optimizer_step import optimizer_step_bytes
from meshplan.spec.training import TrainingSpec

A100 = catalog.gpu("a100-sxm-80gb")


def test_fp16_unscales_the_main_gradients_in_place():
    """``torch._amp_foreach_non_finite_check_and_unscale_`` reads and writes every fp32 main
    gradient once: 8 B per parameter on top of bf16's 58 (2 B parameters, 4 B main gradients, 4 B
    master, 8 B Adam states: norm 4, clip 8, Adam 28, copy 6, zero 4, / dp 8): 66. Under torch
    (no Megatron optimizer) no such pass: 50 (no / dp pass, one zeroing)."""
    t = TrainingSpec(global_batch=64, seq_len=2048, sharding="none", framework="megatron", param_dtype="bf16",
                     grad_dtype="fp32")
    n = 1_000_000
    bf16 = optimizer_step_bytes(2 * n, 4 * n, 4 * n, 8 * n, t)
    fp16 = optimizer_step_bytes(2 * n, 4 * n, 4 * n, 8 * n, t.model_copy(update={"param_dtype": "fp16"}))
    assert (bf16, fp16) == (58 * n, 66 * n)
    torch_fp16 = t.model_copy(update={"param_dtype": "fp16", "framework": "torch"})
    assert optimizer_step_bytes(2 * n, 4 * n, 4 * n, 8 * n, torch_fp16) == 50 * n


def test_fp16_step_pays_the_scalers_syncs():
    """Beside the pass: ``found_inf.fill_(0.0)`` (one kernel), ``found_inf.item()`` after its
    all-reduce, and the ``optimizer-unscale-and-check-inf`` timer's start and stop (two
    ``torch.cuda.synchronize``): 4 issue floors of 4.7 us = 18.8 us per step, nothing with bf16."""
    tensors = stage_param_tensors(catalog.model("megatron-175b"), 8, 6400, [0], True, False, 8)
    base = megatron_step_cost(A100, tensors, sp=False, per_param_copy=False, clip=True)
    scaled = megatron_step_cost(A100, tensors, sp=False, per_param_copy=False, clip=True, grad_scaler=True)
    assert scaled.seconds() - base.seconds() == pytest.approx(4 * 4.7e-6, rel=1e-9)
