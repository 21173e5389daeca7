"""Transformer Engine fp8 under Megatron-LM (te50): the working set's gathers at 1 B, the fp8 weight cache,
``--fp8-param-gather`` (state, collective table, import/export) and the once-a-step weight casts.

The job: a small dense model, h 64, 4 heads of 16 (4 KV heads), gated MLP f 128, 2 layers, vocab 128, on one
DGX node at tp 2 x dp 4 under framework megatron, ``--fp8-format`` (``linear_dtype = "fp8"``), sequence
parallel, seq 32, micro-batch 2, the distributed optimizer (zero1). A layer's linear weights: wq, wk, wv, wo
4 x 64 x 64 = 16,384, w_gate, w_up, w_down 3 x 64 x 128 = 24,576; 40,960 in all, every dim a multiple of 16
(TE fp8), so 20,480 a rank at tp 2 and 40,960 for the stage's two layers (pp 1): the rank's fp8 weight values.
"""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict

MODEL = {"layers": 2, "hidden": 64, "ffn": 128, "q_heads": 4, "kv_heads": 4, "vocab": 128, "gated_mlp": True}
FP8_VALUES = 2 * (4 * 64 * 64 + 3 * 64 * 128) // 2  # 40,960: two layers' linear weights at tp 2


def _cfg(system: str = "dgx-h100", mesh: dict | None = None, **training):
    t = {"global_batch": 16, "seq_len": 32, "micro_batch": 2, "framework": "megatron", "linear_dtype": "fp8",
         "sharding": "zero1", "vocab_pad_divisor": 1} | training
    return config_from_dict({"model": MODEL, "cluster": {"system": system, "nodes": 1}, "training": t,
                             "mesh": mesh or {"names": ["dp", "tp"], "shape": [4, 2], "sequence_parallel": True}})


def _plan(**kw):
    from meshplan.plan import build_plan
    return build_plan(_cfg(**kw))


def test_working_set_gathers_fp8_under_te():
    """Task 1: under TE's fp8 the layer norm's output is quantized on the sequence shard and gathered as fp8
    (TE d0067d0 layernorm_linear.py:292-313), the output gradient before proj's and fc2's dgrad (base.py
    1718-1749): the working set asks compute.dtensor_sp.fp8_tp_gathers, as the collective table does. The
    rank's full sequence: 32 x 2 = 64 tokens. Forward: the gathered input 64 x 64 values, 4,096 B at 1 B
    (8,192 B in bf16). Backward, mlp w_out: the gathered dY 64 x 64 = 4,096 B + its dX F = 2 B x 64 x
    128 / 2 = 8,192 B: 12,288 B (16,384 B in bf16)."""
    from meshplan.memory.workingset import layer_act_sizes
    from meshplan.plan import build_plan
    for fp8, gathered, w_out in ((True, 4096, 12288), (False, 8192, 16384)):
        cfg = _cfg(**({} if fp8 else {"linear_dtype": None}))
        p = build_plan(cfg)
        a = layer_act_sizes(cfg.model, cfg.training, p.mesh, cfg.memory)
        assert (a.fwd_temp, a.fwd_what) == (gathered, "SP all-gathered input")
        assert {s.name: s.work for s in a.steps}["mlp w_out"] == w_out
