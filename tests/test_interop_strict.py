"""Foreign configs do not drop or mistype settings silently (issue: interop).

A key or flag that is a near miss of one meshplan reads is an error naming the likely one
(Megatron-LM's own parser refuses unknown flags; a misspelt torchtitan or DeepSpeed key would
leave the setting at its default), while the tools' real keys that meshplan does not use are
listed. Expected values from the tools' documented rules: torchtitan's Float8LinearConverter
(float8 all-gather only with dp_shard > 1, never with a recipe; the output layer converted
unless filtered), DeepSpeed's gradient_clipping (> 0 clips, 0 does not, default 1.0 since
v0.19.3), Megatron-LM's pretrain_gpt.sh (``GPT_ARGS="`` spanning lines).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, reimport_options
from meshplan.interop.foreign import load_any
from meshplan.interop.roundtrip import differences

from tests.test_interop import DS, EX, H100, MG, ROOT, TT  # noqa: F401  (the examples and options both use)
H100x2 = ImportOptions(cluster="dgx-h100", nodes=2)
DSOPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)


def _write(tmp_path, name: str, text: str) -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize("old,new,error", [
    ("tensor_parallel_degree = 1", "tensor_parallel_degre = 2",
     r"^parallelism.tensor_parallel_degre: not a torchtitan key; did you mean parallelism.tensor_parallel_degree\?"),
    ("[parallelism]", "[paralelism]", r"^paralelism: not a torchtitan key; did you mean parallelism\?"),
    ("seq_len = 8192", "seqlen = 8192", r"^training.seqlen: .* did you mean training.seq_len\?"),
    ('mode = "selective"', 'mdoe = "selective"', r"^activation_checkpoint.mdoe: .* activation_checkpoint.mode\?"),
])
def test_torchtitan_near_miss_is_an_error(tmp_path, old, new, error):
    text = TT.read_text()
    assert old in text
    with pytest.raises(ConfigError, match=error):
        load_any(_write(tmp_path, "t.toml", text.replace(old, new)), opts=H100)


def test_torchtitan_key_under_an_older_table_is_an_error(tmp_path):
    # torchtitan before its [parallelism] table kept the degrees under [training], pp and cp under [experimental]
    # (train_configs/llama3_8b.toml at b19456a98, January 2025)
    text = TT.read_text().replace("tensor_parallel_degree = 1\n", "").replace(
        "steps = 1000", "steps = 1000\ntensor_parallel_degree = 2")
    with pytest.raises(ConfigError, match=r"^training.tensor_parallel_degree: torchtitan reads this key as "
                                          r"parallelism.tensor_parallel_degree \(older torchtitan kept it under "
                                          r"\[training\]\); move it there$"):
        load_any(_write(tmp_path, "t.toml", text), opts=H100)
    with pytest.raises(ConfigError, match=r"^experimental.pipeline_parallel_degree: .* parallelism."):
        load_any(_write(tmp_path, "t.toml", TT.read_text() + "[experimental]\npipeline_parallel_degree = 2\n"),
                 opts=H100)


def test_torchtitan_real_keys_are_listed_not_refused(tmp_path):
    # keys of torchtitan's job_config.py (e347b1e) that meshplan does not read, some close to read ones
    extra = ('\n[lr_scheduler]\nwarmup_steps = 200\n[compile]\nenable = true\nbackend = "inductor"\n'
             '[quantize.linear.mx]\nrecipe_name = "mxfp8"\n')
    text = TT.read_text().replace("steps = 1000", "steps = 1000\nmax_norm = 1.0\ndataset_path = \"c4\"").replace(
        "context_parallel_degree = 1", "context_parallel_degree = 1\ncontext_parallel_rotate_method = \"allgather\"\n"
        "pipeline_parallel_schedule_csv = \"\"\nexpert_parallel_comm_backend = \"standard\"") + extra
    cfg = load_any(_write(tmp_path, "t.toml", text), opts=H100)
    unused = cfg.notes[-1]
    for key in ("training.steps", "optimizer.lr", "parallelism.pipeline_parallel_schedule_csv",
                "lr_scheduler.warmup_steps", "compile.backend", "quantize.linear.mx.recipe_name"):
        assert key in unused, key
    # read since newcomer 48 (finding 2: "deepep" is training.moe_dispatcher); "standard" is the all-to-all
    assert "parallelism.expert_parallel_comm_backend" not in unused and cfg.training.moe_dispatcher == "alltoall"
    assert "compile.enable" not in unused and cfg.training.torch_compile   # read: torch.compile on
    assert "training.max_norm" not in unused and cfg.training.grad_clip  # read: torchtitan clips every step
    # read (refused as "alltoall" at cp > 1): no longer listed as unused, its note says what it did at cp 1
    assert "parallelism.context_parallel_rotate_method" not in unused
    assert ("torchtitan: parallelism.context_parallel_rotate_method 'allgather' read: no effect at "
            "context_parallel_degree 1 (no ring attention runs)") in cfg.notes


@pytest.mark.parametrize("old,new,error", [
    ("--sequence-parallel", "--sequence-paralel",
     r"^--sequence-paralel: not a Megatron-LM flag \(its parser refuses it\); did you mean --sequence-parallel\?"),
    ("--seq-length 8192", "--seq-len 8192", r"^--seq-len: .* did you mean --seq-length\?"),
    ("--tensor-model-parallel-size 2", "--tensor-model-parralel-size 2",
     r"^--tensor-model-parralel-size: .* --tensor-model-parallel-size\?"),
    ("--pipeline-model-parallel-size 2", "--pipeline_model_parallel_size 2",
     r"^--pipeline_model_parallel_size: .* --pipeline-model-parallel-size\?"),
])
def test_megatron_near_miss_is_an_error(tmp_path, old, new, error):
    text = MG.read_text()
    assert old in text
    with pytest.raises(ConfigError, match=error):
        load_any(_write(tmp_path, "m.args", text.replace(old, new)), opts=H100x2)


def test_megatron_real_flags_are_listed_not_refused(tmp_path):
    # real Megatron-LM flags (arguments.py); --vocab-file is two edits from --vocab-size, --fp4-format one
    # from --fp8-format
    flags = ("--save /ckpt --load /ckpt --tokenizer-type GPT2BPETokenizer --data-path /data --vocab-file v.json "
             "--merge-file m.txt --split 949,50,1 --clip-grad 1.0 --ckpt-format torch_dist --eval-iters 10")
    cfg = load_any(_write(tmp_path, "m.args", MG.read_text() + flags + "\n"), opts=H100x2)
    assert cfg.notes[-1] == ("megatron: fields meshplan does not use: --lr, --train-iters, "
                             "--tokenizer-type, --save, --load, --data-path, --vocab-file, --merge-file, --split, "
                             "--eval-iters")  # --clip-grad is read: training.grad_clip, --ckpt-format checked


@pytest.mark.parametrize("edit,error", [
    (lambda d: d | {"zero_optimisation": d.pop("zero_optimization")},
     r"^zero_optimisation: not a DeepSpeed key; did you mean zero_optimization\?"),
    (lambda d: d | {"train_micro_batch_size_per_gp": 1},
     r"^train_micro_batch_size_per_gp: .* did you mean train_micro_batch_size_per_gpu\?"),
    (lambda d: d | {"bf16": {"enable": True}}, r"^bf16.enable: .* did you mean bf16.enabled\?"),
    (lambda d: d | {"gradient_cliping": 1.0}, r"^gradient_cliping: .* did you mean gradient_clipping\?"),
])
def test_deepspeed_near_miss_is_an_error(tmp_path, edit, error):
    d = edit(json.loads(DS.read_text()))
    with pytest.raises(ConfigError, match=error):
        load_any(_write(tmp_path, "d.json", json.dumps(d)), opts=DSOPTS)


def test_deepspeed_real_keys_are_listed_not_refused(tmp_path):
    d = json.loads(DS.read_text()) | {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
        "fp32": {"enabled": False}, "wall_clock_breakdown": False, "prescale_gradients": False}
    cfg = load_any(_write(tmp_path, "d.json", json.dumps(d)), opts=DSOPTS)
    for key in ("optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.warmup_num_steps",
                "fp32.enabled", "prescale_gradients"):
        assert key in cfg.notes[-1], key


def test_deepspeed_old_bfloat16_name(tmp_path):
    # DeepSpeed's constants.py: BFLOAT16 = "bf16", BFLOAT16_OLD = "bfloat16" (kept for backwards compatibility)
    d = json.loads(DS.read_text())
    d["bfloat16"] = d.pop("bf16")
    t = load_any(_write(tmp_path, "d.json", json.dumps(d)), opts=DSOPTS).training
    assert (t.param_dtype, t.compute_dtype) == ("bf16", "bf16")


# torchtitan float8 all-gather -------------------------------------------------------------

def _float8(tmp_path, f8: str, shard: int = -1, tp: int = 1):
    text = ('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["float8"]\n[training]\nlocal_batch_size = 1\n'
            f'seq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = {shard}\ntensor_parallel_degree = {tp}\n'
            f'[quantize.linear.float8]\n{f8}\n')
    return load_any(_write(tmp_path, "f8.toml", text), opts=H100)


def test_torchtitan_float8_all_gather(tmp_path):
    # llama3_8b.toml's preset: output filtered; with the precompute, one amax all-reduce
    t = _float8(tmp_path, 'enable_fsdp_float8_all_gather = true\nprecompute_float8_dynamic_scale_for_fsdp = true\n'
                          'filter_fqns = ["output"]').training
    assert (t.compute_dtype, t.linear_dtype, t.sharding, t.fp8_all_gather, t.fp8_output_layer) == (
        "bf16", "fp8", "zero3", True, False)
    # without the all-gather: the GEMMs still in fp8, the weights gathered in bf16; filter_fqns
    # defaults to [] (job_config.py), so the output layer is converted too
    t = _float8(tmp_path, "enable_fsdp_float8_all_gather = false").training
    assert (t.compute_dtype, t.linear_dtype, t.fp8_all_gather, t.fp8_output_layer) == ("bf16", "fp8", False, True)
    # dp_shard 1 (tp 8 on 8 GPUs): torchtitan's dp_shard_enabled is false, nothing gathered
    cfg = _float8(tmp_path, "enable_fsdp_float8_all_gather = true", shard=1, tp=8)
    assert cfg.training.fp8_all_gather is False
    assert any("data_parallel_shard_degree 1 and no cp: FSDP shards nothing" in n for n in cfg.notes)
    with pytest.raises(ConfigError, match=r"^quantize.linear.float8.recipe_name: 'rowwise' with "
                                          r"enable_fsdp_float8_all_gather = true: torchtitan refuses the pair"):
        _float8(tmp_path, 'enable_fsdp_float8_all_gather = true\nrecipe_name = "rowwise"')


def test_torchtitan_float8_recipe(tmp_path):
    """recipe_name "rowwise" (or "rowwise_with_gw_hp") is training.fp8_recipe = "rowwise"; unset,
    tensorwise; exported back as recipe_name; rowwise with fp8_all_gather refused by field."""
    assert _float8(tmp_path, "").training.fp8_recipe == "tensorwise"
    for name in ("rowwise", "rowwise_with_gw_hp"):
        assert _float8(tmp_path, f'recipe_name = "{name}"').training.fp8_recipe == "rowwise"
    t = {"global_batch": 8, "seq_len": 4096, "param_dtype": "fp32", "recompute": "full", "linear_dtype": "fp8",
         "fp8_recipe": "rowwise"}
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": t, "mesh": {"names": ["dp_shard"], "shape": [8]}})
    text, _ = export(cfg, "torchtitan", "f8")
    assert 'recipe_name = "rowwise"' in text
    again = load_any(_write(tmp_path, "r.toml", text), "torchtitan", reimport_options(cfg, "torchtitan"))
    assert differences(cfg, again) == []
    with pytest.raises(ConfigError, match="fp8_all_gather is tensorwise scaling only"):
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                          "training": t | {"fp8_all_gather": True, "sharding": "zero3"},
                          "mesh": {"names": ["dp_shard"], "shape": [8]}})
    with pytest.raises(ConfigError, match="fp8_recipe applies to the float8 Linear layers"):
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                          "training": {"global_batch": 8, "seq_len": 4096, "fp8_recipe": "rowwise"},
                          "mesh": {"names": ["dp_shard"], "shape": [8]}})


@pytest.mark.parametrize("gather,output", [(True, False), (True, True), (False, False), (False, True)])
def test_torchtitan_float8_round_trip(tmp_path, gather, output):
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "param_dtype": "fp32",
                                         "recompute": "full", "linear_dtype": "fp8", "fp8_all_gather": gather,
                                         "fp8_output_layer": output},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    text, header = export(cfg, "torchtitan", "f8")
    assert f"enable_fsdp_float8_all_gather = {str(gather).lower()}" in text
    assert 'converters = ["quantize.linear.float8"]' in text  # the registry name at e347b1e
    assert ('filter_fqns = []' if output else 'filter_fqns = ["output"]') in text
    assert not [h for h in header if h.startswith("not expressed")], header
    again = load_any(_write(tmp_path, "x.toml", text), "torchtitan", reimport_options(cfg, "torchtitan"))
    assert differences(cfg, again) == []


# DeepSpeed gradient clipping --------------------------------------------------------------

@pytest.mark.parametrize("value,clip", [(1.0, True), (0.3, True), (0.0, False), (0, False), (None, True)])
def test_deepspeed_gradient_clipping(tmp_path, value, clip):
    d = json.loads(DS.read_text())
    d.pop("gradient_clipping")
    if value is not None:
        d["gradient_clipping"] = value
    cfg = load_any(_write(tmp_path, "d.json", json.dumps(d)), opts=DSOPTS)
    assert cfg.training.grad_clip is clip
    # absent: DeepSpeed's default, 1.0 since v0.19.3 (0 before), with a note
    assert any("gradient_clipping not given" in n for n in cfg.notes) is (value is None)
    again = load_any(_write(tmp_path, "e.json", export(cfg, "deepspeed", "d")[0]), "deepspeed", DSOPTS)
    assert differences(cfg, again) == []
    with pytest.raises(ConfigError, match=r"^gradient_clipping: must be a number >= 0"):
        load_any(_write(tmp_path, "f.json", json.dumps(d | {"gradient_clipping": -1})), opts=DSOPTS)


# Megatron launch scripts ------------------------------------------------------------------

PRETRAIN_GPT = """#!/bin/bash
GPUS_PER_NODE=8
NNODES=2
DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \\
    --nnodes $NNODES \\
    --master_addr localhost \\
    --master_port 6000
"
GPT_ARGS="
    --num-layers 24 \\
    --hidden-size 1024 \\
    --num-attention-heads 16 \\
    --seq-length 1024 \\
    --max-position-embeddings 1024 \\
    --micro-batch-size 4 \\
    --global-batch-size 64 \\
    --lr 0.00015 \\
    --fp16
"
torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \\
    $GPT_ARGS \\
    --vocab-size 50257 \\
    --save $CHECKPOINT_PATH
"""


def test_megatron_pretrain_gpt_sh_multiline_strings(tmp_path):
    f = _write(tmp_path, "pretrain_gpt.sh", PRETRAIN_GPT)
    cfg = load_any(f, "megatron", ImportOptions(cluster="dgx-h100"))
    # GPT-2 345M of pretrain_gpt.sh: 24 layers, 1024 hidden; 2 nodes from torchrun's --nnodes; dp = 16
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.q_heads, cfg.cluster.nodes) == (24, 1024, 16, 2)
    assert (cfg.mesh.names, cfg.mesh.shape, cfg.training.global_batch, cfg.training.micro_batch) == (
        ["dp"], [16], 64, 4)
    assert cfg.notes[-1] == "megatron: fields meshplan does not use: --lr, --save"  # no torchrun options
    cfg = load_any(f, "megatron", ImportOptions(cluster="dgx-h100", nodes=4))
    assert cfg.cluster.nodes == 4
    assert "megatron: --nodes 4 used; the launch script's --nnodes 2 is not" in cfg.notes
    with pytest.raises(ConfigError, match=r"^megatron: cannot split 'GPT_ARGS=\"' \(line 10\) into words \(No "
                                          r"closing quotation\); close the quote"):
        load_any(_write(tmp_path, "bad.sh", PRETRAIN_GPT.replace('    --fp16\n"', "    --fp16\n")), "megatron",
                 ImportOptions(cluster="dgx-h100"))


def test_megatron_missing_model_flags_name_them_and_the_fix(tmp_path):
    f = _write(tmp_path, "m.args", "--hidden-size 4096 --num-attention-heads 32 --seq-length 4096\n")
    with pytest.raises(ConfigError, match=r"^--model: the arguments lack the model flags --num-layers, --vocab-size "
                                          r"\(Megatron-LM takes the vocabulary size from its tokenizer, so its "
                                          r"arguments often lack it; meshplan knows GPT2BPETokenizer's\); give "
                                          r"--model CATALOG_NAME or --model "
                                          r"path/config.json, or add them to the arguments$"):
        load_any(f, opts=H100)
    f.write_text("--num-layers 32 --hidden-size 4096 --vocab-size 128256 --seq-length 4096\n")
    with pytest.raises(ConfigError, match=r"^--model: the arguments lack the model flag --num-attention-heads; "
                                          r"give --model .*, or add it to the arguments$"):
        load_any(f, opts=H100)


def test_torchtitan_degrees_off_the_world_name_the_torchtitan_key(tmp_path):
    """torchtitan's ParallelDims asserts dp_replicate * dp_shard * cp * tp * pp == world size: a
    file with dp_shard 3 on 8 GPUs is planned (infeasible, a result) and a note names the key."""
    f = tmp_path / "tt.toml"
    f.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 2048\n'
                 '[parallelism]\ndata_parallel_shard_degree = 3\n')
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1))
    assert "torchtitan: parallelism: pp * dp_replicate * dp_shard * cp * tp = 3, the world is 8 (1 node(s)); " \
           "torchtitan refuses that at start-up (ParallelDims): set parallelism.data_parallel_shard_degree = 8 " \
           "or -1" in cfg.notes


def test_megatron_clip_grad_zero_turns_clipping_off_and_round_trips(tmp_path):
    """Megatron-LM computes the gradient norm only with --clip-grad > 0 (default 1.0)."""
    base = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --vocab-size 128256 "
            "--ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --bf16 "
            "--tensor-model-parallel-size 8")
    opts = ImportOptions(cluster="dgx-h100", nodes=1)
    for extra, clip in (("", True), (" --clip-grad 1.0", True), (" --clip-grad 0", False), (" --clip-grad 0.0", False)):
        f = tmp_path / "m.args"
        f.write_text(base + extra + "\n")
        cfg = load_any(f, "megatron", opts)
        assert cfg.training.grad_clip is clip, extra
        text, header = export(cfg, "megatron", "m")
        assert ("--clip-grad 0" in text.splitlines()) is (not clip)
        assert not [h for h in header if "grad_clip" in h]
    f.write_text(base + " --clip-grad x\n")
    with pytest.raises(ConfigError, match=r"^--clip-grad: 'x' is not a number"):
        load_any(f, "megatron", opts)


def test_deepspeed_activation_checkpointing_section_is_full_recompute(tmp_path):
    """A DeepSpeed config with an activation_checkpointing section configures
    deepspeed.checkpointing.checkpoint, which models call on whole blocks: planned as full
    recompute (with a note); without it DeepSpeed checkpoints nothing unless the model code
    calls deepspeed.checkpointing: recompute none, the note saying so; export writes no
    section (newcomer trial nc52 #8: an empty one stood for full, though it turns nothing on and
    the HF Trainer ignores it), its header saying where full is set."""
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "bf16": {"enabled": True}}
    opts = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)
    full = ("deepspeed: activation_checkpointing configures deepspeed.checkpointing.checkpoint, which the model code "
            "calls on whole blocks (Megatron-DeepSpeed's --checkpoint-activations): planned with recompute = \"full\"; "
            "set training.recompute if the model checkpoints otherwise")
    none = ("deepspeed: no activation_checkpointing section: planned without activation checkpointing (recompute = "
            "\"none\"), as DeepSpeed runs unless the model code calls deepspeed.checkpointing itself; set "
            "training.recompute if it does")
    for section, recompute, note in (({"activation_checkpointing": {"partition_activations": False}}, "full", full),
                                     ({}, "none", none)):
        f = tmp_path / "ds.json"
        f.write_text(json.dumps(base | section))
        cfg = load_any(f, opts=opts)
        assert cfg.training.recompute == recompute
        assert [n for n in cfg.notes if "recompute" in n] == [note]
        text, header = export(cfg, "deepspeed", "ds")
        assert "activation_checkpointing" not in json.loads(text)  # no key turns it on (nc52d: none written)
        assert [h.split(":")[0] for h in header if "recompute" in h] == (
            ["activation checkpointing (recompute full) is not a DeepSpeed JSON key"] if recompute == "full" else [])


def test_megatron_negative_clip_grad_is_a_value_and_a_bare_one_an_error(tmp_path):
    """argparse reads ``--clip-grad -1`` as the value -1 (no clipping: Megatron-LM clips only
    when it is > 0); a bare ``--clip-grad`` is refused by Megatron-LM's parser."""
    base = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --vocab-size 128256 "
            "--ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --bf16 "
            "--tensor-model-parallel-size 8")
    opts = ImportOptions(cluster="dgx-h100", nodes=1)
    f = tmp_path / "m.args"
    f.write_text(base + " --clip-grad -1 --lr 3e-4\n")
    cfg = load_any(f, "megatron", opts)
    assert cfg.training.grad_clip is False
    f.write_text(base + " --clip-grad --lr 3e-4\n")
    with pytest.raises(ConfigError, match=r"^--clip-grad: needs a value"):
        load_any(f, "megatron", opts)


def test_cli_import_options_below_one_name_the_option(capsys):
    """--seq-len 0 was dropped silently (``opts.seq_len or ...``) and -5 named training.seq_len."""
    from meshplan.cli import main
    for opt, value in (("--seq-len", "0"), ("--seq-len", "-5"), ("--nodes", "0")):
        argv = ["plan", str(ROOT / "examples" / "torchtitan_llama3-8b_8xh100.toml"), "--cluster", "dgx-h100",
                "--nodes", "1", opt, value]
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err == f"error: {opt}: {value} must be a whole number >= 1\n"


def test_import_options_are_checked_where_they_are_built():
    """One home for the --nodes / --seq-len bound (ImportOptions): before, the CLI and
    cluster_table each checked --nodes (two messages), and ImportOptions(nodes=0) passed."""
    for field, kw in (("--nodes", dict(nodes=0)), ("--nodes", dict(nodes=-2)), ("--seq-len", dict(seq_len=0))):
        value = next(iter(kw.values()))
        with pytest.raises(ConfigError, match=f"^{field}: {value} must be a whole number >= 1$"):
            ImportOptions(cluster="dgx-h100", **kw)
    assert ImportOptions(cluster="dgx-h100", nodes=1, seq_len=1).nodes == 1


def test_a_toml_syntax_error_is_reported_before_the_foreign_options(tmp_path):
    """A torchtitan file with a TOML syntax error is detected as meshplan (it cannot be read);
    with --cluster given the user must see the syntax error, not 'only for a foreign config'."""
    f = tmp_path / "tt.toml"
    f.write_text('[model]\nname = "llama3"\nflavor = "8B\n')
    with pytest.raises(ConfigError, match=r"^config: .*not valid TOML"):
        load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1))


def test_torchtitan_mixed_precision_values_are_checked(tmp_path):
    """torchtitan's mixed_precision_param / _reduce take float32 or bfloat16; anything else fell
    back to bf16 / fp32 silently."""
    for key in ("mixed_precision_param", "mixed_precision_reduce"):
        f = tmp_path / f"{key}.toml"
        f.write_text(f'[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 2048\n'
                     f'{key} = "float16"\n')
        with pytest.raises(ConfigError, match=rf"^training.{key}: 'float16'; use float32 or bfloat16"):
            load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1))


@pytest.mark.parametrize("zero,key,device", [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}, "zero_optimization.offload_optimizer", "'nvme'"),
    ({"offload_optimizer": {"device": "none"}, "offload_param": {"device": "nvme", "nvme_path": "/n"}},
     "zero_optimization.offload_param", "'nvme'"),
    ({"offload_param": {"device": "cpu"}}, "zero_optimization.offload_param", "'cpu'"),
    ({"cpu_offload_param": True}, "zero_optimization.cpu_offload_param", None),
])
def test_deepspeed_offload_is_refused_naming_the_key(tmp_path, zero, key, device):
    """DeepSpeed's zero/config.py: offload_optimizer/offload_param hold a device (default "none");
    the deprecated cpu_offload/cpu_offload_param true mean device "cpu". meshplan models ZeRO-Offload
    of the optimizer to the CPU only (meshplan.memory.offload, tests/test_offload.py): NVMe and
    parameter offload are refused naming the key (before: every offload was, the CPU optimizer too)."""
    d = json.loads(DS.read_text())
    d["zero_optimization"] |= zero
    with pytest.raises(ConfigError) as e:
        load_any(_write(tmp_path, "o.json", json.dumps(d)), opts=DSOPTS)
    assert e.value.field == key
    assert e.value.message.startswith(f"device {device}: " if device else "meshplan models ZeRO-Offload to the CPU only")


@pytest.mark.parametrize("zero", [{"offload_optimizer": {"device": "cpu", "pin_memory": True}}, {"cpu_offload": True}])
def test_deepspeed_cpu_optimizer_offload_is_read(tmp_path, zero):
    """The CPU optimizer (device "cpu", or the deprecated cpu_offload true) is read into
    training.offload_optimizer = "cpu" at this config's stage 2, and its device keys are not listed unused;
    pin_memory is (timed as pinned either way, it is carried as the user's key)."""
    d = json.loads(DS.read_text())
    d["zero_optimization"] |= zero
    cfg = load_any(_write(tmp_path, "c.json", json.dumps(d)), opts=DSOPTS)
    assert (cfg.training.sharding, cfg.training.offload_optimizer) == ("zero2", "cpu")
    assert "offload_optimizer.device" not in cfg.notes[-1] and "cpu_offload" not in cfg.notes[-1]
    assert ("zero_optimization.offload_optimizer.pin_memory" in cfg.notes[-1]) == ("offload_optimizer" in zero)


def test_deepspeed_offload_to_device_none_is_planned(tmp_path):
    """Device "none" and false booleans offload nothing: the GPU-resident plan; the device keys are read
    (they decide training.offload_optimizer), no longer listed unused."""
    d = json.loads(DS.read_text())
    d["zero_optimization"] |= {"offload_optimizer": {"device": "none"}, "offload_param": {},
                               "cpu_offload": False, "cpu_offload_param": False}
    cfg = load_any(_write(tmp_path, "n.json", json.dumps(d)), opts=DSOPTS)
    assert (cfg.training.sharding, cfg.training.offload_optimizer) == ("zero2", "none")
    assert "zero_optimization.offload_optimizer.device" not in cfg.notes[-1]


def test_deepspeed_config_searches_only_meshes_deepspeed_runs():
    """A DeepSpeed config runs ZeRO over one data axis (export --to deepspeed refuses tp, pp, cp,
    ep and HSDP): its [search] keeps the search there, the header says so, and every row listed
    exports back to DeepSpeed. Was: dp_shard x cp and HSDP rows from a DeepSpeed config."""
    import dataclasses
    from meshplan.report.search_header import header_lines
    from meshplan.search.driver import search
    from meshplan.search.space import candidate_config
    cfg = load_any(DS, opts=DSOPTS)
    o = cfg.search
    assert (o.pp, o.dp_replicate, o.cp, o.tp, o.ep, o.etp, o.sharding) == ([1], [1], [1], [1], [1], [1],
                                                                           ["zero1", "zero2", "zero3"])
    assert any(n.startswith("deepspeed: meshplan search keeps to what a DeepSpeed config runs") for n in cfg.notes)
    r = search(dataclasses.replace(cfg, search=o.model_copy(update={"top": 5})), workers=1)
    assert r.top and "only these, by [search]: pp 1, dp_replicate 1, cp 1, tp 1, ep 1, etp 1, sharding " \
        "zero1/zero2/zero3" in header_lines(r)
    # tp pinned to 1: no line that tp_comm_overlap was not searched (it has nothing to overlap)
    assert not any(x.startswith("not searched: training.tp_comm_overlap") for x in header_lines(r))
    for e in r.top:
        row = candidate_config(r.config, r.candidates, e.index)
        axis = "dp_shard" if row.training.sharding == "zero3" else "dp"  # ZeRO-1/2 replicate: DeepSpeed's dp
        assert [(a, d) for a, d in zip(row.mesh.names, row.mesh.shape) if d > 1] == [(axis, 16)]
        assert json.loads(export(row, "deepspeed", "row")[0])["zero_optimization"]["stage"] in (1, 2, 3)
