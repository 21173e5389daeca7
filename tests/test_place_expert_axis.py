"""``meshplan place`` names the experts' data axis as ``meshplan plan`` does (small leftovers 42,
item 3): :func:`meshplan.spec.wording.expert_data_axis`, ``edp`` where the sharding replicates the
experts (DDP, ZeRO-1/2: Megatron-Core's expert data-parallel group), ``efsdp`` where FSDP shards
them. ``place`` printed ``efsdp`` whatever the sharding, beside ``plan``'s ``edp``."""

from __future__ import annotations

import pytest

from tests.cli_run import run_cli
from tests.configs import job_toml


def _mixtral(tmp_path, sharding: str, data_axis: str):
    """Mixtral-8x7B on 4 dgx-h100 (32 GPUs), mesh data axis 32 x ep 8 (examples/mixtral-8x7b_32xh100_ep8-dp32.toml
    at ``sharding``)."""
    p = tmp_path / f"mixtral_{sharding}.toml"
    p.write_text(job_toml("mixtral-8x7b", nodes=4,
                          training={"global_batch": 256, "seq_len": 4096, "micro_batch": 1, "sharding": sharding,
                                    "recompute": "full"},
                          mesh={"names": [data_axis, "ep"], "shape": [32, 8]}))
    return p


def _axis_row(text: str, name: str) -> list[str]:
    """The first columns of ``place``'s axis row ``name`` (axis, size, groups, link, nodes, rails, same, sockets)."""
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("  ") and ln.split()[:1] == [name]]
    assert rows, text
    return rows[0][:8]


def test_place_prints_edp_where_plan_does(tmp_path, capsys):
    """ZeRO-1: the experts' group is edp = dp 32 / (ep 8 x etp 1) = 4 ranks, 32 / 4 = 8 groups; rank r's
    group is {r, r + 8, r + 16, r + 24}, one GPU of each of the 4 nodes at the same local index: 4 nodes,
    1 rail, 1 socket."""
    cfg = _mixtral(tmp_path, "zero1", "dp")
    rc, plan, err = run_cli(["plan", cfg], capsys)
    assert rc == 0, err
    assert "  edp = dp(32) / (ep 8 * etp 1) = 4" in plan.splitlines()
    rc, place, err = run_cli(["place", cfg], capsys)
    assert rc == 0, err
    assert _axis_row(place, "edp") == ["edp", "4", "8", "network", "4", "1", "same", "1"]
    assert "  - edp 4 spans 4 nodes, one member per node at the same local GPU: each group on one rail" in place
    assert "efsdp" not in place


def test_place_keeps_efsdp_under_fsdp(tmp_path, capsys):
    """ZeRO-3 (the example's sharding): efsdp = dp_shard 32 / 8 = 4, in both outputs."""
    cfg = _mixtral(tmp_path, "zero3", "dp_shard")
    rc, plan, err = run_cli(["plan", cfg], capsys)
    assert rc == 0, err
    assert "  efsdp = dp_shard(32) / (ep 8 * etp 1) = 4" in plan.splitlines()
    rc, place, err = run_cli(["place", cfg], capsys)
    assert rc == 0, err
    assert _axis_row(place, "efsdp") == ["efsdp", "4", "8", "network", "4", "1", "same", "1"]
    assert "edp" not in place.replace("efsdp", "")


def test_all_to_all_axis_scored_by_its_off_node_bytes():
    """ep 16 on 2 dgx-h100 nodes (8 GPUs each, one NVLink domain a node): each rank has g = 8 of
    its group in its node and sends (16 - 8)/(16 - 1) = 8/15 of its all-to-all bytes off it; 16 ranks
    x 8/15 = 8.533 rank-buffers, x weight 1000 B = 8,533.3 B per step. As ring hops (2 domains: 2
    hops) it was 2,000 B, 4.3x short (newcomer nc33: ep 16 on 256 H100 scored 3,768.8 GB, by this
    rule 16,080.4 GB). ep 8 inside a node sends nothing off it."""
    from meshplan.catalog import system
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.placement.assign import place
    from meshplan.placement.score import weak_bytes
    from meshplan.spec.mesh import MeshSpec

    cluster = system("dgx-h100", nodes=2)
    mesh = resolve_mesh(MeshSpec(names=["dp_shard", "ep"], shape=[16, 16]), world=16)
    cost = weak_bytes(mesh, place(cluster, 16), {"ep": 1000.0}).by_axis["ep"]
    assert cost.kind == "all-to-all" and cost.network_hops == pytest.approx(16 * 8 / 15)
    assert cost.network_bytes == pytest.approx(8533.33, abs=0.01)
    mesh8 = resolve_mesh(MeshSpec(names=["dp_shard", "ep"], shape=[16, 8]), world=16)
    assert weak_bytes(mesh8, place(cluster, 16), {"ep": 1000.0}).by_axis["ep"].network_bytes == 0
