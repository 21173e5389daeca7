"""One verdict everywhere (issue 11 item 4, issue 13 item 4): every command that resolves a
mesh treats a mesh whose memory does not fit as ``meshplan plan`` does: exit 1 and the plan's
own reason on stderr as ``infeasible: <reason>``.

The infeasible case is the seed's tensor-4 alternative at micro-batch 2 (tests/configs.py TP4_MB2,
examples/seed-64gpu-tp4-mb2.toml: Llama-3-70B, dp_shard 16 x tp 4 on 64 H100): its memory timeline
peaks at 121.5 GiB, above usable HBM (the runtime's 79.11 GiB x 0.9 = 71.2 GiB), so ``plan`` exits 1.
(At micro-batch 1 it peaks at 69.72 GiB and fits, tight.) The reasons asserted below are taken from
the plan built in-process, never typed in: the commands must print exactly what plan says.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.spec.mesh_words import schedule_words
from tests.cli_run import help_words, run_captured
from tests.conftest import EXAMPLES
from tests.configs import TP4_MB2

TP4 = TP4_MB2
SEED = EXAMPLES / "seed-64gpu.toml"


def _run(*args: str) -> SimpleNamespace:
    return run_captured(*args)  # in-process: the exit status and output the console script gives


@pytest.fixture(scope="module")
def tp4_plan():
    p = build_plan(load_config(TP4))
    assert not p.feasible and p.mesh is not None and p.stages is not None  # memory, not validity
    assert "GiB usable" in p.reasons[0]
    return p


def _reason_lines(p, who: str = "") -> str:
    return "".join(f"infeasible: {who + ': ' if who else ''}{r}\n" for r in p.reasons)


def test_plan_and_step_agree_on_an_infeasible_mesh(tp4_plan):
    """step exits 1 like plan, with plan's reason and plan's ``fix:`` line (newcomer trial 50 #10: the same
    verdict lines); the step it prints is labelled as the one the mesh would take if it fit, and is the step
    model's own number."""
    assert _run("plan", str(TP4)).returncode == 1
    r = _run("step", str(TP4))
    assert r.returncode == 1
    would = step_time(tp4_plan, Overlap())
    sched = schedule_words(would.pipeline.spec.schedule, would.pipeline.spec.p)  # pp 1 here: "no pipeline"
    assert sched == "no pipeline"
    from meshplan.spec.accuracy import mfu_caveat
    assert r.stdout == (f"step would be {would.step_s:.3f} s ({sched}, MFU {would.mfu:.1%}) "
                        f"if it fit; it does not fit\n{mfu_caveat()}\n")  # the MFU caveat (words20's 597cc2b)
    plan_fix = [x for x in _run("plan", str(TP4)).stderr.splitlines() if x.startswith("fix: ")]
    assert len(plan_fix) == 1 and r.stderr == _reason_lines(tp4_plan) + plan_fix[0] + "\n"


def test_step_of_a_feasible_mesh_exits_0():
    r = _run("step", str(SEED))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("step ") and "would be" not in r.stdout and "infeasible" not in r.stderr


def test_groups_and_place_print_then_give_the_verdict(tp4_plan):
    """groups and place still print what they show (rank 5's tp group is 4..7 under tp 4), then
    the verdict line, and exit 1 (they exited 0 before: issue 13)."""
    g = _run("groups", str(TP4), "--rank", "5")
    assert g.returncode == 1
    assert "4..7" in g.stdout and g.stderr == _reason_lines(tp4_plan)
    pl = _run("place", str(TP4))
    assert pl.returncode == 1
    assert "CUDA_VISIBLE_DEVICES" in pl.stdout and pl.stderr == _reason_lines(tp4_plan)


def _world_log(path: Path, world: int, per_node: int = 8) -> Path:
    """An NCCL_DEBUG=INFO log of one world communicator: process r on host n<r // per_node>, its
    GPU r % per_node, rank r; no channel lines, so nothing to differ from the placement."""
    lines = [f"n{r // per_node}:{100 + r}:{100 + r} [{r % per_node}] NCCL INFO ncclCommInitRank comm 0x{r + 1:x} "
             f"rank {r} nranks {world} cudaDev {r % per_node} busId 18000 commId 0xabc - Init COMPLETE"
             for r in range(world)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_nccl_check_checks_then_gives_the_verdict(tp4_plan, tmp_path):
    """nccl-check on a mesh that does not fit exited 1 and printed nothing (114 cases of
    issue 13): it now checks the log against the placement and ends with plan's reasons."""
    log = _world_log(tmp_path / "world64.log", 64)
    r = _run("nccl-check", str(TP4), str(log))
    assert r.returncode == 1
    assert r.stdout == "0 difference(s) between the NCCL log and the placement\n"
    assert r.stderr == _reason_lines(tp4_plan)
    seed = _run("nccl-check", str(SEED), str(log))
    assert seed.returncode == 0 and seed.stdout == r.stdout and seed.stderr == ""


def test_nccl_check_of_another_worlds_log_cannot_check(tmp_path):
    """A 16-rank run's log against a 64-rank config: its ranks are not the config's global
    ranks, so no check (exit 2, one line), where it reported 22 differences before."""
    log = Path(__file__).parent / "data" / "nccl" / "dgx-h100x2_world16_dp2_ok.log"
    r = _run("nccl-check", str(SEED), str(log))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("error: dgx-h100x2_world16_dp2_ok.log: cannot check: no communicator of all 64 ranks in the "
                        "log (the largest, commId 0x7d2f3c1b8e4a9a10, has 16), so its ranks are not global ranks; log "
                        "the run from the world communicator's init on (a collective on the default process group, "
                        "e.g. dist.barrier(), creates it) with NCCL_DEBUG=INFO\n")


def test_nccl_check_of_a_mesh_without_placement_says_why(tmp_path):
    """Degrees that do not make the world: no placement to check. The library's plan keeps the
    rejection as a result (search ranks such meshes away); the CLI treats the config as malformed
    input since clinits (exit 2, one line naming mesh.shape and the fix: 3 x 8 = 24 of 64 GPUs,
    so dp_shard 64 / 8 = 8)."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(SEED.read_text().replace("shape = [8, 8]", "shape = [3, 8]"))
    p = build_plan(load_config(cfg))
    assert p.placement is None and p.reasons
    r = _run("nccl-check", str(cfg), str(tmp_path / "no.log"))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: mesh.shape: ") and "= 24 ranks, but the cluster has 64 GPUs" in r.stderr
    assert "fix: shape [8, 8]" in r.stderr


def test_compare_with_neither_fitting_exits_1_with_both_reasons(tp4_plan, tmp_path):
    """dp_shard 32 x tp 2 fits even less than tp 4 (more weight and activation memory per
    rank). Before: a ConfigError (exit 2, as if the input were malformed); now a result: no
    winner, both reasons, exit 1, no evidence folder."""
    tp2 = tmp_path / "seed-tp2.toml"
    tp2.write_text(TP4.read_text().replace("shape = [16, 4]", "shape = [32, 2]"))
    tp2_plan = build_plan(load_config(tp2))
    assert not tp2_plan.feasible
    out = tmp_path / "out"
    r = _run("compare", str(TP4), str(tp2), "--out", str(out))
    assert r.returncode == 1
    assert "verdict: neither mesh fits" in r.stdout
    assert r.stderr == _reason_lines(tp4_plan, "seed-64gpu-tp4-mb2") + _reason_lines(tp2_plan, "seed-tp2")
    assert not out.exists()


def test_compare_with_a_feasible_winner_exits_0_and_names_the_loser_reason(tp4_plan, tmp_path):
    r = _run("compare", str(SEED), str(TP4), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "verdict: seed-64gpu (rejected: seed-64gpu-tp4-mb2)" in r.stdout
    assert tp4_plan.reasons[0] in " ".join(r.stdout.split())


def test_search_with_nothing_that_fits_exits_1(tmp_path):
    """Llama-3-70B on one DGX H100 (8 GPUs): parameters, gradients and Adam state alone are
    70.6e9 x 16 B / 8 = 141 GB per GPU > 79.11 GiB (84.9 GB), whatever the mesh, so no candidate fits."""
    cfg = tmp_path / "one-node.toml"
    cfg.write_text('[model]\ncatalog = "llama3-70b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                   '[training]\nglobal_batch = 64\nseq_len = 4096\n')
    r = _run("search", str(cfg))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr


def test_help_states_the_exit_codes():
    text = help_words()
    assert "exit status: 0 feasible" in text and "1 infeasible" in text and "2 malformed input" in text
