"""What a Megatron FSDP export writes for Megatron-LM to start (newcomer trial, issue 11
follow-up), checked against NVIDIA/Megatron-LM d98e8a6 ``megatron/training/arguments.py``
``validate_args``: ``--use-distributed-optimizer`` beside ``--use-megatron-fsdp`` (Megatron-FSDP
v1 runs the distributed optimizer, lines 1124-1135), a comment line to unset
CUDA_DEVICE_MAX_CONNECTIONS (asserted not 1 under Megatron FSDP, lines 1166-1167), and no
``--no-gradient-accumulation-fusion`` (not asserted there; the plan times the fused
accumulation), which an import reads as a note and an export carries from the user's file."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import run_main as _main

from meshplan.config import config_from_dict
from meshplan.interop.export import export, user_source

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = "environment: unset CUDA_DEVICE_MAX_CONNECTIONS (or set it above 1) before launching"


def _cfg(sharding: str, names: list[str], shape: list[int], **training) -> dict:
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 64, "seq_len": 8192, "sharding": sharding, "framework": "megatron",
                         **training},
            "mesh": {"names": names, "shape": shape, "sequence_parallel": "tp" in names}}


@pytest.mark.parametrize("tables, strategy, tp_clause", [
    (_cfg("zero3", ["dp_shard", "tp"], [4, 2]), "optim_grads_params", "with tp 2 it warns before Blackwell GPUs"),
    (_cfg("zero2", ["dp", "cp"], [4, 2]), "optim_grads", "with cp 2 it warns before Blackwell GPUs"),
    (_cfg("zero3", ["dp_shard"], [8]), "optim_grads_params", None),
    (_cfg("zero1", ["dp"], [8], megatron_fsdp=True), "optim", None),
])
def test_megatron_fsdp_export_writes_the_distributed_optimizer_and_the_environment_line(tables, strategy, tp_clause):
    text, header = export(config_from_dict(tables), "megatron", "t")
    lines = text.splitlines()
    at = lines.index("--use-megatron-fsdp")
    assert lines[at:at + 3] == ["--use-megatron-fsdp", "--use-distributed-optimizer",
                                f"--data-parallel-sharding-strategy {strategy}"]
    assert "--no-gradient-accumulation-fusion" not in lines
    env = [h for h in header if h.startswith("environment:")]
    assert len(env) == 1 and env[0].startswith(ENV) and f"# {env[0]}" in lines  # a comment line of the file
    assert (tp_clause in env[0]) if tp_clause else "warns" not in env[0]


def test_megatron_ddp_export_has_no_unset_line():
    """DDP with the distributed optimizer at tp 2 on H100: not Megatron FSDP's unset line but the
    export of 1 that validate_args asserts there (lines 1453-1479; tests/test_megatron_env.py);
    at tp 1 no line at all."""
    text, header = export(config_from_dict(_cfg("zero1", ["dp", "tp"], [4, 2])), "megatron", "t")
    env = [h for h in header if "CUDA_DEVICE_MAX_CONNECTIONS" in h]
    assert len(env) == 1 and env[0].startswith("environment: export CUDA_DEVICE_MAX_CONNECTIONS=1 before launching")
    _, header = export(config_from_dict(_cfg("zero1", ["dp"], [8])), "megatron", "t")
    assert [h for h in header if "CUDA_DEVICE_MAX_CONNECTIONS" in h] == []
    assert text.splitlines().count("--use-distributed-optimizer") == 1 and "--use-megatron-fsdp" not in text


def test_no_gradient_accumulation_fusion_is_a_note_on_import_and_carried_on_export(tmp_path, capsys):
    """The trial's arguments (Megatron-LM's guide of af28b5a lists both flags) import as the same plan,
    with a note for the unfused accumulation; exported back, the flag is the user's, carried unchanged."""
    args = tmp_path / "fsdp.args"
    args.write_text((EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text().replace(
        "--use-distributed-optimizer --overlap-grad-reduce",
        "--use-megatron-fsdp --use-distributed-optimizer --no-gradient-accumulation-fusion "
        "--data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor"))
    out = tmp_path / "back.args"
    assert _main("export", args, "--to", "megatron", "-o", out, "--cluster", "dgx-h100", "--nodes", 2) == 0
    said = capsys.readouterr().out
    text = out.read_text()
    lines = text.splitlines()
    assert lines.count("--no-gradient-accumulation-fusion") == 1 and lines.count("--use-distributed-optimizer") == 1
    assert "carried unchanged from" in said and "--no-gradient-accumulation-fusion" in said.split(
        "carried unchanged from")[1].splitlines()[0]
    rewritten = [line for line in said.splitlines() if line.startswith("written otherwise than")]
    assert rewritten and "-> dropped" not in rewritten[0] and "--use-" not in rewritten[0]  # both kept as given
    assert _main("import", "megatron", out, "--cluster", "dgx-h100", "--nodes", 2) == 0
    imported = capsys.readouterr().out
    assert "# note: megatron: --no-gradient-accumulation-fusion: planned with Megatron-LM's default fused " \
           "accumulation" in imported
    assert 'sharding = "zero3"' in imported and 'names = ["pp", "dp_shard", "tp"]' in imported
    assert user_source(args).doc["--no-gradient-accumulation-fusion"] is True  # a switch: no value taken
