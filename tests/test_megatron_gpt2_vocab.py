"""Megatron-LM arguments with every model flag but ``--vocab-size`` and GPT-2's tokenizer: the
vocabulary is GPT-2's 50257 (Radford et al. 2019, 2.2; Megatron-LM's ``_GPT2BPETokenizer`` takes
``len(encoder)`` of gpt2-vocab.json), padded as Megatron-LM pads it (``_vocab_size_with_padding``:
a multiple of ``--make-vocab-size-divisible-by`` x tp). A newcomer's GPT-3 175B launch script,
written the way Megatron-LM's examples write it (``--vocab-file``, ``--merge-file``, no
``--tokenizer-type``: pretrain_gpt.py defaults it to GPT2BPETokenizer), was asked for ``--model``."""

from __future__ import annotations

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from tests.cli_run import run_main

A100x128 = ImportOptions(cluster="dgx-a100", nodes=128)
GPT3_SH = """#!/bin/bash
VOCAB_FILE=gpt2-vocab.json
MERGE_FILE=gpt2-merges.txt
MODEL_ARGS=(
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96
    --seq-length 2048 --max-position-embeddings 2048
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 1536 --bf16 --lr 6.0e-5
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
)
DATA_ARGS=(
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
)
torchrun pretrain_gpt.py ${MODEL_ARGS[@]} ${TRAIN_ARGS[@]} ${DATA_ARGS[@]}
"""
NOTE = ("megatron: --vocab-size not given: GPT-2's vocabulary, 50257 tokens (--vocab-file gpt2-vocab.json, "
        "pretrain_gpt.py's GPT2BPETokenizer), padded as Megatron-LM pads it to 51200 (a multiple of "
        "--make-vocab-size-divisible-by 128 x tp 8)")


def _load(tmp_path, text: str):
    f = tmp_path / "gpt3.sh"
    f.write_text(text)
    return load_any(f, "megatron", A100x128)


def test_gpt3_175b_script_without_vocab_size_plans_gpt2s_vocabulary(tmp_path, capsys):
    cfg = _load(tmp_path, GPT3_SH)
    assert NOTE in cfg.notes
    # the flags and 50257 are Brown et al. 2020's GPT-3 175B, the catalog's gpt3-175b, exactly
    assert "megatron: the model flags give catalog model gpt3-175b exactly" in cfg.notes
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.q_heads, cfg.model.vocab) == (96, 12288, 96, 50257)
    assert cfg.training.vocab_pad_divisor == 128
    assert run_main("plan", tmp_path / "gpt3.sh", "--cluster", "dgx-a100", "--nodes", 128) == 0
    out = capsys.readouterr().out
    # ceil(50257 / 1024) x 1024 = 51200 rows, 6400 per tp rank; the tied embedding's fp32 gradient
    # all-reduce between the first and last stage: 6400 x 12288 x 4 B
    assert "note vocab padded 50257 -> 51200 = ceil(V / (128 * tp 8)) * 1024 (6400 per tp rank)" in out
    assert f"pp step all-reduce {6400 * 12288 * 4:,} B" in out


def test_explicit_tokenizer_type_and_divisor(tmp_path):
    """--tokenizer-type GPT2BPETokenizer names the vocabulary whatever the vocab file's path (here an
    unresolved shell variable); --make-vocab-size-divisible-by 64 x tp 8 = 512: 99 x 512 = 50688."""
    text = GPT3_SH.replace("--vocab-file $VOCAB_FILE", "--vocab-file $VOCAB --tokenizer-type GPT2BPETokenizer "
                           "--make-vocab-size-divisible-by 64")
    cfg = _load(tmp_path, text)
    assert cfg.model.vocab == 50257 and cfg.training.vocab_pad_divisor == 64
    assert ("megatron: --vocab-size not given: GPT-2's vocabulary, 50257 tokens (--tokenizer-type GPT2BPETokenizer, "
            "--vocab-file $VOCAB), padded as Megatron-LM pads it to 50688 (a multiple of "
            "--make-vocab-size-divisible-by 64 x tp 8)") in cfg.notes


def test_a_given_vocab_size_wins_and_other_tokenizers_still_need_it(tmp_path):
    cfg = _load(tmp_path, GPT3_SH.replace("--max-position-embeddings 2048", "--max-position-embeddings 2048 "
                                          "--vocab-size 51200"))
    assert cfg.model.vocab == 51200 and not any("--vocab-size not given" in n for n in cfg.notes)
    hf = GPT3_SH.replace("--vocab-file $VOCAB_FILE", "--vocab-file $VOCAB_FILE --tokenizer-type HuggingFaceTokenizer")
    with pytest.raises(ConfigError, match=r"^--model: the arguments lack the model flag --vocab-size \(Megatron-LM "
                                          r"takes the vocabulary size from its tokenizer"):
        _load(tmp_path, hf)
    other = GPT3_SH.replace("VOCAB_FILE=gpt2-vocab.json", "VOCAB_FILE=my-bpe-vocab.json")
    with pytest.raises(ConfigError, match=r"^--model: the arguments lack the model flag --vocab-size "):
        _load(tmp_path, other)
