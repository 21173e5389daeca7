"""The foreign-config options' one home (meshplan.cli.foreign_opts): the option list, the
decorator that puts it on a command, and the ImportOptions it hands the loader."""

import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from meshplan.cli.foreign_opts import OPTIONS, Foreign, foreign_options
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from tests.cli_run import run_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = ("fmt", "cluster", "nodes", "gpu", "model", "seq_len", "micro_batch", "grad_accum", "dtype",
         "gradient_checkpointing", "job_config")  # job_config: --config, a torchtitan config_registry.py function


def test_options_are_import_options_fields_after_format():
    assert tuple(name for name, _ in OPTIONS) == NAMES
    assert NAMES[1:] == tuple(f.name for f in fields(ImportOptions))


def test_decorator_appends_the_options_and_hands_one_foreign():
    seen = {}

    @foreign_options()
    def cmd(config: str, force: bool = False, foreign: Foreign = Foreign()):
        seen.update(config=config, force=force, foreign=foreign)

    assert tuple(inspect.signature(cmd).parameters) == ("config", "force") + NAMES
    cmd(config="a.json", force=True, fmt="deepspeed", cluster="dgx-h100", nodes=2, seq_len=4096)
    assert seen["config"] == "a.json" and seen["force"] is True
    assert seen["foreign"].fmt == "deepspeed"
    assert seen["foreign"].options() == ImportOptions(cluster="dgx-h100", nodes=2, seq_len=4096)


def test_without_format_the_command_keeps_its_own_fmt():
    seen = {}

    @foreign_options(with_format=False)
    def cmd(fmt: str, foreign: Foreign = Foreign()):
        seen.update(fmt=fmt, foreign=foreign)

    assert tuple(inspect.signature(cmd).parameters) == ("fmt",) + NAMES[1:]
    cmd(fmt="auto", gpu="h100-sxm5-80gb")
    assert seen["fmt"] == "auto" and seen["foreign"].fmt is None
    assert seen["foreign"].options() == ImportOptions(gpu="h100-sxm5-80gb")


def test_numbers_are_checked_when_the_options_are_built():
    f = Foreign(None, {"nodes": 0})  # kept as given: the command checks its outputs first
    with pytest.raises(ConfigError) as e:
        f.options()
    assert (e.value.field, e.value.message) == ("--nodes", "0 must be a whole number >= 1")


def test_an_existing_json_is_refused_before_a_bad_nodes(tmp_path, capsys):
    """Order of the one-line errors as before the options moved: plan refuses an existing
    --json before it loads the config, and only then checks --nodes."""
    out = tmp_path / "p.json"
    out.write_text("keep me")
    ds = EXAMPLES / "deepspeed_zero2_16xh100.json"
    assert run_main("plan", ds, "--json", out, "--cluster", "dgx-h100", "--nodes", "0") == 2
    assert capsys.readouterr().err.strip() == (f"error: --json: {out} exists; choose another path or pass --force "
                                               "to replace it")
    assert run_main("plan", ds, "--cluster", "dgx-h100", "--nodes", "0") == 2
    assert capsys.readouterr().err.strip() == "error: --nodes: 0 must be a whole number >= 1"
    assert out.read_text() == "keep me"
