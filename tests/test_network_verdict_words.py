"""Newcomer words20: the network verdict's link. It said ``400.0 GB/s per rank`` for a dp_shard group
of 8 ranks a node on a DGX H100 (that is the node's 8 NICs x 50 GB/s, the ring's bus bandwidth), that
every byte a rank sends goes over the network (the edge table: 1/8 of it through each NIC), and
``8 group(s) per node share NIC(s) mlx5_0,...,mlx5_11; rails [0]`` where each group has its own NIC."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.plan import build_plan
from meshplan.schedule.verdict import _link, network_share
from tests.conftest import EXAMPLES

NICS = "mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11"  # dgx-h100's 8 compute NICs, 50 GB/s each


def _row(plan):
    return next(r for r in plan.collectives["stage 0"] if r.axis == "dp_shard")


def test_one_group_of_eight_ranks_a_node():
    """dp_shard 32 on 4 nodes: 1 group, 8 ranks a node on all 8 NICs. Each NIC carries one rank's
    share: 50 GB/s a rank; the ring's bus bandwidth min(NVLink 450, 8 x 50 / 1 group) = 400 GB/s;
    1 of 8 hops a node crosses it, so 1/8 of the bytes sent."""
    plan = build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
        "training": {"global_batch": 256, "seq_len": 1024, "sharding": "zero3"},
        "mesh": {"names": ["dp_shard"], "shape": [32]}}))
    r = _row(plan)
    assert _link(r) == (f"network (1 group(s) per node, on NIC(s) {NICS}; rails [0, 1, 2, 3, 4, 5, 6, 7]; 50.0 GB/s "
                        "of NIC per rank, 400.0 GB/s bus bandwidth over 8 rank(s) per node)")
    assert network_share(r) == pytest.approx(1 / 8)


def test_eight_groups_each_on_its_own_nic():
    """dp_shard 32 x tp 8 on 32 nodes: 8 dp_shard groups a node, one rank each, each rank on its own
    NIC: 50 GB/s = min(450, 8 x 50 / 8 groups), rail 0 for group 0; every byte crosses the network."""
    r = _row(build_plan(load_config(EXAMPLES / "llama3-70b_256xh100_dp32-tp8.toml")))
    assert _link(r) == ("network (8 group(s) per node, each on its own NIC(s) (group 0: mlx5_0); rails [0]; 50.0 GB/s "
                        "of NIC per rank, 50.0 GB/s bus bandwidth over 1 rank(s) per node)")
    assert network_share(r) == 1.0
