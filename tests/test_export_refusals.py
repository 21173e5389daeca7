"""Export refuses a pipeline its target's runtime refuses (README: "a mesh the target cannot run
is refused with the reason"): torch 2.13's ScheduleInterleaved1F1B runs pp 4 with 6
micro-batches (rounds max(1, 6 // 4) = 1 divides 6), Megatron-LM's interleaved schedule needs
pp to divide them (6 % 4 = 2), so a torch plan of that mesh exports to torchtitan, not to
Megatron-LM, and the refusal never suggests a target that refuses it too."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from meshplan.config import config_from_dict
from meshplan.plan_runtime import export_refusals
from tests.cli_run import run_captured


def _tables(global_batch: int, sp: bool = True) -> dict:
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": global_batch, "seq_len": 4096, "micro_batch": 1},
            "mesh": {"names": ["pp", "tp"], "shape": [4, 2], "virtual_stages": 2, "sequence_parallel": sp,
                     "pp_schedule": "interleaved_1f1b"}}


def test_refusals_follow_each_target_framework():
    six, eight = config_from_dict(_tables(6)), config_from_dict(_tables(8))
    assert export_refusals(six, "megatron") == ("interleaved 1F1B needs micro-batches (6) divisible by pp (4) "
                                                "(Megatron-LM): megatron's runtime refuses this pipeline schedule",)
    assert export_refusals(six, "torchtitan") == ()  # torch's own framework runs it
    assert export_refusals(eight, "megatron") == ()  # 8 % 4 == 0
    assert export_refusals(six, "deepspeed") == export_refusals(six, "meshplan") == ()


def _export(*args: str) -> SimpleNamespace:
    """``meshplan export ARGS`` as the user runs it (the CLI's one-line error and exit status), in-process
    (:func:`tests.cli_run.run_captured`)."""
    return run_captured("export", *args)


def _write(tmp_path: Path, tables: dict) -> Path:
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        for k, v in table.items():
            lines.append(f"{k} = " + (str(v).lower() if isinstance(v, bool) else repr(v).replace("'", '"')))
    path = tmp_path / "il.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_export_to_megatron_is_refused_and_torchtitan_suggested(tmp_path):
    cfg = _write(tmp_path, _tables(6))
    out = tmp_path / "x.args"
    res = _export(str(cfg), "--to", "megatron", "-o", str(out))
    assert res.returncode == 2 and not out.exists() and len(res.stderr.strip().splitlines()) == 1
    assert "interleaved 1F1B needs micro-batches (6) divisible by pp (4) (Megatron-LM)" in res.stderr
    assert "export --to torchtitan instead" in res.stderr and "Traceback" not in res.stderr
    res = _export(str(cfg), "--to", "torchtitan", "-o", str(tmp_path / "x.toml"))
    assert res.returncode == 0 and (tmp_path / "x.toml").exists()


def test_a_refused_target_is_never_suggested(tmp_path):
    # without sequence parallelism torchtitan refuses the mesh too: no target is suggested
    cfg = _write(tmp_path, _tables(6, sp=False))
    res = _export(str(cfg), "--to", "megatron", "-o", str(tmp_path / "x.args"))
    assert res.returncode == 2 and "all refuse it (--to torchtitan: torchtitan runs tp with sequence parallel" in \
        res.stderr and res.stderr.endswith("): keep the meshplan TOML or change what they name\n")
    # e347b1e's JobConfig (v0.2.2) has no sequence-parallel key and apply_tp always shards the norms with
    # SequenceParallel() (llama3/infra/parallelize.py:181, 219, 233); b5bcd76 added enable_sequence_parallel
    assert "(v0.2.2, whose job TOML this is, has no key to turn it off: llama3/infra/parallelize.py:181-233 at " \
           "e347b1e); set mesh.sequence_parallel = true" in res.stderr


def test_a_refusal_not_about_the_pipeline_says_what_it_refuses(tmp_path):
    """uxsmall item 4: Megatron-LM's MoE with tp 2 and no sequence parallelism (Mixtral, ep 8)
    ended with "megatron's runtime refuses this pipeline" though pp is 1; the suffix now names
    the MoE mesh. torchtitan refuses it too (tp without sequence parallel), DeepSpeed any tp."""
    tables = {"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
              "training": {"global_batch": 256, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                           "recompute": "full"},
              "mesh": {"names": ["dp_shard", "tp", "ep"], "shape": [16, 2, 8], "sequence_parallel": False}}
    assert export_refusals(config_from_dict(tables), "megatron") == (
        "framework megatron: MoE with tp 2 (ep 8) needs sequence parallelism (Megatron-LM's MoELayer raises "
        "ValueError in training without it); fix: set [mesh] sequence_parallel = true (--sequence-parallel): "
        "megatron's runtime refuses this MoE mesh without sequence parallelism",)
    res = _export(str(_write(tmp_path, tables)), "--to", "megatron", "-o", str(tmp_path / "x.args"))
    assert res.returncode == 2 and res.stderr.endswith(
        "(--sequence-parallel): megatron's runtime refuses this MoE mesh without sequence parallelism; torchtitan, "
        "Megatron-LM and DeepSpeed all refuse it (--to torchtitan: torchtitan knows models by flavor (llama3 8B, 70B, "
        "405B; deepseek_v3 16B, 236B, 671B; qwen3 30B-A3B, 235B-A22B); model 'mixtral-8x7b' is none of them: nearest "
        "llama3 8B, which differs in vocab 32000 (128256), rope_theta 1000000.0 (500000.0), "
        "experts 8 (0), top_k 2 (0), expert_ffn 14336 (None); --to deepspeed: a DeepSpeed config applies to ZeRO over "
        "one data axis, without TP/PP/CP/EP or HSDP; this mesh has tp 2, ep 8 (zero3)): keep the meshplan TOML or "
        "change what they name\n")
    assert "pipeline" not in res.stderr
