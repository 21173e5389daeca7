"""--help says what each command does (the help of a command is its contract)."""

import inspect
import os
import subprocess
import sys


def _help(cmd: str) -> str:
    r = subprocess.run([sys.executable, "-m", "meshplan.cli", cmd, "--help"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def test_validate_help_names_both_backends():
    """The worker initialises NCCL when CUDA is present, gloo otherwise: the help says both."""
    from meshplan.runtime.execution import worker
    src = inspect.getsource(worker._init)
    assert src.index('init_process_group("nccl"') < src.index('init_process_group("gloo"')
    assert "torch.cuda.is_available()" in src
    assert "(torchrun: NCCL on the GPUs when CUDA is present, else gloo on CPU)" in _help("validate")


def test_compare_help_names_the_default_out():
    assert "--out <path> folder for the rejected mesh's evidence [default: out/compare]" in _help("compare")


def test_config_argument_help_says_what_each_command_reads():
    """plan, report, groups, memory, step, reliability, search and export read a torchtitan,
    Megatron-LM or DeepSpeed file directly (the loader with the foreign options); compare,
    place, launch, nccl-check and validate read a meshplan TOML and say to import first."""
    from typer.testing import CliRunner

    from meshplan.cli import app
    runner = CliRunner()
    for cmd in ("plan", "report", "groups", "memory", "step", "reliability", "search", "export"):
        text = " ".join(runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "400"}).output.split())
        assert ("meshplan TOML config ([model], [cluster], [training], [mesh]), or a torchtitan job TOML, Megatron-LM "
                "arguments (file or launch script) or DeepSpeed JSON, read directly with --cluster/--nodes") in text, cmd
    for cmd in ("compare", "place", "launch", "nccl-check", "validate"):
        text = " ".join(runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "400"}).output.split())
        assert "meshplan TOML config (a torchtitan, Megatron-LM or DeepSpeed file: meshplan import it first)" in text, cmd
        assert "Megatron-LM arguments (file" not in text, cmd
