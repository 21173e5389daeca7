"""``meshplan plan``'s note when tp is larger than memory needs (:mod:`meshplan.report.axis_need`):
the same world with a smaller tp and the data axis grown re-planned; the smallest that fits named
with its peak, and whether the configured tp is kept for the step."""

from __future__ import annotations

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.axis_need import need_line, smaller_fit
from meshplan.schedule.steptime import step_time
from meshplan.units import GiB, step_seconds
from tests.cli_run import run_main
from tests.configs import job_toml

#: Llama-3-8B on one dgx-h100 (8 x H100 80 GB), zero3, seq 8192, micro-batch 2, no recompute.
#: Usable per GPU = 80e9 B x (1 - 10% reserve) = 72e9 B = 67.06 GiB. The global batch caps dp at
#: global_batch / micro_batch: 16 / 2 = 8 (every dp_shard x tp of 8 GPUs allowed), 4 / 2 = 2.
def config(dp: int, k: int, gb: int = 16, axis: str = "tp") -> str:
    """The job at dp_shard ``dp`` x ``axis`` ``k`` (sequence parallelism on under tp)."""
    return job_toml(training={"global_batch": gb, "seq_len": 8192, "micro_batch": 2, "sharding": "zero3",
                              "recompute": "none"},
                    mesh={"names": ["dp_shard", axis], "shape": [dp, k], "sequence_parallel": axis == "tp"})


def _plan(tmp_path, dp: int, tp: int, gb: int = 16):
    path = tmp_path / f"dp{dp}-tp{tp}-gb{gb}.toml"
    path.write_text(config(dp, tp, gb))
    return path, build_plan(load_config(path))


def test_tp_8_is_more_than_memory_needs_tp_2_is_enough(tmp_path, capsys):
    """tp 8 (dp_shard 1) fits; so do tp 4 (dp_shard 2) and tp 2 (dp_shard 4); tp 1 (dp_shard 8) does
    not: the note names tp 2, its peak and both steps, each the plan of that mesh written by hand."""
    path, p8 = _plan(tmp_path, 1, 8)
    _, p2 = _plan(tmp_path, 4, 2)
    _, p1 = _plan(tmp_path, 8, 1)
    assert p8.feasible and p2.feasible and not p1.feasible
    # usable: the H100's runtime total 79.11 GiB (catalog device_memory_gib) x 0.9 = 71.199 GiB (was 72e9 B = 67.06)
    assert round(p8.constraints.usable_bytes / GiB, 2) == round(79.11 * 0.9, 2) == 71.20
    k, small = smaller_fit(p8, "tp")
    assert k == 2 and small.axis_degrees() == {"dp_shard": 4, "tp": 2}
    assert small.timeline.peak.total_bytes == p2.timeline.peak.total_bytes
    peak2, peak8 = p2.timeline.peak.total_bytes / GiB, p8.timeline.peak.total_bytes / GiB
    assert peak8 < peak2 <= 71.20  # tp 8 shards the activations 4 times more than tp 2
    s8, s2 = step_time(p8).step_s, step_time(p2).step_s
    assert s2 < s8  # tp 8's all-gathers and reduce-scatters on every layer cost more than they save here
    line = (f"note: tp 8 is more than memory needs: tp 2 (dp_shard 4 x tp 2) also fits, timeline peak {peak2:.2f} GiB "
            f"of 71.20 GiB usable (this mesh {peak8:.2f} GiB); not for the step either: {step_seconds(s8)} at tp 8 "
            f"against {step_seconds(s2)} at tp 2")
    assert need_line(p8) == line
    assert run_main("plan", str(path)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == line


def test_no_note_where_the_smaller_tp_does_not_fit_or_the_batch_forces_tp(tmp_path):
    """tp 2 (dp_shard 4): tp 1 does not fit, no note. tp 4 (dp_shard 2) with global batch 4: dp is
    capped at 4 / 2 = 2, so tp 2 (dp_shard 4) is refused by the batch rule, the config forces tp 4."""
    _, p2 = _plan(tmp_path, 4, 2)
    assert p2.feasible and need_line(p2) is None
    _, p4 = _plan(tmp_path, 2, 4, gb=4)
    assert p4.feasible and smaller_fit(p4, "tp") is None and need_line(p4) is None


def test_cp_4_is_more_than_memory_needs_cp_2_is_enough(tmp_path):
    """The same workload at dp_shard 2 x cp 4 (no tp): cp 2 (dp_shard 4) fits, with the peak of that
    mesh written by hand; cp 1 (dp_shard 8) is the tp 1 mesh above, which does not fit."""
    def plan(dp: int, cp: int):
        path = tmp_path / f"dp{dp}-cp{cp}.toml"
        path.write_text(config(dp, cp, axis="cp"))
        return build_plan(load_config(path))
    p4, p2 = plan(2, 4), plan(4, 2)
    assert p4.feasible and p2.feasible and p4.axis_degrees() == {"dp_shard": 2, "cp": 4}
    k, small = smaller_fit(p4, "cp")
    assert k == 2 and small.axis_degrees() == {"dp_shard": 4, "cp": 2}
    assert small.timeline.peak.total_bytes == p2.timeline.peak.total_bytes
    assert need_line(p4).startswith(f"note: cp 4 is more than memory needs: cp 2 (dp_shard 4 x cp 2) also fits, "
                                    f"timeline peak {p2.timeline.peak.total_bytes / GiB:.2f} GiB of 71.20 GiB usable")


def test_with_memory_if_fits_is_the_full_plan_or_none(tmp_path):
    """:func:`~meshplan.plan.with_memory_if_fits`, which :func:`smaller_fit` re-plans with: the
    plan's timelines, stage for stage, where it fits (dp_shard 4 x tp 2), None where it does not
    (dp_shard 8 x tp 1, the mesh over memory above)."""
    from meshplan.plan import with_memory_if_fits

    for dp, tp in ((4, 2), (8, 1)):
        path, full = _plan(tmp_path, dp, tp)
        lean = build_plan(load_config(path), memory=False, reports=False)
        fit = with_memory_if_fits(lean)
        if not full.feasible:
            assert fit is None and (dp, tp) == (8, 1)
            continue
        assert fit.feasible and fit.reasons == () and (dp, tp) == (4, 2)
        assert [tl.peak for tl in fit.timelines] == [tl.peak for tl in full.timelines]
