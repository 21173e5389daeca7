"""Compute model: GEMM efficiency by shape (tile, wave, roofline, ceiling), the measured
table, per-op FLOP of a layer with the named conventions, MFU/HFU, and the published 22B
measurements as a loose development reference (no constant is fitted to them)."""

import json
from dataclasses import replace

import pytest

from meshplan import catalog
from meshplan.compute.embed_head import embedding_cost, head_cost
from meshplan.compute.flops import korthikanti_model_flops, sequence_model_flops, utilization
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.errors import ConfigError
from meshplan.compute.gemm import compute_efficiency, gemm_efficiency, gemm_model, gemm_time, load_gemm_table
from meshplan.spec.cluster import LinkSpec

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
    # not in the user's table: the catalog's measured points for H100 bf16, then the shape model
    # for a dtype the catalog has no points for (tf32)
    assert gemm_time(H100, 4096, 1024, 8192, table=table).source == "catalog"
    assert gemm_time(H100, 4096, 1024, 8192, "tf32", table=table).source == "model"
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
    """Megatron-LM's CheckpointFunction re-runs the whole layer; torch's replay leaves out what
    only feeds the MLP's closing reduce-scatter (compiled: w_down's GEMM; ops.full_ac_not_replayed)."""
    w = Workload(seq_len=S, micro_batch=B, tp=8, sp=True, recompute="full", flash=False, megatron_ops=True)
    c = layer_cost(GPT22B, A100, w)
    assert c.seconds("backward_input", recompute=True) == pytest.approx(c.forward_s)
    t = layer_cost(GPT22B, A100, replace(w, megatron_ops=False))
    w_down = sum(o.seconds for o in t.ops if o.name == "w_down" and o.phase == "forward")
    assert w_down > 0 and t.seconds("backward_input", recompute=True) == pytest.approx(t.forward_s - w_down)
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
    # backward only: autograd sums the residual stream's two gradient branches, one add per fork
    accum = [o for o in c.ops if o.name == "residual grad accumulate"]
    assert [(o.phase, o.size_bytes) for o in accum] == [("backward_input", 3 * 2 * rows * H)] * 2
    # A100 measured bandwidths (catalog kernels.toml): elementwise at BabelStream Triad 1.70 TB/s;
    # norms t0 + bytes / bw, the least-squares line through the Liger RMSNorm times (S11: 2048 rows,
    # H 1024 / 4096 / 32768, bytes 2 x 2048 x H x 2 = 8,388,608 / 33,554,432 / 268,435,456 B,
    # 13.6 / 31.1 / 182.2 us), by hand: mean x 103,459,498.67 B, mean y 75.633 us, slope 6.4633e-19
    # s/B (1.5472 TB/s), t0 = 8.764 us; each kernel at least the 4.7 us issue floor.
    # (Was: every memory op at the datasheet 2.039 TB/s.)
    xs, ys = [2 * 2048 * h * 2 for h in (1024, 4096, 32768)], [13.6e-6, 31.1e-6, 182.2e-6]
    mx, my = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert (1 / slope, my - slope * mx) == (pytest.approx(1.5472e12, rel=1e-4), pytest.approx(8.764e-6, rel=1e-3))
    for o in (o for o in c.ops if o.kind == "memory"):
        t = my - slope * mx + slope * o.size_bytes if o.name.endswith("norm") else o.size_bytes / 1.70e12
        assert o.seconds == pytest.approx(max(t, 4.7e-6)), o.name


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

from meshplan.compute.flops import KORTHIKANTI_22B_MEASURED as PUBLISHED_22B  # noqa: E402


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


def test_measured_attention_and_gemm_share_the_issue_floor():
    """Every kernel takes at least the host's issue floor (catalog host.kernel_issue_s, 4.7 us),
    however it was timed: a measured attention entry of 1 us counts 4.7 us, as a measured GEMM
    of 1 us does (the golden tp 8 plan's attention, 2.7 us forward, caught the difference)."""
    from meshplan.compute.gemm import GemmTable, Measurement
    from meshplan.compute.shapes import attention_shape

    w = Workload(seq_len=S, micro_batch=B, recompute="none", flash=True)
    att = attention_shape(GPT22B, 1, 1, B, S)
    key = (att.batch, att.q_heads, att.kv_heads, att.seq_q, att.seq_kv, att.head_dim, w.dtype)
    g = (B * S, 3 * GPT22B.hidden, GPT22B.hidden)  # any shape the table holds: only its own op is read
    table = GemmTable({(*g, "bf16"): Measurement(*g, "bf16", 1e-6, "bench", "-")}, "bench",
                      attention={key: (1e-6, 2e-6)})
    c = layer_cost(GPT22B, A100, w, table=table)
    assert sorted(o.seconds for o in c.ops if o.kind == "attention") == [4.7e-6, 4.7e-6]
    from meshplan.compute.kernel_time import gemm_ops
    from meshplan.compute.shapes import Gemm
    assert gemm_ops(A100, Gemm("x", *g), "attn", w, table)[0].seconds == 4.7e-6


def test_catalog_gemm_interpolation_by_hand():
    """Shepard interpolation over the 4 nearest A100 points in log2 (M, N, K), weights 1/d^2
    (meshplan.compute.measured). 22B fc1 at tp 8, micro-batch 4: (8192, 3072, 6144)."""
    from math import log2
    from meshplan.compute.gemm_points import gemm_seconds, gemm_tflops
    from meshplan.compute.measured import kernel_data

    d = kernel_data("a100-sxm-80gb")
    eff = lambda m, n, k: compute_efficiency(A100, m, n, k)  # noqa: E731 (below the points only)
    q = (13, log2(3072), log2(6144))
    pts = [(4096, 4096, 4096, 228.0), (8192, 8192, 8192, 253.7), (2048, 2048, 2048, 221.8),
           (6144, 12288, 12288, 250.8), (16384, 16384, 16384, 256.5),
           (1024, 2145, 1024, 132.8), (1024, 1024, 1024, 119.4), (802816, 192, 768, 157.8),
           (896, 896, 896, 73.94), (768, 768, 768, 58.98)]
    dist = sorted((sum((a - log2(b)) ** 2 for a, b in zip(q, p[:3])) ** 0.5, p[3]) for p in pts)[:4]
    want = sum(v / x ** 2 for x, v in dist) / sum(1 / x ** 2 for x, _ in dist)
    assert gemm_tflops(d, 8192, 3072, 6144, "bf16", eff)[0] == pytest.approx(want)
    assert 228.0 < want < 253.7  # between the 4096^3 and 8192^3 cubes it lies between
    # the MAMF maximum (S1, 1024x10240x5120 271.2) is the ceiling, not a node (kernels.toml header):
    # the 22B-at-tp-8 shape nearest it in log2 reads the S3 points only
    assert all(p[4] != "S1" for pts in d.gemm.values() for p in pts)
    assert gemm_tflops(d, 1024, 10240, 5120, "bf16", eff)[0] < 256.5
    # a measured shape returns its value; fp16 uses the bf16 points (one tensor-core peak)
    assert gemm_tflops(d, 802816, 192, 768, "fp16", eff)[0] == 157.8
    # memory roofline: (8192, 8192, 16): 2 (M K + K N + M N) B at 1.70 TB/s beats any FLOP rate
    t, how = gemm_seconds(d, 8192, 8192, 16, "bf16", 1, eff)
    assert t == pytest.approx(2 * (8192 * 16 * 2 + 8192 * 8192) / 1.70e12) and "memory-bound" in how


def test_catalog_attention_rates_by_hand():
    """FA2 on A100 has only fwd+bwd rates: both passes at that rate, FLOP split 1 : 2.5.
    Causal d128, S 2048: 155 TFLOP/s (S7a). fwd FLOP = 4 B S^2 H d / 2."""
    from meshplan.compute.measured import attention_seconds, kernel_data
    from meshplan.compute.shapes import Attention

    att = Attention(batch=8, q_heads=16, kv_heads=16, seq_q=2048, seq_kv=2048, head_dim=128)
    fwd = 4 * 8 * 2048 ** 2 * 16 * 128 / 2
    f, b, how = attention_seconds(kernel_data("a100-sxm-80gb"), att)
    assert f == pytest.approx(fwd / 155e12) and b == pytest.approx(2.5 * fwd / 155e12) and "FA2" in how
    # H100: FA3 forward (causal d128 at 2048: 521, S7c); backward FA3 d128 (S8, mask not named): 501;
    # between measured lengths linear in log2(S): S 3072 -> 521 + (579 - 521) log2(1.5) = 554.9
    f, b, how = attention_seconds(kernel_data("h100-sxm5-80gb"), att)
    assert f == pytest.approx(fwd / 521e12) and b == pytest.approx(2.5 * fwd / 501e12)
    from math import log2
    att3 = Attention(8, 16, 16, 3072, 3072, 128)
    f3, _, _ = attention_seconds(kernel_data("h100-sxm5-80gb"), att3)
    assert f3 == pytest.approx(att3.flops() / ((521 + 58 * log2(1.5)) * 1e12))
    # head dim 64 causal forward: its own FA3 row (371 at 2048)
    att64 = Attention(8, 32, 32, 2048, 2048, 64)
    assert attention_seconds(kernel_data("h200-sxm-141gb"), att64)[0] == pytest.approx(att64.flops() / 371e12)


def test_overheads_and_optimizer_from_the_catalog():
    from meshplan.compute.kernel_time import optimizer_bandwidth

    w = Workload(seq_len=S, micro_batch=B, tp=8, sp=True, flash=False)
    assert not [o for o in embedding_cost(GPT22B, A100, w).ops if o.kind == "overhead"]  # no host link given
    pcie4 = LinkSpec(name="pcie-gen4-x16", bandwidth_gb_per_s=31.5, latency_us=5.7)
    over = [o for o in embedding_cost(GPT22B, A100, w, pcie4).ops if o.kind == "overhead"]
    # torch: inputs and labels (4 x 2048 int64 = 65,536 B each) copied to the GPU, then one issue floor
    assert [o.name for o in over] == ["batch to device"]
    assert over[0].seconds == pytest.approx(2 * (5.7e-6 + 65_536 / 31.5e9) + 4.7e-6, rel=1e-12)
    assert optimizer_bandwidth(A100) == 1.70e12  # BabelStream Triad, not the 2.039 TB/s datasheet
    assert optimizer_bandwidth(H100) == 2.97e12


def test_linear_bias_kernels_by_hand():
    """Megatron GPT biases (22B, tp 8, SP, b 4, s 2048: tokens 8192, rows 1024): forward QKV bias
    add reads and writes 8192 x 2304 x 2 B; backward bias gradients read their output gradients:
    QKV 8192 x 2304, MLP-up 8192 x 3072, wo and MLP-down 1024 x 6144 (sequence shards), 2 B each."""
    c = layer_cost(GPT22B, A100, Workload(seq_len=S, micro_batch=B, tp=8, sp=True, flash=False))
    by = {(o.name, o.phase): o.size_bytes for o in c.ops if "bias" in o.name}
    assert by == {("qkv bias add", "forward"): 2 * 2 * 8192 * 2304, ("qkv bias grad", "backward_weight"): 2 * 8192 * 2304,
                  ("wo bias grad", "backward_weight"): 2 * 1024 * 6144,
                  ("mlp up bias grad", "backward_weight"): 2 * 8192 * 3072,
                  ("mlp down bias grad", "backward_weight"): 2 * 1024 * 6144}
    llama = layer_cost(catalog.model("llama3-8b"), H100, Workload(seq_len=4096, tp=2))
    assert not [o for o in llama.ops if "bias" in o.name]  # no linear biases


def test_attention_gemm_points_derived_from_s7a():
    """The A100 "D S7a" GEMM points (catalog kernels.toml): S7a's PyTorch standard attention
    (fwd+bwd, non-causal, d 128, 16 heads, B x S = 16,384) minus the memory-bound rest as the model
    times it (softmax 4 + 6 B per score; 8 passes of 4 B per q/k/v element: q, k, v rearranged,
    alpha on dQ and dK, the 3-tensor stack; at Triad), the six batched GEMMs' 12 n S^2 d FLOP over
    what is left. At S 2048: 12.659 ms measured, softmax 3.158 ms, the q-sized passes 0.632 ms,
    1.649 TFLOP in 8.869 ms: 93.0 TFLOP/s."""
    from meshplan.compute.measured import kernel_data

    d = kernel_data("a100-sxm-80gb")
    s7a = {512: 53, 1024: 67, 2048: 76, 4096: 79, 8192: 86}     # public-microbenchmarks.md 2, S7a
    pts = {(m, n, k): v for m, n, k, v, src in d.gemm["bf16"] if src == "D S7a"}
    assert len(pts) == 10
    for s, rate in s7a.items():
        b, heads, hd = 16384 // s, 16, 128
        batch = b * heads
        measured = 3.5 * 4 * b * s * s * heads * hd / (rate * 1e12)
        rest = (4 + 6) * batch * s * s / 1.70e12 + 8 * 4 * b * s * heads * hd / 1.70e12
        derived = 6 * 2 * batch * s * s * hd / (measured - rest) / 1e12
        assert batch * s == 262144
        assert pts[(262144, s, 128)] == pts[(262144, 128, s)] == pytest.approx(derived, abs=0.05)
    assert pts[(262144, 2048, 128)] == 93.0


def test_bmm_head_dim_ratio_replaces_the_shape_model_for_the_22b_attention():
    """kernels.toml bmm_head_dim (A100, AC24 Fig. 7, read off the figure): QK^T at K 96 runs at
    93 / 105 = 0.886 of K 128, PV at N 96 at 107 / 138 = 0.775 of N 128. The 22B's batched GEMMs
    (head dim 96, micro-batch 4 x 8 heads at tp 8 = 32 per call, S 2048) take these in place of the
    shape model's x1.000 (K) and x0.750 (N), on their edges read on the "D S7a" plane (M 262,144,
    test_batched_gemm_reads_the_points_plane_at_another_batch_count): QK^T's 93.0 (x1.000 for 32
    batches), PV's 93.0 x (512 / 540) / (2048 / 2052) = 88.35: 93.0 x 93 / 105 = 82.4 and 88.35 x
    107 / 138 = 68.5 TFLOP/s (before the plane rule, both edges 86.5: 76.6 and 67.1). A single (not
    batched) GEMM of the same shape keeps the shape model's ratio, on Shepard's 86.5."""
    from meshplan.compute.gemm_points import gemm_tflops
    from meshplan.compute.measured import kernel_data

    d = kernel_data("a100-sxm-80gb")
    t = d.bmm_head_dim
    assert t.head_dim == (64, 80, 96, 128)
    assert t.ratio("kq", 96) == pytest.approx(93 / 105) and t.ratio("aov", 96) == pytest.approx(107 / 138)
    assert t.ratio("kq", 128) == t.ratio("aov", 128) == 1.0
    a100 = catalog.gpu("a100-sxm-80gb")
    eff = lambda m, n, k: compute_efficiency(a100, m, n, k)
    edge = gemm_tflops(d, 65536, 2048, 128, "bf16", eff)[0]
    assert edge == pytest.approx(86.5, abs=0.05)
    qk_edge = gemm_tflops(d, 65536, 2048, 128, "bf16", eff, batched=True)[0]
    pv_edge = gemm_tflops(d, 65536, 128, 2048, "bf16", eff, batched=True)[0]
    assert qk_edge == 93.0 and pv_edge == pytest.approx(93.0 * (512 / 540) / (2048 / 2052))
    qk, how = gemm_tflops(d, 65536, 2048, 96, "bf16", eff, batched=True)
    pv = gemm_tflops(d, 65536, 96, 2048, "bf16", eff, batched=True)[0]
    assert qk == pytest.approx(qk_edge * 93 / 105) and qk == pytest.approx(82.4, abs=0.05)
    assert pv == pytest.approx(pv_edge * 107 / 138) and pv == pytest.approx(68.5, abs=0.05)
    assert "measured head-dim ratio, K 96 of 128" in how
    single = gemm_tflops(d, 65536, 96, 2048, "bf16", eff)[0]
    assert single == pytest.approx(edge * 0.75)   # the shape model: N 96 in tiles of 128
    t_pv = gemm_time(a100, 2048, 96, 2048, "bf16", count=32).seconds
    assert t_pv == pytest.approx(2 * 2048 * 96 * 2048 * 32 / (pv * 1e12))


def test_batched_gemm_reads_the_points_plane_at_another_batch_count():
    """The A100 "D S7a" points sit at one M, 262,144 = B x S x heads of S7a's run (16,384 tokens x
    16 heads), whatever S: they were measured at one batch count. The 22B's QK^T edge, 32 batches of
    2048x2048x128 (M 65,536), is that very GEMM in fewer batches; Shepard off the plane weighs
    S 1024 and 4096 (distance sqrt(2^2 + 1)) nearly as much as S 2048 (distance 2) and S 512 next:
    86.5 TFLOP/s. On the plane it is the measured 93.0 x the shape model's waves (A100, 108 SMs,
    ceiling 0.8692 = 271.2 / 312): QK^T in 128x256 tiles, 32 x 16 x 8 = 4,096 tiles in 38 waves (4,104
    slots) against 16,384 in 152 (16,416): ratio 1. PV (N 128) in 128x128 tiles, 512 tiles in 5
    waves (540) against 2,048 in 19 (2,052): (512 / 540) / (2048 / 2052) = 0.950, 88.35 TFLOP/s.
    On the plane itself (S7a's own batch) and for a single GEMM nothing changes; a batched query
    whose nearest points are not all on one plane (8 x 1024^3: S3's cubes nearest) is Shepard's,
    and so is one whose nearest points share an M but whose (N, K) were also measured at other M
    (H200's M1 grid: 3072x7168x8192's four nearest at M 2048, each also at 8192 and 16384)."""
    from meshplan.compute.gemm_points import gemm_tflops
    from meshplan.compute.measured import kernel_data

    d = kernel_data("a100-sxm-80gb")
    a100 = catalog.gpu("a100-sxm-80gb")
    eff = lambda m, n, k: compute_efficiency(a100, m, n, k)
    assert {p[0] for p in d.gemm["bf16"] if p[4] == "D S7a"} == {16384 * 16}
    w = 0.8692   # gpus.toml max_gemm_fraction: 271.2 / 312 to 4 places
    assert eff(65536, 2048, 128) == pytest.approx(w * 4096 / 4104) and eff(262144, 2048, 128) == pytest.approx(
        w * 16384 / 16416)
    assert eff(65536, 128, 2048) == pytest.approx(w * 512 / 540) and eff(262144, 128, 2048) == pytest.approx(
        w * 2048 / 2052)
    qk, how = gemm_tflops(d, 65536, 2048, 128, "bf16", eff, batched=True)
    assert qk == pytest.approx(93.0) and "off the points' plane M 262144" in how
    pv = gemm_tflops(d, 65536, 128, 2048, "bf16", eff, batched=True)[0]
    assert pv == pytest.approx(93.0 * (512 / 540) / (2048 / 2052)) and pv == pytest.approx(88.35, abs=0.005)
    assert gemm_tflops(d, 65536, 2048, 128, "bf16", eff)[0] == pytest.approx(86.5, abs=0.05)  # single: Shepard
    assert gemm_tflops(d, 262144, 128, 2048, "bf16", eff, batched=True)[0] == 93.0          # S7a's own batch
    cube = gemm_tflops(d, 8192, 1024, 1024, "bf16", eff, batched=True)
    assert cube == gemm_tflops(d, 8192, 1024, 1024, "bf16", eff) and "off the points' plane" not in cube[1]
    h = kernel_data("h200-sxm-141gb")
    h200 = lambda m, n, k: compute_efficiency(catalog.gpu("h200-sxm-141gb"), m, n, k)
    near = {(p[0], p[1], p[2]) for p in h.gemm["bf16"] if (p[1], p[2]) in ((7168, 8192), (6144, 4096))}
    assert {(2048, 7168, 8192), (8192, 7168, 8192), (2048, 6144, 4096), (16384, 6144, 4096)} <= near
    assert gemm_tflops(h, 3072, 7168, 8192, "bf16", h200, batched=True) == gemm_tflops(h, 3072, 7168, 8192, "bf16", h200)


def test_ac24_head_dim_64_agrees_with_s7a_pytorch_attention():
    """Two sources at head dim 64 against 128, on A100: AC24's columns give the six products
    (2 QK^T-like, 4 PV-like, time-weighted) 0.570 of their d 128 rate; S7a's PyTorch standard
    attention at S 2048 (flash-attention @0251105 assets/flash2_a100_fwd_bwd_benchmark.png, panel
    (a), "Pytorch" bar label 43 TFLOP/s at d 64, 32 heads, B 8) less the softmax and the q-sized
    passes exactly as the "D S7a" points are derived gives 53.5 TFLOP/s, 0.575 of D S7a's 93.0."""
    from meshplan.compute.measured import kernel_data

    t = kernel_data("a100-sxm-80gb").bmm_head_dim
    six = 6 / (2 / t.ratio("kq", 64) + 4 / t.ratio("aov", 64))
    assert six == pytest.approx(0.570, abs=0.0005)
    b, s, heads, hd = 8, 2048, 32, 64
    n = b * heads
    measured = 3.5 * 4 * b * s * s * heads * hd / 43e12
    rest = (4 + 6) * n * s * s / 1.70e12 + 8 * 4 * b * s * heads * hd / 1.70e12
    d64 = 6 * 2 * n * s * s * hd / (measured - rest) / 1e12
    assert d64 == pytest.approx(53.5, abs=0.05)
    assert d64 / 93.0 == pytest.approx(six, rel=0.02)


def test_s7a_attention_pytorch_passes_as_torch_dispatches_them():
    """The passes the derivation above takes away, as torch dispatches flash-attention's
    attention_pytorch (benchmarks/benchmark_flash_attention.py @0251105; dropout 0, the gradient
    randn_like(y) as flash_attn/utils/benchmark.py makes it) on CPU: forward clones q, k and v
    (3), backward scales dQ and dK by alpha (2 mul.Scalar) and stacks the three gradients (one
    stack), with no copy of the output gradient; 4 + 2 bmm in all."""
    import math

    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    b, s, h, d = 2, 16, 4, 8
    qkv = torch.randn(b, s, 3, h, d, dtype=torch.bfloat16, requires_grad=True)

    def attention_pytorch(qkv):
        q, k, v = qkv.unbind(dim=2)
        q = q.permute(0, 2, 1, 3).reshape(b * h, s, d)        # rearrange 'b t h d -> (b h) t d'
        k = k.permute(0, 2, 3, 1).reshape(b * h, d, s)        # rearrange 'b s h d -> (b h) d s'
        scores = torch.empty(b * h, s, s, dtype=qkv.dtype)
        scores = torch.baddbmm(scores, q, k, beta=0, alpha=1.0 / math.sqrt(d)).view(b, h, s, s)
        out = torch.einsum("bhts,bshd->bthd", F.dropout(torch.softmax(scores, dim=-1), 0.0), v)
        return out.to(dtype=qkv.dtype)

    fwd, bwd = Count(), Count()
    with fwd:
        y = attention_pytorch(qkv)
    grad = torch.randn_like(y)
    with bwd:
        y.backward(grad)
    assert fwd.ops.count("clone") == 3 and fwd.ops.count("baddbmm") == 1 and fwd.ops.count("bmm") == 1
    assert bwd.ops.count("mul") == 2 and bwd.ops.count("stack") == 1 and bwd.ops.count("bmm") == 4
    assert "clone" not in bwd.ops and "copy_" not in bwd.ops


def test_score_products_reproduce_the_s7a_rate_they_were_derived_from():
    """The six batched products of non-flash attention (compute/attention.score_ops) at S7a's own
    setting (B x S = 16,384 tokens, 16 heads of 128, tp 1) each land on a "D S7a" point, so they
    take 6 x 2 n S^2 d / rate together, the time the derivation above assigned them: QK^T at
    (n S, S, d), PV, dQ, dK and dV at (n S, d, S), dP at (n S, S, d). At S 2048: 6 x 2 x 128 x
    2048^2 x 128 FLOP = 824.6 GFLOP at 93.0 TFLOP/s, 8.867 ms (dV as the Linear layers' weight
    gradient, (d, S, S) with the batch on d, left one of the six off those points)."""
    model = GPT22B.model_copy(update={"hidden": 2048, "q_heads": 16, "kv_heads": 16, "ffn": 8192})
    s7a = {512: 66.1, 1024: 83.0, 2048: 93.0, 4096: 94.7, 8192: 104.8}   # kernels.toml "D S7a"
    for s, rate in s7a.items():
        w = Workload(seq_len=s, micro_batch=16384 // s, flash=False, recompute="none")
        names = ("qk^T", "pv", "qk^T.dgrad", "qk^T.wgrad", "pv.dgrad", "pv.wgrad")
        ops = {o.name: o.seconds for o in layer_cost(model, A100, w).ops if o.name in names}
        n = 16384 // s * 16
        assert len(ops) == 6
        for name, t in ops.items():
            assert t == pytest.approx(2 * n * s * s * 128 / (rate * 1e12), rel=1e-9), name
    assert 6 * 2 * 128 * 2048 ** 2 * 128 / 93.0e12 == pytest.approx(8.867e-3, abs=1e-6)


def test_attention_kernel_follows_the_framework():
    """torch's scaled_dot_product_attention runs FlashAttention-2 on an H100 (its flash backend;
    torchtitan adds cuDNN only on compute capability 10.0), Megatron-LM the catalog's FA3. Llama 3
    8B, one sequence of 8,192 tokens, tp 1: 32 heads of 128, causal forward FLOP
    4 x 32 x 8192^2 x 128 / 2 = 549.8 GFLOP; FA2 333 TFLOP/s forward (S7c) and 318 backward (S8)
    at S 8192, FA3 602 and 559."""
    from meshplan.compute.kernel_choices import framework_kernels
    from meshplan.spec.training import TrainingSpec
    llama, h100 = catalog.model("llama3-8b"), catalog.gpu("h100-sxm5-80gb")
    fwd_flop = 4 * 32 * 8192 ** 2 * 128 / 2
    for framework, f_rate, b_rate in (("torch", 333, 318), ("megatron", 602, 559)):
        t = TrainingSpec(global_batch=1, seq_len=8192, framework=framework)
        w = Workload(seq_len=8192, micro_batch=1, recompute="none", **framework_kernels(t))
        ops = {(o.phase, o.name): o for o in layer_cost(llama, h100, w).ops if o.kind == "attention"}
        assert ops[("forward", "attention")].seconds == pytest.approx(fwd_flop / (f_rate * 1e12), rel=1e-9)
        assert ops[("backward_input", "attention")].seconds == pytest.approx(2.5 * fwd_flop / (b_rate * 1e12),
                                                                             rel=1e-9)
    # the A100 has FA2 alone: the same rates under both frameworks
    a100 = catalog.gpu("a100-sxm-80gb")
    times = {fw: [o.seconds for o in layer_cost(llama, a100, Workload(seq_len=8192, recompute="none", **framework_kernels(
        TrainingSpec(global_batch=1, seq_len=8192, framework=fw)))).ops if o.kind == "attention"] for fw in
        ("torch", "megatron")}
    assert times["torch"] == times["megatron"]
