"""Megatron-LM's GEMM habits in the compute model (issue 11 item 2): Q, K and V projected by
one column-parallel GEMM (``query_key_value``), and weight gradients accumulated into the fp32
main gradients inside the GEMM (``gradient_accumulation_fusion``)."""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute.gemm import gemm_time
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload

A100 = catalog.gpu("a100-sxm-80gb")
GPT22B = catalog.model("megatron-22b")   # h 6144, 64 heads of 96


def ops(w: Workload, names, phase):
    return {o.name: o.seconds for o in layer_cost(GPT22B, A100, w).ops if o.phase == phase and o.name in names}


def test_fused_qkv_is_one_gemm_of_three_widths():
    """tp 8, micro-batch 4 (8,192 tokens): one (8192, 3 x 768, 6144) GEMM in place of three of
    width 768; its time shared a third each (equal widths without GQA)."""
    w = Workload(seq_len=2048, micro_batch=4, tp=8, flash=False, fused_qkv=True)
    for phase, (m, n, k) in (("forward", (8192, 2304, 6144)), ("backward_input", (8192, 6144, 2304)),
                             ("backward_weight", (2304, 6144, 8192))):
        t = gemm_time(A100, m, n, k, "bf16").seconds
        got = ops(w, ("wq", "wk", "wv", "wq.dgrad", "wk.dgrad", "wv.dgrad", "wq.wgrad", "wk.wgrad", "wv.wgrad"), phase)
        assert len(got) == 3 and sum(got.values()) == pytest.approx(t, rel=1e-12)
        assert all(x == pytest.approx(t / 3, rel=1e-12) for x in got.values())
    three = ops(Workload(seq_len=2048, micro_batch=4, tp=8, flash=False), ("wq", "wk", "wv"), "forward")
    assert sum(three.values()) == pytest.approx(3 * gemm_time(A100, 8192, 768, 6144, "bf16").seconds, rel=1e-12)


def test_fp32_accumulation_bounds_the_weight_gradient_by_its_bytes():
    """wo's weight gradient at tp 8 and micro-batch 1 with 128 tokens (seq 128): (6144, 768, 128);
    accumulating into fp32 it moves 2 (6144 x 128 + 128 x 768) + 8 x 6144 x 768 = 39,518,208 B,
    23.2 us at Triad 1.7 TB/s, above the GEMM's own time (16.5 us): memory-bound."""
    base = Workload(seq_len=128, micro_batch=1, tp=8, flash=False)
    fused = Workload(seq_len=128, micro_batch=1, tp=8, flash=False, fp32_wgrad_accumulation=True)
    nbytes = 2 * (6144 * 128 + 128 * 768) + 8 * 6144 * 768
    assert nbytes == 39_518_208
    plain = ops(base, ("wo.wgrad",), "backward_weight")["wo.wgrad"]
    acc = ops(fused, ("wo.wgrad",), "backward_weight")["wo.wgrad"]
    assert plain < nbytes / 1.7e12 and acc == pytest.approx(nbytes / 1.7e12, rel=1e-12)


@pytest.mark.slow  # plans every candidate: about 2 CPU minutes
def test_search_bound_stays_below_the_megatron_step():
    """The search's lower bound uses the same framework kernels (compute.kernel_choices.framework_kernels):
    with framework = "megatron" (fused QKV, fp32 wgrad accumulation, blocking pp sends) it never
    exceeds the step model on any feasible candidate of the 8-GPU search case (but those the rule
    'framework' rejects under Megatron-LM, hsdp and zero3 kept gathered: no bound)."""
    from dataclasses import replace

    from tests.test_search import config, plan_all, refused
    from meshplan.search.driver import search

    cfg = config(1, micro_batch=[1, 2], top=8)
    cfg = replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron", "grad_dtype": "fp32"}))
    result = search(cfg, workers=1)
    checked = 0
    for i, (feasible, _, _, step) in enumerate(plan_all(cfg, result)):
        if feasible and not refused(result, i):
            assert result.est.step_lo[i] <= step * (1 + 1e-9), result.candidates.label(i)
            checked += 1
    assert checked > 0
