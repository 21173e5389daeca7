"""The seed's worked example (issue 2): Llama-3-70B on 8 nodes x 8 H100 with two NICs,
mesh (dp_shard 8, tp 8) against the tensor-4 alternative (dp_shard 16, tp 4)."""

import json
import subprocess
import sys

import pytest

from meshplan.plan import SCHEMA, build_plan
from meshplan.report.json_out import plan_to_dict, write_json
from meshplan.spec.config import load_config


@pytest.fixture(scope="module")
def plan8():
    from tests.conftest import EXAMPLES
    return build_plan(load_config(EXAMPLES / "seed-64gpu.toml"))


@pytest.fixture(scope="module")
def plan4():
    from tests.conftest import EXAMPLES
    return build_plan(load_config(EXAMPLES / "seed-64gpu-tp4.toml"))


def test_coordinates_and_groups(plan8):
    mesh = plan8.mesh
    assert mesh.layout.rank_of((3, 5)) == 29
    assert mesh.layout.coords_of(29) == (3, 5)
    assert mesh.group_of(29, "tp") == list(range(24, 32))
    assert mesh.group_of(29, "dp_shard") == [5, 13, 21, 29, 37, 45, 53, 61]


def test_local_projection_width(plan8, plan4):
    wq8 = next(g for g in plan8.gemms if g.name == "wq")
    wq4 = next(g for g in plan4.gemms if g.name == "wq")
    assert (wq8.m, wq8.n, wq8.k) == (8192, 1024, 8192)
    assert wq4.n == 2048


def test_placement_of_rank_29(plan8):
    p = plan8.placement
    assert (p.node[29], p.local_gpu[29], p.socket[29], p.nic[29], p.rail[29]) == (3, 5, 1, 1, 1)


def test_tensor_collectives_on_nvlink_shard_on_network(plan8):
    rows = plan8.collectives["stage 0"]
    assert {r.path.kind for r in rows if r.axis == "tp"} == {"nvlink"}
    assert {r.path.kind for r in rows if r.axis == "dp_shard"} == {"network"}
    # every layer: 2 all-gathers + 2 reduce-scatters forward with SP, 80 layers, +1 for the output layer
    ag = next(r for r in rows if r.axis == "tp" and r.phase == "forward" and r.op == "all-gather")
    assert ag.per_microbatch == 2 * 80 + 1
    assert ag.size_bytes == 8192 * 8192 * 2  # b*s*h in bf16, the full gathered buffer
    # 4 shard groups per NIC on a node: each gets 50 GB/s / 4
    fs = next(r for r in rows if r.axis == "dp_shard" and r.op == "all-gather" and r.phase == "forward")
    assert fs.path.bandwidth_bytes_per_s == pytest.approx(400e9 / 8 / 4)


def test_feasibility_and_axis_annotation(plan8, plan4):
    assert plan8.feasible, plan8.reasons
    assert "capacity" in plan8.constraints.axes["tp"]
    assert plan8.constraints.unforced == ()
    assert plan8.micro_batches == 64
    assert not plan4.feasible  # the tensor-4 alternative needs another axis or more memory
    assert "GiB usable (74.5 GiB - 10% reserve)" in plan4.reasons[0]


def test_persistent_state_fsdp2(plan8):
    s = plan8.state[0]
    # 70.55e9 params / tp 8 (plus replicated norms) sharded 8 ways: fp32 params + fp32 grads + Adam 8 B
    assert s.params.total == 8_821_940_224
    assert s.total_bytes == pytest.approx(8_821_940_224 / 8 * 16, rel=1e-6)


def test_json_has_every_group_and_schema(plan8, tmp_path):
    d = plan_to_dict(plan8)
    assert d["schema"] == SCHEMA
    assert d["groups"]["tp"][3] == list(range(24, 32))
    assert len(d["groups"]["dp_shard"]) == 8
    assert d["placement"]["nic"][29] == 1
    out = write_json(plan8, tmp_path / "plan.json")
    assert json.loads(out.read_text())["world"] == 64
    from meshplan.errors import ConfigError
    with pytest.raises(ConfigError, match="exists"):
        write_json(plan8, out)


def test_cli_plan_and_groups(tmp_path):
    from tests.conftest import EXAMPLES
    cfg = str(EXAMPLES / "seed-64gpu.toml")
    r = subprocess.run([sys.executable, "-m", "meshplan.cli", "groups", cfg, "--rank", "29"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "dp_shard=3, tp=5" in r.stdout
    assert "[(3,0)..(3,7)]" in r.stdout and "[(0,5)..(7,5)]" in r.stdout
    assert "24..31" in r.stdout and "5,13,21,29,37,45,53,61" in r.stdout
    r = subprocess.run([sys.executable, "-m", "meshplan.cli", "plan", cfg, "--json", str(tmp_path / "p.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "feasible" in r.stdout and "busbw (GB/s)" in r.stdout
    assert (tmp_path / "p.json").exists()
    r = subprocess.run([sys.executable, "-m", "meshplan.cli", "groups", cfg, "--rank", "64"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --rank: 64 outside 0..63"
