"""calib37: a calibration sets the collective kinds it measured and never makes a slower network
faster (meshplan/comm/calibration_kinds.py); an NVLink calibration moves ``compute`` only by the
SM contention it changes (meshplan/schedule/contention_line.py).

The nccl-tests logs here are written from the catalog's own prediction of the very run (each
row's busbw is s x what the uncalibrated model gives that op, rank count and size), so "slower"
means slower at every logged size than the catalog, by the factor s < 1 (at s = 1 the busbw
column's two decimals alone can make a row 0.01% faster)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from meshplan.catalog import system
from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.nccl_algorithms import collective_time
from meshplan.comm.calibrate import calibrate_curves
from meshplan.comm.calibration import calibration_toml, load_calibration
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.calibration_kinds import per_nic
from meshplan.comm.nccl_protocols import REFERENCE_STEP_S
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from tests.cli_run import run_cli
from tests.nccl_published import published_text

ROOT = Path(__file__).resolve().parents[1]
D4 = ROOT / "benchmarks" / "fidelity" / "megatron-175b_64xa100_tp8-pp8-vpp3_sp-selective.toml"
S15 = ROOT / "tests" / "data" / "nccl" / "all_reduce_perf_8xa100_s15.txt"
SIZES = [2 ** k for k in range(3, 34)]  # 8 B to 8 GiB, every power of 2
A100 = "NVIDIA A100-SXM4-80GB"

#: 4 DGX A100: tp 8 inside a node, pp 2 and dp 2 across nodes, one rank per node in each pp and dp
#: group (the pair curve "p2p" and the one-rank-per-node all-reduce "nic1" both in use).
CONFIG = """
[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-a100"
nodes = 4
[training]
global_batch = 16
seq_len = 2048
micro_batch = 1
recompute = "selective"
[mesh]
names = ["dp_replicate", "pp", "tp"]
shape = [2, 2, 8]
sequence_parallel = true
"""


def _catalog_log(path: Path, scale: float, per_host: int) -> Path:
    """all_reduce_perf over 2 hosts x ``per_host`` GPUs whose busbw at each of SIZES is ``scale``
    x the uncalibrated dgx-a100 model's for that run (its fastest algorithm on the catalog curves)."""
    node = system("dgx-a100", nodes=2).node
    n = 2 * per_host
    rows = []
    for size in SIZES:
        _, t = collective_time("all-reduce", n, size, 25e9 * per_host, "network", nodes=2,
                               intra_bandwidth_bytes_per_s=node.fabric.bandwidth_bytes_per_s, curves=node.busbw,
                               ranks_per_node=per_host)
        rows.append((size, scale * busbw_factor("all-reduce", n) * size / t / 1e9))
    hosts = [h for h in ("node-a", "node-b") for _ in range(per_host)]
    path.write_text(published_text("all_reduce_perf", hosts, A100, rows, f"catalog x {scale}"))
    return path


def _calibrate(tmp: Path, log: Path) -> dict:
    fits, _, sources, curves, split = calibrate_curves([log], "nic", system="dgx-a100")
    out = tmp / f"{log.stem}.toml"
    out.write_text(calibration_toml(fits, sources, curves=curves, nics_per_node=split))
    return load_calibration(out)


def _network_rows(plan) -> dict:
    return {(k, r.axis, r.phase, r.op, r.size_bytes): r.time_s for k in range(len(plan.stages))
            for r in plan.stage(k).collectives if r.path.kind == "network"}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scale=st.sampled_from([0.35, 0.6, 0.85, 0.97]), per_host=st.sampled_from([1, 8]))
def test_slower_measured_nic_makes_no_network_part_faster(tmp_path, scale, per_host):
    cfg_path = tmp_path / "small.toml"
    cfg_path.write_text(CONFIG)
    cfg = load_config(cfg_path)
    base = build_plan(cfg)
    calib = _calibrate(tmp_path, _catalog_log(tmp_path / f"ar_{per_host}_{scale}.txt", scale, per_host))
    slow = build_plan(replace(cfg, cluster=apply_calibration(cfg.cluster, calib)))
    before, after = _network_rows(base), _network_rows(slow)
    assert set(before) == set(after) and {k[1] for k in before} >= {"pp", "dp_replicate"}
    for key, t in before.items():
        assert after[key] >= t * (1 - 1e-9), key  # never faster, whichever NIC pattern the row runs
    pair = [k for k in before if k[3] == "send/recv"]
    assert pair and after[pair[0]] > before[pair[0]]  # the pp pair: S18's curve scaled by about s
    a, b = step_time(base), step_time(slow)
    for part in ("exposed pp", "exposed dp_replicate"):
        assert b.parts_s().get(part, 0.0) >= a.parts_s().get(part, 0.0) * (1 - 1e-9)
    assert b.step_s >= a.step_s * (1 - 1e-9)


def test_calib37_repro_pair_stays_on_its_own_curve(tmp_path):
    """The issue's run: 2 x 1 A100 all-reduce at 18.71 GB/s (alpha 25 us). Before, the pp pair
    went from S18's pair curve (415.6 us, 15.1 GB/s) to the all-reduce fit (338.8 us, 18.6 GB/s).
    Now the pair curve stays, x r = 18.70 (the log's busbw at 1 GiB) / 18.65 (S18's 2 x 1
    all-reduce there) = 1.00268, read at the calibrated NIC rate over the scaled line."""
    rows = [(s, 1.0 * s / (25e-6 + s / 18.71e9) / 1e9) for s in SIZES]
    log = tmp_path / "all_reduce_2node.txt"
    log.write_text(published_text("all_reduce_perf", ["node-a", "node-b"], A100, rows, "issue calib37"))
    calib = _calibrate(tmp_path, log)
    cat = system("dgx-a100", nodes=2)
    c = apply_calibration(cat, calib)
    pair = c.node.busbw["p2p"]
    measured = per_nic(c.node.busbw["nic"], 2**30, 18.71)
    assert round(measured, 2) == 18.70 and pair.busbw_gb_per_s == [15.48]
    r = c.node.nics[0].rate_gbit_per_s / 8 / pair.line_gb_per_s
    assert r == pytest.approx(measured / 18.65, rel=1e-9) and round(r, 5) == 1.00268
    assert "scaled x1.003" in pair.source and not pair.calibrated and c.node.busbw["nic"].calibrated
    # the pair's time at the pp message (6 MiB, the 175B SP activation / tp 8): S18's curve read as a
    # catalog curve, its bandwidth term / r; never the all-reduce fit's 18.71 GB/s
    size = 6291456
    _, t_cat = collective_time("send/recv", 2, size, 25e9, "network", nodes=2, curves=cat.node.busbw, ranks_per_node=1)
    bw = c.node.nics[0].rate_gbit_per_s / 8 * 1e9
    _, t_cal = collective_time("send/recv", 2, size, bw, "network", nodes=2, curves=c.node.busbw, ranks_per_node=1,
                               calibrated=True, latency_scale=c.network[0].latency_s / REFERENCE_STEP_S["network"])
    assert round(t_cat * 1e6, 1) == 415.6 and size / t_cal / 1e9 < 15.5 < 18.6
    assert t_cal == pytest.approx(t_cat / r, rel=0.01)


@pytest.fixture(scope="module")
def d4_pair():
    cfg = load_config(D4)
    fits, _, sources, curves, split = calibrate_curves([S15])
    return cfg, fits, sources, curves, split


def test_nvlink_calibration_moves_compute_only_by_sm_contention(tmp_path, d4_pair):
    """D4 (Megatron-LM 2022, tp 8 with SP) calibrated with S15's 8 x A100 NVLink all-reduce only.
    The compute part moved (calib37 (b)) for two reasons: get_batch's tp broadcasts were compute
    (now on the tp stream, exposed tp), and kernels overlapping NVLink collectives run on the SMs
    their NCCL channels leave: 24 channels of 108 SMs (nccl-tests issue #100), 2/9. The second is
    the model: compute less the contention is the same with and without the calibration, and
    a backward unit's contention is 2/9 x the NVLink collectives it overlaps (a kernel of D
    overlapping c seconds of a collective ends at D + c f)."""
    cfg, fits, sources, curves, split = d4_pair
    out = tmp_path / "nvl.toml"
    out.write_text(calibration_toml(fits, sources, curves=curves, nics_per_node=split))
    calib = load_calibration(out)
    assert set(calib) == {"nvlink"}
    a = step_time(build_plan(cfg))
    b = step_time(build_plan(replace(cfg, cluster=apply_calibration(cfg.cluster, calib))))
    ca, cb = a.contention_s(), b.contention_s()
    assert ca > 0 and cb > 0 and abs(ca - cb) > 1e-4  # the calibration changes the tp collectives' length
    assert a.parts_s()["compute"] - ca == pytest.approx(b.parts_s()["compute"] - cb, rel=1e-12)
    f = 24 / 108
    for st_ in (a, b):
        keys, _ = st_.unit_index if st_.unit_index else st_.units.index(st_.pipeline.flat)
        unit = st_.units.by_key(next(k for k in keys if k[0] == 0 and k[2] == "B"))
        computes = [e for e in unit.events if e.stream == "compute"]
        inside = [e for e in unit.events if e.stream == "tp"
                  and any(c.start_s <= e.start_s and e.end_s <= c.end_s for c in computes)]
        assert inside and unit.contention_s == pytest.approx(f * sum(e.end_s - e.start_s for e in inside), rel=1e-9)


def test_step_prints_the_contention_line(capsys):
    rc, out, _ = run_cli(["step", D4], capsys)
    assert not rc
    line = next(x for x in out.splitlines() if x.startswith("SM contention:"))
    st_ = step_time(build_plan(load_config(D4)))
    assert f"includes {st_.contention_s() * 1e3:.2f} ms" in line and "hold up to 22% of the SMs" in line
    assert f"compute less it, {(st_.parts_s()['compute'] - st_.contention_s()) * 1e3:.2f} ms" in line


def test_a_sendrecv_run_sets_the_pair(tmp_path):
    """A sendrecv_perf run over 2 hosts beside the all-reduce: the all-reduce fit stays the class's
    (calibrate keeps the all-reduce fit), and the pair reads the logged send/recv busbw itself:
    at the logged 1 GiB, 12.00 GB/s (the file's busbw column), not S18's 15.48 scaled."""
    ar = _catalog_log(tmp_path / "ar.txt", 0.9, 1)
    rows = [(s, s / (30e-6 + s / 12.0e9) / 1e9) for s in SIZES]
    text = published_text("sendrecv_perf", ["node-a", "node-b"], A100, rows, "a pair at 12 GB/s")
    sr = tmp_path / "sr.txt"
    sr.write_text(text.replace("     sum  ", "    none  "))
    fits, notes, sources, curves, split = calibrate_curves([ar, sr], "nic", system="dgx-a100")
    assert [f.op for f in fits] == ["all-reduce"] and {c.op for c in curves["nic"]} == {"all-reduce", "send/recv"}
    out = tmp_path / "both.toml"
    out.write_text(calibration_toml(fits, sources, curves=curves, nics_per_node=split))
    c = apply_calibration(system("dgx-a100", nodes=2), load_calibration(out))
    pair = c.node.busbw["p2p"]
    assert pair.op == "send/recv" and not pair.calibrated and "sr.txt" in pair.source
    bw = c.node.nics[0].rate_gbit_per_s / 8 * 1e9
    _, t = collective_time("send/recv", 2, 2**30, bw, "network", nodes=2, curves=c.node.busbw, ranks_per_node=1,
                           calibrated=True, latency_scale=c.network[0].latency_s / REFERENCE_STEP_S["network"])
    assert round(2**30 / t / 1e9, 2) == 12.0
    said = next(n for n in notes if n.startswith("nic: this file sets, across nodes, all-reduce, all-gather and "
                                                 "reduce-scatter (the all-reduce fit over 2 ranks"))
    # trial 28: each op from its own run; all-to-all, which no file measures, keeps the catalog's curve
    assert f"and send/recv (its own logged curve: {pair.source})" in said
    assert said.endswith("; all-to-all keeps the catalog's curve (an alltoall_perf log over several ranks per host "
                         "sets it)")
