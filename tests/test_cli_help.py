"""--help says what each command does (the help of a command is its contract)."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

from tests.cli_run import help_words

ROOT = Path(__file__).resolve().parents[1]


def test_validate_help_names_both_backends():
    """The worker initialises NCCL when CUDA is present, gloo otherwise: the help says both."""
    from meshplan.runtime.execution import worker
    src = inspect.getsource(worker._init)
    assert src.index('init_process_group("nccl"') < src.index('init_process_group("gloo"')
    assert "torch.cuda.is_available()" in src
    assert "(torchrun: NCCL on the GPUs when CUDA is present, else gloo on CPU)" in help_words("validate")


def test_compare_help_names_the_default_out():
    assert "--out <path> folder for the rejected mesh's evidence [default: out/compare]" in help_words("compare")


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


# documented once for every command in "Output contracts" (docs/commands.md: --json, --force) and, for the
# commands that read a foreign config (the plan row: torchtitan, Megatron-LM, DeepSpeed), "Foreign configs"
SHARED = {"--help", "--json", "--force"}
FOREIGN = {"--format", "--cluster", "--nodes", "--gpu", "--model", "--seq-len", "--micro-batch", "--grad-accum",
           "--dtype", "--gradient-checkpointing", "--config"}  # meshplan/cli/foreign_opts.OPTIONS, named once in docs/commands.md ("CONFIG ... with")
READS_FOREIGN = {"plan", "report", "groups", "memory", "step", "reliability", "search", "export"}


def test_every_option_is_in_its_readme_row():
    """Newcomer finding (issue 11 item 6): reliability --lost-nodes/--spare-nodes, step
    --no-prefetch, place --rank and five launch options were in --help but not in the README.
    Every option of every top-level command is named in that command's row of the README table
    (a flag by either of its names, an option by its long or short name), but the shared ones. The
    full rows are now docs/commands.md's sections: each one's signature line is the row's first cell."""
    import re
    import typer
    from meshplan.cli import app
    from tests.docs_text import command_sections, command_signature
    rows = {name: command_signature(name) for name in command_sections()}  # docs/commands.md, a section each
    missing = []
    for name, cmd in typer.main.get_command(app).commands.items():
        if hasattr(cmd, "commands"):  # bench, testbed: groups with their own rows
            continue
        assert name in rows, f"{name}: no section in docs/commands.md"
        skip = SHARED | (FOREIGN if name in READS_FOREIGN else set())
        for p in cmd.params:
            names = [o for o in p.opts + p.secondary_opts if o.startswith("-")]
            if names and not set(names) & skip and not any(re.search(re.escape(o) + r"\b", rows.get(name, ""))
                                                            for o in names):
                missing.append(f"{name} {names[0]}")
    assert missing == []


def test_python_dash_m_meshplan_runs_the_cli():
    """``python -m meshplan`` is the console script: same command list, exit 0 on --help."""
    r = subprocess.run([sys.executable, "-m", "meshplan", "--help"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "Usage: python -m meshplan" in r.stdout
    for cmd in ("plan", "search", "compare", "step", "reliability", "calibrate", "validate"):
        assert f" {cmd} " in r.stdout, cmd
