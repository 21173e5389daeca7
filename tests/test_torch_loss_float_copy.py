"""torch's eager loss upcasts the logits with ``pred.float()``, whose copy is fp32 whatever
``memory.logits_dtype`` states (``Tensor.float()`` is ``self.to(torch.float32)``)."""

from __future__ import annotations

from meshplan.memory.workingset import head_sizes
from tests.test_memory_timeline import MEM, plan_of


def _logits_temp(logits_dtype: str) -> int:
    p = plan_of(memory={**MEM, "cross_entropy": "torch", "logits_dtype": logits_dtype})
    cfg = p.config
    return head_sizes(cfg.model, cfg.training, p.mesh, cfg.memory)["logits_temp"]


def test_float_copy_is_fp32_under_bf16_logits_dtype():
    """The tiny plan (tests/test_memory_timeline.py): 8 tokens a micro-batch (seq 8, micro 1),
    vocabulary 128, tp 1, bf16 compute. The loss's forward transients: the GEMM's bf16 logits
    2 x 8 x 128 = 2,048 B and their ``.float()`` copy 4 x 8 x 128 = 4,096 B, 6,144 B with
    ``logits_dtype`` bf16 as with fp32 (before the fix the copy was sized at the kept dtype's 2 B:
    4,096 B)."""
    assert _logits_temp("bf16") == 2 * 8 * 128 + 4 * 8 * 128 == 6144
    assert _logits_temp("fp32") == 6144
