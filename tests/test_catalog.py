"""The built-in catalog: every entry loads and names its source; parameter counts of the
catalog models match hand-derived values; unknown names are one-line ConfigErrors."""

import pytest

from meshplan import catalog
from meshplan.errors import ConfigError
from meshplan.spec.cluster import ClusterSpec, GPUSpec, NodeSpec
from meshplan.spec.model import ModelSpec

LOADERS = {"gpu": catalog.gpu, "node": catalog.node, "network": catalog.network, "model": catalog.model}
ENTRIES = [(kind, name) for kind in catalog.KINDS for name in catalog.names(kind)]


def test_catalog_has_the_required_entries():
    assert set(catalog.names("gpu")) >= {"h100-sxm5-80gb", "h200-sxm-141gb", "a100-sxm-80gb"}
    assert set(catalog.names("node")) >= {"dgx-h100", "dgx-h200", "dgx-a100", "seed-8x8-2nic"}
    assert set(catalog.names("model")) >= {
        "llama3-8b", "llama3-70b", "llama3-405b", "llama3.1-8b", "llama3.1-70b", "gpt3-175b", "megatron-22b",
        "mixtral-8x7b"}


@pytest.mark.parametrize("kind,name", ENTRIES)
def test_every_entry_loads_and_names_a_source(kind, name):
    obj = LOADERS[kind](name)
    expected = {"gpu": GPUSpec, "node": NodeSpec, "model": ModelSpec}.get(kind)
    if expected:
        assert isinstance(obj, expected) and obj.name == name
    else:
        assert obj, "a network has at least one tier"
    source = catalog.entry(kind, name)["source"]
    assert isinstance(source, str) and len(source.strip()) > 20


@pytest.mark.parametrize("name", catalog.names("node"))
def test_every_node_makes_a_system(name):
    raw = catalog.entry("node", name)
    cluster = catalog.system(name, nodes=8)
    assert isinstance(cluster, ClusterSpec)
    assert cluster.gpu.name == raw["gpu"] and cluster.world == 8 * cluster.node.gpus
    assert cluster.network == catalog.network(raw["network"]) and cluster.network
    assert all(t.oversubscription == 1 and t.latency_us == 14.0 for t in cluster.network)
    assert cluster.node.fabric.source and cluster.node.pcie.source


def test_gpu_numbers_match_public_facts():
    h100, h200, a100 = (catalog.gpu(n) for n in ("h100-sxm5-80gb", "h200-sxm-141gb", "a100-sxm-80gb"))
    assert h100.peak_flops("bf16") == 989.4e12 and h100.peak_tflops["fp8"] == 1978.9
    assert (h100.hbm_gb, h100.hbm_bandwidth_tb_per_s, h100.sms) == (80, 3.35, 132)
    assert (h200.hbm_gb, h200.hbm_bandwidth_tb_per_s, h200.peak_tflops["bf16"]) == (141, 4.8, 989)
    assert (a100.hbm_gb, a100.peak_tflops["bf16"], a100.sms) == (80, 312, 108)
    assert "fp8" not in a100.peak_tflops
    # max_gemm_fraction reproduces the measured best GEMM (stas00/ml-engineering)
    assert h100.max_gemm_fraction * 989.4 == pytest.approx(794.5, abs=0.1)
    assert a100.max_gemm_fraction * 312 == pytest.approx(271.2, abs=0.1)
    assert h200.max_gemm_fraction * 989.0 == pytest.approx(794.5, abs=0.1)  # S1: 'H200 is the same'
    # S1 @744d01e MAMF BF16 table: B200 SXM 1745.0 / 2250, GB200 SXM 1822.0 / 2500, MI300X 668.4
    b200, gb200, mi300x = (catalog.gpu(n) for n in ("b200-sxm-180gb", "b200-gb200-186gb", "mi300x-oam-192gb"))
    assert b200.max_gemm_fraction * 2250 == pytest.approx(1745.0, abs=0.2)
    assert gb200.max_gemm_fraction * 2500 == pytest.approx(1822.0, abs=0.2)
    assert mi300x.max_gemm_fraction * 1307.4 == pytest.approx(668.4, abs=0.2)
    assert "H100" in catalog.entry("gpu", "h200-sxm-141gb")["source"]


def test_dgx_h100_pairs_nic_k_with_gpu_k_on_rail_k():
    node = catalog.node("dgx-h100")
    assert node.fabric.bandwidth_gb_per_s == 450 and node.fabric.latency_us == 3.4
    assert [len(s.gpus) for s in node.sockets] == [4, 4] and node.sockets[0].cores == 56
    for g in range(8):
        nic = node.nics[node.nic_of(g)]
        assert (nic.gpus, nic.rail, nic.socket, nic.rate_gbit_per_s) == ([g], g, g // 4, 400)
        assert node.socket_of(g) == g // 4


def test_dgx_a100_nics_share_pcie_switches_in_pairs():
    node = catalog.node("dgx-a100")
    assert node.fabric.bandwidth_gb_per_s == 300 and node.sockets[1].cores == 64
    assert [n.gpus for n in node.nics] == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
    assert [n.rail for n in node.nics] == list(range(8))
    assert all(n.rate_gbit_per_s == 200 for n in node.nics)
    # each GPU of a pair takes its own NIC of the pair (round-robin), as NCCL does
    assert [node.nic_of(g) for g in range(8)] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_seed_node_has_two_nics_one_per_socket():
    node = catalog.node("seed-8x8-2nic")
    assert [(n.gpus, n.socket, n.rail) for n in node.nics] == [([0, 1, 2, 3], 0, 0), ([4, 5, 6, 7], 1, 1)]
    assert [node.nic_of(g) for g in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "gives no NIC rate" in catalog.entry("node", "seed-8x8-2nic")["source"]
    assert catalog.system("seed-8x8-2nic", nodes=8).world == 64


def test_llama3_70b_param_count_by_hand():
    h, kv, ffn, vocab, layers = 8192, 8 * 128, 28672, 128256, 80
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h  # qkv, o, gated MLP, 2 RMSNorms
    expected = 2 * vocab * h + layers * per_layer + h  # untied embedding + output, final norm
    assert expected == 70_553_706_496
    assert catalog.model("llama3-70b").param_count() == expected


@pytest.mark.parametrize("name,total,active", [
    ("llama3-8b", 8.03e9, None),
    ("llama3-405b", 405.85e9, None),
    ("gpt3-175b", 174.6e9, None),  # with learned positions and biases, tied embedding
    ("megatron-22b", 22.07e9, None),
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mixtral paper / model card: 46.7B total, 12.9B active
])
def test_model_param_counts(name, total, active):
    spec = catalog.model(name)
    assert spec.param_count() == pytest.approx(total, rel=2e-3)
    assert spec.active_param_count() == pytest.approx(active or total, rel=2e-3)


def test_llama31_8b_70b_are_llama3_sizes_at_131072_scaled_positions():
    """Llama 3.1 8B/70B (nc59 #4): Table 3 of the Llama 3 paper gives the 3.1 models Llama 3's sizes,
    so the counts are the same by hand. 8B: h 4096, kv 8 x 128 = 1024, ffn 14336, 32 layers:
    per layer 4096 x (4096 + 2048) + 4096^2 + 3 x 4096 x 14336 + 2 x 4096 = 25,165,824 + 16,777,216
    + 176,160,768 + 8,192 = 218,112,000; x 32 = 6,979,584,000; + 2 x 128256 x 4096 = 1,050,673,152
    + final norm 4096 = 8,030,261,248. 70B as in test_llama3_70b_param_count_by_hand: 70,553,706,496.
    Positions and RoPE scaling: meta-llama/Llama-3.1-8B / -70B config.json (max_position_embeddings
    131072; rope_scaling factor 8, low 1, high 4, original 8192; rope_theta 500000)."""
    h, kv, ffn = 4096, 8 * 128, 14336
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h
    assert per_layer == 218_112_000
    assert 32 * per_layer + 2 * 128256 * h + h == 8_030_261_248
    assert catalog.model("llama3.1-8b").param_count() == 8_030_261_248
    assert catalog.model("llama3.1-70b").param_count() == 70_553_706_496
    for name in ("llama3.1-8b", "llama3.1-70b"):
        m = catalog.model(name)
        assert (m.max_position, m.rope_theta, m.norm_eps, m.vocab) == (131072, 500000.0, 1e-5, 128256)
        rs = m.rope_scaling
        assert (rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position) == (8.0, 1.0, 4.0, 8192)
        assert "meta-llama/Llama-3.1-" in catalog.entry("model", name)["source"]
    assert catalog.model("llama3-8b").rope_scaling is None  # Llama 3: 8192 positions, unscaled


def test_exact_counts_of_other_models():
    assert catalog.model("llama3-8b").param_count() == 8_030_261_248
    assert catalog.model("llama3-405b").param_count() == 405_853_388_800
    assert catalog.model("gpt3-175b").param_count() == 174_604_259_328
    mixtral = catalog.model("mixtral-8x7b")
    assert (mixtral.param_count(), mixtral.active_param_count()) == (46_702_792_704, 12_879_925_248)


@pytest.mark.parametrize("kind", catalog.KINDS)
def test_unknown_name_lists_the_known_ones_on_one_line(kind):
    with pytest.raises(ConfigError) as info:
        LOADERS[kind]("no-such-entry")
    msg = str(info.value)
    assert info.value.field == kind and "no-such-entry" in msg and "\n" not in msg
    assert all(name in msg for name in catalog.names(kind))


def test_unknown_kind_and_bad_system_requests():
    with pytest.raises(ConfigError, match="known: gpu, node, network, model"):
        catalog.names("tpus")
    with pytest.raises(ConfigError, match="dgx-h100"):
        catalog.system("dgx-b300", nodes=2)
    with pytest.raises(ConfigError) as info:
        catalog.system("dgx-h100", nodes=0)
    assert info.value.field == "nodes"
    with pytest.raises(ConfigError, match="superpod-ndr-su32"):
        catalog.system("dgx-h100", nodes=2, network_name="fat-tree")


def test_entry_returns_a_copy():
    catalog.entry("gpu", "h100-sxm5-80gb")["peak_tflops"]["bf16"] = 1.0
    assert catalog.gpu("h100-sxm5-80gb").peak_tflops["bf16"] == 989.4


def test_new_gpus_dense_peaks_derived_from_the_datasheets():
    """Dense = the printed (with sparsity) rack or board peak / 2 / GPUs: HGX B200 BF16 36 PF and
    FP8 72 PF over 8 GPUs; GB200 NVL72 BF16 360 PF over 72; MI300X dense as printed."""
    b200, gb200, mi = catalog.gpu("b200-sxm-180gb"), catalog.gpu("b200-gb200-186gb"), catalog.gpu("mi300x-oam-192gb")
    assert b200.peak_tflops["bf16"] == 36_000 / 2 / 8 and b200.peak_tflops["fp8"] == 72_000 / 2 / 8
    assert (b200.hbm_gb, b200.hbm_bandwidth_tb_per_s) == (1440 / 8, 64 / 8)
    assert gb200.peak_tflops["bf16"] == 360_000 / 2 / 72 and round(13_400 / 72) == gb200.hbm_gb
    assert (mi.peak_tflops["bf16"], mi.peak_tflops["fp8"], mi.hbm_gb, mi.sms) == (1307.4, 2614.9, 192, 304)
    for name in ("b200-sxm-180gb", "b200-gb200-186gb", "mi300x-oam-192gb"):
        assert "https://" in catalog.entry("gpu", name)["source"]
    for name in ("dgx-b200", "gb200-nvl72-tray", "mi300x-azure-nd-v5"):
        assert "https://" in catalog.entry("node", name)["source"]


def test_gb200_nvl72_is_one_nvlink_domain_of_72_gpus_across_trays():
    """18 trays of 4 GPUs make one rack: ranks 0..71 share NVLink domain 0, rank 72 (tray 18,
    the next rack) is in domain 1; a tp 8 group crossing trays 1 and 2 rides NVLink, a
    dp_shard group spanning both racks the network."""
    from meshplan.config import config_from_dict
    from meshplan.plan import build_plan

    cl = catalog.system("gb200-nvl72-tray", 36)
    assert cl.node.gpus == 4 and cl.node.nvlink_domain_gpus == 72 and cl.world == 144
    plan = build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "gb200-nvl72-tray", "nodes": 36},
        "training": {"global_batch": 144, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3"},
        "mesh": {"names": ["dp_shard", "tp"], "shape": [18, 8]}}))
    assert list(plan.placement.domain[[0, 71, 72, 143]]) == [0, 0, 1, 1]
    assert list(plan.placement.node[[4, 11]]) == [1, 2]
    paths = {(r.axis, r.path.kind) for r in plan.stage(0).collectives}
    assert ("tp", "nvlink") in paths and ("dp_shard", "network") in paths
    assert ("tp", "network") not in paths


def test_mi300x_node_uses_rccl_timed_as_nccl_not_as_gloo():
    from meshplan.comm.nccl_algorithms import collective_time

    cl = catalog.system("mi300x-azure-nd-v5", 2)
    assert cl.collective_library == "rccl" and catalog.system("dgx-b200", 1).collective_library == "nccl"
    args = ("all-reduce", 8, 1 << 28, cl.node.fabric.bandwidth_bytes_per_s, "nvlink")
    assert collective_time(*args, library="rccl") == collective_time(*args, library="nccl")
    assert collective_time(*args, library="rccl") != collective_time(*args, library="gloo")


def test_catalog_command_prints_each_entrys_values(capsys):
    """`meshplan catalog gpu` gives the values beside the sources (a new user found only prose):
    H100 SXM5 from its datasheet, 989.4 dense bf16 TFLOP/s, 80 GB at 3.35 TB/s, 132 SMs."""
    from meshplan.cli import main
    with pytest.raises(SystemExit) as e:
        main(["catalog", "gpu"])
    out = capsys.readouterr().out.splitlines()
    assert e.value.code in (0, None)
    line = next(x for x in out if x.startswith("h100-sxm5-80gb: "))
    assert "peak_tflops {bf16 989.4, fp16 989.4, fp8 1978.9" in line
    assert "hbm_gb 80; hbm_bandwidth_tb_per_s 3.35; sms 132" in line
    assert out[out.index(line) + 1].startswith("  source: NVIDIA H100 Tensor Core GPU datasheet")
