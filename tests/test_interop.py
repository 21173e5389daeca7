"""Import and export of torchtitan, Megatron-LM and DeepSpeed configs (issue 12 items 1, 2)
and the axis vocabularies (item 6).

Expected values are derived by hand from the example files and the foreign tools' rules
(torchtitan: global batch = local_batch_size x dp, dp_shard -1 = the rest of the world;
Megatron-LM: dp = world / (tp * cp * pp); DeepSpeed: train_batch_size = micro x accumulation
x dp). Round trips compare the plans: mesh, memory peak and step time.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest

from meshplan import catalog
from meshplan.config import config_from_dict, load_config
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.deepspeed_batch import batch
from meshplan.interop.detect import detect
from meshplan.interop.export import export, reimport_options
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron import parse_args, write
from meshplan.interop.roundtrip import differences, mesh_key
from meshplan.interop.torchtitan_tables import default_split
from meshplan.plan import Plan, build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from tests.cli_run import run_captured

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
TT = EX / "torchtitan_llama3-8b_8xh100.toml"
MG = EX / "megatron_llama3-8b_16xh100_tp2-pp2.args"
DS = EX / "deepspeed_zero2_16xh100.json"
H100 = ImportOptions(cluster="dgx-h100", nodes=1)


def _cli(*args: str, cwd=None):
    """``meshplan ARGS`` in-process (:func:`tests.cli_run.run_captured`: no interpreter start-up) under the
    bare environment its subprocess had (PATH /usr/bin:/bin, OMP_NUM_THREADS 1), in ``cwd`` when given."""
    with mock.patch.dict(os.environ, {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, clear=True):
        return run_captured(*args, cwd=cwd)


def _same_loss(again, cfg):
    """``again`` (a re-imported export) with ``cfg``'s ``[memory] cross_entropy``: a torchtitan
    import states torch's loss (``"torch"``, or ``"compiled"``: what torchtitan runs), which the
    export cannot carry from a config that keeps Megatron's default (roundtrip.differences skips
    it likewise); and, under framework megatron on both sides, with ``cfg``'s Megatron-LM generation
    (``training.megatron_runtime``): a Megatron-LM import states today's (core) whatever generation
    the exported plan followed, which the export's header says and roundtrip.differences skips
    likewise; and with ``cfg``'s ``sp_gathered_input``: a torchtitan import states torch's tp saving
    its all-gathered GEMM inputs (newcomer trial 53), the runtime's, which roundtrip.differences skips
    too; the rest of the plan must be the same."""
    if cfg.training.framework == again.training.framework == "megatron":
        again = replace(again, training=again.training.model_copy(update={
            "megatron_runtime": cfg.training.megatron_runtime,
            "dataloader_attention_mask": cfg.training.dataloader_attention_mask}))
    return replace(again, memory=again.memory.model_copy(update={"cross_entropy": cfg.memory.cross_entropy,
                                                                 "sp_gathered_input": cfg.memory.sp_gathered_input}))


def _outcome(cfg):
    """(mesh key, peak bytes of the most loaded stage, step seconds) of a config's plan."""
    p = build_plan(cfg)
    assert isinstance(p, Plan) and p.feasible, p.reasons
    return mesh_key(cfg), p.timeline.peak.total_bytes, step_time(p, Overlap()).step_s


def test_detects_each_format():
    assert [detect(p, p.read_text()) for p in (TT, MG, DS, EX / "seed-64gpu.toml")] == [
        "torchtitan", "megatron", "deepspeed", "meshplan"]


def test_torchtitan_example_by_hand():
    cfg = load_any(TT, opts=H100)
    t = cfg.training
    assert cfg.model == catalog.model("llama3-8b")
    assert (cfg.mesh.names, cfg.mesh.shape) == (["dp_shard"], [-1])  # -1: 8 GPUs / 1 = 8
    # global batch = local_batch_size 1 x dp (dp_replicate 1 x dp_shard 8) = 8
    assert (t.global_batch, t.micro_batch, t.seq_len) == (8, 1, 8192)
    # [activation_checkpoint] mode "selective", selective_ac_option "op": torchtitan's op-level SAC
    assert (t.sharding, t.param_dtype, t.compute_dtype, t.reduce_dtype, t.recompute, t.reshard_after_forward) == (
        "zero3", "fp32", "bf16", "fp32", "op", True)
    assert cfg.notes[-1] == ("torchtitan: fields meshplan does not use: job.dump_folder, job.description, "
                             "model.hf_assets_path, optimizer.lr, metrics.log_freq, training.steps, "
                             "training.dataset, checkpoint.enable")


def test_torchtitan_hf_path_and_float8(tmp_path):
    hf = ROOT / "tests" / "data" / "hf" / "qwen3-0.6b"
    f = tmp_path / "qwen.toml"
    f.write_text(f'[model]\nname = "qwen3"\nflavor = "0.6B"\nhf_assets_path = "{hf}"\nconverters = ["float8"]\n'
                 '[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n'
                 '[training]\nlocal_batch_size = 2\nseq_len = 2048\n')
    cfg = load_any(f, opts=H100)
    assert cfg.model.layers == 28 and cfg.model.hidden == 1024  # Qwen3-0.6B config.json
    # float8: the Linears' GEMMs in fp8, activations in the compute dtype (bf16)
    t = cfg.training
    assert (t.compute_dtype, t.linear_dtype, t.global_batch) == ("bf16", "fp8", 16)  # 2 x dp_shard 8
    # enable_fsdp_float8_all_gather with dp_shard 8: FSDP2 gathers float8 weights; filter_fqns defaults to []
    # in job_config.py, so the output layer is converted too
    assert (cfg.training.fp8_all_gather, cfg.training.fp8_output_layer) == (True, True)
    assert not any("fields meshplan does not use" in n for n in cfg.notes)
    assert any("precompute_float8_dynamic_scale_for_fsdp is false" in n for n in cfg.notes)
    f.write_text('[model]\nname = "qwen3"\nflavor = "0.6B"\n')  # qwen3 is mapped for its MoE flavors only
    with pytest.raises(ConfigError, match=r"^model.flavor: torchtitan model 'qwen3' flavor '0.6B' is not one meshplan "
                                          r"maps \(qwen3 30B-A3B, 235B-A22B\) .* --model"):
        load_any(f, opts=H100)
    f.write_text('[model]\nname = "gpt_oss"\nflavor = "20b"\n')
    with pytest.raises(ConfigError, match=r"^model.name: torchtitan model 'gpt_oss' is not one meshplan knows by name "
                                          r"\(supported: llama3, deepseek_v3, qwen3\) .* give one of those names with "
                                          r"its flavor, .* --model"):
        load_any(f, opts=H100)
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1, model=str(hf)))
    assert cfg.model.layers == 28
    f.write_text('[model]\nname = "llama3"\nflavor = "0.6B"\n')  # a known name, an unknown flavor: model.flavor
    with pytest.raises(ConfigError, match=r"^model.flavor: torchtitan model 'llama3' flavor '0.6B' is not one "
                                          r"meshplan maps \(llama3 8B, 70B, 405B\) .* give --model"):
        load_any(f, opts=H100)


def test_megatron_bf16_reduces_gradients_in_fp32_unless_told(tmp_path):
    """Megatron-LM's arguments.py forces accumulate_allreduce_grads_in_fp32 for --bf16 (later
    versions: unless --grad-reduce-in-bf16): the imported config's dp reduction is fp32, bf16 with
    the flag, and an export writes the flag back so the round trip keeps bf16."""
    args = MG.read_text().replace("--use-distributed-optimizer ", "")  # DDP: sharding none
    f = tmp_path / "a.args"
    f.write_text(args)
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=2))
    assert (cfg.training.sharding, cfg.training.gradient_reduce_dtype) == ("none", "fp32")
    dp = [r for r in build_plan(cfg).stage(0).collectives if r.axis == "dp"]
    assert dp and {r.dtype for r in dp} == {"fp32"}
    f.write_text(args + " --grad-reduce-in-bf16")
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=2))
    assert cfg.training.gradient_reduce_dtype == "bf16"
    assert "--grad-reduce-in-bf16" in write(cfg)


def test_megatron_example_by_hand():
    cfg = load_any(MG, opts=ImportOptions(cluster="dgx-h100", nodes=2))
    t = cfg.training
    # dp = 16 / (tp 2 * cp 1 * pp 2) = 4, Megatron's order tp-cp-dp-pp: outermost pp, dp, tp
    assert (cfg.mesh.names, cfg.mesh.shape, cfg.mesh.sequence_parallel) == (["pp", "dp", "tp"], [2, 4, 2], True)
    assert (t.global_batch, t.micro_batch, t.seq_len, t.sharding, t.recompute) == (128, 1, 8192, "zero1", "selective")
    # --bf16 makes Megatron-LM accumulate and reduce gradients in fp32 (arguments.py: "bfloat16
    # requires gradient accumulation and all-reduce to be done in fp32")
    assert (t.param_dtype, t.compute_dtype, t.gradient_reduce_dtype) == ("bf16", "bf16", "fp32")
    assert cfg.model == catalog.model("llama3-8b")  # the flags give its fields exactly
    assert "megatron: the model flags give catalog model llama3-8b exactly" in cfg.notes
    assert cfg.notes[-1] == "megatron: fields meshplan does not use: --lr, --train-iters, --tokenizer-type"
    # zero1 (DDP buffers) with --overlap-grad-reduce: planned so (its bucketed reduce-scatters in the backward)
    assert (t.overlap_grad_reduce, t.overlap_param_gather) == (True, False)
    assert not any("overlap" in n for n in cfg.notes)


def test_megatron_launch_script_with_variables_and_nnodes(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\nTP=4\nPP=2\nMODEL_ARGS=(\n  --num-layers 32 --hidden-size 4096 --num-attention-heads 32"
                      " \\\n  --ffn-hidden-size 14336 --swiglu --vocab-size 128256 --seq-length 4096\n)\n"
                      "PAR=\"--tensor-model-parallel-size $TP --pipeline-model-parallel-size ${PP}\"  # layout\n"
                      "torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py ${MODEL_ARGS[@]} $PAR \\\n"
                      "  --micro-batch-size 2 --global-batch-size 64 --bf16\n")
    cfg = load_any(script, "megatron", ImportOptions(cluster="dgx-h100"))
    assert cfg.cluster.nodes == 2  # from --nnodes
    assert (cfg.mesh.names, cfg.mesh.shape) == (["pp", "dp", "tp"], [2, 2, 4])  # dp = 16 / (4 * 2)
    assert (cfg.training.micro_batch, cfg.training.global_batch, cfg.model.ffn, cfg.model.tied_embeddings) == (
        2, 64, 14336, True)  # Megatron ties embeddings unless --untie-embeddings-and-output-weights
    # torchrun's options (before pretrain_gpt.py) are the launcher's: read (--nnodes) or left, never listed
    assert not any("--nproc_per_node" in n for n in cfg.notes)


def test_megatron_world_and_nnodes_errors(tmp_path):
    f = tmp_path / "a.args"
    f.write_text("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 128256 --seq-length 4096\n"
                 "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 3\ntorchrun --nnodes $NNODES x.py\n")
    with pytest.raises(ConfigError, match=r"^--nodes: the launch script's --nnodes is '\$NNODES', not a node count"):
        load_any(f, opts=ImportOptions(cluster="dgx-h100"))
    for bad in ("9" * 5000, "\u00b2"):  # str.isdigit() accepts both, int() raises on both
        g = tmp_path / "b.args"
        g.write_text(f.read_text().replace("$NNODES", bad))
        with pytest.raises(ConfigError, match=r"^--nodes: the launch script's --nnodes is"):
            load_any(g, opts=ImportOptions(cluster="dgx-h100"))
    # 2 nodes = 16 GPUs: tp 8 * pp 3 = 24 does not divide it; pp (tp 8 alone cannot: 3 does not divide 16)
    # at 16 / 8 = 2, or 3 nodes (24 GPUs, planned below)
    with pytest.raises(ConfigError, match=r"^--pipeline-model-parallel-size: --tensor-model-parallel-size 8 x "
                                          r"--pipeline-model-parallel-size 3 = 24 does not divide the world, --nodes 2 "
                                          r"x 8 GPUs = 16; .*fix: --pipeline-model-parallel-size 2 .*or --nodes 3 "):
        load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=2))
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=3, seq_len=2048))  # 24 GPUs: dp 1
    assert (cfg.mesh.shape, cfg.training.seq_len) == ([3, 1, 8], 2048)
    assert "megatron: --seq-len 2048 replaces --seq-length 4096" in cfg.notes


def test_parse_args_switch_and_equals():
    assert parse_args("--bf16 --seq-length=4096 --sequence-parallel\n--lr 1e-4") == {
        "--bf16": True, "--seq-length": "4096", "--sequence-parallel": True, "--lr": "1e-4"}


def test_deepspeed_example_by_hand():
    cfg = load_any(DS, opts=ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096))
    t = cfg.training
    assert (cfg.mesh.names, cfg.mesh.shape) == (["dp"], [16])
    # 256 = micro 1 x accumulation 16 x dp 16
    assert (t.global_batch, t.micro_batch, t.sharding, t.param_dtype, t.master_weights) == (
        256, 1, "zero2", "bf16", True)
    assert t.grad_clip  # "gradient_clipping": 1.0 > 0
    assert cfg.memory.grad_bucket_elements == 500_000_000  # zero2: "reduce_bucket_size": 500000000
    # ZeRO-2 as DeepSpeed runs it, "overlap_comm": true; no communication_data_type: the model's bf16
    assert (t.zero12_engine, t.overlap_comm, t.grad_reduce_dtype, t.gradient_reduce_dtype) == (
        "deepspeed", True, None, "bf16")
    assert cfg.notes[-1] == "deepspeed: fields meshplan does not use: steps_per_print"


def test_deepspeed_batch_rule():
    assert batch({"train_batch_size": 64}, 8) == (64, 8)
    with pytest.raises(ConfigError, match=r"train_batch_size: 60 != train_micro_batch_size_per_gpu 2 x "
                                          r"gradient_accumulation_steps 4 x dp 8 = 64"):
        batch({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 8)


def test_torchtitan_default_split_by_hand():
    # 126 layers + embedding 1 + output 1 = 128 over 16 stages: 8 each, 7 layers on the end stages
    assert default_split(16, 126) == [7] + [8] * 14 + [7]
    # 80 + 2 = 82 over 8 virtual stages: 10 each, 2 extra on stages 0 and 1
    assert default_split(8, 80) == [10, 11, 10, 10, 10, 10, 10, 9]
    assert sum(default_split(8, 80)) == 80


def test_what_a_foreign_file_does_not_say_is_an_option_error():
    with pytest.raises(ConfigError, match=r"^--cluster: a torchtitan config does not say the cluster; give --cluster"):
        load_any(TT)
    with pytest.raises(ConfigError, match=r"^--model: a DeepSpeed config does not name the model"):
        load_any(DS, opts=ImportOptions(cluster="dgx-h100", nodes=2))
    with pytest.raises(ConfigError, match=r"^--cluster: only for a foreign config"):
        load_any(EX / "seed-64gpu.toml", opts=H100)


def test_torchtitan_pipeline_and_hsdp_by_hand(tmp_path):
    f = tmp_path / "tt.toml"
    f.write_text('[model]\nname = "llama3"\nflavor = "70B"\n[training]\nlocal_batch_size = 8\nseq_len = 4096\n'
                 '[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = -1\n'
                 'tensor_parallel_degree = 8\npipeline_parallel_degree = 2\n'
                 'pipeline_parallel_schedule = "Interleaved1F1B"\npipeline_parallel_microbatch_size = 2\n')
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=8))
    # dp_shard = 64 / (pp 2 * dp_replicate 2 * tp 8) = 2; Interleaved1F1B: 2 stages per rank, 4 parts
    assert (cfg.mesh.names, cfg.mesh.shape) == (["pp", "dp_replicate", "dp_shard", "tp"], [2, 2, -1, 8])
    assert (cfg.mesh.virtual_stages, str(cfg.mesh.pp_schedule)) == (2, "interleaved_1f1b")
    assert cfg.mesh.pp_layer_split == [20, 21, 20, 19]  # (80 + 2) / 4 = 20 r 2
    # global = local 8 x dp (2 x 2) = 32; micro-batch = the pipeline micro-batch; "default" left unset (nc24b),
    # resolved per mesh: no reshard under pp 2
    t = cfg.training
    assert (t.global_batch, t.micro_batch, t.sharding, t.at_pp(2).reshard_after_forward) == (32, 2, "hsdp", False)
    assert "reshard_after_forward" not in t.model_fields_set


def _tt_ac(tmp_path, option: str, tp: int = 1, mode: str = "selective", cp: int = 1):
    f = tmp_path / f"ac-{option}-{tp}-{cp}.toml"
    f.write_text(f'[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 4096\n'
                 f'[parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = {tp}\n'
                 f'context_parallel_degree = {cp}\n'
                 f'[activation_checkpoint]\nmode = "{mode}"\nselective_ac_option = "{option}"\n')
    return load_any(f, opts=H100)


def test_nodes_over_the_world_bound_names_the_option():
    with pytest.raises(ConfigError, match=r"^--nodes: 99999999 nodes x 8 GPUs = 799,999,992 ranks is over the bound "
                                          r"1,048,576"):
        load_any(TT, opts=ImportOptions(cluster="dgx-h100", nodes=99999999))


def test_torchtitan_activation_checkpointing_options(tmp_path):
    # torchtitan's selective AC: option "op" is op-level SAC, an integer k every k-th block in full
    assert _tt_ac(tmp_path, "op").training.recompute == "op"
    t = _tt_ac(tmp_path, "3").training
    assert (t.recompute, t.ac_freq) == ("layer", 3)
    assert _tt_ac(tmp_path, "3", mode="full").training.recompute == "full"
    # op-level SAC is modelled with cp = 1 only (tp > 1 under SP, as torchtitan applies TP):
    # cp 2 is planned as selective, and says so
    assert _tt_ac(tmp_path, "op", tp=2).training.recompute == "op"
    cfg = _tt_ac(tmp_path, "op", cp=2)
    assert cfg.training.recompute == "selective"
    assert any("op-level SAC" in n and "with cp 2 planned as Megatron-LM's selective" in n for n in cfg.notes)
    for bad in ("0", "two"):
        with pytest.raises(ConfigError, match=r"^activation_checkpoint.selective_ac_option: "):
            _tt_ac(tmp_path, bad)


@pytest.mark.parametrize("recompute,ac_freq,option", [("layer", 2, "2"), ("layer", 1, "1"), ("op", 1, "op")])
def test_torchtitan_ac_round_trip_and_megatron_refusal(tmp_path, recompute, ac_freq, option):
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "micro_batch": 1, "param_dtype": "fp32",
                                         "recompute": recompute, "ac_freq": ac_freq},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    text, header = export(cfg, "torchtitan", "ac")
    assert f'selective_ac_option = "{option}"' in text and 'mode = "selective"' in text
    assert not [h for h in header if h.startswith("not expressed")], header
    out = tmp_path / "x.toml"
    out.write_text(text)
    assert differences(cfg, load_any(out, "torchtitan", reimport_options(cfg, "torchtitan"))) == []
    with pytest.raises(ConfigError, match=rf"^--to: Megatron-LM has no flag for torchtitan's recompute '{recompute}'"):
        export(replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron"})), "megatron", "ac")


def test_megatron_selective_exported_to_torchtitan_lists_the_change():
    # torchtitan has no attention-core recompute: with flash attention written as mode "none" (the
    # same activations kept but the flash softmax statistics; op-level SAC keeps others), and the
    # header says so; without flash attention as "full" (the softmax output is not kept)
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "micro_batch": 1, "param_dtype": "fp32",
                                         "recompute": "selective"},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    text, header = export(cfg, "torchtitan", "sel")
    assert "not expressed in torchtitan: training.recompute: 'selective' -> 'none'" in header
    assert 'mode = "none"' in text and "selective_ac_option" not in text
    slow = replace(cfg, training=cfg.training.model_copy(update={"flash_attention": False}))
    assert "not expressed in torchtitan: training.recompute: 'selective' -> 'full'" in export(slow, "torchtitan",
                                                                                             "sel")[1]


@pytest.mark.parametrize("path,opts,to", [
    (EX / "seed-64gpu.toml", ImportOptions(), "torchtitan"),
    (EX / "seed-64gpu.toml", ImportOptions(), "meshplan"),
    (MG, ImportOptions(cluster="dgx-h100", nodes=2), "megatron"),
    (MG, ImportOptions(cluster="dgx-h100", nodes=2), "meshplan"),
    (DS, ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096), "deepspeed"),
])
def test_round_trip_plans_the_same(tmp_path, path, opts, to):
    cfg = load_any(path, opts=opts)
    if to == "torchtitan":  # the seed's Megatron-LM selective has no torchtitan option (the test above)
        cfg = replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"}))
    text, header = export(cfg, to, str(path))
    assert not [h for h in header if h.startswith("not expressed")], header
    out = tmp_path / f"x.{ {'deepspeed': 'json', 'megatron': 'args'}.get(to, 'toml') }"
    out.write_text(text)
    again = load_any(out, to, reimport_options(cfg, to) if to != "meshplan" else ImportOptions())
    assert differences(cfg, again) == []
    a, b = _outcome(cfg), _outcome(_same_loss(again, cfg))
    assert a[0] == b[0] and a[1] == b[1] and a[2] == pytest.approx(b[2], rel=1e-12)


def _seventy(mesh: dict, **training) -> dict:
    return {"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
            "training": {"global_batch": 64, "seq_len": 4096, "recompute": "full", **training}, "mesh": mesh}


@pytest.mark.parametrize("tables,to", [
    # torchtitan under pp: FSDP2 keeps fp32 shards, no reshard after forward (its default with pp)
    (_seventy({"names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 4], "sequence_parallel": True},
              param_dtype="fp32", reshard_after_forward=False), "torchtitan"),
    # interleaved, an uneven split per virtual stage (torchtitan's module_fqns_per_model_part holds any);
    # resharded after forward under pp is torchtitan's "always", which reshards [norm, output] too
    (_seventy({"names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 4], "sequence_parallel": True,
               "virtual_stages": 2, "pp_schedule": "interleaved_1f1b",
               "pp_layer_split": [9, 10, 10, 11, 11, 10, 10, 9]}, param_dtype="fp32",
              reshard_head_after_forward=True), "torchtitan"),
    # Megatron: distributed optimizer, interleaved 1F1B with 10 layers per virtual stage
    (_seventy({"names": ["pp", "dp", "tp"], "shape": [4, 2, 4], "sequence_parallel": True, "virtual_stages": 2,
               "pp_schedule": "interleaved_1f1b"}, sharding="zero1", grad_reduce_dtype="fp32", framework="megatron"),
     "megatron"),
    # Megatron: the first and last stage lighter, the middle even (--decoder-first/last-pipeline-num-layers)
    (_seventy({"names": ["pp", "dp", "tp"], "shape": [4, 2, 4], "sequence_parallel": True,
               "pp_layer_split": [19, 21, 21, 19]}, sharding="zero1", grad_reduce_dtype="param", framework="megatron"),
     "megatron"),
    # Megatron, interleaved with the first and last stage lighter: each stage's layers a multiple of
    # vpp 2 (TransformerConfig), so --decoder-first/last-pipeline-num-layers 18 with 2 virtual stages
    (_seventy({"names": ["pp", "dp", "tp"], "shape": [4, 2, 4], "sequence_parallel": True, "virtual_stages": 2,
               "pp_schedule": "interleaved_1f1b", "pp_layer_split": [18, 22, 22, 18]}, sharding="zero1",
              grad_reduce_dtype="param", framework="megatron"), "megatron"),
    # Llama 3 405B's split interleaved (126 layers + embedding + loss = 128 = pp 16 x vpp 2 x 4): Megatron's
    # --account-for-embedding/loss-in-pipeline-split; torchtitan's parts of 3, 4, ..., 4, 3 layers
    ({"model": {"catalog": "llama3-405b"}, "cluster": {"system": "dgx-h100", "nodes": 16},
      "training": {"global_batch": 32, "seq_len": 4096, "recompute": "full", "sharding": "zero1",
                   "grad_reduce_dtype": "param", "framework": "megatron"},
      "mesh": {"names": ["pp", "tp"], "shape": [16, 8], "sequence_parallel": True, "virtual_stages": 2,
               "pp_schedule": "interleaved_1f1b", "pp_layer_split": [7] + [8] * 14 + [7]}}, "megatron"),
    ({"model": {"catalog": "llama3-405b"}, "cluster": {"system": "dgx-h100", "nodes": 32},
      # resharded after forward under pp: torchtitan's "always", which reshards [norm, output] too
      "training": {"global_batch": 32, "seq_len": 4096, "recompute": "full", "param_dtype": "fp32",
                   "reshard_head_after_forward": True},
      "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": [16, 2, 8], "sequence_parallel": True, "virtual_stages": 2,
               "pp_schedule": "interleaved_1f1b", "pp_layer_split": [7] + [8] * 14 + [7]}}, "torchtitan"),
    # vpp 8: (126 + 2) / (16 x 8) = 1 slot, the first chunk the embedding alone and the last the output
    # layer alone (Megatron's account-for flags at one slot; torchtitan's parts ["tok_embeddings"], ...,
    # ["norm", "output"])
    ({"model": {"catalog": "llama3-405b"}, "cluster": {"system": "dgx-h100", "nodes": 16},
      "training": {"global_batch": 32, "seq_len": 4096, "recompute": "full", "sharding": "zero1",
                   "grad_reduce_dtype": "param", "framework": "megatron"},
      "mesh": {"names": ["pp", "tp"], "shape": [16, 8], "sequence_parallel": True, "virtual_stages": 8,
               "pp_schedule": "interleaved_1f1b", "pp_layer_split": [7] + [8] * 14 + [7]}}, "megatron"),
    ({"model": {"catalog": "llama3-405b"}, "cluster": {"system": "dgx-h100", "nodes": 32},
      "training": {"global_batch": 32, "seq_len": 4096, "recompute": "full", "param_dtype": "fp32",
                   "reshard_head_after_forward": True},
      "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": [16, 2, 8], "sequence_parallel": True, "virtual_stages": 8,
               "pp_schedule": "interleaved_1f1b", "pp_layer_split": [0] + [1] * 126 + [0]}}, "torchtitan"),
    # MoE: Mixtral's experts over ep 8 under Megatron FSDP (the example's mesh, in Megatron's order)
    (load_config(EX / "mixtral-8x7b_32xh100_ep8-dp32.toml"), "megatron"),
])
def test_pipeline_and_moe_round_trips(tmp_path, tables, to):
    cfg = tables if not isinstance(tables, dict) else config_from_dict(tables)
    if to == "megatron" and cfg.training.framework != "megatron":  # run by Megatron-LM: its backward order
        # and its bf16 parameters with fp32 main copies (torch's default: fp32 parameters)
        cfg = replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron", "param_dtype": "bf16"}))
    text, header = export(cfg, to, "test")
    assert not [h for h in header if h.startswith("not expressed")], header
    out = tmp_path / "x"
    out.write_text(text)
    again = load_any(out, to, reimport_options(cfg, to))
    assert differences(cfg, again) == []
    a, b = _outcome(cfg), _outcome(_same_loss(again, cfg))
    assert a[0] == b[0] and a[1] == b[1] and a[2] == pytest.approx(b[2], rel=1e-12)


def test_megatron_export_of_uneven_chunks():
    """The flags Megatron-LM takes for a split with virtual stages, and the refusal where none fits:
    Llama 3 8B's 32 layers as [7, 9, 9, 7] over vpp 2 give chunks 3+4 | 5+4 | 5+4 | 4+3 (stage_layers):
    neither each stage a multiple of 2 (--decoder-first/last-pipeline-num-layers) nor 34 slots over 8
    virtual stages (--account-for-embedding/loss-in-pipeline-split)."""
    mesh = {"names": ["pp", "dp", "tp"], "shape": [4, 2, 1], "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 16, "seq_len": 4096, "sharding": "zero1", "framework": "megatron"}}
    cfg = config_from_dict(base | {"mesh": mesh | {"pp_layer_split": [7, 9, 9, 7]}})
    with pytest.raises(ConfigError, match=r"^--to: virtual stages \[3, 5, 5, 4, 4, 4, 4, 3\] differ within a stage"):
        export(cfg, "megatron", "x")
    text, _ = export(config_from_dict(base | {"mesh": mesh | {"pp_layer_split": [6, 10, 10, 6]}}), "megatron", "x")
    assert "--num-virtual-stages-per-pipeline-rank 2" in text and "--decoder-first-pipeline-num-layers 6" in text \
        and "--decoder-last-pipeline-num-layers 6" in text


def test_export_lists_what_the_target_does_not_express():
    cfg = load_config(EX / "seed-64gpu.toml")  # fp32 parameters: Megatron keeps bf16 ones with fp32 main params
    _, header = export(cfg, "megatron", "seed")
    assert "not expressed in megatron: training.param_dtype: 'fp32' -> 'bf16'" in header
    # a torch plan run by Megatron-LM follows Megatron's backward order (training.framework)
    assert "not expressed in megatron: training.framework: 'torch' -> 'megatron'" in header


def test_export_refuses_what_the_target_cannot_run():
    cfg = load_config(EX / "seed-64gpu.toml")
    with pytest.raises(ConfigError, match=r"^--to: a DeepSpeed config applies to ZeRO over one data axis, without "
                                          r"TP/PP/CP/EP or HSDP; this mesh has tp 8"):
        export(cfg, "deepspeed", "seed")
    mg = load_any(MG, opts=ImportOptions(cluster="dgx-h100", nodes=2))
    with pytest.raises(ConfigError, match=r"^--to: torchtitan shards with FSDP2 \(zero3, hsdp\) or replicates"):
        export(mg, "torchtitan", "mg")


def test_meshplan_export_writes_the_uneven_layer_split():
    cfg = load_config(EX / "llama3-405b_16384xh100_tp8-pp16-dp128.toml")
    base = cfg.mesh.model_copy(update={"pp_layer_split": None, "names": ["pp", "dp_shard", "tp"],
                                       "shape": [2, 1024, 8], "virtual_stages": 1})
    text, _ = export(cfg, "meshplan", "405b")
    assert "pp_layer_split = [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]" in text
    even = config_from_dict({"model": {"catalog": "llama3-405b"}, "cluster": {"system": "dgx-h100", "nodes": 2048},
                             "training": {"global_batch": 2048, "seq_len": 8192},
                             "mesh": base.model_dump(mode="json", exclude_defaults=True)})
    text, _ = export(even, "meshplan", "even")  # 126 / 2 = 63: the split the plan uses, written out
    assert "pp_layer_split = [63, 63]" in text


@pytest.mark.slow
def test_search_rows_export_and_replan(tmp_path):
    """Every ranked row of a small search: exported as meshplan TOML it plans to the row's own
    step time; in a foreign format it is either refused with a reason or, where nothing is
    lost, plans the same."""
    from meshplan.search.driver import search
    from meshplan.search.space import candidate_config

    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 16, "seq_len": 4096}, "search": {"top": 4}},
                           require_mesh=False)
    result = search(cfg, workers=1)
    assert len(result.top) == 4
    planned = 0
    for rank, row in enumerate(result.top, 1):
        cc = candidate_config(cfg, result.candidates, row.index)
        for to in ("meshplan", "torchtitan", "megatron", "deepspeed"):
            try:
                text, header = export(cc, to, f"row {rank}")
            except ConfigError as e:
                assert e.field == "--to" and e.message
                continue
            if [h for h in header if h.startswith("not expressed")]:
                continue
            out = tmp_path / f"r{rank}-{to}"
            out.write_text(text)
            again = load_any(out, to, reimport_options(cc, to) if to != "meshplan" else ImportOptions())
            _, peak, step = _outcome(_same_loss(again, cc))
            assert step == pytest.approx(row.step_s, rel=1e-9) and peak == pytest.approx(row.peak_bytes, rel=1e-12)
            planned += 1
    assert planned >= 4  # at least every row as meshplan TOML


@pytest.mark.slow
def test_cli_import_writes_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "tt.toml"
    r = _cli("import", "torchtitan", str(TT), "--cluster", "dgx-h100", "--nodes", "1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "note: torchtitan: fields meshplan does not use: job.dump_folder" in r.stdout
    text = out.read_text()
    # the example's [checkpoint] enable = false: a note says why its keys are unused (nc55 #14), then the list
    assert text.startswith(f"# meshplan import torchtitan {TT}\n# note: torchtitan: checkpoint: enable = false ")
    assert "\n# note: torchtitan: fields meshplan does not use: job.dump_folder" in text
    assert load_config(out).training.global_batch == 8
    r = _cli("import", "torchtitan", str(TT), "--cluster", "dgx-h100", "--nodes", "1", "-o", str(out))
    assert (r.returncode, r.stderr) == (2, f"error: -o: {out} exists; choose another path or pass --force to "
                                           f"replace it\n")
    r = _cli("import", "torchtitan", str(TT), "-o", str(tmp_path / "y.toml"))
    assert r.returncode == 2 and r.stderr.startswith("error: --cluster: a torchtitan config does not say the cluster")
    assert r.stderr.count("\n") == 1


@pytest.mark.slow
def test_cli_plan_reads_a_foreign_file_and_search_exports_a_row(tmp_path):
    r = _cli("plan", str(DS), "--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b", "--seq-len", "4096")
    assert r.returncode == 0, r.stderr
    assert "note: deepspeed: fields meshplan does not use: steps_per_print" in r.stderr
    out = tmp_path / "row2.toml"
    r = _cli("search", str(TT), "--cluster", "dgx-h100", "--nodes", "1", "--top", "3", "--export", "2", "--to",
             "meshplan", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    assert load_config(out).mesh is not None


@pytest.mark.slow
def test_cli_groups_memory_reliability_report_read_a_foreign_file(tmp_path):
    import json
    opts = ["--cluster", "dgx-h100", "--nodes", "2"]
    mine = tmp_path / "mg.toml"
    assert _cli("import", "megatron", str(MG), *opts, "-o", str(mine)).returncode == 0
    for cmd, extra in (("groups", ["--rank", "3"]), ("memory", ["--out", str(tmp_path)]),
                       ("reliability", ["--write-gbps", "100", "--read-gbps", "100", "--restart-overhead-s", "600"])):
        direct = _cli(cmd, str(MG), *opts, *extra, "--json", "-")
        assert direct.returncode == 0, direct.stderr
        via = _cli(cmd, str(mine), *extra, "--json", "-", "--force")
        a, b = json.loads(direct.stdout), json.loads(via.stdout)
        for doc in (a, b):
            doc.pop("config"), doc.pop("pngs", None)  # named after each file
        assert a == b, cmd  # the same plan as its meshplan import's
    r = _cli("report", str(MG), *opts, "--out", str(tmp_path / "r.html"))
    assert r.returncode == 0 and (tmp_path / "r.html").stat().st_size > 0, r.stderr
    r = _cli("groups", str(MG))  # the cluster is still needed
    assert r.returncode == 2 and r.stderr.startswith("error: --cluster: a Megatron-LM config does not say the cluster")


@pytest.mark.slow
def test_cli_export_writes_and_refuses(tmp_path):
    out = tmp_path / "seed.args"
    r = _cli("export", str(EX / "seed-64gpu.toml"), "--to", "megatron", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "not expressed in megatron: training.param_dtype: 'fp32' -> 'bf16'" in r.stdout
    assert "--tensor-model-parallel-size 8" in out.read_text().splitlines()
    r = _cli("export", str(EX / "seed-64gpu.toml"), "--to", "deepspeed", "-o", str(tmp_path / "ds.json"))
    assert r.returncode == 2 and r.stderr.startswith("error: --to: a DeepSpeed config applies to ZeRO over one data "
                                                     "axis, without TP/PP/CP/EP or HSDP; this mesh has tp 8")
    assert r.stderr.count("\n") == 1 and not (tmp_path / "ds.json").exists()
    r = _cli("place", str(TT))  # place reads meshplan TOML only (its --format is the bindings')
    assert r.returncode == 2 and r.stderr.startswith(f"error: config: {TT} is a torchtitan config; this command "
                                                     f"reads meshplan TOML: run meshplan import torchtitan")


@pytest.mark.slow
def test_cli_fsdp_axis_note(tmp_path):
    p = tmp_path / "f.toml"
    p.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                 '[training]\nglobal_batch = 8\nseq_len = 4096\n[mesh]\nnames = ["fsdp", "tp"]\nshape = [4, 2]\n')
    r = _cli("groups", str(p), "--rank", "3")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ("note: mesh.names: mesh axis 'fsdp' is planned as 'dp_shard' (torchtitan's fsdp: parameters, "
                        "gradients and optimizer state sharded over it; torchtitan's derived fsdp = dp_shard x cp, "
                        "and cp stays an axis of its own here)\n")
    assert "dp_shard" in r.stdout


# item 6: axis vocabularies ------------------------------------------------------------------

def _mesh_cfg(names, shape, **extra):
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 4096}, "mesh": {"names": names, "shape": shape, **extra}}


def test_fsdp_axis_means_dp_shard_with_a_note():
    a = config_from_dict(_mesh_cfg(["fsdp", "tp"], [4, 2]))
    b = config_from_dict(_mesh_cfg(["dp_shard", "tp"], [4, 2]))
    assert a.mesh == b.mesh and a.notes[0].startswith("mesh.names: mesh axis 'fsdp' is planned as 'dp_shard'")
    assert _outcome(a) == _outcome(b)


def test_close_axis_name_is_an_error_unless_custom():
    with pytest.raises(ConfigError, match=r"^mesh.names: 'tq' is not a standard axis; did you mean 'tp'\? If it is an "
                                          r"axis of your own .* list it in mesh.custom_axes = \['tq'\]"):
        config_from_dict(_mesh_cfg(["dp_shard", "tq"], [4, 2]))
    cfg = config_from_dict(_mesh_cfg(["dp_shard", "tq"], [4, 2], custom_axes=["tq"]))
    assert cfg.mesh.names == ["dp_shard", "tq"] and cfg.notes == ()
    with pytest.raises(ConfigError, match=r"^mesh.order: 'TP' is not a standard axis; did you mean 'tp'\?"):
        config_from_dict({**_mesh_cfg([], []), "mesh": {"order": "TP-dp", "degrees": {"TP": 2, "dp": 4}}})
    with pytest.raises(ConfigError, match=r"^mesh.custom_axes: 'cfg' is not an axis of the mesh"):
        config_from_dict(_mesh_cfg(["dp_shard", "tp"], [4, 2], custom_axes=["cfg"]))


def test_megatron_order_with_fsdp_alias_renames_degrees():
    cfg = config_from_dict({**_mesh_cfg([], []), "mesh": {"order": "tp-fsdp", "degrees": {"tp": 2, "fsdp": 4}}})
    assert (cfg.mesh.order, cfg.mesh.degrees) == ("tp-dp_shard", {"tp": 2, "dp_shard": 4})


def test_vocabularies_map_explicitly():
    from meshplan.spec.axes import KNOWN_AXES, MEGATRON_AXES, TORCHTITAN_AXES
    assert set(TORCHTITAN_AXES) == {"dp_replicate", "dp_shard", "fsdp", "cp", "tp", "pp", "ep", "etp"}
    assert set(MEGATRON_AXES) == {"tp", "cp", "ep", "dp", "pp", "etp"}
    assert set(TORCHTITAN_AXES.values()) | set(MEGATRON_AXES.values()) <= set(KNOWN_AXES)
    assert TORCHTITAN_AXES["fsdp"] == "dp_shard"


@pytest.mark.parametrize("extra,grads,reduce", [({}, "bf16", "bf16"),
                                                ({"data_types": {"grad_accum_dtype": "fp32"},
                                                  "communication_data_type": "fp32"}, "fp32", "fp32")])
def test_deepspeed_zero3_gradient_dtypes(tmp_path, extra, grads, reduce):
    """DeepSpeed's ZeRO-3 (edaa722): the gradient partition in ``data_types.grad_accum_dtype``
    (``stage3.py:742-744``; unset the model's dtype, ``engine.py:1485-1496``), the reduce-scatter in
    ``communication_data_type`` (``stage3.py:1798-1799``; unset the model's, ``engine.py:1405-1417``).
    Llama 3 8B over dp 8: a layer is 4096 x (4096 + 2 x 1024 + 4096) + 3 x 4096 x 14336 + 2 x 4096
    = 218,112,000 elements (every dim a multiple of 8: no FSDP padding), reduce-scattered as
    436,224,000 B in bf16 (872,448,000 B in fp32, FSDP2's default before) a layer: since nc52d in
    ipg buckets of 5e8 elements across layers (comm/deepspeed_ipg.py), 32 layers' worth a
    micro-batch in all, each call in the reduce dtype."""
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}} | extra))
    opts = ImportOptions(cluster="dgx-h100", nodes=1, model="llama3-8b", seq_len=1024)
    cfg = load_any(path, opts=opts)
    assert (cfg.training.grad_dtype, cfg.training.gradient_reduce_dtype) == (grads, reduce)
    layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
    rows = [r for r in build_plan(cfg, memory=False).collectives["stage 0"]
            if r.op == "reduce-scatter" and r.cadence.startswith("every layer (ipg bucket")]
    assert sum(r.size_bytes * r.per_microbatch for r in rows) == 32 * layer * {"bf16": 2, "fp32": 4}[reduce]
    assert {r.dtype for r in rows} == {reduce} and layer == 218_112_000
    text, header = export(cfg, "deepspeed", "x")
    assert not [h for h in header if h.startswith("not expressed")], header
    again = tmp_path / "again.json"
    again.write_text(text)
    assert differences(cfg, load_any(again, "deepspeed", reimport_options(cfg, "deepspeed"))) == []


def test_torch_default_param_dtype_is_what_torchtitan_keeps(tmp_path):
    """Unset param_dtype under framework torch with FSDP2: the plan keeps torchtitan's fp32
    parameters without a master copy (training.dtype "float32", torchtitan/trainer.py builds the
    model in it; bf16 only in FSDP2's MixedPrecisionPolicy), export --to torchtitan writes
    training.dtype "float32" with mixed_precision_param "bfloat16", and the file reads back with
    no difference. Llama 3 8B over dp_shard 8: 8,030,261,248 parameters x (4 + 4 + 8) B / 8."""
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "recompute": "full"},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    assert cfg.training.param_dtype == "fp32" and not cfg.training.keeps_master
    state = build_plan(cfg).state[0]
    assert {i.kind: i.bytes_per_element for i in state.items} == {"params": 4, "grads": 4, "optimizer": 8}
    assert state.total_bytes == 8_030_261_248 * 16 // 8
    text, header = export(cfg, "torchtitan", "dtype")
    assert 'dtype = "float32"' in text and 'mixed_precision_param = "bfloat16"' in text
    out = tmp_path / "x.toml"
    out.write_text(text)
    assert differences(cfg, load_any(out, "torchtitan", reimport_options(cfg, "torchtitan"))) == []
