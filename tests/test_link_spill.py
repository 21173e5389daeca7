"""A newcomer's trial of ``meshplan step`` (examples/llama3-70b_128xh100_dp16-tp8.toml: Llama-3-70B,
dp_shard 16 x tp 8 on 16 dgx-h100, one micro-batch of 8192 tokens, full recompute, blocking TP):
every NIC's edge-load line said ``busy 1.318 s of 1.098 s ... DOES NOT FIT`` while the parts line
exposed 54.05 ms of fsdp. The window is the stage's compute time, and the fsdp time past it runs
mostly while the compute waits for tp (:mod:`meshplan.schedule.link_spill`). Each number is checked
against the timeline's events, merged here by a plain interval sweep, and the parts line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.link_spill import network_spill, network_streams, spill_line
from meshplan.schedule.linkload import edge_loads
from meshplan.schedule.steptime import step_time
from tests.cli_run import run_main
from tests.conftest import EXAMPLES

TRIAL = EXAMPLES / "llama3-70b_128xh100_dp16-tp8.toml"


@pytest.fixture(scope="module")
def trial():
    plan = build_plan(load_config(TRIAL))
    return plan, step_time(plan)


def _merged(intervals):
    """Union of (start, end) pairs as sorted disjoint pairs."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(xs):
    return sum(b - a for a, b in xs)


def _minus(xs, ys):
    """Length of the union ``xs`` outside the union ``ys``."""
    inside = sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)
    return _length(xs) - inside


def _events(st, stream):
    """The trace's events of ``stream`` on stage 0, without the whole units (F0, B0)."""
    return [(e.start_s, e.end_s) for e in st.trace_events(stage=0)
            if e.stream == stream and e.end_s > e.start_s and e.name not in ("F0", "B0")]


def test_window_is_the_stage_compute_without_the_optimizer(trial):
    """The NIC lines' 1.098 s: the parts line's compute (1105.09 ms) less the optimizer step,
    which runs after the units; 65.9 GB per NIC at 50 GB/s (400 Gb/s ConnectX-7) is 1.318 s. (nicshare:
    1105.12 -> 1105.09 ms, the window 1097.69 -> 1097.67 ms: under FSDP2's reduce-scatter stream the
    backward unit is 14.805 ms shorter, 14.784 ms of it exposed fsdp (test_step_tp_hint's
    test_eager_config_gets_torch_compile_with_async_tp), the other 0.021 ms its kernels' SM contention.)
    (nc52fixC: fsdp's all-gathers and reduce-scatters cross nodes and now hold 16 of the H100's 132 SMs
    while they run, NCCL's 2 rings per NIC (row_shares.nccl_net_channels; NVIDIA/nccl connect.cc:457), where
    they held none: the compute they overlap slows by 197.96 ms of SM contention: compute 1105.09 -> 1302.22 ms, the window 1097.67 -> 1294.79 ms, the optimizer
    step's 7.425 ms and the NIC's 1.318 s unchanged.) (Merged with es50, whose replayed closing tp
    reduce-scatters run on the compute stream but count as exposed tp, not compute (the window 1097.67 ms
    unchanged on int): the fsdp collectives beside the 80 replays (27.26 ms) overlap less kernel time, so
    the contention 197.96 -> 191.36 ms (read from the model, test_step_tp_hint): compute 1302.22 - 6.61 =
    1295.61 ms, the window 1295.61 - 7.425 = 1288.18 ms.) (kvheads: no repeat_kv copies, ``[memory] kv_expanded``
    false (the SDPA reads the 1 local KV head, enable_gqa): each layer's 37,748,736 B forward, backward and full
    recompute's replay at 2.97 TB/s, 3 x 12.71 us x 80 layers = 3.05 ms: the window 1288.18 -> 1285.13 ms.)"""
    plan, st = trial
    opt = sum(e.dur_s for e in st.post_events if e.stage == 0 and e.stream == "compute")
    loads = edge_loads(plan, st)
    nics = [e for e in loads if "NIC" in e.edge]
    assert len(nics) == 8 and not any(e.fits for e in nics)
    assert nics[0].interval_s == pytest.approx(st.parts_s()["compute"] - opt, rel=1e-9)
    assert round(nics[0].interval_s * 1e3, 2) == 1285.13 and round(opt * 1e3, 3) == 7.425
    assert round(3 * 80 * 37_748_736 / 2.97e12 * 1e3, 2) == 3.05
    assert round(nics[0].busy_s, 3) == 1.318 and nics[0].capacity_bytes_per_s == 50e9


def test_spill_is_the_fsdp_time_beside_no_compute(trial):
    """fsdp runs 1410.94 ms (its events merged), 333.19 ms of it outside every compute event;
    54.05 ms of that is the parts line's exposed fsdp, and fsdp time beside no compute while a
    tp collective runs (the compute waiting for tp) is the rest to within one tp collective
    (0.34 ms, where the compute waits for both and the sim counts fsdp, the later).
    (nicshare4, under FSDP2's reduce-scatters on their own stream sharing the NIC max-min: fsdp's
    merged events 1410.94 -> 1365.60 ms (a reduce-scatter and the next all-gather now overlap each
    other, each slowed to its share), 333.19 -> 309.42 ms beside no compute: the exposed 54.05 ->
    31.33 ms (the backward unit's exposed fsdp 25.341 -> 10.557 ms and its tail past it 18.448 ->
    10.504 ms: 54.05 - 14.784 - 7.944, test_step_tp_hint's derivation) and 279.13 -> 278.09 ms
    hidden while the compute waits for tp, to within one tp collective and two norm-grad all-reduces.)
    (nc52fixC: fsdp's all-gathers and reduce-scatters cross nodes and now hold 16 of the H100's 132 SMs
    while they run, NCCL's 2 rings per NIC (row_shares.nccl_net_channels; NVIDIA/nccl connect.cc:457), where
    they held none: on the branch without es50 the compute they overlap slowed by 197.96 ms of SM
    contention, so the same 1365.60 ms of fsdp lay more beside compute: 309.42 -> 274.16 ms beside none,
    exposed 31.33 -> 27.90 ms, hidden while the compute waits for tp 278.09 -> 246.25 ms.)
    (es50, torchtitan's full AC replays each layer's closing tp reduce-scatter, 0.34073 ms, in backward:
    fsdp's merged events unchanged at 1365.60 ms; on int without nc52fixC the exposed 31.33 -> 30.65 ms
    (two replays in a copy-in's wait for the reduce-scatter before it), 309.42 -> 310.46 ms beside no
    compute and 278.09 -> 279.81 ms hidden, the sweep's, traced not derived.)
    (Both, the merge: read from the model, not derived by hand: 301.41 ms beside no compute, of which
    27.90 ms exposed (the branch's: the compute slowed by contention covers the two FSDP waits the
    replays fell in) and 273.51 ms hidden while the compute waits for tp; the 80 replayed reduce-scatters
    add 80 x 0.34073 = 27.26 ms of compute-stream waits beside fsdp, 274.16 + 27.26 = 301.42, within the
    sweep's last bits of the 301.41 ms it reports.) (kvheads: 301.41 -> 301.43 and 273.51 -> 273.52 ms, the
    compute 3.05 ms shorter without the repeat_kv copies, test_window_is_the_stage_compute_without_the_optimizer,
    the same fsdp events a little less beside it.)"""
    plan, st = trial
    assert network_streams(plan) == ("fsdp",)
    s = network_spill(plan, st)
    fsdp, compute = (_merged(_events(st, k)) for k in ("fsdp", "compute"))
    assert s.busy_s == pytest.approx(_length(fsdp), rel=1e-9)
    assert s.spill_s == pytest.approx(_minus(fsdp, compute), rel=1e-9)
    assert s.exposed_s == st.exposed_s["fsdp"]
    assert s.window_s == edge_loads(plan, st)[1].interval_s
    assert [round(x * 1e3, 2) for x in (s.busy_s, s.spill_s, s.hidden_elsewhere_s)] == [1365.60, 301.43, 273.52]
    rs = next(r.time_s for r in plan.stage(0).collectives if (r.axis, r.phase, r.op) == ("tp", "backward", "reduce-scatter"))
    assert st.shown_ms()["exposed fsdp"] == "27.90"
    assert round(s.spill_s * 1e3 - 27.90, 2) == pytest.approx(273.52, abs=0.01)  # the spill less the exposed
    assert s.spill_s * 1e3 == pytest.approx(274.16 + 80 * rs * 1e3, abs=0.02)  # the branch's spill + the replays
    # and, since the reduce-scatters run on their own stream, the two gaps where the compute waits for a
    # tp norm-grad all-reduce (0.0595 ms) beside a reduce-scatter (L79's beside the head's, L0's beside
    # L1's), counted fsdp (the later): 0.3407 + 2 x 0.0595 = 0.4597 ms
    assert list(s.beside) == ["tp"] and abs(s.beside["tp"] - s.hidden_elsewhere_s) < 0.3408e-3 + 2 * 0.0596e-3


def test_line_names_the_window_and_async_tp(trial):
    """The line's figures, and async TP's: the same job with training.tp_comm_overlap and
    torch_compile (torchtitan's async TP needs compile) planned directly exposes 200.94 ms of fsdp
    (227.86 ms, step 1436.69 ms, before FSDP2's reduce-scatters ran beside the all-gathers: its backward
    unit 1040.068 -> 1020.228 ms, exposed fsdp 164.752 -> 145.777 ms and SM contention 0.865 -> 0 ms,
    its tail 18.448 -> 10.504 ms: 227.86 - 18.975 - 7.944 = 200.94 ms, 1436.69 - 19.840 - 7.944 =
    1408.91 ms; the plain step 1460.14 -> 1437.39 ms as test_step_tp_hint derives it).
    (nc52fixC: fsdp's all-gathers and reduce-scatters cross nodes and now hold 16 of the H100's 132 SMs
    while they run, NCCL's 2 rings per NIC (row_shares.nccl_net_channels; NVIDIA/nccl connect.cc:457), where
    they held none; es50: the eager step's replayed closing tp reduce-scatters. Both: the plain step
    1437.39 -> 1652.08 ms and its exposed fsdp 31.33 -> 27.90 ms as test_step_tp_hint derives them;
    async TP's (compiled: no replayed collective, so the branch's figures) step 1408.90 -> 1475.23 ms,
    its exposed fsdp 200.94 -> 29.93 ms (its compute, slowed by 237.34 ms of contention, now hides the
    gathers the shorter one left exposed); the window's compute 1097.67 -> 1288.18 ms, the model's sweep.)
    (kvheads, no repeat_kv copies: the plain step 1652.08 -> 1649.03 ms, the window 1285.13 ms; async TP's step
    1475.23 -> 1472.21 ms, its exposed fsdp 29.93 -> 29.97 ms, read from the model.)"""
    plan, st = trial
    line = spill_line(plan, st, network_spill(plan, st), step_time)
    t = plan.config.training.model_copy(update={"tp_comm_overlap": True, "torch_compile": True})
    on = step_time(build_plan(replace(plan.config, training=t)))
    assert on.shown_ms()["exposed fsdp"] == "29.97" and on.shown_ms()["step"] == "1472.21"
    assert line == ("where the NICs' traffic goes: on stage 0's timeline fsdp runs 1365.60 ms (its collectives' "
                    "modelled times) against the window's 1285.13 ms of compute; 301.43 ms of it while no compute "
                    "runs, of which 27.90 ms exposed (the parts line's exposed fsdp) and the other 273.53 ms while "
                    "the compute stream waits for tp (exposed tp), hidden there; with async TP "
                    "(training.tp_comm_overlap = true, training.torch_compile = true) tp no longer hides it: "
                    "exposed fsdp 27.90 -> 29.97 ms, step 1649.03 -> 1472.21 ms")
    assert "with async TP" not in spill_line(plan, st, network_spill(plan, st))  # no re-plan without step_fn


def test_step_prints_it_only_where_a_nic_does_not_fit(capsys):
    """Under the NIC lines of the trial; not for one node (examples/torchtitan_llama3-8b_8xh100.toml
    has no NIC traffic), whose window is still named in the header. (nicshare: the step 1.460 -> 1.437 s,
    FSDP2's reduce-scatters on their own stream, test_step_tp_hint.test_eager_config_gets_torch_compile_with_async_tp
    derives it: -22.75 ms; es50: + 78 x 0.34073 ms of replayed closing tp reduce-scatters; nc52fixC: fsdp's
    network rings hold 16 of 132 SMs; both, as test_step_tp_hint derives them: 1.437 -> 1.652 s, the
    window 1.098 -> 1.288 s; kvheads, no repeat_kv copies: 1.649 s, the window 1.285 s. nc54 #12: a capacities line under the header, so the spill line is the 11th
    below it: capacities, 1 NVLink and 8 NIC rows, then it.)"""
    assert run_main("step", TRIAL) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, x in enumerate(out) if x.startswith("edge load per step"))
    assert ("stage 0's compute time, its forward, backward and recompute kernels (1.285 s of the 1.649 s step"
            in out[head])
    assert out[head + 1].startswith("  capacities: ")
    assert out[head + 11].startswith("  where the NICs' traffic goes: ") and len(out) == head + 12
    assert run_main("step", EXAMPLES / "torchtitan_llama3-8b_8xh100.toml", "--cluster", "dgx-h100", "--nodes", "1") == 0
    out = capsys.readouterr().out
    assert "edge load per step" in out and "where the NICs' traffic goes" not in out
