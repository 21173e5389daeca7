"""GEMM times from the measured points of the catalog (:class:`meshplan.compute.measured.KernelData`).

The catalog holds measured TFLOP/s at scattered shapes
(A100: Azure cuBLASLt fp16, small cubes 256^3 .. 896^3 of torch.matmul in Triton's matmul
tutorial, kernels.toml "TT", and the non-flash attention's batched GEMMs derived from
FlashAttention-2's PyTorch-attention benchmark, kernels.toml "D S7a"; H100: XLA's measured
sm_90 table; H200: H100's bf16 points; Meta's 500 W HBM2e H100: H100's bf16 points x 0.797, the
ratio of torch.matmul measured on it to that table, ``gemm_scale``; fp8: Azure cuBLASLt). The ml-engineering MAMF values are not nodes: each is the maximum over a
sweep of shapes in short runs, the GPU's ceiling (``gpus.toml`` ``max_gemm_fraction``), and as a
node it would lend its neighbours the best shape's speed. A shape between them is interpolated by
inverse-distance weighting (Shepard's method) in log2 space of (M, N, K): the 4 nearest points,
weight ``1 / d^2``; a measured shape returns its own value; the result stays within the range of
those 4 points (never extrapolated beyond the measured maximum).

Below the measured points (:func:`gemm_tflops`): a query smaller than every point of its dtype in
M, N or K is not read flat off its neighbours (the interpolation never goes below them, and
small, narrow shapes run far below larger ones: tile and wave quantization, the memory
roofline). It is taken to the edge of the measured box, ``e = (max(M, min M), max(N, min N),
max(K, min K))`` over the points, interpolated there, and scaled by the shape model's ratio
``min(1, eff(query) / eff(e))``, ``eff`` its efficiency without the memory roofline
(:func:`meshplan.compute.gemm.compute_efficiency`: tile and wave quantization, on the GPU the
points were measured on); the roofline then comes once, at measured bandwidth
(:func:`gemm_seconds`), not twice. Why this and not ``min(table, model)``: the model leaves out
split-K and stream-K kernels, so on few-tile, long-K shapes it is below what is measured
(H100 512x256x4096: 92.2 TFLOP/s measured, S4; the model 48.2), and the min would throw the
measurement away just where the model is weakest; the ratio keeps the measured level at the
edge and takes from the model only how that level falls as the shape shrinks, which is what it
does model. Why the edge of the box and not the nearest measured point: which point is nearest
changes as the query moves, and the rate would jump there; at the edge the rule meets the
table (ratio 1), and below it the rate falls as the model's efficiency does. Capped at 1:
never above what was measured at the edge. A K below the points scales by 1 (the tiles' waves
do not depend on K): such a GEMM is bound by its bytes, which the roofline times. A batched GEMM
below in N or K alone, at a head dim the GPU's ``bmm_head_dim`` table covers (A100: the attention's
QK^T and PV at head dim 64-128, kernels.toml "AC24"), takes that measured ratio instead of the model's.

A grouped call of ``count``
GEMMs is looked up as one GEMM of ``(count M, N, K)`` (the same tiles in more waves); off the
one M its nearest points were measured at, on their plane x the shape model's ratio
(:func:`_batched_plane`). The time
is ``max(2 M N K count / rate, bytes / achievable bandwidth)`` with ``bytes = dtype (M K + K N
+ M N) count``: interpolating between compute-bound points must not beat the memory roofline.

>>> from meshplan import catalog
>>> from meshplan.compute.gemm import compute_efficiency
>>> d = kernel_data("a100-sxm-80gb")
>>> eff = lambda m, n, k: compute_efficiency(catalog.gpu("a100-sxm-80gb"), m, n, k)
>>> gemm_tflops(d, 4096, 4096, 4096, "bf16", eff)[0]   # a measured shape (S3)
228.0
>>> round(gemm_tflops(d, 8192, 3072, 6144, "bf16", eff)[0], 1)  # 22B fc1 at tp 8, b 4: between the cubes
238.5
"""

from __future__ import annotations

from math import log2
from typing import Callable, Optional

from meshplan import catalog  # noqa: F401  (the doctests' catalog)
from meshplan.compute.measured import KernelData, kernel_data  # noqa: F401  (kernel_data: the doctests')
from meshplan.units import TFLOPS, dtype_bytes

NEIGHBOURS = 4  # Shepard interpolation: nearest points used
POWER = 2  # inverse-distance weight exponent


def gemm_tflops(data: KernelData, m: int, n: int, k: int, dtype: str,
                model: Callable[[int, int, int], float], batched: bool = False) -> tuple[float, str]:
    """(TFLOP/s, how) of one (M, N, K) GEMM from ``data``'s points for ``dtype``: interpolated
    inside the measured box, and below it (smaller than every point in M, N or K) the box edge's
    rate x ``min(1, model(M, N, K) / model(edge))``, ``model`` the shape model's efficiency
    without its memory roofline (:func:`meshplan.compute.gemm.compute_efficiency`; module
    docstring). ``batched`` (a batch of GEMMs looked up as one) below the points in N or K
    alone, at a head dim the GPU's ``bmm_head_dim`` table covers: its measured ratio instead
    (:func:`_head_dim_ratio`). Raises KeyError when there are no points for ``dtype``. Not memoised
    here: its one caller in the flow, :func:`meshplan.compute.gemm.gemm_time`, memoises the
    whole estimate above it (``_catalog_time``)."""
    pts = data.gemm[dtype]
    edge = tuple(max(q, min(p[i] for p in pts)) for i, q in enumerate((m, n, k)))
    rate, how = _batched_plane(pts, edge, model) if batched else _interpolate(pts, *edge)
    if edge == (m, n, k):
        return rate, how
    measured = _head_dim_ratio(data, (m, n, k), edge) if batched else None
    ratio, by = measured or (min(1.0, model(m, n, k) / model(*edge)), "shape model, capped at 1")
    below = "/".join(a for a, q, e in zip("MNK", (m, n, k), edge) if q < e)
    return rate * ratio, (f"{rate * ratio:.1f} TFLOP/s: {m}x{n}x{k} is below the measured {below}; "
                          f"x{ratio:.3f} ({by}) of {edge[0]}x{edge[1]}x{edge[2]}: {how}")


def _head_dim_ratio(data: KernelData, shape: tuple[int, int, int],
                    edge: tuple[int, int, int]) -> Optional[tuple[float, str]]:
    """(ratio, how) for a batched GEMM ``shape`` below the measured ``edge`` in N alone (PV-like,
    N = head dim: the table's ``aov`` column) or K alone (QK^T-like, K = head dim: ``kq``), when
    ``data.bmm_head_dim`` covers that head dim and its last head dim is the edge; else None (the
    shape model's ratio applies). Capped at 1."""
    t = data.bmm_head_dim
    below = [i for i in range(3) if shape[i] < edge[i]]
    if t is None or len(below) != 1 or below[0] == 0:
        return None
    i = below[0]
    if not (t.head_dim[0] <= shape[i] and edge[i] == t.head_dim[-1]):
        return None
    column = "aov" if i == 1 else "kq"
    return (min(1.0, t.ratio(column, shape[i])),
            f"measured head-dim ratio, {'N' if i == 1 else 'K'} {shape[i]} of {edge[i]}: {t.source.split(' (')[0]}")


def _batched_plane(pts, shape: tuple[int, int, int], model: Callable[[int, int, int], float]) -> tuple[float, str]:
    """(TFLOP/s, how) of a batched GEMM ``shape`` = (count M, N, K): :func:`_interpolate`, unless its
    :data:`NEIGHBOURS` nearest points' (N, K) were measured at one M0 alone, not its own (one batch
    count: A100 "D S7a", M0 262,144 at every S). Off that plane Shepard's weights flatten toward the
    points' mean (22B: 32 batches of 2048x2048x128 at 86.5 TFLOP/s, 128 of them measured at 93.0),
    so: the plane at (M0, N, K) x ``min(1, model(shape) / model(M0, N, K))``, the waves of the same
    tiles, as below the box.

    >>> from meshplan.compute.gemm import compute_efficiency
    >>> pts = kernel_data("a100-sxm-80gb").gemm["bf16"]
    >>> eff = lambda m, n, k: compute_efficiency(catalog.gpu("a100-sxm-80gb"), m, n, k)
    >>> _batched_plane(pts, (65536, 2048, 128), eff)[0]   # 4,096 tiles in 38 waves, as 16,384 in 152
    93.0
    >>> round(_batched_plane(pts, (65536, 128, 2048), eff)[0], 2)   # 512 tiles in 5 waves of 108 SMs
    88.35
    """
    near = {(p[1], p[2]) for _, p in _nearest(pts, *shape)}
    planes = {p[0] for p in pts if (p[1], p[2]) in near}   # every M their (N, K) were measured at
    if len(planes) != 1 or shape[0] in planes:
        return _interpolate(pts, *shape)
    m0 = planes.pop()
    rate, how = _interpolate([p for p in pts if p[0] == m0], m0, shape[1], shape[2])   # on the plane alone
    ratio = min(1.0, model(*shape) / model(m0, shape[1], shape[2]))
    return rate * ratio, (f"{rate * ratio:.1f} TFLOP/s: x{ratio:.3f} (shape model, batch M {shape[0]} off the "
                          f"points' plane M {m0}, capped at 1) of {m0}x{shape[1]}x{shape[2]}: {how}")


def _nearest(pts, m: int, n: int, k: int) -> list:
    """The :data:`NEIGHBOURS` points nearest (m, n, k) in log2 space, as (distance, point), nearest first."""
    q = (log2(m), log2(n), log2(k))
    return sorted(((sum((a - log2(b)) ** 2 for a, b in zip(q, p[:3])) ** 0.5, p) for p in pts),
                  key=lambda x: x[0])[:NEIGHBOURS]


def _interpolate(pts, m: int, n: int, k: int) -> tuple[float, str]:
    """Shepard interpolation of ``pts`` (M, N, K, TFLOP/s, source) at (m, n, k), log2 axes."""
    dist = _nearest(pts, m, n, k)
    if dist[0][0] < 1e-9:
        p = dist[0][1]
        return float(p[3]), f"measured {p[3]:g} TFLOP/s at {m}x{n}x{k} [{p[4]}]"
    w = [1.0 / d ** POWER for d, _ in dist]
    rate = sum(wi * p[3] for wi, (_, p) in zip(w, dist)) / sum(w)
    near = ", ".join(f"{p[0]}x{p[1]}x{p[2]} {p[3]:g} [{p[4]}]" for _, p in dist)
    return rate, f"{rate:.1f} TFLOP/s interpolated (Shepard, log2 M,N,K) from {near}"


#: Bytes of an output element by operand dtype where the output is wider than the operands: a
#: float8 GEMM writes the high-precision dtype (bf16). torchao's ``float8_mm`` passes
#: ``output_dtype = a._orig_dtype`` to ``torch._scaled_mm(..., out_dtype=output_dtype)``
#: (pytorch/ao 6243040, June 2025, ``torchao/float8/float8_ops.py`` lines 351-383 and 25-79;
#: eab345c: ``float8_ops.py`` line 283, ``float8_python_api.py`` line 66); Transformer
#: Engine's fp8 GEMMs also write the activation dtype.
OUTPUT_BYTES = {"fp8": 2}


def gemm_bytes(m: int, n: int, k: int, dtype: str, count: int = 1) -> int:
    """HBM bytes of ``count`` (M, N, K) GEMMs, each operand read once and the output written
    once: ``dtype`` bytes for ``M K + K N``, :data:`OUTPUT_BYTES` (else ``dtype``'s) for ``M N``.
    A float8 GEMM of Llama 3 8B's wk data gradient at tp 8 (M 98,304 tokens, N 4,096, K 128):
    the 805 MB bf16 output is most of its traffic.

    >>> gemm_bytes(98304, 4096, 128, "fp8"), gemm_bytes(98304, 4096, 128, "bf16")
    (818413568, 831520768)
    """
    return (dtype_bytes(dtype) * (m * k + k * n) + OUTPUT_BYTES.get(dtype, dtype_bytes(dtype)) * m * n) * count


def gemm_seconds(data: KernelData, m: int, n: int, k: int, dtype: str, count: int,
                 model: Callable[[int, int, int], float]) -> tuple[float, str]:
    """Seconds of ``count`` (M, N, K) GEMMs: :func:`gemm_tflops` at ``(count M, N, K)``
    (``model``: the shape model's efficiency of one such GEMM; ``count > 1`` is a batched GEMM,
    which reads the GPU's measured head-dim ratio where it has one), no faster than the memory
    roofline at Triad bandwidth (:func:`gemm_bytes`: a float8 GEMM's output in bf16)."""
    rate, how = gemm_tflops(data, m * count, n, k, dtype, model, batched=count > 1)
    t_compute = 2.0 * m * n * k * count / (rate * TFLOPS)
    t_memory = gemm_bytes(m, n, k, dtype, count) / data.stream_bytes_per_s
    if t_memory > t_compute:
        return t_memory, how + f"; memory-bound at {data.stream_bytes_per_s / 1e12:.2f} TB/s (Triad)"
    return t_compute, how
