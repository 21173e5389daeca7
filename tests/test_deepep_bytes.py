"""DeepEP's copies per token (meshplan.comm.deepep): the closed form against a hand derivation
and against a numpy Monte-Carlo of the same routing model (uniform group choice, then uniform
top-k among the chosen groups' experts; fixed seeds)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from meshplan.comm.deepep import copies, hit_probabilities


def _ratio(a: int, b: int, k: int) -> Fraction:
    """C(a, k) / C(b, k) as the product of (a - i)/(b - i), i < k (by hand, not math.comb)."""
    out = Fraction(1)
    for i in range(k):
        out *= Fraction(a - i, b - i)
    return out


def test_8_nodes_of_8_gpus_256_experts_top_8_in_4_of_8_groups_by_hand():
    # each node is one group of 32 experts; chosen with probability 4/8, then missed only if all
    # 8 experts fall in the other 3 chosen groups' 96 of 128: P(hit) = 1/2 (1 - C(96,8)/C(128,8))
    p = Fraction(1, 2) * (1 - _ratio(96, 128, 8))
    c = copies(256, 8, 64, 8, 8, 4)
    assert c.nodes == pytest.approx(float(8 * p), rel=1e-12)          # 3.6290
    assert c.other_nodes == pytest.approx(float(7 * p), rel=1e-12)    # 3.1754: the token's own node is 1 of 8
    # ranks: 4 experts each, the rank's group chosen with probability 1/2, then C(124,8)/C(128,8) to miss
    r = 64 * Fraction(1, 2) * (1 - _ratio(124, 128, 8))
    assert c.ranks == pytest.approx(float(r), rel=1e-12)              # 7.3594
    assert c.nvlink == pytest.approx(float(r) * 7 / 8, rel=1e-12)
    # plain top-k over the same 8 nodes: 1 - C(224,8)/C(256,8) per node
    plain = copies(256, 8, 64, 8)
    assert plain.other_nodes == pytest.approx(float(7 * (1 - _ratio(224, 256, 8))), rel=1e-12)  # 4.6328
    assert round(c.other_nodes, 4) == 3.1754 and round(plain.other_nodes, 4) == 4.6328


def _monte_carlo(experts, top_k, units, groups, chosen, tokens=60000, seed=0) -> np.ndarray:
    """Per unit, the share of tokens that send it at least one copy, sampled."""
    rng = np.random.default_rng(seed)
    per_group = experts // groups
    picked = np.argsort(rng.random((tokens, groups)), axis=1)[:, :chosen]           # uniform M-subset of groups
    slot = np.argsort(rng.random((tokens, chosen * per_group)), axis=1)[:, :top_k]  # uniform k of the pool
    expert = picked[np.arange(tokens)[:, None], slot // per_group] * per_group + slot % per_group
    unit = expert // (experts // units)
    hit = np.zeros((tokens, units), dtype=bool)
    hit[np.arange(tokens)[:, None], unit] = True
    return hit.mean(axis=0)


@pytest.mark.parametrize("experts, top_k, units, groups, chosen", [
    (256, 8, 8, 8, 4),    # the groups are the nodes
    (256, 8, 4, 8, 4),    # two groups per node
    (256, 8, 16, 8, 4),   # a group over two nodes
    (64, 6, 8, 1, 1),     # plain top-k
    (160, 6, 16, 8, 3)])  # DeepSeek-V2's device-limited routing, 10 experts per unit over groups of 20
def test_closed_form_matches_monte_carlo(experts, top_k, units, groups, chosen):
    exact = np.array(hit_probabilities(experts, top_k, units, groups, chosen))
    sampled = _monte_carlo(experts, top_k, units, groups, chosen)
    # 60,000 tokens: standard error <= 0.5 / sqrt(60000) = 0.002 per unit
    assert np.abs(sampled - exact).max() < 0.01
    assert abs(sampled.sum() - exact.sum()) < 0.03


def test_the_groups_come_from_the_hf_config_and_are_checked():
    import json
    from pathlib import Path

    from pydantic import ValidationError

    from meshplan.spec.hf import model_from_hf_config
    from meshplan.spec.model import ModelSpec
    hf = Path(__file__).resolve().parent / "data" / "hf"
    v3 = model_from_hf_config(json.loads((hf / "deepseek-v3" / "config.json").read_text()))
    v2 = model_from_hf_config(json.loads((hf / "deepseek-v2" / "config.json").read_text()))
    assert (v3.n_group, v3.topk_group, v2.n_group, v2.topk_group) == (8, 4, 8, 3)
    base = dict(layers=1, hidden=64, ffn=64, q_heads=4, vocab=8, experts=16, top_k=4)
    with pytest.raises(ValidationError, match="go together"):
        ModelSpec(**base, n_group=4)
    with pytest.raises(ValidationError, match="must divide experts 16"):
        ModelSpec(**base, n_group=3, topk_group=1)
    with pytest.raises(ValidationError, match="top_k 4 > the 1 x 2 experts"):
        ModelSpec(**base, n_group=8, topk_group=1)
    assert ModelSpec(**base, n_group=8, topk_group=2).topk_group == 2
