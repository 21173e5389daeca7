"""The bytes of torchao float8 tensorwise TP that the runtime moves (torchao 6243040, June 2025,
the torchao of torchtitan's 2025-06 async TP runs; the same code at eab345c):

- a float8 GEMM writes its output in the high-precision dtype: ``float8_mm`` passes
  ``output_dtype = a._orig_dtype`` (bf16) to ``torch._scaled_mm`` (``float8_ops.py`` lines
  351-383, 25-79), so its memory roofline counts ``M N`` at 2 B, the operands at 1 B;
- under ``Float8ColwiseParallel`` / ``PrepareFloat8ModuleInput`` / ``Float8RowwiseParallel`` the
  sequence-parallel gathers move Float8Tensors, and torch's ``cat`` of the gathered chunks (dim 1,
  batch > 1) runs on them as ``float8_cat`` over the uint8 ``_data`` (``float8_ops.py`` lines
  252-286): those layout copies are 1 B an element; the scatters stay bf16.

Shapes: Llama 3 8B at tp 8 with 12 sequences of 8,192 tokens a rank (torchtitan's 2025-06 8B
async TP run): M = 98,304 tokens, hidden 4,096, wk's data gradient N = 4,096, K = 1,024 / 8 = 128.
"""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute.float8 import INPUTS
from meshplan.compute.gemm import gemm_time
from meshplan.compute.layer import sp_layout_ops
from meshplan.compute.measured import kernel_data
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import layer_gemms

GPU = "h100-hbm2e-96gb-500w"


def test_float8_gemm_roofline_counts_bf16_output():
    """wk's data gradient, 98,304 x 4,096 x 128 in float8 on the 500 W H100 (memory-bound
    kernels at S12's 2.117 TB/s): operands 98,304 x 128 + 128 x 4,096 = 13,107,200 B, output
    98,304 x 4,096 x 2 B = 805,306,368 B: 818,413,568 B / 2.117e12 B/s = 386.6 us. Its compute
    time at the catalog's rate is far less (2 x 98,304 x 4,096 x 128 = 1.03e11 FLOP at under 1,000
    TFLOP/s: ~0.1 ms), so the roofline sets it. Counting the output at 1 B (before) gave
    415,760,384 B: 196.4 us. The bf16 GEMM of the same shape moves 831,520,768 B (392.8 us):
    float8 saves only its operands' bytes here."""
    bw = kernel_data(GPU).stream_bytes_per_s
    assert bw == pytest.approx(2.117e12, rel=1e-3)
    fp8 = gemm_time(catalog.gpu(GPU), 98304, 4096, 128, "fp8")
    bf16 = gemm_time(catalog.gpu(GPU), 98304, 4096, 128, "bf16")
    assert fp8.seconds == pytest.approx(818_413_568 / bw, rel=1e-9)
    assert fp8.seconds * 1e6 == pytest.approx(386.6, abs=0.1)
    assert bf16.seconds == pytest.approx(831_520_768 / bw, rel=1e-9)


def _workload(fp8: bool, async_tp: str = "") -> Workload:
    f8 = dict(linear_dtype="fp8", float8_gemms=frozenset(INPUTS), fp8_all_gather=True) if fp8 else {}
    return Workload(seq_len=8192, micro_batch=12, tp=8, sp=True, sp_layout_copies=True, async_tp=async_tp, **f8)


@pytest.mark.parametrize("async_tp", ["", "torch"])
def test_sp_gather_copies_move_float8(async_tp):
    """Per layer, vanilla TP: 4 gather copies (forward input, backward output gradient; attention
    and MLP) of 2 x 98,304 x 4,096 x 1 B = 805,306,368 B under float8 tensorwise TP, against
    1,610,612,736 B in bf16; the 4 scatter copies 1,610,612,736 B either way. Async TP: per block
    the returned gathered input (float8) and the output gradient's gather (float8) at
    805,306,368 B, the unfused scatter at 1,610,612,736 B."""
    m = catalog.model("llama3-8b")
    gpu = catalog.gpu(GPU)
    gemms = layer_gemms(m, 8, 98304)
    got = {(o.name, o.phase): o.size_bytes for o in sp_layout_ops(m, gpu, _workload(True, async_tp), gemms)}
    bf16 = {(o.name, o.phase): o.size_bytes for o in sp_layout_ops(m, gpu, _workload(False, async_tp), gemms)}
    assert set(got) == set(bf16) and len(got) == (8 if not async_tp else 6)
    for (name, phase), nb in got.items():
        assert bf16[(name, phase)] == 1_610_612_736
        assert nb == (805_306_368 if "gather" in name else 1_610_612_736), name
