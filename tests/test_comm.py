"""Handed case C12 and the nccl-tests bus-bandwidth convention."""

import pytest

from meshplan.comm.alphabeta import busbw, busbw_factor, ring_time, steps
from meshplan.comm.nccl_protocols import NCCL_RING, NO_LATENCY


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


def test_algorithm_choice():
    from meshplan.comm.alphabeta import tree_time
    from meshplan.comm.nccl_algorithms import collective_time
    from meshplan.comm.nccl_protocols import NVLS_GAIN
    # a 1 GiB all-reduce inside an NVLS-capable node: in-switch reduction beats the ring
    alg, t = collective_time("all-reduce", 8, 2**30, 450e9, "nvlink", nvls=True)
    assert alg == "NVLS"
    # NCCL tuning.cc: an NVLS collective's latency is the NVLink hwLat of NVLS/Simple, 25 us, no base
    assert t == pytest.approx(25e-6 + 1.75 * 2**30 / (450e9 * NVLS_GAIN))
    assert collective_time("all-reduce", 8, 2**30, 300e9, "nvlink", nvls=False)[0] == "ring"
    # a 4 KiB all-reduce over 64 nodes: the tree's 2*log2(64) = 12 steps beat the ring's 126
    alg, t = collective_time("all-reduce", 64, 4096, 50e9, "network", nodes=64)
    assert alg == "tree" and t == pytest.approx(tree_time(64, 4096, 50e9))
    assert t < ring_time("all-reduce", 64, 4096, 50e9, network=True)
    # 16 ranks on 2 nodes, small all-gather: one network step plus 7 NVLink steps beat 15 network steps
    assert collective_time("all-gather", 16, 65536, 50e9, "network", nodes=2,
                           intra_bandwidth_bytes_per_s=450e9)[0] == "hierarchical"
    # large all-gather with one rank per node: only the ring applies
    assert collective_time("all-gather", 8, 2**30, 12.5e9, "network", nodes=8,
                           intra_bandwidth_bytes_per_s=450e9)[0] == "ring"


def test_gloo_runs_rings_only():
    from meshplan.comm.nccl_algorithms import collective_time
    assert collective_time("all-gather", 16, 65536, 50e9, "network", nodes=2, intra_bandwidth_bytes_per_s=450e9,
                           library="gloo")[0] == "ring"


def test_gloo_ring_step_costs_the_link_latency_with_one_protocol():
    """gloo has one protocol: each ring step costs the link's latency (cpu_testbed.toml:
    225 us per step over loopback) and the bytes go at the full link rate. A 256 B all-reduce
    over 2 ranks is 2 steps + 2 * (1/2) * 256 B / 0.5 GB/s = 450 us + 0.512 us; the
    2-rank gloo measurement it was taken from is 0.45 ms. NCCL's LL protocol (0.6 us per step
    at 0.5 efficiency) must not be applied to gloo."""
    from meshplan.comm.nccl_algorithms import collective_time

    alg, t = collective_time("all-reduce", 2, 256, 0.5e9, "nvlink", latency_scale=225 / 3.4, library="gloo")
    assert alg == "ring" and t == pytest.approx(2 * 225e-6 + 256 / 0.5e9, rel=1e-12)
    # across a network tier (reference 14 us per step): all-gather over 4 ranks = 3 steps
    _, t = collective_time("all-gather", 4, 4096, 1e9, "network", latency_scale=700 / 14, library="gloo")
    assert t == pytest.approx(3 * 700e-6 + 0.75 * 4096 / 1e9, rel=1e-12)
    # gloo runs reduce-scatter as an all-reduce of the full buffer: 6 steps and 2 * 3/4 * S
    _, t = collective_time("reduce-scatter", 4, 4096, 1e9, "network", latency_scale=700 / 14, library="gloo")
    assert t == pytest.approx(6 * 700e-6 + 1.5 * 4096 / 1e9, rel=1e-12)
    assert collective_time("reduce-scatter", 4, 4096, 1e9, "network", latency_scale=700 / 14)[1] < t / 1.5
