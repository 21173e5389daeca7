"""``meshplan step --schedule`` judged before the plan's rules (newcomer trial 13, finding 1): a
pp 2 x tp 4 mesh with one micro-batch (global_batch 1) is infeasible under the config's default
1F1B (torch's Schedule1F1B needs micro-batches >= pp) but plans under GPipe; ``--schedule gpipe``
printed 1F1B's refusal and exited 1. A micro-batch refusal of ``--schedule`` named the virtual
stages as its fix, which does not help: it now names the micro-batches the rule needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(argv, capsys) -> tuple[int, str, str]:
    """``meshplan ARGV`` in this process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def _pp2(tmp_path, schedule: str | None = None) -> Path:
    """examples/mini_2x4_tp4-dp2.toml as pp 2 x tp 4 with global_batch 1: m = 1 / (1 x dp 1) = 1."""
    text = (EXAMPLES / "mini_2x4_tp4-dp2.toml").read_text()
    text = text.replace('names = ["dp_shard", "tp"]', 'names = ["pp", "tp"]').replace("global_batch = 64",
                                                                                    "global_batch = 1")
    if schedule:
        text += f'pp_schedule = "{schedule}"\n'
    f = tmp_path / f"pp2_{schedule or 'default'}.toml"
    f.write_text(text)
    return f


def test_the_option_rescues_a_mesh_its_configs_schedule_refuses(tmp_path, capsys):
    rc, out, err = run(["step", _pp2(tmp_path)], capsys)
    assert (rc, out) == (1, "")
    assert err == "infeasible: 1F1B needs micro-batches (1) >= pp (2) (torch Schedule1F1B)\n"
    rc, asked, err = run(["step", _pp2(tmp_path), "--schedule", "gpipe"], capsys)
    assert rc == 0 and "1F1B" not in err
    assert asked.splitlines()[0].startswith("step ") and "(gpipe, p 2, m 1, v 1)" in asked.splitlines()[0]
    rc, own, _ = run(["step", _pp2(tmp_path, "gpipe")], capsys)  # the same plan as pp_schedule = "gpipe"
    assert rc == 0 and own == asked


def test_a_micro_batch_refusal_names_the_micro_batches_not_the_virtual_stages(tmp_path, capsys):
    rc, out, err = run(["step", _pp2(tmp_path, "gpipe"), "--schedule", "1f1b"], capsys)
    assert (rc, out) == (2, "")
    assert err == ("error: --schedule: 1f1b: 1F1B needs micro-batches (1) >= pp (2) (torch Schedule1F1B); raise "
                   "training.global_batch, or lower training.micro_batch or pp, until the step's micro-batches (now "
                   "1: global_batch / (micro_batch x dp)) meet the rule (the fewest 1f1b runs at pp 2: 2), or choose "
                   "a schedule this mesh allows\n")
    assert "virtual stages" not in err


def test_dualpipev_names_both_of_its_rules(tmp_path, capsys):
    """DualPipeV needs a V (virtual_stages 2) and 2 pp = 4 micro-batches (torch ScheduleDualPipeV);
    the fix names the key and the value: Llama-3-8B's 32 layers / (pp 2 x 2) = 8 per virtual stage
    (newcomer trial 29: "the config's virtual stages" named no key)."""
    rc, _, err = run(["step", _pp2(tmp_path, "gpipe"), "--schedule", "DualPipeV"], capsys)
    assert rc == 2
    assert err == ("error: --schedule: dualpipev: DualPipeV needs virtual_stages = 2 (two chunks per rank, a V), got "
                   "1; DualPipeV needs micro-batches (1) >= 2 pp (4) (torch ScheduleDualPipeV); set mesh.virtual_stages = 2 "
                   "(32 layers / (pp 2 x 2) = 8 per virtual stage), and raise training.global_batch, or lower "
                   "training.micro_batch or pp, until the step's micro-batches (now 1: global_batch / (micro_batch x "
                   "dp)) meet the rule (the fewest dualpipev runs at pp 2: 4), or choose a schedule this mesh "
                   "allows\n")


def test_the_memory_rule_judges_the_asked_schedule(tmp_path, capsys):
    """Llama-3-8B, pp 2 x dp 4 x tp 2, 32 micro-batches of 8192 tokens: 1F1B holds at most pp = 2
    micro-batches' activations on stage 0 and fits; GPipe holds all 32 before the first backward
    (peak on stage 1 at the head's forward of micro-batch 31) and does not. ``--schedule gpipe``
    printed the step as if it fit (the plan's memory was 1F1B's)."""
    toml = tmp_path / "t.toml"
    toml.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 2\n[training]\n'
                    'global_batch = 128\nseq_len = 8192\nsharding = "zero1"\n[mesh]\nnames = ["pp", "dp", "tp"]\n'
                    'shape = [2, 4, 2]\nsequence_parallel = true\n')
    assert run(["step", toml], capsys)[0] == 0
    rc, out, err = run(["step", toml, "--schedule", "gpipe"], capsys)
    assert rc == 1 and out.startswith("step would be ") and "(gpipe, MFU" in out
    assert err.splitlines()[:-1] == ["infeasible: peak 410.8 GiB at forward of the head (micro-batch 31) on stage 1 > "
                                "71.2 GiB usable (79.1 GiB - 10% reserve)",  # 79.11 GiB x 0.9
                                "infeasible: 2 of 2 stages exceed usable memory: stages 0, 1"]
    assert err.splitlines()[-1].startswith("fix: ")  # plan's fix line, step's too (newcomer trial 50 #10)


def test_schedule_runs_count_per_run(tmp_path, capsys):
    """global_batch 4 as 4 schedule runs (training.pp_schedule_runs) of 1 micro-batch: 1F1B needs
    pp = 2 per run, so 4 x 2 = 8 per step. Runs that do not divide the micro-batches (6 / 4) are
    the config's fault under any schedule: the plan's infeasible line, not a --schedule error."""
    def toml(batch):
        f = _pp2(tmp_path, "gpipe")
        f.write_text(f.read_text().replace("global_batch = 1", f"global_batch = {batch}\npp_schedule_runs = 4"))
        return f
    rc, _, err = run(["step", toml(4), "--schedule", "1f1b"], capsys)
    assert rc == 2 and err == (
        "error: --schedule: 1f1b: each of the 4 schedule runs (training.pp_schedule_runs): 1F1B needs micro-batches (1) "
        ">= pp (2) (torch Schedule1F1B); raise training.global_batch, or lower training.micro_batch or pp, until the "
        "step's micro-batches (now 4: global_batch / (micro_batch x dp), 4 schedule runs: training.pp_schedule_runs) "
        "meet the rule (the fewest 1f1b runs at pp 2: 8), or choose a schedule this mesh allows\n")
    rc, out, err = run(["step", toml(6), "--schedule", "1f1b"], capsys)
    assert (rc, out, err) == (1, "", "infeasible: training.pp_schedule_runs 4 does not divide the step's 6 "
                                     "micro-batches (global_batch / (micro_batch x dp)); use a divisor of 6\n")
