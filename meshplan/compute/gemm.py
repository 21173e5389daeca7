"""Time of one GEMM on one GPU by its shape, and the measured table that replaces the model.

:func:`gemm_time` takes, in order: a user's measured table (``meshplan bench gemm``, exact
shape), the catalog's measured points for the GPU and dtype, interpolated
(:mod:`meshplan.compute.measured`), and the shape model below (GPUs or dtypes without points).

A GEMM (M, N, K) computes an M x N output reducing over K: ``2 M N K`` FLOP. The model
follows NVIDIA's "Matrix Multiplication Background User's Guide" (Deep Learning
Performance documentation):

- **Tile quantization.** The output is cut into thread-block tiles of ``tm x tn``;
  ``ceil(M/tm) * ceil(N/tn)`` tiles run even when the last row or column of tiles is
  partly padding. Useful fraction ``M N / (tiles tm tn)``.
- **Wave quantization.** Tiles run in waves of one tile per SM (``gpu.sms``):
  ``ceil(tiles / sms)`` waves; a partly filled last wave costs a full wave. Useful
  fraction ``tiles / (waves sms)``.
- **Arithmetic intensity (roofline).** ``2 M N K / bytes`` with
  ``bytes = dtype_bytes (M K + K N + M N)`` (each operand read once, output written once; a
  float8 GEMM's output in bf16, 2 B: :func:`meshplan.compute.gemm_points.gemm_bytes`);
  below the ridge point ``peak * ceiling / hbm_bandwidth`` the GEMM is memory-bound.
- **Ceiling.** An SM that is busy runs at ``gpu.max_gemm_fraction`` of its share of the
  dense peak: the best GEMM throughput measured on that GPU (794.5 of 989.4 TFLOP/s =
  80.3% on H100 SXM, 271.2 of 312 = 86.9% on A100; stas00/ml-engineering), not 95% of
  peak. The same fraction is assumed for every dtype (only BF16 is measured there).

Time = ``max(waves * 2 tm tn K / (peak * ceiling / sms), bytes / hbm_bandwidth)`` for each
candidate tile among 128x256, 256x128 and 128x128, and the fastest tile is kept, as a
cuBLAS heuristic picks the fastest kernel it knows. Efficiency = useful FLOP / time / peak.

Not modelled (so the model is conservative or optimistic where they matter): split-K and
stream-K kernels that cut wave quantization for few, long-K tiles; kernel launch latency
(a few microseconds); L2 reuse beyond reading each operand once. At the measured-maximum
shape 2048x2048x13312 on H100 the model gives 97% of the ceiling (128 tiles of 128x256 on
132 SMs): it does not reproduce the measured maximum exactly there.

>>> from meshplan import catalog
>>> h100 = catalog.gpu("h100-sxm5-80gb")
>>> eff, why = gemm_efficiency(h100, 8192, 1024, 8192)
>>> round(eff, 4)
0.7787
>>> print(why)  # doctest: +NORMALIZE_WHITESPACE
8192x1024x8192 bf16: tile 128x256, 256 tiles (tile quantization 100.0%), 2 waves of 132 SMs
(wave quantization 97.0%), intensity 819 FLOP/B (ridge 237): time set by compute, ceiling 80.3%
(max_gemm_fraction) -> 77.9% of peak
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil, isfinite
from pathlib import Path
from typing import Optional

from meshplan import catalog
from meshplan.compute.kernel_fragment import kernel_data, overlaid
from meshplan.compute.gemm_points import gemm_bytes, gemm_seconds
from meshplan.errors import ConfigError
from meshplan.fileread import parse_json, read_text_limited
from meshplan.limits import FILE_BYTES, MAX_LINE_CHARS, MAX_STRING
from meshplan.spec.cluster import GPUSpec
from meshplan.units import TFLOPS, dtype_bytes

#: Thread-block tiles a cuBLAS heuristic chooses among (Matrix Multiplication Background
#: User's Guide, "Tile quantization": 256x128 and 128x128 tiles as examples).
TILES = ((128, 256), (256, 128), (128, 128))


@dataclass(frozen=True)
class GemmEstimate:
    """Time of one GEMM call: ``seconds``, ``efficiency`` (useful FLOP/s / dense peak),
    ``source`` ("model" or "measured") and a one-line ``explanation``."""

    seconds: float
    efficiency: float
    source: str
    explanation: str


def _compute_time(gpu: GPUSpec, m: int, n: int, k: int, tile: tuple[int, int], dtype: str, count: int):
    """(seconds, tiles, waves) of the tiles' waves at the ceiling, no memory roofline."""
    tm, tn = tile
    tiles = ceil(m / tm) * ceil(n / tn) * count
    waves = ceil(tiles / gpu.sms)
    per_sm = gpu.peak_flops(dtype) * gpu.max_gemm_fraction / gpu.sms
    return waves * 2.0 * tm * tn * k / per_sm, tiles, waves


def compute_efficiency(gpu: GPUSpec, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """The shape model's efficiency of one GEMM (M, N, K) without its memory roofline: tile and
    wave quantization at the ceiling, best of :data:`TILES` (the catalog's measured points are
    scaled by its ratio below their smallest shapes, :func:`meshplan.compute.gemm_points.gemm_tflops`,
    and meet the roofline at measured bandwidth there).

    >>> from meshplan import catalog
    >>> a100 = catalog.gpu("a100-sxm-80gb")   # 128 or 256 rows, N 1024: 8 or 16 tiles of 128x128, one wave
    >>> compute_efficiency(a100, 128, 1024, 8192) / compute_efficiency(a100, 256, 1024, 8192)
    0.5
    """
    t = min(_compute_time(gpu, m, n, k, tile, dtype, 1)[0] for tile in TILES)
    return 2.0 * m * n * k / t / gpu.peak_flops(dtype)


def _tile_time(gpu: GPUSpec, m: int, n: int, k: int, tile: tuple[int, int], dtype: str, count: int):
    t_compute, tiles, waves = _compute_time(gpu, m, n, k, tile, dtype, count)
    nbytes = gemm_bytes(m, n, k, dtype, count)
    t_memory = nbytes / gpu.hbm_bandwidth_bytes_per_s
    return max(t_compute, t_memory), tiles, waves, nbytes, t_compute >= t_memory


def gemm_model(gpu: GPUSpec, m: int, n: int, k: int, dtype: str = "bf16", count: int = 1) -> GemmEstimate:
    """Modelled time of ``count`` GEMMs (M, N, K) launched together (a grouped GEMM shares
    waves), per the module docstring. Raises ValueError on a non-positive size."""
    if min(m, n, k, count) <= 0:
        raise ValueError(f"GEMM sizes must be positive, got M {m} N {n} K {k} count {count}")
    best = min(TILES, key=lambda t: _tile_time(gpu, m, n, k, t, dtype, count)[0])
    t, tiles, waves, nbytes, compute_bound = _tile_time(gpu, m, n, k, best, dtype, count)
    peak = gpu.peak_flops(dtype)
    flops = 2.0 * m * n * k * count
    eff = flops / t / peak
    tq = m * n * count / (tiles * best[0] * best[1])
    wq = tiles / (waves * gpu.sms)
    ridge = peak * gpu.max_gemm_fraction / gpu.hbm_bandwidth_bytes_per_s
    shape = f"{m}x{n}x{k}" + (f" x{count}" if count > 1 else "")
    why = (f"{shape} {dtype}: tile {best[0]}x{best[1]}, {tiles} tiles (tile quantization {tq:.1%}), "
           f"{waves} waves of {gpu.sms} SMs (wave quantization {wq:.1%}), intensity {flops / nbytes:.0f} "
           f"FLOP/B (ridge {ridge:.0f}): time set by {'compute' if compute_bound else 'memory traffic'}, ceiling "
           f"{gpu.max_gemm_fraction:.1%} (max_gemm_fraction) -> {eff:.1%} of peak")
    return GemmEstimate(t, eff, "model", why)


def gemm_efficiency(gpu: GPUSpec, m: int, n: int, k: int, dtype: str = "bf16") -> tuple[float, str]:
    """(efficiency, explanation) of one GEMM (M, N, K) on ``gpu`` by the shape model.

    Efficiency is achieved FLOP/s over the dense peak of ``dtype``; it never exceeds
    ``gpu.max_gemm_fraction``. See the module docstring for the terms.
    """
    e = gemm_model(gpu, m, n, k, dtype)
    return e.efficiency, e.explanation


# Measured table -------------------------------------------------------------------------

#: ``run_m`` (optional): the M the row was run at when ``bench gemm --max-elements`` scaled it
#: down (seconds = the time measured at ``run_m`` x m / run_m); empty when run at m.
TABLE_COLUMNS = ("m", "n", "k", "dtype", "seconds", "tflops", "device", "torch", "run_m")


@dataclass(frozen=True)
class Measurement:
    """One measured GEMM: ``seconds`` per call on ``device`` with torch ``torch``; ``row``: its
    1-based row in the table read (0: not read from one), ``tflops``: the tflops column when the
    row gave it beside seconds (:func:`meshplan.compute.rate_check.table_rates` compares them)."""

    m: int
    n: int
    k: int
    dtype: str
    seconds: float
    device: str
    torch: str
    row: int = 0
    tflops: Optional[float] = None


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMM times keyed by (M, N, K, dtype); ``path`` it was read from.
    ``attention``: measured fused attention, ``(batch, q_heads, kv_heads, seq_q, seq_kv,
    head_dim, dtype) -> (forward_s, backward_s)`` (causal; backward = the input and weight
    gradients of one call), used by :mod:`meshplan.compute.attention` in place of the flash model."""

    entries: dict
    path: str = ""
    attention: dict = field(default_factory=dict)

    def lookup(self, m: int, n: int, k: int, dtype: str) -> Optional[Measurement]:
        return self.entries.get((m, n, k, dtype))

    def __len__(self) -> int:
        return len(self.entries)


#: Columns of a measured attention row (``op = "attention"``; ``meshplan bench attention``,
#: ``validate``'s gemm_table.json): shape of one causal call, seconds of its forward and backward.
ATTENTION_COLUMNS = ("op", "batch", "q_heads", "kv_heads", "seq_q", "seq_kv", "head_dim", "dtype",
                     "forward_s", "backward_s", "device", "torch")


def _attention_row(raw: dict, where: str) -> tuple[tuple, tuple[float, float], str]:
    """(GemmTable.attention key, (forward_s, backward_s), device) of one attention row."""
    unknown = {str(k)[:40] for k, v in raw.items() if v not in (None, "")} - set(ATTENTION_COLUMNS)
    if unknown:
        raise ConfigError(where, f"unknown column(s) {sorted(unknown)}; attention rows have "
                          f"{', '.join(ATTENTION_COLUMNS)}")
    try:
        sizes = tuple(_whole(raw[c]) for c in ATTENTION_COLUMNS[1:7])
        key = sizes + (_text(raw["dtype"]),)
        times = (_number(raw["forward_s"]), _number(raw["backward_s"]))
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(where, f"bad or missing attention column ({str(e)[:60]}); need "
                          f"{', '.join(ATTENTION_COLUMNS[1:10])}") from None
    if not all(0 < x <= 2 ** 31 for x in sizes) or not all(0 <= t <= 1e6 for t in times):
        raise ConfigError(where, f"sizes must be 1..2^31 and times finite, 0..1e6 s: {key} {times}")
    return key, times, str(raw.get("device", ""))


def _whole(value) -> int:
    """A size from a CSV cell or a JSON number: a whole number, ASCII digits, at most 18."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{str(value)[:40]!r} is not a whole number")
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.lstrip("-").isdigit() and len(text) <= 18):
            raise ValueError(f"{text[:40]!r} is not a whole number")
        return int(text)
    if not isfinite(value) or value != int(value):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def _number(value) -> float:
    """A finite number from a CSV cell or a JSON number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{str(value)[:40]!r} is not a number")
    out = float(value[:64] if isinstance(value, str) else value)
    if not isfinite(out):
        raise ValueError(f"{value!r:.40} is not a finite number")
    return out


def _text(value) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING or not value.isprintable():
        raise ValueError(f"{str(value)[:40]!r} is not a short printable string")
    return value


def _row(raw: dict, where: str, row: int = 0) -> Measurement:
    raw = {k: v for k, v in raw.items() if not (k == "op" and v == "gemm")}
    if None in raw:
        raise ConfigError(where, "more fields than header columns; pass the table bench gemm wrote")
    unknown = {str(k)[:40] for k in raw} - set(TABLE_COLUMNS)
    if unknown:
        raise ConfigError(where, f"unknown column(s) {sorted(unknown)}; allowed: {', '.join(TABLE_COLUMNS)}")
    for key in ("m", "n", "k", "dtype", "device", "torch"):
        if raw.get(key) in (None, ""):
            raise ConfigError(f"{where}.{key}", "missing; every row needs m, n, k, dtype, device, torch "
                              "and seconds or tflops")
    try:
        m, n, k = _whole(raw["m"]), _whole(raw["n"]), _whole(raw["k"])
        dtype_bytes(_text(raw["dtype"]))
        if not all(0 < x <= 2 ** 31 for x in (m, n, k)):
            raise ConfigError(where, f"m, n, k must be 1..2^31 (cuBLAS int dimensions); got {m}, {n}, {k}")
        tflops = _number(raw["tflops"]) if raw.get("tflops") not in (None, "") else None
        if tflops is not None and not 0 < tflops <= 1e7:
            raise ConfigError(f"{where}.tflops", f"{tflops} must be > 0 and at most 1e7 TFLOP/s")
        if raw.get("seconds") not in (None, ""):
            seconds = _number(raw["seconds"])
        elif tflops is not None:
            seconds, tflops = 2.0 * m * n * k / (tflops * TFLOPS), None  # nothing to compare it with
        else:
            raise ConfigError(f"{where}.seconds", "give seconds (per call) or tflops")
        device, torch = _text(raw["device"]), _text(raw["torch"])
        if raw.get("run_m") not in (None, "") and not 0 < _whole(raw["run_m"]) <= m:
            raise ConfigError(f"{where}.run_m", f"{raw['run_m']} must be 1..m ({m}): the M a scaled-down row ran at")
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(where, f"bad value ({str(e)[:60]}); m, n, k are integers, seconds/tflops numbers, "
                          f"dtype one of fp32, tf32, bf16, fp16, fp8") from None
    if not 0 < seconds <= 1e6:
        raise ConfigError(where, f"time must be positive and at most 1e6 s (m {m} n {n} k {k} seconds {seconds})")
    return Measurement(m, n, k, str(raw["dtype"]), seconds, device, torch, row, tflops)


def load_gemm_table(path: str | Path) -> GemmTable:
    """Read a measured GEMM table: CSV with a header of :data:`TABLE_COLUMNS` (seconds or
    tflops may be empty, not both), or JSON as a list of such rows or
    ``{"device": ..., "torch": ..., "rows": [...]}`` (row keys override the top level).
    Rows with ``op = "attention"`` (:data:`ATTENTION_COLUMNS`; ``meshplan bench attention``)
    fill ``GemmTable.attention``. One device per table. Raises ConfigError naming the row and
    column."""
    p = Path(path)
    hint = "write one with `meshplan bench gemm` or `meshplan bench attention`"
    if "\0" not in str(p) and not p.exists() and not p.is_symlink():
        raise ConfigError("gemm_table", f"no file {str(p)!r}; {hint}")
    text = read_text_limited(p, "gemm_table", FILE_BYTES["gemm_table"], hint)
    rows: object
    if p.suffix.lower() == ".json":
        data = parse_json(text, "gemm_table", p.name, hint)
        if isinstance(data, dict):
            top = {k: data[k] for k in ("device", "torch") if k in data}
            extra = {str(k)[:40] for k in data} - {"device", "torch", "rows"}
            if extra:
                raise ConfigError("gemm_table", f"unknown key(s) {sorted(extra)}; allowed: device, torch, rows")
            rows = data.get("rows", [])
            if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
                rows = [{**top, **r} for r in rows]
        else:
            rows = data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError("gemm_table", f"{p.name}: expected a list of row objects (or {{\"rows\": [...]}}); {hint}")
    else:
        long = next((i for i, line in enumerate(text.splitlines(), 1) if len(line) > MAX_LINE_CHARS), None)
        if long:
            raise ConfigError(f"gemm_table line {long}", f"over {MAX_LINE_CHARS} characters; {hint}")
        try:
            rows = list(csv.DictReader(io.StringIO(text, newline="")))
        except csv.Error as err:
            raise ConfigError("gemm_table", f"{p.name}: not a valid CSV table ({err}); {hint}") from None
    meas, att = [], []
    for i, r in enumerate(rows):
        if r.get("op") == "attention":
            att.append(_attention_row(r, f"gemm_table row {i + 1}"))
        else:
            meas.append(_row(r, f"gemm_table row {i + 1}", i + 1))
    devices = sorted({x.device for x in meas} | {d for _, _, d in att if d})
    if len(devices) > 1:
        raise ConfigError("gemm_table", f"rows from several devices {devices}; keep one device per table")
    return GemmTable({(x.m, x.n, x.k, x.dtype): x for x in meas}, str(p), {k: t for k, t, _ in att})


def gemm_time(gpu: GPUSpec, m: int, n: int, k: int, dtype: str = "bf16", count: int = 1,
              table: Optional[GemmTable] = None) -> GemmEstimate:
    """Seconds of ``count`` GEMMs (M, N, K), first of: the measured entry when ``table`` (a
    user's ``meshplan bench gemm``) has this exact shape and dtype (``count`` calls of it); the
    catalog's measured points for this GPU and dtype, interpolated
    (:func:`meshplan.compute.gemm_points.gemm_seconds`, source "catalog"); :func:`gemm_model`."""
    hit = table.lookup(m, n, k, dtype) if table is not None else None
    if hit is None:
        data = kernel_data(gpu)
        if data is None or dtype not in data.gemm or min(m, n, k, count) <= 0:
            return gemm_model(gpu, m, n, k, dtype, count)
        return _catalog_time(data.gpu, gpu.kernels, gpu.peak_flops(dtype), m, n, k, dtype, count)
    eff = 2.0 * m * n * k / hit.seconds / gpu.peak_flops(dtype)
    why = (f"{m}x{n}x{k} {dtype}: measured {hit.seconds * 1e6:.1f} us on {hit.device} (torch {hit.torch}) "
           f"-> {eff:.1%} of {gpu.name} peak")
    return GemmEstimate(hit.seconds * count, eff, "measured", why)


@lru_cache(maxsize=1 << 16)
def _catalog_time(gpu_name: str, kernels: tuple, peak_flops: float, m: int, n: int, k: int, dtype: str,
                  count: int) -> GemmEstimate:
    """:func:`gemm_time` from the catalog's points of ``gpu_name`` with the run's measured
    ``kernels`` files laid over them (:func:`meshplan.compute.kernel_fragment.overlaid`;
    :func:`meshplan.compute.gemm_points.gemm_seconds`; below the measured points, scaled by
    :func:`compute_efficiency` of the catalog GPU ``gpu_name``), efficiency against ``peak_flops``;
    memoised on everything it reads (the catalog entry by GPU, the files by text): the search times the
    same shapes for every recompute policy and across thousands of meshes. The flow's one GEMM
    memo (every catalog lookup of the flow comes through here; the interpolation below it is
    not memoised). A pure function's results: a cache, not state."""
    data = overlaid(gpu_name, kernels)
    if data is None:  # gemm_time asks only for a GPU with catalog points
        raise KeyError(f"{gpu_name}: no catalog kernel data")
    measured_on = catalog.gpu(gpu_name)  # below the points: the shape model of the GPU they were measured on
    t, how = gemm_seconds(data, m, n, k, dtype, count,
                          lambda mm, nn, kk: compute_efficiency(measured_on, mm, nn, kk, dtype))
    eff = 2.0 * m * n * k * count / t / peak_flops
    shape = f"{m}x{n}x{k}" + (f" x{count}" if count > 1 else "")
    return GemmEstimate(t, eff, "catalog", f"{shape} {dtype}: {how} -> {eff:.1%} of peak")
