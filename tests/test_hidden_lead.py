"""A window UNSHARD pass whose gathers are all done before it starts is its lead-inf timeline with
the gathers' events moved (meshplan.schedule.window_unshard.hidden_lead, a shortcut of
UnitTimes.by_key): the same UnitSim, every field and every event, as simulating the pass at its lead.

The plan (tests/test_unshard_window_timing.py): interleaved 1F1B, pp 2 x dp_shard 2, vpp 4, the
8-layer TINY model, zero3 kept gathered after forward, so every pass but a chunk's first finds its
chunk UNSHARDed by torch's window ahead of it.
"""

import math

import pytest

import meshplan.schedule.unit_times as ut
from meshplan.schedule.steptime import step_time
from meshplan.schedule.window_unshard import hidden_lead

from tests.test_unshard_window_timing import _plan


def _fields(u):
    return (u.duration_s, u.tail_s, u.exposed_s, u.tail_stream, u.host_wait_s, u.contention_s, u.nic_wait,
            [(e.stage, e.stream, e.name, e.start_s, e.end_s, e.args) for e in u.events])


@pytest.mark.parametrize("m", [2, 4])
def test_shortcut_equals_the_simulated_pass(m, monkeypatch):
    plan = _plan(m)
    fast = step_time(plan)
    derived = {k: u for k, u in fast.units.cache.items() if k[6] is not None and k[6] < math.inf and u.early is None}
    monkeypatch.setattr(ut, "hidden_lead", lambda base, lead: None)  # every pass simulated at its lead
    slow = step_time(plan)
    assert derived  # the shortcut is taken here: a case that cannot miss it
    for k, u in derived.items():
        assert _fields(u) == _fields(slow.units.cache[k]), k
    assert fast.step_s == slow.step_s


def test_gathers_back_to_back_from_the_lead_or_simulated():
    plan = _plan(2)
    units = step_time(plan).units
    k, base = next((k, u) for k, u in units.cache.items() if k[6] == math.inf and u.early)
    total = sum(w for _, w in base.early)  # the gathers' seconds alone, one after another on the fsdp queue
    # a lead of twice their seconds: the first starts at -2 total, the last ends at -total (within float rounding)
    got = hidden_lead(base, 2 * total)
    starts = sorted(got.events[i].start_s for i, _ in base.early)
    assert starts[0] == -2 * total
    assert max(got.events[i].end_s for i, _ in base.early) == pytest.approx(-total, rel=1e-12)
    assert got.duration_s == base.duration_s
    # a lead shorter than their seconds: the gathers run into the pass; it is simulated instead
    assert hidden_lead(base, 0.5 * total) is None and hidden_lead(base, 0.0) is None
