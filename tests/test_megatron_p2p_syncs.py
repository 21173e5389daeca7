"""Megatron-LM 2022's pipeline p2p calls cost their host syncs (audit of the 175B step against
NVIDIA/Megatron-LM 2755bcb): every p2p call the schedules make runs between two timer syncs
(``p2p_communication.py`` lines 168-311, ``global_vars.py`` ``_Timer.start``/``stop``) and
``_communicate`` synchronizes once more after its waits (line 139): 3 ``torch.cuda.synchronize``
per call, one issue floor each (4.7 us on A100, catalog kernels.toml, as the model's other
Megatron timers)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

D4 = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity" / "megatron-175b_64xa100_tp8-pp8-vpp3_sp-selective.toml"
NAME = "pipeline p2p calls' syncs"


def _syncs(st) -> dict[int, float]:
    return {e.stage: e.dur_s for e in st.post_events if e.name == NAME}


def test_175b_stages_pay_their_calls_syncs(monkeypatch):
    """GPT-3 175B (D4: pp 8, interleaved with 3 chunks, 64 micro-batches, 192 chunk units a stage).
    Stage 0 warms up min(192, 2 x 7 + 2 x 8) = 30 units and makes 192 calls for its warm-up
    forwards and steady pairs, 30 in the cool-down, none before its first unit: 222 calls, 666
    syncs, 3.1302 ms. Stage 7 warms up 2 x 8 = 16 units: 192 + 16 + its leading recv_forward =
    209 calls, 627 syncs, 2.9469 ms. Stage 0 ends the step: its end moves by its own 3.1302 ms."""
    plan = build_plan(load_config(D4))
    st = step_time(plan)
    got = _syncs(st)
    assert got[0] == pytest.approx(666 * 4.7e-6, rel=1e-9)
    assert got[7] == pytest.approx(627 * 4.7e-6, rel=1e-9)
    assert st.critical_stage == 0
    monkeypatch.setattr("meshplan.schedule.step_end.megatron_p2p_syncs_s", lambda *a: 0.0)
    without = step_time(plan)
    assert _syncs(without) == {}
    assert st.stage_end_s[0] - without.stage_end_s[0] == pytest.approx(666 * 4.7e-6, rel=1e-6)


def test_no_syncs_without_megatron_blocking_calls():
    """Megatron-LM's overlap_p2p_comm (pp_p2p_overlap = true, 2023 on) and torch's pipelining make
    other calls: no such step-end event."""
    cfg = load_config(D4)
    for training in (cfg.training.model_copy(update={"pp_p2p_overlap": True}),
                     cfg.training.model_copy(update={"framework": "torch"})):
        st = step_time(build_plan(replace(cfg, training=training)))
        assert _syncs(st) == {}
