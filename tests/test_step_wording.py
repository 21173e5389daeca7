"""What `meshplan step` prints says what the model did: one rounding for a quantity printed
twice, the stage each bubble figure is on, the slack of a collective hidden behind compute."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.pipeline.fast import KINDS
from meshplan.plan import build_plan
from meshplan.schedule.linkload import StageDetail
from meshplan.schedule.readiness import timings
from meshplan.schedule.steptime import step_time
from tests.conftest import EXAMPLES, ROOT

#: Llama 3 8B, seq 5120, dp_shard 2 x tp 4 under Megatron-LM with --tp-comm-overlap: its exposed
#: tp, 144.68 ms on its own, prints 144.69 as a part of the step (largest remainder; at seq 4096 the
#: case before the batch transfers changed, 117.92 both ways).
MINI_TP_OVERLAP = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                   "training": {"global_batch": 64, "seq_len": 5120, "micro_batch": 1, "sharding": "zero3",
                                "recompute": "none", "tp_comm_overlap": True, "framework": "megatron"},
                   "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 4], "sequence_parallel": True}}


def _numbers(line: str) -> dict[str, str]:
    """``name value`` pairs of an ``exposed communication`` or ``step on stage`` line."""
    return {k: v for k, v in re.findall(r"((?:exposed )?[a-z_]+) (\d+\.\d\d)", line)}


def test_exposed_line_and_parts_line_print_one_rounding():
    st = step_time(build_plan(config_from_dict(MINI_TP_OVERLAP)))
    lines = st.lines()
    exposed = next(x for x in lines if x.startswith("exposed communication on stage"))
    parts = next(x for x in lines if x.startswith("step on stage"))
    shown = _numbers(exposed.split(": ", 1)[1])
    in_parts = _numbers(parts.split(" = ", 1)[1])
    assert shown and {k: in_parts[f"exposed {k}"] for k in shown} == shown
    # the case that printed two numbers (seq 5120): fsdp rounds to 35.08 alone, 35.09 so that the parts add up
    # (was tp until calib37 moved Megatron's get_batch broadcasts from compute to tp: 145.61 either way now)
    assert f"{st.exposed_s['fsdp'] * 1e3:.2f}" != shown["fsdp"]
    assert abs(float(shown["fsdp"]) - st.exposed_s["fsdp"] * 1e3) <= 0.01
    # and the parts add up to the step printed on the first line
    step = re.match(r"step (\d+\.\d\d) ms", lines[0]).group(1)
    assert parts.endswith(f"= {step} ms")
    assert round(sum(float(v) for v in in_parts.values()) * 100) == round(float(step) * 100)


def test_bubble_line_names_the_stage_of_each_figure():
    """405B example (pp 16, 1F1B, FSDP under pp): the ratios are on the busiest stage (11), the
    step's parts on the critical one (0), where the step ends; the printed stages and numbers are
    the model's. (Stages 1-14 run the same units: their busy times differ in the last bits of
    each unit's end - start, which picks the busiest among them: 14 before torch's 1F1B calls
    waited, 11 since, 6.503584619329027 s against 6.503584619329026 s on stage 14; 1 since es50's
    replayed closing tp reduce-scatters: torchtitan's full AC runs early_stop=False, each of a middle
    stage's 8 layers replays its 256 MiB reduce-scatter, 0.65957 ms, in each of 16 micro-batches: + 8 x 16
    x 0.65957 ms = 84.43 ms, 6.50358 -> 6.58801 s; 10 since nc52fixC's network SM contention, 16 of 132
    SMs under the cross-node FSDP and pp collectives, which moved those last bits again (stage 10's
    6.5880101010283445 s against 6.588010101028344 s on stages 2 and 6, read from the model); 9 since
    kvheads: without the repeat_kv copies (no [memory] kv_expanded; 71,303,168 B an op at tp 8, 24.01 us,
    3 a layer under full AC) a middle stage is 6.58801 -> 6.57896 s busy (9.05 ms of the copies' at most
    8 x 16 x 3 x 24.01 us = 9.22 ms, read from the model), stages 9, 10, 13 and 14 tied to the last
    bits at 6.578959160174468 s, the first of them the busiest.)"""
    plan = build_plan(load_config(EXAMPLES / "llama3-405b_16384xh100_tp8-pp16-dp128.toml"))
    st = step_time(plan)
    res = st.pipeline
    assert (res.busiest_stage, st.critical_stage) == (9, 0)  # the case: they differ
    rs = next(r for r in plan.stage(1).collectives if r.axis == "tp" and (r.phase, r.op) == ("backward", "reduce-scatter"))
    assert round(rs.time_s * 1e3, 5) == 0.65957 and len(plan.stage(1).layers) == 8
    # 6.503584619329027 before kvheads: the stage's repeat_kv copies left (docstring)
    assert round(float(res.busy_s[1]) - 8 * 16 * rs.time_s, 9) == 6.494533678
    lines = st.lines()
    bubble = next(x for x in lines if x.startswith("bubble "))
    parts = next(x for x in lines if x.startswith("step on stage"))
    busy = float(res.busy_s[res.busiest_stage])
    assert bubble.startswith(f"bubble {(res.step_s - busy) / busy:.4f} as idle/ideal, "
                             f"{(res.step_s - busy) / res.step_s:.4f} as idle/total (the schedule's bubble fraction, on the busiest stage 9,")
    assert parts.startswith("step on stage 0 = ")
    bubble_ms = _numbers(parts.split(" = ", 1)[1])["bubble"]
    assert abs(float(bubble_ms) - st.parts_s()["bubble"] * 1e3) <= 0.01
    assert f"the step's parts below are on stage 0, where the step ends: bubble {bubble_ms} ms is its idle" in bubble


def test_no_bubble_line_without_a_second_stage():
    """pp 1 runs no pipeline schedule: no bubble line (newcomer trial 8 read "bubble 0.0000 as
    idle/ideal" on a pp 1 mesh)."""
    st = step_time(build_plan(config_from_dict(MINI_TP_OVERLAP)))
    assert not any(x.startswith("bubble ") for x in st.lines())


def _detail(events) -> StageDetail:
    """One forward unit's events (stream, name, start ms, end ms), then the optimizer step."""
    rows = [(s, n) for s, n, _, _ in events] + [("compute", "optimizer step")]
    streams, names = tuple(s for s, _ in rows), tuple(n for _, n in rows)
    t = np.array([(a, b) for _, _, a, b in events] + [(10.0, 11.0)]) * 1e-3
    n = len(events)
    return StageDetail(np.arange(n + 1), streams, names, t[:, 0], t[:, 1], np.array([0] * n + [-1]),
                       np.array([KINDS.index("F")] * n + [-1]))


@pytest.mark.parametrize("ag_ms, slack_ms", [(0.3, 0.2), (0.8, -0.3)])
def test_cp_gather_slack_is_the_q_projection_it_hides_behind(ag_ms, slack_ms):
    """All-gather CP by hand: K/V projection 0-1 ms, the K/V all-gather issued at 1 ms beside the
    0.5 ms Q projection (1-1.5 ms), the core attention after both. A 0.3 ms gather leaves 0.5 -
    0.3 = 0.2 ms of slack; a 0.8 ms one makes the core wait 0.3 ms: slack -0.3 (exposed). It was
    0 either way (the gather's own end taken for its deadline)."""
    d = _detail([("compute", "attention K/V proj", 0.0, 1.0), ("cp", "cp K/V all-gather", 1.0, 1.0 + ag_ms),
                 ("compute", "attention Q proj", 1.0, 1.5), ("compute", "attention core", max(1.5, 1.0 + ag_ms), 3.0)])
    st = SimpleNamespace(_trace_cache={("arrays", 0): d},
                         pipeline=SimpleNamespace(end=np.array([3e-3]), stage_slice=lambda s: slice(0, 1)))
    (t,) = timings(st)
    assert (t.stream, t.phase, t.op) == ("cp", "forward", "all-gather")
    assert t.deadline_s == pytest.approx(1.5e-3)
    assert t.slack_s == pytest.approx(slack_ms * 1e-3)


def test_cp_slack_in_a_plan_is_wq_less_the_gather():
    """tests/data/validate_llama8b_cp2_fsdp.toml: the printed slack of the K/V all-gather is the
    Q projection's seconds less the gather's (the plan's table row), both from the model; the
    dK/dV reduce-scatter's is wq's input gradient less it."""
    p = build_plan(load_config(ROOT / "tests" / "data" / "validate_llama8b_cp2_fsdp.toml"))
    st = step_time(p)
    t = {(x.stream, x.phase, x.op): x for x in timings(st)}
    unit = st.units.get(0, 0, "F", 0)
    q = next(e for e in unit.events if e.name == "attention Q proj")
    row = next(r for r in p.stage(0).collectives if r.axis == "cp" and r.phase == "forward")
    ag = t[("cp", "forward", "all-gather")]
    assert ag.duration_s == pytest.approx(row.time_s)
    assert ag.slack_s == pytest.approx((q.end_s - q.start_s) - row.time_s) and ag.slack_s > 0
    back = st.units.get(0, 0, "B", 0)
    qb = next(e for e in back.events if e.name.endswith(" Q proj B"))
    rs = t[("cp", "backward", "reduce-scatter")]
    assert rs.slack_s == pytest.approx((qb.end_s - qb.start_s) - rs.duration_s) and rs.slack_s > 0


def _main(argv, capsys) -> str:
    from meshplan.cli import main
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    assert not done.value.code
    return capsys.readouterr().out



def _toml(tmp_path, d: dict) -> str:
    from meshplan.interop.tomlout import dumps
    path = tmp_path / "plan.toml"
    path.write_text(dumps(d))
    return str(path)


def test_step_and_plan_name_the_tp_overlap_and_what_it_saves(tmp_path, capsys):
    """Megatron-LM --tp-comm-overlap with SP (TE userbuffers): the line names the model and gives
    exposed tp, compute and step with it and with the same mesh planned without it (built again
    from a config with the overlap off: the step model is the only reader of the field)."""
    on = step_time(build_plan(config_from_dict(MINI_TP_OVERLAP)))
    off_cfg = {**MINI_TP_OVERLAP, "training": {**MINI_TP_OVERLAP["training"], "tp_comm_overlap": False}}
    off = step_time(build_plan(config_from_dict(off_cfg)))
    a, b = on.shown_ms(), off.shown_ms()
    assert float(b["exposed tp"]) > float(a["exposed tp"]) > 0
    saves = (round(off.step_s * 1e5) - round(on.step_s * 1e5)) / 100
    want = (f"tp overlap (training.tp_comm_overlap): Megatron-LM --tp-comm-overlap as Transformer Engine userbuffers "
            f"run it: decomposed GEMMs (meshplan.compute.asynctp); exposed tp {a['exposed tp']} ms (blocking: "
            f"{b['exposed tp']} ms), compute {a['compute']} ms (blocking: {b['compute']} ms), step {a['step']} ms "
            f"(blocking: {b['step']} ms): saves {saves:.2f} ms per step")
    path = _toml(tmp_path, MINI_TP_OVERLAP)
    out = _main(["step", path], capsys)
    assert want in out.splitlines() and "--overlap-tp ignored" not in out
    # --overlap-tp with the overlap already on: the same step, and a note that says so
    flagged = _main(["step", path, "--overlap-tp"], capsys)
    assert flagged.splitlines()[0] == out.splitlines()[0] and want in flagged.splitlines()
    assert "note: --overlap-tp ignored: training.tp_comm_overlap is on" in flagged
    # plan says it too (rich may wrap the line: compare without the breaks)
    plan_out = " ".join(_main(["plan", path], capsys).split())
    assert "note " + want in plan_out
    # torch's async TP: --overlap-tp changes nothing either (its unfused collectives still block)
    torch_cfg = {**MINI_TP_OVERLAP, "training": {**MINI_TP_OVERLAP["training"], "framework": "torch",
                                                 "torch_compile": True}}
    torch_path = _toml(tmp_path, torch_cfg)
    plain, flagged = _main(["step", torch_path], capsys), _main(["step", torch_path, "--overlap-tp"], capsys)
    assert flagged.splitlines()[0] == plain.splitlines()[0] and "--overlap-tp ignored" in flagged
    # off: no line in either command
    off_path = _toml(tmp_path, off_cfg)
    assert "tp overlap (training" not in _main(["step", off_path], capsys)
    assert "tp overlap (training" not in _main(["plan", off_path], capsys)


def test_overlap_tp_flag_prints_what_the_ideal_overlap_did(tmp_path, capsys):
    """``step --overlap-tp`` on a config without training.tp_comm_overlap printed no line saying
    what it did: it prints the knob's line, labelled as the ideal whole-GEMM overlap, against the
    same plan with TP blocking (the mini mesh under Megatron-LM, tp 4 with SP over NVLink: exposed
    tp falls, compute grows by the SMs the overlapped NCCL kernels hold). At tp 1 a note says it
    changes nothing."""
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.schedule.tp_overlap_lines import IDEAL_TP_OVERLAP
    off_cfg = {**MINI_TP_OVERLAP, "training": {**MINI_TP_OVERLAP["training"], "tp_comm_overlap": False}}
    plan = build_plan(config_from_dict(off_cfg))
    on, off = step_time(plan, Overlap(tp=True)), step_time(plan)
    a, b = on.shown_ms(), off.shown_ms()
    assert float(b["exposed tp"]) > float(a["exposed tp"]) and float(a["compute"]) > float(b["compute"])
    assert off.step_s > on.step_s
    saves = (round(off.step_s * 1e5) - round(on.step_s * 1e5)) / 100
    want = (f"tp overlap (--overlap-tp): {IDEAL_TP_OVERLAP}; exposed tp {a.get('exposed tp', '0.00')} ms (blocking: "
            f"{b['exposed tp']} ms), compute {a['compute']} ms (blocking: {b['compute']} ms), step {a['step']} ms "
            f"(blocking: {b['step']} ms): saves {saves:.2f} ms per step")
    assert IDEAL_TP_OVERLAP.startswith("whole-GEMM overlap, a what-if, not a bound")
    path = _toml(tmp_path, off_cfg)
    flagged = _main(["step", path, "--overlap-tp"], capsys)
    assert flagged.splitlines()[0].startswith(f"step {a['step']} ms") and want in flagged.splitlines()
    assert "--overlap-tp ignored" not in flagged and "tp overlap (" not in _main(["step", path], capsys)
    one = _toml(tmp_path, {**off_cfg, "mesh": {"names": ["dp_shard"], "shape": [8]}})
    out = _main(["step", one, "--overlap-tp"], capsys)
    assert "note: --overlap-tp changes nothing: tp 1 has no TP collectives" in out and "tp overlap (" not in out
