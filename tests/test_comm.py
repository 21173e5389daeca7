"""Handed case C12 and the nccl-tests bus-bandwidth convention."""

import pytest

from meshplan.comm import NCCL_RING, NO_LATENCY, busbw, busbw_factor, ring_time, steps


def test_c12_ring_volumes_and_times():
    S, bw = 14e9, 50e9
    assert busbw_factor("all-reduce", 8) * S == pytest.approx(24.5e9)
    assert ring_time("all-reduce", 8, S, bw, latency=NO_LATENCY) == pytest.approx(0.49)
    assert busbw_factor("reduce-scatter", 8) * S == pytest.approx(12.25e9)
    assert ring_time("reduce-scatter", 8, S, bw, latency=NO_LATENCY) == pytest.approx(0.245)
    assert ring_time("all-gather", 8, S, bw, latency=NO_LATENCY) == pytest.approx(0.245)


def test_c12_busbw_factors():
    assert busbw_factor("all-reduce", 8) == 1.75
    for op in ("all-gather", "reduce-scatter", "all-to-all"):
        assert busbw_factor(op, 8) == 7 / 8
    assert busbw_factor("broadcast", 8) == 1.0
    # busbw of a ring at its link rate equals the link rate
    t = ring_time("all-reduce", 8, 14e9, 50e9, latency=NO_LATENCY)
    assert busbw("all-reduce", 8, 14e9, t) == pytest.approx(50e9)


def test_nccl_latency_small_message():
    # public-facts: single-node 8-GPU ring all-reduce latency = 6.6 + 14 * 0.6 = 15 us (LL)
    assert steps("all-reduce", 8) == 14
    t = ring_time("all-reduce", 8, 8.0, 450e9, latency=NCCL_RING)
    assert t == pytest.approx(15e-6, rel=1e-3)


def test_large_message_uses_simple_protocol_bandwidth():
    t = ring_time("all-gather", 8, 8 * 2**30, 450e9)
    sent = 7 / 8 * 8 * 2**30
    assert t == pytest.approx(8.4e-6 + 7 * 3.4e-6 + sent / 450e9)


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown collective"):
        steps("gather", 4)
