"""Concurrent network collectives share their NICs in the rank timeline (issue 11, open item 1a;
newcomer trial 31, finding #2: the cp ring's sends and the FSDP all-gathers each ran at the full NIC
rate): :func:`meshplan.schedule.comm_times.nic_share`, :func:`meshplan.schedule.nic_fair.max_min_shares` applied
at every event of the unit's run (:mod:`meshplan.schedule.unit_events`)."""

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
from meshplan.schedule.overlap_policy import config_overlap
from meshplan.schedule.unit_sim import Overlap, simulate
from meshplan.spec.training import TrainingSpec
from tests.cli_run import run_cli
from tests.configs import NC31_TOP1_TOML, mixtral_8x22b_etp_job

#: 200 Gb/s NICs, one per GPU, 2 nodes of 8 GPUs: 25 GB/s each.
NIC = Path("network", 200e9, "2 nodes", nodes=2, ranks_per_node=8, nic_bandwidth_bytes_per_s=25e9)
AG = ("shard", "layer", "forward", "all-gather")
SEND = ("cp", "", "forward", "send/recv")


def _row(op: str, size_bytes: float, time_s: float, path: Path = NIC) -> CollectiveRow:
    return CollectiveRow("fsdp", "forward", op, 16, 1, (0,), size_bytes, "bf16", 1, 1, "", path, time_s)


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


def _unit(ag_share: float, send_share: float, then=None, ov: Overlap = Overlap()):
    """The all-gather (10 ms alone) issued at 0, 1 ms of compute, then the cp send (5 ms alone) at
    1 ms; ``then(s, ag)`` issues more. Played as the rank timeline plays a unit (:func:`simulate`)."""
    comm = CommTimes(t={AG: 0.010, SEND: 0.005}, nic={AG: ag_share, SEND: send_share})
    out = {}

    def build(s):
        out["ag"] = s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[])
        s.compute("L0", 0.001)
        out["send"] = s.comm("cp", "forward", "send/recv", "cp send")
        if then is not None:
            then(s, out["ag"])
    return simulate(build, comm, None, ov), out


def test_two_collectives_on_one_nic_by_hand():
    """The all-gather (demand 0.75 of the NIC, 10 ms) issued at 0, 1 ms of compute, then the cp send
    (demand 0.8, 5 ms alone) at 1 ms. Max-min fair shares of the NIC: 0.75 + 0.8 > 1, the level 1/2
    under both demands, so each gets half: the send runs at 0.5 / 0.8 = 0.625 of its speed, its 5 ms
    take 8 and it ends at 9 ms (not 6: 3 ms longer, charged to fsdp); the all-gather at 0.5 / 0.75 =
    2/3: by 1 ms it did 1 of its 10 ms, from 1 to 9 ms 8 x 2/3 = 5.333, the 3.667 ms left alone after
    the send: it ends at 12.667 ms, not 10 (2.667 ms longer, charged to cp). The NIC's work is kept:
    0.75 x 10 + 0.8 x 5 = 11.5 ms of NIC time = 0.75 x 1 (0-1 ms) + 1 x 8 (both, the NIC full) + 0.75
    x 3.667 (the all-gather alone). (Before, the earlier kept its end at 10 ms: 1.333 ms of NIC time
    lost.)"""
    unit, ev = _unit(0.75, 0.8)
    assert (ev["ag"].start_s, ev["ag"].end_s) == (0.0, pytest.approx(0.009 + (0.009 - 0.008 * 2 / 3)))  # 9 ms + 3.667 alone
    assert ev["ag"].end_s == pytest.approx(0.0126667, abs=1e-7)
    assert (ev["send"].start_s, ev["send"].end_s) == (pytest.approx(0.001), pytest.approx(0.009))
    assert unit.nic_wait == {("cp", "fsdp"): pytest.approx(0.003), ("fsdp", "cp"): pytest.approx(0.0026667, abs=1e-7)}


def test_an_earlier_collective_slowed_moves_what_waits_on_it():
    """As :func:`test_two_collectives_on_one_nic_by_hand`, then layer 1's compute waiting for the
    all-gather: it starts when the all-gather ends, 12.667 ms (10 ms if the send had not slowed it),
    and the compute stream, free at 1 ms, waited 11.667 ms for fsdp (exposed): the send, running
    from 1 ms, slows the all-gather that layer 1 waits for. Alone (no send issued) the all-gather ends
    at 10 ms."""
    unit, ev = _unit(0.75, 0.8, then=lambda s, ag: s.compute("L1", 0.002, [ag]))
    l1 = next(e for e in unit.events if e.name == "L1")
    assert l1.start_s == pytest.approx(0.0126667, abs=1e-7)
    assert unit.exposed_s["fsdp"] == pytest.approx(0.0116667, abs=1e-7)
    alone = simulate(lambda s: s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[]),
                     CommTimes(t={AG: 0.010, SEND: 0.005}, nic={AG: 0.75, SEND: 0.8}), None, Overlap())
    assert alone.events[0].end_s == pytest.approx(0.010)


def test_a_wait_issued_before_the_later_collective_waits_for_its_slowed_end():
    """The all-gather (demand 0.75, 10 ms alone) issued at 0 and layer 0's compute (2 ms) waiting
    for it are issued before the cp send (demand 0.8, 5 ms alone, ``after=[]``: it waits for nothing,
    its queue free from 0). In time order the send starts at 0 beside the all-gather: demands 1.55,
    each gets half, the send at 0.5 / 0.8 = 0.625 of its speed, its 5 ms take 8 ms; the all-gather at
    2/3 does 8 x 2/3 = 5.333 ms of its 10 by then and its 4.667 ms left alone after: it ends at 12.667 ms
    (the same end as when the send starts at 1 ms, as the NIC's work says: 0.75 x 10 + 0.8 x 5 = 11.5 ms
    of NIC time, the NIC full for 8 ms and the all-gather's 0.75 for the rest). The compute, issued
    before the send, waits for that end (not the 10 ms the all-gather has alone): 12.667 to 14.667 ms,
    all of it exposed on fsdp; one ordered run, nothing placed twice."""
    comm = CommTimes(t={AG: 0.010, SEND: 0.005}, nic={AG: 0.75, SEND: 0.8})
    ev = {}

    def build(s):
        ev["ag"] = s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[])
        s.compute("L0", 0.002, [ev["ag"]])
        ev["send"] = s.comm("cp", "forward", "send/recv", "cp send", after=[])
    unit = simulate(build, comm, None, Overlap())
    assert (ev["send"].start_s, ev["send"].end_s) == (0.0, pytest.approx(0.008))
    l0 = next(e for e in unit.events if e.name == "L0")
    assert (l0.start_s, l0.end_s) == (pytest.approx(0.0126667, abs=1e-7), pytest.approx(0.0146667, abs=1e-7))
    assert unit.exposed_s["fsdp"] == pytest.approx(0.0126667, abs=1e-7)


def test_room_on_the_nic_costs_nothing():
    """Demands 0.5 and 0.5: the NIC carries both at full speed; the send ends at 1 + 5 = 6 ms, the
    all-gather at 10. The all-gather off the network (demand 0): the same. Both bandwidth-bound (demand
    1) and issued together: each runs at half while both run: the send's 5 ms take 10, it ends at 10
    ms; the all-gather did 5 of its 10 ms by then and ends 5 ms later, at 15 ms (the NIC's 15 ms of
    work in 15 ms; before, the earlier kept its 10 ms)."""
    for ag_share in (0.5, 0.0):
        unit, ev = _unit(ag_share, 0.5)
        assert (ev["send"].end_s, ev["ag"].end_s) == (pytest.approx(0.006), pytest.approx(0.010))
        assert unit.nic_wait == {}
    comm = CommTimes(t={AG: 0.010, SEND: 0.005}, nic={AG: 1.0, SEND: 1.0})
    ev = {}

    def build(s):
        ev["ag"] = s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[])
        ev["send"] = s.comm("cp", "forward", "send/recv", "cp send", after=[])
    simulate(build, comm, None, Overlap())
    assert (ev["send"].end_s, ev["ag"].end_s) == (pytest.approx(0.010), pytest.approx(0.015))


RS = ("shard", "layer", "backward", "reduce-scatter")
BAG = ("shard", "layer", "backward", "all-gather")


def test_fsdp2_reduce_scatter_beside_the_next_all_gather():
    """FSDP2 issues reduce-scatters on ``reduce_scatter_stream`` and all-gathers on
    ``all_gather_stream`` (torch 2.13 ``_fsdp_param_group.py`` lines 89-92): layer 1's reduce-scatter
    (8 ms alone, demand 0.6) issued at 0, then layer 0's all-gather (4 ms alone, demand 0.6). One
    queue (Megatron FSDP, DeepSpeed in the model): the all-gather waits for the reduce-scatter, 8 to 12
    ms. Two queues (FSDP2): both from 0, 1.2 of the NIC wanted, each gets half, 0.5 / 0.6 = 5/6 of its
    speed: the all-gather's 4 ms take 4.8 ms; the reduce-scatter did 4 of its 8 ms by then, and ends
    4 ms later alone, at 8.8 ms. config_overlap turns the two queues on for torch with FSDP2 only."""
    comm = CommTimes(t={RS: 0.008, BAG: 0.004}, nic={RS: 0.6, BAG: 0.6})
    ends = {}
    for two in (False, True):
        def build(s):
            rs = s.comm("shard", "backward", "reduce-scatter", "fsdp RS L1", "layer", after=[])
            ag = s.comm("shard", "backward", "all-gather", "fsdp AG L0", "layer", after=[])
            ends[two] = (rs, ag)
        simulate(build, comm, None, Overlap(fsdp_rs_queue=two))
        rs, ag = ends[two]
        ends[two] = (rs.end_s, ag.start_s, ag.end_s)  # set by the run, not while the unit is issued
    assert ends[False] == (pytest.approx(0.008), pytest.approx(0.008), pytest.approx(0.012))
    assert ends[True] == (pytest.approx(0.0088), 0.0, pytest.approx(0.0048))
    t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero3")
    assert config_overlap(t).fsdp_rs_queue
    assert not config_overlap(t.model_copy(update={"framework": "megatron"})).fsdp_rs_queue
    assert not config_overlap(t.model_copy(update={"zero3_engine": "deepspeed"})).fsdp_rs_queue


def test_nc31_step_charges_the_cp_sends(capsys, tmp_path):
    """Newcomer 31's top mesh (dp_shard 4 x cp 32 x tp 2 on 32 DGX H100, 400 Gb/s = 50 GB/s per GPU's
    NIC). Its table: the layer's FSDP all-gather of 855,670,784 B over 128 ranks, 4 a node, 4,856.1 us:
    through each member's NIC 127/128 x 855,670,784 / 4 = 212,246,425 B = 4.2449 ms at 50 GB/s, share
    0.87415; the cp K/V send of 8,388,608 B, 187.4 us: the boundary member's NIC 0.16777 ms, share
    0.8953. The forward's first cp send is issued while the next layer's all-gather (prefetched) runs
    and ends before it: demands 0.87415 + 0.8953 > 1, the max-min level 1/2 under both, so the send
    runs at 0.5 / 0.8953 = 0.55847 of its speed, 0.1874 / 0.55847 = 0.3356 ms, longer than the 0.2374 ms
    ring step beside it (step 0, the causal 4,096 x 4,096 diagonal: 2 x 4096^2 x 32 x 128 FLOP at FA3's
    579 TFLOP/s; its slack alone 0.050 ms); the all-gather meanwhile at 0.5 / 0.87415 = 0.57199 of its
    speed, so it loses at least 0.3356 x (1 - 0.57199) = 0.1436 ms to each send beside it: one a layer
    at least, 8 micro-batches x 79 layers with a next one, 632 x 0.1436 = 90.8 ms per step. The step's
    concurrent line says what the sharing cost each; the parts line exposes cp."""
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
    lengthened = float(re.search(r"lengthens cp's collectives by ([\d.]+) ms", line).group(1))
    assert lengthened > 0
    slowed = float(re.search(r"and fsdp's collectives by ([\d.]+) ms per step", line).group(1))
    assert slowed >= 632 * 0.3356 * (1 - 0.5 / ag_share)
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
    ms = float(re.search(r"lengthens cp's collectives by ([\d.]+) ms", line).group(1))
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
