"""``meshplan validate`` of a pipelined mesh runs the fewest micro-batches its schedule takes
(issue 11, newcomer trial 4: the CLI always scaled to 1 micro-batch, so every pp config failed
with ``1F1B needs micro-batches (1) >= pp (2)``), and ``--micro-batches N`` sets them.

Expected counts from torch 2.13's constructors (torch/distributed/pipelining/schedules.py):
``Schedule1F1B`` refuses m < pp, ``ScheduleDualPipeV`` m < its 2 pp stages, the looped
schedules an m that is not a multiple of their rounds max(1, m // pp) (p itself is one round);
meshplan starts at pp (below it no stage reaches the steady state)."""

import dataclasses
import json
from pathlib import Path

import pytest

from meshplan.config import load_config
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.scaling import scale_config
from tests.cli_run import run_captured

DATA = Path(__file__).parent / "data"
PP_FSDP = DATA / "validate_llama8b_pp2_fsdp.toml"  # pp 2 x dp_shard 4, 1F1B, global batch 64


def _micro(schedule: str, vpp: int = 1, runs: int = 1, world: int = 4, micro=None) -> tuple[int, str]:
    cfg = load_config(PP_FSDP)
    cfg = dataclasses.replace(cfg, mesh=cfg.mesh.model_copy(update={"pp_schedule": schedule, "virtual_stages": vpp}),
                              training=cfg.training.model_copy(update={"pp_schedule_runs": runs}))
    scaled, notes = scale_config(cfg, world, Options(micro_batches=micro))
    t = scaled.training
    return t.global_batch // (t.micro_batch * (world // 2)), next(n for n in notes if n.startswith("batch:"))


@pytest.mark.parametrize("schedule,vpp,runs,want", [
    ("gpipe", 1, 1, 2), ("1f1b", 1, 1, 2), ("interleaved_1f1b", 2, 1, 2), ("zbv", 2, 1, 2), ("dualpipev", 2, 1, 4),
    ("1f1b", 1, 2, 4),  # two schedule runs of 2 (training.pp_schedule_runs)
])
def test_default_is_the_fewest_micro_batches_the_schedule_runs(schedule, vpp, runs, want):
    assert _micro(schedule, vpp, runs)[0] == want


def test_batch_line_says_why_and_an_explicit_count_is_kept():
    m, line = _micro("1f1b")
    assert line == ("batch: micro_batch 1 -> 1, seq_len 8192 -> 64, global_batch 64 -> 4 = micro_batch 1 x dp 2 x 2 "
                    "micro-batch(es) (the fewest pp_schedule 1f1b runs at pp 2; --micro-batches N sets them)")
    m, line = _micro("1f1b", micro=6)
    assert m == 6 and line.endswith("global_batch 64 -> 12 = micro_batch 1 x dp 2 x 6 micro-batch(es)")


@pytest.mark.parametrize("world,dp", [(4, 1), (8, 2)])
def test_the_newcomers_pp2_dp_shard2_tp2_config_plans_at_worlds_4_and_8(tmp_path, world, dp):
    """Issue 11's config: Llama 3 8B, pp 2 x dp_shard 2 x tp 2, 1F1B by default, global batch 16:
    the scaled plan was infeasible at both worlds (1 micro-batch < pp 2); now 2, feasible."""
    from meshplan.plan import build_plan

    p = tmp_path / "c.toml"
    p.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
                 'global_batch = 16\nseq_len = 8192\nmicro_batch = 1\n[mesh]\nnames = ["pp", "dp_shard", "tp"]\n'
                 'shape = [2, 2, 2]\n')
    scaled, notes = scale_config(load_config(p), world, Options(layers=2))
    assert (f"global_batch 16 -> {2 * dp} = micro_batch 1 x dp {dp} x 2 micro-batch(es) (the fewest pp_schedule "
            "1f1b runs at pp 2") in next(n for n in notes if n.startswith("batch:"))
    plan = build_plan(scaled)
    assert plan.feasible and plan.micro_batches == 2, plan.reasons


def test_pp1_keeps_one_micro_batch():
    cfg = load_config(DATA / "validate_llama8b_tp2sp_fsdp.toml")
    scaled, _ = scale_config(cfg, 4, Options())
    assert scaled.training.global_batch == scaled.training.micro_batch * 2  # dp_shard 2 x 1 micro-batch


def test_micro_batches_the_schedule_refuses_are_one_line_exit_2(tmp_path):
    pytest.importorskip("torch")
    r = run_captured("validate", PP_FSDP, "--worlds", "4", "--micro-batches", "1", "--out", tmp_path / "ev")  # refused: no run
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("error: --micro-batches: 1 at world 4: 1F1B needs micro-batches (1) >= pp (2) (torch "
                        "Schedule1F1B); give --micro-batches 2 (the fewest it runs), or leave it out\n")
    assert not (tmp_path / "ev").exists()


def shared_validate_runs() -> dict:
    """The newcomer's command ``meshplan validate PP_FSDP --worlds 2 --steps 1 --no-probe --seq-len
    32 --timeout-s 150`` as the Options the CLI builds from it (no ``--micro-batches``: None), in
    the shared 2-rank launch (tests/conftest.py ``world2_runs``, tests/validate_runs.py)."""
    return {"pp2_default_micro_batches": (PP_FSDP, Options(worlds=(2,), steps=1, probe=False, seq_len=32,
                                                           timeout_s=150))}


@pytest.mark.slow
def test_cli_runs_a_pp2_1f1b_mesh_with_two_micro_batches(world2_runs):
    """The newcomer's command (``--steps 1 --no-probe``, no --micro-batches) on pp 2 x dp_shard
    1 (world 2) with gloo: 2 micro-batches, the run matches the plan, exit 0. Run in the shared
    launch (:func:`shared_validate_runs`): its console lines are the ones ``validate`` prints
    (the CLI adds the ``evidence:`` line); the CLI's refusal path is
    :func:`test_micro_batches_the_schedule_refuses_are_one_line_exit_2`."""
    r = world2_runs["pp2_default_micro_batches"]
    out = r.out
    assert ("global_batch 64 -> 2 = micro_batch 1 x dp 1 x 2 micro-batch(es) (the fewest pp_schedule 1f1b runs at "
            "pp 2; --micro-batches N sets them)") in r.stdout
    assert r.code == 0, r.stdout
    assert "  OK: " in r.stdout and "FAILED" not in r.stdout
    assert json.loads((out / "world2" / "plan.json").read_text())["mesh"]["micro_batches"] == 2
    for rank in (0, 1):
        steps = json.loads((out / "world2" / f"rank{rank}" / "timings.json").read_text())["steps"]
        assert steps and all(s["micro_batches"] == 2 for s in steps)


def test_a_bf16_gradient_reduction_runs_and_is_planned_in_fp32():
    """Newcomer 32: a DeepSpeed import sets ``grad_reduce_dtype = "bf16"``; the CPU run reduces in
    fp32 (every dtype fp32) while the scaled plan kept bf16 rows, so validate failed on six
    reduce-scatters of its own making (1,352,704 B bf16 planned, 2,705,408 B fp32 run: 2 x). The
    scaled training reduces in fp32 and the dtypes line names the config's reduction, bf16."""
    from meshplan.plan import build_plan

    cfg = load_config(DATA / "validate_llama8b_tp2sp_fsdp.toml")
    cfg = dataclasses.replace(cfg, training=cfg.training.model_copy(update={"grad_reduce_dtype": "bf16"}))
    assert cfg.training.gradient_reduce_dtype == "bf16"
    scaled, notes = scale_config(cfg, 4, Options())
    assert scaled.training.gradient_reduce_dtype == "fp32"
    assert next(n for n in notes if n.startswith("dtypes:")).endswith("reduce bf16)")
    rows = [r for r in build_plan(scaled).stage(0).collectives if r.op == "reduce-scatter" and r.axis in ("fsdp", "dp_shard")]
    assert rows and {r.dtype for r in rows} == {"fp32"}
