"""``--fp8-param-gather`` is a planned flag since te50 (``training.fp8_param_gather``, written by
``export --to megatron`` where true) but stayed among the flags an export carries from the user's
file as given (``megatron_carry.KEPT_UNLESS_WRITTEN``, from before it was planned). So a plan that
keeps it off, imported from a file that gives it, exported with the user's switch (its own header
then said ``training.fp8_param_gather: False -> True``) and ``launch`` let the program give it: the
run would gather fp8 parameters the plan does not (1 B a value instead of 2, the fp8 parameters'
memory). Megatron-LM's ``--fp8-param-gather`` is a store_true switch (d98e8a6
``training/arguments.py:2016-2018``): no later word undoes it, so the export must drop it and
launch refuse it (``megatron_carry.planned_off``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshplan.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args"


def _run(argv, capsys, cwd, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def _imported(tmp_path, capsys, monkeypatch, gather: bool) -> Path:
    """The example's Llama-3-8B tp 2 x pp 2 arguments with TE fp8 (--fp8-format hybrid) and
    --fp8-param-gather under its distributed optimizer, imported (fp8_param_gather = true), then
    set to ``gather``."""
    args = EXAMPLE.read_text().replace("--recompute-activations", "--recompute-activations --fp8-format hybrid "
                                       "--fp8-param-gather")
    (tmp_path / "job.args").write_text(args)
    rc, _, err = _run(["import", "megatron", "job.args", "--cluster", "dgx-h100", "--nodes", "2", "--out", "job.toml",
                       "--force"],
                      capsys, tmp_path, monkeypatch)
    text = (tmp_path / "job.toml").read_text()
    assert rc == 0 and "fp8_param_gather = true" in text, err
    (tmp_path / "job.toml").write_text(text.replace("fp8_param_gather = true", f"fp8_param_gather = {str(gather).lower()}"))
    return tmp_path / "job.toml"


def test_export_drops_the_users_fp8_param_gather_where_the_plan_keeps_it_off(tmp_path, capsys, monkeypatch):
    """Planned off: the exported flags hold no --fp8-param-gather, the header says the user's switch
    is dropped and no longer that the plan is not expressed; planned on: written once, as before."""
    _imported(tmp_path, capsys, monkeypatch, False)
    rc, out, err = _run(["export", "job.toml", "--to", "megatron", "-o", "-"], capsys, tmp_path, monkeypatch)
    assert rc == 0 and "--fp8-param-gather" not in out.split() and "--fp8-format" in out.split(), out
    assert "--fp8-param-gather (switch) -> dropped" in err and "not expressed" not in err, err
    _imported(tmp_path, capsys, monkeypatch, True)
    rc, out, err = _run(["export", "job.toml", "--to", "megatron", "-o", "-"], capsys, tmp_path, monkeypatch)
    assert rc == 0 and out.split().count("--fp8-param-gather") == 1 and "not expressed" not in err, err


def test_launch_refuses_the_programs_fp8_param_gather_where_the_plan_keeps_it_off(tmp_path, capsys, monkeypatch):
    """The program's --fp8-param-gather under a plan that keeps it off: one line naming PROGRAM,
    the flag and the fix (style50's refusal), nothing written; under a plan that runs it: launched."""
    _imported(tmp_path, capsys, monkeypatch, False)
    argv = ["launch", "job.toml", "--out", "L", "--", "python", "pretrain_gpt.py", "--fp8-param-gather", "--lr", "1"]
    rc, out, err = _run(argv, capsys, tmp_path, monkeypatch)
    assert rc == 2 and [x for x in err.splitlines() if x.startswith("error:")] == [
        "error: PROGRAM: --fp8-param-gather is a Megatron-LM flag meshplan plans, which the plan's appended flags "
        "leave out (a switch it keeps off, or an option at Megatron-LM's default): no later word undoes it, so the "
        "run would not be the plan; remove it from the program, or plan it in job.toml"], err
    assert not (tmp_path / "L" / "torchrun.sh").exists()
    shutil.rmtree(tmp_path / "L", ignore_errors=True)
    _imported(tmp_path, capsys, monkeypatch, True)
    rc, out, err = _run(argv, capsys, tmp_path, monkeypatch)
    assert rc == 0 and (tmp_path / "L" / "torchrun.sh").exists(), err
