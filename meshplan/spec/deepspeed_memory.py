"""DeepSpeed ZeRO's memory defaults and rules (deepspeedai/DeepSpeed edaa722): the ZeRO-1/2
gradient bucket's default size and the bytes its buckets hold during a backward, ZeRO-3's
prefetch bucket and live-parameter defaults, and the bytes its parameter coordinator
prefetches after a fetch and ``torch.cat`` copies out. The ``[memory]`` fields that set them
are :class:`meshplan.spec.memory.MemoryOptions`'s."""

from __future__ import annotations

import numpy as np

from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


#: DeepSpeed's ``zero_optimization.reduce_bucket_size`` default, elements (deepspeedai/DeepSpeed
#: edaa722 ``runtime/zero/config.py``: ``reduce_bucket_size: int = Field(pp_int(5e8), ge=0)``): the
#: bucket of ``training.zero12_engine = "deepspeed"`` when ``grad_bucket_elements`` is unset.
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
#: DeepSpeed ZeRO-3's ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` defaults,
#: elements (deepspeedai/DeepSpeed edaa722 ``runtime/zero/config.py:215, 238``: 5e7 and 1e9).
DEEPSPEED_PREFETCH_ELEMENTS = 50_000_000
DEEPSPEED_MAX_LIVE_ELEMENTS = 1_000_000_000


def deepspeed_prefetch_budget(prefetch_live: tuple[int, int], held: int) -> int:
    """Bytes DeepSpeed ZeRO-3's coordinator prefetches after a fetch (deepspeedai/DeepSpeed edaa722
    ``runtime/zero/partitioned_param_coordinator.py:452-480``): ``min(max_live - held,
    prefetch_bucket)``, none below 0; ``prefetch_live``: (prefetch bucket, max live) bytes
    (:meth:`meshplan.spec.memory.MemoryOptions.deepspeed_prefetch_bytes`), ``held``: bytes gathered at the fetch. The one
    rule for the memory model's prefetched part (:meth:`meshplan.memory.passes.PassBuilder._deepspeed_prefetch`)
    and the step's ``torch.cat`` copy of it (:func:`deepspeed_copied_bytes`).

    >>> deepspeed_prefetch_budget((10**8, 2 * 10**9), 436_224_000), deepspeed_prefetch_budget((10**8, 5 * 10**8), 436_224_000)
    (100000000, 63776000)
    """
    prefetch, live = prefetch_live
    return min(prefetch, max(0, live - held))


def deepspeed_prefetch_ahead(prefetch_live: tuple[int, int], unit_bytes: int) -> float:
    """Layers of parameters DeepSpeed ZeRO-3's coordinator has in flight or gathered past the layer
    it computes, in the step's layer-sized units (``unit_bytes``: a layer's gathered bytes;
    ``prefetch_live``: (prefetch bucket, max live) bytes). ``fetch_sub_module``
    (deepspeedai/DeepSpeed edaa722 ``runtime/zero/partitioned_param_coordinator.py:310-490``) runs
    before every module's forward and backward, containers and persistent norms included: it
    gathers the module's own parameters not yet gathered (on demand: the compute waits for them,
    ``current_stream().wait_stream(allgather_stream)``), then, on the same all-gather stream, pops
    the parameters next in the trace's queue and prefetches them while fewer than
    ``min(max_live - available, bucket)`` elements are taken, so at least one parameter per call.
    A Llama or GPT layer makes more such calls than it has gathered weights, so each layer moves
    the prefetch frontier on by more than the layer it consumes: it runs ahead until
    ``max_live`` stops it, whatever the bucket's size beyond 0.

    - bucket 0 (``if self.__prefetch_bucket_sz > 0``), or a max live that does not hold more than
      the layer computed: nothing ahead, every gather on demand: 0;
    - else ``(max_live - layer) / layer``, and at least 1: with less than a layer of room the
      frontier is still ahead by modules, each module's weight gathered during the module before
      it, which at the step's layer granularity is the next layer's gather during this one
      (FSDP2's prefetch of one unit).

    A 30B layer (6656 hidden, 17920 gated FFN, 2 norms: 535,049,216 parameters, 1,070,098,432 B in
    bf16), max live 1e9 elements (2e9 B): buckets 0, 5e6 and 5e8 elements; max live 3e9:

    >>> [deepspeed_prefetch_ahead((b * 2, 2 * 10**9), 1_070_098_432) for b in (0, 5 * 10**6, 5 * 10**8)]
    [0.0, 1.0, 1.0]
    >>> round(deepspeed_prefetch_ahead((10**8, 6 * 10**9), 1_070_098_432), 3)
    4.607

    A max live of 5e8 elements (1e9 B) holds less than that layer: none ahead.

    >>> deepspeed_prefetch_ahead((10**8, 10**9), 1_070_098_432)
    0.0

    The memory timeline still holds a bucket of the next layer per layer fetch
    (:meth:`~meshplan.memory.passes.PassBuilder._deepspeed_prefetch`), less than this frontier
    once it runs ahead: its gathered parameters are a lower bound there.
    """
    prefetch, live = prefetch_live
    if prefetch <= 0 or unit_bytes <= 0 or live <= unit_bytes:
        return 0.0
    return max(1.0, (live - unit_bytes) / unit_bytes)


def deepspeed_copied_bytes(unit_bytes: int, prefetch_live: tuple[int, int], held: int) -> int:
    """Bytes of one DeepSpeed ZeRO-3 fetch of a ``unit_bytes`` unit that ``torch.cat`` copies out of
    the all-gather buffer: its prefetched part, the budget after the fetch before it (``held`` bytes
    gathered then; :func:`deepspeed_prefetch_budget`), as the memory model holds it
    (``AllGatherCoalescedHandle.wait``, ``partition_parameters.py:750-784``); the rest is gathered by
    ``_all_gather_sequential`` (:1339-1376), the parameters views of its buffer, no copy.

    Llama 3 8B's layer in bf16 (436,224,000 B) after a layer, DeepSpeed's defaults 5e7 and 1e9
    elements x 2 B: 1e8 B; ``stage3_max_live_parameters`` 2.5e8: (2.5e8 - 218,112,000) x 2 B:

    >>> deepspeed_copied_bytes(436_224_000, (10**8, 2 * 10**9), 436_224_000)
    100000000
    >>> deepspeed_copied_bytes(436_224_000, (10**8, 5 * 10**8), 436_224_000)
    63776000
    """
    return min(unit_bytes, deepspeed_prefetch_budget(prefetch_live, held))


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

    ``contiguous_gradients`` false: the flattened bucket alone, 5e8 x 2 B = 1 GB:

    >>> deepspeed_bucket_bytes(B, t.model_copy(update={"contiguous_gradients": False}), 8 * 10**9)
    1000000000
    """
    big_b, p = bucket_elements, dtype_bytes(training.param_dtype)
    cast = dtype_bytes(training.gradient_reduce_dtype) if training.gradient_reduce_dtype != training.param_dtype \
        else 0
    k = np.minimum(big_b, params_numel)
    ipg = (2 if training.overlaps_comm else 1) if training.contiguous_grads else 0
    out = big_b * p * ipg + k * (p + cast)
    return out if np.ndim(out) else int(out)
