"""DeepSpeed ZeRO stage 3 as released in 2021 (``training.zero3_engine = "deepspeed-2021"``): the
collectives it issues per micro-batch, one all-gather per parameter tensor, one all-reduce per
gradient bucket (or, with ``contiguous_gradients``, one reduce-scatter per gradient), and the
persistent parameters' gather per step.

Read in microsoft/DeepSpeed at v0.3.13 (2021-03-16; the same gathers through v0.5.4, Oct 2021:
v0.5.5 coalesced the all-gathers, PR #1188; the gradient path follows ``contiguous_gradients``:
false, v0.3.13's default to v0.4.2, all-reduces buckets; true, the default from v0.4.3,
reduce-scatters each gradient),
the engine Narayanan et al. (SC'21, arXiv 2104.04473, section 5.2) integrated into Megatron-LM
for their ZeRO-3 comparison (Table 2):

- ``runtime/zero/stage3.py`` ``PartitionedParameterCoordinator.fetch_sub_module``: a module's
  forward pre-hook all-gathers each of its own parameters that is not available, one
  ``partition_parameters.py`` ``_allgather_param`` per parameter tensor (one
  ``torch.distributed.all_gather`` over the whole data-parallel group, its output a list of
  ``world`` partition views, no coalescing), waits for them (``_synchronize_communication``:
  ``handle.wait()``, ``torch.cuda.synchronize()``) and ``release_sub_module`` re-partitions
  them after the module's forward. The backward pre-hook fetches them again
  (``pre_sub_module_backward_function``), so every gathered parameter is all-gathered in
  forward and again in backward; under activation checkpointing the replayed forward fires
  the forward hooks again: one more gather in backward.
- A parameter stays gathered between two uses when the elements of the parameters used in
  between are fewer than ``stage3_max_reuse_distance`` (``_keep_for_later``,
  ``get_reuse_distance_in_numel``): :data:`MAX_REUSE_DISTANCE`. Under full recompute this keeps
  the layer's last module (its replayed forward is followed at once by its backward).
- Parameters with fewer elements than ``stage3_param_persistence_threshold``
  (:data:`PERSISTENCE_THRESHOLD`) are never partitioned (``persistent_parameters``): no gather
  (norm weights and biases, linear biases).
- Gradients (``contiguous_gradients`` false, stage 3's default from v0.3.12 to v0.4.2:
  ``ZERO3_OPTIMIZATION_CONTIGUOUS_GRADIENTS_DEFAULT``, set true by c9fee8214, 2021-07-01, PR
  #1199, first in v0.4.3): each parameter's gradient hook
  (``reduce_independent_p_g_buckets_and_remove_grads``) first reduces the bucket when the
  parameter would take it past ``reduce_bucket_size`` elements (default 5e8: ``[memory]
  grad_bucket_elements``, :meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_bucket_elements`), then
  adds it; ``reduce_ipg_grads`` -> ``buffered_reduce_fallback`` -> ``allreduce_bucket``
  flattens the bucket's gradients, divides by the world and runs one
  ``torch.distributed.all_reduce`` of the flat buffer, then copies it back into each
  gradient (:func:`grad_buckets`, :func:`bucket_copy_seconds`, :func:`bucket_host_seconds`);
  ``partition_previous_reduced_grads`` then keeps each rank's slice. Persistent parameters
  included, in the gradient's dtype (``param.grad``, the parameter dtype).
- Gradients with ``contiguous_gradients`` true (``training.contiguous_gradients``; the default
  from v0.4.3 to v0.5.4): the same buckets (the same hook), but the hook copies each gradient
  no larger than the bucket into the ipg buffer of ``reduce_bucket_size`` elements, and
  ``reduce_ipg_grads`` -> ``average_tensor`` divides the whole buffer (and a gradient past the
  bucket) by the world and reduce-scatters each parameter's gradient on its own
  (``reduce_gradients_at_owner`` -> ``partition_parameters.py`` ``_reduce_scatter_gradients``:
  one list-based ``torch.distributed.reduce_scatter`` of ``world`` views per parameter, all
  issued, then waited for) (:func:`contiguous_gpu_seconds`, :func:`contiguous_host_seconds`).
  ``reduce_ipg_grads`` and ``average_tensor`` are the same at v0.3.13 (lines 1431-1514,
  1689-1718), v0.4.3 (bc451c09) and v0.5.4 (bc7778ea), which only skips an empty bucket's
  flush (line 1917); the ``reduce_scatter`` default true (``ZERO_OPTIMIZATION_REDUCE_SCATTER_DEFAULT``).
- Persistent parameters: ``backward`` ends with ``_partition_all_parameters`` (they too are
  partitioned) and the optimizer step's ``_post_step`` gathers them again, all at once and
  synchronously (``partition_parameters.py`` ``_allgather_params``): one list-based
  all-gather of their partitions side by side, then, for each parameter and each rank whose
  slice holds elements, a Python ``narrow``, ``view``, ``narrow`` and ``copy_`` into the
  replicated tensor: ``persistent x world`` copies issued one by one every step
  (:func:`persistent_gather_host_seconds`).
- Each gather's buffer is ``torch.zeros`` of the padded parameter, then
  ``torch.cuda.synchronize()`` before the all-gather is issued (``_allgather_param``): the
  host waits for the zero fill (:func:`zero_fill_seconds`) after the fetch's own
  synchronize has drained the device.
- Each parameter is padded to a multiple of the world (``_aligned_size``).
- Prefetch (``prefetch_next_sub_modules``) after a fetch, only when nothing is in flight, of the
  next parameters of the recorded trace up to ``stage3_prefetch_bucket_size`` = 5e7 elements
  (:data:`PREFETCH_BUCKET`): one weight ahead once every weight has h^2 >= 5e7 elements
  (h >= 7,072; GPT-3 175B). The rank timeline keeps its one-unit-ahead prefetch (a layer's
  gathers overlap the previous layer's compute); with the gathers much longer than the compute
  the exposed time is the same.
- ``torch.cuda.synchronize()`` ends every fetch, so it also waits for the reduce-scatters in
  flight (the step model turns ``Overlap.grad_reduce`` off for this engine).
- NCCL of 2021 (2.8-2.9) ran all-gather and reduce-scatter on rings only (``tuning.cc``
  v2.9.9-1): the table times them with ``nccl_era = "2021"`` (no hierarchical algorithm).

torch's ProcessGroupNCCL of 2021 (``allgather`` with a list of outputs, ``reduce_scatter`` with a
list of inputs; torch 1.8/1.9 ``ProcessGroupNCCL.cpp``) stages the list through one flat buffer
(``flatten_for_scatter_gather``) and copies each of the ``world`` pieces out (all-gather) or in
(reduce-scatter) with its own ``copy_`` on the NCCL stream: ``world`` copy kernels per call,
issued by the host (:func:`host_seconds`) and run on the GPU (:func:`list_copy_seconds`).
Defaults: v0.3.13 ``runtime/zero/constants.py``; code read in microsoft/DeepSpeed at tag v0.3.13
(12a53b43833b7bea279a205e313f2bd3f0cdfd99): ``runtime/zero/stage3.py``,
``runtime/zero/partition_parameters.py``, ``runtime/zero/config.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, TypeVar

from meshplan.compute.measured import KernelData, memory_seconds

#: ``stage3_param_persistence_threshold`` default (elements): smaller parameters are never
#: partitioned (DeepSpeed v0.3.13 ``runtime/zero/constants.py``).
PERSISTENCE_THRESHOLD = 100_000
#: ``stage3_max_reuse_distance`` default (elements), same file.
MAX_REUSE_DISTANCE = 1_000_000_000
#: ``stage3_prefetch_bucket_size`` default (elements), same file.
PREFETCH_BUCKET = 50_000_000
#: Marks the table rows of this module (the rank timeline sums their calls per layer).
CADENCE = "per parameter tensor (DeepSpeed ZeRO-3"


def module_of(name: str) -> str:
    """The torch module holding parameter ``name``: a weight and its bias share one.

    >>> module_of("w_up_bias"), module_of("attn_norm")
    ('w_up', 'attn_norm')
    """
    return name[:-5] if name.endswith("_bias") else name


def padded(numel: int, world: int) -> int:
    """Elements of a parameter padded to a multiple of ``world`` (``_aligned_size``).

    >>> padded(12288, 1536), padded(12289, 1536)
    (12288, 13824)
    """
    return -(-numel // world) * world


def layer_calls(params: list[tuple[str, int]], recompute: bool,
                after_numel: int = 0) -> dict[str, tuple[int, int, int]]:
    """``{parameter: (forward all-gathers, backward all-gathers, gradients reduced)}`` per
    micro-batch for one layer's ``params`` ((name, local elements) in forward order), by the
    module docstring's rules. ``recompute``: the layer is replayed in backward (full
    recompute); ``after_numel``: elements of the parameters used after this layer's forward
    and before its backward without recompute (later layers twice, forward and backward,
    and the head).

    GPT-3 175B as Megatron-LM holds a layer (QKV fused; h = 12288), full recompute: 4 weights
    gathered in forward; in backward the replay gathers the 4 again and the backward gathers
    3 (the MLP's second linear, replayed last, is reused at once); 12 gradients reduced (in
    buckets, :func:`grad_buckets`):

    >>> h = 12288
    >>> p = [("attn_norm", h), ("attn_norm_bias", h), ("query_key_value", 3 * h * h),
    ...      ("query_key_value_bias", 3 * h), ("wo", h * h), ("wo_bias", h), ("mlp_norm", h),
    ...      ("mlp_norm_bias", h), ("w_up", 4 * h * h), ("w_up_bias", 4 * h), ("w_down", 4 * h * h),
    ...      ("w_down_bias", h)]
    >>> calls = layer_calls(p, recompute=True)
    >>> [sum(c[k] for c in calls.values()) for k in range(3)]
    [4, 7, 12]
    >>> calls["w_down"], calls["w_up"], calls["wo_bias"]
    ((1, 1, 1), (1, 2, 1), (0, 0, 1))
    """
    order = list(dict.fromkeys(module_of(n) for n, _ in params))
    module_numel: Counter[str] = Counter()
    for n, k in params:
        module_numel[module_of(n)] += k
    out = {}
    for name, numel in params:
        if numel < PERSISTENCE_THRESHOLD:
            out[name] = (0, 0, 1)
            continue
        later = sum(module_numel[m] for m in order[order.index(module_of(name)) + 1:])
        # elements used between this module's last forward use and its backward use:
        # the later modules' forward (replayed) and backward, plus what lies outside the layer
        reuse = 2 * later + (0 if recompute else after_numel)
        backward = (1 if recompute else 0) + (0 if reuse < MAX_REUSE_DISTANCE else 1)
        out[name] = (1, backward, 1)
    return out


#: Host time of one eager PyTorch op issued from Python: ~2 us (S21, pytorch/pytorch issue
#: 41383, ngimel: "~2 us via Python, about half parsing"; public-microbenchmarks.md section 5).
#: DeepSpeed's ``_allgather_param`` / ``_reduce_scatter_gradient`` build their list of ``world``
#: partitions with one ``narrow`` each in a Python loop.
PYTHON_OP_S = 2e-6
#: ``torch.distributed.get_rank(group=...)``'s host time over a ``narrow``'s: 0.45, measured
#: (benchmarks/get_rank_cost.py: torch 2.13, medians 0.43 / 0.47 / 0.43 of three runs). Each
#: iteration of ``_allgather_param``'s loop calls it (v0.3.13 ``partition_parameters.py`` line
#: 626, the same to v0.5.4); ``_reduce_scatter_gradient`` and ``_allgather_params`` do not.
GET_RANK_OF_NARROW = 0.45


def host_seconds(world: int, data: Optional[KernelData], get_rank: bool = False) -> float:
    """Host seconds of one list-based call over ``world`` ranks (module docstring): the Python
    loop of ``world`` partition views (:data:`PYTHON_OP_S` each; with ``get_rank``, as in the
    per-parameter all-gather, plus a ``get_rank`` call each, :data:`GET_RANK_OF_NARROW` of a
    view) and the ``world`` copies
    ProcessGroupNCCL issues on the host right after the collective (the catalog's per-kernel
    issue floor, ``kernels.toml`` ``[host] kernel_issue_s``: S21 + S22). The module's compute is
    enqueued only after them, so the rank timeline adds them to the compute stream. 0 without
    kernel data for the GPU.

    1,536 ranks on an A100 (4.7 us per issued kernel): 1536 x 6.7 us = 10.29 ms per call; the
    all-gather's loop adds 1536 x 0.9 us:

    >>> from meshplan.compute.measured import kernel_data
    >>> a100 = kernel_data("a100-sxm-80gb")
    >>> round(host_seconds(1536, a100) * 1e3, 2), round(host_seconds(1536, a100, get_rank=True) * 1e3, 2)
    (10.29, 11.67)
    """
    if data is None or world <= 1:
        return 0.0
    return world * (PYTHON_OP_S * (1 + GET_RANK_OF_NARROW * get_rank) + data.kernel_issue_s)


def list_copy_seconds(world: int, size_bytes: float, data: Optional[KernelData]) -> float:
    """GPU seconds of the ``world`` copies ProcessGroupNCCL of 2021 runs on the NCCL stream
    around one list-based all-gather or reduce-scatter of a ``size_bytes`` buffer: together
    they read and write the whole buffer, at the GPU's BabelStream Triad rate (the catalog's
    memory-bound rate). 0 without kernel data for the GPU or with one rank.

    A 1.2 GB buffer on an A100 (1.70 TB/s): 2.4 GB, 1.41 ms:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(list_copy_seconds(1536, 1.2e9, kernel_data("a100-sxm-80gb")) * 1e3, 2)
    1.41
    """
    if data is None or world <= 1:
        return 0.0
    return memory_seconds(data, 2 * size_bytes)


def zero_fill_seconds(size_bytes: float, data: Optional[KernelData]) -> float:
    """GPU seconds of ``torch.zeros`` of one gathered parameter's ``size_bytes`` buffer
    (``_allgather_param``), which ``torch.cuda.synchronize()`` makes the host wait for before
    it issues the all-gather: the bytes written at the catalog's memory-bound (Triad) rate. 0
    without kernel data for the GPU.

    QKV of GPT-3 175B in fp16 (3 x 12288^2 x 2 B = 906 MB) on an A100 (1.70 TB/s): 0.53 ms:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(zero_fill_seconds(3 * 12288 ** 2 * 2, kernel_data("a100-sxm-80gb")) * 1e3, 3)
    0.533
    """
    return 0.0 if data is None else memory_seconds(data, size_bytes)


T = TypeVar("T")


def grad_buckets(grads: list[tuple[T, int]], bucket: int) -> list[list[tuple[T, int]]]:
    """The all-reduced buckets of ``grads`` ((tag, elements) in the order their hooks fire,
    the backward's), by ``reduce_independent_p_g_buckets_and_remove_grads``: a gradient that
    would take the bucket past ``bucket`` elements first reduces the bucket (an empty one
    issues nothing), then joins it; the backward's end reduces the rest.

    A GPT-3 175B layer's gradients in backward order (h = 12288), DeepSpeed's default bucket of
    5e8 elements (the 4 h^2 weights go alone):

    >>> h = 12288
    >>> order = [h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h * h, 3 * h, 3 * h * h, h, h]
    >>> [len(b) for b in grad_buckets(list(enumerate(order)), 500_000_000)]
    [1, 1, 1, 1, 5, 3]
    """
    out: list[list[tuple[T, int]]] = []
    cur: list[tuple[T, int]] = []
    filled = 0
    for tag, k in grads:
        if filled + k > bucket and cur:
            out.append(cur)
            cur, filled = [], 0
        cur.append((tag, k))
        filled += k
    return out + ([cur] if cur else [])


#: Cadence words of a gradient reduction's row: the module whose gradient hook flushed its
#: bucket (:func:`flush_modules`), which the rank timeline places it at.
FLUSHED = "flushed at module "
#: :func:`flush_modules`' name for the flush at the backward's end (``independent_gradient_partition_epilogue``).
BACKWARD_END = "backward end"


def flush_modules(buckets: list[list[tuple[tuple[str, str], int]]]) -> list[str]:
    """The module whose gradient hook reduces each of ``buckets`` (from :func:`grad_buckets`,
    tags (unit, module)): the module of the next bucket's first gradient, the one that would
    take the bucket past its size (``reduce_independent_p_g_buckets_and_remove_grads``, v0.3.13
    ``stage3.py`` lines 1433-1436); the last bucket at the backward's end
    (``independent_gradient_partition_epilogue``, line 1280: :data:`BACKWARD_END`).

    GPT-3's w_down (alone), [w_up's bias] and w_up (alone): flushed by w_up's bias, by w_up's
    weight (one module), then at the end:

    >>> b = [[(("layer", "w_down"), 9)], [(("layer", "w_up"), 1)], [(("layer", "w_up"), 9)]]
    >>> flush_modules(b)
    ['w_up', 'w_up', 'backward end']
    """
    return [b[0][0][1] for b in buckets[1:]] + [BACKWARD_END] if buckets else []


def bucket_copy_seconds(size_bytes: float, data: Optional[KernelData]) -> float:
    """GPU seconds on the reduction stream of one bucket's all-reduce besides NCCL's
    (``allreduce_bucket``, ``allreduce_and_copy``): the flatten into one buffer, the in-place
    ``div_`` by the world and the copy back into the gradients, each reading and writing the
    ``size_bytes`` bucket (6 x its bytes) at the catalog's Triad rate. 0 without kernel data.

    A 1.2 GB bucket on an A100 (1.70 TB/s): 7.2 GB, 4.24 ms:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(bucket_copy_seconds(1.2e9, kernel_data("a100-sxm-80gb")) * 1e3, 2)
    4.24
    """
    return 0.0 if data is None else memory_seconds(data, 6 * size_bytes)


def bucket_host_seconds(tensors: int, data: Optional[KernelData]) -> float:
    """Host seconds of reducing one bucket of ``tensors`` gradients: the flatten, the ``div_``
    and the all-reduce (3 ops issued), the unflatten's views and the copies back (a view and
    a copy each), and ``partition_previous_reduced_grads``' slice of each (``narrow``,
    ``_partition_gradient``'s four views and its ``copy_``): (3 + 2 k) issued ops and 6 k Python
    ops (:data:`PYTHON_OP_S`, ``kernels.toml`` ``kernel_issue_s``). Independent of the world:
    no list of partitions. 0 without kernel data.

    One tensor on an A100: 5 x 4.7 + 6 x 2 = 35.5 us:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(bucket_host_seconds(1, kernel_data("a100-sxm-80gb")) * 1e6, 1)
    35.5
    """
    if data is None:
        return 0.0
    return (3 + 2 * tensors) * data.kernel_issue_s + 6 * tensors * PYTHON_OP_S


def persistent_gather_host_seconds(numels: list[int], world: int, data: Optional[KernelData]) -> float:
    """Host seconds of ``_post_step``'s gather of the persistent parameters of ``numels``
    elements each over ``world`` ranks (``partition_parameters.py`` ``_allgather_params``):
    the list-based call (:func:`host_seconds`), this rank's partitions copied in (a ``narrow``
    and a ``copy_`` each), then per parameter a ``torch.empty`` and the ``.data`` swap (2 Python
    ops) and, for each of the ranks whose slice holds elements (``ceil(numel / slice)``), a
    ``narrow``, ``view``, ``narrow`` (:data:`PYTHON_OP_S` each) and a ``copy_`` issued
    (``kernel_issue_s``). 0 without kernel data or with one rank.

    GPT-3 175B at 1,536 ranks: 96 x 8 + 2 = 770 persistent tensors (norms and biases of 12,288
    to 49,152 elements, every one a multiple of 1536), 770 x 1536 = 1,182,720 copies of 10.7 us:
    12.655 s, plus 770 x (6.7 + 4) us and the call's 10.29 ms: 12.67 s per step:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(persistent_gather_host_seconds([12288] * 770, 1536, kernel_data("a100-sxm-80gb")), 2)
    12.67
    """
    if data is None or world <= 1:
        return 0.0
    copies = sum(-(-k // (padded(k, world) // world)) for k in numels)
    own = len(numels) * (PYTHON_OP_S + data.kernel_issue_s + 2 * PYTHON_OP_S)
    return host_seconds(world, data) + own + copies * (3 * PYTHON_OP_S + data.kernel_issue_s)


def contiguous_gpu_seconds(size_bytes: float, bucket_bytes: float, large: bool, first: bool,
                           data: Optional[KernelData]) -> float:
    """GPU seconds on the reduction stream of one gradient's reduce-scatter under
    ``contiguous_gradients`` true besides NCCL's and the list copies' (``stage3.py``
    ``reduce_ipg_grads`` -> ``average_tensor``, v0.3.13 lines 1496-1514 and 1689-1706, the
    same at v0.4.3 and v0.5.4): ``average_tensor`` first runs ``div_`` over the whole ipg
    buffer of ``reduce_bucket_size`` elements (``bucket_bytes``, allocated at that size in
    ``backward``, line 2536, however full the bucket: charged to the bucket's ``first``
    gradient) and over a gradient larger than the bucket (``large``: ``extra_large_param_to_reduce``,
    kept outside the buffer), each read and written at the catalog's Triad rate; then one
    reduce-scatter per gradient (``reduce_gradients_at_owner``). 0 without kernel data.

    The first gradient of a bucket of 5e8 fp16 elements on an A100 (1.70 TB/s): 2 GB read and
    written, 1.18 ms; a 4 h^2 weight of GPT-3 (1.2 GB) alone past the bucket: 1.18 + 1.42 ms:

    >>> from meshplan.compute.measured import kernel_data
    >>> a100 = kernel_data("a100-sxm-80gb")
    >>> round(contiguous_gpu_seconds(1.2e9, 1e9, True, True, a100) * 1e3, 2)
    2.59
    >>> contiguous_gpu_seconds(24576, 1e9, False, False, a100)
    0.0
    """
    if data is None:
        return 0.0
    return memory_seconds(data, 2 * (bucket_bytes * first + size_bytes * large))


def contiguous_host_seconds(size_bytes: float, large: bool, first: bool, data: Optional[KernelData]) -> float:
    """Compute-stream seconds of one gradient under ``contiguous_gradients`` true besides its
    list-based reduce-scatter's (:func:`host_seconds`): the hook
    (``reduce_independent_p_g_buckets_and_remove_grads``, v0.3.13 lines 1455-1462) copies a
    gradient no larger than the bucket into the ipg buffer (``narrow``, ``view``, ``view_as``
    and a ``copy_``: its bytes read and written at the Triad rate on the compute stream, the
    backward's), ``partition_previous_reduced_grads`` keeps the rank's slice (``narrow``,
    ``_partition_gradient``'s four views and its ``copy_``), and the bucket's ``first`` gradient
    issues the buffer's ``div_``; a gradient past the bucket is not copied but divided on its
    own (``div_``): (2 + first) issued ops, 8 Python ops (5 past the bucket). 0 without kernel
    data.

    A 12,288-element fp16 bias, not first, on an A100: 2 x 4.7 + 8 x 2 us and 49 KB copied:
    25.4 us:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(contiguous_host_seconds(24576, False, False, kernel_data("a100-sxm-80gb")) * 1e6, 1)
    25.4
    """
    if data is None:
        return 0.0
    issued, python = 2 + first, 5 if large else 8
    copy = 0.0 if large else memory_seconds(data, 2 * size_bytes)
    return issued * data.kernel_issue_s + python * PYTHON_OP_S + copy

