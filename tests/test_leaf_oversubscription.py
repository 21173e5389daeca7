"""A leaf tier's oversubscription (nc61 #2): read by nothing, so said in a warning with the tier that is read.

A network engineer writes a 2:1 leaf on the leaf tier; meshplan takes a leaf's uplink capacity from the
outermost tier (schedule/linkload.py edge_loads: nodes under the leaf x the NIC rate / network[-1]'s
oversubscription), so the leaf's value was accepted and dropped without a word.
"""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.linkload import edge_loads
from meshplan.schedule.steptime import step_time
from tests.cli_run import run_captured


def _data(leaf_over: float = 1.0, spine_over: float = 1.0) -> dict:
    # llama3-8b, DDP over dp_replicate 16 x tp 4 on 8 dgx-a100 (HDR 200 Gb/s = 25 GB/s per NIC), leaves of 4 nodes
    return {
        "model": {"catalog": "llama3-8b"},
        "cluster": {"node": "dgx-a100", "nodes": 8, "network": [
            {"name": "leaf", "latency_us": 14.0, "nodes_per_domain": 4, "oversubscription": leaf_over},
            {"name": "spine", "latency_us": 14.0, "oversubscription": spine_over}]},
        "training": {"global_batch": 128, "seq_len": 4096, "micro_batch": 1, "sharding": "none", "recompute": "full"},
        "mesh": {"names": ["dp_replicate", "tp"], "shape": [16, 4]},
    }


def _uplink(data: dict):
    plan = build_plan(config_from_dict(data))
    (up,) = [e for e in edge_loads(plan, step_time(plan)) if e.edge.startswith("rail 0 uplinks")]
    return up


def test_uplink_capacity_is_nodes_times_nic_over_the_spine_tier():
    # 4 nodes under the leaf x 25e9 B/s = 100e9 B/s non-blocking; the leaf's 2 leaves it so (not read);
    # the spine's 2 halves it: 50e9 B/s, and the same bytes take twice as long.
    base, leaf2, spine2 = _uplink(_data()), _uplink(_data(leaf_over=2.0)), _uplink(_data(spine_over=2.0))
    assert base.capacity_bytes_per_s == pytest.approx(4 * 25e9)
    assert leaf2.capacity_bytes_per_s == pytest.approx(4 * 25e9)
    assert spine2.capacity_bytes_per_s == pytest.approx(4 * 25e9 / 2)
    assert spine2.busy_s == pytest.approx(2 * base.busy_s)


def test_cli_warns_when_the_leaf_sets_it(tmp_path):
    lines = ["[model]", 'catalog = "llama3-8b"', "[cluster]", 'node = "dgx-a100"', "nodes = 8",
             'network = [{ name = "leaf", latency_us = 14.0, nodes_per_domain = 4, oversubscription = 2 }, '
             '{ name = "spine", latency_us = 14.0 }]',
             "[training]", "global_batch = 128", "seq_len = 4096", 'sharding = "none"', 'recompute = "full"',
             "[mesh]", 'names = ["dp_replicate", "tp"]', "shape = [16, 4]"]
    cfg = tmp_path / "job.toml"
    cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = run_captured("plan", str(cfg))
    assert r.returncode == 0
    assert ("warning: cluster.network: leaf oversubscription 2 is not read (the leaf's uplinks are its 4 nodes x "
            "the NIC rate / the outermost tier's oversubscription, spine 1); to model a 2:1 leaf, set "
            "oversubscription = 2 on spine") in r.stderr
    cfg.write_text(cfg.read_text().replace("nodes_per_domain = 4, oversubscription = 2 }",
                                           "nodes_per_domain = 4 }"), encoding="utf-8")
    assert "oversubscription" not in run_captured("plan", str(cfg)).stderr
