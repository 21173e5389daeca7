"""Findings of newcomer trial 22: each test failed on int before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import run_main as _main

from meshplan.spec.hf import model_from_hf_config

HF = Path(__file__).resolve().parent / "data" / "hf"

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


DSV3 = Path(__file__).resolve().parents[1] / "examples" / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"


def test_step_says_the_ep_traffic_counts_plain_top_k_under_node_limited_routing(capsys):
    # was: the catalog's source said so, step's ep verdict did not
    assert _main("step", DSV3) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("verdict: network-bound") and "most on ep" in x)
    assert lines[at + 1] == (
        "note: ep all-to-all bytes are planned for plain top-k routing (8 copies of each token, to any of the 256 "
        "experts); deepseek-v3's group-limited routing (n_group 8, topk_group 4: experts from 4 of 8 groups, at "
        "most 4 nodes per token in DeepSeek-V3) is not modelled: a plain all-to-all sends the same bytes, a "
        "dispatch that sends one copy per node (DeepEP) sends fewer across the network")


def test_the_hf_reader_keeps_the_routing_groups():
    spec = model_from_hf_config(json.loads((HF / "deepseek-v3" / "config.json").read_text()))
    assert "(group-limited routing, n_group 8, topk_group 4, no size)" in spec.source
