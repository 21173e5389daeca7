"""Placement: rank -> GPU/socket/cores/NIC/rail, group locality per axis, placement flags.

Expected values are worked out by hand from the cluster drawn in each test (case C3 of
shared/cases/handed-cases.md, the seed's 8 x 8 worked example, NVIDIA/nccl issue 1405's
GPU/NIC affinity table), plus a slow per-rank oracle built on NodeSpec.socket_of/nic_of.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from meshplan.errors import ConfigError
from meshplan.mesh.resolve import resolve_mesh
from meshplan.placement.assign import axis_locality, core_table, group_locality, place, rank_row
from meshplan.placement.flags import placement_flags
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.mesh import MeshSpec

GPU = {"name": "h100", "peak_tflops": {"bf16": 989.0}, "hbm_gb": 80.0,
       "hbm_bandwidth_tb_per_s": 3.35, "sms": 132, "source": "test"}
NVLINK = {"name": "nvlink4", "bandwidth_gb_per_s": 450.0, "latency_us": 3.4}
PCIE = {"name": "pcie5", "bandwidth_gb_per_s": 63.0, "latency_us": 5.7}
TWO_SOCKETS = [{"gpus": [0, 1, 2, 3], "cores": 56}, {"gpus": [4, 5, 6, 7], "cores": 56}]


def nic(name, gpus, socket, rail):
    return {"name": name, "rate_gbit_per_s": 400.0, "gpus": gpus, "socket": socket, "rail": rail}


NIC_PER_GPU = [nic(f"mlx5_{g}", [g], g // 4, g) for g in range(8)]  # DGX H100 style, rail = GPU
TWO_NICS = [nic("nic0", [0, 1, 2, 3], 0, 0), nic("nic1", [4, 5, 6, 7], 1, 1)]  # the seed's node


def cluster(nodes, nics=NIC_PER_GPU, gpus=8, sockets=TWO_SOCKETS, fabric=NVLINK, domain=0):
    node = {"name": "node", "gpus": gpus, "fabric": fabric, "pcie": PCIE, "sockets": sockets,
            "nics": nics, "nvlink_domain_gpus": domain}
    return ClusterSpec(gpu=GPU, node=node, nodes=nodes)


def mesh(names, shape, world=None):
    return resolve_mesh(MeshSpec(names=list(names), shape=list(shape)), world=world or int(np.prod(shape)))


def by_axis(flags):
    out = {}
    for f in flags:
        out.setdefault(f.axis, []).append(f)
    return out


# --------------------------------------------------------------------------- place()


def test_default_node_major():
    p = place(cluster(2), 16)
    assert p.node.tolist() == [0] * 8 + [1] * 8
    assert p.local_gpu.tolist() == list(range(8)) * 2
    assert p.socket.tolist() == ([0] * 4 + [1] * 4) * 2
    assert p.nic.tolist() == list(range(8)) * 2 and p.rail.tolist() == list(range(8)) * 2
    assert p.domain.tolist() == p.node.tolist()
    with pytest.raises(ValueError):
        p.node[0] = 1  # read-only arrays


def test_cores_split_evenly_per_socket():
    # 56 cores per socket, 4 GPUs each: 14 cores per GPU; socket 1 starts at core 56.
    first, last = core_table(cluster(1).node)
    assert first.tolist() == [0, 14, 28, 42, 56, 70, 84, 98]
    assert last.tolist() == [13, 27, 41, 55, 69, 83, 97, 111]
    # 38 cores / 4 GPUs: 9 each, cores 36-37 left free; 3 cores for 4 GPUs: shared single cores.
    odd = cluster(1, sockets=[{"gpus": [0, 1, 2, 3], "cores": 38}, {"gpus": [4, 5, 6, 7], "cores": 3}])
    first, last = core_table(odd.node)
    assert first.tolist() == [0, 9, 18, 27, 38, 38, 39, 40]
    assert last.tolist() == [8, 17, 26, 35, 38, 38, 39, 40]


def test_seed_rank_29_row():
    # Seed: 8 nodes x 8 GPUs, NIC 0 under GPUs 0-3 (socket 0, rail 0), NIC 1 under 4-7.
    p = place(cluster(8, TWO_NICS), 64)
    assert rank_row(p, 29) == {"rank": 29, "node": 3, "gpu": 5, "socket": 1, "cores": "70-83",
                               "nic": "nic1", "rail": 1}
    assert p.row(0)["cores"] == "0-13"
    with pytest.raises(ConfigError):
        rank_row(p, 64)


def test_node_without_nics():
    p = place(cluster(2, nics=[]), 16)
    assert p.nic.tolist() == [-1] * 16 and p.rail.tolist() == [-1] * 16
    assert rank_row(p, 3)["nic"] == "-" and rank_row(p, 3)["rail"] is None


def test_nccl_1405_nic_affinity():
    # nvidia-smi topo of NVIDIA/nccl#1405: GPUs 0-3 (NUMA 0, cores 0-37) are PIX with NICs
    # 1,3,4,5; GPUs 4-7 (NUMA 1, cores 38-75) with NICs 0,2,6,7. One NIC per GPU, NIC k on rail k.
    pairs = {0: 1, 1: 3, 2: 4, 3: 5, 4: 0, 5: 2, 6: 6, 7: 7}
    gpu_of = {n: g for g, n in pairs.items()}
    nics = [nic(f"NIC{k}", [gpu_of[k]], 0 if gpu_of[k] < 4 else 1, k) for k in range(8)]
    sockets = [{"gpus": [0, 1, 2, 3], "cores": 38}, {"gpus": [4, 5, 6, 7], "cores": 38}]
    p = place(cluster(2, nics, sockets=sockets), 16)
    assert p.nic[:8].tolist() == [1, 3, 4, 5, 0, 2, 6, 7]
    assert p.nic[8:].tolist() == [1, 3, 4, 5, 0, 2, 6, 7]
    assert rank_row(p, 9) == {"rank": 9, "node": 1, "gpu": 1, "socket": 0, "cores": "9-17",
                              "nic": "NIC3", "rail": 3}
    assert rank_row(p, 12) == {"rank": 12, "node": 1, "gpu": 4, "socket": 1, "cores": "38-46",
                               "nic": "NIC0", "rail": 0}
    # corresponding GPUs across nodes share a rail even though NIC index != GPU index
    loc = group_locality(p, np.array([[g, g + 8] for g in range(8)]))
    assert loc.rail_aligned and loc.max_rails == 1
    # GPU 0 (NIC1) with GPU 4 (NIC0) of the other node: two rails
    assert not group_locality(p, np.array([[0, 12]])).rail_aligned


def test_explicit_rank_to_gpu_moves_ranks():
    # rank r -> GPU (r % 2) * 8 + r // 2: ranks alternate nodes.
    perm = [(r % 2) * 8 + r // 2 for r in range(16)]
    p = place(cluster(2), 16, perm)
    assert p.node[:4].tolist() == [0, 1, 0, 1] and p.local_gpu[:4].tolist() == [0, 0, 1, 1]
    assert rank_row(p, 3)["node"] == 1 and rank_row(p, 3)["gpu"] == 1
    m = mesh(("pp", "dp", "tp"), (2, 1, 8))  # TP(0) = [0..7]: nodes 0,1,0,1,... now
    loc = axis_locality(m, p)["tp"]
    assert loc.link == "network" and loc.max_nodes == 2 and loc.max_per_node == 4
    assert [f.severity for f in placement_flags(m, p) if f.axis == "tp"] == ["fault"]
    # a subset: 4 ranks on node 1's GPUs 0-3
    q = place(cluster(2), 4, [8, 9, 10, 11])
    assert q.node.tolist() == [1, 1, 1, 1] and q.local_gpu.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("perm, words", [
    ([0, 1, 2], "3 entries for world 4"),
    ([0, 1, 2, 2], "both map to GPU 2"),
    ([0, 1, 2, 16], "GPU 16 is outside 0..15"),
    ([0, -1, 2, 3], "GPU -1 is outside"),
    ([0.0, 1.0, 2.0, 3.0], "integers"),
])
def test_bad_rank_to_gpu(perm, words):
    with pytest.raises(ConfigError) as err:
        place(cluster(2), 4, perm)
    assert err.value.field == "mesh.rank_to_gpu" and words in str(err.value)
    assert "\n" not in str(err.value)


def test_world_larger_than_cluster():
    with pytest.raises(ConfigError) as err:
        place(cluster(2), 32)
    assert "32" in str(err.value) and "16" in str(err.value)
    with pytest.raises(ConfigError):
        place(cluster(2), 0)


# --------------------------------------------------------------------------- C3


def test_c3_dp_tp_pp_tp_spans_nodes():
    m, p = mesh(("dp", "tp", "pp"), (1, 8, 2)), place(cluster(2), 16)
    assert m.group_of(0, "tp") == [0, 2, 4, 6, 8, 10, 12, 14]
    loc = axis_locality(m, p)
    assert (loc["tp"].link, loc["tp"].max_nodes, loc["tp"].max_per_node) == ("network", 2, 4)
    assert loc["tp"].leaves_node and loc["tp"].max_rails == 4  # local GPUs 0,2,4,6 on both nodes
    assert loc["pp"].link == "nvlink" and m.group_of(0, "pp") == [0, 1]
    tp = by_axis(placement_flags(m, p))["tp"]
    assert len(tp) == 1 and tp[0].severity == "fault"
    assert tp[0].message.startswith("tp groups span 2 nodes: tp collectives run every layer over the network")
    assert "tp(0) = [0,2,4,6,8,10,12,14]" in tp[0].message and "tp 8 fits in one 8-GPU node" in tp[0].message


def test_c3_pp_dp_tp_tp_inside_node():
    m, p = mesh(("pp", "dp", "tp"), (2, 1, 8)), place(cluster(2), 16)
    assert m.group_of(0, "tp") == list(range(8)) and m.group_of(0, "pp") == [0, 8]
    loc = axis_locality(m, p)
    assert loc["tp"].link == "nvlink" and not loc["tp"].leaves_node
    assert loc["tp"].crosses_sockets  # GPUs 0-7 span both sockets, but NVLink carries it
    assert loc["pp"].link == "network" and loc["pp"].rail_aligned  # [g, g+8]: same rail g
    flags = placement_flags(m, p)
    assert [(f.axis, f.severity) for f in flags] == [("pp", "info")]
    assert flags[0].message.startswith("pp groups span 2 nodes")


def test_c3_dp2_tp4_pp2():
    m, p = mesh(("pp", "dp", "tp"), (2, 2, 4)), place(cluster(2), 16)
    assert m.group_of(0, "tp") == [0, 1, 2, 3]
    assert m.group_of(0, "dp") == [0, 4]
    assert m.group_of(0, "pp") == [0, 8]
    loc = axis_locality(m, p)
    assert loc["tp"].link == "nvlink" and not loc["tp"].crosses_sockets  # GPUs 0-3: socket 0
    assert loc["dp"].link == "nvlink" and loc["dp"].crosses_sockets  # [0, 4]: sockets 0 and 1
    assert [f.severity for f in placement_flags(m, p)] == ["info"]


def test_c3_hsdp():
    m, p = mesh(("dp_replicate", "dp_shard"), (2, 8)), place(cluster(2), 16)
    assert m.group_of(9, "dp_shard") == list(range(8, 16))
    assert m.group_of(9, "dp_replicate") == [1, 9]
    loc = axis_locality(m, p)
    assert loc["dp_shard"].link == "nvlink"
    assert loc["dp_replicate"].link == "network" and loc["dp_replicate"].rail_aligned
    # derived batch axis: every node holds members on all 8 rails, the same on both nodes
    assert loc["dp"].link == "network" and loc["dp"].rail_aligned
    assert placement_flags(m, p) == []  # derived dp carries no gradient traffic: not flagged


def test_c3_hsdp_swapped_shard_crosses_nodes():
    m, p = mesh(("dp_shard", "dp_replicate"), (8, 2)), place(cluster(2), 16)
    assert m.group_of(9, "dp_shard") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert m.group_of(9, "dp_replicate") == [8, 9]
    loc = axis_locality(m, p)
    assert loc["dp_shard"].link == "network" and loc["dp_shard"].max_per_node == 4
    shard = by_axis(placement_flags(m, p, example_rank=9))["dp_shard"]
    # crossing nodes is the error; both nodes hold members on rails {1,3,5,7}, so the rings
    # stay rail-aligned and no rail warning is added
    assert [f.severity for f in shard] == ["fault"]
    assert shard[0].message.startswith(
        "dp_shard(9) = [1,3,5,7,9,11,13,15] crosses nodes on every layer's all-gather")
    assert "dp_shard 8 fits in one 8-GPU node: move dp_replicate outside dp_shard" in shard[0].message
    # without an example rank the first offending group is named
    first = by_axis(placement_flags(m, p))["dp_shard"][0]
    assert first.message.startswith("dp_shard(0) = [0,2,4,6,8,10,12,14]")


ZERO1 = "each step's gradient reduce-scatter and parameter all-gather (zero1: once per step, not per layer)"
ZERO2 = ("every micro-batch's gradient reduce-scatter and each step's parameter all-gather (zero2: parameters "
         "gathered once per step, not per layer)")


@pytest.mark.parametrize("sharding,engine,words", [
    ("zero1", "megatron", ZERO1), ("zero2", "megatron", ZERO2),
    ("zero2", "deepspeed", ZERO2.replace("reduce-scatter", "all-reduce")),
    ("zero3", "megatron", "every layer's all-gather"), ("hsdp", "megatron", "every layer's all-gather")])
def test_shard_fault_names_the_collectives_of_its_sharding(sharding, engine, words):
    """dp_shard 8 outside pp 2 on two 8-GPU nodes: DP_SHARD(0) = [0,2,...,14] crosses nodes
    although dp_shard 8 fits one node. What crosses follows the sharding (meshplan.comm.dp_rows):
    FSDP (zero3, hsdp) gathers every layer's parameters; zero1 reduces the gradients and gathers
    the updated parameters once per step, zero2 reduces every micro-batch (DeepSpeed's engine by
    bucket all-reduces) and gathers once per step."""
    from meshplan.spec.training import TrainingSpec

    t = TrainingSpec(global_batch=16, seq_len=8, micro_batch=1, sharding=sharding, zero12_engine=engine)
    m, p = mesh(("dp_shard", "pp"), (8, 2)), place(cluster(2), 16)
    (f,) = by_axis(placement_flags(m, p, training=t))["dp_shard"]
    assert (f.severity, f.message) == ("fault", f"dp_shard(0) = [0,2,4,6,8,10,12,14] crosses nodes on {words}; "
                                                "dp_shard 8 fits in one 8-GPU node: move pp outside dp_shard")


def test_shard_rail_warning_names_the_collectives_of_its_sharding():
    """dp_shard 2 x tp 8 with ranks 8 and 9 swapped: DP_SHARD(0) = [0,8] on GPUs 0 and 9, rails
    0 and 1, as DP_SHARD(1) = [1,9] on rails 1 and 0: 2 of the 8 groups cross rails."""
    from meshplan.spec.training import TrainingSpec

    m = mesh(("dp_shard", "tp"), (2, 8))
    p = place(cluster(2), 16, list(range(8)) + [9, 8] + list(range(10, 16)))
    rail = "dp_shard group of rank 0 = [0,8] uses rails {0,1}: 2 of 8 groups cross rails on WORDS; place members on the " \
           "same local GPU indices on every node"
    for sharding, words in (("zero1", ZERO1), ("zero3", "every layer's all-gather and reduce-scatter")):
        t = TrainingSpec(global_batch=16, seq_len=8, micro_batch=1, sharding=sharding)
        assert [f.message for f in placement_flags(m, p, training=t)] == [rail.replace("WORDS", words)]


def test_plan_flags_follow_the_configs_sharding():
    """build_plan passes [training] to the flags: a zero1 config's dp_shard fault says once per step."""
    from meshplan.config import config_from_dict
    from meshplan.plan import build_plan

    def flags(sharding):
        cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                                "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1,
                                             "sharding": sharding},
                                "mesh": {"names": ["dp_shard", "pp"], "shape": [8, 2]}})
        return [f.message for f in build_plan(cfg).flags if f.axis == "dp_shard"]

    tail = "; dp_shard 8 fits in one 8-GPU node: move pp outside dp_shard"
    assert flags("zero1") == [f"dp_shard(0) = [0,2,4,6,8,10,12,14] crosses nodes on {ZERO1}{tail}"]
    assert flags("zero3") == [f"dp_shard(0) = [0,2,4,6,8,10,12,14] crosses nodes on every layer's all-gather{tail}"]


# --------------------------------------------------------------------------- seed 8 x 8


def test_seed_dp_shard8_tp8_two_rails():
    m, p = mesh(("dp_shard", "tp"), (8, 8)), place(cluster(8, TWO_NICS), 64)
    loc = axis_locality(m, p)
    assert loc["tp"].link == "nvlink" and loc["tp"].max_rails == 2
    shard = loc["dp_shard"]
    assert (shard.link, shard.max_nodes, shard.max_per_node, shard.max_rails) == ("network", 8, 1, 1)
    assert shard.rail_aligned
    groups = m.groups("dp_shard")
    assert groups[5].tolist() == [5, 13, 21, 29, 37, 45, 53, 61]
    rails = p.rail[groups]
    assert rails[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # group j = tp index j
    assert np.bincount(rails[:, 0]).tolist() == [4, 4]  # the 8 groups split 4/4 over two NICs
    # dp_shard 8 * tp 8 = 64 > 8: crossing nodes is capacity, not order; on-rail: no flag
    assert placement_flags(m, p) == []


def test_seed_swapped_order_is_flagged():
    m, p = mesh(("tp", "dp_shard"), (8, 8)), place(cluster(8, TWO_NICS), 64)
    flags = by_axis(placement_flags(m, p))
    assert flags["tp"][0].severity == "fault" and "tp groups span 8 nodes" in flags["tp"][0].message
    assert "dp_shard" not in flags  # [0..7] within node 0


# --------------------------------------------------------------------------- other rules


def test_tp_larger_than_node_is_warning():
    m, p = mesh(("dp", "tp"), (1, 16)), place(cluster(2), 16)
    (f,) = placement_flags(m, p)
    assert (f.axis, f.severity) == ("tp", "warn") and "tp 16 > 8 GPUs per node" in f.message


def test_cp_out_of_node_counts_all_per_layer_axes():
    # tp 4 * cp 2 = 8 fits one node, but (cp, dp, tp) puts CP(0) = [0, 8] across nodes.
    m, p = mesh(("cp", "dp", "tp"), (2, 2, 4)), place(cluster(2), 16)
    assert m.group_of(0, "cp") == [0, 8]
    cp = by_axis(placement_flags(m, p))["cp"]
    assert cp[0].severity == "fault" and "tp 4 * cp 2 = 8 fits in one 8-GPU node" in cp[0].message


def test_socket_crossing_on_pcie_node():
    pcie_only = cluster(1, fabric={"name": "pcie5", "bandwidth_gb_per_s": 63.0, "latency_us": 5.7})
    p = place(pcie_only, 8)
    bad = mesh(("tp", "dp"), (2, 4))  # TP(0) = [0, 4]: socket 0 and socket 1
    (f,) = placement_flags(bad, p)
    assert (f.axis, f.severity) == ("tp", "warn")
    assert f.message.startswith("tp(0) = [0,4] spans sockets [0, 1]") and "every layer" in f.message
    assert placement_flags(mesh(("dp", "tp"), (4, 2)), p) == []  # TP(0) = [0, 1]: one socket
    assert placement_flags(bad, place(cluster(1), 8)) == []  # NVLink node: sockets do not matter


def test_sp_user_axis_is_per_layer():
    m, p = mesh(("sp", "dp"), (2, 8)), place(cluster(2), 16)  # SP(0) = [0, 8]
    assert [f.severity for f in by_axis(placement_flags(m, p))["sp"]] == ["fault"]


def test_expert_axes():
    # world 16, dp_shard 4, tp 4 (block 16), ep 8 -> efsdp 2: EP(0) = [0..7], efsdp(0) = [0, 8]
    m = resolve_mesh(MeshSpec(names=["dp_shard", "tp", "ep"], shape=[4, 4, 8]), world=16)
    p = place(cluster(2), 16)
    loc = axis_locality(m, p)
    assert m.group_of(0, "ep") == list(range(8)) and m.group_of(0, "efsdp") == [0, 8]
    assert loc["ep"].link == "nvlink" and loc["efsdp"].rail_aligned
    flags = by_axis(placement_flags(m, p))
    assert "ep" not in flags and "efsdp" not in flags
    # [0,4,8,12]: rails {0,4} on each of the two nodes: each ring channel stays on one rail
    assert "dp_shard" not in flags


# --------------------------------------------------------------------------- NVLink domains


def test_nvl72_domain_spans_nodes():
    # GB200 NVL72-like: 4 GPUs per node, 72-GPU NVLink domain = 18 nodes; 36 nodes = 2 domains.
    sockets = [{"gpus": [0, 1], "cores": 36}, {"gpus": [2, 3], "cores": 36}]
    nics = [nic(f"mlx5_{g}", [g], g // 2, g) for g in range(4)]
    c = cluster(36, nics, gpus=4, sockets=sockets, domain=72)
    p = place(c, 144)
    assert p.domain[[0, 71, 72, 143]].tolist() == [0, 0, 1, 1]
    m = mesh(("dp_shard", "tp"), (18, 8))
    loc = axis_locality(m, p)
    assert loc["tp"].leaves_node and loc["tp"].max_nodes == 2 and loc["tp"].link == "nvlink"
    assert loc["dp_shard"].link == "network" and loc["dp_shard"].max_domains == 2
    flags = by_axis(placement_flags(m, p))
    assert "tp" not in flags  # inside one NVLink domain although it spans 2 nodes
    # groups that leave nodes but stay in a domain are rail-ok; TP(0) uses rails {0..3}
    assert loc["tp"].max_rails == 4 and loc["tp"].rail_aligned
    bad = mesh(("tp", "dp_shard"), (2, 72))  # TP(0) = [0, 72]: two domains
    (f,) = placement_flags(bad, p)
    assert f.severity == "fault" and f.message.startswith("tp groups span 2 NVLink domains")
    assert "tp 2 fits in one 72-GPU NVLink domain" in f.message


# --------------------------------------------------------------------------- oracle, scale


def slow_locality(c: ClusterSpec, p, groups):
    """Per-group loop straight from NodeSpec: nodes, per-node max, sockets, rails."""
    node = c.node
    out = []
    for g in groups.tolist():
        where = [(p.global_gpu[r] // node.gpus, p.global_gpu[r] % node.gpus) for r in g]
        nodes = {n for n, _ in where}
        socks = {(n, node.socket_of(l)) for n, l in where}
        nic = [node.nic_of(l) for _, l in where]
        rails = [node.nics[i].rail for i in nic if i is not None]
        per_node = {k: sorted(node.nics[nic[j]].rail for j, (n, _) in enumerate(where) if n == k) for k in nodes}
        same = len({tuple(v) for v in per_node.values()}) == 1  # every node on the same rails
        out.append((len(nodes), max(sum(1 for n, _ in where if n == k) for k in nodes),
                    len(socks) > len(nodes), len(set(rails)), len(nodes) == 1 or len(set(rails)) == 1 or same))
    return out


@pytest.mark.parametrize("shape", [(2, 2, 4), (4, 2, 2), (1, 4, 4), (2, 8, 1), (16, 1, 1)])
def test_vectorised_matches_loop(shape):
    nics = [nic("nic0", [0, 1], 0, 0), nic("nic1", [2, 3], 1, 1)]
    c = cluster(4, nics, gpus=4, sockets=[{"gpus": [0, 1], "cores": 8}, {"gpus": [2, 3], "cores": 8}])
    perm = np.random.default_rng(sum(shape)).permutation(16)
    for names in itertools.permutations(("pp", "dp_shard", "tp")):
        m = mesh(names, shape)
        for p in (place(c, 16), place(c, 16, perm.tolist())):
            for axis in m.all_axes():
                loc = group_locality(p, m.groups(axis))
                got = list(zip(loc.nodes.tolist(), loc.per_node.tolist(), loc.cross_socket.tolist(),
                               loc.rails.tolist(), loc.rail_ok.tolist()))
                assert got == slow_locality(c, p, m.groups(axis))


@pytest.mark.timeout(60)
def test_16384_ranks_runs():
    p = place(cluster(2048), 16384)
    m = mesh(("pp", "dp_shard", "tp"), (16, 128, 8))
    loc = axis_locality(m, p)
    assert loc["tp"].link == "nvlink" and loc["dp_shard"].rail_aligned
    assert loc["dp_shard"].max_nodes == 128 and loc["pp"].max_nodes == 16
    assert [f.axis for f in placement_flags(m, p)] == ["pp"]


def test_mesh_world_must_match():
    with pytest.raises(ConfigError):
        placement_flags(mesh(("dp", "tp"), (2, 4)), place(cluster(2), 16))


def test_rail_rule_same_rails_on_every_node():
    """A data group with several members per node is rail-aligned when every node holds its
    members on the same rails; a swapped GPU on one node breaks that and is warned."""
    from meshplan import catalog
    c = catalog.system("dgx-h100", nodes=2)
    m = mesh(("dp_shard", "tp"), (4, 4))  # dp_shard(0) = [0,4,8,12]: rails {0,4} on both nodes
    assert axis_locality(m, place(c, 16))["dp_shard"].rail_aligned
    assert "dp_shard" not in by_axis(placement_flags(m, place(c, 16)))
    perm = list(range(16))
    perm[8], perm[9] = perm[9], perm[8]  # rank 8 on node 1's GPU 1: rails {0,4} vs {1,4}
    warn = by_axis(placement_flags(m, place(c, 16, perm)))["dp_shard"]
    assert warn[0].severity == "warn" and "uses rails {0,1,4}" in warn[0].message
