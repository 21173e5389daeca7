"""``meshplan bench gemm``: time a plan's local GEMM shapes on the local device with torch
and write the table :func:`meshplan.compute.gemm.load_gemm_table` reads (CSV columns m, n, k,
dtype, seconds, tflops, device, torch).

Each forward GEMM (M, N, K) of one layer and the output layer is timed with its backward
pair (data gradient (M, K, N), weight gradient (N, K, M); :func:`meshplan.compute.shapes.backward_gemms`)
as ``torch.matmul`` of an (M, K) by a (K, N) operand: ``warmup`` untimed calls, then the
median of ``repeats`` timed calls (CUDA events on a GPU, ``time.perf_counter`` around a
synchronised call on the CPU). Shapes larger than ``max_elements`` per operand are scaled
down along M (and the time scaled back up, stated in the row's note) so a CPU run stays
short; on a GPU nothing is scaled by default.
"""

from __future__ import annotations

import csv
import io
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from meshplan.compute.shapes import Gemm, backward_gemms
from meshplan.errors import ConfigError
from meshplan.fileio import write_output
from meshplan.units import counted

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Timed:
    """One measured shape; ``scaled_m`` is the M actually run when it was scaled down."""

    gemm: Gemm
    dtype: str
    seconds: float
    device: str
    scaled_m: int

    @property
    def tflops(self) -> float:
        return 2.0 * self.gemm.m * self.gemm.n * self.gemm.k / self.seconds / 1e12


def resolve_device(device: str) -> str:
    """``--device``: ``cpu``, ``cuda``, or ``auto`` (cuda when torch sees a GPU); ``cuda``
    where torch sees none is a ConfigError (it was torch's AssertionError traceback)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError("--device", f"{device!r}; use cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"cuda, but torch {torch.__version__} sees no GPU here; run on a GPU, or "
                                      f"give --device cpu to time this CPU")
    return device


def device_name(device: str) -> str:
    """A readable device name: the CUDA device's name, or the CPU with its thread count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({counted(torch.get_num_threads(), 'thread')})"


#: CUDA: seconds of back-to-back GEMMs in one timing window (:func:`time_gemm`).
WINDOW_S = 2e-3
#: CUDA: most GEMMs captured in one graph.
MAX_CAPTURED = 1000


def time_gemm(m: int, n: int, k: int, dtype: str = "fp32", device: str = "cpu", warmup: int = 2,
              repeats: int = 5) -> float:
    """Median seconds of one (M, N, K) matmul on ``device``.

    CUDA: the kernel's own time, as the step-time model uses it (the host's issue of each kernel
    is a separate term, kernels.toml ``[host] kernel_issue_s``): ``c = a @ b`` captured ``r`` times
    back to back in one CUDA graph (``r`` from one event-timed call, so that a replay lasts about
    :data:`WINDOW_S`; at most :data:`MAX_CAPTURED`), each of ``repeats`` replays timed with CUDA
    events and divided by ``r``. One eager call between events would add the launch latency (some
    microseconds: half the time of a 1024 x 256 x 256 GEMM on an H200, measured 2026-12-04).
    CPU: ``time.perf_counter`` around one synchronous call."""
    dt = DTYPES[dtype]
    a = torch.randn(m, k, dtype=dt, device=device)
    b = torch.randn(k, n, dtype=dt, device=device)
    if device.startswith("cuda"):
        return _time_captured(lambda out: torch.matmul(a, b, out=out), torch.empty(m, n, dtype=dt, device=device),
                              warmup, repeats)
    for _ in range(warmup):
        torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def event_seconds(fn) -> float:
    """Seconds of ``fn()`` on the current CUDA stream, between two CUDA events (synchronised)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _time_captured(call, out, warmup: int, repeats: int) -> float:
    """Seconds of one ``call(out)`` from CUDA-graph replays (:func:`time_gemm`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as graph capture asks
        for _ in range(max(1, warmup)):
            call(out)
    torch.cuda.current_stream().wait_stream(stream)
    one = event_seconds(lambda: call(out))
    r = max(1, min(MAX_CAPTURED, int(WINDOW_S / max(one, 1e-7))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(r):
            call(out)
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(event_seconds(graph.replay) / r for _ in range(repeats))


def bench(gemms: list[Gemm], dtype: str = "fp32", device: str = "cpu", max_elements: Optional[int] = None,
          warmup: int = 2, repeats: int = 5, backward: bool = True) -> list[Timed]:
    """Time every distinct shape of ``gemms`` (and their backward pairs)."""
    shapes: dict = {}
    for g in gemms:
        for x in [g] + (backward_gemms(g) if backward else []):
            shapes.setdefault((x.m, x.n, x.k), x)
    out = []
    name = device_name(device)
    for (m, n, k), g in shapes.items():
        run_m = m
        if max_elements:
            run_m = max(1, min(m, max_elements // max(k, n)))
        sec = time_gemm(run_m, n, k, dtype, device, warmup, repeats) * m / run_m
        out.append(Timed(g, dtype, sec, name, run_m))
    return out


def table_csv(rows: list[Timed]) -> str:
    """CSV text in the format :func:`meshplan.compute.gemm.load_gemm_table` reads: per row its
    seconds per call, ``tflops`` = 2 M N K / seconds / 1e12 to 4 significant digits, and ``run_m``,
    the M it ran at when scaled down (``--max-elements``; its seconds scaled back by m / run_m),
    empty when run at m (newcomer trial 54 #11: the tflops column was empty, the scaling unrecorded)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["m", "n", "k", "dtype", "seconds", "tflops", "device", "torch", "run_m"])
    for r in rows:
        w.writerow([r.gemm.m, r.gemm.n, r.gemm.k, r.dtype, f"{r.seconds:.9g}", f"{r.tflops:.4g}", r.device,
                    torch.__version__, r.scaled_m if r.scaled_m != r.gemm.m else ""])
    return buf.getvalue()


def write_table(rows: list[Timed], path: str | Path, force: bool = False) -> Path:
    """Write the CSV atomically; refuses to replace an existing file unless ``force``."""
    return write_output(path, table_csv(rows), force=force, field="--out")
