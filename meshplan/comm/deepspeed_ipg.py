"""DeepSpeed ZeRO-3's gradient reduce-scatters per ipg bucket (``training.zero3_engine =
"deepspeed"``, DeepSpeed >= v0.5.5): how many calls a layer's gradients take, and of what size,
for ``zero_optimization.reduce_bucket_size`` (``[memory] grad_bucket_elements``, unset
DeepSpeed's 5e8: :meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_bucket_elements`).

Read in deepspeedai/DeepSpeed at edaa722 (``deepspeed/runtime/zero/stage3.py``):

- Each parameter's gradient hook runs ``reduce_independent_p_g_buckets_and_remove_grads``
  (lines 1519-1539): when the bucket holds gradients and this one would take it past
  ``reduce_bucket_size`` elements (``bucket.elements + param.ds_numel > self.reduce_bucket_size
  and bucket.elements > 0``, 1533-1535), the bucket is reduced first
  (``__reduce_and_partition_ipg_grads``), then the gradient joins it (``__add_grad_to_ipg_bucket``;
  one past the bucket's size is a bucket of its own). The backward's end reduces the rest
  (``independent_gradient_partition_epilogue``, 1357-1360). The buckets run across layers: a
  bucket is not flushed at a layer's end.
- A bucket is reduced by one ``reduce_scatter_coalesced`` (``__avg_scatter_grads``, 1791-1813,
  with ``reduce_scatter`` true, DeepSpeed's default): ``runtime/comm/coalesced_collectives.py``
  158-207 pads each gradient to a multiple of the world (``math.ceil(numel / world_sz)`` per
  rank), concatenates them rank-major and issues one reduce-scatter of the flat buffer: one call
  per bucket of ``sum(padded(numel))`` elements in the reduce dtype.

The packing is :func:`meshplan.comm.deepspeed.grad_buckets`' (the same hook since v0.3.13). A
Llama layer's gradients come in backward order (its tensors reversed: w_down, w_up, w_gate, the
MLP norm, wo, wv, wk, wq, the attention norm), so at the HF Trainer's ``"auto"`` bucket ``h^2``
(Llama 3 70B: 67,108,864 elements) each of the three 234,881,024-element MLP weights is a bucket
of its own, wo (exactly h^2) another, wk and wv one together, wq one, and each norm one: 8 calls
a layer where one per layer was planned before (newcomer trial nc52 #14); at DeepSpeed's 5e8, 2.
"""

from __future__ import annotations

from collections import Counter

from meshplan.comm import deepspeed
from meshplan.comm.stage_context import StageContext
from meshplan.spec.memory import MemoryOptions
from meshplan.units import dtype_bytes

#: Cadence words of a layer's reduce-scatter row per ipg bucket; the rank timeline sums the rows'
#: seconds into the layer's reduction (:func:`meshplan.schedule.comm_times`).
IPG = "ipg bucket of"


def layer_buckets(layer: list[int], n: int, cap: int, world: int) -> list[tuple[int, int, int]]:
    """[(a bucket's padded elements, its gradients, calls)] of the reduce-scatters of ``n`` layers
    whose tensors have ``layer`` elements (in registration order), gradients in backward order
    layer after layer, packed into buckets of ``cap`` elements (``reduce_bucket_size``), each
    gradient padded to a multiple of ``world`` (module docstring); the largest bucket first.

    Llama 3 70B (h 8192, kv 1024, ffn 28672; attention norm, wq, wk, wv, wo, MLP norm, w_gate,
    w_up, w_down), 2 layers over 256 ranks at the HF Trainer's bucket h^2 = 67,108,864: each
    234,881,024-element MLP weight alone (3 a layer), wo = h^2 alone, wv + wk 16,777,216 together,
    wq alone, each norm (8,192, padded to 8,192) alone: 8 calls a layer, 16:

    >>> h, kv, f = 8192, 1024, 28672
    >>> llama = [h, h * h, h * kv, h * kv, h * h, h, h * f, h * f, h * f]
    >>> layer_buckets(llama, 2, h * h, 256)
    [(234881024, 1, 6), (67108864, 1, 4), (16777216, 2, 2), (8192, 1, 4)]

    At DeepSpeed's default 5e8: w_down + w_up (469,762,048), then w_gate with the rest of the layer
    (234,881,024 + 2 x 67,108,864 + 2 x 8,388,608 + 2 x 8,192 = 385,892,352; the next layer's
    w_down would take it past 5e8): 2 calls a layer:

    >>> [(size, k) for size, _, k in layer_buckets(llama, 2, 500_000_000, 256)]
    [(469762048, 2), (385892352, 2)]
    """
    order = [k for _ in range(n) for k in reversed(layer)]
    buckets = deepspeed.grad_buckets(list(enumerate(order)), cap)
    calls: Counter = Counter((sum(deepspeed.padded(k, world) for _, k in b), len(b)) for b in buckets)
    return [(size, tensors, k) for (size, tensors), k in sorted(calls.items(), reverse=True)]


def bucket_rows(add, c: StageContext, layer: list[int], n: int, cadence: str, red: tuple, in_s: float) -> None:
    """The reduce-scatter rows of ``n`` layers (tensors of ``layer`` elements) under DeepSpeed's
    ZeRO-3, one per bucket size (:func:`layer_buckets`, ``reduce_bucket_size`` from ``[memory]
    grad_bucket_elements``, unset DeepSpeed's 5e8); ``red``: the layers' (per micro-batch, per
    step) calls (``fsdp_rows._call_counts``), each layer's now its buckets'; ``in_s``: one
    layer's gradient copy into the bucket (seconds), each call its share."""
    rs = c.training.gradient_reduce_dtype
    cap = MemoryOptions(grad_bucket_elements=c.bucket_elements).deepspeed_bucket_elements()
    rows = layer_buckets(layer, n, cap, c.mesh.degree("fsdp"))
    total = sum(size * k for size, _, k in rows) or 1
    for size, tensors, k in rows:
        add("fsdp", "backward", "reduce-scatter", size * dtype_bytes(rs), rs, k if red[0] else 0,
            f"{cadence} ({IPG} {tensors} gradient(s), reduce_bucket_size {cap:,})", "optimizer step",
            per_step=None if red[1] is None else k * (red[1] // max(n, 1)), ds_gpu_s=in_s * n * size / total)
