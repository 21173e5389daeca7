"""The unit's event-ordered run (schedule/unit_events.py, issue 11 item 2): one ordered pass, each
network collective at its max-min fair share of the NIC among those running at every event, each
kernel slowed by the SMs of the collectives issued before it; nothing placed is moved afterwards.
The unit of Mixtral-8x7B under HSDP that jumped between schedules under nicshare4's pass iteration
(settle) is played once."""

from __future__ import annotations

import tomllib

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule import unit_sim
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap, simulate
from tests.conftest import EXAMPLES

AG = ("shard", "layer", "forward", "all-gather")
SEND = ("cp", "", "forward", "send/recv")
TP = ("tp", "", "forward", "all-reduce")


def test_a_third_collective_rebalances_the_two_running():
    """Three network collectives on one NIC, issued at once on three queues (``after=[]``): the
    all-gather (demand 0.9, 10 ms alone), the cp send (0.2, 2 ms) and a tp all-reduce (0.5, 3 ms)
    from 0. Max-min: 0.2 is under the level 1/3, it gets 0.2; the level of the 0.8 left over two is
    0.4, under 0.5 and 0.9: each 0.4. Rates: the send 1 (its demand), the all-reduce 0.4 / 0.5 = 0.8,
    the all-gather 0.4 / 0.9 = 4/9. The send ends at 2 ms; then 0.5 and 0.9 share the NIC at 1/2
    each: the all-reduce at 1 (did 1.6 of 3 ms; its 1.4 ms left end at 3.4 ms), the all-gather at
    0.5 / 0.9 = 5/9 from 2 ms. By 3.4 ms the all-gather did 2 x 4/9 + 1.4 x 5/9 = 1.6667 ms of its 10;
    alone after, it ends at 3.4 + 8.3333 = 11.7333 ms. The NIC's work: 0.9 x 10 + 0.2 x 2 + 0.5 x 3 =
    10.9 ms of NIC time = 1 x 3.4 (full until 3.4 ms) + 0.9 x 8.3333 (the all-gather alone)."""
    comm = CommTimes(t={AG: 0.010, SEND: 0.002, TP: 0.003}, nic={AG: 0.9, SEND: 0.2, TP: 0.5})
    ev = {}

    def build(s):
        ev["ag"] = s.comm("shard", "forward", "all-gather", "fsdp AG L0", "layer", after=[])
        ev["send"] = s.comm("cp", "forward", "send/recv", "cp send", after=[])
        ev["ar"] = s.comm("tp", "forward", "all-reduce", "tp all-reduce", after=[])
    simulate(build, comm, None, Overlap())
    assert ev["send"].end_s == pytest.approx(0.002)
    assert ev["ar"].end_s == pytest.approx(0.0034)
    assert ev["ag"].end_s == pytest.approx(0.0034 + (0.010 - 0.002 * 4 / 9 - 0.0014 * 5 / 9), abs=1e-12)
    assert ev["ag"].end_s == pytest.approx(0.0117333, abs=1e-7)


def test_a_kernel_is_slowed_by_the_collectives_issued_before_it_only():
    """The SM rule of main's issue-order simulation (``unit_sim.progress``, MAX_SM_SHARE 0.9): a tp
    all-reduce off the NIC (4 ms, 0.5 of the SMs) issued at 0, then kernel L0 (2 ms): L0 runs at
    1 - 0.5 while it does, its 2 ms take 4 ms, to 4 ms (2 ms of contention). Kernel L1 (2 ms), then a
    second all-reduce issued after it with nothing to wait for but its queue (after the first, at 4
    ms): L1 from 4 to 6 ms is not slowed by it (issued after L1), as the issue-order rule had it."""
    comm = CommTimes(t={TP: 0.004}, share={TP: 0.5})
    ev = {}

    def build(s):
        s.comm("tp", "forward", "all-reduce", "tp AR 0", after=[])
        ev["l0"] = s.compute("L0", 0.002)
        ev["l1"] = s.compute("L1", 0.002)
        ev["ar1"] = s.comm("tp", "forward", "all-reduce", "tp AR 1", after=[])
    unit = simulate(build, comm, None, Overlap())
    assert (ev["l0"].start_s, ev["l0"].end_s) == (0.0, pytest.approx(0.004))
    assert (ev["l1"].start_s, ev["l1"].end_s) == (pytest.approx(0.004), pytest.approx(0.006))
    assert (ev["ar1"].start_s, ev["ar1"].end_s) == (pytest.approx(0.004), pytest.approx(0.008))
    assert unit.contention_s == pytest.approx(0.002)


def _mixtral_hsdp():
    data = tomllib.loads((EXAMPLES / "mixtral-8x7b_32xh100_ep8-dp32.toml").read_text())
    data["training"] |= {"sharding": "hsdp", "recompute": "layer", "ac_freq": 2, "param_dtype": "fp32"}
    data["mesh"] = {"names": ["dp_replicate", "dp_shard", "ep"], "shape": [2, 16, 8]}
    return config_from_dict(data, base=EXAMPLES)


def test_the_unit_pass_iteration_could_not_settle_runs_once(monkeypatch):
    """Mixtral-8x7B (examples/mixtral-8x7b_32xh100_ep8-dp32.toml) under HSDP, dp_replicate 2 x
    dp_shard 16 x ep 8 at per-layer AC every 2nd layer (a candidate meshplan search plans): its
    backward units' network collectives (FSDP2's reduce-scatters on their own stream beside the
    all-gathers, the HSDP all-reduces, the experts' efsdp collectives) slow each other. nicshare4's
    pass iteration issued such a unit again with the last pass's intervals as a forecast and jumped
    between schedules (589/591/675/591/717/590 ms, one backward unit); the event-ordered run builds
    and plays every unit once (one StreamSim a unit) and gives the same step on a second plan.
    Units are built by :func:`~meshplan.schedule.rank_timeline.forward_unit` and
    :func:`~meshplan.schedule.backward_pass.backward_unit`: ``simulate`` is counted in both."""
    made = []
    real = unit_sim.StreamSim

    class Counted(real):
        def __init__(self, comm, w, ov):
            super().__init__(comm, w, ov)
            made.append(self)

    monkeypatch.setattr(unit_sim, "StreamSim", Counted)
    calls = []
    real_sim = unit_sim.simulate

    def simulate_(build, comm, w, ov):
        calls.append(1)
        return real_sim(build, comm, w, ov)
    from meshplan.schedule import backward_pass, rank_timeline
    monkeypatch.setattr(rank_timeline, "simulate", simulate_)
    monkeypatch.setattr(backward_pass, "simulate", simulate_)
    st = step_time(build_plan(_mixtral_hsdp()))
    assert calls and len(made) == len(calls)
    monkeypatch.undo()
    assert step_time(build_plan(_mixtral_hsdp())).step_s == st.step_s
