"""The H100 of torchtitan's published runs (96 GB HBM2e, 500 W; catalog ``h100-hbm2e-96gb-500w``
in node ``grand-teton-h100``): what is published of it is in the catalog, what is not keeps the
700 W H100 SXM5's value and says so, and its one measured kernel sets the memory-bound times.

By hand (S12, pytorch/pytorch PR #119842: torch's fused AdamW on a 128-way shard of Llama 2
70B's parameters, bf16, on 'H100 (HBM2E, 500W)', 3.564 ms; fused Adam 3.578 ms):
Llama 2 70B = 2 x 32000 x 8192 (embedding, output) + 80 x (8192 x (8192 + 2 x 1024) + 8192^2
+ 3 x 8192 x 28672 + 2 x 8192) + 8192 = 68,976,648,192 parameters; a shard 538,880,064; the
fused step reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq, 2 B
each: 14 B a parameter, 7,544,320,896 B; / 3.564 ms = 2.1168 TB/s (Adam: 2.1085).
"""

from __future__ import annotations

import sys

import pytest

from meshplan import catalog
from meshplan.compute.measured import kernel_data, memory_kernel_seconds
from meshplan.plan import build_plan
from bench_module import bench

PART, NODE = "h100-hbm2e-96gb-500w", "grand-teton-h100"
LLAMA2_70B = 2 * 32000 * 8192 + 80 * (8192 * (8192 + 2 * 1024) + 8192 ** 2 + 3 * 8192 * 28672 + 2 * 8192) + 8192
SHARD_BYTES = LLAMA2_70B // 128 * 14  # fused AdamW, all bf16: 4 reads + 3 writes of 2 B


def _bench():
    return bench('torchtitan_h100', 'torchtitan_h100_gt')


def _plan(row_id: str, node: str, tmp_path):
    b = _bench()
    r = next(x for x in b.ROWS if x.id == row_id)
    f = tmp_path / "row.toml"
    f.write_text(b.toml_of(r))
    return build_plan(b.load_row(f, r, node))  # the benchmark's config (training.fsdp_root_unit set)


def test_published_values_and_the_kept_ones_say_so():
    g, sxm = catalog.gpu(PART), catalog.gpu("h100-sxm5-80gb")
    assert (g.hbm_gb, g.hbm_bandwidth_tb_per_s) == (96, 2.4)  # torchtitan's benchmark pages
    # not published for this part: the 700 W SXM5's, named as such in the source
    assert (g.peak_tflops, g.sms, g.max_gemm_fraction) == (sxm.peak_tflops, sxm.sms, sxm.max_gemm_fraction)
    src = catalog.entry("gpu", PART)["source"]
    assert "NOT published" in src and "500W" in src and "between SXM and NVL" in src


def test_s12_gives_the_streaming_bandwidth_by_hand():
    assert LLAMA2_70B == 68_976_648_192 and SHARD_BYTES == 7_544_320_896
    assert SHARD_BYTES / 3.564e-3 == pytest.approx(2.1168e12, abs=0.0001e12)
    assert SHARD_BYTES / 3.578e-3 == pytest.approx(2.1085e12, abs=0.0001e12)  # fused Adam agrees within 0.4%
    d = kernel_data(PART)
    assert d.stream_bytes_per_s == pytest.approx(SHARD_BYTES / 3.564e-3, rel=1e-3)
    assert d.stream_bytes_per_s / 2.4e12 == pytest.approx(0.882, abs=0.001)  # of the published peak
    # the measured step is what a memory-bound kernel of those bytes takes in the model
    assert memory_kernel_seconds(d, SHARD_BYTES, 2.4e12) == pytest.approx(3.564e-3, rel=1e-3)
    # norms: H100 SXM5's fitted Liger bandwidth scaled by the measured streaming ratio, fixed time kept
    h = kernel_data("h100-sxm5-80gb")
    assert d.norm_bytes_per_s == pytest.approx(h.norm_bytes_per_s * 2.117 / 2.97, rel=1e-4)
    assert d.norm_fixed_s == h.norm_fixed_s


def test_node_is_grand_teton():
    c = catalog.system(NODE, nodes=2)
    assert (c.gpu.name, c.world, c.node.fabric.bandwidth_gb_per_s) == (PART, 16, 450)
    assert [(n.gpus, n.rate_gbit_per_s) for n in c.node.nics] == [([g], 400) for g in range(8)]
    assert len(c.node.sockets) == 2  # Llama 3 paper: two CPUs a server


def test_the_benchmark_plans_on_the_part(tmp_path):
    """T1 FSDP+compile+fp8 on grand-teton-h100 against dgx-h100: float8 GEMMs at 0.840 of the SXM5's
    rates (FBGEMM #2546's fp8 GEMMs at 500 W), attention at 0.797 (D), the bf16 head's GEMM at 0.797,
    so each takes 1 / that ratio of the SXM5's time; the casts at 2.117 TB/s: the attention input's cast, 16,384 x 4096 x
    4 B = 268,435,456 B, 126.80 us (90.38 us at Triad 2.97); memory checked against 96 GB."""
    part, sxm = _plan("T1 FSDP+compile+fp8", NODE, tmp_path), _plan("T1 FSDP+compile+fp8", "dgx-h100", tmp_path)
    assert _bench().NODE == NODE and part.config.cluster.gpu.hbm_bytes == 96e9
    from meshplan.compute.layer import layer_cost
    from meshplan.schedule.steptime import workload_of
    ops = [{o.name: o for o in layer_cost(p.config.model, p.config.cluster.gpu, workload_of(p)).ops}
           for p in (part, sxm)]
    cast = "float8 cast (attn input)"
    assert ops[0][cast].seconds == pytest.approx(268_435_456 / 2.117e12, rel=1e-9) == pytest.approx(126.80e-6, abs=0.01e-6)
    assert ops[1][cast].seconds == pytest.approx(90.38e-6, abs=0.01e-6)
    att = [n for n, o in ops[0].items() if o.kind == "attention"]
    assert att and all(ops[0][n].seconds == pytest.approx(ops[1][n].seconds / 0.797, rel=1e-9) for n in att)
    # GEMMs: float8 ones at 0.840 of the SXM5's rows, the bf16 output layer's at 0.797 (FBGEMM #2546),
    # where compute-bound: 1 / 0.840 = 1.1905 of the SXM5's time; the float8 backward GEMMs (no fast
    # accumulation under torchao) also x 1.286, measured on the part only (kernels.toml
    # fp8_no_fast_accum_slowdown; the SXM5 has none): 1.286 / 0.840 = 1.5310
    ratios = {round(ops[0][n].seconds / ops[1][n].seconds, 4) for n, o in ops[0].items() if o.kind == "gemm"}
    assert ratios == {round(1 / 0.840, 4), round(1.286 / 0.840, 4)}  # a layer's Linears are all float8 here
    # the forward GEMMs and op-level AC's replays of them (wk, wo, w_up in backward: forward GEMMs, fast
    # accumulation) at 1 / 0.840; every data- and weight-gradient GEMM at 1.286 / 0.840
    fwd = {n for n, o in ops[0].items() if o.kind == "gemm" and round(o.seconds / ops[1][n].seconds, 4) == round(1 / 0.840, 4)}
    assert all(("." not in n) == (n in fwd) for n, o in ops[0].items() if o.kind == "gemm")
    assert {n for n in fwd if ops[0][n].recompute} == {"wk (recompute)", "wo (recompute)", "w_up (recompute)"}
    head = lambda p: next(o for c in _head_ops(p) for o in c if o.kind == "gemm")
    assert head(part).seconds / head(sxm).seconds == pytest.approx(1 / 0.797, rel=1e-9)


def _head_ops(plan):
    from meshplan.schedule.steptime import chunk_costs, workload_of
    return [ch.head.ops for ch in chunk_costs(plan, workload_of(plan))[0] if ch.head is not None]


def test_bf16_gemms_from_the_500w_measurements_by_hand():
    """pytorch/FBGEMM PR #2546 ('H100 500W', torch.matmul bf16): 585.23, 575.12, 546.31 TFLOP/s at
    8192^3, 65536x8192x7168, 65536x3584x8192; H100 SXM5's table there 718.15, 711.62, 712.60:
    ratios 0.8149, 0.8082, 0.7666, mean 0.7966 -> 0.797, the part's scale on every bf16 point."""
    from meshplan.compute.gemm_points import gemm_tflops
    sxm, part = kernel_data("h100-sxm5-80gb"), kernel_data(PART)
    eff = lambda m, n, k: 1.0  # noqa: E731: every shape here is inside the measured points (no model)
    measured = {(8192, 8192, 8192): 585.23, (65536, 8192, 7168): 575.12, (65536, 3584, 8192): 546.31}
    table = [gemm_tflops(sxm, *s, "bf16", eff)[0] for s in measured]
    assert table == pytest.approx([718.15, 711.62, 712.60], abs=0.01)
    ratios = [v / t for v, t in zip(measured.values(), table)]
    assert sum(ratios) / 3 == pytest.approx(0.797, abs=0.0005)
    assert part.gemm["bf16"] == tuple((m, n, k, r * 0.797, f"{key} x0.797") for m, n, k, r, key in sxm.gemm["bf16"])
    for s, v in measured.items():  # the part's table within 4% of each measurement
        assert gemm_tflops(part, *s, "bf16", eff)[0] == pytest.approx(v, rel=0.04)


def test_fp8_gemms_from_the_500w_measurements_by_hand():
    """pytorch/FBGEMM PR #2546 ('H100 500W', "fp8 row gemm only": FBGEMM's Triton row-wise fp8 GEMM):
    1125.51, 1082.75, 1141.38 TFLOP/s at 8192^3, 65536x8192x7168, 65536x3584x8192. H100 SXM5's fp8
    table (S3 cuBLASLt, 700 W) there: 1290.10 (a measured point), 1352.27, 1347.72 (interpolated);
    ratios 1125.51 / 1290.10 = 0.8724, 1082.75 / 1352.27 = 0.8007, 1141.38 / 1347.72 = 0.8469, mean
    0.8400 -> 0.840, the part's scale on every fp8 point: 274.1 x 0.840 = 230.244 at 1024^3."""
    from meshplan.compute.gemm_points import gemm_tflops
    sxm, part = kernel_data("h100-sxm5-80gb"), kernel_data(PART)
    eff = lambda m, n, k: 1.0  # noqa: E731: every shape here is inside the measured points (no model)
    measured = {(8192, 8192, 8192): 1125.51, (65536, 8192, 7168): 1082.75, (65536, 3584, 8192): 1141.38}
    table = [gemm_tflops(sxm, *s, "fp8", eff)[0] for s in measured]
    assert table == pytest.approx([1290.10, 1352.27, 1347.72], abs=0.01)
    ratios = [v / t for v, t in zip(measured.values(), table)]
    assert ratios == pytest.approx([0.8724, 0.8007, 0.8469], abs=0.00005)
    assert sum(ratios) / 3 == pytest.approx(0.840, abs=0.0005)
    assert part.gemm["fp8"] == tuple((m, n, k, r * 0.840, f"{key} x0.84") for m, n, k, r, key in sxm.gemm["fp8"])
    assert part.gemm["fp8"][0][3] == pytest.approx(230.244, abs=1e-9)
    for s, v in measured.items():  # the part's table within 5% of each measurement
        assert gemm_tflops(part, *s, "fp8", eff)[0] == pytest.approx(v, rel=0.05)


def test_attention_takes_the_bf16_gemm_ratio_derived():
    """No attention kernel is published at 500 W: the part's attention rows are H100 SXM5's x 0.797,
    the bf16 GEMM's measured ratio (D, an assumption the catalog's source says), e.g. FA2 fwd causal
    d128 at 16k: 335 x 0.797 = 266.995 TFLOP/s; fwd+bwd at 8k, d128 causal (S7b): 308 x 0.797 = 245.476."""
    sxm, part = kernel_data("h100-sxm5-80gb"), kernel_data(PART)
    assert len(part.attention) == len(sxm.attention)
    for a, b in zip(part.attention, sxm.attention):
        assert (a.kernel, a.pass_, a.mask, a.head_dim, a.seq) == (b.kernel, b.pass_, b.mask, b.head_dim, b.seq)
        assert a.tflops == pytest.approx(tuple(t * 0.797 for t in b.tflops), rel=1e-12)
        assert a.source == f"{b.source} x0.797"
    row = lambda d, p: next(r for r in d.attention if (r.kernel, r.pass_, r.mask, r.head_dim) == ("FA2",) + p)  # noqa: E731
    assert row(part, ("fwd", "causal", 128)).tflops[-1] == pytest.approx(266.995, abs=1e-9)
    assert row(part, ("fwd+bwd", "causal", 128)).tflops[4] == pytest.approx(245.476, abs=1e-9)
    src = catalog.entry("gpu", PART)["source"]
    assert "attention takes the bf16 GEMM's ratio (D, an assumption" in src


def test_the_benchmark_prints_its_sources(capsys):
    """(nicshare: T1's prediction 9,334.7 -> 9,334.1 tokens/s/GPU, a 0.006% longer step, all of it exposed
    fsdp, 8.4 -> 8.5 ms of the 1755 ms step, compute 1746.8 ms unchanged: FSDP2's reduce-scatters on their
    own stream with one in flight, grad_reduce.rs_buffer_wait.) (fsdp_root_unit: 9,334.1 -> 9,300.6, the step
    1755.3 -> 1761.6 ms: torchtitan 9dec370's one FSDP2 root unit exposes its 2.10 GB all-gather at the step's
    start and its 4.20 GB fp32 reduce-scatter at the end of backward, exposed fsdp 8.5 -> 18.0 ms, less 3.2 ms of
    compute whose SM contention those collectives no longer cause where they were hidden:
    16,384 / 9,300.6 = 1.7616 s, tests/test_fsdp_root_unit.py.) (fp8micro: 9,300.6 -> 8,711.6, the step
    1761.6 -> 1880.7 ms: the float8 backward GEMMs run without fast accumulation, x 1.286 on the part
    (kernels.toml fp8_no_fast_accum_slowdown, from torchao's float8 microbenchmark,
    tests/test_float8_micro.py): GEMM 796.0 -> 915.2 ms a step, 0.286 x 416.8 ms of them; 16,384 / 8,711.6
    = 1.8807 s.)"""
    assert _bench().main(["--only", "T1 FSDP+compile+fp8"]) == 0
    out = capsys.readouterr().out
    assert f"planned on catalog {NODE} ({PART})" in out and "memory-bound at 2.117 TB/s" in out
    assert "S12 pytorch/pytorch PR #119842" in out and "| T1 FSDP+compile+fp8 | 8,532.0 | 8,711.6 | +2.1%" in out


def test_the_memory_column_names_its_peaks_as_meshplan_memory_does(tmp_path):
    """The benchmark's memory cell is published reserved / predicted reserved (stage 0) / the plan's
    ``timeline.peak.total_bytes``: torchtitan logs ``reserved_bytes.all.peak`` (9dec370 ``metrics.py`` line
    62), compared with the simulated reserved peak (``meshplan memory``'s "reserved peak"); the third value
    is the timeline's peak over every kind, which :mod:`meshplan.memory.reserved` names the "peak incl.
    communication buffers" (the "allocated peak" is the allocator's, without the buffers). The header said
    "predicted allocated peak" for it. T2 cp1 on the grand-teton node: the row's third value is the plan's
    timeline peak in GiB."""
    b = _bench()
    header = b.table([])[0]
    assert "predicted reserved peak (stage 0) / predicted peak incl. communication buffers (most loaded stage)" \
        in header and "allocated" not in header
    r = next(x for x in b.ROWS if x.id == "T2 cp1 32k")
    res = b.predict(r, tmp_path)
    plan = _plan("T2 cp1 32k", NODE, tmp_path)
    assert res.peak_gib == plan.timeline.peak.total_bytes / 2**30
    assert b.table([res])[2].endswith(f"/ {res.peak_gib:.1f} |")
