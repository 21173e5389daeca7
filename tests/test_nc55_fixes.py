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
