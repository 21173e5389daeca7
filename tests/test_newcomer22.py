"""Findings of newcomer trial 22: each test failed on int before its fix."""

from __future__ import annotations

import pytest
from cli_run import run_main as _main

#: Llama 3 70B, dp_shard 64 x tp 8 on 64 DGX H100, with tp spelled ``tensor`` (the trial's config).
TENSOR = """[model]
catalog = "llama3-70b"
[cluster]
system = "dgx-h100"
nodes = 64
[training]
global_batch = 512
seq_len = 8192
micro_batch = 1
sharding = "zero3"
[mesh]
names = ["dp_shard", "tensor"]
shape = [64, 8]
"""


@pytest.mark.parametrize("name, axis, who", [("tensor", "tp", "torchtitan/Megatron"),
                                             ("pipe", "pp", "DeepSpeed"),
                                             ("expert", "ep", "torchtitan/Megatron")])
def test_another_frameworks_word_for_an_axis_is_refused(tmp_path, capsys, name, axis, who):
    # was: "tensor" planned as a custom axis (plan exit 0, "axis tensor: solves no stated constraint")
    job = tmp_path / "job.toml"
    job.write_text(TENSOR.replace('"tensor"', f'"{name}"'))
    assert _main("plan", job) == 2
    assert capsys.readouterr().err.strip() == (
        f'error: mesh.names: "{name}" is {who}\'s word for {axis}; write "{axis}" (or list it in '
        f"mesh.custom_axes to keep a custom axis of that name)")


def test_a_foreign_word_listed_in_custom_axes_stays_a_custom_axis(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(TENSOR.replace("shape = [64, 8]", 'shape = [64, 8]\ncustom_axes = ["tensor"]'))
    assert _main("plan", job) == 1  # infeasible: a custom axis shards no weight (229 GiB peak, no TP)
    assert "  axis tensor: solves no stated constraint" in capsys.readouterr().out


def test_an_unquoted_4k_names_the_key_and_the_fix(tmp_path, capsys):
    # was: "not valid TOML (Expected newline or end of document after a statement (at line 8, column 12))"
    job = tmp_path / "job.toml"
    job.write_text(TENSOR.replace('"tensor"', '"tp"').replace("seq_len = 8192", "seq_len = 4k"))
    assert _main("plan", job) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: config: {job}: not valid TOML (training.seq_len (line 8): Expected newline or end of document "
        f'after a statement; "4k" is not a number (TOML has no k suffix): write seq_len = 4096 (4 x 1024))')
