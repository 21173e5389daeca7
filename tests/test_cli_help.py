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
