"""``meshplan bench gemm --grid`` / ``bench attention --grid``: sweep the catalog's own grid for
a GPU on the local device and write it in ``meshplan/catalog/kernels.toml`` form
(:mod:`meshplan.compute.kernel_fragment` reads it back), so a table measured on a new GPU is
pasted into the catalog, not transcribed.

**Grid** (:func:`gemm_grid`, :func:`attention_grid`): on a GPU, the (M, N, K) points the catalog
holds for that GPU and dtype (after ``gemm_from``), and the head dims and sequence lengths of its
attention rows, each timed causal and unmasked; a GPU without catalog data gets
:data:`DEFAULT_GEMM` / :data:`DEFAULT_ATTENTION`. On the CPU the grid is :data:`CPU_GEMM` /
:data:`CPU_ATTENTION` (small enough for two cores), and the file is keyed ``[gpu.cpu]``
(:data:`CPU_KEY`) with a source that says it describes the CPU: CPU rates filed under the
plan's GPU id would read as that GPU's measured kernels.

**Timing**: GEMM as :func:`meshplan.runtime.bench.gemm.time_gemm` (``torch.matmul``, median of
``repeats``; on a GPU replays of a CUDA graph of back-to-back GEMMs: the kernel's time without
the host's launch), TFLOP/s = 2 M N K / s. Attention as
:func:`meshplan.runtime.bench.attention.time_attention` (torch SDPA forward, then backward; on a
GPU :data:`CUDA_CALLS` calls back to back per repeat) at
the shape of flash-attention's ``benchmarks/benchmark_flash_attention.py``
(Dao-AILab/flash-attention @0251105: batch x seq = 16,384 tokens, model dim 2,048, so heads =
2048 / head dim), rates in its FLOP convention: forward ``4 B S^2 H d`` halved when causal,
backward 2.5x forward; rows are kernel "SDPA" (whichever backend torch picks).
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Optional

import torch

from meshplan.compute.measured import kernel_data
from meshplan.compute.shapes import Attention
from meshplan.fileio import write_output
from meshplan.runtime.bench.attention import time_attention
from meshplan.runtime.bench.gemm import device_name, time_gemm

Point = tuple[int, int, int]
DEFAULT_GEMM: list[Point] = [(n, n, n) for n in (1024, 2048, 4096, 8192)] + [(8192, 4096, 14336), (8192, 14336, 4096)]
DEFAULT_ATTENTION: dict[int, list[int]] = {64: [512, 1024, 2048, 4096, 8192, 16384],
                                           128: [512, 1024, 2048, 4096, 8192, 16384]}
CPU_GEMM: list[Point] = [(64, 64, 64), (128, 128, 128), (256, 256, 256)]
CPU_ATTENTION: dict[int, list[int]] = {32: [64, 128]}
TOKENS, MODEL_DIM = 16384, 2048  # flash-attention benchmark_flash_attention.py shape
#: Attention calls timed back to back per repeat on a GPU (time_attention ``calls``).
CUDA_CALLS = 10
KEY = "bench"  # source key of every point this writes (the file's `source` says what it is)
CPU_KEY = "cpu"  # the [gpu.<id>] key of a sweep timed on the CPU: no GPU's id


def gemm_grid(gpu: str, dtype: str, device: str) -> list[Point]:
    """The (M, N, K) points to time (module docstring)."""
    if device == "cpu":
        return list(CPU_GEMM)
    data = kernel_data(gpu)
    pts = data.gemm.get(dtype) if data is not None else None
    return [(p[0], p[1], p[2]) for p in pts] if pts else list(DEFAULT_GEMM)


def attention_grid(gpu: str, device: str) -> dict[int, list[int]]:
    """head dim -> sequence lengths to time (module docstring)."""
    if device == "cpu":
        return dict(CPU_ATTENTION)
    data = kernel_data(gpu)
    if data is None or not data.attention:
        return dict(DEFAULT_ATTENTION)
    grid: dict[int, set[int]] = {}
    for r in data.attention:
        grid.setdefault(r.head_dim, set()).update(r.seq)
    return {d: sorted(s) for d, s in sorted(grid.items())}


def _sig(x: float) -> float:
    """``x`` to 5 significant digits (a CPU's 0.004 TFLOP/s keeps its precision)."""
    return float(f"{x:.5g}")


def sweep_gemm(points: list[Point], dtype: str, device: str, warmup: int = 2, repeats: int = 5) -> list[list]:
    """``[M, N, K, TFLOP/s, KEY]`` per point, timed on ``device``."""
    out: list[list] = []
    for m, n, k in points:
        s = time_gemm(m, n, k, dtype, device, warmup, repeats)
        out.append([m, n, k, _sig(2.0 * m * n * k / s / 1e12), KEY])
    return out


def sweep_attention(grid: dict[int, list[int]], dtype: str, device: str, warmup: int = 1, repeats: int = 5,
                    tokens: int = TOKENS, model_dim: int = MODEL_DIM) -> list[dict]:
    """kernels.toml attention rows (fwd and bwd per mask and head dim) of SDPA on ``device``."""
    rows: list[dict] = []
    for d, seqs in grid.items():
        heads = max(1, model_dim // d)
        for causal in (True, False):
            fwd, bwd = [], []
            for s in seqs:
                att = Attention(batch=max(1, tokens // s), q_heads=heads, kv_heads=heads, seq_q=s, seq_kv=s, head_dim=d)
                f, b = time_attention(att, dtype, device, warmup, repeats, causal=causal,
                                      calls=1 if device == "cpu" else CUDA_CALLS)
                flops = att.flops(causal_half=causal)
                fwd.append(_sig(flops / f / 1e12))
                bwd.append(_sig(2.5 * flops / b / 1e12))
            mask = "causal" if causal else "none"
            for pass_, rates in (("fwd", fwd), ("bwd", bwd)):
                rows.append(dict(kernel="SDPA", pass_=pass_, mask=mask, head_dim=d, dtype=dtype, seq=list(seqs),
                                 tflops=rates, source=KEY))
    return rows


def source_line(command: str, device: str, today: Optional[datetime.date] = None) -> str:
    """``meshplan bench <command> on <device name>, torch <version>, <date>`` (CPU said so)."""
    when = (today or datetime.datetime.now(datetime.timezone.utc).date()).isoformat()
    cpu = " (CPU: describes this CPU, not a GPU)" if device == "cpu" else ""
    return f"meshplan bench {command} on {device_name(device)}{cpu}, torch {torch.__version__}, {when}"


def fragment_toml(gpu: str, source: str, gemm: Optional[dict[str, list[list]]] = None,
                  attention: Optional[list[dict]] = None, host: Optional[dict[str, float]] = None) -> str:
    """kernels.toml text for one GPU (:mod:`meshplan.compute.kernel_fragment` schema); ``host``: the
    ``[host]`` table (eager DTensor TP's pace, seconds per block: ``bench rank --kernels-out``)."""
    q = json.dumps  # a JSON string of plain text is a TOML basic string
    key = gpu if re.fullmatch(r"[A-Za-z0-9_-]+", gpu) else q(gpu)  # a bare key, as kernels.toml writes it
    lines = [f"# written by {source}", f"[gpu.{key}]", f"source = {q(source)}"]
    if gemm:
        lines.append(f"\n[gpu.{key}.gemm]")
        for dt, pts in gemm.items():
            lines.append(f"{dt} = [")
            lines += [f"  [{m}, {n}, {k}, {r!r}, {q(key)}]," for m, n, k, r, key in pts]
            lines.append("]")
    if attention:
        lines += [f"\n[gpu.{key}.attention]", 'prefer = ["SDPA"]', "rows = ["]
        for r in attention:
            lines.append(f"  {{ kernel = {q(r['kernel'])}, pass = {q(r['pass_'])}, mask = {q(r['mask'])}, "
                         f"head_dim = {r['head_dim']}, dtype = {q(r['dtype'])}, seq = {r['seq']}, "
                         f"tflops = {r['tflops']}, source = {q(r['source'])} }},")
        lines.append("]")
    if host:
        lines += ["\n[host]"] + [f"{k} = {v!r}" for k, v in host.items()]
    return "\n".join(lines) + "\n"


def write_fragment(text: str, path: str | Path, force: bool = False) -> Path:
    """Write the TOML atomically; refuses to replace an existing file unless ``force``."""
    return write_output(path, text, force=force, field="--out")


def run_grid(kind: str, gpu: str, dtype: str, device: str, out: Path, force: bool = False,
             repeats: int = 5) -> tuple[Path, list[str]]:
    """``bench gemm --grid`` (``kind`` "gemm") or ``bench attention --grid`` ("attention"):
    sweep the grid of ``gpu``, write the kernels.toml-form file to ``out`` keyed by ``gpu``
    (by :data:`CPU_KEY` when ``device`` is the CPU); (path, printed lines)."""
    source = source_line(kind, device)
    key = CPU_KEY if device == "cpu" else gpu
    if kind == "gemm":
        pts = sweep_gemm(gemm_grid(gpu, dtype, device), dtype, device, repeats=repeats)
        lines = [f"{m:7d} {n:7d} {k:7d} {dtype:>5} {r:9.2f} TFLOP/s" for m, n, k, r, _ in pts]
        text = fragment_toml(key, source, gemm={dtype: pts})
    else:
        rows = sweep_attention(attention_grid(gpu, device), dtype, device, repeats=repeats)
        lines = [f"SDPA {r['pass_']:>3} {r['mask']:>6} d{r['head_dim']} {dtype}: S {r['seq']} TFLOP/s {r['tflops']}"
                 for r in rows]
        text = fragment_toml(key, source, attention=rows)
    said = f"the CPU grid, keyed [gpu.{CPU_KEY}], not {gpu}" if key == CPU_KEY else f"grid of {gpu}"
    return write_fragment(text, out, force=force), [f"{said} ({source})"] + lines
