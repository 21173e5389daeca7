"""Routed experts under FSDP2 (newcomer findings on examples/mixtral-8x7b_32xh100_ep8-dp32.toml):
the dim torchtitan shards them on, the bytes of their all-gather, the persistent memory that
agrees with it, the ZeRO textbook line counting them, and where the timeline gathers them.
Values derived by hand below.

Mixtral-8x7B at dp_shard 32, ep 8: one expert per rank and layer, efsdp = 32 / 8 = 4, and
4 x 8 > 8 experts, so FSDP2 shards dim 1 (torchtitan ``apply_fsdp``: ``Shard(1)`` past
efsdp x ep > experts): no padding. One layer's expert weights: 3 x 4096 x 14336 =
176,160,768 elements, gathered in bf16 (352,321,536 B), gradients reduce-scattered in fp32
(704,643,072 B). Per rank over 32 layers: 176,160,768 x 32 / 4 = 1,409,286,144 elements.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.config import load_config
from meshplan.memory.state_estimates import zero_textbook_bytes
from meshplan.mesh.tpsplit import expert_shard_dim, fsdp_padded_numel, fsdp_shard_len
from meshplan.plan import build_plan
from meshplan.report.text import _accounting_lines
from meshplan.spec.model import ModelSpec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"
LAYER_EXPERT = 3 * 4096 * 14336  # one expert's w_gate, w_up, w_down


@pytest.fixture(scope="module")
def plan():
    return build_plan(load_config(EXAMPLE))


def test_the_rule_is_torchtitans():
    # efsdp x ep > experts -> dim 1; equal or below -> dim 0
    assert [expert_shard_dim(8, f, e) for f, e in ((4, 8), (1, 8), (4, 2), (2, 4), (32, 1), (8, 1))] == [1, 0, 0, 0,
                                                                                                        1, 0]


def test_dim1_per_weight():
    """w_gate/w_up (E, f, h) shard f (cut by etp first), w_down (E, h, f) shards h."""
    m = ModelSpec(layers=1, hidden=4096, ffn=14336, q_heads=32, vocab=1, experts=8, top_k=2)
    ts = {t.name: t for t in m.layer_tensors(0) if t.expert}
    assert {n: fsdp_shard_len(t, m, 4, tp=2, ep=4, etp=2) for n, t in ts.items()} == {
        "experts_w_gate": 7168, "experts_w_up": 7168, "experts_w_down": 4096}
    assert {n: fsdp_shard_len(t, m, 2, tp=1, ep=2) for n, t in ts.items()} == dict.fromkeys(ts, 4)  # 2 x 2 <= 8: dim 0
    # 8 / ep 2 = 4 rows over efsdp 3 (3 x 2 <= 8: dim 0), padded to 6 rows
    assert fsdp_padded_numel(ts["experts_w_up"], m, 3, tp=1, ep=2) == 6 * 14336 * 4096


def test_mixtral_expert_rows_are_one_expert(plan):
    rows = {(r.phase, r.op): r for r in plan.stage(0).collectives if r.axis == "efsdp"}
    assert {k: (r.size_bytes, r.dtype, r.per_step) for k, r in rows.items()} == {
        ("forward", "all-gather"): (LAYER_EXPERT * 2, "bf16", 256),
        ("backward", "all-gather"): (LAYER_EXPERT * 2, "bf16", 256),
        ("backward", "reduce-scatter"): (LAYER_EXPERT * 4, "fp32", 256)}
    assert LAYER_EXPERT * 2 == 352_321_536


def test_mixtral_memory_agrees_with_the_gather(plan):
    """The persistent expert parameters per rank are the gathered elements / efsdp x layers,
    stored in fp32 (torchtitan's parameters, torch's default) and gathered in bf16 (FSDP2's
    MixedPrecisionPolicy): twice the gathered bytes / efsdp x layers."""
    state = plan.state[0]
    params = next(i for i in state.items if i.kind == "params" and i.group == "expert")
    assert (params.count, params.axis, params.divisor) == (1_409_286_144, "efsdp", 4)
    gather = next(r for r in plan.stage(0).collectives if r.axis == "efsdp" and r.op == "all-gather")
    assert gather.dtype == "bf16" and params.bytes_per_element == 4
    assert params.size_bytes == 2 * gather.size_bytes / 4 * 32 == 5_637_144_576


def test_zero_line_counts_the_experts(plan):
    """16 B per parameter (2 + 2 + 12): dense 1,605,636,096 / 32 + experts 5,637,144,576 / 4
    = 1,459,462,272 parameters per rank, 23,351,396,352 B (21.75 GiB), next to the framework
    table's 24.47 GiB at 18 B (fp32 gradients)."""
    line = _accounting_lines(plan, plan.state[0])[0]
    assert line.startswith("textbook accounting (ZeRO paper), ZeRO stage 3: 21.75 GiB ((2 + 2 + K) (psi / N + psi_e / "
                           "N_e) with psi 1.60564e+09 (dense), N 32, psi_e 5.63714e+09 (routed experts), N_e 4")
    z = zero_textbook_bytes(1_605_636_096, 32, stage=3, expert_params=5_637_144_576, expert_n=4)
    assert z.size_bytes == 16 * (1_605_636_096 // 32 + 5_637_144_576 // 4) == 23_351_396_352
    # a dense model's line is the paper's own
    assert zero_textbook_bytes(7.5e9, 64, stage=1).formula.startswith("4 psi + K psi / N with psi 7.5e+09, N 64,")
    # stages 0-2 with experts: the unsharded terms count both groups
    assert zero_textbook_bytes(10, 2, stage=1, expert_params=20, expert_n=4).size_bytes == 4 * 30 + 12 * (5 + 5)


def test_expert_gathers_are_prefetched_beside_the_layers(plan):
    """Newcomer finding 1: the timeline gathered each layer's experts on demand in forward and not
    at all in backward. torchtitan (``apply_fsdp``, ep > 1) prefetches [next block, its experts]
    in forward and [previous block, its experts] in backward (at b5bcd76 the experts are a
    parameter group of the block's unit, so the output layer's backward prefetch of the last block
    takes them too); only the first layer's experts (forward) are gathered at the layer's start. Each
    gather here (352,321,536 B over efsdp 4 across nodes) takes less than the layer pass it is
    issued beside (forward: the time between two layers' starts; backward: its reduce-scatter on
    the same efsdp stream included), so one gather per forward is exposed, the row's own time, and
    in backward the last layer's less the compute it runs beside: the head's backward and its
    unit's reduce-scatter copy-in (before, on demand after them: the whole 5.63 ms).

    Each of those gathers is issued beside the dense block's FSDP all-gather (84,164,608 B over dp_shard
    32, 8 a node, 0.3067 ms), which holds 31/32 x 84,164,608 / 8 = 10,191,808 B / 50 GB/s = 0.2038 ms of
    its 0.3067: 0.6646 of each rank's NIC; the experts' gather holds 3/4 x 352,321,536 = 264,241,152 B /
    50 GB/s = 5.2848 of its 5.6254 ms: 0.9395 (schedule/comm_times.py nic_share). Issued with the dense
    one, 0.6646 + 0.9395 > 1: the max-min level 1/2 under both demands, each gets half the NIC
    (schedule/nic_fair.py): the dense gather runs at 0.5 / 0.6646 = 0.7523 of its speed, its 0.3067 ms
    in 0.3067 x 2 x 0.6646 = 0.4077 ms, the experts' at 0.5 / 0.9395 = 0.5322 meanwhile: its exposure is
    its own time + 0.4077 x (1 - 0.5322) = 5.6254 + 0.1907 = 5.8161 ms (5.7688 before the dense one was
    slowed too: it kept its 0.3067 ms). In backward the last layer's experts' gather also meets the head's
    reduce-scatter (demand 0.8828, r = 1.4384 ms alone), issued after the head's backward and its copy-in
    (4.2988 ms): by then the gather did 0.2170 + (4.2988 - 0.4077) = 4.1081 ms of its 5.6254, 1.5173 left;
    both at half, the reduce-scatter takes 2 x 0.8828 r = 2.5396 ms, the gather does 0.8828 r / 0.9395 =
    1.3516 ms meanwhile and the 0.1657 left alone: it ends at 4.2988 + 2.5396 + 0.1657 = 7.0041 ms, exposed
    2.7052 ms after the head (1.5173 before: the head's reduce-scatter then took its fair half without
    slowing the gather). (nc52fixC: both gathers cross nodes and hold NCCL's network rings while they
    run, 2 x 8 NICs = 16 of the H100's 132 SMs each, s = 16/132 (row_shares.nccl_net_channels), and both
    are issued before the head's backward, which runs at 1 - 2s while both run (the dense one's 0.4077
    ms), then at 1 - s beside the experts' gather: its 4.2988 ms of kernels and copy-in end at 0.4077 +
    (4.2988 - 0.4077 x (1 - 2s)) / (1 - s) = 4.9479 ms, the gather still running (0.2170 + 4.9479 -
    0.4077 = 4.7572 of its 5.6254 ms done, 0.8681 left, unrounded); the head's reduce-scatter, issued
    then, shares the NIC at half each as above, but the gather's 0.8681 ms are now fewer than the 1.3516
    ms it would do beside the whole reduce-scatter: it ends first, after 0.8681 / (0.5 / 0.9395) =
    1.6311 ms, exposed after the head (2.7052 before).)"""
    from meshplan.schedule.comm_times import nic_share
    from meshplan.schedule.backward_pass import backward_unit
    from meshplan.schedule.rank_timeline import forward_unit
    from meshplan.schedule.steptime import step_time
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.schedule.workload import chunk_costs, workload_of
    rows = {(r.phase, r.op): r for r in plan.stage(0).collectives if r.axis == "efsdp"}
    ag, rs = rows[("backward", "all-gather")], rows[("backward", "reduce-scatter")]
    dense = next(r for r in plan.stage(0).collectives if r.axis == "dp_shard" and r.phase == "forward"
                 and r.op == "all-gather" and r.cadence == "every layer")
    assert (nic_share(dense), nic_share(ag)) == (pytest.approx(0.6646, abs=1e-4), pytest.approx(0.9395, abs=1e-4))
    shared = dense.time_s * 2 * nic_share(dense) * (1 - 0.5 / nic_share(ag))  # 0.1907 ms
    assert ag.size_bytes == 2 * LAYER_EXPERT and rows[("forward", "all-gather")].time_s == ag.time_s
    w = workload_of(plan)
    chunk, comm = chunk_costs(plan, w)[0][0], step_time(plan).units.comms[0]
    f = forward_unit(chunk, comm, w, Overlap())
    b = backward_unit("B", chunk, comm, w, Overlap(), last_grad_unit=True)
    for unit, phase, extra in ((f, "forward", 0.0), (b, "backward", rs.time_s)):
        starts = sorted(e.start_s for e in unit.events if e.stream == "compute" and e.name[1:].isdigit())
        assert len(starts) == 32 and min(y - x for x, y in zip(starts, starts[1:])) > ag.time_s + extra
        assert sum(1 for e in unit.events if e.stream == "efsdp" and e.args["op"] == "all-gather") == 32
        head = 0.0
        if phase == "backward":  # the compute before the last layer's: the head's backward, its copy-in
            head = max(e.end_s for e in unit.events if e.stream == "compute" and e.end_s <= starts[0])
            own = chunk.head.seconds("backward_input") + chunk.head.seconds("backward_weight") \
                + comm.copies[("root_head", "reduce-scatter")]
            s, t1 = 16 / 132, dense.time_s * 2 * nic_share(dense)   # beside two rings for t1, then one
            assert round(own * 1e3, 4) == 4.2988 and round(t1 * 1e3, 4) == 0.4077
            assert head == pytest.approx(t1 + (own - t1 * (1 - 2 * s)) / (1 - s)) and round(head * 1e3, 4) == 4.9479
        want = ag.time_s + shared - head
        if phase == "backward":  # the head's reduce-scatter from the head's end (docstring)
            key = ("shard", "root_head", "backward", "reduce-scatter")
            r, g_h, g_e = comm.t[key], comm.nic[key], nic_share(ag)
            t1 = dense.time_s * 2 * nic_share(dense)
            left = ag.time_s - t1 * 0.5 / g_e - (head - t1)
            assert (round(r * 1e3, 4), round(g_h, 4), round(left * 1e3, 4)) == (1.4384, 0.8828, 0.8681)
            assert left < r * g_h / g_e      # nc52fixC: the gather ends first, both at half the NIC
            want = left / (0.5 / g_e)        # 1.6311 ms (2 r g_h + left - r g_h / g_e = 2.7052 ms before)
            assert round(want * 1e3, 4) == 1.6311
        assert unit.exposed_s["efsdp"] == pytest.approx(want), phase


def test_the_experts_reductions_are_named_as_their_gathers(plan):
    """Trace finding: the routed experts' reduce-scatter showed as ``fsdp RS L0 experts`` on the
    efsdp track beside their gathers ``efsdp AG L0``. Both now carry the stream's name, and so
    does FSDP2's copy-in before it on the compute stream: per layer (Mixtral's 32, all MoE) one
    ``efsdp AG L<i>``, one ``efsdp RS L<i>``, one ``efsdp RS copy-in L<i>``; the layers' other
    parameters and the embedding's and head's units keep ``fsdp RS ...`` on the fsdp track."""
    from meshplan.schedule.backward_pass import backward_unit
    from meshplan.schedule.steptime import step_time
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.schedule.workload import chunk_costs, workload_of
    w = workload_of(plan)
    chunk, comm = chunk_costs(plan, w)[0][0], step_time(plan).units.comms[0]
    b = backward_unit("B", chunk, comm, w, Overlap(), last_grad_unit=True)
    names = lambda stream, op: sorted(e.name for e in b.events if e.stream == stream and e.args.get("op") == op)
    layers = sorted(f"L{i}" for i in range(32))
    assert names("efsdp", "all-gather") == [f"efsdp AG {x}" for x in layers]
    assert names("efsdp", "reduce-scatter") == [f"efsdp RS {x}" for x in layers]
    assert names("fsdp", "reduce-scatter") == sorted(f"fsdp RS {x}" for x in [*layers, "root_embed", "root_head"])
    copies = sorted(e.name for e in b.events if e.stream == "compute" and "copy-in" in e.name)
    assert [x for x in copies if x.startswith("efsdp")] == [f"efsdp RS copy-in {x}" for x in layers]
    assert not [e.name for e in b.events if "experts" in e.name and "RS" in e.name]
