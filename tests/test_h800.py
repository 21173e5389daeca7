"""DeepSeek-V3's hardware (newcomer trial 17): the H800 SXM (``h800-sxm-80gb``), its node
``hgx-h800`` and network ``deepseek-mpft``; an unknown node whose GPU differs from the nearest
name's is not guessed as a misspelling; the README's inline [cluster] forms parse.

By hand (sources in the catalog entries):
- H800 NVLink: 400 GB/s both directions (Insights into DeepSeek-V3, arXiv 2505.09343, 4.1),
  200 GB/s each way ("NVLink provides 200GB/s bandwidth", 4.3); 160 GB/s achieved (DeepSeek-V3
  report, arXiv 2412.19437, 3.2.2). IB: 8 x 400 Gb/s NICs, 50 GB/s each (4.1, 4.3).
- H100's ring all-reduce at 8 GiB (catalog h100-nvlink4-ring, line 450 GB/s): 368 GB/s busbw,
  t = 1.75 x 2^33 B / 368e9 = 40.849 ms. Read against 200 GB/s, its bandwidth term grows by
  450 / 200 = 2.25: t = 15 us + 2.25 x (40.849 ms - 15 us) = 91.89 ms, busbw 163.6 GB/s, near
  DeepSeek's 160 achieved (NCCL's ring latency for 8 ranks on NVLink, 15 us, as test_busbw).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.comm.nccl_algorithms import collective_time
from meshplan.compute.measured import kernel_data
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.plan import build_plan
from tests.docs_text import docs_text

GiB = 2 ** 30


def test_h800_is_h100_compute_with_a_cut_nvlink():
    h800, h100 = catalog.gpu("h800-sxm-80gb"), catalog.gpu("h100-sxm5-80gb")
    assert (h800.peak_tflops, h800.sms, h800.hbm_gb) == (h100.peak_tflops, 132, 80)
    assert 432 / 0.4373 == pytest.approx(h800.peak_tflops["bf16"], rel=2e-3)  # Insights table 4: MFU on BF16 peak
    src = catalog.entry("gpu", "h800-sxm-80gb")["source"]
    assert "20 out of the 132 SMs" in src and "NOT read from an NVIDIA H800" in src
    d, h = kernel_data("h800-sxm-80gb"), kernel_data("h100-sxm5-80gb")
    assert d.stream_bytes_per_s == h.stream_bytes_per_s and d.attention == h.attention


def test_hgx_h800_node_and_network():
    c = catalog.system("hgx-h800", nodes=256)
    assert (c.gpu.name, c.world, c.node.fabric.bandwidth_gb_per_s, c.node.fabric.nvls) == (
        "h800-sxm-80gb", 2048, 200.0, False)
    assert [(n.gpus, n.rail, n.rate_gbit_per_s) for n in c.node.nics] == [([g], g, 400) for g in range(8)]
    assert 400 / 8 == 50  # Gb/s -> GB/s: DeepSeek's "IB (50 GB/s)"
    assert [(t.name, t.nodes_per_domain) for t in c.network] == [("leaf", 32), ("spine", 0)]
    fabric = catalog.node("hgx-h800").fabric.source
    assert "reduced from 900 GB/s to 400 GB/s" in fabric and "160 GB/s" in fabric and "DERIVED" in fabric


def test_h800_nvlink_ring_is_h100s_curve_at_200_gb_per_s():
    curves = catalog.node("hgx-h800").busbw
    assert curves["nvlink"].line_gb_per_s == 450 and curves["nvlink"].busbw_gb_per_s[-1] == 368.0
    t_h100 = 1.75 * 8 * GiB / 368e9
    _, t = collective_time("all-reduce", 8, 8 * GiB, 200e9, "nvlink", curves=curves)
    assert t == pytest.approx(15e-6 + 450 / 200 * (t_h100 - 15e-6), rel=1e-6)
    assert 1.75 * 8 * GiB / t / 1e9 == pytest.approx(163.6, abs=0.1)


def _deepseek_like(system: str) -> dict:
    """DeepSeek-V2-Lite shaped as DeepSeek-V3's run (pp, ep inside the data axis, ZeRO-1, no tp)
    on 2 nodes: pp 2 x dp_shard 8 x ep 8."""
    return {"model": {"catalog": "deepseek-v2-lite"}, "cluster": {"system": system, "nodes": 2},
            "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1",
                         "recompute": "full", "framework": "megatron"},
            "mesh": {"names": ["pp", "dp_shard", "ep"], "shape": [2, 8, 8], "pp_layer_split": [13, 14]}}


def _ep_all_to_all(plan):
    return next(r for r in plan.collectives["stage 0"] if (r.axis, r.op, r.phase) == ("ep", "all-to-all", "forward"))


def test_deepseek_like_mesh_plans_on_hgx_h800():
    h800 = build_plan(config_from_dict(_deepseek_like("hgx-h800")))
    h100 = build_plan(config_from_dict(_deepseek_like("dgx-h100")))
    assert h800.feasible and h100.feasible
    a, b = _ep_all_to_all(h800), _ep_all_to_all(h100)
    assert (a.group_size, a.size_bytes, a.path.kind, b.path.kind) == (8, b.size_bytes, "nvlink", "nvlink")
    assert (a.path.bandwidth_bytes_per_s, b.path.bandwidth_bytes_per_s) == (200e9, 450e9)
    # same curve, same latency L: (t_h800 - L) = 2.25 (t_h100 - L), so L = (2.25 t_h100 - t_h800) / 1.25
    # is NCCL's LL latency of 7 steps on NVLink, 6.6 + 7 x 0.6 = 10.8 us (as test_busbw)
    assert (2.25 * b.time_s - a.time_s) / 1.25 == pytest.approx(10.8e-6, rel=1e-6)


@pytest.mark.parametrize("typed,field", [("dgx-a800", "node"), ("a800-sxm-80gb", "gpu")])
def test_another_gpu_is_not_guessed_as_a_misspelling(typed, field):
    read = catalog.node if field == "node" else catalog.gpu
    with pytest.raises(ConfigError) as e:
        read(typed)
    msg = e.value.message
    assert "did you mean" not in msg and "is another GPU, not a spelling of it" in msg and "\n" not in msg
    if field == "node":
        assert "no catalog node holds GPU 'a800' ('dgx-a100'" in msg and "dgx-a100 (a100-sxm-80gb)" in msg
        assert "hgx-h800 (h800-sxm-80gb)" in msg and "fabric = {...}" in msg


@pytest.mark.parametrize("typed,guess", [("dgx-h800", "'hgx-h800'"), ("dgx-h10", "'dgx-h100'"),
                                         ("h800", "'hgx-h800'")])
def test_a_misspelling_of_the_same_gpu_is_still_guessed(typed, guess):
    with pytest.raises(ConfigError, match=f"did you mean {guess}\\? known: "):
        catalog.node(typed)


def _readme_clusters() -> list[dict]:
    blocks = re.findall(r"```toml\n(\[cluster\].*?)```", docs_text(), re.S)
    return [tomllib.loads(b)["cluster"] for b in blocks]


def _with(cluster: dict, world: int) -> dict:
    return {"model": {"catalog": "llama3-8b"}, "cluster": cluster,
            "training": {"global_batch": 64, "seq_len": 2048, "micro_batch": 1, "sharding": "zero3"},
            "mesh": {"names": ["dp_shard"], "shape": [world]}}


def test_readme_cluster_examples_parse():
    fabric, inline, four_nic, roce = _readme_clusters()  # four_nic: tests/test_newcomer32.py
    c = config_from_dict(_with(fabric, 32)).cluster
    a100 = catalog.system("dgx-a100", nodes=4)
    assert (c.node.fabric.bandwidth_gb_per_s, c.node.fabric.nccl_channels, c.world) == (200.0, 24, 32)
    assert c.node.busbw == a100.node.busbw and c.node.nics == a100.node.nics and c.gpu == a100.gpu
    assert "A800" in c.node.fabric.source
    c = config_from_dict(_with(inline, 2)).cluster
    assert (c.gpu.name, c.world, c.node.fabric.bandwidth_gb_per_s, c.node.nics[0].gpus) == ("my-gpu", 2, 200.0, [0, 1])
    c = config_from_dict(_with(roce, 1536)).cluster  # RoCE NICs (tests/test_newcomer52b.py): dgx-h200's, relabelled
    h200 = catalog.node("dgx-h200")
    assert [n.transport for n in c.node.nics] == ["roce"] * 8 and c.node.busbw == h200.busbw and c.world == 1536
    assert [n.model_copy(update={"transport": "infiniband"}) for n in c.node.nics] == h200.nics


def test_fabric_override_keeps_the_rest_and_refuses_bad_keys():
    c = config_from_dict(_with({"system": "hgx-h800", "nodes": 1, "fabric": {"bandwidth_gb_per_s": 160.0}}, 8)).cluster
    assert c.node.fabric.bandwidth_gb_per_s == 160.0 and c.node.fabric.latency_us == 3.4
    src = "config's [cluster] fabric (bandwidth_gb_per_s) over catalog node hgx-h800's nvlink4-h800 (200 GB/s)"
    assert c.node.fabric.source == src and c.source.endswith(f"(see each entry's source); NVLink fabric: {src}")
    with pytest.raises(ConfigError) as e:
        config_from_dict(_with({"system": "hgx-h800", "nodes": 1, "fabric": {"bandwith_gb_per_s": 160.0}}, 8))
    assert e.value.field == "cluster.fabric.bandwith_gb_per_s" and "did you mean bandwidth_gb_per_s" in e.value.message
    with pytest.raises(ConfigError, match="must be a table of fabric keys"):
        config_from_dict(_with({"system": "hgx-h800", "nodes": 1, "fabric": 160}, 8))
