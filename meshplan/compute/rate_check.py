"""Measured kernel inputs checked against the GPU they time (newcomer trial 54 #2): a
``--kernels`` GEMM point (TFLOP/s) or a ``step --gemm-table`` row (seconds per call) is a
rate, and no GEMM runs faster than the GPU's dense peak times its ceiling.

- **Above the ceiling: an error.** ``peak_flops(dtype) * max_gemm_fraction`` is the best GEMM
  throughput measured on that GPU (``gpus.toml``; 794.5 of 989.4 TFLOP/s bf16 on H100 SXM,
  stas00/ml-engineering, :mod:`meshplan.compute.gemm`). A rate above it is a unit slip (GFLOP/s
  written in a TFLOP/s column, microseconds in a seconds column) or another GPU's data, and would
  time the step faster than the GPU can run. A margin of :data:`ABOVE_MARGIN` (2%, a chosen
  tolerance) is allowed over the catalog's measured best.
- **Below** :data:`LOW_FRACTION` **(1%) of the shape model's rate at that shape: a warning.**
  The shape model (:func:`meshplan.compute.gemm.gemm_model`: tile and wave quantization, the
  memory roofline, the ceiling) is the datasheet's bound for the shape, so a small, memory-bound
  GEMM is held to its own low bound and not to the dense peak (the catalog's slowest measured
  H100 bf16 point is 12.5 TFLOP/s, 1.3% of peak, ``kernels.toml``). A rate 100x under it is more
  likely milliseconds written as seconds than a GPU's GEMM; it warns and does not refuse.
- **seconds and tflops both given and apart by more than** :data:`DISAGREE` **(5%): a
  warning** naming the row; the seconds column is the one timed
  (:func:`meshplan.compute.gemm.load_gemm_table`). ``bench gemm`` writes tflops rounded to 4
  significant digits, far inside 5%.

A dtype the GPU has no peak for (``gpus.toml`` ``peak_tflops``) is not checked.
"""

from __future__ import annotations

from typing import Iterable, Optional

from meshplan.compute.gemm import gemm_model
from meshplan.compute.kernel_fragment import fragment_of
from meshplan.errors import ConfigError
from meshplan.spec.cluster import GPUSpec, KernelFile
from meshplan.units import TFLOPS

#: Rates below this fraction of the shape model's rate at their shape are warned (module docstring;
#: an input-check tolerance, the brief's "~1%", not a model constant).
LOW_FRACTION = 0.01
#: Allowed margin over ``peak * max_gemm_fraction`` before a rate is refused: an input-check
#: tolerance for a GPU measured a little above the catalog's best (clocks, run-to-run noise), not
#: a model constant; no step time depends on it.
ABOVE_MARGIN = 1.02
#: Relative difference of a row's seconds and tflops above which it is warned (a chosen tolerance:
#: a unit slip is a factor 1000, rounding to 4 digits 0.05%).
DISAGREE = 0.05


def _peak(gpu: GPUSpec, dtype: str) -> Optional[float]:
    """Dense peak FLOP/s of ``dtype`` on ``gpu``; None where the catalog has none."""
    return gpu.peak_tflops[dtype] * TFLOPS if dtype in gpu.peak_tflops else None


def _ceiling_words(gpu: GPUSpec, dtype: str, peak: float) -> str:
    return (f"{gpu.name}'s {dtype} ceiling {peak * gpu.max_gemm_fraction / TFLOPS:,.1f} TFLOP/s "
            f"({peak / TFLOPS:,.1f} dense peak x {gpu.max_gemm_fraction:g} max_gemm_fraction)")


def check_rates(rows: Iterable[tuple[str, str, float, tuple[int, int, int]]], gpu: GPUSpec, what: str,
                fix: str) -> list[str]:
    """``rows``: (row name, dtype, FLOP/s, (M, N, K)) of one input ``what`` (``--kernels FILE``).
    Raises ConfigError naming the first row above the ceiling and ``fix`` (the input's units);
    returns one warning text (no prefix) for the rows below :data:`LOW_FRACTION` of the shape
    model's rate, or none.

    >>> from meshplan import catalog
    >>> h100 = catalog.gpu("h100-sxm5-80gb")
    >>> big = (8192, 1024, 8192)   # the model: 77.9% of peak, 770.4 TFLOP/s (module meshplan.compute.gemm)
    >>> check_rates([("p[0]", "bf16", 620e15, big)], h100, "--kernels k.toml", "TFLOP/s")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --kernels k.toml p[0]: bf16 620,000.0 TFLOP/s is above h100-sxm5-80gb's bf16 ceiling ...
    >>> print(*check_rates([("p[0]", "bf16", 5e12, big), ("p[1]", "bf16", 5e14, big)], h100, "--kernels k", "u"))
    ... # doctest: +NORMALIZE_WHITESPACE
    --kernels k: 1 of 2 rows below 1% of the shape model's rate on h100-sxm5-80gb (first p[0]:
    bf16 5.0 TFLOP/s, 0.65% of the model's 770.4 at 8192x1024x8192); u
    """
    low = []
    rows = list(rows)
    for name, dtype, rate, (m, n, k) in rows:
        peak = _peak(gpu, dtype)
        if peak is None:
            continue
        if rate > peak * gpu.max_gemm_fraction * ABOVE_MARGIN:
            raise ConfigError(f"{what} {name}", f"{dtype} {rate / TFLOPS:,.1f} TFLOP/s is above "
                                                f"{_ceiling_words(gpu, dtype, peak)}; {fix}")
        model = 2.0 * m * n * k / gemm_model(gpu, m, n, k, dtype).seconds
        if rate < model * LOW_FRACTION:
            low.append((name, dtype, rate, model, f"{m}x{n}x{k}"))
    if not low:
        return []
    name, dtype, rate, model, shape = low[0]
    return [f"{what}: {len(low)} of {len(rows)} rows below {LOW_FRACTION:.0%} of the shape model's rate on "
            f"{gpu.name} (first {name}: {dtype} {rate / TFLOPS:,.1f} TFLOP/s, {rate / model:.2%} of the model's "
            f"{model / TFLOPS:,.1f} at {shape}); {fix}"]


def kernel_file_rates(gpu: GPUSpec, files: Iterable[KernelFile], field: str = "--kernels") -> list[str]:
    """:func:`check_rates` on ``gpu`` of the GEMM points of each kernels file of ``files`` (``--kernels``,
    a config's ``[kernels] files``: :func:`meshplan.compute.kernel_fragment.with_kernel_files`),
    each point named by its file and place (``F gemm.bf16[0] 4096x4096x4096``). A file measured on
    the CPU (its source says "CPU") is not warned of slow points: it is warned of as a whole
    (:func:`~meshplan.compute.kernel_fragment.read_kernel_file`)."""
    out = []
    for f in files:
        frag = fragment_of(f)
        rows = [(f"gemm.{dt}[{i}] {p[0]}x{p[1]}x{p[2]}", dt, p[3] * TFLOPS, (p[0], p[1], p[2]))
                for dt, pts in frag.gemm.items() for i, p in enumerate(pts)]
        low = check_rates(rows, gpu, f"{field} {f.path}", "a kernels file's 4th column is TFLOP/s (10^12 FLOP/s; "
                                                           "GFLOP/s / 1000): rewrite it with `meshplan bench gemm "
                                                           "CONFIG --grid` on the GPU")
        out += [] if "CPU" in frag.source else low
    return out


def table_rates(entries: Iterable, gpu: GPUSpec, what: str) -> list[str]:
    """:func:`check_rates` of a measured GEMM table's rows (``entries``:
    :class:`~meshplan.compute.gemm.Measurement`, rate ``2 M N K / seconds``), then one warning
    for the rows whose ``tflops`` column disagrees with their seconds by more than :data:`DISAGREE`.
    A table measured on the CPU is not checked for slow rows (``step`` warns it times a CPU).

    >>> from meshplan import catalog
    >>> from meshplan.compute.gemm import Measurement
    >>> row = Measurement(8192, 1024, 8192, "bf16", 0.221676, "NVIDIA H100", "2.13", row=1, tflops=620.0)
    >>> for w in table_rates([row], catalog.gpu("h100-sxm5-80gb"), "--gemm-table t.csv"):
    ...     print(w)  # doctest: +NORMALIZE_WHITESPACE
    --gemm-table t.csv: 1 of 1 rows below 1% of the shape model's rate on h100-sxm5-80gb (first row 1
    8192x1024x8192: bf16 0.6 TFLOP/s, 0.08% of the model's 770.4 at 8192x1024x8192); the seconds column is seconds per call (not ms or us): rewrite it
    with `meshplan bench gemm CONFIG` on the GPU
    --gemm-table t.csv: 1 of 1 rows give seconds and tflops more than 5% apart (first row 1 8192x1024x8192:
    seconds 0.221676 is 0.620 TFLOP/s, tflops 620, 1e+03x); the seconds column is used: give one of them
    (seconds per call), or both from one run
    """
    entries = sorted(entries, key=lambda r: r.row)
    named = [(f"row {r.row} {r.m}x{r.n}x{r.k}", r.dtype, 2.0 * r.m * r.n * r.k / r.seconds, (r.m, r.n, r.k))
             for r in entries]
    cpu = entries and all(r.device.lower().startswith("cpu") for r in entries)
    fix = ("the seconds column is seconds per call (not ms or us): rewrite it with `meshplan bench gemm CONFIG` "
           "on the GPU")
    low = check_rates(named, gpu, what, fix)  # raises above the ceiling, CPU table or not
    out = [] if cpu else low
    apart = [(name, rate, r) for (name, _, rate, _), r in zip(named, entries)
             if r.tflops is not None and abs(rate / TFLOPS / r.tflops - 1) > DISAGREE]
    if apart:
        name, rate, r = apart[0]
        ratio = max(rate / TFLOPS, r.tflops) / min(rate / TFLOPS, r.tflops)
        out.append(f"{what}: {len(apart)} of {len(entries)} rows give seconds and tflops more than {DISAGREE:.0%} "
                   f"apart (first {name}: seconds {r.seconds:g} is {rate / TFLOPS:,.3f} TFLOP/s, tflops {r.tflops:g}, "
                   f"{ratio:,.3g}x); the seconds column is used: give one of them (seconds per call), or both from "
                   f"one run")
    return out
