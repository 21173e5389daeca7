"""torchtitan b5bcd76's model code as ``training.op_sac_policy = "b5bcd76"`` names it under framework
torch (meshplan.spec.training_knobs.TrainingKnobs.torchtitan_revision), at every recompute:

- one ``wqkv`` GEMM: the llama3 and qwen3 flavors build ``fuse_qkv=True`` (models/llama3/__init__.py:77,
  models/qwen3/__init__.py:99, 144), ``FusedQKVLinear`` (models/common/attention.py:722-810) runs
  ``self.wqkv(x)`` once (line 771), a ColwiseParallel Linear of ``n_kv_heads x (n_heads / n_kv_heads +
  2) x head_dim`` outputs, ``(q + 2 kv) d / tp`` per tp rank;
- no context parallelism without flex attention: ``Decoder.Config.update_from_config``
  (models/common/decoder.py:173-183) raises NotImplementedError at ``context_parallel_degree > 1``
  where a block's attention is SDPA or varlen; meshplan plans torch's CP as the SDPA ring, so the
  mesh is infeasible (rule torch_cp_flex), as Megatron-LM's cp without TE's fused attention is.

Llama 3 8B: 32 q heads, 8 KV heads of 128, hidden 4096; seq 8192, micro-batch 1.
"""

from __future__ import annotations

import pytest

from meshplan.errors import ConfigError

from meshplan.compute.kernel_time import gemm_ops
from meshplan.compute.shapes import Gemm
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.workload import plan_step_gemms, workload_of
from meshplan.search.driver import search
from meshplan.search.reasons import REASONS


def _cfg(policy: str = "b5bcd76", recompute: str = "none", names=("dp_shard",), shape=(8,), framework="torch",
         search_opts=None):
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 8192, "recompute": recompute, "op_sac_policy": policy,
                      "framework": framework},
         "mesh": {"names": list(names), "shape": list(shape)}}
    if search_opts:
        d["search"] = search_opts
    return config_from_dict(d)


@pytest.mark.parametrize("tp, n", [(1, 6144), (2, 3072), (8, 768)])
def test_b5bcd76_times_one_wqkv_gemm(tp, n):
    """N = (32 + 2 x 8) x 128 / tp: 6144 at tp 1, 3072 at tp 2, 768 at tp 8 (M 8192 tokens, K 4096):
    the plan's GEMMs as its step times them hold that one GEMM in place of wq (4096 / tp), wk and wv
    (1024 / tp each); 238fa99 keeps the three."""
    mesh = dict(names=("dp_shard", "tp"), shape=(8 // tp, tp)) if tp > 1 else {}
    b5 = [(g.name, g.m, g.n, g.k) for g in plan_step_gemms(build_plan(_cfg(**mesh)))][:2]
    assert b5 == [("qkv", 8192, n, 4096), ("wo", 8192, 4096, 4096 // tp)]
    old = [(g.name, g.n) for g in plan_step_gemms(build_plan(_cfg("238fa99", **mesh)))][:3]
    assert old == [("wq", 4096 // tp), ("wk", 1024 // tp), ("wv", 1024 // tp)]


def test_the_three_projections_cost_the_one_gemm():
    """At dp_shard 8, tp 1: the layer's wq, wk and wv ops (forward, data and weight gradients) add up
    to gemm_ops of Gemm("qkv", 8192, 6144, 4096), each pass shared by width (wq 4096/6144 = 2/3, wk and
    wv 1/6 each); under 238fa99 they are three GEMMs of their own, and one GEMM of 6144 is not slower than
    them (a wider N fills more tiles per wave)."""
    def qkv_ops(policy):
        plan = build_plan(_cfg(policy))
        st = step_time(plan, Overlap())
        return plan, [o for o in st.units.chunks[0][0].layers[0].ops if o.name.split(".")[0] in ("wq", "wk", "wv")]
    plan, ops = qkv_ops("b5bcd76")
    whole = gemm_ops(plan.config.cluster.gpu, Gemm("qkv", 8192, 6144, 4096), "attn", workload_of(plan), None)
    assert sum(o.seconds for o in ops) == pytest.approx(sum(o.seconds for o in whole), rel=1e-9)
    fwd = {o.name: o.seconds for o in ops if o.phase == "forward"}
    assert fwd["wq"] == pytest.approx(whole[0].seconds * 2 / 3) and fwd["wk"] == pytest.approx(whole[0].seconds / 6)
    assert all("of fused QKV" in o.note for o in ops)
    _, three = qkv_ops("238fa99")
    assert not any("fused" in o.note for o in three)
    assert sum(o.seconds for o in ops) <= sum(o.seconds for o in three)


def test_megatron_and_mla_unchanged_by_the_policy():
    """The revision is torchtitan's: under framework megatron the field moves nothing (Megatron-LM
    fuses QKV at either value: "238fa99", what import torchtitan writes, plans as unset); the knob acts
    under torch at any recompute (its model code), under megatron only at recompute op. Since the
    merge with style50, "b5bcd76" under megatron, read nowhere, is a one-line error naming the field
    (spec.training_checks.check_op_sac_policy)."""
    a, b = (build_plan(_cfg(p, framework="megatron")) for p in ("238fa99", None))
    assert step_time(a, Overlap()).step_s == step_time(b, Overlap()).step_s
    with pytest.raises(ConfigError, match="training.op_sac_policy") as e:
        _cfg("b5bcd76", framework="megatron")
    assert "\n" not in str(e.value) and "remove op_sac_policy" in str(e.value)
    t = _cfg().training
    assert t.knob_acts("op_sac_policy") == (True, "b5bcd76")
    assert _cfg("238fa99", framework="megatron").training.knob_acts("op_sac_policy") == (False, "238fa99")


def test_cp_without_flex_is_infeasible_at_b5bcd76():
    """dp_shard 4 x cp 2 under torch: at b5bcd76 infeasible with torchtitan's words and the fix (one
    line); at 238fa99 (SDPA ring CP) planned; under megatron unaffected."""
    mesh = dict(names=("dp_shard", "cp"), shape=(4, 2))
    p = build_plan(_cfg(recompute="full", **mesh))
    assert not p.feasible
    (why,) = [r for r in p.reasons if "torchtitan b5bcd76" in r]
    assert "models/common/decoder.py:173-183" in why and "Use FlexAttention or disable CP" in why
    assert "fix: cp 1, or training.op_sac_policy = \"238fa99\"" in why and "\n" not in why
    assert build_plan(_cfg("238fa99", recompute="full", **mesh)).feasible
    assert build_plan(_cfg("238fa99", recompute="full", framework="megatron", **mesh)).feasible


def test_search_offers_no_cp_at_b5bcd76():
    """The search's rule engine holds the same rule: with [search] cp [1, 2] every cp 2 row of the
    b5bcd76 search breaks rule torch_cp_flex first (seq 8192 divides by 2 x cp), and no cp 2 mesh is
    shown; at 238fa99 none breaks it."""
    opts = dict(cp=[1, 2], pp=[1], tp=[1], micro_batch=[1], recompute=["full"], sharding=["zero3"])
    opts = dict(search_opts=opts)
    keys = [k for k, _ in REASONS]
    r = search(_cfg(recompute="full", **opts))
    cp2 = r.candidates.cp == 2
    assert cp2.any() and (r.code[cp2] == keys.index("torch_cp_flex")).all() and (r.code[~cp2] == -1).any()
    assert r.top and all(int(r.candidates.cp[e.index]) == 1 for e in r.top)
    r0 = search(_cfg("238fa99", recompute="full", **opts))
    assert not (r0.code == keys.index("torch_cp_flex")).any() and (r0.code[r0.candidates.cp == 2] == -1).any()
