"""launch refuses a DeepSpeed plan's training command whose batch or ZeRO numbers are not the
plan's (newcomer trial nc52, finding 19: launch_h100_z3_mismatch was written with exit 0)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli_run import run_cli

JOB = Path(__file__).parent / "data" / "nc52c" / "job_h100_z3.toml"


def test_hf_batch_flags_that_are_not_the_plan_are_refused(tmp_path, monkeypatch, capsys):
    """job_h100_z3: DeepSpeed ZeRO-3 (hpZ 8) on 32 x 8 H100, global batch 1024, micro-batch 1, dp 256:
    1024 / (1 x 256) = 4 accumulation steps. The trial's command gives the HF Trainer
    --per_device_train_batch_size 4 and --gradient_accumulation_steps 32 (a batch of 4 x 32 x 256
    = 32768): one line naming both, exit 2, nothing written. Its JSON ds_offload_other.json is not
    in the folder: not read (the flags alone decide)."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(["launch", JOB, "--out", "l", "--", "python", "train.py", "--deepspeed",
                            "ds_offload_other.json", "--per_device_train_batch_size", "4",
                            "--gradient_accumulation_steps", "32"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: PROGRAM: --per_device_train_batch_size 4, the plan 1; "
                          "--gradient_accumulation_steps 32, the plan 4: ")
    assert not (tmp_path / "l" / "torchrun.sh").exists()


def test_deepspeed_json_is_read_and_checked(tmp_path, monkeypatch, capsys):
    """The JSON after --deepspeed, read from the folder launch runs in: ZeRO stage 2 and no hpZ
    (zero_hpz_partition_size unset: DeepSpeed's 1) against the plan's stage 3 and hpZ 8 is
    refused; the plan's own (stage 3, hpZ 8, batch "auto" with the flags 1 and 4) is written,
    exit 0, the program as given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "z2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    rc, _, err = run_cli(["launch", JOB, "--out", "a", "--", "python", "train.py", "--deepspeed", "z2.json"], capsys)
    assert rc == 2
    assert ("z2.json zero_optimization.stage 2, the plan 3; z2.json zero_optimization.zero_hpz_partition_size 1, "
            "the plan 8") in err
    (tmp_path / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8},
                                                 "train_micro_batch_size_per_gpu": "auto"}))
    rc, _, err = run_cli(["launch", JOB, "--out", "b", "--", "python", "train.py", "--deepspeed", "z3.json",
                          "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4"], capsys)
    assert rc == 0, err
    assert "python train.py --deepspeed z3.json --per_device_train_batch_size 1 --gradient_accumulation_steps 4" \
        in (tmp_path / "b" / "torchrun.sh").read_text()
