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

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import differences, export, load_any, reimport_options
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
    assert not any("--hidden-dropout" in n or "--attention-dropout" in n for n in on.notes)
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
