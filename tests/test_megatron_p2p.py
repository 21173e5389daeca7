"""Megatron-LM 2022's pipeline sends (issue 11): scatter/gather without sequence parallelism
(each tp rank sends 1/tp of the activation over its NIC, the receivers all-gather it over
NVLink) and blocking sends (the sender's stream is held for the send). GPT-3 175B, tp 8 x pp 8
x vpp 3 on 8 DGX A100 (Korthikanti et al. 2022, the fidelity benchmark's D3/D4 configs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.config import load_config
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
    send holds its stage: the critical stage exposes at least its held time on "pp"."""
    plan = plan_of(False)
    send = max(r.time_s for r in rows(plan) if r.op == "send/recv")
    gather = max(r.time_s for r in rows(plan) if "scatter/gather" in r.cadence)
    st = step_time(plan)
    spec = st.pipeline.spec
    assert spec.blocking_p2p and spec.p2p_s == pytest.approx(send + gather, rel=1e-12)
    assert 0.2e-3 < send < 0.4e-3 and 0.1e-3 < gather < 0.5e-3   # 6.3 MB at ~23 GB/s; 50 MB at NVLink3 busbw
    sl = st.pipeline.stage_slice(st.critical_stage)
    held = float(st.pipeline.hold[sl][:-1].sum())
    # stage 0 (critical) runs 192 F and 192 B units; every F sends (virtual stages 0, 8, 16 ->
    # stage 1), B of chunks 1, 2 send (virtual stages 8, 16 -> stage 7), chunk 0's do not.
    # One blocking call per issuing unit: the 2 (8 - 1) + (3 - 1) 8 = 30 warm-up F's; 192 - 30
    # = 162 steady-state F+B pairs, one call each (the F's output leaves with the B's); cool-down
    # B units k = 162..191 of chunk 2 - (k mod 24) // 8: k 162-167 chunk 0 (no send), then one
    # round of 8 chunk-2, 8 chunk-1 (send) and 8 chunk-0: 16 calls. 30 + 162 + 16 = 208, the
    # last unit (chunk 0) not among them.
    assert st.critical_stage == 0 and st.pipeline.hold[sl][-1] == 0
    assert held == pytest.approx(spec.p2p_s * 208, rel=1e-9)
    assert st.exposed_s["pp"] >= held
    torch_ = step_time(plan_of(False, "torch")).pipeline.spec
    assert not torch_.blocking_p2p
