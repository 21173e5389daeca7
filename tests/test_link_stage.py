"""The edge-load table of a MoE step whose critical stage is dense (newcomer trial 17):
DeepSeek-V3 at pp 16 x dp_shard 128 x ep 64 on 256 dgx-h100 (examples/deepseek-v3_2048xh100_pp16-ep64-dp128.toml).
Stage 0 holds the 3 dense layers, no ep traffic, so its NICs fit, while the verdict says each
rank of stage 1 sends 1,332 GB per step on ep. step prints stage 0's table, says in its header
that stage 1's ranks send more, and prints stage 1's table (rank 128, node 16)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.link_spill import heaviest_nic_stage, nic_bytes_per_stage, other_stage_loads
from meshplan.schedule.linkload import edge_loads
from meshplan.schedule.netload import _spine_share
from meshplan.schedule.steptime import step_time
from tests.cli_run import run_main
from tests.conftest import EXAMPLES

DSV3 = EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"


@pytest.fixture(scope="module")
def stepped():
    plan = build_plan(load_config(DSV3))
    return plan, step_time(plan)


def test_stage_1s_nic_carries_its_ep_all_to_alls(stepped):
    """By hand: each all-to-all moves micro_batch 1 x seq 4096 x top_k 8 x hidden 7168 x 2 bytes
    (bf16) = 469,762,048 B per rank, 56 / 64 of it to peers on the 7 other nodes of its ep group
    (ep 64 = 8 nodes of 8), out of the rank's own NIC (one GPU per NIC). Calls per step: 120
    micro-batches x 4 MoE layers x (2 forward + 2 backward + 2 replayed by full recompute) =
    2,880. So 2,880 x 469,762,048 x 7/8 = 1,183.8 GB on ep; the stage's other network rows
    (pp sends, dp_shard and efsdp, ep's dropless counts) add their own off-node bytes."""
    plan, st = stepped
    ep_by_hand = 120 * 4 * 6 * (1 * 4096 * 8 * 7168 * 2) * 56 / 64
    assert round(ep_by_hand / 1e9, 1) == 1183.8
    loads = {e.edge: e for e in edge_loads(plan, st, 1)}
    nic = loads["node 16 NIC mlx5_0 (rail 0)"]
    ep_rows = [r for r in plan.stage(1).collectives if r.axis == "ep" and r.op == "all-to-all"]
    assert sum(r.per_step for r in ep_rows) == 2880 and {r.size_bytes for r in ep_rows} == {469762048}
    rest = nic.bytes_per_step - ep_by_hand
    assert 0 < rest < 0.05 * nic.bytes_per_step  # pp, dp_shard, efsdp: 31 GB of 1,214.8
    assert round(nic.bytes_per_step / 1e9, 1) == 1214.8 and not nic.fits
    assert "rank 128 nvlink4" in loads


def test_stage_0s_nics_carry_no_ep_and_stage_1_is_named(stepped):
    """Stage 0 (dense layers, node 0): 16.1 GB per step on each NIC, none of it ep; stage 1 is
    the first of the expert stages whose ranks send the most (stages 1-14 alike), the stage the
    verdict names."""
    plan, st = stepped
    per = nic_bytes_per_stage(plan, st)
    assert round(per[0] / 1e9, 1) == 16.1 and round(per[1] / 1e9, 1) == 1214.8
    assert heaviest_nic_stage(plan, st) == 1
    assert not [r for r in plan.stage(0).collectives if r.axis == "ep"]
    assert all(e.fits for e in edge_loads(plan, st, 0))


def test_the_leaf_uplinks_carry_each_node_under_its_own_stage_bounded_by_the_nics(stepped):
    """Newcomer trial 24 #2: the leaf of nodes 0-31 holds stage 0 (nodes 0-15) and stage 1 (16-31);
    its rail-0 uplinks counted stage 1's ep all-to-alls on all 32 nodes (33,597.4 GB), more than the
    leaf's rail-0 NICs send at all. Then each node under its own stage's table, the same edge in both
    tables: stage 1's 16 nodes x 1,183.8 GB of ep x 7/8 (of a member's 56 off-node peers 49 sit on
    other rails) = 16,573.2 GB, plus the non-ep rows' hops that leave the leaf (pp sends to stage 2).
    Newcomer 48 (finding 7): NCCL's PXN (default on an NVLink node; NVIDIA/nccl 5067397
    src/graph/search.cc:1398-1470) sends each all-to-all message through the NIC on the peer's rail, and
    every ep group of 8 nodes lies inside the leaf, so that ep share no longer goes up: the uplinks carry
    the non-ep rows' hops alone, under 3% of those 16,573.2 GB (the old test's bound on them), and no
    more than 16 x 1,214.8 + 16 x 16.1 GB, what the leaf's rail-0 NICs carry."""
    plan, st = stepped
    one = {e.edge: e for e in edge_loads(plan, st, 1)}
    zero = {e.edge: e for e in edge_loads(plan, st, 0)}
    up = one["rail 0 uplinks to spine (nodes 0-31)"].bytes_per_step
    assert zero["rail 0 uplinks to spine (nodes 0-31)"].bytes_per_step == pytest.approx(up, rel=1e-12)
    ep = 16 * (120 * 4 * 6 * (4096 * 8 * 7168 * 2) * 56 / 64) * 7 / 8
    assert round(ep / 1e9, 1) == 16573.2 and 0 < up < 0.03 * ep
    nics = 16 * one["node 16 NIC mlx5_0 (rail 0)"].bytes_per_step + 16 * zero["node 0 NIC mlx5_0 (rail 0)"].bytes_per_step
    assert up <= nics and round(nics / 1e9) == 19694


def test_step_prints_both_tables(capsys):
    assert run_main("step", DSV3) == 0
    out = capsys.readouterr().out
    assert ("edge load per step on stage 0 (rank 0, node 0; stage 1's ranks send more and a NIC or uplink of it does "
            "not fit: its table follows)") in out
    assert ("edge load per step on stage 1 (rank 128, node 16; the stage whose ranks send the most, 1214.8 GB per rank "
            "per step over the network against stage 0's 16.1 GB)") in out
    assert "each rank of stage 1 sends 1,332 GB per step" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("node 16 NIC mlx5_0"))
    assert line.endswith("DOES NOT FIT")


def test_a_heavier_stage_that_fits_prints_its_table_too(capsys):
    """Llama-3-405B, pp 16 dense: stage 1 (8 layers) sends 21.1 GB per rank per step over the
    network against stage 0's (7 layers) 19.3 GB, and every edge of it fits: its table follows
    stage 0's all the same, labelled (the stage whose links are loaded most,
    meshplan.schedule.stage_traffic), where it was left out before. By hand (reshard_after_forward
    unset: false at pp > 1, so each layer all-gathered once per step over dp_shard 128): per
    layer an all-gather of 796,983,296 B (bf16) and a reduce-scatter of 1,593,966,592 B (fp32),
    127/128 of each sent, 2,372.27 MB; 16 micro-batches' pp sends of 33,554,432 B, 32 per
    neighbour. Stage 1: 8 x 2,372.27 + 64 x 33.55 = 21,125.7 MB; stage 0: 7 x 2,372.27 + the
    embedding's 127/128 x (528,482,304 + 1,056,964,608) B + 32 x 33.55 = 19,252.7 MB."""
    assert run_main("step", EXAMPLES / "llama3-405b_16384xh100_tp8-pp16-dp128.toml") == 0
    out = capsys.readouterr().out
    assert out.count("edge load per step on stage") == 2 and "does not fit: its table follows" not in out
    assert ("edge load per step on stage 1 (rank 1024, node 128; the stage whose ranks send the most, 21.1 GB per "
            "rank per step over the network against stage 0's 19.3 GB)") in out
    plan = build_plan(load_config(EXAMPLES / "llama3-405b_16384xh100_tp8-pp16-dp128.toml"))
    st = step_time(plan)
    other = other_stage_loads(plan, st)
    assert heaviest_nic_stage(plan, st) == 1 and other is not None and other[0] == 1
    assert all(e.fits for e in other[1])


def test_spine_share_from_another_node():
    """All-to-all from node 16's members (rails 0, 1) to node 17's (rails 1, 0): half the pairs
    change rail, as from node 0."""
    assert _spine_share("all-to-all", np.array([16, 16, 17, 17]), np.array([0, 1, 1, 0]), 16) == 0.5
    assert _spine_share("all-to-all", np.array([16, 16, 17, 17]), np.array([0, 1, 1, 0])) == 0.0  # node 0 holds none


def test_json_and_html_carry_the_second_table(tmp_path, capsys):
    """step --json: ``links`` stays stage 0's, ``other_stage_links`` holds stage 1's rows (valid
    against the step schema); the HTML report shows the same second table; the 405B file has none."""
    import json

    import jsonschema

    from meshplan.report.html_pages import plan_page
    from meshplan.report.json_docs import schema_of
    assert run_main("step", DSV3, "--json", tmp_path / "s.json") == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "s.json").read_text())
    jsonschema.Draft202012Validator(schema_of("step")).validate(doc)
    other = doc["other_stage_links"]
    assert other["stage"] == 1 and round(other["links"][1]["bytes_per_step"] / 1e9, 1) == 1214.8
    assert not other["links"][1]["fits"] and all(e["fits"] for e in doc["links"])
    plan = build_plan(load_config(DSV3))
    page = plan_page(plan, step_time(plan), "dsv3")
    assert "stage 1 (rank 128, node 16): the stage whose ranks send the most, 1214.8 GB per rank per step" in page
    assert "node 16 NIC mlx5_0 (rail 0)" in page
    assert run_main("step", EXAMPLES / "mini_2x4_tp4-dp2.toml", "--json", tmp_path / "l.json") == 0
    assert json.loads((tmp_path / "l.json").read_text())["other_stage_links"] is None  # pp 1: one stage
