"""A DeepSpeed JSON written for the HF Trainer (newcomer trial nc52, finding 8): planned with the
model code the Trainer runs (HF transformers' decomposed LlamaRMSNorm), its --gradient_checkpointing
given as import's --gradient-checkpointing, and export writing no empty activation_checkpointing
section (which the HF Trainer ignores) in its place."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from tests.cli_run import run_cli

DATA = Path(__file__).parent / "data" / "nc52d"
#: The trial's job: ds_z3_hf.json (ZeRO-3, hpZ 8, "auto" everywhere) for Llama 3 70B at 8k on 32 DGX H100.
HF = ["import", "deepspeed", DATA / "ds_z3_hf.json", "--cluster", "dgx-h100", "--nodes", "32", "--model", "llama3-70b",
      "--seq-len", "8192", "--micro-batch", "1", "--grad-accum", "4", "--dtype", "bf16"]


def _imported(tmp_path, capsys, *extra: str, name: str = "hf") -> tuple[dict, str]:
    out = tmp_path / f"{name}.toml"
    rc, out_text, err = run_cli([*HF, *extra, "-o", out], capsys)
    assert rc == 0, err
    return tomllib.loads(out.read_text()), out_text + err


def test_hf_trainer_json_plans_hf_model_code_and_its_checkpointing(tmp_path, capsys):
    """ds_z3_hf.json says "auto" (train_batch_size, reduce_bucket_size, ...), which only the HF
    Trainer fills (transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig), so the model is
    an HF transformers class: LlamaRMSNorm is ``x.to(float32)``, ``pow(2).mean``, ``* rsqrt``,
    ``weight * x.to(dtype)`` (modeling_llama.py at 5dd4a63, lines 60-74), torch_norm "decomposed".
    Before: torch_norm unset (torchtitan's fused nn.RMSNorm) and no --gradient-checkpointing option.
    The Trainer checkpoints every decoder layer only with --gradient_checkpointing
    (trainer.py _inner_training_loop; LlamaModel.forward's _gradient_checkpointing_func):
    recompute "full" with the flag, "none" without, whatever the JSON says."""
    t, err = _imported(tmp_path, capsys, "--gradient-checkpointing")
    assert t["training"]["torch_norm"] == "decomposed" and t["training"]["recompute"] == "full"
    assert "note: deepspeed: model code: the HF Trainer's, HF transformers'" in err
    assert "--gradient-checkpointing: the HF Trainer's --gradient_checkpointing checkpoints every decoder layer" in err
    t, err = _imported(tmp_path, capsys, name="nogc")
    assert t["training"]["recompute"] == "none" and t["training"]["torch_norm"] == "decomposed"
    assert "only with its --gradient_checkpointing, not given here" in err


def test_decomposed_norm_costs_at_least_its_extra_hbm_bytes(tmp_path, capsys):
    """The step of the import (HF's norm) against the same plan with torchtitan's fused norm (the
    trial's job_h100_z3.toml, 33.60 s; its hand-edited torch_norm = "decomposed" 35.80 s).
    By hand, the extra HBM bytes of the decomposed norm (meshplan.compute.torch_eager, bf16 b = 2):
    forward 4b + 28 = 36 B against the fused 2b = 4 B per element (+32), backward 8b + 76 = 92 B
    against 3b = 6 B (+86); recompute full runs the forward twice: +32 x 2 + 86 = 150 B per element.
    Per layer 2 norms of 8192 tokens x h 8192 = 67,108,864 elements: 2 x 67,108,864 x 150 =
    2.0133e10 B; 80 layers, 4 micro-batches: 6.4425e12 B. At the H100's 3.35 TB/s (datasheet, the
    catalog's hbm_bandwidth_tb_per_s) that is at least 1.923 s more (the final norm and the per-row
    rsqrt kernels only add to it)."""
    t, _ = _imported(tmp_path, capsys, "--gradient-checkpointing")
    steps = {}
    for norm in ("decomposed", "fused"):
        t["training"]["torch_norm"] = norm
        body = "\n".join(_toml_lines(t))
        (tmp_path / f"{norm}.toml").write_text(body)
        rc, _, err = run_cli(["step", tmp_path / f"{norm}.toml", "--json", tmp_path / f"{norm}.json"], capsys)
        assert rc == 0, err
        steps[norm] = json.loads((tmp_path / f"{norm}.json").read_text())["step_s"]
    extra = 2 * 8192 * 8192 * 150 * 80 * 4 / 3.35e12
    assert round(extra, 3) == 1.923
    assert steps["decomposed"] - steps["fused"] >= extra


def test_export_writes_no_checkpointing_section_and_says_where(tmp_path, capsys):
    """export --to deepspeed of the import with --gradient-checkpointing. Before: an empty
    "activation_checkpointing": {} (the trial's export_z3.json), which the HF Trainer never reads
    (HfTrainerDeepSpeedConfig fills no such key, HF's model code never calls deepspeed.checkpointing).
    Now: no such key; one header line says recompute full is the Trainer's --gradient_checkpointing,
    the import line re-imports with --gradient-checkpointing, and the round trip loses nothing."""
    _imported(tmp_path, capsys, "--gradient-checkpointing")
    rc, out, err = run_cli(["export", tmp_path / "hf.toml", "--to", "deepspeed", "-o", tmp_path / "out.json"], capsys)
    assert rc == 0, err
    err = out + err
    doc = json.loads((tmp_path / "out.json").read_text())
    assert "activation_checkpointing" not in doc
    assert "activation checkpointing (recompute full) is not a DeepSpeed JSON key: the HF Trainer runs it with " \
           "--gradient_checkpointing" in err
    assert "--seq-len 8192 --gradient-checkpointing" in err and "not expressed" not in err


def test_gradient_checkpointing_refused_for_a_torchtitan_file(tmp_path, capsys):
    """A torchtitan job TOML states its own activation checkpointing: the flag is an error naming
    activation_checkpoint.mode, as --micro-batch names training.local_batch_size there."""
    rc, _, err = run_cli(["import", "torchtitan", Path(__file__).parent / "data" / "nc50" / "etp2.toml",
                          "--cluster", "dgx-h100", "--nodes", "2", "--gradient-checkpointing", "-o",
                          tmp_path / "t.toml"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: --gradient-checkpointing: only for a DeepSpeed JSON run by the HF Trainer")
    assert "set activation_checkpoint.mode in etp2.toml" in err


def test_plain_deepspeed_json_names_the_model_code_planned(tmp_path, capsys):
    """A DeepSpeed JSON without "auto" (ds_mds_h100.json of trial nc52) says nothing of the model
    code: torchtitan's fused norm is planned, and one note names it and the key to change."""
    rc, out, err = run_cli(["import", "deepspeed", Path(__file__).parent / "data" / "nc52" / "ds_mds_h100.json",
                          "--cluster", "dgx-h100", "--nodes", "32", "--model", "llama3-70b", "--seq-len", "8192",
                          "-o", tmp_path / "p.toml"], capsys)
    assert rc == 0, err
    err = out + err
    assert "torch_norm" not in tomllib.loads((tmp_path / "p.toml").read_text())["training"]
    assert "model code: torchtitan's (torch's fused nn.RMSNorm, training.torch_norm = \"fused\")" in err
    assert "set training.torch_norm = \"decomposed\"" in err


def _toml_lines(t: dict) -> list[str]:
    """The tables of ``t`` as TOML (scalars, lists of scalars, one level of tables)."""
    from meshplan.interop.tomlout import dumps

    return dumps({k: v for k, v in t.items() if k != "source"}).splitlines()
