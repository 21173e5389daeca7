"""Several ``validate`` configs in one torchrun launch (meshplan.runtime.validation.batch, the
worker's ``--jobs``): what a batch refuses, and how the worker reads its jobs. The launches
themselves run in tests/test_validate_pipeline.py, test_validate_pp_combos.py and
test_validate_cp.py (their module fixtures), every assertion of their per-config runs kept."""

import json

import pytest

pytest.importorskip("torch")

from meshplan.errors import ConfigError  # noqa: E402
from meshplan.runtime.validation.batch import check_batch  # noqa: E402
from meshplan.runtime.validation.options import Options  # noqa: E402


def test_a_batch_runs_one_world_without_faults_testbed_or_hosts(tmp_path):
    """One launch is one torchrun of W ranks: every job the same single world; the fault
    injections and the testbed keep their own launch (what they test is the launch itself)."""
    job = (None, Options(worlds=(4,)), tmp_path / "a")
    assert check_batch([job, (None, Options(worlds=(4,), layers=4), tmp_path / "b")]) == 4
    with pytest.raises(ConfigError, match="worlds"):
        check_batch([job, (None, Options(worlds=(8,)), tmp_path / "b")])
    with pytest.raises(ConfigError, match="worlds"):
        check_batch([(None, Options(worlds=(2, 4)), tmp_path / "a")])
    with pytest.raises(ConfigError, match="jobs"):
        check_batch([])
    for bad in (dict(fail_rank=1), dict(hang_rank=0), dict(testbed="mp"), dict(nnodes=2, rdzv_endpoint="h:1")):
        with pytest.raises(ConfigError, match="fail_rank/hang_rank/testbed/nnodes"):
            check_batch([job, (None, Options(worlds=(4,), **bad), tmp_path / "b")])


def test_the_worker_reads_each_jobs_own_arguments(tmp_path):
    """``--jobs FILE``: a JSON list of argument lists, each parsed as one run's (its plan, its
    folder, its steps); without it the arguments are one job's, as before."""
    from meshplan.runtime.execution.worker import parse_jobs

    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([["--plan-json", "a/plan.json", "--out", "a", "--steps", "1"],
                                ["--plan-json", "b/plan.json", "--out", "b", "--probe-spec", "b/probe.json"]]))
    got = parse_jobs(["--jobs", str(jobs)])
    assert [(j.plan_json, j.out, j.steps, j.probe_spec) for j in got] == [("a/plan.json", "a", 1, ""),
                                                                         ("b/plan.json", "b", 3, "b/probe.json")]
    one = parse_jobs(["--plan-json", "p.json", "--out", "o", "--fail-rank", "2"])
    assert [(j.plan_json, j.out, j.fail_rank) for j in one] == [("p.json", "o", 2)]
