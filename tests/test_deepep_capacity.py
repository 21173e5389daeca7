"""A capacity factor under ``training.moe_dispatcher = "deepep"`` (newcomer trial 24, finding 1).

Megatron-LM (NVIDIA/Megatron-LM d98e8a6) refuses only ``--moe-pad-expert-input-to-capacity`` with
the flex dispatcher's deepep backend (``transformer_config.py`` lines 1754-1761); with
``--moe-expert-capacity-factor`` its router drops the copies over ``C = ceil(f T k / E)`` per expert
of the rank's own tokens (``moe_utils.apply_router_token_dropping``, ``router.py`` line 794) and
``_DeepepManager.setup_metadata`` masks them (index -1) before ``fused_dispatch``: only kept copies
travel, nothing padded. The DeepSeek-V3 example (ep 64 over 8 DGX H100 nodes, groups = nodes,
E 256, k 8, T 4096 tokens of 7168 x 2 B) derived by hand.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb
from pathlib import Path

import numpy as np
import pytest

from meshplan.compute.routing import RoutingOptions, a2a_rows, routing
from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron import write
from meshplan.plan import build_plan
from meshplan.schedule.ep_routing import routing_caveat
from tests.configs import example_toml

NAME = "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"
DSV3 = Path(__file__).resolve().parents[1] / "examples" / NAME
PER = 4096 * 7168 * 2  # bytes of a rank's tokens per call


def _plan(tmp_path, **training):
    f = tmp_path / "c.toml"
    f.write_text(example_toml(NAME, moe_dispatcher="deepep", **training))
    return build_plan(load_config(f))


def _ep(tmp_path, **training):
    return [r for r in _plan(tmp_path, **training).stage(1).collectives if r.axis == "ep"]


def _node_hit(keep: Fraction) -> Fraction:
    """P(a node receives a token): its group (32 experts) chosen, 4 of 8 (1/2), and at least one of the
    token's 8 experts among the 128 of the chosen groups on it and kept; a experts on it are
    hypergeometric, each kept with probability ``keep``."""
    miss = sum(Fraction(comb(32, a) * comb(96, 8 - a), comb(128, 8)) * (1 - keep) ** a for a in range(9))
    return Fraction(1, 2) * (1 - miss)


def test_a_capacity_factor_that_drops_nothing_under_balanced_routing_sends_the_dropless_bytes(tmp_path):
    # T k / E = 4096 x 8 / 256 = 128 copies per expert per source rank; C = ceil(1.25 x 128) = 160
    capped, dropless = _ep(tmp_path, moe_capacity_factor=1.25)[0], _ep(tmp_path)[0]
    assert capped.link_bytes == dropless.link_bytes and capped.time_s == dropless.time_s
    assert capped.link_bytes[1] == pytest.approx(PER * 7 * float(_node_hit(Fraction(1))), rel=1e-9)  # 186.5 MB


def test_a_capacity_that_keeps_half_the_copies_thins_deepeps_node_and_rank_copies(tmp_path):
    # C = ceil(0.5 x 128) = 64: every expert keeps 64 of its 128 copies, q = 1/2
    plan = _plan(tmp_path, moe_capacity_factor=0.5)
    row = [r for r in plan.stage(1).collectives if r.axis == "ep"][0]
    nvl, net = row.link_bytes
    assert net == pytest.approx(PER * 7 * float(_node_hit(Fraction(1, 2))), rel=1e-9)
    assert net == pytest.approx(135.9e6, rel=1e-3)  # of 186.5 MB dropless: fewer nodes hit
    # ranks: 4 experts each, groups of 8 ranks; P(rank hit) = 1/2 (1 - sum_a C(4,a) C(124,8-a) / C(128,8) (1/2)^a)
    miss_r = sum(Fraction(comb(4, a) * comb(124, 8 - a), comb(128, 8)) * Fraction(1, 2) ** a for a in range(5))
    ranks = 64 * Fraction(1, 2) * (1 - miss_r)
    assert nvl == pytest.approx(PER * float(ranks) * 7 / 8, rel=1e-9)
    # the step's note and the plan's say the same thinned copies: 7/8 x 8 x P(node hit) = 2.31 across nodes
    assert round(7 * float(_node_hit(Fraction(1, 2))), 2) == 2.31
    note = routing_caveat(plan)
    assert "2.31 of 8 copies per token cross nodes" in note and "0.5 of the copies kept by the capacity" in note
    assert any("16384 of the 32768 copies kept and sent (balanced), 16384 dropped per rank per layer" in n
               for n in plan.notes)


def test_unpadded_capacity_rows_keep_at_most_c_per_expert_with_a_hot_expert():
    # E 8, k 2, T 100, ep 2, hottest share 0.4: hot 80 copies, others 0.6 x 200 / 7 = 17.14 -> 18;
    # C = ceil(1 x 200 / 8) = 25: hot keeps 25 (55 dropped), others all 18 (<= 25)
    r = routing(RoutingOptions(capacity_factor=1.0, hottest_share=0.4, padded=False), 100, 2, 8, 2)
    assert (r.capacity, r.send_rows, r.hot_expert_rows, r.other_expert_rows) == (25, 25 + 7 * 18, 2 * 25, 2 * 18)
    assert r.recv_rows == 2 * (25 + 3 * 18) and r.dropped == 55
    ro = RoutingOptions(capacity_factor=1.0, hottest_share=0.4, padded=False)  # the search's vectorised form
    assert a2a_rows(ro, np.array([100]), 2, 8, np.array([2])).tolist() == [r.recv_rows]
    padded = routing(RoutingOptions(capacity_factor=1.0, hottest_share=0.4), 100, 2, 8, 2)
    assert (padded.send_rows, padded.hot_expert_rows) == (8 * 25, 2 * 25)


def _args(tmp_path, *extra: str) -> Path:
    flags = [x for x in write(load_config(DSV3)) if not x.startswith("--moe-token-dispatcher-type")]
    f = tmp_path / "a.args"
    f.write_text("\n".join(flags + ["--moe-token-dispatcher-type flex", *extra]) + "\n")
    return f


def test_import_plans_flex_with_a_capacity_factor_and_refuses_only_the_padding_flag(tmp_path):
    opts = ImportOptions(cluster="dgx-h100", nodes=256)
    got = load_any(_args(tmp_path, "--moe-expert-capacity-factor 1.25"), "megatron", opts)
    assert (got.training.moe_dispatcher, got.training.moe_capacity_factor) == ("deepep", 1.25)
    assert not any("padded" in n for n in got.notes)
    with pytest.raises(ConfigError) as e:
        load_any(_args(tmp_path, "--moe-expert-capacity-factor 1.25", "--moe-pad-expert-input-to-capacity"),
                 "megatron", opts)
    assert e.value.field == "--moe-pad-expert-input-to-capacity"
    assert "Flex token dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity" in str(e.value)
