"""An imported TOML remembers its foreign file (newcomer trial 17 #2): ``import auto job.sh -o
job.toml`` then ``export job.toml --to megatron`` lost ``--lr``, ``--min-lr``, ``--train-iters``,
``--save``, ``--load``, ``--vocab-file`` with no line saying so, while an export straight from
job.sh carried them. The TOML now has a ``[source]`` table (path relative to the TOML, format);
export reads the file back and carries what it carries from the file itself, and says in one line
when the file is gone. Run through the CLI, as the user ran it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshplan import cli
from meshplan.config import load_config
from meshplan.errors import ConfigError

EX = Path(__file__).resolve().parents[1] / "examples"
MEGATRON = EX / "megatron_llama3-8b_16xh100_tp2-pp2.args"
#: The flags of the trial's job that meshplan does not plan, beside the example's own.
UNPLANNED = "--min-lr 3e-5 --save ckpt --load ckpt --vocab-file gpt2-vocab.json\n"
CARRIED = "--lr, --train-iters, --tokenizer-type, --min-lr, --save, --load, --vocab-file"


def _cli(*args: str) -> str:
    r = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "1000"})
    assert r.exit_code == 0, r.output
    return r.output


def _flags(path: Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x and not x.startswith("#")]


@pytest.fixture
def imported(tmp_path) -> tuple[Path, Path]:
    """(jobs/gpt.sh, plans/gpt.toml imported from it): the TOML in another folder than the file."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "plans").mkdir()
    src = tmp_path / "jobs" / "gpt.sh"
    src.write_text(MEGATRON.read_text() + UNPLANNED)
    toml = tmp_path / "plans" / "gpt.toml"
    _cli("import", "auto", str(src), "--cluster", "dgx-h100", "--nodes", "2", "-o", str(toml))
    return src, toml


def test_import_writes_source_relative_to_the_toml(imported):
    src, toml = imported
    assert tomllib.loads(toml.read_text())["source"] == {"path": "../jobs/gpt.sh", "format": "megatron"}
    assert load_config(toml).source == (str(toml.parent / "../jobs/gpt.sh"), "megatron")


def test_export_of_imported_toml_carries_the_source_flags(imported, tmp_path):
    """The TOML's export writes the same flags as the export straight from gpt.sh, and its header
    names the carried flags and the file they came from."""
    src, toml = imported
    out = _cli("export", str(toml), "--to", "megatron", "-o", str(tmp_path / "from-toml.args"))
    _cli("export", str(src), "--to", "megatron", "--cluster", "dgx-h100", "--nodes", "2",
         "-o", str(tmp_path / "from-sh.args"))
    assert _flags(tmp_path / "from-toml.args") == _flags(tmp_path / "from-sh.args")
    assert {"--min-lr 3e-5", "--save ckpt", "--load ckpt", "--vocab-file gpt2-vocab.json", "--lr 3e-4",
            "--train-iters 1000"} <= set(_flags(tmp_path / "from-toml.args"))
    assert f"carried unchanged from {toml.parent / '../jobs/gpt.sh'}, the [source] of {toml}: {CARRIED}" in out


def test_export_says_when_the_source_is_gone(imported, tmp_path):
    """gpt.sh removed: the export writes the plan's flags only and one line says what is not carried
    and how to carry it."""
    src, toml = imported
    src.unlink()
    out = _cli("export", str(toml), "--to", "megatron", "-o", str(tmp_path / "x.args"))
    lines = [x for x in out.splitlines() if "[source]" in x]
    assert lines == [f"warning: {toml.parent / '../jobs/gpt.sh'}, the [source] of {toml} (the megatron file it was "
                     f"imported from), is gone: its settings meshplan does not plan (listed in gpt.toml's header) are "
                     f"not carried; restore it, or export from the original file"]
    assert not [f for f in _flags(tmp_path / "x.args") if f.startswith(("--lr", "--save", "--min-lr"))]


def test_export_to_another_format_lists_the_source_flags_as_not_carried(tmp_path):
    """A DeepSpeed JSON source exported as Megatron-LM arguments: its keys meshplan does not plan
    are named as not carried, as from the JSON itself."""
    src = tmp_path / "ds.json"
    src.write_text((EX / "deepspeed_zero2_16xh100.json").read_text())
    toml = tmp_path / "ds.toml"
    _cli("import", "deepspeed", str(src), "--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b",
         "--seq-len", "8192", "-o", str(toml))
    out = _cli("export", str(toml), "--to", "megatron", "-o", str(tmp_path / "x.args"))
    assert "not carried to megatron: the DeepSpeed settings meshplan does not plan: steps_per_print" in out


def test_export_to_meshplan_keeps_the_source(imported, tmp_path):
    """export --to meshplan keeps [source] (as an absolute path: the new file may be elsewhere) and
    says nothing is lost."""
    src, toml = imported
    out = _cli("export", str(toml), "--to", "meshplan", "-o", str(tmp_path / "again.toml"))
    assert tomllib.loads((tmp_path / "again.toml").read_text())["source"] == {"path": str(src.resolve()),
                                                                              "format": "megatron"}
    assert "not carried" not in out


@pytest.mark.parametrize("table,field", [({"path": "a.sh", "format": "slurm"}, "source.format"),
                                         ({"path": "a.sh", "format": "megatron", "hash": "x"}, "source.hash"),
                                         ({"format": "megatron"}, "source.path")])
def test_bad_source_table_is_one_line(tmp_path, imported, table, field):
    _, toml = imported
    text = toml.read_text().split("\n[source]\n")[0] + "\n[source]\n" + "".join(
        f"{k} = \"{v}\"\n" for k, v in table.items())
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert e.value.field == field and "\n" not in str(e.value)


def test_hf_config_is_written_relative_to_the_toml_as_source_is(tmp_path):
    """Newcomer finding: import wrote ``[source] path`` relative to the TOML but ``model.hf_config``
    absolute. Both are now relative to the written TOML's folder (as load_config reads them), and
    both absolute when the TOML is printed. jobs/job.toml names its model by hf_assets_path = "hf"
    (jobs/hf/config.json, a flavor the catalog lacks); the TOML goes to plans/."""
    (tmp_path / "jobs" / "hf").mkdir(parents=True)
    (tmp_path / "plans").mkdir()
    hf = Path(__file__).resolve().parent / "data" / "hf" / "llama-3.1-8b" / "config.json"
    (tmp_path / "jobs" / "hf" / "config.json").write_text(hf.read_text())
    job = tmp_path / "jobs" / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "custom"\nhf_assets_path = "hf"\n[training]\nseq_len = 4096\n'
                   'local_batch_size = 1\n[parallelism]\ndata_parallel_shard_degree = -1\n')
    toml = tmp_path / "plans" / "job.toml"
    _cli("import", "auto", str(job), "--cluster", "dgx-h100", "--nodes", "1", "-o", str(toml))
    written = tomllib.loads(toml.read_text())
    assert written["model"] == {"hf_config": "../jobs/hf/config.json"}
    assert written["source"] == {"path": "../jobs/job.toml", "format": "torchtitan"}
    assert load_config(toml).model.layers == 32  # read back from the TOML's folder
    printed = tomllib.loads(_cli("import", "auto", str(job), "--cluster", "dgx-h100", "--nodes", "1"))
    assert printed["model"] == {"hf_config": str(tmp_path / "jobs" / "hf" / "config.json")}
    assert printed["source"]["path"] == str(job)
