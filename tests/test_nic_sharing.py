"""Concurrent network collectives share their NICs in the rank timeline (issue 11, open item 1a;
newcomer trial 31, finding #2: the cp ring's sends and the FSDP all-gathers each ran at the full NIC
rate): :func:`meshplan.schedule.comm_times.nic_share` and :meth:`meshplan.schedule.unit_sim.StreamSim._nic`."""

from __future__ import annotations

import json
import re
import tomllib

import jsonschema
import pytest

from meshplan.comm.row import CollectiveRow, Path
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from meshplan.schedule.comm_times import CommTimes, nic_share
from meshplan.schedule.unit_sim import Overlap, StreamSim
from tests.cli_run import run_cli
from tests.configs import NC31_TOP1_TOML, mixtral_8x22b_etp_job

#: 200 Gb/s NICs, one per GPU, 2 nodes of 8 GPUs: 25 GB/s each.
NIC = Path("network", 200e9, "2 nodes", nodes=2, ranks_per_node=8, nic_bandwidth_bytes_per_s=25e9)
AG = ("shard", "layer", "forward", "all-gather")
SEND = ("cp", "", "forward", "send/recv")


def _row(op: str, size_bytes: float, time_s: float, path: Path = NIC) -> CollectiveRow:
    return CollectiveRow("fsdp", "forward", op, 16, 1, (0,), size_bytes, "bf16", 1, 1, "", path, time_s)


def _sim(ag_share: float, send_share: float, ag_s: float = 0.010, send_s: float = 0.005) -> StreamSim:
    comm = CommTimes(t={AG: ag_s, SEND: send_s}, nic={AG: ag_share, SEND: send_share})
    return StreamSim(comm, None, Overlap())


def test_nic_share_by_hand():
    """An FSDP all-gather over 16 ranks (2 nodes x 8) of X = 1.6 GB timed 10 ms: a rank's ring
    bytes 15/16 X = 1.5 GB, 1/8 of them through its own NIC (one ring channel leaves by each GPU's
    NIC) = 187.5 MB = 7.5 ms at 25 GB/s: 0.75 of the NIC. A cp send of Y = 100 MB timed 5 ms: the
    boundary member sends all of Y through its NIC, 4 ms: 0.8. The same all-gather on NVLink: 0."""
    assert nic_share(_row("all-gather", 1.6e9, 0.010)) == pytest.approx(0.75)
    assert nic_share(_row("send/recv", 100e6, 0.005)) == pytest.approx(0.8)
    assert nic_share(_row("all-gather", 1.6e9, 0.010, Path("nvlink", 450e9, "nvlink4"))) == 0.0
    # bandwidth-bound beyond the line rate (a faster measured curve): at most the whole NIC
    assert nic_share(_row("send/recv", 100e6, 0.002)) == 1.0


def test_two_collectives_on_one_nic_by_hand():
    """The all-gather (share 0.75, 10 ms) issued at 0, 1 ms of compute, then the cp send (share 0.8,
    5 ms alone) at 1 ms. The earlier keeps its end (10 ms); the NIC leaves the send 1 - 0.75 = 0.25,
    less than its fair half (two running), so it runs at 0.5 / 0.8 = 0.625 of its speed: its 5 ms take
    8, it ends at 9 ms, not 6: 3 ms longer, charged to fsdp. (What is left alone, 0.25 / 0.8 = 0.3125,
    would end it at 12.1875 ms.)"""
    s = _sim(0.75, 0.8)
    ag = s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[])
    s.compute("L0", 0.001)
    send = s.comm("cp", "forward", "send/recv", "cp send")
    assert (ag.start_s, ag.end_s) == (0.0, pytest.approx(0.010))
    assert send.start_s == pytest.approx(0.001)
    assert send.end_s == pytest.approx(0.009)
    assert s.finish().nic_wait == {("cp", "fsdp"): pytest.approx(0.003)}


def test_room_on_the_nic_costs_nothing():
    """Shares 0.5 and 0.5: the NIC carries both at full speed; the send ends at 1 + 5 = 6 ms. The
    all-gather off the network (share 0): the same. Both bandwidth-bound (share 1) and issued
    together: the send runs at its fair half, its 5 ms in 10, and ends at 10 ms, as fair sharing ends
    it (the all-gather keeps its 10 ms, where fair sharing would end it at 15)."""
    for ag_share in (0.5, 0.0):
        s = _sim(ag_share, 0.5)
        s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[])
        s.compute("L0", 0.001)
        assert s.comm("cp", "forward", "send/recv", "cp send").end_s == pytest.approx(0.006)
        assert s.finish().nic_wait == {}
    s = _sim(1.0, 1.0)
    s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[])
    assert s.comm("cp", "forward", "send/recv", "cp send", after=[]).end_s == pytest.approx(0.010)


def test_nc31_step_charges_the_cp_sends(capsys, tmp_path):
    """Newcomer 31's top mesh (dp_shard 4 x cp 32 x tp 2 on 32 DGX H100, 400 Gb/s = 50 GB/s per GPU's
    NIC). Its table: the layer's FSDP all-gather of 855,670,784 B over 128 ranks, 4 a node, 4,856.1 us:
    through each member's NIC 127/128 x 855,670,784 / 4 = 212,246,425 B = 4.2449 ms at 50 GB/s, share
    0.87415; the cp K/V send of 8,388,608 B, 187.4 us: the boundary member's NIC 0.16777 ms, share
    0.8953. The forward's first cp send is issued while the next layer's all-gather (prefetched) runs
    and ends before it: the NIC leaves it 1 - 0.87415 = 0.12585, less than its fair half, so it runs at
    0.5 / 0.8953 = 0.55847 of its speed, 0.1874 / 0.55847 = 0.3356 ms, longer than the 0.2374 ms ring step
    beside it (step 0, the causal 4,096 x 4,096 diagonal: 2 x 4096^2 x 32 x 128 FLOP at FA3's 579 TFLOP/s;
    its slack alone 0.050 ms; 0.036 ms beside the equal 0.223 ms share of the steps before te_ring). The step's concurrent line says what the sharing cost cp;
    the parts line exposes cp."""
    cfg = tmp_path / "nc31.toml"
    cfg.write_text(NC31_TOP1_TOML)
    code, out, _ = run_cli(["step", cfg], capsys)
    assert code == 0
    ag_share = 855_670_784 * 127 / 128 / 4 / 50e9 / 4856.1e-6
    send_share = 8_388_608 / 50e9 / 187.4e-6
    assert (round(ag_share, 4), round(send_share, 4)) == (0.8741, 0.8953)
    want_ms = 0.1874 / (max(1 - ag_share, 0.5) / send_share)
    row = re.search(r"^  cp +forward +send/recv +[\d.]+ +[\d.]+ +([\d.]+)", out, re.M)
    assert float(row.group(1)) == pytest.approx(want_ms, abs=0.002)  # 0.336 ms; alone 0.187
    line = next(x for x in out.splitlines() if x.startswith("concurrent: cp and fsdp"))
    lengthened = float(re.search(r"lengthens cp's collectives by ([\d.]+) ms per step", line).group(1))
    assert lengthened > 0
    assert re.search(r"exposed cp [\d.]+", out.splitlines()[2])


def test_step_json_carries_the_sharing_cost(capsys, tmp_path):
    """``step --json``'s ``nic_sharing_s`` holds what the text's concurrent line prints: cp's
    collectives lengthened beside fsdp's, in seconds (the line's ms / 1000, to its 0.1 ms), and
    at least the forward sends' lengthening beside the next layer's prefetched all-gather: 32 / 4 =
    8 micro-batches x 79 layers with a next layer, (0.3356 - 0.1874) ms for at least the first send
    of each: 632 x 0.1482 ms = 93.7 ms. The document validates against the step schema."""
    cfg, doc = tmp_path / "nc31.toml", tmp_path / "s.json"
    cfg.write_text(NC31_TOP1_TOML)
    code, out, _ = run_cli(["step", cfg, "--json", doc], capsys)
    assert code == 0
    data = json.loads(doc.read_text())
    assert list(jsonschema.Draft202012Validator(schema_of("step")).iter_errors(data)) == []
    got = {(x["stream"], x["beside"]): x["seconds"] for x in data["nic_sharing_s"]}
    line = next(x for x in out.splitlines() if x.startswith("concurrent: cp and fsdp"))
    ms = float(re.search(r"lengthens cp's collectives by ([\d.]+) ms per step", line).group(1))
    assert round(got[("cp", "fsdp")] * 1e3, 1) == ms
    assert got[("cp", "fsdp")] >= 8 * 79 * (0.3356 - 0.1874) * 1e-3


def test_a_collective_on_nvlink_holds_no_nic_beside_a_network_one_of_its_kind():
    """Megatron-LM's Mixtral-8x22B job (tests/configs.py mixtral_8x22b_etp_job: pp 8 x dp 32 x tp 2 x
    ep 8 x etp 2 on 64 DGX H100, 400 Gb/s = 50 GB/s per GPU's NIC). Its etp all-gather and
    reduce-scatter (kind ep, group etp) run over etp 2, two adjacent GPUs of a node: NVLink, share 0.
    The ep all-to-all of 50,331,648 B over ep 8 (ranks 2 apart: 4 a node on 2 nodes) sends (n - g)/n =
    4/8 of it, 25,165,824 B, through the rank's NIC: 0.5033 ms at 50 GB/s over the row's time (0.5598
    ms: 0.899). Before, the etp key's 0 was read as no row and the lookup fell back to the kind's
    largest, the all-to-all's 0.899, so the NVLink gathers were slowed beside the FSDP all-gathers
    (at sharding zero3 the step was 17 ms longer, 3.9235 -> 3.9063 s)."""
    plan = build_plan(config_from_dict(tomllib.loads(mixtral_8x22b_etp_job())))
    rows = plan.stage(0).collectives
    a2a = next(r for r in rows if r.axis == "ep" and r.op == "all-to-all" and r.phase == "forward")
    assert (a2a.size_bytes, a2a.path.nodes, a2a.path.ranks_per_node) == (50_331_648, 2, 4)
    comm = CommTimes.from_rows(rows)
    assert comm.nic_share("ep", "forward", "all-to-all") == pytest.approx(25_165_824 / 50e9 / a2a.time_s)
    assert round(comm.nic_share("ep", "forward", "all-to-all"), 3) == 0.899
    for phase in ("forward", "backward"):
        for op in ("all-gather", "reduce-scatter"):
            assert comm.nic_share("ep", phase, op, "etp") == 0.0
    # a key with no row of its own (the per-step reduction's pieces) still reads its kind's
    assert comm.nic_share("ep", "forward", "no such op") == comm.nic_share("ep", "forward", "all-to-all")
