"""torchtitan's op-level selective AC at two commits (``training.op_sac_policy``,
meshplan.compute.recompute.op_sac_fuses_qkv).

238fa99 (and v0.2.2, e347b1e, whose job TOML import reads): llama3's attention projects with three
Linears, so a block's ``aten.mm`` calls are wq, wk, wv, wo, w1, w3, w2 and the odd ones (wq, wv,
w1, w2) are saved. b5bcd76: the llama3 and qwen3 flavors build ``fuse_qkv=True``
(models/llama3/__init__.py:77, common/attention.py FusedQKVLinear 722-810), so the mms are wqkv,
wo, w1, w3, w2; saved wqkv, w1, w2; recomputed wo, w3 (activation_checkpoint.py:243-274: every
second mm recomputed). DeepSeek's MLA (deepseek_v3/model.py:93-151) is the same at both.

Model G of tests/test_activation_checkpointing.py (4 layers, hidden 16, gated MLP 64, 4 heads of
4, 4 KV heads, bf16, flash, seq 8, micro-batch 1, tp 1): 238fa99 keeps 2432 B per layer (layer
input 256, wq 256, wv 256, SDPA output 256 and its statistics 128, w1 1024, w2 256). b5bcd76
keeps wqkv's (4 + 4 + 4) x 4 x 8 x 2 = 768 B in place of wq's and wv's 512: 2688 B.
"""

import pytest

from meshplan.compute.recompute import op_sac_replayed
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.memory.sizes import stage_sizes
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan import catalog

from tests.test_memory_timeline import plan_of

G = dict(layers=4, hidden=16, ffn=64, gated_mlp=True, q_heads=4, vocab=128)


def _kept(plan):
    sz = stage_sizes(plan.config.model, plan.config.training, plan.mesh, plan.stages, plan.state[0],
                     plan.config.memory, [])
    return [sz.acts[i].saved for i in range(4)]


def test_b5bcd76_keeps_the_fused_qkv_output():
    """Per layer (module docstring): 2432 B under 238fa99, 2688 B under b5bcd76 (wk's 8 x 16 x 2 =
    256 B more); the default is 238fa99."""
    assert _kept(plan_of(model=G, recompute="op")) == [2432] * 4
    assert _kept(plan_of(model=G, recompute="op", op_sac_policy="238fa99")) == [2432] * 4
    assert _kept(plan_of(model=G, recompute="op", op_sac_policy="b5bcd76")) == [2688] * 4


def test_b5bcd76_does_not_replay_wk():
    """238fa99 replays wk, wo, w3; b5bcd76 wo and w3: its recompute is shorter by wk's forward GEMM
    in each of the 4 layers (``recompute_s``: one micro-batch's, on stage 0), nothing else
    changes."""
    old = step_time(plan_of(model=G, recompute="op"), Overlap())
    new = step_time(plan_of(model=G, recompute="op", op_sac_policy="b5bcd76"), Overlap())
    names = lambda st: sorted(o.name for o in st.units.chunks[0][0].layers[0].ops if o.recompute)
    assert set(names(old)) - set(names(new)) == {"wk (recompute)"} and set(names(new)) <= set(names(old))
    wk = [o.seconds for o in old.units.chunks[0][0].layers[0].ops if o.name == "wk" and o.phase == "forward"][0]
    assert old.recompute_s() - new.recompute_s() == pytest.approx(4 * wk, rel=1e-9)


def test_mla_is_the_same_under_both():
    """DeepSeek-V2-Lite (MLA without a query latent): wq, wkv_a, wkv_b, wo, then the shared experts'
    w1, w3, w2: wq, wkv_b, w1, w2 saved at both commits."""
    m = catalog.model("deepseek-v2-lite")
    assert op_sac_replayed(m, True, "b5bcd76") == op_sac_replayed(m, True, "238fa99") == {
        "wq": 0.0, "wkv_a": 1.0, "wkv_b": 0.0, "wo": 1.0, "shared_w_up": 0.5, "shared_w_down": 0.0}


def test_llama3_replays_by_hand():
    """Llama 3 8B dense layer: 238fa99 wq 0, wk 1, wv 0, wo 1, w1 0, w3 1, w2 0; b5bcd76 the fused
    wqkv 0 (meshplan's wq, wk, wv), wo 1, w1 0, w3 1, w2 0."""
    m = catalog.model("llama3-8b")
    assert op_sac_replayed(m, False) == {"wq": 0.0, "wk": 1.0, "wv": 0.0, "wo": 1.0, "w_gate": 0.0, "w_up": 1.0,
                                         "w_down": 0.0}
    assert op_sac_replayed(m, False, "b5bcd76") == {"wo": 1.0, "w_gate": 0.0, "w_up": 1.0, "w_down": 0.0,
                                                    "wq": 0.0, "wk": 0.0, "wv": 0.0}


def test_bad_value_is_one_line_naming_the_field():
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 1024, "recompute": "op", "op_sac_policy": "b5bcd7"}}
    with pytest.raises(ConfigError, match="training.op_sac_policy") as e:
        config_from_dict(d, require_mesh=False)
    assert "\n" not in str(e.value) and "b5bcd76" in str(e.value)


def test_knob_acts_under_op_or_torch():
    """tt50: the policy names torchtitan's revision, whose model code (b5bcd76's one wqkv GEMM, its
    CP refusal without flex: tests/test_torchtitan_b5bcd76.py) acts under framework torch at every
    recompute; under megatron only op-level AC reads it."""
    from meshplan.spec.training import TrainingSpec
    t = lambda rc, fw="torch": TrainingSpec(global_batch=8, seq_len=16, recompute=rc, op_sac_policy="b5bcd76",
                                            framework=fw)
    assert t("op").knob_acts("op_sac_policy") == (True, "b5bcd76")
    assert t("full").knob_acts("op_sac_policy") == (True, "b5bcd76")
    assert t("full", "megatron").knob_acts("op_sac_policy") == (False, "b5bcd76")



def _cfg(training: dict, search: dict | None = None):
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 1024, **training}}
    return config_from_dict(d | ({"search": search} if search is not None else {}), require_mesh=False)


def test_policy_acting_nowhere_is_one_line_error():
    """op_sac_policy names a torchtitan revision: under framework torch it is read at every recompute
    (its op-level SAC under "op"; b5bcd76's one wqkv GEMM and CP refusal, 238fa99's etp = tp: tt50,
    nc50fix), so there no error and no note; under Megatron-LM (no torchtitan model code, no op-level
    SAC) nothing reads it, so a value given is a one-line error naming the field and the fix."""
    with pytest.raises(ConfigError, match="training.op_sac_policy") as e:
        _cfg({"framework": "megatron", "sharding": "zero1", "recompute": "full", "op_sac_policy": "b5bcd76"})
    msg = str(e.value)
    assert "\n" not in msg and "framework \"torch\" (here 'megatron'): remove op_sac_policy" in msg
    for training in ({"recompute": "full", "op_sac_policy": "b5bcd76"}, {"recompute": "selective", "op_sac_policy": "b5bcd76"},
                     {"recompute": "op", "op_sac_policy": "238fa99"}):
        assert not [n for n in _cfg(training, {"recompute": ["full"]}).notes if "op_sac_policy" in n]

