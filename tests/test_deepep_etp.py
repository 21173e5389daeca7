"""etp > 1 under Megatron-LM's flex dispatcher (``training.moe_dispatcher = "deepep"``): it runs over
the ``tp_ep`` group, ep x etp ranks with etp innermost, and sends a token to every etp rank of each
destination ep rank (``MoEFlexTokenDispatcher`` and ``_initialize_metadata``, NVIDIA/Megatron-LM
d98e8a6 token_dispatcher.py lines 1834-1843 and 1893-1919), each rank dispatching its own
sequence-parallel tokens. Checked against a Monte-Carlo of that routing and by hand at the
DeepSeek-V3 example re-meshed ep 32 x etp 2 (the same 64 ranks as its ep 64)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

from meshplan.comm.deepep import copies
from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.memory.timeline import memory_timeline
from meshplan.plan import build_plan
from tests.configs import example_toml

NAME = "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"


def _ratio(a: int, b: int, k: int) -> Fraction:
    """C(a, k) / C(b, k) as a product (by hand, not math.comb)."""
    out = Fraction(1)
    for i in range(k):
        out *= Fraction(a - i, b - i)
    return out


def _sampled(experts, top_k, ep, etp, nodes, groups, chosen, tokens=40000, seed=1):
    """(distinct nodes, distinct ranks) per token of the flex group, sampled: uniform group choice,
    uniform top-k in the chosen groups, each expert's ep rank replicated on its etp ranks."""
    rng = np.random.default_rng(seed)
    per_group = experts // groups
    picked = np.argsort(rng.random((tokens, groups)), axis=1)[:, :chosen]
    slot = np.argsort(rng.random((tokens, chosen * per_group)), axis=1)[:, :top_k]
    expert = picked[np.arange(tokens)[:, None], slot // per_group] * per_group + slot % per_group
    ep_rank = expert // (experts // ep)
    ranks = (ep_rank[:, :, None] * etp + np.arange(etp)).reshape(tokens, -1)   # etp innermost
    node = ranks // (ep * etp // nodes)
    distinct = lambda a, n: np.array([(np.bincount(r, minlength=n) > 0).sum() for r in a]).mean()
    return distinct(node, nodes), distinct(ranks, ep * etp)


@pytest.mark.parametrize("experts, top_k, ep, etp, nodes, groups, chosen", [
    (256, 8, 32, 2, 8, 8, 4),   # DeepSeek-V3 at ep 32 x etp 2 over 8 nodes: 4 ep ranks a node
    (64, 6, 8, 2, 2, 1, 1),     # plain top-k, 8 ep ranks x 2 over 2 nodes of 8
    (64, 6, 4, 16, 8, 1, 1)])   # etp 16 past a node's 8 GPUs: each ep rank's ranks over 2 nodes
def test_flex_copies_match_monte_carlo(experts, top_k, ep, etp, nodes, groups, chosen):
    c = copies(experts, top_k, ep, nodes, groups if groups > 1 else None, chosen if groups > 1 else None, etp=etp)
    n, r = _sampled(experts, top_k, ep, etp, nodes, groups, chosen)
    # 40,000 tokens: a standard error of about 0.2% of either mean; 0.6% is three of them
    assert c.nodes == pytest.approx(n, rel=0.006) and c.ranks == pytest.approx(r, rel=0.006)


def _plan(tmp_path, ep: int, etp: int):
    text = example_toml(NAME, moe_dispatcher="deepep").replace(
        'names = ["pp", "dp_shard", "ep"]\nshape = [16, 128, 64]',
        f'names = ["pp", "dp_shard", "ep", "etp"]\nshape = [16, 128, {ep}, {etp}]')
    f = tmp_path / f"ep{ep}x{etp}.toml"
    f.write_text(text)
    return build_plan(load_config(f))


def test_deepseek_v3_ep32_etp2_by_hand(tmp_path):
    p = _plan(tmp_path, 32, 2)
    rows = [r for r in p.collectives["stage 1"] if r.algorithm == "deepep"]
    assert rows and all(r.group_size == 64 and r.example_ranks == tuple(range(64)) for r in rows)
    # each rank dispatches its own 4096 tokens (tp 1: b s = 4096) of 7168 x 2 B
    per = 4096 * 7168 * 2
    # the nodes hold ep 64's experts: 7/8 x 8 x 1/2 (1 - C(96,8)/C(128,8)) other nodes per token
    other = 7 * Fraction(1, 2) * (1 - _ratio(96, 128, 8))
    # 32 ep ranks of 8 experts, each hit w.p. 1/2 (1 - C(120,8)/C(128,8)); 2 etp ranks each; 7/8 off the forwarder
    ranks = 2 * 32 * Fraction(1, 2) * (1 - _ratio(120, 128, 8))
    nvlink, network = rows[0].link_bytes
    assert network == pytest.approx(per * float(other), rel=1e-12)             # 186.5 MB, as at ep 64
    assert nvlink == pytest.approx(per * float(ranks) * 7 / 8, rel=1e-12)      # 677.9 MB (ep 64: 378.1 MB)
    assert round(network / 1e6, 1) == 186.5 and round(nvlink / 1e6, 1) == 677.9
    # the DeepEP buffer over the same 64 ranks as ep 64's: 747,279,776 B (tests/test_deepep_buffers.py)
    init = memory_timeline(p, 1).templates[0]
    assert [e[2] for e in init if "DeepEP buffer over ep x etp 64" in e[3]] == [747_279_776]
    assert any("each destination ep rank's 2 etp ranks; the group is ep x etp = 64" in n for n in p.notes)


def test_group_size_without_a_deepep_config_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, 128, 2)
    assert e.value.field == "training.moe_dispatcher"
    assert "ep 128 x etp 2 = 256 ranks" in e.value.message and "moe_dispatcher = \"alltoall\"" in e.value.message


def test_search_rejects_group_sizes_deepep_has_no_config_for():
    """24 GPUs (3 DGX H100 nodes), 12 experts: an ep x etp group of 3, 6 or 12 ranks has no DeepEP config
    and one of 1 rank none at all (Megatron-LM asserts TPxEP > 1): rule ``deepep``, after the rules
    before it; 2, 4, 8 and 24 are kept. build_plan gives the same reasons."""
    from meshplan.config import config_from_dict
    from meshplan.search.driver import search
    from meshplan.search.reasons import CODE
    from meshplan.spec.mesh import MeshSpec
    from tests.test_search import MOE

    model = dict(MOE, name="moe12", experts=12, expert_ffn=1536)
    training = {"global_batch": 48, "seq_len": 1024, "framework": "megatron", "moe_dispatcher": "deepep"}
    cfg = config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 3}, "training": training,
                            "search": {"micro_batch": [1], "recompute": ["full"], "pp": [1]}}, require_mesh=False)
    r = search(cfg, workers=1)
    group, deepep = r.candidates.ep * r.candidates.etp, CODE["deepep"]
    odd = np.isin(group, [1, 3, 6, 12])
    assert (r.code == deepep).any() and not (r.code[~odd] == deepep).any()
    # every odd group is rejected, by rule deepep or by a rule before it
    assert ((r.code[odd] >= 0) & (r.code[odd] <= deepep)).all()
    # the search's configs carry their mesh past load_config's check (a given mesh: the ConfigError above)
    plan = build_plan(replace(cfg, mesh=MeshSpec(names=["dp_shard", "tp", "ep", "etp"], shape=[12, 2, 6, 1])))
    assert plan.reasons[-1].startswith("deepep: ep 6 x etp 1 = 6 ranks, a group size DeepEP has no dispatch config")
    plan = build_plan(replace(cfg, mesh=MeshSpec(names=["dp_shard", "tp"], shape=[12, 2])))
    assert plan.reasons[-1].startswith("deepep: ep 1 x etp 1: Megatron-LM's flex dispatcher asserts TPxEP > 1")


def test_a_given_mesh_without_an_ep_x_etp_group_is_refused(tmp_path):
    text = example_toml(NAME, moe_dispatcher="deepep").replace(
        'names = ["pp", "dp_shard", "ep"]\nshape = [16, 128, 64]', 'names = ["pp", "dp_shard"]\nshape = [16, 128]')
    f = tmp_path / "ep1.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert e.value.field == "training.moe_dispatcher" and "asserts TPxEP > 1" in e.value.message
