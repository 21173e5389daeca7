"""How one kernel of the compute model is timed (:mod:`meshplan.compute.ops`' conventions):
the host's issue floor under every kernel (:func:`issue_floor`), a memory-bound kernel's bytes
at the achievable bandwidth (:func:`memory_op`, :func:`optimizer_bandwidth`), and a GEMM's
forward, data-gradient and weight-gradient ops (:func:`gemm_ops`; Megatron-LM's fp32 main-grad
accumulation :func:`wgrad_accumulate_s` and fused QKV :func:`qkv_fused_ops`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute import asynctp
from meshplan.compute.gemm import gemm_time
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.measured import bandwidth, memory_kernel_seconds
from meshplan.compute.ops import Op, PHASES, Workload
from meshplan.compute.shapes import Gemm, backward_gemms, fused_qkv_gemm
from meshplan.spec.cluster import GPUSpec
from meshplan.units import dtype_bytes


def issue_floor(gpu: GPUSpec, seconds: float) -> float:
    """A kernel's time on the step: ``max(kernel seconds, host issue floor)`` (catalog
    ``host.kernel_issue_s``, :mod:`meshplan.compute.measured`); unchanged for a GPU without
    catalog measurements."""
    data = kernel_data(gpu)
    return seconds if data is None else max(seconds, data.kernel_issue_s)


def memory_op(gpu: GPUSpec, name: str, block: str, phase: str, nbytes: float, recompute=False,
         kind: str = "elementwise") -> Op:
    """A memory-bound kernel: :func:`meshplan.compute.measured.memory_kernel_seconds` of its
    bytes for ``kind`` (a norm's fitted fixed time + bytes at its fitted bandwidth, else Triad,
    never below the issue floor), or the datasheet bandwidth for a GPU without catalog data."""
    data = kernel_data(gpu)
    t = memory_op_seconds(gpu, nbytes, kind)
    if data is None:
        bw, what = gpu.hbm_bandwidth_bytes_per_s, "datasheet"
    else:
        bw = bandwidth(data, kind)
        what = f"fused norm, + {data.norm_fixed_s * 1e6:.1f} us" if kind == "norm" else "Triad"
    return Op(name, block, phase, "memory", t, size_bytes=nbytes, recompute=recompute,
              note=f"{nbytes / 1e6:.1f} MB / {bw / 1e12:.3g} TB/s ({what})")


def memory_op_seconds(gpu: GPUSpec, nbytes: float, kind: str = "elementwise") -> float:
    """The seconds :func:`memory_op` gives a memory-bound kernel of ``nbytes`` (read + written):
    :func:`meshplan.compute.measured.memory_kernel_seconds` on ``gpu``'s catalog data."""
    return memory_kernel_seconds(kernel_data(gpu), nbytes, gpu.hbm_bandwidth_bytes_per_s, kind)


def optimizer_bandwidth(gpu: GPUSpec) -> float:
    """Bandwidth (B/s) of the fused optimizer step, which streams its state's bytes
    (:func:`meshplan.schedule.optimizer_step.optimizer_step_s`): the catalog's BabelStream Triad
    (multi-tensor Adam reads and writes several arrays per element; S12's fused AdamW on H100,
    ~2.1 TB/s, is below Triad 2.97), or the datasheet bandwidth for a GPU without catalog data.

    >>> from meshplan import catalog
    >>> optimizer_bandwidth(catalog.gpu("a100-sxm-80gb")) / 1e12  # not the 2.039 TB/s datasheet
    1.7
    """
    data = kernel_data(gpu)
    return gpu.hbm_bandwidth_bytes_per_s if data is None else data.stream_bytes_per_s


def gemm_ops(gpu: GPUSpec, g: Gemm, block: str, w: Workload, table, model_scale: float = 1.0,
              weight: bool = True, backward: Optional[list[Gemm]] = None) -> list[Op]:
    """Forward, data-gradient and weight-gradient ops of ``g`` (``backward``: the two gradient
    GEMMs, default :func:`~meshplan.compute.shapes.backward_gemms`); ``model_scale`` scales the
    model FLOP (replicated KV heads, padded vocabulary). With ``w.fp32_wgrad_accumulation``
    the weight gradient of a ``weight`` (not the attention scores' batched products, whose
    second operand is an activation) is :func:`wgrad_accumulate_s`'s."""
    out = []
    dtype = w.gemm_dtype(g.name)  # float8 Linears: fp8 forward, data- and weight-gradient GEMMs
    for gg, phase in zip([g] + (backward or backward_gemms(g)), PHASES):
        n = asynctp.pieces(w.async_tp, w.tp, gg.name, phase, w.plain_tp_float8 and dtype == "fp8") if w.sp else 0
        if n:  # async TP: n GEMMs of M / n rows, each at its own shape (and launch floor)
            e = gemm_time(gpu, asynctp.piece_rows(gg.m, n), gg.n, gg.k, dtype, gg.count, table)
            slow = no_fast_accum_factor(gpu, dtype, phase, w, e.source)
            t = n * issue_floor(gpu, e.seconds * slow * asynctp.sm_margin(w.async_tp, gg.name, phase, gpu.sms))
            out.append(Op(gg.name, block, phase, "gemm", t, gg.flops * model_scale, gg.flops,
                          note=f"async TP ({w.async_tp}): {n} pieces of {e.explanation}",
                          table_key=(asynctp.piece_rows(gg.m, n), gg.n, gg.k, dtype)))
            continue
        e = gemm_time(gpu, gg.m, gg.n, gg.k, dtype, gg.count, table)
        slow = no_fast_accum_factor(gpu, dtype, phase, w, e.source)
        t, note = e.seconds * slow, e.explanation + (f"; x{slow:g}: no fast accumulation" if slow != 1.0 else "")
        if phase == "backward_weight" and w.fp32_wgrad_accumulation and weight:
            t, how = wgrad_accumulate_s(gpu, gg, dtype, t)
            note += how
        out.append(Op(gg.name, block, phase, "gemm", issue_floor(gpu, t), gg.flops * model_scale,
                      gg.flops, note=note, table_key=(gg.m, gg.n, gg.k, dtype)))
    return out


def no_fast_accum_factor(gpu: GPUSpec, dtype: str, phase: str, w: Workload, source: str) -> float:
    """Time factor of a float8 GEMM of ``phase`` that runs without fast accumulation, against the
    catalog's fp8 points (``source`` "catalog"), which were timed with it: the cuBLASLt rows (S3,
    Azure AI-benchmarking-guide's ``cublaslt_gemm`` of superbenchmark, whose ``cublasLtGemm::Setup``
    sets ``CUBLASLT_MATMUL_DESC_FAST_ACCUM`` to 1 for fp8 operands). torchao's float8 Linears run
    the data- and weight-gradient GEMMs without it in both recipes (pytorch/ao fdddb2c and eab345c
    ``torchao/float8/config.py``: ``gemm_config_output = Float8GemmConfig(use_fast_accum=True)``,
    ``gemm_config_grad_input`` and ``gemm_config_grad_weight`` default ``use_fast_accum=False``),
    so those two take the GPU's measured factor (kernels.toml ``fp8_no_fast_accum_slowdown``; 1
    where not measured); the forward GEMM, a user's measured GEMM (``source`` "measured") and
    Megatron-LM's Transformer Engine GEMMs (``w.megatron_ops``: not checked here) take 1.

    >>> from meshplan import catalog
    >>> w = Workload(seq_len=8192, micro_batch=1, linear_dtype="fp8", float8_gemms=frozenset({"wq"}))
    >>> part = catalog.gpu("h100-hbm2e-96gb-500w")
    >>> [no_fast_accum_factor(part, "fp8", p, w, "catalog") for p in PHASES]
    [1.0, 1.286, 1.286]
    >>> no_fast_accum_factor(part, "bf16", "backward_input", w, "catalog"), no_fast_accum_factor(part, "fp8", "backward_input", w, "measured")
    (1.0, 1.0)
    """
    if dtype != "fp8" or phase == "forward" or source != "catalog" or w.megatron_ops:
        return 1.0
    data = kernel_data(gpu)
    return 1.0 if data is None else data.fp8_no_fast_accum


def wgrad_accumulate_s(gpu: GPUSpec, wgrad: Gemm, dtype: str, gemm_s: float) -> tuple[float, str]:
    """(seconds, note) of a weight-gradient GEMM (M = out features, N = in features, K =
    tokens) that accumulates into an fp32 main gradient: Megatron-LM's
    ``gradient_accumulation_fusion`` (``--no-gradient-accumulation-fusion`` turns it off; on by
    default in 2022, with fp32 gradient accumulation: ``megatron/mpu/layers.py``
    ``fused_dense_cuda.wgrad_gemm_accum_fp32(input, grad_output, weight.main_grad)``, a cuBLAS
    GEMM with beta 1 and an fp32 C). Its HBM traffic is the operands in ``dtype`` and C read
    and written in fp32 (8 B per weight element per micro-batch, in place of the 16-bit
    output's 2 B); time ``max(gemm_s, bytes / achievable bandwidth)``, the roofline
    :mod:`meshplan.compute.measured` applies to every GEMM (Triad, or the datasheet bandwidth
    for a GPU without catalog data: :func:`optimizer_bandwidth`).

    >>> from meshplan import catalog
    >>> a100 = catalog.gpu("a100-sxm-80gb")
    >>> g = Gemm("w.wgrad", 1024, 1024, 256)   # 2 (1024*256*2) + 8 * 1024^2 B at Triad 1.7 TB/s
    >>> t, _ = wgrad_accumulate_s(a100, g, "bf16", 1e-6)
    >>> round(t * 1e6, 3), round((2 * 2 * 1024 * 256 + 8 * 1024 * 1024) / 1.7e12 * 1e6, 3)
    (5.551, 5.551)
    """
    nbytes = (dtype_bytes(dtype) * (wgrad.m * wgrad.k + wgrad.k * wgrad.n) + 8 * wgrad.m * wgrad.n) * wgrad.count
    t_mem = nbytes / optimizer_bandwidth(gpu)
    if t_mem > gemm_s:
        return t_mem, f"; fp32 main-grad accumulate: memory-bound, {nbytes / 1e6:.1f} MB"
    return gemm_s, "; fp32 main-grad accumulate (C read + written in fp32: compute-bound)"


def qkv_fused_ops(gpu: GPUSpec, gemms: list[Gemm], w: Workload, table, scales: dict) -> list[Op]:
    """The Q, K and V projections as one column-parallel GEMM of width ``(q + 2 kv) d / tp``
    (Megatron-LM's GPT ``ParallelAttention.query_key_value``, one ``ColumnParallelLinear``:
    ``megatron/model/transformer.py``; torchtitan b5bcd76's ``FusedQKVLinear``, one ``wqkv``
    ColwiseParallel Linear, ``models/common/attention.py`` 722-810, its one ``self.wqkv(x)`` at line
    771), its forward, data-gradient and weight-gradient GEMMs
    timed once; each pass's time is shared among the wq, wk, wv ops by their widths (the ops
    keep their names for the timeline's CP split and the column-parallel input gradients).
    ``gemms``: the wq, wk, wv Gemms (same M and K); ``scales``: model-FLOP scale by name."""
    fused = fused_qkv_gemm(gemms)
    whole = gemm_ops(gpu, fused, "attn", w, table)
    out = []
    for g in gemms:
        share = g.n / fused.n
        for gg, op in zip([g] + backward_gemms(g), whole):
            out.append(Op(gg.name, "attn", op.phase, "gemm", op.seconds * share, gg.flops * scales.get(g.name, 1.0),
                          gg.flops, note=f"{share:.0%} of fused QKV: {op.note}", table_key=op.table_key))
    return out
