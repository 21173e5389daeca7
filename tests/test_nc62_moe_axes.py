"""Newcomer trial nc62 #2: an MoE plan's axes. :func:`meshplan.memory.constraints.estimate` has no
expert activations, so an MoE model has no first estimate; an axis the batch allows dropping was
still said to solve "no stated constraint (memory fits and the batch allows it without it)", which
the DeepSeek-V3 example's pp 16 contradicted (its capacity row: pp 1 does not fit). Without an
estimate the line now says that it does not know and points at the capacity row."""

from __future__ import annotations

from pathlib import Path

from meshplan.config import load_config
from meshplan.memory.constraints import MOE_UNKNOWN
from meshplan.plan import build_plan

MIXTRAL = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"


def test_moe_axes_claim_no_memory_verdict_without_an_estimate(tmp_path):
    """Mixtral-8x7B on 32 H100s as pp 2 x dp_shard 16 (ep 8 re-factoring dp_shard), zero1, global
    batch 256, micro-batch 1: the batch needs tp*pp*cp >= ceil(32 x 1 / 256) = 1, so pp 2 is not
    forced by the batch (without it tp*pp*cp = 1 >= 1); memory has no first estimate for an MoE
    model, so neither pp nor dp_shard may claim that memory fits without them."""
    text = MIXTRAL.read_text().replace('names = ["dp_shard", "ep"]', 'names = ["pp", "dp_shard", "ep"]')
    text = text.replace("shape = [32, 8]", "shape = [2, 16, 8]").replace('sharding = "zero3"', 'sharding = "zero1"')
    path = tmp_path / "mixtral_pp2.toml"
    path.write_text(text)
    plan = build_plan(load_config(path))
    axes = plan.constraints.axes
    assert axes["pp"] == MOE_UNKNOWN
    assert "memory fits" not in axes["pp"] and "capacity row" in axes["pp"]
    assert "pp" not in plan.constraints.unforced  # not known to solve nothing
    assert axes["dp_shard"] == ("throughput: 16 batch shards (memory: no first estimate for an MoE model, "
                                "see the capacity row)")
