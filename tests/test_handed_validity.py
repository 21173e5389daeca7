"""Handed cases C4 (degrees, -1), C6 (KV heads vs tp), C7 (vocab padding), C8 (layers vs
pp/vpp), C1 batch arithmetic: exact values from ../shared/cases/handed-cases.md."""

import pytest

from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Infeasible, resolve_mesh
from meshplan.mesh.layers import stage_layers, vpp_from_chunk
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.mesh.tpsplit import heads_reason, local_heads, local_numel, padded_vocab
from meshplan.mesh.validity import check


def mesh_of(world, **degrees):
    return resolve_mesh(MeshSpec(names=list(degrees), shape=list(degrees.values())), world)


# C4 ---------------------------------------------------------------------------------------
def test_c4_product_mismatch_is_infeasible_with_numbers():
    m = mesh_of(8, dp_shard=8, cp=8)
    assert isinstance(m, Infeasible)
    assert m.reasons == ("dp_shard(8) * cp(8) = 64 != world(8); fix: shape [1, 8] (dp_shard = 8 / cp 8 = 1; "
                         "or -1 there to infer it)",)


def test_c4_minus_one_not_divisible_rejected():
    m = mesh_of(8, tp=2, pp=3, dp=-1)
    assert isinstance(m, Infeasible)
    assert "8 is not divisible by tp 2 * pp 3 = 6" in m.reasons[0]


def test_c4_minus_one_inferred():
    assert mesh_of(6, tp=2, pp=3, dp=-1).degree("dp") == 1
    m = mesh_of(8, dp_replicate=2, tp=2, dp_shard=-1)
    assert m.degree("dp_shard") == 2
    assert "dp_shard = 8 / (dp_replicate 2 * tp 2) = 2" in m.derivation


@pytest.mark.parametrize("bad", [0, -2, -7])
def test_c4_degree_zero_or_below_minus_one_is_config_error(bad):
    with pytest.raises(ConfigError, match=r"mesh\.tp: degree .* not allowed"):
        mesh_of(8, tp=bad, dp=-1)


def test_two_minus_ones_is_config_error():
    with pytest.raises(ConfigError, match="at most one degree"):
        mesh_of(8, tp=-1, dp=-1)


# C6 ---------------------------------------------------------------------------------------
def _m(q, kv, hidden=4096, d=128):
    return ModelSpec(layers=2, hidden=hidden, ffn=4 * hidden, q_heads=q, kv_heads=kv, head_dim=d, vocab=1000)


def test_c6_kv_heads_fewer_than_tp_a_stated_mechanism_or_rejected():
    """C6 (32 q / 4 KV heads, tp 8): framework megatron plans Megatron-LM's QKV sub-sharding
    (f7dfb99, d98e8a6 attention.py:1851-1871: each rank 1/8 of wk/wv, 64 of the 512 K rows, the
    fused QKV output all-gathered over tp per layer; stated in the note); framework torch rejects it
    (rule torch_kv_heads). meshplan's own runtime keeps one KV head per rank (128 rows, copied 2x)."""
    m = _m(32, 4)
    assert heads_reason(m, 8) is None
    q, kv, rep = local_heads(m, 8)
    assert (q, kv, rep) == (4, 1, 2)  # 4 q heads, one KV head used by 2 ranks
    wk = [t for t in m.layer_tensors(0) if t.name == "wk"][0]
    assert local_numel(wk, m, 8) == 128 * 4096  # the runtime's copy: 128 K features per rank
    assert local_numel(wk, m, 8, framework="megatron") == 512 * 4096 // 8 == 64 * 4096  # Megatron: 1/tp
    v = check(m, TrainingSpec(global_batch=8, seq_len=128, framework="megatron"), mesh_of(8, tp=8),
              MeshSpec(names=["tp"], shape=[8]))
    assert v.reasons == ()
    assert any("Megatron-LM's QKV sub-sharding" in n and "no KV head is replicated" in n and "{2i..2i+1}" in n
               and "neither refusing tp 8 nor replicating each KV head 2x" in n for n in v.notes)
    v = check(m, TrainingSpec(global_batch=8, seq_len=128), mesh_of(8, tp=8), MeshSpec(names=["tp"], shape=[8]))
    assert v.reasons == ("framework torch: tp 8 with kv_heads 4: torchtitan shards wk/wv colwise over tp and views "
                         "each rank's slice as whole KV heads (b5bcd76 decoder_sharding.py:182-192, "
                         "attention.py:698-705); it replicates no KV head; fix: tp 1, 2 or 4 (a divisor of kv_heads "
                         "4), or training.framework = \"megatron\" (Megatron-LM runs tp > kv_heads)",)


def test_c6_40_q_10_kv_tp4_rejected():
    assert heads_reason(_m(40, 10, hidden=5120), 4) == \
        "kv_heads 10 vs tp 4: need kv_heads % tp == 0 or tp % kv_heads == 0"


def test_c6_model_keeps_8_kv_heads_at_tp16():
    m = _m(128, 8, hidden=16384)
    assert heads_reason(m, 16) is None
    assert m.n_kv_heads == 8
    assert local_heads(m, 16) == (8, 1, 2)


# C7 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("v,div,tp,expect", [
    (32002, 128, 2, 32256), (32002, 128, 8, 32768),
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 8, 51200),
    (128256, 64, 8, 128512), (128256, 128, 8, 129024)])
def test_c7_vocab_padding(v, div, tp, expect):
    assert padded_vocab(v, div, tp) == expect


def test_c7_per_rank_rows():
    assert padded_vocab(32002, 128, 2) // 2 == 16128
    assert padded_vocab(128256, 64, 8) // 8 == 16064


# C8 ---------------------------------------------------------------------------------------
def test_c8_interleaved_assignment():
    assert stage_layers(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_c8_rejections():
    """Each C8 rejection's reason, whole: 80 / 16 = 5 a stage, not a multiple of 2; 30 / 4 = 7.5;
    8 + 7 + 7 + 7 = 29; 40 / 2 = 20 a stage, 20 / 12 = 1.66667 a chunk."""
    assert vpp_from_chunk(80, 16, 2) == "5 layers per stage (80 / pp 16) are not a multiple of 2 layers per virtual stage"
    assert stage_layers(30, 4) == "30 layers do not divide into pp 4 stages (7.5 per stage); give an explicit pp_layer_split"
    assert stage_layers(30, 4, split=[8, 8, 7, 7])[3] == [[23, 24, 25, 26, 27, 28, 29]]
    assert stage_layers(30, 4, split=[8, 7, 7, 7]) == "pp_layer_split [8, 7, 7, 7] sums to 29, must be 30 layers"
    assert stage_layers(40, 2, 12) == ("20 layers per stage (40 / pp 2) do not divide into vpp 12 virtual stages "
                                       "(1.66667 layers per chunk)")
    s = stage_layers(40, 2, 10)
    assert all(len(chunk) == 2 for stage in s for chunk in stage)


# C1 batch arithmetic ---------------------------------------------------------------------
def test_c1_microbatches_exclude_cp():
    spec = MeshSpec(order="tp-cp-ep-dp-pp", degrees={"tp": 1, "cp": 16, "ep": 1, "dp": 2, "pp": 1})
    mesh = resolve_mesh(spec, 32)
    model = ModelSpec(layers=4, hidden=1024, ffn=4096, q_heads=16, vocab=1000)
    v = check(model, TrainingSpec(global_batch=16, micro_batch=1, seq_len=4096), mesh, spec)
    assert v.reasons == ()
    assert v.micro_batches == 8
    assert mesh.group_of(17, "cp") == list(range(16, 32))
    assert mesh.group_of(17, "dp") == [1, 17]


def test_batch_not_divisible_is_reason():
    spec = MeshSpec(names=["dp"], shape=[3])
    mesh = resolve_mesh(spec, 3)
    model = ModelSpec(layers=2, hidden=64, ffn=256, q_heads=4, vocab=100)
    v = check(model, TrainingSpec(global_batch=16, seq_len=64), mesh, spec)
    assert v.reasons == ("global_batch 16 is not divisible by micro_batch 1 * dp 3 = 3",)
