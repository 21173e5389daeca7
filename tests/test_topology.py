"""Topology input: nvidia-smi topo -m and NCCL's topology XML into a NodeSpec.

The files under tests/data/topo/ are written in the real formats (nvidia-smi: tab-separated
matrix, " X " on the diagonal, CPU/NUMA affinity columns, legend and NIC legend; NCCL:
<system><cpu numaid affinity=cpumask><pci busid><gpu dev>/<nic><net name dev speed>):

- dgx-h100-like: 8 GPUs on NV18; 12 mlx5 devices of which 8 compute NICs, one per GPU under
  its PCIe switch (GPU 0 mlx5_0, 1 mlx5_3, 2 mlx5_4, 3 mlx5_5, 4 mlx5_6, 5 mlx5_9, 6 mlx5_10,
  7 mlx5_11, as in the DGX H100 user guide) and storage NICs on their own root ports; GPUs
  0-3 on NUMA 0 (CPUs 0-55,112-167), 4-7 on NUMA 1 (56-111,168-223).
- seed-8gpu-2nic: the seed's node: NIC mlx5_0 behind the switch tree of GPUs 0-3 (PXB),
  mlx5_1 of GPUs 4-7.
- nccl-1405: the layout of NVIDIA/nccl issue 1405: one switch per socket, GPUs 0-3 with
  NICs 1, 3, 4, 5 and GPUs 4-7 with NICs 0, 2, 6, 7 (PIX); CPUs 0-37,76-113 / 38-75,114-151.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.catalog import node
from meshplan.errors import ConfigError
from meshplan.spec.cluster import NodeSpec
from meshplan.placement.topology import load_topology, parse_nccl_topo_xml, parse_nvidia_smi_topo
from meshplan.placement.topology_node import check_identity_nic_map, node_from_topology

DATA = Path(__file__).parent / "data" / "topo"
DGX_NICS = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]
NCCL_1405 = {0: "mlx5_1", 1: "mlx5_3", 2: "mlx5_4", 3: "mlx5_5", 4: "mlx5_0", 5: "mlx5_2", 6: "mlx5_6", 7: "mlx5_7"}


def nic_names(n: NodeSpec) -> list[str]:
    return [n.nics[n.nic_of(g)].name for g in range(n.gpus)]


# --------------------------------------------------------------------------- parsing


def test_smi_dgx_matrix():
    t = load_topology(DATA / "dgx-h100-like_topo-m.txt")
    assert t.gpus == tuple(range(8)) and t.nics == tuple(f"mlx5_{k}" for k in range(12))  # NIC legend
    assert t.gpu_gpu[0] == ("X",) + ("NV18",) * 7
    assert [t.level(g, n) for g, n in enumerate(DGX_NICS)] == ["PIX"] * 8
    assert t.level(0, "mlx5_3") == "NODE" and t.level(0, "mlx5_6") == "SYS" and t.level(5, "mlx5_1") == "SYS"
    assert t.nic_nic[1][2] == "PIX" and t.nic_nic[0][11] == "SYS"
    assert len(t.gpu_cpus[0]) == 112 and t.gpu_cpus[4][0] == 56 and t.gpu_cpus[7][-1] == 223
    assert t.gpu_numa == (0,) * 4 + (1,) * 4 and t.nic_numa == (None,) * 12


def test_xml_dgx_matrix():
    t = load_topology(DATA / "dgx-h100-like_topo.xml")
    assert t.gpus == tuple(range(8))
    assert set(t.nics) == set(DGX_NICS) | {"mlx5_1", "mlx5_7"}
    assert [t.level(g, n) for g, n in enumerate(DGX_NICS)] == ["PIX"] * 8
    assert t.level(0, "mlx5_3") == "PHB" and t.level(0, "mlx5_1") == "PHB" and t.level(0, "mlx5_6") == "SYS"
    assert t.gpu_gpu[3] == ("NV18",) * 3 + ("X",) + ("NV18",) * 4  # 5+4+4+5 links to the NVSwitches
    assert t.gpu_cpus[0] == tuple(range(56)) + tuple(range(112, 168))  # from the cpumask
    assert t.nic_numa[t.nics.index("mlx5_7")] == 1
    assert t.nic_speed_gbit_per_s == (400.0,) * 10


def test_smi_space_separated_and_old_mlx_columns():
    # older drivers name the NIC columns mlx5_*; copies from web pages turn tabs into spaces
    text = """        GPU0    GPU1    mlx5_0  mlx5_1  CPU Affinity
GPU0     X      NV12    PXB     SYS     0-23,48-71
GPU1    NV12     X      SYS     PXB     24-47,72-95
mlx5_0  PXB     SYS      X      SYS
mlx5_1  SYS     PXB     SYS      X
"""
    t = parse_nvidia_smi_topo(text)
    assert t.nics == ("mlx5_0", "mlx5_1") and t.gpu_nic == (("PXB", "SYS"), ("SYS", "PXB"))
    assert t.gpu_numa == (None, None)  # no NUMA column: sockets come from the affinity sets
    n = node_from_topology(t, node("dgx-a100").model_copy(update={"gpus": 2, "sockets": [
        {"gpus": [0], "cores": 24}, {"gpus": [1], "cores": 24}]}))
    assert [(s.gpus, s.cores) for s in n.sockets] == [([0], 24), ([1], 24)]  # 48 CPUs each, SMT 2
    # rates from the base's NICs of the same name (DGX A100: 200 Gb/s HDR)
    assert [(x.name, x.gpus, x.socket, x.rate_gbit_per_s) for x in n.nics] == [
        ("mlx5_0", [0], 0, 200.0), ("mlx5_1", [1], 1, 200.0)]


@pytest.mark.parametrize("text, where, words", [
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\n", "t.txt:3", "row GPU1 has 1 cells for 2 devices"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tQPI\t X \n", "t.txt:3", "unknown connection 'QPI'"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "t.txt", "no row for GPU1"),
    ("GPU 0: NVIDIA H100\n", "t.txt", "no header line with GPU0"),
    ("\tGPU0\tCPU Affinity\nGPU0\t X \t0-7,x\n", "t.txt: GPU0 affinity", "bad CPU list '0-7,x'"),
])
def test_smi_errors(text, where, words):
    with pytest.raises(ConfigError) as err:
        parse_nvidia_smi_topo(text, source="t.txt")
    assert err.value.field == where and words in err.value.message and "\n" not in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("<system><cpu numaid='0'>", "not valid XML"),
    ("<topo/>", "root element is <topo>"),
    ("<system><cpu numaid='0' affinity='ff'/></system>", "no <gpu> element"),
    ("<system><cpu numaid='x'><gpu dev='0'/></cpu></system>", "integer 'numaid'"),
    ("<system><cpu numaid='0' affinity='zz,00'><gpu dev='0'/></cpu></system>", "bad CPU list 'zz,00'"),
])
def test_xml_errors(text, words):
    with pytest.raises(ConfigError) as err:
        parse_nccl_topo_xml(text, source="t.xml")
    assert err.value.field.startswith("t.xml") and words in err.value.message


def test_xml_speed_overrides_base_rate_and_pxb():
    # GPU 0 under sub-switch 0b, NIC under the parent switch 0a: several bridges -> PXB
    xml = """<system version="1"><cpu numaid="0" affinity="0000ffff">
      <pci busid="0000:0a:00.0" class="0x060400">
        <pci busid="0000:0b:00.0" class="0x060400"><pci busid="0000:0c:00.0" class="0x030200"><gpu dev="0"/></pci></pci>
        <pci busid="0000:0d:00.0" class="0x020700"><nic><net name="mlx5_0" dev="0" speed="200000" port="1"/></nic></pci>
      </pci></cpu></system>"""
    t = parse_nccl_topo_xml(xml)
    assert t.gpu_nic == (("PXB",),) and t.gpu_cpus[0] == tuple(range(16))
    base = node("seed-8x8-2nic").model_copy(update={"gpus": 1, "sockets": [{"gpus": [0], "cores": 8}]})
    n = node_from_topology(t, base)
    assert n.nics[0].rate_gbit_per_s == 200.0 and n.nics[0].gpus == [0] and n.sockets[0].cores == 16
    assert n.fabric == base.fabric and n.pcie == base.pcie


# --------------------------------------------------------------------------- NodeSpec


@pytest.mark.parametrize("name", ["dgx-h100-like_topo-m.txt", "dgx-h100-like_topo.xml"])
def test_dgx_node_matches_catalog(name):
    base = node("dgx-h100")
    n = node_from_topology(load_topology(DATA / name), base)
    # storage NICs drop out because the base names all compute NICs
    assert [x.name for x in n.nics] == DGX_NICS and [x.rail for x in n.nics] == list(range(8))
    assert [(x.gpus, x.socket, x.rate_gbit_per_s) for x in n.nics] == [([g], g // 4, 400.0) for g in range(8)]
    assert [(s.gpus, s.cores) for s in n.sockets] == [([0, 1, 2, 3], 56), ([4, 5, 6, 7], 56)]  # 112 CPUs, SMT 2
    assert nic_names(n) == DGX_NICS
    assert n.fabric == base.fabric and n.nvlink_domain_gpus == 8
    assert check_identity_nic_map(n) == []


def test_dgx_with_all_nics_and_explicit_list():
    t = load_topology(DATA / "dgx-h100-like_topo-m.txt")
    every = node_from_topology(t, node("seed-8x8-2nic"))  # base names nic0/nic1 are not in the topology
    # the NICs with a GPU under their switch: storage NICs mlx5_1/2 (socket 0) and mlx5_7/8 (socket 1) drop out
    assert [x.name for x in every.nics] == sorted(DGX_NICS, key=lambda n: int(n[5:]))
    assert [x.gpus for x in every.nics] == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert nic_names(every) == DGX_NICS
    two = node_from_topology(t, node("dgx-h100"), nics=["mlx5_0", "mlx5_6"])
    assert [(x.name, x.gpus, x.socket, x.rail) for x in two.nics] == [("mlx5_0", [0], 0, 0), ("mlx5_6", [4], 1, 1)]
    # GPU 1 shares no switch with either: the first NIC on its socket
    assert nic_names(two) == ["mlx5_0"] * 4 + ["mlx5_6"] * 4
    with pytest.raises(ConfigError, match="mlx5_99 not in dgx-h100-like_topo-m.txt"):
        node_from_topology(t, node("dgx-h100"), nics=["mlx5_99"])


def test_nic_names_with_long_digit_runs_sort_without_int():
    """NICs named in the topology but not in the base node are sorted naturally (mlx5_9 before
    mlx5_10) without int() of their digit runs: a 5,000-digit run raised ValueError (Python's
    4,300-digit limit), found by benchmarks/fuzz.py."""
    from meshplan.placement.topology_node import _natural
    names = ["mlx5_10", "mlx5_9", "mlx5_" + "1" + "0" * 5000, "mlx5_009"]
    assert sorted(names, key=_natural) == ["mlx5_009", "mlx5_9", "mlx5_10", names[2]]


def test_seed_two_nics_by_affinity():
    n = node_from_topology(load_topology(DATA / "seed-8gpu-2nic_topo-m.txt"), node("seed-8x8-2nic"))
    assert [(x.name, x.gpus, x.socket, x.rail) for x in n.nics] == [
        ("mlx5_0", [0, 1, 2, 3], 0, 0), ("mlx5_1", [4, 5, 6, 7], 1, 1)]
    assert nic_names(n) == ["mlx5_0"] * 4 + ["mlx5_1"] * 4
    # local_rank % 2 would send GPUs 1, 3 across the socket to mlx5_1 and 4, 6 to mlx5_0
    line = ("GPU {g}: index map gives {bad} (other socket) but the topology gives {good} (same PCIe switch); "
            "bind GPU {g} to {good}")
    assert check_identity_nic_map(n) == [line.format(g=1, bad="mlx5_1", good="mlx5_0"),
                                         line.format(g=3, bad="mlx5_1", good="mlx5_0"),
                                         line.format(g=4, bad="mlx5_0", good="mlx5_1"),
                                         line.format(g=6, bad="mlx5_0", good="mlx5_1")]


@pytest.mark.parametrize("name", ["nccl-1405_topo-m.txt", "nccl-1405_topo.xml"])
def test_nccl_1405_gpu_k_is_not_under_nic_k(name):
    t = load_topology(DATA / name)
    assert [t.level(0, f"mlx5_{k}") for k in range(8)] == ["SYS", "PIX", "SYS", "PIX", "PIX", "PIX", "SYS", "SYS"]
    n = node_from_topology(t, node("dgx-h100"))  # base: fabric only; names differ, so all 8 NICs in name order
    assert [x.name for x in n.nics] == [f"mlx5_{k}" for k in range(8)] and [x.rail for x in n.nics] == list(range(8))
    assert [x.gpus for x in n.nics] == [[4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3],
                                        [0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert [(s.gpus, s.cores) for s in n.sockets] == [([0, 1, 2, 3], 38), ([4, 5, 6, 7], 38)]
    # round-robin over the switch's NICs: GPU k is not under NIC k
    assert {g: n.nics[n.nic_of(g)].name for g in range(8)} == NCCL_1405
    flags = check_identity_nic_map(n)
    assert [f.split(":")[0] for f in flags] == ["GPU 0", "GPU 2", "GPU 4", "GPU 5"]
    assert flags[0] == ("GPU 0: index map gives mlx5_0 (other socket) but the topology gives mlx5_1 "
                        "(same PCIe switch); bind GPU 0 to mlx5_1")
    if name.endswith(".xml"):
        assert {x.rate_gbit_per_s for x in n.nics} == {200.0}  # speed="200000" Mb/s


def test_node_errors():
    t = load_topology(DATA / "nccl-1405_topo-m.txt")
    with pytest.raises(ConfigError, match="topology has GPUs .* but dgx-h100 has 4; pick a base node with 8 GPUs"):
        node_from_topology(t, node("dgx-h100").model_copy(update={"gpus": 4}))
    lone = """\tGPU0\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tSYS\t0-7\t0
NIC0\tSYS\t X

NIC Legend:

  NIC0: mlx5_0
"""
    base = node("seed-8x8-2nic").model_copy(update={"gpus": 1, "sockets": [{"gpus": [0], "cores": 8}]})
    with pytest.raises(ConfigError, match="NIC mlx5_0 is SYS to every GPU: its socket is unknown"):
        node_from_topology(parse_nvidia_smi_topo(lone), base)
    with pytest.raises(ConfigError, match="no rate for mlx5_0"):
        node_from_topology(parse_nvidia_smi_topo(lone.replace("SYS", "PIX")), base.model_copy(update={"nics": []}))
    with pytest.raises(ConfigError, match="--topology: no such file .*missing.txt"):
        load_topology(DATA / "missing.txt")
