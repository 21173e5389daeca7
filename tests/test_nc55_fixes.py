"""Newcomer trial nc55's findings (/work/prompts/nc55-report.md), each checked through the CLI
as the user ran it: #1 ``import auto`` of a TOML that does not parse, #2 the ``fix:`` of a -1 that
cannot be inferred, #3 the exit code of a tp the model refuses in a torchtitan file, #6 the launch
scripts' exit code, #10 ``compare`` of two global batches, #13 a number option that does not
parse, #14 the import note on ``checkpoint.enable``."""

from __future__ import annotations

import pytest

from tests.cli_run import run_cli


# ---------------------------------------------------------------- #13 numbers that do not parse

@pytest.mark.parametrize("args,line", [
    # an int option: typer's pydantic "Input should be a valid integer, unable to parse string as an
    # integer" was printed inside "Invalid value for '--nodes': ..." (nc55 #13)
    (["plan", "x.toml", "--nodes", "abc"],
     "error: --nodes: 'abc' is not an integer; fix: give --nodes a whole number; see meshplan plan --help"),
    (["plan", "x.toml", "--seq-len=4k"],
     "error: --seq-len: '4k' is not an integer; fix: give --seq-len a whole number; see meshplan plan --help"),
    # a float option (reliability's storage bandwidth): pydantic's "valid number"
    (["reliability", "x.toml", "--write-gbps", "fast"],
     "error: --write-gbps: 'fast' is not a number; fix: give --write-gbps a number (digits, a decimal point, "
     "an exponent); see meshplan reliability --help"),
])
def test_a_number_option_that_does_not_parse_is_one_line_in_our_words(args, line, capsys):
    code, out, err = run_cli(args, capsys)
    assert (code, out) == (2, "")
    head, cmd = line.split("; see meshplan ")
    assert len(err.splitlines()) == 1 and err.startswith(head + "; see ") and err.endswith(f" {cmd}\n"), err


# ---------------------------------------------------------------- #14 checkpoint.enable listed unused

_TT = """[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
"""


@pytest.mark.parametrize("table,note", [
    # enable = false (the trial's llama3_70b.toml): no checkpoint saved, both keys unused, and why
    ("[checkpoint]\nenable = false\ninterval = 500\n",
     "note: torchtitan: checkpoint: enable = false (torchtitan's default): the job saves no checkpoint, so "
     "checkpoint.enable and checkpoint.interval are listed unused; with enable = true meshplan reads the interval as "
     "[reliability] checkpoint_interval_steps (meshplan reliability sets it beside the optimal interval)"),
    # only an interval: enable unset is torchtitan's default False (job_config.py class Checkpoint)
    ("[checkpoint]\ninterval = 100\n",
     "note: torchtitan: checkpoint: enable unset (torchtitan's default, false): the job saves no checkpoint, so "
     "checkpoint.interval is listed unused; with enable = true meshplan reads the interval as [reliability] "
     "checkpoint_interval_steps (meshplan reliability sets it beside the optimal interval)"),
    # enable = true: the interval is read (checkpoint_interval_steps = 100), neither key unused, no note
    ("[checkpoint]\nenable = true\ninterval = 100\n", None),
])
def test_checkpoint_keys_listed_unused_say_why(table, note, tmp_path, capsys):
    job, out = tmp_path / "job.toml", tmp_path / "plan.toml"
    job.write_text(_TT + table)
    code, said, err = run_cli(["import", "torchtitan", job, "--cluster", "dgx-h100", "--nodes", "1", "-o", out], capsys)
    assert code == 0, err
    err = said + err  # the notes, wherever the command prints them
    written = out.read_text()
    unused = next((line for line in err.splitlines() if "fields meshplan does not use" in line), "")
    notes = [line for line in err.splitlines() if line.startswith("note: torchtitan: checkpoint:")]
    if note is None:
        assert notes == [] and "checkpoint." not in unused and "checkpoint_interval_steps = 100" in written
    else:
        assert notes == [note] and "checkpoint.interval" in unused and "checkpoint_interval_steps =" not in written
