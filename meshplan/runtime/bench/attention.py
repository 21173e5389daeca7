"""``meshplan bench attention``: time a plan's local attention on the local device with torch
SDPA, forward and backward, and write the table :func:`meshplan.compute.gemm.load_gemm_table`
reads (JSON rows with ``op = "attention"``, columns
:data:`meshplan.compute.gemm.ATTENTION_COLUMNS`); the step-time model then uses these times in
place of the catalog's FlashAttention rates (``meshplan step --gemm-table``).

The shape is :func:`meshplan.compute.shapes.attention_shape` of the plan: (micro-batch, local
query heads, ``seq / cp`` queries, ``seq`` keys, head dim). It runs as the runtime model runs it
(:mod:`meshplan.runtime.execution.model`): K and V heads repeated to the query heads,
``F.scaled_dot_product_attention`` with ``is_causal=True`` (cp > 1: the rank's boolean mask of
:class:`meshplan.runtime.execution.cp.ContextParallel`). Each repeat times the forward call and,
separately, ``backward`` of its output with a random output gradient (CUDA events on a GPU,
``time.perf_counter`` around synchronised calls on the CPU); ``warmup`` untimed repeats, then the
median of ``repeats``. Whichever SDPA backend torch picks on the device is what is timed (flash or
memory-efficient on a GPU, the math kernel on the CPU).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from meshplan.compute.gemm import load_gemm_table
from meshplan.compute.shapes import Attention, attention_shape
from meshplan.fileio import write_output
from meshplan.runtime.bench.gemm import DTYPES, device_name, event_seconds


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    """Seconds of ``fn()``: CUDA events on a GPU (:func:`~meshplan.runtime.bench.gemm.event_seconds`),
    ``time.perf_counter`` on the CPU."""
    if device.startswith("cuda"):
        return event_seconds(fn)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_attention(att: Attention, dtype: str = "fp32", device: str = "cpu", warmup: int = 1, repeats: int = 5,
                   mask: Optional[torch.Tensor] = None, causal: bool = True, calls: int = 1) -> tuple[float, float]:
    """Median (forward s, backward s) of one SDPA call of shape ``att`` (module docstring),
    causal unless ``causal`` is False (``mask``, when given, replaces both). ``calls`` > 1: each
    repeat times that many calls back to back and divides (the GPU's queue stays full, so the
    host's launch latency is not in the figure: ``bench attention --grid`` on a GPU); backward is
    then the time of ``calls`` forward+backward pairs less that of ``calls`` forwards."""
    dt = DTYPES[dtype]
    shape = (att.batch, att.q_heads)
    q = torch.randn(*shape, att.seq_q, att.head_dim, dtype=dt, device=device, requires_grad=True)
    k = torch.randn(*shape, att.seq_kv, att.head_dim, dtype=dt, device=device, requires_grad=True)
    v = torch.randn(*shape, att.seq_kv, att.d_v, dtype=dt, device=device, requires_grad=True)  # MLA: v_head_dim
    grad = torch.randn(*shape, att.seq_q, att.d_v, dtype=dt, device=device)
    kw = dict(is_causal=causal) if mask is None else dict(attn_mask=mask)
    fwd, bwd = [], []
    if calls > 1:
        def forwards():
            with torch.no_grad():
                for _ in range(calls):
                    F.scaled_dot_product_attention(q, k, v, **kw)

        def pairs():
            for _ in range(calls):
                F.scaled_dot_product_attention(q, k, v, **kw).backward(grad)
            q.grad = k.grad = v.grad = None

        for i in range(warmup + repeats):
            tf, tfb = _timed(forwards, device) / calls, _timed(pairs, device) / calls
            if i >= warmup:
                fwd.append(tf)
                bwd.append(tfb - tf)
        _sync(device)
        return statistics.median(fwd), statistics.median(bwd)
    for i in range(warmup + repeats):
        out = []
        tf = _timed(lambda: out.append(F.scaled_dot_product_attention(q, k, v, **kw)), device)
        tb = _timed(lambda: out[0].backward(grad), device)
        q.grad = k.grad = v.grad = None
        if i >= warmup:
            fwd.append(tf)
            bwd.append(tb)
    _sync(device)
    return statistics.median(fwd), statistics.median(bwd)


def row(att: Attention, forward_s: float, backward_s: float, dtype: str, device: str) -> dict:
    """One table row (:data:`meshplan.compute.gemm.ATTENTION_COLUMNS`)."""
    return dict(op="attention", batch=att.batch, q_heads=att.q_heads, kv_heads=att.kv_heads, seq_q=att.seq_q,
                seq_kv=att.seq_kv, head_dim=att.head_dim, dtype=dtype, forward_s=forward_s, backward_s=backward_s,
                device=device, torch=torch.__version__)


def gemm_rows(path: str | Path) -> list[dict]:
    """The GEMM rows of a measured table (``meshplan bench gemm``), to write beside attention."""
    t = load_gemm_table(path)
    return [dict(m=x.m, n=x.n, k=x.k, dtype=x.dtype, seconds=x.seconds, device=x.device, torch=x.torch)
            for x in t.entries.values()]


def write_table(rows: list[dict], path: str | Path, force: bool = False) -> Path:
    """Write ``{"rows": rows}`` as JSON atomically; refuses to replace a file unless ``force``."""
    return write_output(path, json.dumps({"rows": rows}, indent=1) + "\n", force=force, field="--out")


def bench_plan(plan, dtype: str, device: str, warmup: int = 1, repeats: int = 5) -> dict:
    """Time the plan's local attention; returns its table row."""
    cfg, mesh = plan.config, plan.mesh
    cp = mesh.degree("cp")
    att = attention_shape(cfg.model, mesh.degree("tp"), cp, cfg.training.micro_batch, cfg.training.seq_len)
    mask = None
    if cp > 1:
        from meshplan.runtime.execution.cp import ContextParallel

        mask = ContextParallel(None, cp, 0).mask(att.seq_q, device)  # type: ignore[arg-type]  # the mask needs no group
    f, b = time_attention(att, dtype, device, warmup, repeats, mask)
    return row(att, f, b, dtype, device_name(device))
