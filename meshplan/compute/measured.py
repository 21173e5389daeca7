"""Kernel times from measurements shipped in the catalog (``meshplan/catalog/kernels.toml``):
GEMM throughput over (M, N, K), fused attention throughput, achievable HBM bandwidth and
fixed overheads of one GPU, each point with its source.

**GEMM**: the catalog's measured points over (M, N, K), read by :mod:`meshplan.compute.gemm_points`
(interpolation, below the points, batched GEMMs).

**Attention** (:func:`attention_seconds`): the FlashAttention benchmark's rates by pass, mask,
head dim and sequence length, FLOP convention of flash-attention's
``benchmarks/benchmark_flash_attention.py``: forward ``4 B S_q S_kv H d`` (H query heads),
halved when causal; backward 2.5x forward. The first kernel of the GPU's ``prefer`` list with a
row for the pass is used (a row of the same mask, else one whose mask the source does not name),
its nearest head dim (log2), rate linear in log2(S_kv) between the measured lengths and clamped
at the ends. Where a kernel only has fwd+bwd rates (FA2 on A100), forward and backward are
timed at that one rate (time split by FLOP, 1 : 2.5).

**Memory-bound kernels** (:func:`memory_seconds`): a norm takes ``fixed + bytes / bandwidth``,
both fitted by least squares (:func:`fit_norm`) to the catalog's fused-norm kernel times (Liger
RMSNorm at several hidden sizes, ``bytes = 2 x rows x H x 2 B``): the bytes carry rows and hidden
alike, so a norm over 8,192 rows is not timed at the bandwidth of 2,048. Other elementwise
kernels and the optimizer stream at BabelStream Triad.

>>> d = kernel_data("a100-sxm-80gb")
>>> round(d.norm_fixed_s * 1e6, 2), round(d.norm_bytes_per_s / 1e12, 3)   # S11, 2048 rows
(8.76, 1.547)
>>> round(memory_seconds(d, 2 * 8192 * 6144 * 2, "norm") * 1e6, 1)   # 22B norm, 8192 rows: us
138.9

One memory-bound kernel on the step (:func:`memory_kernel_seconds`, the one rule the layer's ops
and FSDP2's copies share): :func:`memory_seconds`, never below the issue floor; the datasheet
HBM bandwidth for a GPU without catalog data.

**Overheads**: ``kernel_issue_s`` is the host's issue floor per eager kernel (a kernel shorter
than it runs at the host's rate); ``dtensor_tp_block_s``: the host's (forward, backward) pace of
one transformer block under eager DTensor tensor parallelism (kernels.toml ``[host]``, M1), which
the unit timelines hold the device to (:class:`meshplan.schedule.unit_sim.StreamSim`). A micro-batch's own transfers (the batch's copy to the GPU,
Megatron-LM's tp broadcasts) are timed from the node's links: :mod:`meshplan.compute.batch_input`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import log2
from typing import Optional

from meshplan import catalog
from meshplan.compute.attention_points import below_rows
from meshplan.compute.shapes import Attention
from meshplan.units import TFLOPS

#: Where the catalog's host pace (``dtensor_tp_block_s``) comes from, as the ``host:`` line says it;
#: a ``--kernels`` file's ``[host]`` replaces it (:func:`meshplan.compute.kernel_fragment.with_fragment`).
CATALOG_HOST_PACE = "measured on the H200 machine's host, torch 2.11: kernels.toml [host], M1"


def host_pace_label(source: str) -> str:
    """``source`` (a :attr:`KernelData.dtensor_tp_source`) as a short line names it: the catalog's
    as ``kernels.toml [host]``, a kernels file's as itself (``your kernels file FILE``)."""
    return "kernels.toml [host]" if source == CATALOG_HOST_PACE else source


@dataclass(frozen=True)
class AttentionRow:
    """Measured fused-attention TFLOP/s of ``kernel`` for ``pass_`` (fwd, bwd or fwd+bwd),
    ``mask`` (none, causal or any) and ``head_dim`` at each of ``seq`` lengths."""

    kernel: str
    pass_: str
    mask: str
    head_dim: int
    seq: tuple[int, ...]
    tflops: tuple[float, ...]
    source: str
    dtype: str = "bf16"  # the row's input dtype; absent in a row = bf16 (backwards compatible)


@dataclass(frozen=True)
class BmmHeadDim:
    """Measured TFLOP/s of the attention's batched GEMMs at head dims ``head_dim`` (ascending, the
    last the reference): ``kq`` QK^T (K = d), ``aov`` PV (N = d), one batch and sequence length
    (kernels.toml ``bmm_head_dim``). Only their ratio to the last head dim is used."""

    head_dim: tuple[int, ...]
    kq: tuple[float, ...]
    aov: tuple[float, ...]
    source: str

    def ratio(self, column: str, d: int) -> float:
        """``column``'s (``"kq"`` or ``"aov"``) rate at head dim ``d`` over its rate at the last
        head dim, linear in log2(d) between the measured ones (clamped at the ends).

        >>> t = BmmHeadDim((64, 128), (50.0, 100.0), (40.0, 80.0), "x")
        >>> t.ratio("kq", 64), round(t.ratio("aov", 96), 3)
        (0.5, 0.792)
        """
        ys = getattr(self, column)
        return _interp_log(self.head_dim, [y / ys[-1] for y in ys], d)


@dataclass(frozen=True)
class KernelData:
    """One GPU's measured kernel data (see the module docstring); bandwidths in B/s. ``first``:
    kernels whose rows were measured on the user's GPU for this run (``--kernels``,
    :func:`meshplan.compute.kernel_fragment.with_fragment`), tried before any other, the
    framework's choice included: torch's SDPA timed on the GPU is what the framework runs there.
    ``copy_engine_gemm``: (slowdown, seconds a call) of async TP's GEMMs beside copy-engine pulls,
    measured on this GPU (kernels.toml ``copy_engine_gemm_slowdown``, ``copy_engine_call_s``;
    :func:`meshplan.compute.asynctp.copy_engine_terms`), (0, 0) where not measured.
    ``fp8_no_fast_accum``: the time factor of a float8 GEMM run without fast accumulation against
    this GPU's fp8 points, which were timed with it (kernels.toml ``fp8_no_fast_accum_slowdown``;
    :func:`meshplan.compute.kernel_time.no_fast_accum_factor`), 1 where not measured."""

    gpu: str
    gemm: dict
    attention: tuple[AttentionRow, ...]
    prefer: tuple[str, ...]
    stream_bytes_per_s: float
    norm_fixed_s: float
    norm_bytes_per_s: float
    kernel_issue_s: float
    source: str
    first: tuple[str, ...] = ()
    dtensor_tp_block_s: tuple[float, float] = (0.0, 0.0)
    dtensor_tp_source: str = CATALOG_HOST_PACE
    bmm_head_dim: Optional[BmmHeadDim] = None
    copy_engine_gemm: tuple[float, float] = (0.0, 0.0)
    fp8_no_fast_accum: float = 1.0


@lru_cache(maxsize=None)
def kernel_data(gpu_name: str) -> Optional[KernelData]:
    """The catalog's measured kernel data of ``gpu_name``, or None when it has none."""
    raw = catalog.kernel_data(gpu_name)
    if raw is None:
        return None
    g = raw.get("gemm", {})  # a string value names another dtype's points (fp16 = "bf16")
    gemm = {dt: tuple(tuple(p) for p in (g[v] if isinstance(v, str) else v)) for dt, v in g.items()}
    att = raw.get("attention", {})
    rows = tuple(attention_row(r) for r in att.get("rows", []))
    prefer = tuple(att.get("prefer", sorted({r.kernel for r in rows})))
    fixed, bw = fit_norm([2 * raw["norm_rows"] * h * 2 for h in raw["norm_hidden"]],
                         [ms * 1e-3 for ms in raw["norm_ms"]])
    return KernelData(gpu_name, gemm, rows, prefer, raw["stream_tb_per_s"] * 1e12, fixed,
                      bw * raw.get("norm_bandwidth_scale", 1.0),
                      raw["host"]["kernel_issue_s"], raw["source"],
                      dtensor_tp_block_s=(raw["host"].get("dtensor_tp_block_forward_s", 0.0),
                                          raw["host"].get("dtensor_tp_block_backward_s", 0.0)),
                      bmm_head_dim=_bmm_head_dim(raw.get("bmm_head_dim")),
                      copy_engine_gemm=(raw.get("copy_engine_gemm_slowdown", 0.0), raw.get("copy_engine_call_s", 0.0)),
                      fp8_no_fast_accum=raw.get("fp8_no_fast_accum_slowdown", 1.0))


def _bmm_head_dim(raw: Optional[dict]) -> Optional[BmmHeadDim]:
    """kernels.toml's ``bmm_head_dim`` table of one GPU, or None when it has none."""
    if raw is None:
        return None
    return BmmHeadDim(tuple(int(d) for d in raw["head_dim"]), tuple(float(v) for v in raw["kq_tflops"]),
                      tuple(float(v) for v in raw["aov_tflops"]), raw["source"])


ATTENTION_DTYPES = ("bf16", "fp16", "fp8", "fp32")


def attention_row(r: dict) -> AttentionRow:
    """One ``attention.rows`` entry of kernels.toml (or of a ``bench --grid`` fragment) as an
    :class:`AttentionRow`; ``dtype`` is optional (bf16 when absent) and one of
    :data:`ATTENTION_DTYPES`."""
    dtype = r.get("dtype", "bf16")
    if dtype not in ATTENTION_DTYPES:
        raise ValueError(f"attention row dtype {dtype!r}; use one of {', '.join(ATTENTION_DTYPES)}")
    return AttentionRow(r["kernel"], r["pass"], r["mask"], int(r["head_dim"]), tuple(int(x) for x in r["seq"]),
                        tuple(float(x) for x in r["tflops"]), r["source"], dtype)


def fit_norm(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(fixed s, bandwidth B/s) of ``t = fixed + bytes / bandwidth``, ordinary least squares
    over measured (bytes, seconds) points of one kernel (at least two distinct sizes).

    >>> fixed, bw = fit_norm([1e6, 3e6], [2e-6, 4e-6])   # 1 us + 1 us per MB
    >>> round(fixed * 1e6, 9), round(bw / 1e12, 9)
    (1.0, 1.0)
    """
    n = len(nbytes)
    mx, my = sum(nbytes) / n, sum(seconds) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds)) / sum((x - mx) ** 2 for x in nbytes)
    return my - slope * mx, 1.0 / slope


def _interp_log(xs, ys, x: float) -> float:
    """Linear in log2(x) between the points (xs ascending), clamped at the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            f = (log2(x) - log2(x0)) / (log2(x1) - log2(x0))
            return y0 + f * (y1 - y0)
    return ys[-1]


def _attention_row(data: KernelData, pass_: str, mask: str, head_dim: int,
                   prefer: tuple[str, ...] = (), dtype: str = "bf16") -> Optional[AttentionRow]:
    """The row for ``pass_``: kernels in preference order (``data.first``, ``prefer``, then
    ``data.prefer``), rows of ``dtype`` (else bf16's, the rows without a dtype), the mask itself
    before "any", the nearest head dim (log2)."""
    for kernel in dict.fromkeys(data.first + prefer + data.prefer):
        for dt, masks in ((dtype, (mask,)), (dtype, ("any",)), ("bf16", (mask,)), ("bf16", ("any",))):
            rows = [r for r in data.attention
                    if r.kernel == kernel and r.pass_ == pass_ and r.mask in masks and r.dtype == dt]
            if rows:
                return min(rows, key=lambda r: (abs(log2(r.head_dim) - log2(head_dim)), -r.head_dim))
    return None


def attention_kernel(data: KernelData, head_dim: int, prefer: tuple[str, ...] = ()) -> str:
    """The kernel whose causal forward row :func:`attention_seconds` reads for ``head_dim`` under
    ``prefer`` ("" without such rows).

    >>> d = kernel_data("h100-sxm5-80gb")
    >>> attention_kernel(d, 128), attention_kernel(d, 128, ("FA2",)), attention_kernel(kernel_data("a100-sxm-80gb"), 128)
    ('FA3', 'FA2', 'FA2')
    """
    row = _attention_row(data, "fwd", "causal", head_dim, prefer) or _attention_row(
        data, "fwd+bwd", "causal", head_dim, prefer)
    return row.kernel if row is not None else ""


def attention_seconds(data: KernelData, att: Attention, causal: bool = True,
                      prefer: tuple[str, ...] = (), dtype: str = "bf16",
                      lengths: Optional[tuple[int, int]] = None) -> tuple[float, float, str]:
    """(forward s, backward s, how) of one fused attention call ``att`` (module docstring);
    ``prefer``: kernels tried before the GPU's ``prefer`` list (the framework's, e.g. torch's
    SDPA runs FA2); ``dtype``: rows of that dtype first, else the bf16 rows; ``lengths``: the
    (forward, backward) sequence lengths the rows are read at, ``(seq_kv, seq_kv)`` unless given
    (a rectangular call's: :func:`meshplan.compute.ring_attention.rate_lengths`). A call shorter
    than a row's first length (the forward's queries, the backward's keys, or the loop length)
    reads the row's edge x the shape model's ratio (:func:`meshplan.compute.attention_points.below_rows`),
    not the first length's rate. Raises KeyError when ``data`` has no attention rows for the mask.

    >>> from meshplan.compute.shapes import Attention
    >>> d = kernel_data("h100-sxm5-80gb")
    >>> a = Attention(batch=1, q_heads=32, kv_heads=8, seq_q=8192, seq_kv=8192, head_dim=128)
    >>> [h.split(" [")[0] for h in attention_seconds(d, a)[2].split("; ")]
    ['fwd FA3 fwd causal d128 602 TFLOP/s at S 8192', 'bwd FA3 bwd any d128 559 TFLOP/s at S 8192']
    >>> [h.split(" [")[0] for h in attention_seconds(d, a, prefer=("FA2",))[2].split("; ")]
    ['fwd FA2 fwd causal d128 333 TFLOP/s at S 8192', 'bwd FA2 bwd any d128 318 TFLOP/s at S 8192']
    >>> short = Attention(batch=1, q_heads=8, kv_heads=8, seq_q=256, seq_kv=256, head_dim=128)
    >>> attention_seconds(d, short)[2].split(" [")[0]   # 16 blocks in one wave against the 512 edge's 32
    'fwd FA3 fwd causal d128 146 TFLOP/s: 256 x 256 rows (parallel x loop) is below the shortest measured S 512; x0.500 (shape model: 16 blocks of 128 over 256-row loops, capped at 1) of the 512x512 edge (292)'
    """
    mask = "causal" if causal else "none"
    fwd_flops = att.flops(causal_half=causal)
    out, how = [], []
    for (pass_, factor), length in zip((("fwd", 1.0), ("bwd", 2.5)), lengths or (att.seq_kv, att.seq_kv)):
        row = _attention_row(data, pass_, mask, att.head_dim, prefer, dtype)
        if row is None:
            row = _attention_row(data, "fwd+bwd", mask, att.head_dim, prefer, dtype)
        if row is None:
            raise KeyError(f"{data.gpu}: no attention rows for a {mask} mask")
        rate = _interp_log(row.seq, row.tflops, length)
        # below the row's shortest length: its edge x the shape model (attention_points.below_rows)
        par = att.seq_q if pass_ == "fwd" else att.seq_kv
        ratio, below = below_rows(_sms(data.gpu), att.batch * att.q_heads, par, length, row.seq[0])
        out.append(factor * fwd_flops / (rate * ratio * TFLOPS))
        dt = "" if row.dtype == "bf16" else f" {row.dtype}"
        at = f"{rate:.0f} TFLOP/s at S {length}" if not below else (
            f"{rate * ratio:.0f} TFLOP/s: {par} x {length} rows (parallel x loop) is below the shortest measured S "
            f"{row.seq[0]}; {below} "
            f"({rate:.0f})")
        how.append(f"{pass_} {row.kernel}{dt} {row.pass_} {row.mask} d{row.head_dim} {at} [{row.source}]")
    return out[0], out[1], "; ".join(how)


@lru_cache(maxsize=None)
def _sms(gpu_name: str) -> int:
    """The SMs of catalog GPU ``gpu_name`` (the shape model's waves, :func:`attention_seconds`)."""
    return catalog.gpu(gpu_name).sms


def bandwidth(data: KernelData, kind: str = "elementwise") -> float:
    """Achievable HBM bandwidth (B/s) of a memory-bound kernel's streaming: ``kind`` "norm" at
    the fused norm's fitted bandwidth, anything else at BabelStream Triad."""
    return data.norm_bytes_per_s if kind == "norm" else data.stream_bytes_per_s


def memory_seconds(data: KernelData, nbytes: float, kind: str = "elementwise") -> float:
    """Seconds of a memory-bound kernel moving ``nbytes`` (read + written): a norm's fitted
    fixed time plus its bytes at the fitted bandwidth; anything else its bytes at Triad."""
    return (data.norm_fixed_s if kind == "norm" else 0.0) + nbytes / bandwidth(data, kind)


def memory_kernel_seconds(data: Optional[KernelData], nbytes: float, datasheet_bytes_per_s: float,
                          kind: str = "elementwise") -> float:
    """Seconds on the step of one memory-bound kernel moving ``nbytes`` (read + written):
    :func:`memory_seconds` for ``kind``, never below the host's issue floor
    (``data.kernel_issue_s``); for a GPU without catalog data (``data`` None) ``nbytes /
    datasheet_bytes_per_s``, the datasheet HBM bandwidth (B/s), with no floor.

    >>> d = kernel_data("h100-sxm5-80gb")
    >>> round(memory_kernel_seconds(d, 2.97e9, 3.35e12) * 1e3, 3)   # 2.97 GB at Triad 2.97 TB/s
    1.0
    >>> memory_kernel_seconds(d, 8.0, 3.35e12) == d.kernel_issue_s   # one element: the issue floor
    True
    >>> round(memory_kernel_seconds(None, 3.35e9, 3.35e12) * 1e3, 3)   # no catalog data: datasheet
    1.0
    """
    if data is None:
        return nbytes / datasheet_bytes_per_s
    return max(memory_seconds(data, nbytes, kind), data.kernel_issue_s)
