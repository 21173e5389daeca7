"""Megatron-LM 2022's pipeline sends (issue 11): scatter/gather without sequence parallelism
(each tp rank sends 1/tp of the activation over its NIC, the receivers all-gather it over
NVLink) and blocking sends (the sender's stream is held for the send). GPT-3 175B, tp 8 x pp 8
x vpp 3 on 8 DGX A100 (Korthikanti et al. 2022, the fidelity benchmark's D3/D4 configs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.config import load_config
from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.rendezvous import call_loads, calls
from meshplan.pipeline.simulate import PipelineSpec, simulate
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

FIDELITY = Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity"
ACT = 1 * 2048 * 12288 * 2          # b s h bf16: 50,331,648 B per micro-batch


def plan_of(sp: bool, framework: str = "megatron"):
    name = "sp-selective" if sp else "full-recompute"
    cfg = load_config(FIDELITY / f"megatron-175b_64xa100_tp8-pp8-vpp3_{name}.toml")
    return build_plan(replace(cfg, training=cfg.training.model_copy(update={"framework": framework})))


def rows(plan, stage: int = 1):
    return plan.stage(stage).collectives


@pytest.mark.parametrize("sp,framework,sent,gathered", [
    (False, "megatron", ACT // 8, ACT),   # scatter/gather: 6,291,456 B over the NIC, 50 MB all-gathered over tp
    (True, "megatron", ACT // 8, None),   # SP: the activation is already (s/tp, b, h): sent as is, no gather
    (False, "torch", ACT, None),          # torch pipelining sends the whole tensor
])
def test_scatter_gather_rows(sp, framework, sent, gathered):
    plan = plan_of(sp, framework)
    pp = [r for r in rows(plan) if r.op == "send/recv"]
    # stage 1 of pp 8 x vpp 3 (looped): chunks at virtual stages 1, 9, 17, each sending and
    # receiving across stages: 3 + 3 per micro-batch and direction
    assert {(r.phase, r.size_bytes, r.per_microbatch) for r in pp} == \
        {("forward", sent, 6), ("backward", sent, 6)}
    sg = [r for r in rows(plan) if "scatter/gather" in r.cadence]
    if gathered is None:
        assert sg == []
    else:
        assert {(r.axis, r.phase, r.op, r.size_bytes, r.per_microbatch, r.path.kind) for r in sg} == \
            {("tp", "forward", "all-gather", gathered, 6, "nvlink"), ("tp", "backward", "all-gather", gathered, 6, "nvlink")}


def test_step_p2p_is_the_send_plus_the_gather_and_blocks():
    """The pipeline's p2p time is one send of 1/tp over the NIC plus the all-gather of the whole
    activation over NVLink (the receiver needs both before its unit), and under Megatron every
    send holds its stage: the critical stage exposes the transfers of its calls on "pp", and their
    wait for the partner stage as bubble."""
    plan = plan_of(False)
    send = max(r.time_s for r in rows(plan) if r.op == "send/recv")
    gather = max(r.time_s for r in rows(plan) if "scatter/gather" in r.cadence)
    st = step_time(plan)
    spec = st.pipeline.spec
    assert spec.blocking_p2p and spec.p2p_s == pytest.approx(send + gather, rel=1e-12)
    assert 0.4e-3 < send < 0.42e-3 and 0.1e-3 < gather < 0.5e-3   # 6.3 MB at 15.48 GB/s (S18 pair); 50 MB at NVLink3 busbw
    sl = st.pipeline.stage_slice(st.critical_stage)
    held = float(st.pipeline.hold[sl][:-1].sum())
    # stage 0 (critical) runs 192 F and 192 B units; every F sends (virtual stages 0, 8, 16 ->
    # stage 1), B of chunks 1, 2 send (virtual stages 8, 16 -> stage 7), chunk 0's do not.
    # One blocking call per issuing unit: the 2 (8 - 1) + (3 - 1) 8 = 30 warm-up F's; 192 - 30
    # = 162 steady-state F+B pairs, one call each (the F's output leaves with the B's); cool-down
    # B units k = 162..191 of chunk 2 - (k mod 24) // 8: k 162-167 chunk 0 (no send), then one
    # round of 8 chunk-2, 8 chunk-1 (send) and 8 chunk-0: 16 calls. 30 + 162 + 16 = 208, the
    # last unit (chunk 0) not among them. Every B of stage 0 receives (from stage 1: virtual
    # stages 1, 9, 17), so each cool-down call also receives the next B's gradient: the 29 after
    # B 162..190, 16 of them already sending: 13 receive-only calls. 208 + 13 = 221.
    assert st.critical_stage == 0 and st.pipeline.hold[sl][-1] == 0
    calls = st.pipeline.hold[sl][:-1] > 0
    assert int(calls.sum()) == 221 and held >= spec.p2p_s * 221 * (1 - 1e-12)
    assert st.pipeline.hold[sl][:-1][calls].min() == pytest.approx(spec.p2p_s, rel=1e-12)  # a call lasts p2p at least
    # exposed pp: the calls' transfers, k p2p each (k: sends or receives sharing the NIC), 340 in
    # all (tests/test_step_parts.py) over the 221 calls, so 340 - 221 = 119 calls carry two through
    # the one NIC; those pay the transfer's fixed part once (one NCCL group, rendezvous.link_load:
    # the pair time, p2p_pair_s = 2 p2p - the NIC's 9.30 us latency), 119 x 9.30 us = 1.107 ms less;
    # and after the backward the tied embedding's all-reduce between the first and last stage (the
    # table's pp step row); the rest of the held time waits for the partner: bubble
    tied = next(r.time_s for r in rows(plan, 0) if r.axis == "pp" and r.phase == "step")
    sends = st.exposed_s["pp"] - tied
    fixed = 2 * spec.p2p_s - spec.p2p_pair_s
    assert round(fixed * 1e6, 2) == 9.30
    assert sends == pytest.approx(340 * spec.p2p_s - (340 - 221) * fixed, rel=1e-9) and held > sends
    assert st.parts_s()["bubble"] >= held - sends - 1e-12
    torch_ = step_time(plan_of(False, "torch")).pipeline.spec
    assert not torch_.blocking_p2p


STAGE_S = {0: (1.0, 2.0), 1: (2.0, 3.0), 2: (1.0, 1.0)}   # (F, B) seconds per stage


def _rendezvous_spec(blocking: bool) -> PipelineSpec:
    return PipelineSpec("1f1b", 3, 4, p2p_s=0.5, blocking_p2p=blocking,
                        duration=lambda s, u: STAGE_S[s][0] if u.kind == "F" else STAGE_S[s][1])


def test_rendezvous_by_hand():
    """1F1B, p 3, m 4, F/B 1/2 s, 2/3 s, 1/1 s on stages 0, 1, 2, p2p 0.5 s, Megatron-LM 2022's
    calls (megatron/schedules.py forward_backward_pipelining_without_interleaving;
    megatron/p2p_communication.py _communicate). Orders: stage 0 F0 F1 F2 B0 F3 B1 B2 B3, stage 1
    F0 F1 B0 F2 B1 F3 B2 B3, stage 2 F0 B0 F1 B1 F2 B2 F3 B3. A call after a unit sends its
    output and receives the next unit's input; it ends at max(own post, peers' posts) + 0.5.
    s0 F0 0-1, call (peer s1's first recv, posted 0) 1.5; F1 1.5-2.5, its send meets s1's call
    after F0. s1: recv F0 max(0, 1) + .5 = 1.5, F0 1.5-3.5, call (send F0 to s2 posted 0, recv
    F1 posted 2.5) 4.0, F1 4-6. s0: max(2.5, 3.5) + .5 = 4, F2 4-5. s2: F0 at 3.5 + .5 = 4, 4-5,
    B0 5-6 (local), call with s1's after F1 (6) 6.5, F1 6.5-7.5, B1 7.5-8.5. s1: max(6, 6) + .5 =
    6.5, B0 6.5-9.5, call (s0 posted F2 at 5) 10, F2 10-12. s0: B0 10-12 (peer 9.5), F3 12-13.
    s2: call after B1 meets s1's after F2: max(8.5, 12) + .5 = 12.5, F2 12.5-13.5, B2 13.5-14.5.
    s1: max(12, 8.5) + .5 = 12.5, B1 12.5-15.5, call (s0 after F3: 13) 16, F3 16-18, call (s2
    after B2: 14.5) 18.5, B2 18.5-21.5. s0: call after F3 meets s1 after B1: max(13, 15.5) + .5
    = 16, B1 16-18, call to receive B2 max(18, 21.5) + .5 = 22, B2 22-24. s2: max(14.5, 18) + .5
    = 18.5, F3 18.5-19.5, B3 19.5-20.5, send B3 max(20.5, 21.5) + .5 = 22. s1: call after B2
    (peers s0 posted 18, s2 posted 20.5) max(21.5, 18, 20.5) + .5 = 22, B3 22-25, send max(25,
    24) + .5 = 25.5. s0: B3 25.5-27.5: step 27.5. Asynchronous sends: 25.0 (torch 1F1B runs its own calls,
    tests/test_torch_p2p_waits.py)."""
    starts = [[0.0, 1.5, 4.0, 10.0, 12.0, 16.0, 22.0, 25.5],
              [1.5, 4.0, 6.5, 10.0, 12.5, 16.0, 18.5, 22.0],
              [4.0, 5.0, 6.5, 7.5, 12.5, 13.5, 18.5, 19.5]]
    spec = _rendezvous_spec(True)
    arr, ref = simulate_arrays(spec), simulate(spec)
    assert arr.start.tolist() == sum(starts, [])
    for s in range(3):
        assert [e.start_s for e in ref.events if e.stage == s and e.stream == "compute"] == starts[s]
    assert arr.step_s == ref.step_s == 27.5
    assert arr.hold[:8].tolist() == [0.5, 1.5, 5.0, 0.0, 3.0, 4.0, 1.5, 0.0]   # stage 0 waits in its calls
    assert simulate_arrays(_rendezvous_spec(False)).step_s == simulate(_rendezvous_spec(False)).step_s == 25.0
    # the critical path crosses stages where a peer's late post bound a call: s0's B3 waited for s1's B3
    assert [(e.stage, e.name) for e in ref.critical_path][-2:] == [(1, "B3"), (0, "B3")]


def test_only_megatron_schedules_block():
    """framework megatron blocks 1F1B and interleaved 1F1B (the schedules Megatron-LM 2022 had);
    ZB-V keeps asynchronous sends (one combined blocking call per unit would deadlock it)."""
    from meshplan.schedule.overlap_policy import blocking_p2p
    from meshplan.spec.mesh import Schedule
    tr = plan_of(False).config.training
    assert [blocking_p2p(tr, s) for s in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B, Schedule.ZBV)] == \
        [True, True, False]


@pytest.mark.parametrize("framework,embed_ar,embed_rs", [("megatron", 1, 0), ("torch", 0, 1)])
def test_sp_embedding_is_all_reduced_under_megatron_2022(framework, embed_ar, embed_rs):
    """Megatron-LM 2755bcb: VocabParallelEmbedding.forward ends in
    reduce_from_tensor_model_parallel_region (an all-reduce of the whole b s h output), and
    Embedding.forward then keeps the rank's sequence shard (scatter_to_sequence_parallel_region:
    a split, no collective). Stage 0 of the SP run holds the embedding on its first chunk: one
    50,331,648 B all-reduce per micro-batch, in place of torch's reduce-scatter; its layers
    each reduce-scatter twice."""
    plan = plan_of(True, framework)
    r0 = rows(plan, 0)
    ar = [r for r in r0 if r.axis == "tp" and r.phase == "forward" and r.op == "all-reduce"]
    rs = [r for r in r0 if r.axis == "tp" and r.phase == "forward" and r.op == "reduce-scatter"]
    assert sum(r.per_microbatch for r in ar) == embed_ar
    assert all(r.size_bytes == ACT for r in ar + rs)
    per_layer_rs = 2
    assert rs[0].per_microbatch - embed_rs == per_layer_rs * (rs[0].per_microbatch // per_layer_rs)
    # stage 1 has no embedding: no all-reduce under SP, whatever the framework
    assert not [r for r in rows(plan, 1) if r.axis == "tp" and r.phase == "forward" and r.op == "all-reduce"]
    if framework == "megatron":
        # 8-GPU all-reduce of 50,331,648 B (48 MiB) on the S15 curve, between its 32M (138.5
        # GB/s) and 64M (171.54 GB/s) rows: t = t32 + (t64 - t32) * (S - 32M) / 32M after NCCL's
        # LL latency (the curve's own rank count): t32 = 1.75 x 2^25 / 138.5e9 = 424.0 us, t64 =
        # 1.75 x 2^26 / 171.54e9 = 684.6 us, half way 554.3 us (574.6 us on the line to the 128M
        # row before the catalog carried S15's 64M row)
        t32, t64 = 1.75 * 2**25 / 138.5e9, 1.75 * 2**26 / 171.54e9
        want = t32 + (t64 - t32) * (ACT - 2**25) / (2**26 - 2**25)
        assert ar[0].time_s == pytest.approx(want, rel=1e-9)
        assert want * 1e6 == pytest.approx(554.3, abs=0.1)


def test_pp_send_through_one_nic_on_the_s18_pair_curve():
    """The D3/D4 pp sends (6,291,456 B per tp rank, each through its own HDR NIC) are timed on
    the single-NIC pair curve (S18 2 x 1 A100 alltoall, 15.48 GB/s at 1 GB): see
    tests/test_busbw.py for the hand derivation (415.6 us at NCCL's LL latency, scaled here by the
    network tier's per-step latency, 1 on superpod-hdr)."""
    plan = plan_of(False)
    send = [r for r in rows(plan) if r.op == "send/recv"][0]
    assert send.size_bytes == ACT // 8 and send.path.kind == "network"
    t1 = 0.5 * 2**30 / 15.48e9
    assert send.time_s == pytest.approx(9.3e-6 + (t1 - 9.3e-6) * (ACT // 8) / (0.5 * 2**30), rel=1e-9)
    assert send.time_s * 1e6 == pytest.approx(415.6, abs=0.1)


def test_interleaved_steady_state_call_sends_twice_through_one_nic():
    """Megatron-LM 2022's interleaved steady state (schedules.py
    forward_backward_pipelining_with_interleaving: p2p_communication.send_forward_backward_recv_forward_backward)
    sends a forward output to the next stage and an input gradient to the previous one in one
    call; both leave through the rank's one NIC (tp rank k of every stage on GPU k of its node, NIC
    k: placement), and p2p_s is one send/recv pair at the NIC's rate, so the call takes 2 p2p_s.
    p 2, m 4, v 2, F 1 s, B 2 s, p2p 0.25 s: every call ends max(own post, peers' posts) + k x 0.25,
    k = 2 for the 6 two-send calls, 1 for the other 16, in both simulators."""
    spec = PipelineSpec("interleaved_1f1b", 2, 4, v=2, forward_s=1.0, backward_s=2.0, p2p_s=0.25, blocking_p2p=True)
    orders = [spec.sched.order(2, 4, 2, s) for s in range(2)]
    peers, xfer = calls(spec, orders)
    load = call_loads(xfer)
    assert sorted(load.values()).count(2) == 6
    ref = simulate(spec)
    start = {s: [e.start_s for e in ref.events if e.stage == s and e.stream == "compute"] for s in range(2)}
    end = {s: [e.end_s for e in ref.events if e.stage == s and e.stream == "compute"] for s in range(2)}
    post = lambda s, i: 0.0 if i < 0 else end[s][i]  # noqa: E731
    checked = 0
    for (s, i), mine in peers.items():
        if i + 1 < len(start[s]):
            want = max([post(s, i)] + [post(*x) for x in mine]) + 0.25 * load[(s, i)]
            assert start[s][i + 1] == pytest.approx(want, abs=1e-12)
            checked += load[(s, i)] == 2
    assert checked == 6
    assert simulate_arrays(spec).step_s == pytest.approx(ref.step_s, abs=1e-12)
    # asynchronous sends (torch's pipelining) end the step earlier
    one = simulate(PipelineSpec("interleaved_1f1b", 2, 4, v=2, forward_s=1.0, backward_s=2.0, p2p_s=0.25))
    assert ref.step_s > one.step_s


@pytest.mark.parametrize("framework", ["megatron", "torch"])
def test_sp_norm_gradients_all_reduced_once_coalesced_under_megatron(framework):
    """Sequence-parallel norm weights get Partial gradients over tp. Megatron-LM 2755bcb
    (optimizer.py allreduce_layernorm_grads) flattens the main gradients of every
    sequence_parallel parameter into one buffer and all-reduces it once per step over tp: the
    norms' weights and biases (fused_layer_norm.py) and the row-parallel linears' biases
    (mpu/layers.py RowParallelLinear: ``setattr(self.bias, 'sequence_parallel', ...)``: attention
    ``dense`` and ``dense_4h_to_h``). Stage 0 of the 175B SP run holds 12 layers (3 chunks of 4) x
    (2 LayerNorms x (weight, bias) + 2 biases) = 72 tensors of 12,288 fp32 main-gradient
    elements: one all-reduce of 72 x 12,288 x 4 = 3,538,944 B. torch (DTensor Partial, measured 2.13) all-reduces each of its 48 norm tensors once in the fused
    AdamW step (training.optimizer_impl's default; 3 reads each under foreach: 144): 48 of 24,576 B."""
    plan = plan_of(True, framework)
    rows0 = [r for r in rows(plan, 0) if r.axis == "tp" and r.phase == "step"]
    assert len(rows0) == 1
    r = rows0[0]
    if framework == "megatron":
        assert (r.op, r.size_bytes, r.dtype, r.per_step) == ("all-reduce", 72 * 12288 * 4, "fp32", 1) == \
            ("all-reduce", 3_538_944, "fp32", 1)
    else:
        assert (r.op, r.size_bytes, r.per_step) == ("all-reduce", 12288 * 2, 1 * 48)


def test_megatron_reduces_gradients_after_the_backward():
    """Megatron-LM 2022 (training.py train_step: optimizer.reduce_model_grads after
    forward_backward_func) runs the per-step reductions after the last backward, none overlapped:
    on stage 0 of the 175B SP run the step ends with the tied embedding's all-reduce over the
    first and last stage (6,400 x 12,288 fp32 = 314,572,800 B) and the SP gradients' all-reduce
    over tp (3,538,944 B), their table times added in full before the optimizer step. torch's
    FSDP/DDP keep overlapping them with the backward."""
    from meshplan.schedule.comm_streams import comm_kind
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.schedule.overlap_policy import config_overlap
    from meshplan.schedule.steptime import step_time

    plan = plan_of(True)
    assert not config_overlap(plan.config.training).grad_reduce
    assert config_overlap(plan_of(True, "torch").config.training).grad_reduce
    step = [r for r in rows(plan, 0) if comm_kind(r) == "step"]
    assert sorted(r.size_bytes for r in step) == [3_538_944, 314_572_800]
    st = step_time(plan, Overlap())
    # one per stage and group the reduction runs on, stage 0's first: tp (SP) then pp (tied)
    reduce = [e for e in st.post_events if e.name.startswith("grad reduce") and e.name.endswith("(per step)")]
    assert sorted({e.stage for e in reduce}) == list(range(8))
    first = [e for e in reduce if e.stage == 0]
    assert [e.stream for e in first] == [r.axis for r in step] == ["tp", "pp"]
    assert [e.end_s - e.start_s for e in first] == pytest.approx([r.time_s for r in step], rel=1e-12)
    assert first[0].end_s == first[1].start_s  # one after the other, as before they were split
