"""Kernel times for the step-time model of a ``validate`` run, measured in this process
before the run: every distinct local GEMM of the plan (forward, data and weight gradient,
``torch.mm``) and the local causal attention as the runtime model runs it, one thread, fp32,
each divided by the rank's core share (ranks time-share the machine's cores). The result is
a :class:`meshplan.compute.gemm.GemmTable` (with ``attention``) that
:func:`meshplan.schedule.steptime.step_time` reads in place of its kernel-efficiency model.
"""

from __future__ import annotations

import time

from meshplan.compute.gemm import GemmTable, Measurement
from meshplan.compute.shapes import attention_shape, backward_gemms


def measure_gemms(plan, share: float, min_s: float = 0.02):
    """Time every distinct local GEMM of the plan (forward, data and weight gradient) with
    torch.mm in this process, one thread, fp32; seconds divided by ``share`` (the rank's
    core share). Returns (GemmTable, rows for gemm_table.json)."""
    import torch


    old = torch.get_num_threads()
    torch.set_num_threads(1)
    shapes = sorted({(g.m, g.n, g.k) for f in plan.gemms for g in [f] + backward_gemms(f)})
    rows, entries = [], {}
    try:
        for m, n, k in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)
            torch.mm(a, b)
            reps, t0 = 0, time.perf_counter()
            while reps < 3 or time.perf_counter() - t0 < min_s:
                torch.mm(a, b)
                reps += 1
            sec = (time.perf_counter() - t0) / reps / share
            entries[(m, n, k, "fp32")] = Measurement(m, n, k, "fp32", sec, "cpu", torch.__version__)
            rows.append(dict(m=m, n=n, k=k, dtype="fp32", seconds=sec))
    finally:
        torch.set_num_threads(old)
    return GemmTable(entries, "measured by meshplan validate"), rows


def measure_attention(plan, share: float, min_s: float = 0.02) -> tuple[dict, list[dict]]:
    """Time the plan's local causal attention as the runtime model runs it (K/V heads repeated
    to the query heads, ``F.scaled_dot_product_attention(is_causal=True)``; with cp > 1 the
    rank's ``seq / cp`` queries against all ``seq`` keys under its boolean mask,
    :class:`meshplan.runtime.execution.cp.ContextParallel`), forward and forward + backward, one
    thread, fp32, in this process; seconds divided by ``share``.
    Returns (``GemmTable.attention`` entries, rows for gemm_table.json)."""
    import torch
    import torch.nn.functional as F


    cfg, mesh = plan.config, plan.mesh
    att = attention_shape(cfg.model, mesh.degree("tp"), mesh.degree("cp"), cfg.training.micro_batch,
                          cfg.training.seq_len)
    old = torch.get_num_threads()
    torch.set_num_threads(1)

    def timed(fn) -> float:
        fn()
        reps, t0 = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t0 < min_s:
            fn()
            reps += 1
        return (time.perf_counter() - t0) / reps / share

    cp = mesh.degree("cp")
    if cp > 1:  # CP: local queries against every key under cp rank 0's mask (runtime.cp; balanced ranks)
        from meshplan.runtime.execution.cp import ContextParallel

        sdpa = dict(attn_mask=ContextParallel(None, cp, 0).mask(att.seq_q, "cpu"))
    else:
        sdpa = dict(is_causal=True)
    try:
        q = torch.randn(att.batch, att.q_heads, att.seq_q, att.head_dim, requires_grad=True)
        k, v = (torch.randn(att.batch, att.q_heads, att.seq_kv, att.head_dim, requires_grad=True) for _ in range(2))
        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, **sdpa))
        both = timed(lambda: F.scaled_dot_product_attention(q, k, v, **sdpa).sum().backward())
    finally:
        torch.set_num_threads(old)
    key = (att.batch, att.q_heads, att.kv_heads, att.seq_q, att.seq_kv, att.head_dim, "fp32")
    bwd = max(both - fwd, 0.0)
    return {key: (fwd, bwd)}, [dict(op="attention", batch=att.batch, q_heads=att.q_heads, kv_heads=att.kv_heads,
                                    seq_q=att.seq_q, seq_kv=att.seq_kv, head_dim=att.head_dim, dtype="fp32",
                                    forward_s=fwd, backward_s=bwd)]
