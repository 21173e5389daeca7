"""unit_sim.settle on a unit whose plain fixed point never settles (issue 11 item 2): Mixtral-8x7B
(examples/mixtral-8x7b_32xh100_ep8-dp32.toml) under HSDP, dp_replicate 2 x dp_shard 16 x ep 8 at
per-layer AC every 2nd layer, one of the candidates meshplan search plans for that example. Its
backward units' network collectives (FSDP2's reduce-scatters on their own stream beside the
all-gathers, the HSDP all-reduces, the experts' efsdp collectives) move each other's ends, and a
pass run with the last pass's intervals as its forecast jumps between schedules: one backward unit
589/591/675/591/717/590/591/591 ms over 8 passes (before this test, the last of 8 was taken: for another
601/727/602/747/602/660/603/693 ms, 693 ms, the top of a jump)."""

from __future__ import annotations

import tomllib

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule import rank_timeline, unit_sim
from meshplan.schedule.nic_fair import residual
from meshplan.schedule.steptime import step_time
from tests.conftest import EXAMPLES


def _config():
    data = tomllib.loads((EXAMPLES / "mixtral-8x7b_32xh100_ep8-dp32.toml").read_text())
    data["training"] |= {"sharding": "hsdp", "recompute": "layer", "ac_freq": 2, "param_dtype": "fp32"}
    data["mesh"] = {"names": ["dp_replicate", "dp_shard", "ep"], "shape": [2, 16, 8]}
    return config_from_dict(data, base=EXAMPLES)


def _passes(monkeypatch, damp_from: int):
    """(each settle call's passes as (forecast, intervals, unit duration) each, the UnitSims settle
    returned, the step) with relaxation from pass ``damp_from``."""
    calls: list = []
    real = unit_sim.StreamSim

    class Recorded(real):
        def __init__(self, comm, w, ov, forecast=None):
            super().__init__(comm, w, ov, forecast)
            self.forecast = forecast
            calls[-1][0].append(self)

    real_settle = unit_sim.settle

    def settle(build, comm, w, ov):
        calls.append(([], None))
        got = real_settle(build, comm, w, ov)
        calls[-1] = (calls[-1][0], got)
        return got

    monkeypatch.setattr(unit_sim, "StreamSim", Recorded)
    monkeypatch.setattr(unit_sim, "DAMP_FROM", damp_from)
    monkeypatch.setattr(rank_timeline, "settle", settle)
    st = step_time(build_plan(_config()))
    monkeypatch.undo()
    return calls, st


def test_a_unit_that_never_settles_takes_its_pass_nearest_its_forecast(monkeypatch):
    """Without relaxation (forecast = the last pass's intervals) some backward unit runs all
    MAX_PASSES = 10 passes and jumps by more than 10% of its length between two of them (the 675 and
    717 ms passes beside 590 ms ones). With it (from the first pass whose distance to its forecast did
    not fall, the forecast is the mean of the last forecast and the last pass) every unit still ends
    within 10 passes, and a unit that does not settle returns the pass nearest its forecast (the least
    residual): the returned timeline is that pass's, its residual under 1% of the unit (the relaxed
    passes' distance to their forecast halves each pass: 89 -> 46 -> 23 -> 11 -> 8 -> 4 ms of a 590 ms
    unit; 147 -> 73 -> 37 -> 18 -> 10 ms and on of a 604 ms one), and the same on a second run."""
    plain, _ = _passes(monkeypatch, 99)
    jumpy = [p for p, _ in plain if len(p) == unit_sim.MAX_PASSES
             and max(s.last.end_s for s in p) > 1.1 * min(s.last.end_s for s in p)]
    assert jumpy
    calls, st = _passes(monkeypatch, unit_sim.DAMP_FROM)
    assert max(len(p) for p, _ in calls) <= unit_sim.MAX_PASSES
    unsettled = [(p, got) for p, got in calls if p[-1].book.moved and len(p) == unit_sim.MAX_PASSES
                 and residual(p[-1].book.intervals(), p[-2].book.intervals()) > 0]
    assert unsettled
    for p, got in unsettled:
        gaps = [residual(s.book.intervals(), s.forecast) for s in p[1:]]
        nearest = p[1 + gaps.index(min(gaps))]
        assert got == nearest.finish()
        assert min(gaps) < 0.01 * got.duration_s
    _, again = _passes(monkeypatch, unit_sim.DAMP_FROM)
    assert again.step_s == st.step_s
