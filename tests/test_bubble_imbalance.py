"""Issue 11 follow-up (a newcomer's trial of ``meshplan step``): a large pipeline bubble was not
explained. The Megatron-LM example (Llama 3 8B, tp 2 x pp 2, m 32) has stage 0 idle 0.1778 of its
busy time against 1F1B's closed form (p - 1) / m = 1 / 32 = 0.0312, because stage 1 holds the
128,256-vocab output layer and loss. The bubble line names the longest stage and the knob that
makes it lighter (:func:`meshplan.schedule.stage_balance.imbalance_clause`).
"""

from __future__ import annotations

import pytest

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.schedule import stage_balance
from meshplan.schedule.steptime import step_time
from tests.conftest import EXAMPLES

MEGATRON = EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args"


@pytest.fixture(scope="module")
def megatron():
    plan = build_plan(load_any(MEGATRON, None, ImportOptions(cluster="dgx-h100", nodes=2)))
    return plan, step_time(plan)


def test_bubble_line_names_the_heavy_last_stage(megatron):
    """pp 2 x 1F1B, m 32, 16 layers a stage. By hand: stage 1 runs without a break once started
    (stage 0 feeds it faster), so stage 0 ends after its own first forward, stage 1's m units
    and its own last backward: idle_0 = t_1 + (m - 1)(t_1 - t_0), the closed form's t for
    uniform stages plus (m - 1) times the difference; the difference is the ends' compute, the
    output layer and loss less the embedding (the layers are the same)."""
    plan, st = megatron
    res = st.pipeline
    m = res.spec.m
    t0, t1 = (b / m for b in res.busy_s)
    head, embed = st.units.chunks[1][0].head.seconds(), st.units.chunks[0][0].embed.seconds()
    assert (m, [len(c.layers) for s in st.units.chunks for c in s]) == (32, [16, 16])
    assert st.parts_s()["bubble"] == pytest.approx(t1 + (m - 1) * (t1 - t0), rel=1e-9)
    assert t1 - t0 == pytest.approx(head - embed, abs=0.5e-3)  # 26.73 ms against 26.84 ms
    x = stage_balance.closed_form(res.spec)
    assert x == 1 / 32 and stage_balance.measured_idle(st) > 5 * x  # 0.1778
    bubble = next(line for line in st.lines() if line.startswith("bubble "))
    mean = (t0 + t1) / 2
    assert bubble.endswith(
        f"closed form for uniform stages: 0.0312 idle/ideal, 0.0303 idle/total; stage 1 takes the longest "
        f"forward+backward per micro-batch: {t1 * 1e3:.2f} ms, {(t1 - mean) * 1e3:.2f} ms ({t1 / mean - 1:.1%}) over "
        f"the mean stage's {mean * 1e3:.2f} ms; it holds the output layer and loss ({head * 1e3:.2f} ms of it); a "
        f"lighter last stage evens the pipeline: mesh.pp_layer_split (Megatron-LM: --decoder-last-pipeline-num-layers, "
        f"or --account-for-embedding-in-pipeline-split with --account-for-loss-in-pipeline-split), which `meshplan "
        f"search` tries at pp >= 3 (Llama 3's split: first and last stage one layer lighter)")
    # 206.966 ms before the loss scale's multiply and its backward were counted on the last stage (2 kernels
    # at the H100's 4.7 us issue floor: 206.9756 ms, compute/megatron.LOSS_KERNELS). The import plans Megatron
    # Core since mcore48 (megatron_runtime "core"): the last stage's get_batch per micro-batch copies the
    # batch's 5 tensors, 67,338,240 B with the loader's 8192 x 8192 boolean mask, over PCIe 5.0 (5 x 5.7 us +
    # 1068.86 us = 1097.36 us) and broadcasts labels, loss mask and mask over tp 2 (242.71 us on its NVLink
    # path): 1340.07 us, where 2022's get_batch took 468.02 us (its 65,544 B copy 6.74, 2 broadcasts 30.16,
    # the fp32 mask's ones/tril/< 0.5 at Triad 90.38 + 180.76 + 112.98, 2 floors, 6 + 2 syncs at 4.7 us):
    # 206.9756 + 1.3401 - 0.4680 = 207.8477 ms
    assert round(5 * 5.7 + 67_338_240 / 63e9 * 1e6, 2) == 1097.36
    assert round(206.9756 + (1097.36 + 242.71 - 468.02) / 1e3, 2) == 207.85
    assert f"{t1 * 1e3:.2f}" == "207.85"


def test_the_knob_shortens_the_step_and_the_clause_goes(megatron, tmp_path):
    """The clause's advice re-planned: --decoder-last-pipeline-num-layers 15 (17 + 15 layers)
    shortens the step, and stage 0's idle comes within twice the closed form."""
    plan, st = megatron
    args = tmp_path / "split.args"
    args.write_text(MEGATRON.read_text() + "\n--decoder-last-pipeline-num-layers 15\n")
    lighter = build_plan(load_any(args, None, ImportOptions(cluster="dgx-h100", nodes=2)))
    st2 = step_time(lighter)
    assert [len(c.layers) for s in st2.units.chunks for c in s] == [17, 15]
    assert st2.step_s < 0.96 * st.step_s  # 6518.77 ms against 6862.25 ms under 2022 (6890.52 ms under core)
    assert stage_balance.measured_idle(st2) <= stage_balance.IMBALANCE_FACTOR * stage_balance.closed_form(
        st2.pipeline.spec)
    assert "takes the longest" not in next(line for line in st2.lines() if line.startswith("bubble "))


def test_imbalance_factor_is_the_named_constant(megatron, monkeypatch):
    plan, st = megatron
    ratio = stage_balance.measured_idle(st) / stage_balance.closed_form(st.pipeline.spec)
    monkeypatch.setattr(stage_balance, "IMBALANCE_FACTOR", ratio * (1 + 1e-9))
    assert stage_balance.imbalance_clause(st) == ""
    monkeypatch.setattr(stage_balance, "IMBALANCE_FACTOR", ratio * (1 - 1e-9))
    assert stage_balance.imbalance_clause(st).startswith("; stage 1 takes the longest")
