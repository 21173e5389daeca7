"""Why HFU exceeds MFU with recompute none: the step says it, cause by cause
(:func:`meshplan.compute.flops.flop_gap`), with values by hand.

Llama-3-8B (32 heads, head dim 128, 32 layers), tp 2, seq 8192, micro-batch 1, dp 4, global batch
64: m = 64 / (1 x 4) = 16 micro-batches, 8 ranks. Causal-half forward attention FLOP of a rank's
layer: 2 b a s^2 d = 2 x 16 x 8192^2 x 128 = 2.74877906944e11.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from tests.conftest import EXAMPLES

FWD = 2 * 16 * 8192 ** 2 * 128  # causal-half forward attention FLOP per layer, micro-batch and rank
PER_STEP = 32 * 16 * 8  # layers x micro-batches x ranks


def _step(**training):
    cfg = load_config(EXAMPLES / "mini_2x4_tp2-dp4.toml")
    cfg = replace(cfg, training=cfg.training.model_copy(update=training))
    return step_time(build_plan(cfg))


def test_flash_backward_is_why_hfu_exceeds_mfu_without_recompute():
    st = _step()
    # FlashAttention-2's backward recomputes QK^T: 2.5x the forward against the model's 2x, so
    # 0.5 x FWD per layer and micro-batch: 1.374e11 x 4096 = 5.6295e14 FLOP per step
    assert dict(st.flop_gap) == {"flash backward recomputes QK^T": pytest.approx(0.5 * FWD * PER_STEP, rel=1e-12)}
    assert st.hardware_flops - st.model_flops == pytest.approx(0.5 * FWD * PER_STEP, rel=1e-9)
    gap_pp = 0.5 * FWD * PER_STEP / (st.step_s * 8 * st.peak_flops) * 100
    assert (st.hfu - st.mfu) * 100 == pytest.approx(gap_pp, rel=1e-9)
    line = next(x for x in st.lines() if x.startswith("tokens/s"))
    assert f"(executed FLOP, recompute included; above MFU by: flash backward recomputes QK^T {gap_pp:.1f} pp)" in line


def test_non_flash_attention_counts_the_full_products():
    st = _step(flash_attention=False)
    # QK^T and PV in full: forward 4 b a s^2 d against the model's 2 (one FWD more), backward
    # twice that (two FWD more): 3 x FWD per layer and micro-batch
    assert dict(st.flop_gap) == {"full attention products (no causal skip)": pytest.approx(3 * FWD * PER_STEP,
                                                                                            rel=1e-12)}


def test_padded_vocabulary_is_named():
    st = _step(vocab_pad_divisor=1000)
    # vocab 128256 padded to ceil(128256 / (1000 x tp 2)) x 2000 = 130000; the output layer's
    # forward, data- and weight-gradient GEMMs (3 x 2 x tokens x h x V/tp) over the 1744 padded
    # rows: 6 x 8192 x 4096 x 872 per micro-batch and rank, x 16 x 8
    pad = 6 * 8192 * 4096 * (130000 - 128256) / 2 * 16 * 8
    assert dict(st.flop_gap)["padded vocabulary"] == pytest.approx(pad, rel=1e-12)


def test_hfu_parts_add_up_under_a_hottest_expert_share():
    """Mixtral-8x7B at dp_shard 256 x ep 8 with training.moe_hottest_expert_share 0.2 (a newcomer's
    config): the step times every rank as the busiest ep rank, whose hottest expert takes 0.2 of the
    routed rows, while the model FLOP count balanced routing. HFU printed 46.7% = MFU 24.5% +
    recompute 11.4 + flash 1.0 pp: 9.8 pp unnamed. The parts now hold that extra work, so
    MFU + the parts = HFU (to the 0.1 pp each is printed at, four roundings)."""
    from pathlib import Path

    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import HOT_EXPERT_GAP, step_time

    st = step_time(build_plan(load_config(Path(__file__).parent / "data" / "nc33" / "mixtral_256_ep8.toml")))
    den = st.step_s * st.world * st.peak_flops
    parts = dict(st.flop_gap)
    assert HOT_EXPERT_GAP in parts and parts[HOT_EXPERT_GAP] / den > 0.05
    assert st.mfu + sum(parts.values()) / den == pytest.approx(st.hfu, rel=1e-9)
