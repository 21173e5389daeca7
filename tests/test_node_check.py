"""nc61 #4: a node written whole with NICs that contradict its GPUs and sockets gets one
``warning:`` line per finding from plan, step and place (placement/node_check.py), not an error.

The node by hand (the trial's m2.toml): 8 GPUs, sockets 0 = GPUs 0-3, 1 = GPUs 4-7; four NICs
mlx5_0 gpus [0, 1] socket 0, mlx5_1 [2, 3] socket 0, mlx5_2 [4, 5] socket 1, mlx5_3 [3, 6] socket 1.
So: GPU 3 is under mlx5_1 and mlx5_3, whose lists differ ([2, 3] against [3, 6]); GPU 7 is under
no NIC (listed: 0-6); mlx5_3 says socket 1 but GPU 3 is on socket 0 (GPU 6 on 1: only 0 is
named). Rails 0-3 and one rate: nothing else."""

import copy

import pytest

from meshplan.catalog import node
from meshplan.placement.node_check import node_warnings
from tests.cli_run import run_cli

NICS = [{"name": "mlx5_0", "rate_gbit_per_s": 400.0, "gpus": [0, 1], "rail": 0, "socket": 0},
        {"name": "mlx5_1", "rate_gbit_per_s": 400.0, "gpus": [2, 3], "rail": 1, "socket": 0},
        {"name": "mlx5_2", "rate_gbit_per_s": 400.0, "gpus": [4, 5], "rail": 2, "socket": 1},
        {"name": "mlx5_3", "rate_gbit_per_s": 400.0, "gpus": [3, 6], "rail": 3, "socket": 1}]

M2 = [
    "warning: cluster.node.nics: GPU 3 is under mlx5_1 (gpus [2, 3]) and mlx5_3 (gpus [3, 6]), which list "
    "different GPUs; a GPU is under one PCIe switch: check each NIC's gpus (nvidia-smi topo -m: PIX/PXB)",
    "warning: cluster.node.nics: GPU 7 is under no NIC, so it shares a NIC of its socket (or has none); check each "
    "NIC's gpus (nvidia-smi topo -m: the NIC under each GPU's PCIe switch)",
    "warning: cluster.node.nics.3 (mlx5_3): socket 1, but its gpus [3, 6] are on socket 0 (cluster.node.sockets); "
    "check its socket (nvidia-smi topo -m: NUMA Affinity) and gpus",
]


def _node(nics):
    return {"name": "hgx-h100-4nic", "gpus": 8, "source": "test", "nvlink_domain_gpus": 8,
            "fabric": {"name": "nvlink4", "bandwidth_gb_per_s": 450.0, "latency_us": 3.4},
            "pcie": {"name": "pcie5", "bandwidth_gb_per_s": 63.0, "latency_us": 5.7},
            "sockets": [{"gpus": [0, 1, 2, 3], "cores": 56}, {"gpus": [4, 5, 6, 7], "cores": 56}], "nics": nics}


def _toml(tmp_path, nics) -> str:
    def nic(n):
        return "{ " + ", ".join(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"'
                                for k, v in n.items()) + " }"
    text = f"""[model]
catalog = "llama3-8b"
[cluster]
nodes = 4
gpu = "h100-sxm5-80gb"
network = "superpod-ndr-su32"
[cluster.node]
name = "hgx-h100-4nic"
gpus = 8
source = "test"
nvlink_domain_gpus = 8
fabric = {{ name = "nvlink4", bandwidth_gb_per_s = 450.0, latency_us = 3.4 }}
pcie = {{ name = "pcie5", bandwidth_gb_per_s = 63.0, latency_us = 5.7 }}
busbw = {{ nvlink = "h100-nvlink4-ring" }}
sockets = [{{ gpus = [0, 1, 2, 3], cores = 56 }}, {{ gpus = [4, 5, 6, 7], cores = 56 }}]
nics = [{", ".join(nic(n) for n in nics)}]
[training]
global_batch = 64
seq_len = 8192
micro_batch = 1
sharding = "zero3"
recompute = "full"
[mesh]
names = ["dp_shard", "tp"]
shape = [8, 4]
"""
    path = tmp_path / "m.toml"
    path.write_text(text)
    return str(path)


def test_the_trial_node_gets_one_warning_per_finding():
    assert node_warnings(_spec(NICS)) == M2


@pytest.mark.parametrize("cmd", ["plan", "place"])
def test_plan_and_place_print_them_once_and_still_plan(cmd, tmp_path, capsys):
    rc, out, err = run_cli([cmd, _toml(tmp_path, NICS)], capsys)
    assert rc == 0, err  # a warning, not an error: real nodes can be odd
    said = [ln for ln in (out + err).splitlines() if ln.startswith("warning: cluster.node.nics")]
    assert said == M2


def test_rail_beyond_the_nics_and_mixed_rates(tmp_path, capsys):
    """m4.toml: rail 7 on a 4-NIC node (rails 0-3); m3.toml: mlx5_0 at 50 Gb/s beside three at 400
    (a Gb/s vs GB/s slip: 400 Gb/s = 50 GB/s). The consistent node (GPU pairs, sockets right) warns
    of nothing else."""
    good = copy.deepcopy(NICS)
    good[3]["gpus"] = [6, 7]
    assert node_warnings(_spec(good)) == []
    odd = copy.deepcopy(good)
    odd[3]["rail"], odd[0]["rate_gbit_per_s"] = 7, 50.0
    assert node_warnings(_spec(odd)) == [
        "warning: cluster.node.nics.3 (mlx5_3): rail 7, but the node has 4 NICs (rails 0-3 in a rail-optimized "
        "fabric: NIC k on leaf k); check its rail",
        "warning: cluster.node.nics: rates differ, mlx5_0 50 Gb/s against 400 Gb/s for the 3 others; the catalog's "
        "nic curve is read against the first NIC's rate: check rate_gbit_per_s (ibstat's Rate, in Gb/s)"]
    rc, _, err = run_cli(["step", _toml(tmp_path, odd)], capsys)
    assert rc == 0 and err.count("warning: cluster.node.nics") == 2


def test_shared_nics_of_one_switch_are_not_warned():
    """DGX A100 (nodes.toml): GPUs 0-1 under both mlx5_0 and mlx5_1, the same list for both (one PCIe
    switch with two NICs): no warning, nor on any other catalog node."""
    a100 = node("dgx-a100")
    assert [n.gpus for n in a100.nics if 0 in n.gpus] == [[0, 1], [0, 1]]
    from meshplan import catalog
    assert {n: node_warnings(node(n)) for n in catalog.names("node") if node_warnings(node(n))} == {}


def _spec(nics):
    from meshplan.spec.cluster import NodeSpec
    return NodeSpec(**_node(nics))
