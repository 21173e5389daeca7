"""Activation memory (handed case C10, Korthikanti et al. 2022 Table 2 and the 22B model)."""

import pytest

from meshplan.errors import ConfigError
from meshplan.memory.activations import (embedding_terms, head_terms, layer_bytes, layer_options, layer_terms,
                                         table2_bytes)
from meshplan.memory.inflight import (in_flight_chunks, in_flight_microbatches, interleaved_factor,
                                      stage_layer_bytes)
from meshplan.memory.layer_dims import LayerDims
from meshplan.spec.model import ModelSpec
from meshplan.units import GiB

C10 = LayerDims.gpt(s=2048, b=1, h=4096, a=32)
SBH = 2048 * 4096


def test_c10_table2_values():
    assert layer_bytes(C10) == 956_301_312 == SBH * (34 + 5 * 32 * 2048 // 4096)
    assert layer_bytes(C10, tp=8) == 192_937_984
    assert layer_bytes(C10, tp=8, sp=True) == 119_537_664
    assert layer_bytes(C10, tp=8, sp=True, recompute="selective") == 35_651_584


def test_c10_full_recompute_keeps_layer_input():
    assert layer_bytes(C10, tp=8, recompute="full") == 2 * SBH
    assert layer_bytes(C10, tp=8, sp=True, recompute="full") == 2 * SBH // 8
    (term,) = layer_terms(C10, tp=8, sp=True, recompute="full")
    assert term.formula == "2*s*b*h/t"


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_derivation_reduces_to_table2(t, sp, recompute):
    for d in (C10, LayerDims.gpt(s=2048, b=4, h=6144, a=64), LayerDims.gpt(s=512, b=2, h=1024, a=16)):
        assert layer_bytes(d, tp=t, sp=sp, recompute=recompute) == \
            table2_bytes(d.s, d.b, d.h, d.a, t, sp=sp, recompute=recompute)


def test_korthikanti_22b_first_stage_totals():
    """48 layers x per-layer bytes x 1 micro-batch in flight (pp 1, the only stage), layers
    only; full recompute: the 48 stored layer inputs 2sbh (no sequence parallel)."""
    d = LayerDims.gpt(s=2048, b=4, h=6144, a=64)
    total = lambda **kw: stage_layer_bytes(layer_bytes(d, **kw), 48, 0, 1, 1) / GiB
    assert total(tp=8) == pytest.approx(59.25, abs=0.01)
    assert total(tp=8, sp=True, recompute="selective") == pytest.approx(9.56, abs=0.01)
    assert total(tp=8, recompute="full") == pytest.approx(4.50, abs=0.01)
    # with pp the first stage holds L/p layers x p micro-batches: the same L layers' worth
    assert stage_layer_bytes(layer_bytes(d, tp=8), 12, 0, 4, 8) / GiB == pytest.approx(59.25)


def test_gqa_gated_layer_per_tensor():
    s, b, h, a, g, dh, f = 8, 1, 16, 4, 2, 4, 32
    d = LayerDims(s=s, b=b, h=h, a=a, g=g, d=dh, f=f, gated=True, dropout=False)
    got = {t.name: t.size_bytes for t in layer_terms(d)}
    assert got == {
        "attn norm input": 2 * s * b * h, "qkv input": 2 * s * b * h,
        "q": 2 * s * b * a * dh, "k": 2 * s * b * g * dh, "v": 2 * s * b * g * dh,
        "softmax output": 2 * a * s * s * b, "context (out-proj input)": 2 * s * b * a * dh,
        "mlp norm input": 2 * s * b * h, "w_in input": 2 * s * b * h,
        "gate": 2 * s * b * f, "silu output": 2 * s * b * f, "up": 2 * s * b * f,
        "w_out input": 2 * s * b * f,
    }
    fused = layer_bytes(d, fused_glu=True)
    assert layer_bytes(d) - fused == 2 * s * b * f


def test_kv_heads_replicated_when_tp_exceeds_them():
    d = LayerDims(s=8, b=1, h=32, a=8, g=2, d=4, f=64, gated=True, dropout=False)
    k = {t.name: t.size_bytes for t in layer_terms(d, tp=4)}["k"]
    assert k == 2 * 8 * 1 * 1 * 4  # one KV head per rank
    with pytest.raises(ConfigError):
        layer_terms(LayerDims(s=8, b=1, h=40, a=40, g=10, d=1, f=8), tp=4)


def test_flash_drops_scores_keeps_statistics():
    plain = {t.name: t.size_bytes for t in layer_terms(C10, tp=8, sp=True)}
    flash = {t.name: t.size_bytes for t in layer_terms(C10, tp=8, sp=True, flash=True)}
    assert "softmax output" in plain and "softmax output" not in flash
    assert flash["flash softmax statistics (fp32)"] == 4 * (32 // 8) * 2048
    selective = layer_bytes(C10, tp=8, sp=True, recompute="selective")
    assert layer_bytes(C10, tp=8, sp=True, flash=True) == selective + 4 * 4 * 2048


def test_context_parallel_divides_tokens():
    d = LayerDims.gpt(s=2048, b=1, h=4096, a=32)
    t1 = {t.name: t.size_bytes for t in layer_terms(d, tp=2)}
    t2 = {t.name: t.size_bytes for t in layer_terms(d, tp=2, cp=2)}
    assert t2["q"] * 2 == t1["q"] and t2["qkv input"] * 2 == t1["qkv input"]
    assert t2["softmax output"] * 2 == t1["softmax output"]  # (s/cp) queries x s keys


def test_embedding_and_head_terms():
    d = LayerDims.gpt(s=2048, b=4, h=6144, a=64)
    v, t = 51200, 8
    head = head_terms(d, v, tp=t, sp=True)
    # Korthikanti 4.3: final norm + output layer input + fp32 logits = 4sbh/t (1 + v/h)
    assert sum(x.size_bytes for x in head[:3]) == 4 * 2048 * 4 * 6144 // t * (1 + v / 6144)
    assert head[3].size_bytes == 13 * 2048 * 4
    bf16 = head_terms(d, v, tp=t, sp=True, logits_dtype="bf16")[2]
    assert bf16.size_bytes == 2 * 2048 * 4 * v // t
    emb = {x.name: x.size_bytes for x in embedding_terms(d, tp=t, sp=True)}
    assert emb == {"token ids (int64)": 8 * 2048 * 4, "embedding dropout mask": 2048 * 4 * 6144 // t}
    nodrop = LayerDims.gpt(s=2048, b=4, h=6144, a=64, dropout=False)
    assert [x.name for x in embedding_terms(nodrop)] == ["token ids (int64)"]


def test_pipeline_building_blocks():
    assert [in_flight_microbatches(k, 4, 8) for k in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(0, 4, 2) == 2
    for p in (2, 4, 8):
        for v in (2, 3, 4):
            # Korthikanti eq. 5: the first stage holds (1 + (p-1)/(p v)) L layers' worth
            assert in_flight_chunks(0, p, 64, v) / (p * v) == pytest.approx(interleaved_factor(p, v))
    assert in_flight_chunks(0, 4, 8, 1) == 4
    assert in_flight_chunks(0, 4, 1, 2) == 2  # capped by m * vpp chunks


def test_from_model_and_options():
    llama = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=8, kv_heads=2, vocab=100)
    d = LayerDims.from_model(llama, seq_len=32, micro_batch=2)
    assert (d.a, d.g, d.d, d.f, d.gated, d.dropout) == (8, 2, 8, 128, True, False)
    moe = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=8, vocab=100, experts=4, top_k=1)
    with pytest.raises(ConfigError, match="MoE"):
        LayerDims.from_model(moe, seq_len=32, micro_batch=2)
    with pytest.raises(ConfigError, match="recompute"):
        layer_terms(d, recompute="partial")


def test_layer_options_from_mesh_and_training():
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.spec.mesh import MeshSpec
    from meshplan.spec.training import TrainingSpec
    m = resolve_mesh(MeshSpec(names=["dp", "cp", "tp"], shape=[2, 2, 2], sequence_parallel=True), 8)
    t = TrainingSpec(global_batch=8, seq_len=64, recompute="full", flash_attention=True)
    assert layer_options(m, t) == dict(tp=2, sp=True, cp=2, recompute="full", flash=True,
                                         framework="torch", cp_kv=False,  # megakv: Megatron keeps the gathered QKV (tp > kv_heads)
                                         op_sac_policy="238fa99")  # tt49: the training's default op-level SAC policy
    # all-gather CP keeps the whole sequence's K and V (memory.cp_buffers); torch's ring (above) the local ones
    assert layer_options(m, t.model_copy(update={"cp_attention": "allgather"}))["cp_kv"] is True
