"""``step``'s "Megatron-LM's --log-throughput formula" line and ``--json``
``megatron_throughput_flops_per_s``: the ``throughput per GPU (TFLOP/s/GPU)`` Megatron-LM logs, derived
here by hand from ``num_floating_point_operations`` (NVIDIA/Megatron-LM d98e8a64dd,
``megatron/training/training.py``:802-1388; ``transformer_flops`` 1009-1311: MHA/GQA projections
1141-1162, core attention 1164-1170 and 1309, MLP 1255-1285 with ``ffn_expansion_factor`` 1070, logits
1298-1303; the throughput 3550-3555, printed /1e12 to one decimal at 3578)."""

from __future__ import annotations

import pytest

from configs import job_toml
from cli_run import step_json as _step
from meshplan.compute.flops import megatron_flops_per_iteration
from meshplan.spec.model import ModelSpec

#: Llama-3-70B's shapes at 2 layers (h 8192, 64 heads of 128, 8 query groups, SwiGLU ffn 28,672,
#: vocab 128,256), Megatron-LM, tp 8 on one DGX H100, global batch 8, seq 4096, one micro-batch.
MG = job_toml({"catalog": "llama3-70b", "layers": 2},
              training={"global_batch": 8, "seq_len": 4096, "micro_batch": 8, "framework": "megatron"},
              mesh={"names": ["tp"], "shape": [8], "sequence_parallel": True})

#: The formula's terms by hand for :data:`MG`, every one x 3 (fwd, wgrad, dgrad) x 2 (FMA) = 6:
#: - attention projections per layer per token, 6 (h (q + k + v) + q h) with q = 128 x 64 = 8,192,
#:   k = v = 128 x 8 = 1,024: 6 x (8192 x 10,240 + 8192 x 8192) = 6 x 150,994,944 = 905,969,664;
#: - MLP per layer per token, 6 h ffn x 3 (--swiglu): 6 x 8192 x 28,672 x 3 = 4,227,858,432;
#: - logits per token, 6 h V_padded; --make-vocab-size-divisible-by 128 x tp 8 = 1,024, and
#:   128,256 / 1,024 = 125.25, so V_padded = 126 x 1,024 = 129,024: 6 x 8192 x 129,024 = 6,341,787,648;
#: - per token: 2 x (905,969,664 + 4,227,858,432) + 6,341,787,648 = 16,609,443,840; x B s = 8 x 4096
#:   = 32,768 tokens: 544,258,255,749,120;
#: - core attention, B s^2 x layers x 6 q / 2 (causal) x 2 (QK^T, PV) = 8 x 4096^2 x 2 x 6 x 8192
#:   = 13,194,139,533,312.
#: Total 557,452,395,282,432 FLOP per iteration.
MG_FLOP = 557_452_395_282_432


def _lines(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("Megatron-LM's --log-throughput formula: ")]


def test_terms_by_hand():
    """The docstring's terms of :data:`MG_FLOP` multiplied out, and the function's value at them."""
    proj, mlp, logits = 6 * (8192 * (8192 + 2 * 1024) + 8192 * 8192), 6 * 8192 * 28672 * 3, 6 * 8192 * 129024
    assert (proj, mlp, logits) == (905_969_664, 4_227_858_432, 6_341_787_648)
    assert MG_FLOP == 8 * 4096 * (2 * (proj + mlp) + logits) + 8 * 4096 ** 2 * 2 * 6 * 8192
    model = ModelSpec(layers=2, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, vocab=128256)
    assert megatron_flops_per_iteration(model, 8, 4096, 129024) == MG_FLOP


def test_step_prints_megatron_throughput(tmp_path, capsys):
    """step under framework megatron: --json megatron_throughput_flops_per_s = MG_FLOP / (step_s x 8 GPUs),
    and one line printing it /1e12 to one decimal, as Megatron's log does."""
    doc, out = _step(tmp_path, capsys, MG, "mg")
    want = MG_FLOP / (doc["step_s"] * 8)
    assert doc["megatron_throughput_flops_per_s"] == pytest.approx(want, rel=1e-12)
    lines = _lines(out)
    assert len(lines) == 1, out
    assert lines[0].startswith(f"Megatron-LM's --log-throughput formula: {want / 1e12:.1f} TFLOP/s/GPU ")
    assert f"{MG_FLOP:.4e} FLOP per iteration" in lines[0] and "x 8 GPUs" in lines[0]
    assert doc["torchtitan_mfu"] is None


def test_recompute_not_counted(tmp_path, capsys):
    """Megatron's formula has no recompute term (its factor is 3 whatever --recompute-granularity):
    full recompute lengthens the predicted step but not the FLOP, so the logged throughput falls by
    exactly the ratio of the steps."""
    none, _ = _step(tmp_path, capsys, MG, "none")
    full, _ = _step(tmp_path, capsys, MG.replace("[training]\n", '[training]\nrecompute = "full"\n', 1), "full")
    assert full["step_s"] > none["step_s"]
    ratio = full["megatron_throughput_flops_per_s"] / none["megatron_throughput_flops_per_s"]
    assert ratio == pytest.approx(none["step_s"] / full["step_s"], rel=1e-12)
    assert full["megatron_throughput_flops_per_s"] == pytest.approx(MG_FLOP / (full["step_s"] * 8), rel=1e-12)


def test_torch_plan_has_none(tmp_path, capsys):
    """The same job under framework torch (torchtitan): no Megatron line, --json null (its own
    torchtitan_mfu line instead)."""
    doc, out = _step(tmp_path, capsys, MG.replace('framework = "megatron"', 'framework = "torch"'), "tt")
    assert doc["megatron_throughput_flops_per_s"] is None
    assert _lines(out) == []
    assert doc["torchtitan_mfu"] is not None


def test_moe_and_mla_terms_by_hand():
    """The MoE and MLA branches (training.py:1079-1137, 1255-1285) on a small shape: 3 layers, the first
    dense, h 64, 4 heads, MLA q_lora 24, kv_lora 16, qk_nope 8, qk_rope 4, v 8; SwiGLU ffn 256, 8 experts
    of 32, top-2, 2 shared of 32; padded vocab 128; B 2, s 16.
    - q 24 x (64 + 4 x 12 + 1) = 2,712; kv 16 x (64 + 4 x 16 + 1) + 64 x 4 = 2,320; out 4 x 8 x 64 = 2,048:
      projections 6 x 7,080 = 42,480 per layer per token; core 6 x (4 x 12 / 2 + 4 x 8 / 2) = 240;
    - MLP width 256 x 3 x 1 dense + (32 x 2 x 3 + 64 x 3) x 2 MoE layers = 768 + 768 = 1,536;
      6 x 64 x 1,536 = 589,824 per token;
    - logits 6 x 64 x 128 = 49,152;
    - 32 tokens x (589,824 + 3 x 42,480 + 49,152 = 766,416) = 24,525,312; + 2 x 16^2 x 3 x 240 = 368,640:
      24,893,952."""
    model = ModelSpec(layers=3, hidden=64, ffn=256, q_heads=4, vocab=100, experts=8, top_k=2, expert_ffn=32,
                      shared_experts=2, shared_expert_ffn=32, dense_layers=1, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=24)
    assert megatron_flops_per_iteration(model, 2, 16, 128) == 24_893_952
