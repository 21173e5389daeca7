"""torchao's float8 work around each float8 Linear (:mod:`meshplan.compute.float8`): the amax,
cast and transposed-copy kernels of one Llama 3 8B layer, by hand, at the shapes of
``benchmarks/torchtitan_h100.py``'s rows (the rows' own torchtitan TOMLs, planned on dgx-h100).

By hand (h 4096, 32 q / 8 KV heads of 128, ffn 14336; per micro-batch and layer):

- T1 (8 GPUs, FSDP, 2 x 8192 tokens = 16,384 rows, compiled, tensorwise, weights gathered in
  float8): each activation an amax pass (read 2 B an element) and a cast writing both layouts
  (read 2, write 1 + 1): the attention input 16,384 x 4096 = 67,108,864 elements, 134,217,728 B
  and 268,435,456 B; w_down's input 16,384 x 14336 = 234,881,024 elements; wq's weight copied
  transposed in float8 (4096 x 4096 x 2 B = 33,554,432 B);
- A8 fp8tw (64 GPUs, dp_shard 8 x tp 8 with SP, 12 x 8192 = 98,304 rows gathered, 12,288 a
  shard): the attention input cast on the shard (12,288 x 4096: amax 100,663,296 B, cast 3 B an
  element 150,994,944 B) and its gathered float8 copied transposed (98,304 x 4096 x 2 B =
  805,306,368 B); wo's local input (98,304 x 512) at 2 + 4 B; the tp all-reduces of the amaxes:
  4 forward, 7 backward, and op-level AC's replay of the 4 forward ones;
- A8 fp8rw (rowwise, plain TP): the gathered attention input 98,304 x 4096 = 402,653,184
  elements, the cast with the transposed bf16 copy (2 + 1 + 2 B) and the transposed copy's cast
  (2 + 1 B); the tp all-reduces of the scales of casts along tp-sharded rows (vectors, not scalars).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan import catalog
from meshplan.comm.row import path_time
from meshplan.compute import float8, float8_tp_reduces
from meshplan.compute.measured import kernel_data, memory_kernel_seconds
from meshplan.compute.layer import layer_cost
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.memory.sizes import float8_copies, layer_act_sizes
from meshplan.plan import build_plan
from meshplan.schedule.step_end import float8_precompute_s
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import workload_of
from bench_module import bench

H100 = catalog.gpu("h100-sxm5-80gb")
LINEARS = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336  # a layer's 7 float8 weights


def _bench():
    """benchmarks/torchtitan_h100.py as a module (its ROWS and toml_of)."""
    return bench('torchtitan_h100', 'torchtitan_h100_rows')


def plan_of(row_id: str, tmp_path):
    """The benchmark row's plan (its torchtitan TOML, as the benchmark imports it), on dgx-h100
    (the by-hand numbers use H100 SXM5's Triad; the benchmark's own node is the runs' HBM2e part)."""
    b = _bench()
    r = next(x for x in b.ROWS if x.id == row_id)
    f = tmp_path / "row.toml"
    f.write_text(b.toml_of(r))
    return build_plan(load_any(f, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=r.gpus // 8)))


def f8_ops(plan) -> dict:
    """(name, phase, recompute) -> size_bytes of the layer's float8 kernels."""
    c = layer_cost(plan.config.model, H100, workload_of(plan))
    return {(o.name, o.phase, o.recompute): o.size_bytes for o in c.ops if o.name.startswith("float8 ")}


def test_t1_fsdp_tensorwise_by_hand(tmp_path):
    p = plan_of("T1 FSDP+compile+fp8", tmp_path)
    ops = f8_ops(p)
    x, d = 16384 * 4096, 16384 * 14336
    assert ops["float8 amax (attn input)", "forward", False] == 2 * x == 134_217_728
    assert ops["float8 cast (attn input)", "forward", False] == 4 * x == 268_435_456
    assert ops["float8 amax (w_down input)", "forward", False] == 2 * d
    assert ops["float8 cast (w_down input)", "forward", False] == 4 * d
    assert ops["float8 cast (w_gate output grad)", "backward_input", False] == 4 * d
    assert ops["float8 cast (wk output grad)", "backward_input", False] == 4 * 16384 * 1024
    assert ops["float8 transpose (wq weight)", "backward_input", False] == 2 * 4096 * 4096 == 33_554_432
    assert not any("forward" == ph and "weight" in n for n, ph, _ in ops)  # gathered in float8: no forward cast
    # op-level AC: the casts of the 4 inputs replayed, not their amaxes (torchtitan saves abs and max)
    replayed = {n for n, _, rc in ops if rc}
    assert replayed == {f"float8 cast ({t}) (recompute)" for t in ("attn input", "wo input", "mlp input", "w_down input")}
    # the layer's total: 4 inputs and 7 output gradients at 6 B an element, 7 weights at 2 B, replays at 4 B
    widths = (3 * 4096 + 14336) + (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)
    assert sum(ops.values()) == 16384 * widths * 6 + LINEARS * 2 + 16384 * (3 * 4096 + 14336) * 4
    # each a memory-bound kernel at the catalog's Triad
    c = layer_cost(p.config.model, H100, workload_of(p))
    o = next(o for o in c.ops if o.name == "float8 cast (attn input)")
    assert o.kind == "memory" and o.seconds == memory_kernel_seconds(kernel_data(H100.name), 4 * x,
                                                                     H100.hbm_bandwidth_bytes_per_s, "elementwise")
    # the per-step precompute: every rank's eighth of 32 layers' float8 weights, read once in fp32
    assert float8_precompute_s(p, 0) == pytest.approx(32 * LINEARS / 8 * 4 / kernel_data(H100.name).stream_bytes_per_s)
    # after the optimizer step: that read, then the table's all-reduce of the stacked amaxes (exposed fsdp)
    ends = {e.name: e for e in step_time(p).post_events}
    opt, read, ar = (ends[n] for n in ("optimizer step", "float8 weight amax (precompute)",
                                       "float8 amax all-reduce (precompute)"))
    row = next(r for r in p.stage(0).collectives if "precompute_float8" in r.cadence)
    assert (row.size_bytes, row.per_step) == (32 * 7 * 4, 1)  # one fp32 amax per float8 weight
    assert read.start_s == opt.end_s and read.dur_s == pytest.approx(float8_precompute_s(p, 0), rel=1e-9)
    assert ar.start_s == read.end_s and ar.dur_s == pytest.approx(row.time_s, rel=1e-9) and ar.stream == "fsdp"


def test_a8_tensorwise_tp_by_hand(tmp_path):
    p = plan_of("A8 fp8tw", tmp_path)
    ops = f8_ops(p)
    shard, full = 12288 * 4096, 98304 * 4096
    assert ops["float8 amax (attn input, all-reduced over tp)", "forward", False] == 2 * shard == 100_663_296
    assert ops["float8 cast (attn input)", "forward", False] == 3 * shard == 150_994_944
    assert ops["float8 transpose (attn input, gathered)", "backward_input", False] == 2 * full == 805_306_368
    assert ops["float8 cast (wo input)", "forward", False] == 4 * 98304 * 512
    assert ops["float8 cast (wo output grad)", "backward_input", False] == 3 * shard  # cast before its gather
    assert ops["float8 transpose (wo output grad, gathered)", "backward_input", False] == 2 * full
    assert ops["float8 cast (w_up output grad)", "backward_input", False] == 4 * 98304 * 1792  # local, both layouts
    c = layer_cost(p.config.model, H100, workload_of(p))
    calls = (float8_tp_reduces.tp_amax_calls(c.ops, "", "forward"), float8_tp_reduces.tp_amax_calls(c.ops, "", "backward_input"))
    assert calls == float8_tp_reduces.tp_amax_per_layer(frozenset(float8.INPUTS), True) == (4, 7)
    rows = {r.phase: r.per_step for r in p.stage(0).collectives if r.dtype == "fp64"}
    assert rows == {"forward": 32 * 4, "backward": 32 * (7 + 4)}  # op-level AC replays the forward's


def test_a8_rowwise_by_hand(tmp_path):
    p = plan_of("A8 fp8rw", tmp_path)
    ops = f8_ops(p)
    full = 98304 * 4096
    assert ops["float8 cast + transpose (attn input)", "forward", False] == 5 * full == 2_013_265_920
    assert ops["float8 cast (transposed) (attn input)", "forward", False] == 3 * full
    assert not any(n.startswith(float8.AMAX) for n, _, _ in ops)
    assert ops["float8 transpose (wq weight)", "backward_input", False] == 4 * 512 * 4096  # bf16, read + write
    # plain TP: a per-row amax over a tp-sharded dim is a Partial max, all-reduced over tp (torchao
    # tensor_to_amax on a DTensor): wo's input (98,304 x 512, its K sharded) and weight (K sharded) in
    # forward, wq's output gradient (98,304 x 512, N sharded) and weight (N sharded) in backward
    assert ops["float8 cast + transpose (wo input, token scales over tp)", "forward", False] == 5 * 98304 * 512
    assert ops["float8 cast (wo weight, weight scales over tp)", "forward", False] == 3 * 4096 * 512
    assert ops["float8 cast + transpose (wq output grad, token scales over tp)", "backward_input", False] == 5 * 98304 * 512
    assert ops["float8 cast (transposed) (wq weight, weight scales over tp)", "backward_input", False] == 3 * 512 * 4096
    c = layer_cost(p.config.model, H100, workload_of(p))
    calls = [float8_tp_reduces.tp_amax_calls(c.ops, "", ph, m) for m in (float8.TOKEN_SCALES, float8.WEIGHT_SCALES)
             for ph in ("forward", "backward_input")]
    assert calls == [2, 5, 2, 5] and float8_tp_reduces.rowwise_tp_per_layer(frozenset(float8.INPUTS)) == (2, 5)
    # the table: per micro-batch 32 layers x 2 forward, x (5 + 2) backward (op-level AC replays the forward's
    # casts: torchtitan saves aten.max, not rowwise's aten.amax), fp64: 98,304 tokens x 8 = 786,432 B, 4096
    # hidden units x 8 = 32,768 B
    rows = sorted((r.size_bytes, r.phase, r.per_microbatch) for r in p.stage(0).collectives if r.dtype == "fp64")
    assert rows == [(32_768, "backward", 224), (32_768, "forward", 64), (786_432, "backward", 224),
                    (786_432, "forward", 64)]
    assert float8_precompute_s(p, 0) == 0.0
    # the backward GEMMs' rescale (torchao addmm_float8_unwrapped, rowwise without fast accumulation:
    # cuBLAS with unit scales, then output *= a_inverse_scale * b_inverse_scale), compiled: the weight
    # gradient read and written in bf16, 4 B an element of the local weight (N / tp x K): wq 512 x 4096
    # x 4 = 8,388,608 B; wk 128 x 4096 x 4 = 2,097,152 (one KV head of 128 at tp 8); w_gate 1792 x 4096
    # x 4 = 29,360,128; the data gradient's pass fused into its consumer, not counted
    assert ops["float8 rescale (wq wgrad)", "backward_weight", False] == 8_388_608
    assert ops["float8 rescale (wk wgrad)", "backward_weight", False] == 2_097_152
    assert ops["float8 rescale (w_gate wgrad)", "backward_weight", False] == 29_360_128
    assert not [n for n, _, _ in ops if "dgrad" in n]
    assert sum(v for (n, _, _), v in ops.items() if n.startswith("float8 rescale")) == 4 * 4096 * (
        2 * 512 + 2 * 128 + 3 * 1792) == 109_051_904
    assert not [n for n, _, _ in f8_ops(plan_of("A8 fp8tw", tmp_path)) if "rescale" in n]  # tensorwise: none


def test_no_casts_without_float8_or_under_megatron(tmp_path):
    assert not f8_ops(plan_of("A8 bf16", tmp_path))
    p = plan_of("T1 FSDP+compile+fp8", tmp_path)
    w = workload_of(p)
    assert not float8.layer_kernels(p.config.model, replace(w, megatron_ops=True), [], 2)


def test_full_ac_replays_the_amax_too(tmp_path):
    p = plan_of("T2 cp1 32k", tmp_path)  # full AC, 32,768 rows
    ops = f8_ops(p)
    assert ops["float8 amax (attn input) (recompute)", "backward_input", True] == 2 * 32768 * 4096
    assert ops["float8 cast (attn input) (recompute)", "backward_input", True] == 4 * 32768 * 4096


def _cast_delay(plan) -> dict:
    """cadence -> seconds each fsdp all-gather row takes beyond its collective (the pre-all-gather casts)."""
    out = {}
    for r in plan.stage(0).collectives:
        if r.op == "all-gather" and r.axis == "dp_shard":
            _, plain = path_time(r.op, r.group_size, r.size_bytes, r.path, plan.config.cluster)
            out[r.phase, r.cadence] = r.time_s - plain
    return out


def test_pre_all_gather_casts_delay_each_layer_all_gather(tmp_path):
    """torchao's fsdp_pre_all_gather casts each float8 weight's fp32 shard eagerly before the
    all-gather: * scale (8 B an element), clamp (8 B), .to(float8) (5 B), each kernel at Triad
    or its issue floor. T1 (dp_shard 8): wq and wo 2,097,152 elements a shard, wk and wv 524,288,
    w_gate, w_up and w_down 7,340,032; A8 (tp 8 x dp_shard 8): every shard an eighth of the tp
    shard (wq 262,144, wk 65,536, w_gate 917,504 elements: at most 7.3 MB a kernel, under the
    4.7 us floor's 14 MB), so 21 kernels at the floor."""
    d = kernel_data(H100.name)
    shards = [4096 * 4096 // 8] * 2 + [1024 * 4096 // 8] * 2 + [4096 * 14336 // 8] * 3
    want = sum(max(n * b / d.stream_bytes_per_s, d.kernel_issue_s) for n in shards for b in (8, 8, 5))
    assert sum(shards) * 21 == 572_522_496 and want == pytest.approx(215.89e-6, abs=0.01e-6)
    t1 = _cast_delay(plan_of("T1 FSDP+compile+fp8", tmp_path))
    assert t1["forward", "every layer"] == pytest.approx(want, rel=1e-9)
    assert t1["backward", "every layer"] == pytest.approx(want, rel=1e-9)  # gathered again in backward
    assert t1["forward", "per root (embedding)"] == 0.0  # no float8 weight (output filtered)
    assert _cast_delay(plan_of("A8 fp8tw", tmp_path))["forward", "every layer"] == pytest.approx(21 * 4.7e-6, rel=1e-9)
    assert not any(_cast_delay(plan_of("A8 fp8rw", tmp_path)).values())  # rowwise: no float8 all-gather


def test_precompute_all_reduces_over_fsdp_then_tp(tmp_path):
    """Under TP the stacked amaxes of the precompute are Partial over dp_shard and tp: two
    all-reduces of one fp32 amax per float8 weight (32 layers x 7 = 896 B), the tp one last."""
    t1, a8 = plan_of("T1 FSDP+compile+fp8", tmp_path), plan_of("A8 fp8tw", tmp_path)
    pre = lambda p: [(r.axis, r.size_bytes, r.per_step) for r in p.stage(0).collectives if "precompute_float8" in r.cadence]
    assert pre(t1) == [("dp_shard", 896.0, 1)]
    assert pre(a8) == [("dp_shard", 896.0, 1), ("tp", 896.0, 1)]
    ends = {e.name: e for e in step_time(a8).post_events}
    fsdp, tp = ends["float8 amax all-reduce (precompute)"], ends["float8 amax all-reduce over tp (precompute)"]
    row = next(r for r in a8.stage(0).collectives if "precompute_float8" in r.cadence and r.axis == "tp")
    assert tp.start_s == fsdp.end_s and tp.dur_s == pytest.approx(row.time_s, rel=1e-9) and tp.stream == "tp"
    assert "float8 amax all-reduce over tp (precompute)" not in {e.name for e in step_time(t1).post_events}


def test_saved_float8_input_copies_in_the_memory_timeline(tmp_path):
    """The float8 copies of the Linears' inputs kept from forward to backward, 1 B an element
    (compiled: the forward cast's column-major copy; eager: each Linear's saved input_fp8).
    T1 (16,384 rows): attention, wo and MLP inputs 16,384 x 4096 = 67,108,864 B each, w_down's
    16,384 x 14336 = 234,881,024 B: 436,207,616 B a layer, 32 layers at the end of pp 1's forward
    (13,958,643,712 B more than the same plan in bf16) without recompute and under selective
    recompute; replayed with the casts under op-level and full recompute (rework, no peak change)."""
    p = plan_of("T1 FSDP+compile+fp8", tmp_path)
    c, layer = p.config, 436_207_616
    assert sum(float8_copies(c.model, c.training, p.mesh).values()) == 16384 * (3 * 4096 + 14336) == layer

    def sizes(rc, ld="fp8", compile_=True):
        t = c.training.model_copy(update={"recompute": rc, "linear_dtype": ld, "fp8_all_gather": ld == "fp8",
                                          "torch_compile": compile_})
        return layer_act_sizes(c.model, t, p.mesh, c.memory), replace(c, training=t)

    for rc in ("none", "selective", "op", "full"):
        (f8, cfg8), (bf, cfgb) = sizes(rc), sizes(rc, None)
        kept = layer if rc in ("none", "selective") else 0
        assert (f8.saved - bf.saved, f8.rework - bf.rework) == (kept, layer - kept), rc
        frees = {a.name: a.frees - b.frees for a, b in zip(f8.steps, bf.steps)}
        assert (frees["attention w_qkv"], frees["mlp w_out"], sum(frees.values())) == (67_108_864, 234_881_024, layer)
        if rc in ("none", "op"):  # the timeline's peak: the end of the forward, every layer's saved tensors
            peak8, peakb = build_plan(cfg8).timeline.peak, build_plan(cfgb).timeline.peak
            assert peak8.total_bytes - peakb.total_bytes == 32 * kept == (13_958_643_712 if kept else 0)
    # eagerly each Linear saves its own: wq, wk, wv the attention input, w_gate and w_up the MLP's
    eager, _ = sizes("none", compile_=False)
    assert eager.saved - sizes("none", None, False)[0].saved == 16384 * (6 * 4096 + 14336)


def test_fp8_output_layer_casts_eagerly_by_hand(tmp_path):
    """T1 FSDP+compile+fp8 with the output layer converted (``filter_fqns = []``): its casts run
    eagerly (torchtitan compiles the blocks alone): the input 16,384 x 4096 and the logits'
    gradient 16,384 x 128,256 each amax 6 B + cast 27 B + transposed copy 2 B an element, the
    weight (gathered in float8) its transposed copy 128,256 x 4096 x 2 B: 76,946,604,032 B a
    micro-batch, 25.91 ms at H100 SXM5's Triad (2.97 TB/s); none with the output filtered."""
    b = _bench()
    r = next(x for x in b.ROWS if x.id == "T1 FSDP+compile+fp8")
    f = tmp_path / "row.toml"
    f.write_text(b.toml_of(r).replace('filter_fqns = ["output"]', "filter_fqns = []"))
    p = build_plan(load_any(f, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1)))
    assert p.config.training.fp8_output_layer
    from meshplan.compute.embed_head import head_cost
    head = {o.name: o for o in head_cost(p.config.model, H100, workload_of(p)).ops}
    f8 = {n: o for n, o in head.items() if n.startswith("float8 ")}
    logits = 16384 * 128256
    assert f8["float8 amax (output grad)"].size_bytes == 6 * logits
    assert f8["float8 cast (output grad)"].size_bytes == 27 * logits
    assert f8["float8 transpose (output grad)"].size_bytes == 2 * logits
    assert f8["float8 transpose (output weight)"].size_bytes == 2 * 128256 * 4096
    assert sum(o.size_bytes for o in f8.values()) == 76_946_604_032
    assert sum(o.seconds for o in f8.values()) == pytest.approx(76_946_604_032 / 2.97e12, rel=1e-6)
    assert head["output"].note and "fp8" in head["output"].note  # the GEMM itself in float8
    assert not [o for o in head_cost(plan_of("T1 FSDP+compile+fp8", tmp_path).config.model, H100,
                                     workload_of(plan_of("T1 FSDP+compile+fp8", tmp_path))).ops
                if o.name.startswith("float8 ")]
