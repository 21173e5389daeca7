"""compare weighs Megatron-DeepSpeed (BF16_Optimizer) against DeepSpeed ZeRO-3 although their
gradient dtypes differ, because each side's gradients are its engine's own (newcomer trial nc52,
finding 12); it still refuses a grad_dtype that differs under one engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.compare.differences import config_differences
from meshplan.compare.engine_grads import engine_grads
from meshplan.config import load_config
from tests.cli_run import run_cli

DATA = Path(__file__).parent / "data" / "nc52c"
MDS, Z3 = DATA / "job_mds_h100.toml", DATA / "job_h100_z3.toml"


def test_bf16_optimizer_fp32_grads_against_zero3_bf16_are_the_engines():
    """job_mds_h100 (the trial's Megatron-DeepSpeed run: zero1, zero12_engine deepspeed, bf16
    params, grad_dtype fp32) is DeepSpeed's BF16_Optimizer, whose gradients are fp32
    (DeepSpeed edaa722 engine.py:1994-1996); job_h100_z3 (DeepSpeed ZeRO-3, bf16, grad_accum_dtype
    unset) keeps them in the model's dtype, bf16 (stage3.py:742-744). Each side's grad_dtype is its
    engine's own and the engines differ, so training.grad_dtype moves from the workload (refused
    before: 'training.grad_dtype differs: ... fp32, ... bf16') to the knobs."""
    a, b = load_config(MDS), load_config(Z3)
    assert engine_grads(a.training)[0] == "fp32" and engine_grads(b.training)[0] == "bf16"
    d = config_differences(a, b)
    assert d.workload == ()
    assert ("training.grad_dtype", "fp32", "bf16") in d.knobs


def test_a_grad_dtype_one_engine_does_not_keep_is_still_refused():
    """Two DeepSpeed ZeRO-3 plans, one with grad_dtype fp32 (grad_accum_dtype fp32 in DeepSpeed's
    JSON): the same engine, so the fp32 gradients are a different workload, which check_workload
    refuses as before."""
    a = load_config(Z3)
    b = replace(a, training=a.training.model_copy(update={"grad_dtype": "fp32"}))
    assert config_differences(a, b).workload == (("training.grad_dtype", "bf16", "fp32"),)


def test_compare_cli_names_the_engines(tmp_path, capsys):
    """`meshplan compare job_mds_h100.toml job_h100_z3.toml` (the trial's command): exit 0, and
    one reason line says grad_dtype fp32 against bf16 follows from BF16_Optimizer and ZeRO-3."""
    rc, out, err = run_cli(["compare", MDS, Z3, "--out", tmp_path / "cmp"], capsys)
    assert rc == 0, err
    text = " ".join(out.split())
    assert "training.grad_dtype fp32 against bf16 follows from each side's engine (DeepSpeed's BF16_Optimizer" in text
    assert "DeepSpeed ZeRO-3 (gradients in the model's dtype" in text
