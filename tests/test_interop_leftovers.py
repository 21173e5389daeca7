"""Interop leftovers (issue: interop, helper 'interop'): repeated keys and flags, DeepSpeed
near misses against DeepSpeed's own key list, export suggestions that name a target which
accepts the config, ``-o -`` as stdout, torchtitan's pre-2025 ``[float8]`` table.

Expected values: DeepSpeed's keys from deepspeed/runtime/constants.py, precision_config.py
and zero/config.py at edaa722 (``zero_optimization`` is a pydantic model with
``extra="forbid"``: DeepSpeed itself refuses unknown keys there); argparse keeps the last
value of a repeated flag (Megatron-LM's parser is argparse with ``allow_abbrev=False`` and no
duplicate check); tomllib refuses a repeated key (TOML 1.0: "Defining a key multiple times is
invalid"); torchtitan's job config before its ``[quantize.linear.float8]`` table read
``[float8]`` with the same keys (train_configs/llama3_8b.toml, 2024-2025).
"""

from __future__ import annotations

import json

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any

from tests.test_interop import DS, MG, TT
from tests.test_interop_strict import DSOPTS, H100, H100x2, _write  # noqa: F401  (shared with the strict tests)


# repeated keys and flags -------------------------------------------------------------------

@pytest.mark.parametrize("old,new,error", [
    ('"train_micro_batch_size_per_gpu": 1,', '"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2,',
     "train_micro_batch_size_per_gpu: given twice in {} (JSON readers keep the last one silently); keep one"),
    ('"stage": 2,', '"stage": 2, "stage": 3,',
     "zero_optimization.stage: given twice in {} (JSON readers keep the last one silently); keep one"),
])
def test_deepspeed_key_given_twice_is_an_error(tmp_path, old, new, error):
    """json.loads kept the last of two keys silently: train_micro_batch_size_per_gpu 2, stage 3."""
    text = DS.read_text()
    assert old in text
    f = _write(tmp_path, "d.json", text.replace(old, new))
    for fmt in (None, "deepspeed"):  # detected, and named with --format
        with pytest.raises(ConfigError) as e:
            load_any(f, fmt, opts=DSOPTS)
        assert str(e.value) == error.format(f)


def test_torchtitan_key_given_twice_names_the_key(tmp_path):
    """tomllib refuses it, but said only "Cannot overwrite a value (at line 31, column 15)"."""
    text = TT.read_text()
    f = _write(tmp_path, "t.toml", text.replace("seq_len = 8192\n", "seq_len = 8192\nseq_len = 4096\n"))
    row = text.splitlines().index("seq_len = 8192") + 2
    for fmt in (None, "torchtitan"):
        with pytest.raises(ConfigError) as e:
            load_any(f, fmt, opts=H100)
        assert str(e.value) == f"config: {f}: not valid TOML (training.seq_len given twice (line {row}); keep one)"


def test_megatron_flag_given_twice_keeps_the_last_with_a_note(tmp_path):
    """argparse (Megatron-LM's parser) keeps the last value; launch scripts append overrides, so
    meshplan does the same and says so when the values differ (the same value twice: no note)."""
    text = MG.read_text() + "--seq-length 4096 --micro-batch-size 1\n"
    cfg = load_any(_write(tmp_path, "m.args", text), opts=H100x2)
    assert (cfg.training.seq_len, cfg.training.micro_batch) == (4096, 1)
    assert [n for n in cfg.notes if "times" in n] == [
        "megatron: --seq-length given 2 times (8192, 4096): planned with the last, 4096, as Megatron-LM's argparse "
        "keeps it"]


# DeepSpeed near misses ----------------------------------------------------------------------

@pytest.mark.parametrize("edit,error", [
    (lambda d: d | {"zero_optimizaton_x": d.pop("zero_optimization")},
     "zero_optimizaton_x: not a DeepSpeed key; did you mean zero_optimization?"),
    (lambda d: d | {"fp16x": {"enabled": True}}, "fp16x: not a DeepSpeed key; did you mean fp16?"),
    (lambda d: d | {"bf_16": d.pop("bf16")}, "bf_16: not a DeepSpeed key; did you mean bf16?"),
    (lambda d: d | {"Train_Batch_Size": d.pop("train_batch_size")},
     "Train_Batch_Size: not a DeepSpeed key; did you mean train_batch_size?"),
    (lambda d: d | {"zero_optimization_config": d.pop("zero_optimization")},
     "zero_optimization_config: not a DeepSpeed key; did you mean zero_optimization?"),
    (lambda d: d | {"zero_optimization": {"stage_3": True}},
     "zero_optimization.stage_3: not a DeepSpeed key; did you mean zero_optimization.stage?"),
])
def test_deepspeed_loose_near_miss_is_an_error(tmp_path, edit, error):
    """Three edits, case, ``_`` and a tail added slipped through (listed as unused: the setting
    stayed at its default, ZeRO stage 0 or fp32)."""
    d = edit(json.loads(DS.read_text()))
    with pytest.raises(ConfigError) as e:
        load_any(_write(tmp_path, "d.json", json.dumps(d)), opts=DSOPTS)
    assert str(e.value).startswith(error + " (meshplan reads that one"), str(e.value)


def test_deepspeed_own_keys_and_other_sections_are_listed(tmp_path):
    """DeepSpeed's own keys close to read ones (stage3_* begin with ``stage``) and sections that
    are nobody's near miss (``my_launcher``, ``fp16_opt_level``: ``fp16`` is under 5
    characters) are listed as unused, not refused."""
    d = json.loads(DS.read_text())
    d["zero_optimization"] |= {"stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e7}
    d |= {"my_launcher": {"nodes": 2}, "fp16_opt_level": "O2", "data_types": {"grad_accum_dtype": "fp32"},
          "communication_data_type": "fp32"}
    cfg = load_any(_write(tmp_path, "d.json", json.dumps(d)), opts=DSOPTS)
    assert cfg.training.sharding == "zero2"
    assert cfg.notes[-1] == (
        "deepspeed: fields meshplan does not use: zero_optimization.stage3_max_live_parameters, "
        "zero_optimization.stage3_prefetch_bucket_size, steps_per_print, my_launcher.nodes, fp16_opt_level, "
        "data_types.grad_accum_dtype")
    assert cfg.training.grad_reduce_dtype == "fp32"  # communication_data_type: DeepSpeed ZeRO-2's reduce dtype


# export refusals name a target that takes the config ----------------------------------------

def test_export_refusal_suggests_a_target_that_accepts_it():
    """The Megatron-LM example (zero1, tp 2, pp 2) refused by DeepSpeed suggested torchtitan,
    which refuses zero1 too; only Megatron-LM takes it."""
    from meshplan.interop.export import export
    cfg = load_any(MG, opts=H100x2)
    with pytest.raises(ConfigError) as e:
        export(cfg, "deepspeed", "m")
    assert str(e.value) == ("--to: a DeepSpeed config applies to ZeRO over one data axis, without TP/PP/CP/EP or HSDP; this "
                            "mesh has pp 2, tp 2 (zero1); export --to megatron instead")
    with pytest.raises(ConfigError, match=r"sharding zero1 has no torchtitan key; export --to megatron instead$"):
        export(cfg, "torchtitan", "m")


@pytest.mark.parametrize("name", ["seed-64gpu.toml", "mixtral-8x7b_32xh100_ep8-dp32.toml",
                                  "deepseek-v3_2048xh100_pp16-ep64-dp128.toml", "megatron_llama3-8b_16xh100_tp2-pp2.args",
                                  "torchtitan_llama3-8b_8xh100.toml", "deepspeed_zero2_16xh100.json"])
def test_every_export_refusal_names_only_targets_that_accept(name):
    """For each example and each foreign target: a refusal's ``export --to X`` names targets
    that export the same config without an error, and says so when there is none."""
    from meshplan.interop.export import export
    from tests.test_interop import EX
    opts = DSOPTS if name.endswith(".json") else H100x2 if name.startswith(("megatron", "torchtitan")) else \
        ImportOptions()
    cfg = load_any(EX / name, opts=opts)
    for to in ("torchtitan", "megatron", "deepspeed"):
        try:
            export(cfg, to, name)
            continue
        except ConfigError as e:
            message = str(e)
        assert message.startswith("--to: "), message
        named = message.rpartition("export --to ")[2].removesuffix(" instead").split(" or ") \
            if message.endswith(" instead") else []
        assert named or message.endswith("keep the meshplan TOML"), message
        for other in named:
            export(cfg, other, name)  # raises if the suggestion is refused in turn


def test_export_refused_by_every_format_says_so():
    """A Mixtral HSDP mesh with tp: torchtitan has no Mixtral flavor, Megatron-LM one data
    axis, DeepSpeed no tp: each refusal says no other format takes it, and why each other refuses it
    (before: "all refuse it" alone; a newcomer's Mixtral was refused by Megatron-LM for its recompute
    only, and the line did not say so)."""
    from meshplan.config import config_from_dict
    from meshplan.interop.export import export
    cfg = config_from_dict({"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": "hsdp"},
                            "mesh": {"names": ["dp_replicate", "dp_shard", "tp"], "shape": [2, 4, 2],
                                     "sequence_parallel": True}})
    why = {"torchtitan": ("torchtitan knows models by flavor (llama3 8B, 70B, 405B; deepseek_v3 16B, 236B, 671B; "
                          "qwen3 30B-A3B, 235B-A22B); model 'mixtral-8x7b' is none of them: nearest llama3 8B, which differs in "
                          "vocab 32000 (128256), rope_theta 1000000.0 (500000.0), experts 8 "
                          "(0), top_k 2 (0), expert_ffn 14336 (None)"),
           "megatron": "Megatron-LM has one data-parallel axis; the mesh has ['dp_replicate', 'dp_shard'] (hsdp)",
           "deepspeed": "a DeepSpeed config applies to ZeRO over one data axis, without TP/PP/CP/EP or HSDP; this mesh has "
                        "tp 2 (hsdp)"}
    for to, reason in why.items():
        with pytest.raises(ConfigError) as e:
            export(cfg, to, "x")
        others = "; ".join(f"--to {t}: {r}" for t, r in why.items() if t != to)
        assert str(e.value) == f"--to: {reason}; torchtitan, Megatron-LM and DeepSpeed all refuse it ({others}): " \
                               f"keep the meshplan TOML or change what they name"


# -o - is stdout -------------------------------------------------------------------------------

def _main(argv, capsys) -> tuple[int, str, str]:
    """``meshplan ARGV`` in this process: (exit status, stdout, stderr)."""
    from meshplan.cli import main
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def test_dash_o_is_stdout_for_import_export_and_search(tmp_path, monkeypatch, capsys):
    """``-o -`` wrote a file named '-'; now the file goes to stdout and the rest to stderr (the
    imported TOML, the torchtitan TOML and Megatron-LM's arguments as they are)."""
    from meshplan.interop.export import export
    from meshplan.interop.foreign import import_text
    from meshplan.interop.source_file import source_table
    from tests.test_interop import EX
    monkeypatch.chdir(tmp_path)
    mini = EX / "mini_2x4_tp2-dp4.toml"
    rc, out, err = _main(["import", "auto", DS, "--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b",
                          "--seq-len", "4096", "-o", "-"], capsys)
    # printed, the TOML's [source] holds the file's absolute path (trial 17: -o's folder is unknown)
    assert (rc, out) == (0, import_text(DS, None, DSOPTS, lambda fmt: source_table(DS, fmt, None))[0])
    rc, out, err = _main(["export", mini, "--to", "torchtitan", "-o", "-"], capsys)
    from meshplan.config import load_config
    text, header = export(load_config(mini), "torchtitan", str(mini))
    assert (rc, out, err.splitlines()) == (0, text, header[1:])
    rc, out, err = _main(["search", mini, "--export", "1", "--to", "megatron", "-o", "-"], capsys)
    assert rc == 0 and "--num-layers 32" in out.splitlines(), out   # the arguments file on stdout
    assert "import with: meshplan import megatron FILE" in err
    assert list(tmp_path.iterdir()) == []


def test_dash_is_refused_by_every_other_output_option(tmp_path, monkeypatch, capsys):
    """Options that write no stream (HTML, PNG folders, traces) and two documents on one
    stdout refuse ``-`` in one line instead of creating a file named '-'."""
    from tests.test_interop import EX
    monkeypatch.chdir(tmp_path)
    mini = EX / "mini_2x4_tp2-dp4.toml"
    for argv, error in (
            (["export", mini, "--to", "torchtitan", "-o", "-", "--json", "-"],
             "error: -o: -o - and --json - both write to stdout; give one of them a file path\n"),
            (["plan", mini, "--html", "-"],
             "error: --html: '-' (stdout) is not taken here; give a file path (./- for one named '-')\n"),
            (["report", mini, "--out", "-"],
             "error: --out: '-' (stdout) is not taken here; give a file path (./- for one named '-')\n"),
            (["step", mini, "--trace", "-"],
             "error: --trace: '-' (stdout) is not taken here; give a file path (./- for one named '-')\n"),
            (["memory", mini, "--out", "-"],
             "error: --out: '-' (stdout) is not taken here; give a folder path (./- for one named '-')\n")):
        rc, out, err = _main(argv, capsys)
        assert (rc, err) == (2, error), argv
    assert list(tmp_path.iterdir()) == []


# torchtitan's pre-2025 [float8] table ---------------------------------------------------------

OLD_FLOAT8 = ("\n[float8]\nenable_fsdp_float8_all_gather = true\nprecompute_float8_dynamic_scale_for_fsdp = true\n"
              "filter_fqns = \"output\"\nforce_recompute_fp8_weight_in_bwd = true\n")


@pytest.mark.parametrize("converter,table", [
    ('converters = "float8"', ""),  # early 2025: the converter as a string list, the settings in [float8]
    ("", "enable_float8_linear = true\n"),  # 2024: [float8] enable_float8_linear
])
def test_torchtitan_old_float8_table_is_read_as_the_new_one(tmp_path, converter, table):
    """Was listed as unused (and ``converters = "float8"`` missed): planned in bf16 without the
    float8 all-gather. Read as [quantize.linear.float8]: fp8 Linear GEMMs (activations bf16), weights gathered in float8
    (dp_shard 8 > 1), the output layer filtered ("output")."""
    text = TT.read_text().replace('flavor = "8B"', f'flavor = "8B"\n{converter}') + OLD_FLOAT8 + table
    cfg = load_any(_write(tmp_path, "t.toml", text), opts=H100)
    t = cfg.training
    assert (t.compute_dtype, t.linear_dtype, t.fp8_all_gather, t.fp8_output_layer) == ("bf16", "fp8", True, False)
    assert cfg.notes[0] == ("torchtitan: [float8] read as [quantize.linear.float8] (torchtitan's name for it since "
                            "2025; its keys are listed under that name)" +
                            (", enable_float8_linear as model.converters = [\"float8\"]" if table else ""))
    assert cfg.notes[-1].endswith("checkpoint.enable, quantize.linear.float8.force_recompute_fp8_weight_in_bwd")


@pytest.mark.parametrize("converter,table,output", [
    ("", "enable_float8_linear = true\n", False),  # 2024 (9dec370 Float8Handler: fqn != "output", no filter_fqns)
    ('converters = ["float8"]', "", True),  # 2025, after a6524d8: filter_fqns defaults to [], the output converted
])
def test_torchtitan_old_float8_table_without_filter_fqns(tmp_path, converter, table, output):
    """torchtitan converted every Linear but the output before ``filter_fqns`` (a6524d8, April
    2025), whose default [] converts it since: a 2024 ``enable_float8_linear`` table without
    ``filter_fqns`` plans the output layer in the compute dtype (and says so); a 2025 [float8]
    table without it, in fp8."""
    old = OLD_FLOAT8.replace('filter_fqns = "output"\n', "")
    text = TT.read_text().replace('flavor = "8B"', f'flavor = "8B"\n{converter}') + old + table
    cfg = load_any(_write(tmp_path, "t.toml", text), opts=H100)
    assert (cfg.training.linear_dtype, cfg.training.fp8_output_layer) == ("fp8", output)
    assert cfg.notes[0].endswith("; the output layer left in the compute dtype, as torchtitan did before filter_fqns "
                                 "(its float8 converter skipped fqn \"output\")") != output


def test_torchtitan_old_and_new_float8_tables_together_are_an_error(tmp_path):
    text = TT.read_text() + OLD_FLOAT8 + "\n[quantize.linear.float8]\nfilter_fqns = [\"output\"]\n"
    with pytest.raises(ConfigError, match=r"^float8: the pre-2025 \[float8\] table and \[quantize.linear.float8\] are "
                                          r"both given; torchtitan reads \[quantize.linear.float8\]: keep that one$"):
        load_any(_write(tmp_path, "t.toml", text), opts=H100)


def test_deepspeed_export_of_a_model_outside_the_catalog():
    """Was '--model: a DeepSpeed config does not name the model' (the re-import had no model
    to take), so torchtitan's refusal could not suggest DeepSpeed either. A DeepSpeed config
    holds no model: the file is written, the header asks for --model on import."""
    from meshplan.config import config_from_dict
    from meshplan.interop.export import export
    cfg = config_from_dict({"model": {"name": "tiny", "layers": 4, "hidden": 512, "ffn": 2048, "q_heads": 8,
                                      "vocab": 32000},
                            "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": "zero2"},
                            "mesh": {"names": ["dp"], "shape": [8]}})
    text, header = export(cfg, "deepspeed", "x")
    # zero2's bucket of the plan: Megatron-Core's default max(40e6, 1e6 x dp 8) elements
    assert json.loads(text)["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 40_000_000}
    assert json.loads(text)["gradient_accumulation_steps"] == 64 // (1 * 8)
    # the plan's fp32 reduction (reduce_dtype) is not DeepSpeed's default (the model's bf16): written
    assert json.loads(text)["communication_data_type"] == "fp32"
    # a DeepSpeed config runs DeepSpeed's own ZeRO-2 (all-reduces), not Megatron's reduce-scatters,
    # and keeps ZeRO-2's gradient partition in the model's dtype (bf16), not the plan's fp32: said
    assert header == ["meshplan export of x (tiny on 1x dgx-h100)",
                      "import with: meshplan import deepspeed FILE --cluster dgx-h100 --nodes 1 --model MODEL "
                      "--seq-len 4096",
                      "not expressed in deepspeed: training.grad_dtype: 'fp32' -> 'bf16'",
                      "not expressed in deepspeed: training.recompute: 'selective' -> 'none' (DeepSpeed's JSON does "
                      "not choose activation checkpointing, the model code does: apply activation checkpointing of "
                      "the attention core only (the model code's deepspeed.checkpointing.checkpoint around it, flash "
                      "kernels included) there)",
                      "not expressed in deepspeed: training.zero12_engine: 'megatron' -> 'deepspeed'"]
    # tiny is a dense Llama-style model, which torchtitan now runs as a llama3 flavor of its own (newcomer
    # trial 27: dim 512 -> int(2 x 2048 / 3) = 1365, multiple_of 2048 x ceil(1365 / 2048) = 2048, its ffn);
    # what torchtitan refuses is zero2, and the refusal still suggests DeepSpeed
    with pytest.raises(ConfigError, match=r"^--to: torchtitan shards with FSDP2 \(zero3, hsdp\) or replicates "
                                          r"\(none\); sharding zero2 has no torchtitan key; export --to megatron or "
                                          r"deepspeed instead$"):
        export(cfg, "torchtitan", "x")


def test_a_config_without_optimizer_exports_torchtitans_adamw(tmp_path, monkeypatch, capsys):
    """Issue 11 (newcomer trial 4): ``search --export 1 --to torchtitan`` of a config that sets no
    optimizer wrote ``name = "Adam"`` (torch.optim.Adam, L2 decay coupled to the gradient), not
    what the user runs. meshplan's default is AdamW, torchtitan's (``Optimizer.name = "AdamW"``
    at pytorch/torchtitan 238fa99, ``default_adamw`` at b5bcd76) and Megatron-LM's ``--optimizer
    adam`` with ``decoupled_weight_decay = True`` (d98e8a6); the exported name is one of
    torchtitan's two factories ("Adam", "AdamW") and reads back as the same optimizer."""
    import tomllib

    from tests.test_interop import EX
    monkeypatch.chdir(tmp_path)
    mini = EX / "mini_2x4_tp2-dp4.toml"
    assert "optimizer" not in tomllib.loads(mini.read_text())["training"]
    rc, out, err = _main(["search", str(mini), "--export", "1", "--to", "torchtitan", "-o", "-"], capsys)
    assert rc == 0, err
    assert tomllib.loads(out)["optimizer"] == {"implementation": "fused", "name": "AdamW"}
    (tmp_path / "job.toml").write_text(out)
    back = load_any(tmp_path / "job.toml", None, ImportOptions(cluster="dgx-h100", nodes=1))
    assert back.training.optimizer == "adamw"
