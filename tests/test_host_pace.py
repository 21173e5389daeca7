"""Eager DTensor TP's host pace in the step's outputs (issue 11, newcomer trial 13): the `host:`
line's time is the trace's host-issue waits, the `hint:` line re-plans under torch.compile, the
`--overlap-tp` line names the host when the tp time it hides becomes host wait, and `compare`
itemises the wait under compute. Values are the model's own re-plans, compared with the same
configs planned directly."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import numpy as np
import pytest

from meshplan.compute.kernel_fragment import with_kernel_files
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
    """The host wait per step (2245.21 ms) is the sum of the critical stage's `host issue` idle
    events over its units: one per layer where the host is later (each at most a block's
    4.65 / 5.37 ms pace), none compiled. (nicshare: 2219.72 ms before. FSDP2's reduce-scatters on
    their own stream change which collectives' SM-holding intervals the backward's kernels run under:
    SM contention 74.33 -> 48.84 ms per step, 0.797 ms a backward x 32; the step is bound by the
    host's issue, 10457.17 ms either way, so what the kernels no longer lose the device waits for the
    host instead: 2219.72 + 25.49 = 2245.21 ms.) (kvheads: no repeat_kv copies without ``[memory]
    kv_expanded``, the SDPA reading the 2 local KV heads as they are: 2 x 41,943,040 B a layer at 2.97 TB/s,
    28.24 us x 32 layers x 32 micro-batches = 28.92 ms less device work (and the SM contention it met), the
    step still the host's: 2245.21 -> 2274.38 ms of host wait.)"""
    st = step_time(_plan())
    res = st.pipeline
    keys, idx = st.units.index(res.flat)
    waits = [sum(e.end_s - e.start_s for e in st.units.by_key(keys[k]).events if e.name.endswith("host issue"))
             for k in idx[res.stage_slice(st.critical_stage)]]
    assert st.host_wait_s() == pytest.approx(sum(waits), rel=1e-12)
    assert round(st.host_wait_s() * 1e3, 2) == 2274.38 and round(2219.72 + (74.33 - 48.84), 2) == 2245.21
    assert round(32 * 32 * 2 * 41_943_040 / 2.97e12 * 1e3, 2) == 28.92 and round(st.step_s * 1e3, 2) == 10457.17
    assert max(e.end_s - e.start_s for k in set(idx.tolist()) for e in st.units.by_key(keys[k]).events
               if e.name.endswith("host issue")) <= 5.37e-3 + 1e-12
    assert step_time(_plan(True)).host_wait_s() == 0.0


def test_hint_replans_under_torch_compile():
    """21.5% of the step waits for the host (>= HINT_SHARE 15%): the hint's step is the compiled
    config's own step (7.91 s against 10.46 s: -24.4%), peak 27.2 GiB. (nicshare: 2.22 s, 21.2% and
    7.93 s, -24.1% before: the host wait +25.49 ms, test_host_wait_is_the_traces_host_issue_events;
    compiled, 7933.67 -> 7908.43 ms, SM contention 2.2604 -> 1.4716 ms a backward x 32, test_step_tp_hint.)
    (kvheads: 2.27 s, 21.7%, the host wait 29.17 ms longer, test_host_wait_is_the_traces_host_issue_events; the
    compiled step 7.91 -> 7.88 s, -24.6%: its repeat_kv copies gone too, compiled or not they were copies.)"""
    p = _plan()
    st = step_time(p)
    compiled = step_time(_plan(True))
    line, = host_hint(p, st, rebuilt_step(p, step_time))
    assert line.startswith("hint: the device waits 2.27 s of the 10.46 s step (21.7%) for the host")
    assert line.endswith(f"step {compiled.step_s:.2f} s ({compiled.step_s / st.step_s - 1:+.1%}), peak 27.2 GiB fits")
    assert f"{compiled.step_s:.2f}" == "7.88"
    assert host_hint(_plan(True), compiled, rebuilt_step(p, step_time)) == []


def test_hint_names_a_compiled_step_within_the_tie_band():
    """A compiled re-plan 0.3% shorter (within meshplan.spec.search.TIE, 1%) is not offered as
    shorter: the line says it is within the model's accuracy; 2% shorter is offered."""
    from meshplan.schedule.verdict import Replanned
    from meshplan.units import GiB
    p = _plan()
    st = step_time(p)
    line, = host_hint(p, st, lambda u: Replanned("step", st.step_s * 0.997, 27 * GiB))
    assert line.endswith(f"training.torch_compile = true is not more than 1% shorter (step {st.step_s * 0.997:.2f} s, "
                         f"-0.3%: within the 1% tie threshold)")
    line, = host_hint(p, st, lambda u: Replanned("step", st.step_s * 0.98, 27 * GiB))
    assert line.endswith(f"step {st.step_s * 0.98:.2f} s (-2.0%), peak 27.0 GiB fits")


def test_overlap_tp_names_the_host_when_hidden_tp_becomes_host_wait(capsys):
    code = run_main("step", MINI, "--overlap-tp")
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("tp overlap (--overlap-tp)"))
    assert code == 0 and line.endswith(
        "saves 0.00 ms per step: the step is bound by the host's issue of eager DTensor TP's blocks (kernels.toml "
        "[host]): the tp time hidden becomes waiting for the host (2274.38 -> 3026.69 ms per step; "
        "training.torch_compile = true removes it)")


def test_compare_itemises_the_host_wait_under_compute(tmp_path, capsys):
    code = run_main("compare", MINI, EXAMPLES / "mini_2x4_tp2-dp4.toml", "--out", tmp_path / "c")
    out = capsys.readouterr().out
    assert code == 0
    assert ("  - of compute, waiting for the host to issue eager DTensor TP's blocks (kernels.toml [host]): "
            "mini_2x4_tp4-dp2 2274.4 ms, mini_2x4_tp2-dp4 57.4 ms (-2216.9 ms)") in out.splitlines()
    # kvheads: 2245.2 and 43.0 ms before, the repeat_kv copies' device time now waiting for the host
    # (test_host_wait_is_the_traces_host_issue_events; tp 2: 14.46 ms of 28.92, test_words)


def _with_kernels(cfg, files):
    """``cfg`` with kernels ``files`` laid over its GPU's data, as the CLI's loader does."""
    gpu, _ = with_kernel_files(cfg.cluster.gpu, files)
    return replace(cfg, cluster=cfg.cluster.model_copy(update={"gpu": gpu}))


def _bounds(kernels=()):
    """(candidates, the search's step-time lower bound of each, NaN where a rule rejects it) for
    MINI's workload at pp 1, micro-batch 1 (``[search]`` narrowed), ``kernels`` files laid over."""
    from meshplan.search.estimate import estimate
    from meshplan.search.reasons import OK, first_reason
    from meshplan.search.space import enumerate_candidates

    data = tomllib.loads(MINI.read_text())
    data["search"] = {"pp": [1], "micro_batch": [1], "recompute": ["none"], "sharding": ["zero3"]}
    cfg = _with_kernels(config_from_dict(data, require_mesh=False), kernels)
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    return c, np.where(code == OK, estimate(cfg, c, code).step_lo, np.nan)


PACE = (0.1, 0.2)  # s per block, forward and backward: far above any 8B block's kernels on an H100


def test_one_override_reaches_the_search_bound_and_the_step(tmp_path, monkeypatch):
    """The pace has one home (schedule.workload.dtensor_host_s), which the search's bound calls
    through its module: a kernels file's [host] table and a patch of that function give the same
    bound. At 0.1 + 0.2 s per block, a pp 1, tp > 1 candidate's step lasts at least
    32 layers x (64 / dp_shard) micro-batches x 0.3 s (dp_shard 2 x tp 4: 307.2 s), its bound
    and MINI's step alike; the tp 1 candidates (no DTensor TP) keep the catalog's bound."""
    pace = tmp_path / "pace.toml"
    pace.write_text('[gpu.h100-sxm5-80gb]\nsource = "test host"\n\n[host]\n'
                    f"dtensor_tp_block_forward_s = {PACE[0]}\ndtensor_tp_block_backward_s = {PACE[1]}\n")
    c, catalog = _bounds()
    _, from_file = _bounds([pace])
    monkeypatch.setattr("meshplan.schedule.workload.dtensor_host_s",
                        lambda config, tp: PACE if tp > 1 else (0.0, 0.0))
    _, patched = _bounds()
    tp_on = c.tp > 1
    assert tp_on.any() and (~tp_on).any() and np.isfinite(from_file[tp_on]).any()
    np.testing.assert_array_equal(from_file, patched)
    floor = 32 * (64 // c.dps) * sum(PACE)
    ok = np.isfinite(patched) & tp_on
    assert (patched[ok] >= floor[ok] * (1 - 1e-12)).all() and (catalog[ok] < floor[ok]).all()
    np.testing.assert_array_equal(patched[~tp_on], catalog[~tp_on])
    st = step_time(_plan())
    assert st.units.w.dtensor_host_s == PACE and st.step_s >= 32 * 32 * sum(PACE) * (1 - 1e-12)
    monkeypatch.undo()
    st = step_time(build_plan(_with_kernels(config_from_dict(tomllib.loads(MINI.read_text())), [pace])))
    assert st.units.w.dtensor_host_s == PACE and st.step_s >= 32 * 32 * sum(PACE) * (1 - 1e-12)
    assert f"backward (your kernels file {pace})" in st.host_line()[0]


def test_no_host_pace_fixture_reaches_the_search_bound(no_host_pace, monkeypatch):
    """The conftest fixture patches the one home, so the bound drops the pace too: every tp > 1
    candidate's bound at most the catalog pace's, and below it where the pace held it (MINI's
    dp_shard 2 x tp 4 waits 2.2 s a step for the host); the tp 1 candidates' bounds unchanged."""
    c, patched = _bounds()
    monkeypatch.undo()
    _, catalog = _bounds()
    ok = np.isfinite(patched) & (c.tp > 1)
    assert ok.any() and (patched[ok] <= catalog[ok]).all() and (patched[ok] < catalog[ok]).any()
    np.testing.assert_array_equal(patched[c.tp == 1], catalog[c.tp == 1])
