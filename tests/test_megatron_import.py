"""Megatron-LM import fidelity (newcomer findings, s22): what Megatron-LM does by default is
what the imported plan plans, and what it refuses is refused.

Sources (NVIDIA/Megatron-LM at d98e8a6): ``TransformerConfig.hidden_dropout`` and
``attention_dropout`` default 0.1 (megatron/core/transformer/transformer_config.py);
``--no-bias-swiglu-fusion`` is a ``store_false`` flag, so ``bias_swiglu_fusion`` is on by
default and becomes ``bias_activation_fusion`` for ``--swiglu``
(megatron/training/arguments.py, argument_utils.py); ``BiasSwiGLUFunction`` saves only its
input for backward (megatron/core/fusions/fused_bias_swiglu.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, reimport_options
from meshplan.interop.foreign import load_any
from meshplan.interop.roundtrip import differences
from meshplan.interop.megatron import write
from meshplan.interop.tomlout import resolved
from meshplan.memory.sizes import layer_act_sizes

A100x128 = ImportOptions(cluster="dgx-a100", nodes=128)
#: GPT-3 175B as the newcomer ran it (tp 8, pp 16, dp 8, interleaved v 2), no dropout flags.
GPT3 = """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --ffn-hidden-size 49152
--seq-length 2048 --max-position-embeddings 2048 --vocab-size 51200
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--num-layers-per-virtual-pipeline-stage 3 --sequence-parallel --recompute-granularity selective
--use-distributed-optimizer --micro-batch-size 1 --global-batch-size 1536 --bf16 --use-flash-attn
"""


def _load(tmp_path, text: str, opts: ImportOptions = A100x128, name: str = "a.args"):
    f = tmp_path / name
    f.write_text(text)
    return load_any(f, "megatron", opts)


def _saved(cfg) -> int:
    return layer_act_sizes(cfg.model, cfg.training, resolved(cfg), cfg.memory).saved


def test_dropout_is_on_by_default_and_off_only_when_both_are_zero(tmp_path):
    on = _load(tmp_path, GPT3)
    assert on.memory.dropout is True
    # newcomer trial 31 #4: dropout planned from Megatron-LM's defaults is said (was: no note at all)
    assert [n for n in on.notes if "--hidden-dropout" in n or "--attention-dropout" in n] == [
        "megatron: --hidden-dropout and --attention-dropout not given: Megatron-LM's default 0.1 each "
        "(TransformerConfig), planned with dropout ([memory] dropout = true: its masks and kernels); Llama-style "
        "runs set --attention-dropout 0 --hidden-dropout 0"]
    off = _load(tmp_path, GPT3 + "--hidden-dropout 0.0 --attention-dropout 0\n")
    assert off.memory.dropout is False
    # the two residual-dropout masks, 1 byte per element of s b h / t (sequence parallel):
    # 2 x 2048 x 12288 / 8 = 6,291,456 B per layer; flash regenerates the attention mask
    assert _saved(on) - _saved(off) == 2 * 2048 * 12288 // 8
    one = _load(tmp_path, GPT3 + "--attention-dropout 0.0\n")
    assert one.memory.dropout is True
    assert ("megatron: --attention-dropout 0.0 but --hidden-dropout 0.1: meshplan has one dropout switch "
            "([memory] dropout), planned on for both") in one.notes


@pytest.mark.parametrize("value", ["1.0", "-0.1", "x"])
def test_dropout_not_a_probability_is_one_line(tmp_path, value):
    with pytest.raises(ConfigError, match=rf"^--hidden-dropout: '{value}' is not a dropout probability; give a "
                                          r"number in \[0, 1\) \(0.0: no dropout\)$"):
        _load(tmp_path, GPT3 + f"--hidden-dropout {value}\n")


@pytest.mark.parametrize("extra", ["", "--hidden-dropout 0.0 --attention-dropout 0.0\n"])
def test_dropout_round_trips_exactly_both_ways(tmp_path, extra):
    cfg = _load(tmp_path, GPT3 + extra)
    args = write(cfg)
    assert ("--hidden-dropout 0.0" in args and "--attention-dropout 0.0" in args) == (not cfg.memory.dropout)
    assert not any("dropout" in a for a in args) or not cfg.memory.dropout
    text, header = export(cfg, "megatron", "test")
    assert not [h for h in header if h.startswith("not expressed")], header
    again = _load(tmp_path, text, reimport_options(cfg, "megatron"), "b.args")
    assert differences(cfg, again) == [] and again.memory == cfg.memory
    assert write(again) == args


#: Llama 3 8B as Megatron-LM runs it (examples/megatron_llama3-8b_16xh100_tp2-pp2.args): tp 2 with SP.
LLAMA = """--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --swiglu --normalization RMSNorm
--position-embedding-type rope --max-position-embeddings 8192 --untie-embeddings-and-output-weights
--disable-bias-linear --vocab-size 128256 --attention-dropout 0.0 --hidden-dropout 0.0
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
--use-distributed-optimizer --recompute-activations --micro-batch-size 1 --global-batch-size 128
--seq-length 8192 --bf16 --use-flash-attn
"""
H100x2 = ImportOptions(cluster="dgx-h100", nodes=2)


def test_fused_swiglu_is_megatron_default_and_saves_three_f_columns(tmp_path):
    fused = _load(tmp_path, LLAMA, H100x2)
    unfused = _load(tmp_path, LLAMA + "--no-bias-swiglu-fusion\n", H100x2)
    assert (fused.memory.fused_glu, unfused.memory.fused_glu) == (None, False)
    assert fused.memory.fused_glu_for(fused.training) and not unfused.memory.fused_glu_for(unfused.training)
    # Korthikanti-style per layer, 2-byte activations, f/t = 14336 / 2 = 7168 columns per rank:
    # unfused gate, SiLU output, up and product 4 x 2 s b f/t; fused fc1 output (2f) and product 3 x 2 s b f/t
    sbf_t = 8192 * 1 * 14336 // 2
    assert _saved(unfused) - _saved(fused) == 2 * sbf_t == 117_440_512
    torch = fused.training.model_copy(update={"framework": "torch"})  # torchtitan: w2(silu(w1 x) * w3 x)
    assert layer_act_sizes(fused.model, torch, resolved(fused), fused.memory).saved == _saved(unfused)
    assert "--no-bias-swiglu-fusion" in write(unfused) and "--no-bias-swiglu-fusion" not in write(fused)
    assert "--no-bias-swiglu-fusion" not in " ".join(unfused.notes)  # read, not listed as unused


#: Mixtral 8x7B on 4 x 8 H100: tp 2 with SP, ep 8 (expert tp defaults to tp 2), dp 16.
MIXTRAL = """--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --swiglu --normalization RMSNorm
--position-embedding-type rope --max-position-embeddings 32768 --untie-embeddings-and-output-weights
--disable-bias-linear --vocab-size 32000 --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8
--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --recompute-activations
--micro-batch-size 1 --global-batch-size 256 --seq-length 4096 --bf16 --use-flash-attn
"""
H100x4 = ImportOptions(cluster="dgx-h100", nodes=4)


def _moe_saved(cfg) -> int:
    return layer_act_sizes(cfg.model, cfg.training, resolved(cfg), cfg.memory, moe=True).saved


def test_capacity_factor_is_read_and_its_absence_is_dropless(tmp_path):
    dropless = _load(tmp_path, MIXTRAL, H100x4)
    assert dropless.training.moe_dropless  # Megatron-LM's default: no capacity factor, nothing dropped
    assert _load(tmp_path, MIXTRAL + "--moe-expert-capacity-factor -1\n", H100x4).training.moe_dropless
    padded = _load(tmp_path, MIXTRAL + "--moe-expert-capacity-factor 1.25 --moe-pad-expert-input-to-capacity\n",
                   H100x4)
    assert (padded.training.moe_dropless, padded.training.moe_capacity_factor) == (None, 1.25)  # dropping at 1.25
    assert not any("capacity" in n for n in padded.notes)
    # the busiest rank's routed rows: T = 4096 tokens (b s etp / tp), k 2, E 8, ep 8, one local expert;
    # dropless balanced T k = 8192; capacity C = ceil(1.25 x 4096 x 2 / 8) = 1280, ep C = 10240 padded rows;
    # per row the fused expert MLP keeps 3 x 2 B x 7168 (expert ffn / etp) plus input and output 2 x 2 B x 4096
    assert _moe_saved(padded) - _moe_saved(dropless) == (10240 - 8192) * (3 * 2 * 7168 + 2 * 2 * 4096)
    unfused = _load(tmp_path, MIXTRAL + "--no-bias-swiglu-fusion\n", H100x4)
    assert _moe_saved(unfused) - _moe_saved(dropless) == 8192 * 2 * 7168  # the fourth f column of each row
    bare = _load(tmp_path, MIXTRAL + "--moe-expert-capacity-factor 1.25\n", H100x4)
    assert bare.training.moe_capacity_factor == 1.25
    assert ("megatron: --moe-expert-capacity-factor 1.25 without --moe-pad-expert-input-to-capacity: Megatron-LM "
            "sends only the routed copies (at most the capacity per expert); planned with the padded experts x "
            "capacity buffer, an upper bound") in bare.notes
    assert not any("--moe-expert-capacity-factor" in n for n in bare.notes if "does not use" in n)


@pytest.mark.parametrize("extra", ["", "--moe-expert-capacity-factor 1.25 --moe-pad-expert-input-to-capacity\n"])
def test_moe_routing_round_trips(tmp_path, extra):
    cfg = _load(tmp_path, MIXTRAL + extra, H100x4)
    text, header = export(cfg, "megatron", "test")
    assert not [h for h in header if h.startswith("not expressed")], header
    again = _load(tmp_path, text, reimport_options(cfg, "megatron"), "b.args")
    assert differences(cfg, again) == [] and again.training == cfg.training


@pytest.mark.parametrize("value", ["0", "x"])
def test_capacity_factor_malformed_is_one_line(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^--moe-expert-capacity-factor: '.*' (is not a number|leaves no capacity)"):
        _load(tmp_path, MIXTRAL + f"--moe-expert-capacity-factor {value}\n", H100x4)


def test_bf16_with_fp16_is_refused_as_megatron_does(tmp_path):
    with pytest.raises(ConfigError, match=r"^--fp16: given with --bf16; Megatron-LM refuses both \(arguments.py "
                                          r"asserts one dtype\): keep one$"):
        _load(tmp_path, GPT3 + "--fp16\n")


def test_sequence_longer_than_learned_positions_is_refused(tmp_path):
    longer = GPT3.replace("--seq-length 2048", "--seq-length 4096")
    with pytest.raises(ConfigError, match=r"^--seq-length: 4096 is more than --max-position-embeddings 2048, the rows "
                                          r"of the learned position table"):
        _load(tmp_path, longer)
    with pytest.raises(ConfigError, match=r"^--seq-len: 8192 is more than --max-position-embeddings 2048"):
        _load(tmp_path, GPT3, ImportOptions(cluster="dgx-a100", nodes=128, seq_len=8192))
    # RoPE has no table: planned, with Megatron-LM's own assertion in a note
    rope = _load(tmp_path, LLAMA.replace("--seq-length 8192", "--seq-length 16384"), H100x2)
    assert rope.training.seq_len == 16384
    assert ("megatron: --seq-length 16384 is more than --max-position-embeddings 8192: planned (RoPE has no table), "
            "but Megatron-LM asserts max_position_embeddings >= seq_length; raise it to run") in rope.notes


def test_json_read_as_megatron_says_it_is_json(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}')
    with pytest.raises(ConfigError, match=rf"^config: {f} is a JSON file \(DeepSpeed\?\), not Megatron-LM arguments: "
                                          rf"use meshplan import deepspeed {f}, or --format deepspeed$"):
        load_any(f, "megatron", A100x128)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "zb_h1", "gpipe"])
def test_megatron_refuses_schedules_it_does_not_have(tmp_path, schedule):
    from meshplan.config import config_from_dict
    from meshplan.plan import build_plan
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.schedule.steptime import step_time
    cfg = _load(tmp_path, GPT3)
    with pytest.raises(ConfigError, match=rf"^--schedule: {schedule} is not a Megatron-LM schedule \(training.framework "
                                          r"\"megatron\" runs 1f1b, or interleaved_1f1b with virtual stages"):
        step_time(build_plan(cfg), Overlap(), schedule=schedule)
    vs = 2 if schedule in ("zbv", "dualpipev") else 1
    tables = {"model": {"catalog": "megatron-175b"}, "cluster": {"system": "dgx-a100", "nodes": 128},
              "training": {"global_batch": 1536, "seq_len": 2048, "sharding": "zero1", "framework": "megatron"},
              "mesh": {"names": ["pp", "dp", "tp"], "shape": [16, 8, 8], "sequence_parallel": True,
                       "pp_schedule": schedule, "virtual_stages": vs}}
    with pytest.raises(ConfigError, match=rf"^mesh.pp_schedule: {schedule} is not a Megatron-LM schedule"):
        build_plan(config_from_dict(tables))
    tables["training"]["framework"] = "torch"  # torch.distributed.pipelining runs it: planned (gpipe: over HBM)
    assert build_plan(config_from_dict(tables)).feasible == (schedule != "gpipe")


def test_selective_recompute_with_flash_replays_the_flash_forward(tmp_path):
    """Megatron-Core checkpoints core_attn under selective granularity whatever the attention
    backend (attention.py ``checkpoint_core_attention``), so the flash forward runs again in
    backward; the plan says so in the recompute policy's words."""
    from meshplan import catalog
    from meshplan.compute.layer import layer_cost
    from meshplan.compute.ops import Workload
    cfg = _load(tmp_path, GPT3)
    assert "flash kernels included: Megatron-Core checkpoints core_attn" in cfg.training.recompute_name
    gpu, model = catalog.gpu("a100-sxm-80gb"), catalog.model("megatron-175b")
    w = Workload(seq_len=2048, tp=8, sp=True, flash=True, recompute="selective")
    extra = layer_cost(model, gpu, w).flops("hardware") - layer_cost(model, gpu, replace(w, recompute="none")).flops(
        "hardware")
    # causal attention forward of 12 local heads: QK^T and PV, 2 x 2 s^2 d a/t FLOP, halved: 12.88 GFLOP
    assert extra == 2 * 2 * 2048 * 2048 * 128 * 12 // 2
