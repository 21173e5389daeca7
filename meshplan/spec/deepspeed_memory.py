"""DeepSpeed ZeRO's memory defaults and rules (deepspeedai/DeepSpeed edaa722): the ZeRO-1/2
gradient bucket's default size and the bytes its buckets hold during a backward, ZeRO-3's
prefetch bucket and live-parameter defaults, and the bytes its parameter coordinator
prefetches after a fetch and ``torch.cat`` copies out. The ``[memory]`` fields that set them
are :class:`meshplan.spec.memory.MemoryOptions`'s."""

from __future__ import annotations

import numpy as np

from meshplan.spec.deepspeed_reuse import frontier_bytes
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


#: DeepSpeed's ``zero_optimization.reduce_bucket_size`` default, elements (deepspeedai/DeepSpeed
#: edaa722 ``runtime/zero/config.py``: ``reduce_bucket_size: int = Field(pp_int(5e8), ge=0)``): the
#: bucket of ``training.zero12_engine = "deepspeed"`` when ``grad_bucket_elements`` is unset.
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
#: DeepSpeed's ZeRO-3 ``zero_optimization.sub_group_size`` default, elements (edaa722
#: ``runtime/zero/config.py:175``, ``pp_int(1e9)``; not modelled: :func:`meshplan.interop.deepspeed_zero.sub_group_note`).
DEEPSPEED_SUB_GROUP_ELEMENTS = 10**9
#: DeepSpeed ZeRO-3's ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` defaults,
#: elements (deepspeedai/DeepSpeed edaa722 ``runtime/zero/config.py:215, 238``: 5e7 and 1e9).
DEEPSPEED_PREFETCH_ELEMENTS = 50_000_000
DEEPSPEED_MAX_LIVE_ELEMENTS = 1_000_000_000


def deepspeed_ahead_bytes(prefetch_live: tuple[int, int], held_bytes: int, layer_params: tuple[int, ...] = ()) -> int:
    """Bytes DeepSpeed ZeRO-3's coordinator holds gathered past the unit it computes once its
    prefetch has run ahead (``held_bytes``: the bytes gathered besides, the unit computed and any
    kept; ``prefetch_live``: (prefetch bucket, max live) bytes; ``layer_params``: a layer's
    parameters' bytes in trace order, the layers past the unit alike; empty: the frontier to the
    byte): the one rule the step's prefetch
    (:func:`deepspeed_prefetch_ahead`, held a layer: the same bytes) and the memory timeline
    (:func:`meshplan.memory.deepspeed_fetch.deepspeed_prefetch`, held the units it holds
    gathered) share.

    ``__n_available_params`` (deepspeedai/DeepSpeed edaa722
    ``runtime/zero/partitioned_param_coordinator.py``) counts the full elements (``ds_numel``) of
    every parameter whose all-gather was issued, on demand or prefetched, from its issue
    (``__all_gather_params_``, :582-593) until its module's release partitions it again
    (``__release_param``, :624-630, after the module's forward or backward); persistent parameters
    are never gathered there and do not count. Each ``fetch_sub_module`` (:353-490) gathers its
    module's parameters, then prefetches from the trace's queue while fewer than
    ``min(max_live - available, bucket)`` elements are taken (at least one parameter, none when
    that is <= 0): once running ahead, every release is topped up again, so the layer computed
    plus the parameters prefetched reach ``max_live`` and run on to the end of the parameter that
    reaches it (the limit is checked before a parameter is taken, :457 ``while self.__param_queue
    and numel_prefetching < max_params_to_prefetch``: up to one parameter past). Hence:

    - bucket 0 (``if self.__prefetch_bucket_sz > 0``, :452) or a max live that holds no more than
      ``held``: 0, every gather on demand;
    - else ``max_live - held`` run on to the next parameter boundary past it
      (:func:`meshplan.spec.deepspeed_reuse.frontier_bytes`).

    A layer of 33,558,528 B (4 x 1024^2 + 3 x 1024 x 4096 + 2 x 1024 parameters in bf16): bucket 0,
    and max live 2 and 4 layers, then 1.5 layers (a part of the next layer):

    >>> u = 33_558_528
    >>> [deepspeed_ahead_bytes(p, u) for p in ((0, 4 * u), (10**7, 2 * u), (10**9, 4 * u), (10**7, 3 * u // 2))]
    [0, 33558528, 100675584, 16779264]

    With the layer's parameters in trace order (a norm, q, k, v, o, a norm, gate, up, down; bytes),
    half a layer past the one computed (16,779,264 B) ends in the gate projection, 2 x 2,048 +
    4 x 2,097,152 B before it: the gate's 8,388,608 B taken whole, 16,781,312 B (2,048 past); max live
    1.2 layers (6,711,705 B past the layer) ends in the o projection, 4 x 2,097,152 + 2,048 B:

    >>> p = (2048,) + (2 * 1024 ** 2,) * 4 + (2048,) + (2 * 1024 * 4096,) * 3
    >>> deepspeed_ahead_bytes((10**7, 3 * u // 2), u, p), deepspeed_ahead_bytes((10**7, 6 * u // 5), u, p)
    (16781312, 8390656)
    """
    prefetch, live = prefetch_live
    if prefetch <= 0 or held_bytes <= 0 or live <= held_bytes:
        return 0
    return frontier_bytes(live - held_bytes, layer_params)


def deepspeed_prefetch_ahead(prefetch_live: tuple[int, int], unit_bytes: int, layer_params: tuple[int, ...] = ()) -> float:
    """Layers of parameters DeepSpeed ZeRO-3's coordinator holds gathered or in flight past the
    layer it computes when that layer starts (``unit_bytes``: a layer's gathered bytes;
    ``prefetch_live``: (prefetch bucket, max live) bytes; ``layer_params``: the layer's
    parameters' bytes, :func:`deepspeed_ahead_bytes`'): :func:`deepspeed_ahead_bytes` in
    layers, fractional, the one number the step (:class:`meshplan.schedule.layer_prefetch.LayerPrefetch`'s
    ``ahead``) and the memory timeline (:func:`meshplan.memory.deepspeed_fetch.deepspeed_prefetch`,
    the same bytes) use.

    What is gathered (deepspeedai/DeepSpeed edaa722 ``runtime/zero/partitioned_param_coordinator.py``):
    ``__n_available_params`` counts each parameter's ``ds_numel`` from its issue
    (``__all_gather_params_``, :593) to its release (``__release_param``, :630, from
    ``release_sub_module`` after its module's forward or backward); each ``fetch_sub_module``
    (:353-490) gathers its module's parameters, then prefetches from the trace's queue while
    fewer than ``min(max_live - available, bucket)`` elements are taken (:453-457; none when that
    is <= 0, else at least one parameter). So at every module's fetch the module computed plus
    the parameters ahead of it reach ``max_live`` (one parameter over at most), never more: at a
    layer's first module ``max_live - layer`` of the layers after it, 0.14 of a layer at
    max live 1.14 layers, not a whole one. As the layer's modules are released one by one, the
    next fetches top the frontier up again, so during the layer the rest of the next layer's
    gather is issued (a window of ``max_live`` sliding module by module): that timing is
    :class:`~meshplan.schedule.layer_prefetch.LayerPrefetch`'s ``slide``, not more bytes.

    - bucket 0, or a max live that does not hold more than the layer computed: 0;
    - else ``(max_live - layer) / layer``.

    A 30B layer (6656 hidden, 17920 gated FFN, 2 norms: 535,049,216 parameters, 1,070,098,432 B in
    bf16), max live 1e9 elements (2e9 B): buckets 0, 5e6 and 5e8 elements (0.869 of the next
    layer whatever the bucket beyond 0); max live 3e9:

    >>> [round(deepspeed_prefetch_ahead((b * 2, 2 * 10**9), 1_070_098_432), 3) for b in (0, 5 * 10**6, 5 * 10**8)]
    [0.0, 0.869, 0.869]
    >>> round(deepspeed_prefetch_ahead((10**8, 6 * 10**9), 1_070_098_432), 3)
    4.607

    A max live of 5e8 elements (1e9 B) holds less than that layer: none ahead.

    >>> deepspeed_prefetch_ahead((10**8, 10**9), 1_070_098_432)
    0.0
    """
    return deepspeed_ahead_bytes(prefetch_live, unit_bytes, layer_params) / unit_bytes


def deepspeed_copied_bytes(unit_bytes: int, prefetch_live: tuple[int, int], layer_bytes: int,
                           layer_params: tuple[int, ...] = ()) -> int:
    """Bytes of one DeepSpeed ZeRO-3 fetch of a ``unit_bytes`` unit that ``torch.cat`` copies out of
    the all-gather buffer, counted as one bucket of its prefetched part:
    ``min(unit, bucket, max live - layer)`` (``layer_bytes``: a layer's gathered bytes;
    :func:`deepspeed_ahead_bytes`, 0 without prefetch, run on to ``layer_params``' boundary); the memory timeline's second copy of a
    prefetched part at its wait is the same bytes. A coalesced gather's
    ``AllGatherCoalescedHandle.wait`` (``partition_parameters.py:750-784``) sets each
    ``param.data = torch.cat(partitions)``; what the fetch gathers on demand is views of its buffer.

    An upper bound at large buckets: ``all_gather_coalesced`` sends a group of one parameter to
    ``_all_gather_sequential`` (``partition_parameters.py:1570``, ``len(params) == 1``; :1345-1376,
    ``param.data = param_buffer.narrow(...)``, no copy), and once the frontier is at max live
    each fetch's top-up is ``min(max_live - available, bucket)``, the room its module's release
    freed (about one weight, coordinator :453), often one parameter, which copies nothing; a
    bucket's worth is taken, and copied, while the frontier runs up to max live (a pass's
    first fetches) or where max live is not reached. Which top-ups hold two or more parameters
    depends on the weights' order and sizes, which meshplan's layer-sized units do not keep: not
    modelled, so a bucket above a weight's size overcounts the copy-out by up to
    ``min(unit, bucket)`` per layer fetch (docs/foreign-configs.md's 30B example: 5e8 steps 4.65 ms slower than 5e6).

    Llama 3 8B's layer in bf16 (436,224,000 B), DeepSpeed's defaults 5e7 and 1e9 elements x 2 B:
    1e8 B; ``stage3_max_live_parameters`` 2.5e8: (2.5e8 - 218,112,000) x 2 B; 2e8 (below the layer)
    and bucket 0: none:

    >>> [deepspeed_copied_bytes(436_224_000, p, 436_224_000) for p in ((10**8, 2 * 10**9), (10**8, 5 * 10**8),
    ...     (10**8, 4 * 10**8), (0, 2 * 10**9))]
    [100000000, 63776000, 0, 0]
    """
    return min(unit_bytes, prefetch_live[0], deepspeed_ahead_bytes(prefetch_live, layer_bytes, layer_params))


def deepspeed_bucket_bytes(bucket_elements: int, training: TrainingSpec, params_numel):
    """Bytes DeepSpeed ZeRO-1/2 holds for its gradient buckets during a backward
    (``training.zero12_engine = "deepspeed"``; deepspeedai/DeepSpeed edaa722
    ``runtime/zero/stage_1_and_2.py``), with ``B`` = ``bucket_elements``
    (:meth:`meshplan.spec.memory.MemoryOptions.deepspeed_bucket_elements`) and
    ``k = min(B, params_numel)`` (``params_numel``: the rank's parameter elements, an int or
    a numpy array):

    - the ipg buffers, with ``contiguous_gradients`` (:attr:`~meshplan.spec.training.TrainingSpec.contiguous_grads`,
      DeepSpeed's default true): ``setup_buckets`` (2493-2516) allocates ``torch.empty(reduce_bucket_size)``
      in the model dtype (``self.dtype``, the parameter dtype) at a backward's first gradient hook,
      and a second one with ``overlap_comm`` ("double buffers"): ``B x param bytes`` once
      or twice, whatever the model's size. Without it none: the hooks keep each ``param.grad``
      where autograd wrote it and ``reduce_ipg_grads`` (1691-1716) reduces the bucket through
      ``buffered_reduce_fallback``, whose ``allreduce_bucket`` flattens it as below;
    - the bucket being reduced: ``allreduce_bucket`` flattens its gradient slices into one
      new tensor (``self.flatten``) and casts it to ``communication_data_type`` when that
      differs from the gradients' dtype (``tensor.to(...)``): ``k x param bytes`` plus
      ``k x reduce bytes`` with a cast (counted whatever the slices: one slice is not
      copied; a bucket spanning a partition boundary, the usual case at dp > 1, is).

    An extra-large parameter (more than ``B`` elements) is reduced from its own gradient
    and flattened in pieces of up to its size: counted as ``k`` here.

    bf16, B 5e8, overlap_comm: 2 buffers + one flattened bucket, 3 x 5e8 x 2 B = 3 GB:

    >>> B = DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", overlap_comm=True)
    >>> deepspeed_bucket_bytes(B, t, 8 * 10**9)
    3000000000
    >>> deepspeed_bucket_bytes(B, t.model_copy(update={"grad_reduce_dtype": "fp32",
    ...     "overlap_comm": False}), 10**8) == 5 * 10**8 * 2 + 10**8 * (2 + 4)
    True

    ``BF16_Optimizer`` (:attr:`~meshplan.spec.training.TrainingSpec.bf16_optimizer`) has no ipg
    buffer and reduces nothing in the backward: 0 here, its step's bucket is
    :func:`meshplan.memory.buffers.bf16_step_bucket_bytes`.

    ``contiguous_gradients`` false: the flattened bucket alone, 5e8 x 2 B = 1 GB:

    >>> deepspeed_bucket_bytes(B, t.model_copy(update={"contiguous_gradients": False}), 8 * 10**9)
    1000000000
    """
    if training.bf16_optimizer:  # no ipg buffer, no bucket in the backward: the step's, memory.buffers.bf16_step_bucket_bytes
        return 0 * params_numel
    big_b, p = bucket_elements, dtype_bytes(training.param_dtype)
    cast = dtype_bytes(training.gradient_reduce_dtype) if training.gradient_reduce_dtype != training.param_dtype \
        else 0
    k = np.minimum(big_b, params_numel)
    ipg = (2 if training.overlaps_comm else 1) if training.contiguous_grads else 0
    out = big_b * p * ipg + k * (p + cast)
    return out if np.ndim(out) else int(out)
