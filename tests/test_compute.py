"""Compute model: GEMM efficiency by shape (tile, wave, roofline, ceiling), the measured
table, per-op FLOP of a layer with the named conventions, MFU/HFU, and the published 22B
measurements as a loose development reference (no constant is fitted to them)."""

import json

import pytest

from meshplan import catalog
from meshplan.compute.ops import (Workload, embedding_cost, head_cost, korthikanti_model_flops, layer_cost,
                              sequence_model_flops, utilization)
from meshplan.errors import ConfigError
from meshplan.compute.gemm import gemm_efficiency, gemm_model, gemm_time, load_gemm_table

H100 = catalog.gpu("h100-sxm5-80gb")
A100 = catalog.gpu("a100-sxm-80gb")
GPT22B = catalog.model("megatron-22b")


def test_wave_quantization_hand_value():
    # 8192x1024: 64 x 4 tiles of 128x256 = 256 tiles; 2 waves of 132 SMs = 264 slots
    eff, why = gemm_efficiency(H100, 8192, 1024, 8192)
    assert eff == pytest.approx(0.8030 * 256 / 264)
    assert "256 tiles" in why and "2 waves of 132 SMs" in why and "80.3%" in why


def test_tile_quantization_picks_the_faster_tile():
    # N = 1056 = 1024 + 32. 128x256: 64*5 = 320 tiles, 3 waves (3 x 32768 tile-area units);
    # 256x128: 32*9 = 288 tiles, 3 waves (same); 128x128: 64*9 = 576 tiles, 5 waves
    # (5 x 16384, faster). Efficiency = M N / (waves tm tn sms) x ceiling.
    eff, why = gemm_efficiency(H100, 8192, 1056, 8192)
    assert "tile 128x128" in why and "576 tiles" in why
    assert eff == pytest.approx(0.8030 * 8192 * 1056 / (5 * 128 * 128 * 132))
    assert eff == pytest.approx(0.8030 * 0.8)


def test_memory_bound_gemm_runs_at_hbm_bandwidth():
    m = n = 8192
    k = 16
    e = gemm_model(H100, m, n, k)
    nbytes = 2 * (m * k + k * n + m * n)
    assert e.seconds == pytest.approx(nbytes / 3.35e12)
    assert "memory traffic" in e.explanation
    assert e.efficiency == pytest.approx(2 * m * n * k / (nbytes / 3.35e12) / 989.4e12)


@pytest.mark.parametrize("shape", [(1, 1, 1), (4096, 4096, 4096), (2048, 2048, 13312), (8192, 128, 8192),
                                   (16384, 53248, 16384), (777, 333, 4099)])
@pytest.mark.parametrize("gpu", [H100, A100])
def test_efficiency_never_exceeds_the_measured_ceiling(shape, gpu):
    eff, _ = gemm_efficiency(gpu, *shape)
    assert 0 < eff <= gpu.max_gemm_fraction + 1e-12


def test_fp8_uses_its_own_peak():
    t16 = gemm_model(H100, 8192, 8192, 8192, "bf16").seconds
    t8 = gemm_model(H100, 8192, 8192, 8192, "fp8").seconds
    assert t8 == pytest.approx(t16 * 989.4 / 1978.9)


def test_measured_table_replaces_the_model(tmp_path):
    p = tmp_path / "gemm.csv"
    p.write_text("m,n,k,dtype,seconds,tflops,device,torch\n"
                 "8192,1024,8192,bf16,0.0002,,NVIDIA H100 80GB HBM3,2.13.0\n"
                 "8192,2048,8192,bf16,,500,NVIDIA H100 80GB HBM3,2.13.0\n")
    table = load_gemm_table(p)
    assert len(table) == 2
    hit = gemm_time(H100, 8192, 1024, 8192, table=table)
    assert hit.source == "measured" and hit.seconds == 0.0002 and "2.13.0" in hit.explanation
    assert gemm_time(H100, 8192, 2048, 8192, table=table).seconds == pytest.approx(2 * 8192 * 2048 * 8192 / 500e12)
    assert gemm_time(H100, 4096, 1024, 8192, table=table).source == "model"
    assert gemm_time(H100, 8192, 1024, 8192, count=3, table=table).seconds == pytest.approx(0.0006)


def test_measured_table_json_and_errors(tmp_path):
    j = tmp_path / "gemm.json"
    j.write_text(json.dumps({"device": "cpu", "torch": "2.13.0", "rows": [{"m": 8, "n": 8, "k": 8, "dtype": "fp32",
                                                                         "seconds": 1e-6}]}))
    assert load_gemm_table(j).lookup(8, 8, 8, "fp32").device == "cpu"
    bad = tmp_path / "bad.csv"
    bad.write_text("m,n,k,dtype,seconds,device,torch,gpu\n8,8,8,bf16,1,cpu,2.13,x\n")
    with pytest.raises(ConfigError, match="unknown column"):
        load_gemm_table(bad)
    bad.write_text("m,n,k,dtype,seconds,device,torch\n8,8,8,bf16,1,,2.13\n")
    with pytest.raises(ConfigError, match="device"):
        load_gemm_table(bad)
    bad.write_text("m,n,k,dtype,seconds,device,torch\n8,8,8,bf16,1,a,2.13\n8,8,16,bf16,1,b,2.13\n")
    with pytest.raises(ConfigError, match="several devices"):
        load_gemm_table(bad)
    with pytest.raises(ConfigError, match="no file"):
        load_gemm_table(tmp_path / "missing.csv")


B, S, H, A = 4, 2048, 6144, 64


def test_gpt_layer_flops_match_narayanan_with_causal_half():
    """Narayanan et al. SC'21: a GPT layer's forward GEMMs are 24 B s h^2; attention
    (QK^T and PV) 4 B s^2 h in full, 2 B s^2 h with the causal half; backward 2x."""
    c = layer_cost(GPT22B, A100, Workload(seq_len=S, micro_batch=B, recompute="none", flash=True))
    gemm_fwd = sum(o.model_flops for o in c.ops if o.kind == "gemm" and o.phase == "forward")
    attn_fwd = sum(o.model_flops for o in c.ops if o.kind == "attention" and o.phase == "forward")
    assert gemm_fwd == 24 * B * S * H * H
    assert attn_fwd == 2 * B * S * S * H
    assert c.flops("model") == 3 * c.flops("model", "forward")
    # flash executes the causal half forward and recomputes QK^T in backward (2.5x)
    assert c.flops("hardware") - c.flops("model") == pytest.approx(0.5 * attn_fwd)


def test_non_flash_executes_full_attention_and_selective_recompute():
    none = layer_cost(GPT22B, A100, Workload(seq_len=S, micro_batch=B, recompute="none", flash=False))
    sel = layer_cost(GPT22B, A100, Workload(seq_len=S, micro_batch=B, recompute="selective", flash=False))
    full_attn = 4 * B * S * S * H
    assert none.flops("hardware") - none.flops("model") == pytest.approx(3 * full_attn / 2)  # masked half x3
    assert sel.flops("model") == none.flops("model")
    assert sel.flops("hardware") - none.flops("hardware") == pytest.approx(full_attn)  # QK^T + PV again
    core = ("qk^T", "pv", "softmax", "attention dropout")  # Korthikanti section 5: the attention core
    assert sel.seconds("backward_input", recompute=True) == pytest.approx(
        sum(o.seconds for o in none.ops if o.phase == "forward" and o.name in core))


def test_full_recompute_reruns_the_forward():
    w = Workload(seq_len=S, micro_batch=B, tp=8, sp=True, recompute="full", flash=False)
    c = layer_cost(GPT22B, A100, w)
    assert c.seconds("backward_input", recompute=True) == pytest.approx(c.forward_s)
    masked = c.flops("hardware", "forward") - c.flops("model", "forward")  # non-flash: masked half, forward
    assert c.flops("hardware") - c.flops("model") == pytest.approx(c.flops("hardware", "forward") + 3 * masked)


def test_memory_ops_bytes_with_sequence_parallel():
    w = Workload(seq_len=S, micro_batch=B, tp=8, sp=True, flash=True, dropout=True)
    c = layer_cost(GPT22B, A100, w)
    by = {(o.name, o.phase): o.size_bytes for o in c.ops if o.kind == "memory"}
    rows = B * S // 8  # norms see tokens / tp rows with SP
    assert by[("attn norm", "forward")] == 2 * 2 * rows * H
    assert by[("attn norm", "backward_input")] == 3 * 2 * rows * H
    assert by[("residual add + dropout", "forward")] == (3 * 2 + 1) * rows * H
    assert by[("gelu", "forward")] == 2 * 2 * B * S * (4 * H // 8)
    mem = [o for o in c.ops if o.kind == "memory"]
    assert all(o.seconds == pytest.approx(o.size_bytes / 2.039e12) for o in mem)


def test_rope_and_gated_mlp_bytes():
    m = catalog.model("llama3-8b")
    c = layer_cost(m, H100, Workload(seq_len=8192, micro_batch=1, tp=4))
    by = {(o.name, o.phase): o.size_bytes for o in c.ops if o.kind == "memory"}
    assert by[("rope", "forward")] == 2 * 2 * 8192 * (32 // 4 + 8 // 4) * 128
    assert by[("silu x up", "forward")] == 3 * 2 * 8192 * 14336 // 4


def test_tensor_parallel_ranks_sum_to_the_unsplit_model_flops():
    """Model FLOP per rank x tp = the tp 1 count, also when KV heads are replicated
    (llama3-8b: 8 KV heads at tp 16 -> each KV head on 2 ranks, counted once)."""
    m = catalog.model("llama3-8b")
    one = layer_cost(m, H100, Workload(seq_len=4096, tp=1)).flops("model")
    for tp in (2, 8, 16):
        per_rank = layer_cost(m, H100, Workload(seq_len=4096, tp=tp)).flops("model")
        assert per_rank * tp == pytest.approx(one)
    assert layer_cost(m, H100, Workload(seq_len=4096, tp=16)).flops("hardware") * 16 > one


def test_head_uses_unpadded_vocab_for_model_flops():
    w = Workload(seq_len=S, micro_batch=1, tp=8)
    h = head_cost(GPT22B, A100, w)
    out = [o for o in h.ops if o.name == "output" and o.phase == "forward"][0]
    assert out.model_flops == pytest.approx(2 * S * H * 51200 / 8)
    assert embedding_cost(GPT22B, A100, w).flops("model") == 0


def test_sequence_flops_against_korthikanti_closed_form():
    seq = sequence_model_flops(GPT22B, S)
    kor = korthikanti_model_flops(B, S, 48, H, 51200)
    assert kor - B * seq == pytest.approx(6 * B * S * S * H * 48)  # full vs causal-half attention


def test_utilization_definition():
    assert utilization(312e12 * 8 * 2.0 * 0.5, 2.0, 8, A100) == pytest.approx(0.5)


def test_workload_rejects_unknown_recompute():
    with pytest.raises(ValueError, match="recompute"):
        Workload(seq_len=8, recompute="some")


# Development reference: Korthikanti et al. 2022, 22B on one DGX A100 (public-facts.md) ------

from meshplan.compute.ops import KORTHIKANTI_22B_MEASURED as PUBLISHED_22B  # noqa: E402


def predict_22b(recompute: str, sp: bool):
    """(layer forward ms, layer backward ms, step s) predicted for the published 22B
    configuration: tp 8, micro-batch 4, seq 2048, no flash attention, GPT dropout."""
    from meshplan.plan import build_plan
    from meshplan.config import config_from_dict
    from meshplan.schedule.steptime import layer_unit_times, step_time

    cfg = config_from_dict({
        "model": {"catalog": "megatron-22b"}, "cluster": {"system": "dgx-a100", "nodes": 1},
        "training": {"global_batch": 4, "seq_len": 2048, "micro_batch": 4, "recompute": recompute,
                     "flash_attention": False, "sharding": "none", "param_dtype": "bf16"},
        "mesh": {"names": ["tp"], "shape": [8], "sequence_parallel": sp}})
    plan = build_plan(cfg)
    f, b = layer_unit_times(plan, dropout=True)
    return f * 1e3, b * 1e3, step_time(plan, dropout=True).step_s


@pytest.mark.parametrize("key", list(PUBLISHED_22B))
def test_22b_development_reference_within_a_loose_band(key):
    f, b, step = predict_22b(*key)
    pf, pb, pstep = PUBLISHED_22B[key]
    print(f"22B {key}: forward {f:.2f} ms (published {pf}), backward {b:.2f} ms (published {pb})"
          + (f", step {step:.3f} s (published {pstep})" if pstep else ""))
    assert f == pytest.approx(pf, rel=0.35)
    assert b == pytest.approx(pb, rel=0.35)
    if pstep:
        assert step == pytest.approx(pstep, rel=0.35)


def test_measured_attention_replaces_the_flash_model():
    """A GemmTable.attention entry (seconds measured per call, forward and backward) is the
    attention op's time; FLOP stay the model's (causal half, backward 2x / 2.5x executed)."""
    from meshplan.compute.gemm import GemmTable
    from meshplan.compute.shapes import attention_shape

    w = Workload(seq_len=S, micro_batch=B, recompute="selective", flash=True)
    att = attention_shape(GPT22B, 1, 1, B, S)
    key = (att.batch, att.q_heads, att.kv_heads, att.seq_q, att.seq_kv, att.head_dim, w.dtype)
    c = layer_cost(GPT22B, A100, w, table=GemmTable({}, "bench", attention={key: (0.003, 0.007)}))
    ops = [(o.phase, o.seconds, o.recompute) for o in c.ops if o.kind == "attention"]
    assert sorted(ops) == sorted([("forward", 0.003, False), ("backward_input", 0.007, False),
                                  ("backward_input", 0.003, True)])
    assert sum(o.model_flops for o in c.ops if o.kind == "attention") == pytest.approx(3 * att.flops(causal_half=True))
    # a table without that shape leaves the flash model in place
    other = layer_cost(GPT22B, A100, w, table=GemmTable({}, "bench", attention={(9,) * 6 + ("bf16",): (1.0, 1.0)}))
    assert all(o.seconds != 1.0 for o in other.ops if o.kind == "attention")
