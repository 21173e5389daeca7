"""Pipeline p2p calls whose peers are both over NVLink (meshplan.pipeline.rendezvous.call_seconds,
whose docstring gives the sources): a send and a receive in one ``batch_isend_irecv`` run beside
each other (NVLink is full duplex: ~783 GB/s bidirectional against 371-377 GB/s one way between two
H100s, NVIDIA/nccl issue #1264; nccl-tests' busbw is reached sending and receiving at once,
nccl-tests PR #189), while two sends to different peers share the GPU's NVLink egress and add
(NCCL gives one NVLink peer channels for all 18 links, nccl 5067397 src/graph/paths.cc
``ncclTopoGetNchannels``; one pair already measures at the 8-GPU ring's per-GPU rate, ~370 GB/s,
nccl-tests issue #212)."""

from __future__ import annotations

import pytest

from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.rendezvous import call_seconds, calls
from meshplan.pipeline.sim_types import PipelineSpec
from meshplan.schedule.pipeline_exposure import call_seconds as array_call_seconds

T = 0.3  # one transfer across every boundary, all on NVLink (link 0)


def test_1f1b_send_and_receive_in_one_call_take_one_transfer():
    """1F1B, p 3, m 4, blocking (Megatron-LM 2022): stage 1 runs F0 F1 B0 F2 B1 F3 B2 B3. Every
    call after a unit of stage 1 carries a send and a receive on NVLink (after F0: F0's output to
    stage 2 and F1's input from stage 0, two different peers and directions; after B0: B0's
    gradient to stage 0 and F2's input from 0), so each takes T = 0.3 s, not 2 T; the leading call
    (F0's input alone) and the last (B3's gradient alone) T as well: 9 calls of 0.3 s, by both the
    event and the array simulation."""
    spec = PipelineSpec("1f1b", 3, 4, p2p_s=(T, T, T), p2p_link=(0, 0, 0), blocking_p2p=True)
    orders = [spec.sched.order(3, 4, 1, s) for s in range(3)]
    _, xfer = calls(spec, orders)
    sends = {x[1] for x in xfer.values()}
    recvs = {x[2] for x in xfer.values()}
    mixed = sorted(k for k in sends & recvs if k[0] == 1)
    assert mixed == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6)]  # a send and a receive each
    secs = call_seconds(spec, xfer)
    assert sorted(v for k, v in secs.items() if k[0] == 1) == [T] * 9
    assert array_call_seconds(simulate_arrays(spec))[1].tolist() == [T] * 9


def test_interleaved_two_sends_to_two_nvlink_peers_add():
    """Interleaved 1F1B, p 3, m 6, v 2: in the steady state stage 1's call sends a forward output
    to stage 2 and an input gradient to stage 0 (and receives from both): two sends through the
    one NVLink egress, 2 T = 0.6 s; the warm-up's and cool-down's calls T. The array simulation's
    25 calls of stage 1: 5 of T, then 8 steady calls of 2 T with an empty one between each two
    (the slot after a unit whose output leaves with the next), then 5 of T."""
    spec = PipelineSpec("interleaved_1f1b", 3, 6, v=2, p2p_s=(T, T, T), p2p_link=(0, 0, 0), blocking_p2p=True)
    orders = [spec.sched.order(3, 6, 2, s) for s in range(3)]
    secs = call_seconds(spec, calls(spec, orders)[1])
    assert sorted(set(round(v, 9) for k, v in secs.items() if k[0] == 1)) == [T, 2 * T]
    row = [round(x, 9) for x in array_call_seconds(simulate_arrays(spec))[1].tolist()]
    assert row == [T] * 5 + [2 * T, 0.0] * 7 + [2 * T] + [T] * 5


def test_two_sends_on_one_link_pay_the_fixed_part_once():
    """With a pair time (two transfers of a boundary's size at once through its link, one NCCL
    group: one kernel, each peer on its own channels), interleaved 1F1B's steady call of stage 1
    takes rendezvous.link_load's max fixed part + each share: pair 0.4 s against T 0.3 s gives
    fixed 2 x 0.3 - 0.4 = 0.2 and share 0.1 each, 0.2 + 0.1 + 0.1 = 0.4 s (not 0.6); calls with one
    transfer a side keep T. Both simulations, the same 25 calls as without it."""
    spec = PipelineSpec("interleaved_1f1b", 3, 6, v=2, p2p_s=(T, T, T), p2p_link=(0, 0, 0), p2p_pair_s=(0.4, 0.4, 0.4),
                        blocking_p2p=True)
    orders = [spec.sched.order(3, 6, 2, s) for s in range(3)]
    secs = call_seconds(spec, calls(spec, orders)[1])
    assert sorted(set(round(v, 9) for k, v in secs.items() if k[0] == 1)) == [T, 0.4]
    row = [round(x, 9) for x in array_call_seconds(simulate_arrays(spec))[1].tolist()]
    assert row == [T] * 5 + [0.4, 0.0] * 7 + [0.4] + [T] * 5
    one = PipelineSpec("interleaved_1f1b", 3, 6, v=2, p2p_s=T, p2p_pair_s=0.4, blocking_p2p=True)  # one value
    assert [round(x, 9) for x in array_call_seconds(simulate_arrays(one))[1].tolist()] == row


def test_pair_times_by_hand_nvlink_and_nic():
    """Megatron interleaved pp 4 x dp 4 on two dgx-h100 nodes (stages 0-1 and 2-3 share a node:
    boundaries 0 and 2 on NVLink, 1 and the wrap 3 across nodes), a 4 KiB activation (b 1, s 32,
    h 64, bf16). NVLink (tests/nccl_published.h100_nvlink_s's reading of the h100-nvlink4-ring
    curve: 1K row 1.75 x 1,024 / 0.07e9 = 25.6 us, 64K row 1.75 x 65,536 / 2.72e9 = 42.165 us,
    linear between; less the curve's LL latency 15.0 us, over 1.75; plus a send/recv's 7.2 us):
    one 4 KiB send 7.2 + (25.6 + 16.565 x 3,072 / 64,512 - 15.0) / 1.75 = 13.708 us, two at once
    (8 KiB through the one egress) 7.2 + (25.6 + 16.565 x 7,168 / 64,512 - 15.0) / 1.75 = 14.309 us,
    against 27.416 us added. Across nodes (the NIC pair of meshplan.comm.pp_rows.timed_boundary:
    9.3 us + S at 47.10 GB/s): 9.387 us one, 9.3 + 8,192 / 47.10e9 = 9.474 us two."""
    from meshplan.config import config_from_dict
    from meshplan.plan import build_plan
    from meshplan.schedule.comm_times import nccl_sm_share
    from meshplan.schedule.steptime import _stage_comms, boundary_p2p_s
    model = dict(layers=8, hidden=64, ffn=256, gated_mlp=False, q_heads=4, kv_heads=2, vocab=256)
    cfg = config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 32, "micro_batch": 1, "framework": "megatron",
                                         "sharding": "zero1"},
                            "mesh": {"names": ["pp", "dp"], "shape": [4, 4], "pp_schedule": "interleaved_1f1b",
                                     "virtual_stages": 2}})
    plan = build_plan(cfg)
    times, links, pair = boundary_p2p_s(plan, _stage_comms(plan, 4, nccl_sm_share(cfg.cluster)))
    assert links == (0, 1, 0, 1)
    t64 = 1.75 * 65536 / 2.72e9 * 1e6
    nvl = [7.2 + (25.6 + (t64 - 25.6) * (n - 1024) / 64512 - 15.0) / 1.75 for n in (4096, 8192)]
    assert [round(x, 3) for x in nvl] == [13.708, 14.309]
    assert times[0] * 1e6 == pytest.approx(nvl[0], rel=1e-4) and pair[0] * 1e6 == pytest.approx(nvl[1], rel=1e-4)
    assert times[1] * 1e6 == pytest.approx(9.3 + 4096 / 47.10e3, abs=2e-3)
    assert pair[1] * 1e6 == pytest.approx(9.3 + 8192 / 47.10e3, abs=2e-3)
