"""The deepep dispatcher in the collective table, the step and the search: the DeepSeek-V3
example (pp 16 x dp_shard 128, ep 64 over 8 DGX H100 nodes, 8 ranks on each, one 400 Gb/s NIC per
GPU) with ``training.moe_dispatcher = "deepep"``, its ep rows derived by hand from
meshplan.comm.deepep's module docstring and DeepEP's published rates (catalog deepep.toml)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from tests.configs import MIXTRAL_8X22B, example_toml, job_toml

DSV3 = Path(__file__).resolve().parents[1] / "examples" / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"


def _cfg(tmp_path, dispatcher: str):
    f = tmp_path / f"{dispatcher}.toml"
    f.write_text(example_toml(DSV3.name, moe_dispatcher=dispatcher))  # the example's framework is megatron
    return load_config(f)


def _ep(plan, stage=1):
    return [r for r in plan.stage(stage).collectives if r.axis == "ep"]


def test_the_ep_rows_are_deepep_dispatch_and_combine_with_hand_derived_bytes_and_time(tmp_path):
    plan = build_plan(_cfg(tmp_path, "deepep"))
    rows = _ep(plan)
    assert [(r.phase, r.op, r.algorithm) for r in rows] == [("forward", "all-to-all", "deepep"),
                                                           ("backward", "all-to-all", "deepep")]  # no count rows
    # T = 1 x 4096 tokens of 7168 x 2 B; node hit 1/2 (1 - C(96,8)/C(128,8)) (groups = ep's 8 nodes)
    miss = Fraction(1)
    for i in range(8):
        miss *= Fraction(96 - i, 128 - i)
    p = float(Fraction(1, 2) * (1 - miss))
    per = 4096 * 7168 * 2
    nvl, net = rows[0].link_bytes
    assert net == pytest.approx(per * 7 * p, rel=1e-9)       # 186.5 MB: 3.1754 other nodes per token
    assert net == pytest.approx(186.5e6, rel=1e-3)
    # RDMA logical bytes 8p x per (own node counted, as DeepEP's test counts them) at the EP-64 rates
    # 51 (dispatch) and 50 (combine) GB/s x (50 GB/s NIC share / 50 GB/s measured line); NVLink slower part
    # is under it (7.36 x per over 153/160 x 450 GB/s = 1.0 ms), so the mean of the two RDMA times
    want = (per * 8 * p / 51e9 + per * 8 * p / 50e9) / 2
    assert rows[0].time_s == pytest.approx(want, rel=1e-9)   # 4.2201 ms
    assert rows[0].time_s == pytest.approx(4.2201e-3, rel=1e-4)
    assert rows[0].cadence.startswith("every MoE layer (deepep dispatch, combine; per call 186.5 MB through the NIC")
    # an all-to-all of the same tokens sends 8 copies a token, 56/64 of them off the node: 7 x per
    a2a = _ep(build_plan(_cfg(tmp_path, "alltoall")))[0]
    assert a2a.algorithm == "pairwise" and a2a.link_bytes[1] == pytest.approx(per * 7, rel=1e-9)


def test_step_and_search_read_the_same_deepep_time(tmp_path):
    from meshplan.search.memory import Tables
    from meshplan.search.comm_bounds import _deepep_s
    from meshplan.search.time_tables import TimeTables
    cfg = _cfg(tmp_path, "deepep")
    row = _ep(build_plan(cfg))[0]
    assert _deepep_s(cfg, TimeTables(cfg, Tables(cfg)), 64, 1, 4096) == pytest.approx(row.time_s, rel=1e-12)


def test_the_plans_ep_line_says_what_the_deepep_dispatch_crosses(tmp_path):
    # rank 0's ep group: 8 nodes x 8 ranks; groups of 32 experts = ep's 8 nodes, 4 chosen (M/G = 1/2).
    # Other nodes per token: 7/8 x 8 nodes x 1/2 (1 - C(96,8)/C(128,8)) = 3.1754; a rank holds 4 experts
    # of one group: 64 ranks x 1/2 (1 - C(124,8)/C(128,8)) = 7.3594 destination ranks, 7/8 of them
    # fan-out copies over NVLink = 6.4394 (meshplan.comm.deepep's module docstring)
    def kept(n: int) -> Fraction:  # C(128 - n, 8) / C(128, 8)
        out = Fraction(1)
        for i in range(8):
            out *= Fraction(128 - n - i, 128 - i)
        return out
    across, fanout = 7 * (1 - kept(32)) / 2, 64 * (1 - kept(4)) / 2 * Fraction(7, 8)
    assert (round(float(across), 4), round(float(fanout), 4)) == (3.1754, 6.4394)
    line = build_plan(_cfg(tmp_path, "deepep")).constraints.axes["ep"]
    assert line.endswith(f"; its deepep dispatch crosses the NICs: the group spans 8 nodes, 8 ranks on each, and a "
                         f"token goes once to each other node holding one of its experts: {float(across):.2f} of its 8 "
                         f"routed copies per token cross nodes, then {float(fanout):.2f} NVLink fan-out copies inside "
                         f"the destination nodes (meshplan.comm.deepep; ep <= 8 keeps the group inside one node)")
    assert "3.18 of its 8" in line and "6.44 NVLink" in line and "peers" not in line
    # the all-to-all's words are unchanged: each rank sends to the 56 ranks of the other 7 nodes
    a2a = build_plan(_cfg(tmp_path, "alltoall")).constraints.axes["ep"]
    assert a2a.endswith("its all-to-alls cross the NICs: the group spans 8 nodes, 8 ranks on each, so each rank "
                        "sends to 56 of its 63 peers over the network (ep <= 8 keeps the group inside one node)")


@pytest.mark.slow
def test_deepep_shortens_the_deepseek_v3_step(tmp_path):
    a2a = step_time(build_plan(_cfg(tmp_path, "alltoall"))).step_s
    dee = step_time(build_plan(_cfg(tmp_path, "deepep"))).step_s
    assert dee < 0.8 * a2a  # 31.5 s against 46.3 s at the commit that added deepep


def test_ep_inside_one_node_runs_the_intranode_kernels_on_nvlink_only():
    # Mixtral 8x7B (8 experts, top 2, no groups) at ep 8 on one DGX H100 (450 GB/s NVLink per GPU):
    # a token reaches 8 (1 - C(7,2)/C(8,2)) = 8 x 1/4 = 2 ranks, 7/8 of them another GPU
    from meshplan.config import config_from_dict
    cfg = config_from_dict({"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "sharding": "zero3",
                                         "framework": "megatron", "moe_dispatcher": "deepep"},
                            "mesh": {"names": ["dp_shard", "ep"], "shape": [8, 8]}})
    plan = build_plan(cfg)
    row = _ep(plan, 0)[0]
    assert plan.constraints.axes["ep"].endswith("; its deepep dispatch stays inside one node, over NVLink")
    per = 4096 * 4096 * 2
    assert row.path.kind == "nvlink" and row.algorithm == "deepep"
    assert row.link_bytes == pytest.approx((per * 2 * 7 / 8, 0.0), rel=1e-12)
    # DeepEP's logical NVLink bytes (2 x per) at 153 and 158 of its measured 160 GB/s, scaled to 450 GB/s
    want = (per * 2 / (153 / 160 * 450e9) + per * 2 / (158 / 160 * 450e9)) / 2
    assert row.time_s == pytest.approx(want, rel=1e-12)
    # inside one node the row's size is its NVLink bytes, busbw = algbw on NVLink
    assert row.size_bytes == pytest.approx(per * 2 * 7 / 8, rel=1e-12)
    assert row.busbw_bytes_per_s == row.algbw_bytes_per_s == pytest.approx(per * 2 * 7 / 8 / want, rel=1e-12)


def test_the_deepep_rows_columns_are_the_nic_part_the_nvlink_part_in_the_cadence(tmp_path, capsys):
    """Trial 24 #3: the row's size was the NVLink and NIC bytes together over (n-1)/n (573,547,152 B),
    a busbw of 133.8 GB/s on a 50 GB/s NIC. Now: size = the NIC bytes per call, 3.1754 x 4096 x 14336 B,
    algbw = busbw = 186.46 MB / 4.2201 ms = 44.2 GB/s, under the 50 GB/s NIC."""
    import json
    from tests.cli_run import run_main
    from tests.test_cli_json import validate
    plan = build_plan(_cfg(tmp_path, "deepep"))
    row = _ep(plan)[0]
    nvl, net = row.link_bytes
    assert row.size_bytes == net == pytest.approx(186.459e6, rel=1e-5)
    assert row.algbw_bytes_per_s == row.busbw_bytes_per_s == pytest.approx(net / 4.2201e-3, rel=1e-4)
    assert round(row.busbw_bytes_per_s / 1e9, 1) == 44.2 < 50.0
    assert row.sent_bytes == pytest.approx(nvl + net, rel=1e-12)  # the traffic of every report: both links
    f = tmp_path / "deepep.toml"
    out = tmp_path / "plan.json"
    assert run_main("plan", f, "--json", out) == 0
    text = capsys.readouterr().out
    assert "│   186,459,394 │" in text and "│         44.2 │         44.2 │" in text
    assert "deepep rows: size = the bytes one rank sends through its NIC per call" in text
    assert "per call 186.5 MB through the NIC, 378.1 MB on NVLink" in text
    doc = json.loads(out.read_text())
    assert validate("plan", doc) == []
    ep = [r for r in doc["collectives"]["stage 1"] if r["axis"] == "ep"][0]
    assert ep["size_bytes"] == pytest.approx(net) and ep["busbw_bytes_per_s"] == pytest.approx(row.busbw_bytes_per_s)
    assert ep["split"] == pytest.approx([nvl, net])


def test_compare_weighs_the_dispatcher_as_a_knob_of_the_plan(tmp_path):
    from meshplan.compare.differences import config_differences
    d = config_differences(_cfg(tmp_path, "alltoall"), _cfg(tmp_path, "deepep"))
    assert d.workload == () and ("training.moe_dispatcher", "alltoall", "deepep") in d.knobs


def test_deepep_at_ep_1_dispatches_over_the_etp_ranks(tmp_path):
    """ep 1 x etp 2 is a group DeepEP runs (deepep.group_reason: TPxEP = 2 > 1, a configured size):
    Megatron-LM's flex dispatcher replicates each expert over the etp ranks (token_dispatcher.py
    1894-1920), so every token goes to both ranks of its tp_ep group. Mixtral-8x22B cut to 2 layers, dp 4
    x tp 2 (SP) x etp 2 on one DGX H100, no recompute: a rank's own 4096 / tp 2 = 2048 tokens of 6144 x 2 B,
    per = 25,165,824 B, half of the 2 ranks' copies on NVLink (per x 2 x 1/2), timed as DeepEP's logical
    2 x per at 153 and 158 of its 160 GB/s scaled to 450 GB/s (the ep 8 case above): 115.1 us; 2 calls
    (dispatch, combine) x 2 layers forward. The table had no row at ep 1, the step no dispatch."""
    f = tmp_path / "ep1.toml"
    f.write_text(job_toml({**MIXTRAL_8X22B, "layers": 2}, nodes=1,
                          training={"global_batch": 4, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1",
                                    "recompute": "none", "framework": "megatron", "moe_dispatcher": "deepep"},
                          mesh={"names": ["dp", "tp", "ep", "etp"], "shape": [4, 2, 1, 2], "sequence_parallel": True}))
    plan = build_plan(load_config(f))
    rows = _ep(plan, 0)
    assert [(r.phase, r.algorithm, r.per_microbatch, r.example_ranks) for r in rows] == [
        ("forward", "deepep", 4, (0, 1)), ("backward", "deepep", 4, (0, 1))]
    per = 4096 // 2 * 6144 * 2
    want = (per * 2 / (153 / 160 * 450e9) + per * 2 / (158 / 160 * 450e9)) / 2
    assert rows[0].link_bytes == (per * 2 * 1 / 2, 0.0) == (25_165_824, 0.0)
    assert rows[0].time_s == pytest.approx(want, rel=1e-12) and round(want * 1e6, 1) == 115.1
    st = step_time(plan)
    (fwd,) = [e for e in st.pipeline.events if e.stage == 0 and e.name[0] == "F"]
    assert [e.name for e in st.units.of_event(fwd).events if e.args.get("kind") == "ep"] == ["ep dispatch", "ep combine"] * 2
