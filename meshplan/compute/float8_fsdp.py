"""torchao's float8 work around FSDP2's all-gather (``training.fp8_all_gather``): the
``precompute_float8_dynamic_scale_for_fsdp`` pass after the optimizer (one read of every local float8
weight shard, its amaxes all-reduced over fsdp and tp) and ``fsdp_pre_all_gather``'s eager cast of
each local shard before its all-gather, as memory-bound kernels (bytes, seconds).

Sources (read, not copied): pytorch/ao at eab345c ``torchao/float8/fsdp_utils.py``
(``precompute_float8_dynamic_scale_for_fsdp``: ``torch._foreach_norm(weights, inf)`` and one
all-reduce of the stacked amaxes; ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``: the
cast with the precomputed scale), as :mod:`meshplan.compute.float8`'s docstring describes them.
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.measured import KernelData, memory_kernel_seconds


def precompute_bytes(float8_weight_numel: int, param_bytes: int) -> int:
    """HBM bytes of ``precompute_float8_dynamic_scale_for_fsdp``'s ``torch._foreach_norm(weights,
    inf)`` over a rank's local shards of the float8 weights (``float8_weight_numel`` elements
    held in ``param_bytes`` each): one read; the stacked amaxes and scales are a few elements.

    >>> precompute_bytes(1_000_000, 4)
    4000000
    """
    return float8_weight_numel * param_bytes


def precompute_all_reduces(tp: int) -> tuple[str, ...]:
    """The mesh dims the precompute's stacked amaxes are all-reduced over, in order (module
    docstring: DTensor's ``redistribute`` reduces a Partial placement per mesh dim, eab345c
    ``fsdp_utils.py`` "it will issue a single all-reduce" on a 1-D FSDP mesh).

    >>> precompute_all_reduces(1), precompute_all_reduces(8)
    (('fsdp',), ('fsdp', 'tp'))
    """
    return ("fsdp", "tp") if tp > 1 else ("fsdp",)


def pre_all_gather_kernels(param_bytes: int) -> list[tuple[str, int]]:
    """(kernel, bytes per element) of ``fsdp_pre_all_gather``'s eager cast of one local weight
    shard held in ``param_bytes`` a value, with the precomputed scale (:mod:`meshplan.compute.float8`'s docstring).

    >>> pre_all_gather_kernels(4)
    [('* scale', 8), ('clamp', 8), ('to float8', 5)]
    >>> sum(nb for _, nb in pre_all_gather_kernels(2))
    27
    """
    up = [] if param_bytes == 4 else [("to float32", param_bytes + 4)]
    return up + [("* scale", 8), ("clamp", 8), ("to float8", 5)]


def pre_all_gather_seconds(shard_numels: list[int], param_bytes: int, data: Optional[KernelData],
                           datasheet_bytes_per_s: float) -> float:
    """Seconds of the pre-all-gather casts of one FSDP unit before its all-gather: each kernel
    of :func:`pre_all_gather_kernels` on each float8 weight's local shard (``shard_numels``
    elements), timed as every memory-bound kernel (:func:`meshplan.compute.measured.memory_kernel_seconds`).

    Llama 3 8B's layer over dp_shard 8: 218,103,808 / 8 float8 weight elements in 7 shards,
    fp32, 21 B each: 572.5 MB, 192.8 us at the H100's Triad (2.97 TB/s), 215.9 us with the 4.7 us
    issue floor under the small kernels (wk's and wv's three, wq's and wo's ``.to(float8)``):

    >>> from meshplan.compute.measured import kernel_data
    >>> shards = [n // 8 for n in (4096 * 4096, 1024 * 4096, 4096 * 14336)]
    >>> round(pre_all_gather_seconds([shards[0]] * 2 + [shards[1]] * 2 + [shards[2]] * 3, 4,
    ...                              kernel_data("h100-sxm5-80gb"), 3.35e12) * 1e6, 1)
    215.9
    """
    return sum(memory_kernel_seconds(data, n * nb, datasheet_bytes_per_s)
               for n in shard_numels if n > 0 for _, nb in pre_all_gather_kernels(param_bytes))
