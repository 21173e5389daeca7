"""What crosses the spine, one rule for ``place`` and ``step`` (meshplan.placement.spine).

Hand derivation, Llama-3-70B at dp_shard 64 x tp 8 on 64 dgx-h100 (superpod-ndr-su32: scalable
units of 32 nodes, NIC k of every node on its unit's leaf k). Each of the 8 dp_shard groups has
one member per node, all at the same local GPU, so on one rail. NCCL's ring follows rank order:
node 0 -> 1 -> ... -> 63 -> 0, 64 hops between nodes; only 31 -> 32 and 63 -> 0 leave a unit,
2 hops per group, 16 of the 512. Each hop carries one rank's ring bytes w (the dp_shard bytes a
rank sends per step, all through its NIC with one member per node). So:

- place: network 512 w, spine 16 w (it printed spine 0 before, every group on one rail);
- step: unit 0's leaf on rail k sends up one hop per ring, node 31's: w per step, against its
  32 uplinks of 400 Gb/s (non-blocking: one per node), busy w / (32 x 50 GB/s). Before, the
  edge was node 0's own uplink with node 0's whole NIC load w against one NIC's 50 GB/s,
  although node 0's ring hop (to node 1) never leaves the unit.
"""

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.placement.score import weak_bytes, weights_from_plan
from meshplan.placement.spine import exit_crosses, spine_hops
from meshplan.plan import build_plan
from meshplan.schedule.linkload import edge_loads
from meshplan.schedule.steptime import step_time


@pytest.fixture(scope="module")
def dp64():
    d = {"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 64},
         "training": {"global_batch": 512, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3",
                      "reshard_after_forward": True, "param_dtype": "fp32", "compute_dtype": "bf16",
                      "reduce_dtype": "fp32", "recompute": "selective", "memory_reserve": 0.10},
         "mesh": {"names": ["dp_shard", "tp"], "shape": [64, 8], "sequence_parallel": True}}
    return build_plan(config_from_dict(d))


def test_ring_leaves_each_unit_once(dp64):
    p, groups = dp64.placement, dp64.mesh.groups("dp_shard")
    assert groups.shape == (8, 64)
    # the hops leaving nodes 31 and 63 (to 32 and back to 0) cross the spine, no other
    assert np.flatnonzero(exit_crosses(p, groups[0])).tolist() == [31, 63]
    assert spine_hops(p, groups).tolist() == [2] * 8
    # tp stays inside a node: no hop at all
    assert spine_hops(p, dp64.mesh.groups("tp")).sum() == 0


def test_place_and_step_count_the_same_hops(dp64):
    w = weights_from_plan(dp64)["dp_shard"]
    cost = weak_bytes(dp64.mesh, dp64.placement, {"dp_shard": w}).by_axis["dp_shard"]
    assert (cost.network_hops, cost.spine_hops) == (512, 16)
    assert cost.spine_bytes == pytest.approx(16 * w)
    loads = {e.edge: e for e in edge_loads(dp64, step_time(dp64))}
    nic = loads["node 0 NIC mlx5_0 (rail 0)"]
    assert nic.bytes_per_step == pytest.approx(w, rel=1e-9)  # every ring byte through the NIC
    ups = [e for k, e in loads.items() if "uplinks to spine" in k]
    assert [e.edge for e in ups] == [f"rail {k} uplinks to spine (nodes 0-31)" for k in range(8)]
    for e in ups:
        # one hop per ring leaves unit 0 (node 31's), the leaf's 32 uplinks at 400 Gb/s
        assert e.bytes_per_step == pytest.approx(w, rel=1e-9)
        assert e.capacity_bytes_per_s == 32 * 400e9 / 8
        assert e.busy_s == pytest.approx(w / (32 * 50e9), rel=1e-9)
        assert e.fits


def test_one_unit_sends_nothing_up():
    # 32 nodes: one scalable unit, every ring hop under its rail's leaf
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 32},
         "training": {"global_batch": 256, "seq_len": 2048}, "mesh": {"names": ["dp_shard", "tp"], "shape": [32, 8]}}
    p = build_plan(config_from_dict(d))
    assert spine_hops(p.placement, p.mesh.groups("dp_shard")).sum() == 0
    assert not [e for e in edge_loads(p, step_time(p)) if "uplink" in e.edge]


def test_pipeline_chain_has_no_wrap_hop():
    # 4 stages on nodes 0-3, scalable units of 2: a ring crosses at 1 -> 2 and 3 -> 0; the
    # pipeline's sends run 0 -> 1 -> 2 -> 3 only, so stage 3's node sends nothing across
    from types import SimpleNamespace as P
    from meshplan.schedule.netload import _exits
    p = P(domain=np.arange(4), node=np.arange(4), rail=np.zeros(4, int), cluster=P(network=[P(nodes_per_domain=2)]))
    assert _exits(p, P(op="all-gather", axis="dp_shard"), np.arange(4)).tolist() == [False, True, False, True]
    assert _exits(p, P(op="send/recv", axis="pp"), np.arange(4)).tolist() == [False, True, False, False]
    # the cp ring's dK/dV shift goes round: rank 3 sends to rank 0, across the spine
    assert _exits(p, P(op="send/recv", axis="cp"), np.arange(4)).tolist() == [False, True, False, True]
