"""What :mod:`meshplan.runtime.validation.one_rank` reads off a rank's run besides its clocks: the
bytes it holds between steps by owner (:func:`held_bytes`) and one step under torch.profiler with
its CUDA kernels summed by kind (:func:`profiled`, :func:`kernel_kind`)."""

from __future__ import annotations

import torch


def held_bytes(model, opt) -> dict:
    """Bytes the rank holds between steps, by what holds them: its parameter shards, the
    optimizer's state, and the rest of ``torch.cuda.memory_allocated()``."""
    params = sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() for p in model.parameters())
    state = sum((v.to_local() if hasattr(v, "to_local") else v).untyped_storage().nbytes()
                for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    total = torch.cuda.memory_allocated()
    return dict(params_bytes=params, optimizer_bytes=state, other_bytes=total - params - state, allocated_bytes=total)


def kernel_kind(name: str) -> str:
    """``gemm``, ``attention`` or ``other`` from a CUDA kernel's name (cuBLAS/CUTLASS GEMMs:
    gemm, nvjet, xmma, cutlass; flash/fmha/attention kernels).

    >>> [kernel_kind(x) for x in ("nvjet_tst_128x256_64x4", "flash_fwd_kernel", "vectorized_elementwise_kernel")]
    ['gemm', 'attention', 'other']
    """
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass")):
        return "gemm"
    return "other"


def profiled(step, cuda: bool) -> dict:
    """One ``step`` under torch.profiler: device seconds and kernel counts by :func:`kernel_kind`,
    and the 25 kernels of most device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    kinds: dict = {}
    names: dict = {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) or 0
            k = kinds.setdefault(kernel_kind(e.name), [0.0, 0])
            k[0] += us * 1e-6
            k[1] += 1
            n = names.setdefault(e.name[:90], [0.0, 0])
            n[0] += us * 1e-6
            n[1] += 1
    top = sorted(names.items(), key=lambda x: -x[1][0])[:25]
    return dict(kinds={k: dict(seconds=v[0], kernels=v[1]) for k, v in kinds.items()},
                top=[dict(name=n, seconds=v[0], calls=v[1]) for n, v in top])
