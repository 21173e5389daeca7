"""DeepEP's RDMA sends on a rail-optimized fabric (newcomer trial 24, finding 2): a token goes over
RDMA to the GPU of the same local index on each destination node, then over NVLink inside it
(deepseek-ai/DeepEP README, "Normal kernels with NVLink and RDMA forwarding"), so its bytes stay on
the sender's rail leaf; an all-to-all's pairwise sends change rail for half of the pairs here.

A small cluster by hand: 4 nodes of 2 H100, GPU i on NIC i (400 Gb/s, rail i), one leaf (one
network tier, every node under it); DeepSeek-V2-Lite (64 experts, top-6), dp_shard 8 x ep 8, ep's
group is ranks 0-7, two on each node. Per node per call each NIC carries its GPU's NIC bytes ``b``.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.linkload import edge_loads
from meshplan.schedule.netload import network_loads
from meshplan.schedule.steptime import step_time

NODE = {"name": "two-rail", "gpus": 2, "source": "a test node",
        "fabric": {"name": "nvlink4", "bandwidth_gb_per_s": 450.0, "latency_us": 3.0},
        "pcie": {"name": "pcie5", "bandwidth_gb_per_s": 63.0, "latency_us": 5.7},
        "sockets": [{"gpus": [0, 1], "cores": 32}],
        "nics": [{"name": "nic0", "rate_gbit_per_s": 400.0, "gpus": [0], "rail": 0},
                 {"name": "nic1", "rate_gbit_per_s": 400.0, "gpus": [1], "rail": 1}]}


def _plan(dispatcher: str, perm=None, fabric: str = "nvlink4"):
    mesh = {"names": ["dp_shard", "ep"], "shape": [8, 8], **({"rank_to_gpu": perm} if perm else {})}
    node = NODE | {"fabric": NODE["fabric"] | {"name": fabric}}
    return build_plan(config_from_dict({
        "model": {"catalog": "deepseek-v2-lite"},
        "cluster": {"gpu": "h100-sxm5-80gb", "nodes": 4, "node": node,
                    "network": [{"name": "leaf", "latency_us": 5.0}]},
        "training": {"global_batch": 16, "seq_len": 2048, "framework": "megatron", "moe_dispatcher": dispatcher},
        "mesh": mesh}))


def _ep_nic_bytes(plan) -> float:
    """NIC bytes one rank sends per step on the ep dispatch rows (each of its node's NICs carries one
    rank's); not the dropless count all-gather (a ring, on one rail set: never up)."""
    return sum(r.link_bytes[1] * r.per_step for r in plan.stage(0).collectives if r.axis == "ep" and r.op == "all-to-all")


def _uplinks(plan) -> dict[int, float]:
    rows = [r for r in plan.stage(0).collectives if r.axis == "ep"]
    return {rail: v[0] for rail, v in network_loads(plan, rows, 1, 0)[1].items()}


def test_deepep_rdma_stays_on_its_rail_where_an_all_to_all_goes_up_for_half_the_pairs_without_pxn():
    """Newcomer 48 (finding 7): on an NVLink node NCCL's PXN (default on; NVIDIA/nccl 5067397
    src/graph/search.cc:1398-1470) sends each all-to-all message through the NIC on the peer's rail, relayed
    over NVLink, so there the all-to-all stays under the leaf as DeepEP does. Without NVLink between the
    node's GPUs (this node's fabric renamed pcie: PXN's relay needs an NVLink path) it goes up for half
    the pairs, as this test asserted for every node before."""
    deepep, a2a = _plan("deepep"), _plan("alltoall")
    assert _ep_nic_bytes(deepep) > 0
    assert _uplinks(deepep) == {}  # rank 2j -> 2j' on rail 0, 2j+1 -> 2j'+1 on rail 1: all under the leaf
    assert _ep_nic_bytes(a2a) > 0 and _uplinks(a2a) == {}  # PXN: every send on the peer's rail
    # no PXN: from node j's rank on rail 0, 3 of its 6 peers on other nodes sit on rail 1 -> 1/2 up,
    # every node's NIC bytes b_a2a on each rail: 4 nodes x b / 2
    a2a = _plan("alltoall", fabric="pcie-only")
    b = _ep_nic_bytes(a2a)
    assert _uplinks(a2a) == {0: pytest.approx(4 * b / 2, rel=1e-12), 1: pytest.approx(4 * b / 2, rel=1e-12)}


def test_rail_swapped_nodes_send_deepeps_pairs_with_them_up_and_the_uplink_stays_under_the_nic_bytes():
    # nodes 1 and 2 with their GPUs swapped: ranks 2, 4 on GPU 1 (rail 1), ranks 3, 5 on GPU 0 (rail 0).
    # DeepEP pairs by local index (rank 2j + i <-> 2j' + i): node 0's pairs with nodes 1 and 2 (4 of its
    # 6) cross rails, 2/3 up; node 1's with nodes 0 and 3, 2/3; so every node. Each rail: 4 x 2/3 b
    # (a uniform all-to-all would give 1/2 on every node: 2 b)
    plan = _plan("deepep", perm=[0, 1, 3, 2, 5, 4, 6, 7])
    b = _ep_nic_bytes(plan)
    up = _uplinks(plan)
    assert up == {0: pytest.approx(8 * b / 3, rel=1e-12), 1: pytest.approx(8 * b / 3, rel=1e-12)}
    # bounded by what the leaf's NICs send on that rail: each node's NIC on each rail carries b
    nic = [network_loads(plan, [r for r in plan.stage(0).collectives if r.axis == "ep"], 1, n)[0] for n in range(4)]
    for rail in (0, 1):
        assert up[rail] <= sum(x[rail][0] for x in nic) == pytest.approx(4 * b, rel=1e-12)


def test_the_step_edge_table_has_no_uplink_for_the_rail_aligned_deepep_mesh():
    plan = _plan("deepep")
    loads = {e.edge: e for e in edge_loads(plan, step_time(plan))}
    assert "node 0 NIC nic0 (rail 0)" in loads
    assert not [e for e in loads if "uplink" in e]
