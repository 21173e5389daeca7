"""The A100 SXM4 40GB (``a100-sxm-40gb``) and its node ``dgx-a100-40gb`` (DGX A100 320GB): datasheet
values, the streaming bandwidth measured on the part, the 80 GB part's compute-bound kernel rows,
and a plan whose memory-bound kernels run at the 40 GB part's bandwidth.

By hand (sources in the catalog entries):
- NVIDIA A100 datasheet, A100 40GB SXM: 40 GB HBM2 at 1,555 GB/s, 312 TFLOP/s bf16 dense (the 80GB
  SXM: 2,039 GB/s, the same peak); 108 SMs (A100 whitepaper).
- Streaming (te42kyfo/gpu-benches gpu-stream/a100_40.txt): triad 1,360 GB/s = 87.5% of 1,555.
  The same benchmark on A100 80GB (cuda-stream/a100_80.txt): 1,759 GB/s; 1,360 / 1,759 = 0.773,
  the factor on the 80 GB part's fitted norm bandwidth, within 1.4% of 1,555 / 2,039 = 0.763.
- Llama-3-8B, micro-batch 1, seq 2048: a residual add reads two bf16 activations and writes one,
  3 x 2,048 x 4,096 x 2 B = 50,331,648 B: 50,331,648 / 1.36e12 = 37.009 us on dgx-a100-40gb,
  / 1.70e12 (the 80 GB part's BabelStream Triad) = 29.607 us on dgx-a100.
- The shape model's memory floor is the datasheet's: an 8192 x 8192 x 16 bf16 GEMM moves
  2 B x (8192 x 16 + 16 x 8192 + 8192^2) = 134,742,016 B, 86.651 us at 1,555 GB/s, against 38
  waves of 128x128x16 tiles at 312e12 x 0.8692 / 108 FLOP/s per SM (0.209 us each): 7.9 us, so
  memory-bound; its ridge is 312e12 x 0.8692 / 1.555e12 = 174 FLOP/B.
"""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute.gemm import gemm_model
from meshplan.compute.kernel_time import optimizer_bandwidth
from meshplan.compute.measured import kernel_data
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.workload import chunk_costs, workload_of


def test_a100_40gb_datasheet_values():
    a40, a80 = catalog.gpu("a100-sxm-40gb"), catalog.gpu("a100-sxm-80gb")
    assert (a40.hbm_gb, a40.hbm_bandwidth_tb_per_s, a40.sms) == (40, 1.555, 108)
    assert a40.peak_tflops == a80.peak_tflops and a40.peak_tflops["bf16"] == 312.0 and "fp8" not in a40.peak_tflops
    assert a40.max_gemm_fraction * 312 == pytest.approx(271.2, abs=0.1)  # the 80 GB part's MAMF, reused
    assert a40.hbm_bandwidth_tb_per_s / a80.hbm_bandwidth_tb_per_s == pytest.approx(1555 / 2039)
    src = catalog.entry("gpu", "a100-sxm-40gb")["source"]
    assert "1,555 GB/s" in src and "NOT measured on this part" in src


def test_a100_40gb_kernels_measured_bandwidth_and_reused_compute_rows():
    d, e = kernel_data("a100-sxm-40gb"), kernel_data("a100-sxm-80gb")
    assert d.stream_bytes_per_s == 1.36e12 and e.stream_bytes_per_s == 1.70e12
    assert d.stream_bytes_per_s / 1.555e12 == pytest.approx(0.875, abs=1e-3)  # 87.5% of the datasheet
    assert 1360 / 1759 == pytest.approx(0.773, abs=5e-4)  # the same benchmark on both parts
    assert 1360 / 1759 == pytest.approx(1555 / 2039, rel=0.015)  # against the datasheets' ratio
    assert d.norm_bytes_per_s == pytest.approx(0.773 * e.norm_bytes_per_s) and d.norm_fixed_s == e.norm_fixed_s
    # compute-bound rows: the 80 GB part's, head-dim ratios of the attention's batched GEMMs included
    assert (d.gemm, d.attention, d.prefer, d.bmm_head_dim) == (e.gemm, e.attention, e.prefer, e.bmm_head_dim)
    assert d.bmm_head_dim is not None
    assert "NOT measured on the 40 GB part" in d.source
    assert optimizer_bandwidth(catalog.gpu("a100-sxm-40gb")) == 1.36e12


def test_dgx_a100_40gb_is_dgx_a100_with_the_40gb_gpu():
    c, ref = catalog.system("dgx-a100-40gb", nodes=4), catalog.system("dgx-a100", nodes=4)
    assert (c.gpu.name, c.world, c.node.fabric.bandwidth_gb_per_s) == ("a100-sxm-40gb", 32, 300.0)
    assert [(n.name, n.gpus, n.rate_gbit_per_s, n.rail) for n in c.node.nics] == [
        (n.name, n.gpus, 200.0, n.rail) for n in ref.node.nics]
    assert len(c.node.nics) == 8 and c.network == ref.network and c.node.busbw == ref.node.busbw
    assert c.node.sockets == ref.node.sockets
    assert "DGX A100 320GB" in catalog.entry("node", "dgx-a100-40gb")["source"]


def _llama8b(system: str) -> dict:
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": system, "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 2048, "micro_batch": 1, "sharding": "zero3",
                         "recompute": "none"},
            "mesh": {"names": ["dp_shard"], "shape": [8]}}


def _memory_ops(plan) -> dict:
    ops = chunk_costs(plan, workload_of(plan))[0][0].layers[0].ops
    return {(o.name, o.phase): o for o in ops if o.kind == "memory"}


def test_plan_on_dgx_a100_40gb_times_memory_bound_ops_at_its_bandwidth():
    p40, p80 = (build_plan(config_from_dict(_llama8b(s))) for s in ("dgx-a100-40gb", "dgx-a100"))
    assert p40.feasible and p80.feasible
    add40, add80 = (_memory_ops(p)[("residual add", "forward")] for p in (p40, p80))
    assert add40.size_bytes == add80.size_bytes == 3 * 2048 * 4096 * 2 == 50_331_648
    assert add40.seconds == pytest.approx(50_331_648 / 1.36e12) and add40.seconds == pytest.approx(37.009e-6, abs=1e-9)
    assert add80.seconds == pytest.approx(29.607e-6, abs=1e-9)
    assert "1.36 TB/s (Triad)" in add40.note
    norm40, norm80 = (_memory_ops(p)[("attn norm", "forward")] for p in (p40, p80))
    d = kernel_data("a100-sxm-40gb")
    assert norm40.seconds == pytest.approx(d.norm_fixed_s + norm40.size_bytes / (0.773 * kernel_data(
        "a100-sxm-80gb").norm_bytes_per_s))
    assert norm40.seconds > norm80.seconds
    # the peak is judged against the runtime's device total (catalog device_memory_gib): A100 40GB
    # 42,298,834,944 B (= 39.394 GiB), A100 80GB 79.25 GiB; 90% usable under the default 10% reserve:
    # 42,298,834,944 x 0.9 = 38,068,951,449.6 B and 79.25 x 2**30 x 0.9 = 76,584,635,596.8 B (were 36e9, 72e9)
    assert (p40.timeline.usable_bytes, p80.timeline.usable_bytes) == (pytest.approx(42_298_834_944 * 0.9),
                                                                      pytest.approx(79.25 * 2**30 * 0.9))
    assert 79.25 * 2**30 * 0.9 == pytest.approx(76_584_635_596.8)


def test_shape_model_memory_floor_is_the_1555_datasheet():
    est = gemm_model(catalog.gpu("a100-sxm-40gb"), 8192, 8192, 16)
    assert est.seconds == pytest.approx(2 * (8192 * 16 + 16 * 8192 + 8192 ** 2) / 1.555e12)
    assert est.seconds == pytest.approx(86.651e-6, abs=1e-9)
    assert "ridge 174" in est.explanation and "time set by memory traffic" in est.explanation
