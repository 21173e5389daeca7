"""Eager DTensor TP's host pace in the step's outputs (issue 11, newcomer trial 13): the `host:`
line's time is the trace's host-issue waits, the `hint:` line re-plans under torch.compile, the
`--overlap-tp` line names the host when the tp time it hides becomes host wait, and `compare`
itemises the wait under compute. Values are the model's own re-plans, compared with the same
configs planned directly."""

from __future__ import annotations

import tomllib

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.host_hint import host_hint
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import rebuilt_step
from tests.conftest import EXAMPLES
from tests.cli_run import run_main

MINI = EXAMPLES / "mini_2x4_tp4-dp2.toml"


def _plan(compile_: bool = False):
    data = tomllib.loads(MINI.read_text())
    data["training"]["torch_compile"] = compile_
    return build_plan(config_from_dict(data))


def test_host_wait_is_the_traces_host_issue_events():
    """The host wait per step (2219.72 ms) is the sum of the critical stage's `host issue` idle
    events over its units: one per layer where the host is later (each at most a block's
    4.65 / 5.37 ms pace), none compiled."""
    st = step_time(_plan())
    res = st.pipeline
    keys, idx = st.units.index(res.flat)
    waits = [sum(e.end_s - e.start_s for e in st.units.by_key(keys[k]).events if e.name.endswith("host issue"))
             for k in idx[res.stage_slice(st.critical_stage)]]
    assert st.host_wait_s() == pytest.approx(sum(waits), rel=1e-12)
    assert round(st.host_wait_s() * 1e3, 2) == 2219.72
    assert max(e.end_s - e.start_s for k in set(idx.tolist()) for e in st.units.by_key(keys[k]).events
               if e.name.endswith("host issue")) <= 5.37e-3 + 1e-12
    assert step_time(_plan(True)).host_wait_s() == 0.0


def test_hint_replans_under_torch_compile():
    """21.2% of the step waits for the host (>= HINT_SHARE 15%): the hint's step is the compiled
    config's own step (7.93 s against 10.46 s: -24.1%), peak 27.2 GiB."""
    p = _plan()
    st = step_time(p)
    compiled = step_time(_plan(True))
    line, = host_hint(p, st, rebuilt_step(p, step_time))
    assert line.startswith("hint: the device waits 2.22 s of the 10.46 s step (21.2%) for the host")
    assert line.endswith(f"step {compiled.step_s:.2f} s ({compiled.step_s / st.step_s - 1:+.1%}), peak 27.2 GiB fits")
    assert f"{compiled.step_s:.2f}" == "7.93"
    assert host_hint(_plan(True), compiled, rebuilt_step(p, step_time)) == []


def test_overlap_tp_names_the_host_when_hidden_tp_becomes_host_wait(capsys):
    code = run_main("step", MINI, "--overlap-tp")
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("tp overlap (--overlap-tp)"))
    assert code == 0 and line.endswith(
        "saves 0.00 ms per step: the step is bound by the host's issue of eager DTensor TP's blocks (kernels.toml "
        "[host]): the tp time hidden becomes waiting for the host (2219.72 -> 2972.28 ms per step; "
        "training.torch_compile = true removes it)")


def test_compare_itemises_the_host_wait_under_compute(tmp_path, capsys):
    code = run_main("compare", MINI, EXAMPLES / "mini_2x4_tp2-dp4.toml", "--out", tmp_path / "c")
    out = capsys.readouterr().out
    assert code == 0
    assert ("  - of compute, waiting for the host to issue eager DTensor TP's blocks (kernels.toml [host]): "
            "mini_2x4_tp4-dp2 2219.7 ms, mini_2x4_tp2-dp4 43.0 ms (-2176.7 ms)") in out.splitlines()
