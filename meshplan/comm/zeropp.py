"""DeepSpeed ZeRO++ (Wang et al., arXiv 2306.10209) on DeepSpeed's ZeRO-3 of today
(``training.zero3_engine = "deepspeed"``): its three switches, their groups, bytes and kernels,
as pure functions the collective table's rows (:mod:`meshplan.comm.zeropp_rows`) and the plan's
checks read. The memory of the secondary partition: :func:`meshplan.memory.buffers.hpz_secondary_bytes`.

Read in deepspeedai/DeepSpeed at edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (2026-08-22):

- **hpZ** (``zero_optimization.zero_hpz_partition_size`` = g > 1, ``training.zero_hpz_partition_size``):
  ``utils/groups.py:859-883`` ``_create_zero_param_parallel_group`` builds the secondary groups
  from *world* ranks, ``[i g, (i + 1) g)`` (:func:`secondary_groups`; g must divide the world,
  ``_ensure_divisibility``). ``partition_parameters.py:1737-1742`` ``_partition``: when a gathered
  parameter is released, ``_partition_param_sec`` (1872-1925) keeps the rank's slice of
  ``aligned numel / g`` elements in the parameter dtype (``ds_secondary_tensor``) the first time
  after it was invalidated (later releases return at once, 1878). ``all_gather_coalesced``
  (1543-1546) gathers from that secondary tensor over the secondary group whenever it exists, so
  per step each parameter is gathered once over the whole data-parallel group (the first forward
  of the step) and every later time (its backward, and every pass of the later micro-batches)
  over its g ranks; ``stage3.py:2566-2577`` ``_post_step`` ends with
  ``invalidate_secondary_tensor`` (706-710), so the next step starts over
  (:func:`hpz_gathers`). Memory: the secondary copy, ``aligned numel / g`` x the parameter's bytes,
  from the first forward to the step's end. The copy that fills it, once per parameter per step
  at its first release (micro-batch 0's forward): ``torch.empty`` of the slice (1887-1888, the
  secondary tensor itself: no other buffer, as ``param.contiguous().view(-1)`` (1908) is a view
  of the gathered parameter, contiguous in its flat all-gather buffer), ``zero_`` of it and
  ``copy_`` of the rank's ``numel / g`` elements from the gathered parameter (1916-1919), on the
  current (compute) stream, then ``get_accelerator().current_stream().synchronize()`` (1922-1923,
  ``accelerator/cuda_accelerator.py:52-59``: CUDA's ``resolves_data_dependency()`` is false): the host waits for the compute stream, which
  then idles while the host issues its next kernel (:func:`hpz_copy_bytes`, :func:`hpz_copy_seconds`).
- **qwZ** (``zero_quantized_weights``, ``training.zero_quantized_weights``): the coordinator
  passes ``quantize=self.zero_quantized_weights`` to every fetch, forward and backward
  (``partitioned_param_coordinator.py:580``), so every parameter all-gather, hpZ's secondary ones
  included, moves int8 (``_all_gather_coalesced``, ``partition_parameters.py:1438-1510``): the
  partitions ``torch.cat`` in the parameter dtype, ``CUDAQuantizer.quantize`` (846-890) casts them
  to fp16 (``param.to(dtype=torch.half)``) and quantizes with one fp32 scale per group of at most
  8,000 elements (``target_group_size``; :func:`weight_quant_groups`), then one all-gather of the
  int8 data (1 B per element, the output ``world x partition`` bytes) and one of the scales. The
  handle's ``wait`` (749-790), on the all-gather stream (``partitioned_param_coordinator.py:400-406``),
  dequantizes into fp16 (``csrc/quantization/pt_binding.cpp:107-135``, ``dequantize<__half>``),
  ``torch.cat`` s the partitions into the parameter and casts it to the parameter dtype
  (:func:`qwz_quantize_bytes`, :func:`qwz_dequantize_bytes`).
- **qgZ** (``zero_quantized_gradients``, ``training.zero_quantized_gradients``): ``stage3.py:1791-1830``
  ``__avg_scatter_grads`` replaces the gradient reduce-scatter with
  ``runtime/comm/coalesced_collectives.py:29-76`` ``all_to_all_quant_reduce`` when the world spans
  more than one node (``num_nodes > 1``, nodes = world / the node's device count). Per gradient: a
  1-D tensor, or one whose elements are not a multiple of 2 x world, is reduce-scattered alone
  (``reduce_scatter_coalesced([tensor])``); any other is quantized to **int4** with
  ``G = max(dim 0, dim 1, world)`` fp32 scales (``swizzle_quant``, ``pt_binding.cpp:226-267``),
  all-to-all'd inside the node (data, then scales; groups ``local_i`` of
  ``utils/groups.py:672-697``: the node's ranks), dequantized, reduced over the node's d copies and
  quantized again to **int4** with G / d scales (``quantized_reduction``, 269-313), all-to-all'd
  across nodes (groups ``global_j``: the ranks of one local index, one per node), dequantized to
  fp16 and the N nodes' chunks summed and divided in Python (:func:`qgz_sizes`,
  :func:`qgz_kernel_bytes`). The source quantizes both hops to 4 bits (``num_bits`` 4 in both
  calls); the paper's text describes the same hierarchy. The kernels read their input as
  ``__half``: 2 bytes per gradient element.

The paper's Figure/Table speedups are no input here: every byte above is the source's, every
kernel is timed as a memory-bound kernel at the catalog's BabelStream Triad rate
(:func:`meshplan.compute.measured.memory_kernel_seconds`), every collective on its group's path.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from meshplan.compute.measured import KernelData, memory_kernel_seconds
from meshplan.units import dtype_bytes

#: Marks the collective table's ZeRO++ rows (:mod:`meshplan.comm.zeropp_rows`); the rank timeline
#: sums a unit's rows (:meth:`meshplan.schedule.comm_times.CommTimes.from_rows`).
MARK = "ZeRO++"
#: ``CUDAQuantizer.target_group_size`` (``partition_parameters.py:848``): qwZ's elements per scale, at most.
WEIGHT_GROUP_ELEMENTS = 8000
#: Bytes of one quantization scale (``torch.float32`` in ``quantize_kernel`` and ``ds_swizzle_quant``).
SCALE_BYTES = 4
#: qgZ's bits per gradient element, both hops (``coalesced_collectives.py:57, 65``: ``num_bits`` 4).
QGZ_BITS = 4
#: Bytes per element the quantization kernels read and write as fp16 (``__half``).
HALF = 2


def secondary_groups(world: int, g: int) -> np.ndarray:
    """hpZ's secondary groups, (world / g, g): consecutive world ranks (``_create_zero_param_parallel_group``).

    >>> secondary_groups(8, 4).tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    return np.arange(world).reshape(world // g, g)


def node_groups(world: int, per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """qgZ's all-to-all groups (``_get_local_all_to_all_group``): (``local_i``, the ranks of each
    node, (nodes, per_node); ``global_j``, one rank of each node at local index j, (per_node, nodes)).

    >>> [a.tolist() for a in node_groups(4, 2)]
    [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
    """
    local = np.arange(world).reshape(world // per_node, per_node)
    return local, local.T.copy()


def hpz_gathers(units: int, micro: int) -> tuple[int, int]:
    """(all-gathers per step over the whole group, over the secondary group) of the forward
    passes of ``units`` units under hpZ with ``micro`` micro-batches: micro-batch 0's forward over
    every rank (no secondary tensor yet), the later ones' over g ranks (module docstring).

    >>> hpz_gathers(32, 4)
    (32, 96)
    """
    return units, units * (micro - 1)


def hpz_copy_bytes(numel: int, g: int, param_dtype: str) -> float:
    """HBM bytes of hpZ's copies into the secondary tensors of ``numel`` gathered elements
    (module docstring): ``zero_`` writes the rank's ``numel / g`` elements, ``copy_`` reads and
    writes them, in the ``param_dtype``'s bytes each (3 x numel / g x bytes; the last rank's
    shorter copy of an unaligned tensor taken whole).

    A Llama 3 8B layer (218,112,000 elements, bf16) at g = 8: 27,264,000 x 2 B x 3 = 163.6 MB:

    >>> hpz_copy_bytes(218_112_000, 8, "bf16")
    163584000.0
    """
    return 3.0 * -(-numel // g) * dtype_bytes(param_dtype)


def hpz_copy_seconds(numel: int, tensors: int, g: int, param_dtype: str, data: Optional[KernelData],
                     hbm_bytes_per_s: float) -> float:
    """Compute-stream seconds of hpZ's secondary copy of one unit of ``tensors`` parameters and
    ``numel`` gathered elements, once a step (micro-batch 0's forward): its :func:`hpz_copy_bytes`
    in ``2 x tensors`` kernels (``zero_``, ``copy_``) at the Triad rate (:func:`kernel_seconds`), and
    per parameter one issue floor (``data.kernel_issue_s``) for the stream ``synchronize()`` after
    it: the stream drains and waits for the host to issue the next kernel, as
    :mod:`meshplan.compute.megatron_cost` times Megatron-LM's ``torch.cuda.synchronize``.

    The layer above in 9 tensors on H100 SXM: 163.6 MB at Triad (2.97 TB/s) is 55.1 us, below the
    18 kernels' issue floors of 4.7 us (84.6 us), plus 9 floors for the synchronizes: 126.9 us:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(hpz_copy_seconds(218_112_000, 9, 8, "bf16", kernel_data("h100-sxm5-80gb"), 3.35e12) * 1e6, 1)
    126.9
    """
    floor = 0.0 if data is None else data.kernel_issue_s
    return kernel_seconds(hpz_copy_bytes(numel, g, param_dtype), 2 * tensors, data, hbm_bytes_per_s) + tensors * floor


def weight_quant_groups(numel: int) -> int:
    """Scales ``CUDAQuantizer.quantize`` takes for ``numel`` elements (``partition_parameters.py:856-881``):
    from ``ceil(numel / 8000)`` up to the first count ``k`` with ``numel % (8 k) == 0``, doubled while
    ``numel % 16 k == 0`` and groups stay above 8,000 elements (never, from that start). For
    ``numel`` not a multiple of 8 no count passes its assertion (DeepSpeed stops there); taken as
    ``ceil(numel / 8000)``, the scales the quantization would hold. 8,192,000 = 8 x 1,024,000: 1,024 from the
    start; 6,291,456 = 2^21 x 3 (a 12288 x 4096 weight over 8 ranks) starts at 787 and stops at the
    first k dividing 2^18 x 3 from there, 1,024 (768 is below):

    >>> weight_quant_groups(8_192_000), weight_quant_groups(12288 * 4096 // 8), weight_quant_groups(2_269_228)
    (1024, 1024, 284)
    """
    k = max(-(-numel // WEIGHT_GROUP_ELEMENTS), 1)
    if numel % 8:
        return k
    while numel % (8 * k):  # ends by k = numel / 8 at the latest
        k += 1
    return k


def qwz_scale_bytes(partition_numel: int) -> int:
    """Bytes of one rank's scales in a qwZ all-gather of ``partition_numel`` elements per rank
    (the scales' own all-gather sends them; the output is ``world`` times this).

    >>> qwz_scale_bytes(8_192_000)
    4096
    """
    return SCALE_BYTES * weight_quant_groups(partition_numel) if partition_numel > 0 else 0


def qwz_quantize_bytes(partition_numel: int, param_dtype: str) -> float:
    """HBM bytes moved on the all-gather stream before one qwZ all-gather of ``partition_numel``
    elements per rank (``_all_gather_coalesced``): the ``torch.cat`` of the partitions (read and
    write the ``param_dtype``'s bytes each), the cast to fp16 (read them, write 2; nothing for an
    fp16 parameter) and the quantize kernel (read 2, write 1, and the scales).

    A bf16 partition of 1M elements: (4 + 4 + 3) MB and 125 scales of 4 B; fp16 skips the cast:

    >>> qwz_quantize_bytes(1_000_000, "bf16"), qwz_quantize_bytes(1_000_000, "fp16")
    (11000500.0, 7000500.0)
    """
    pb = dtype_bytes(param_dtype)
    cast = (pb + HALF) if param_dtype != "fp16" else 0
    return float(partition_numel * (2 * pb + cast + HALF + 1) + qwz_scale_bytes(partition_numel))


def qwz_dequantize_bytes(gathered_numel: int, param_dtype: str) -> float:
    """HBM bytes moved on the all-gather stream after one qwZ all-gather of ``gathered_numel``
    elements (the handle's ``wait``) besides the partitions' ``torch.cat`` into the parameter, which
    the unquantized gather makes too (the engine's copy-out, :func:`meshplan.comm.fsdp_rows._deepspeed_copied`):
    the dequantize kernel (read 1 B, write fp16) and the cast of the fp16 result to the parameter
    dtype (read 2, write the ``param_dtype``'s bytes; nothing for fp16).

    A bf16 layer of 218,112,000 elements: 3 + 4 = 7 B each, 1.527 GB (fp16: 3 B each):

    >>> qwz_dequantize_bytes(218_112_000, "bf16"), qwz_dequantize_bytes(218_112_000, "fp16")
    (1526784000.0, 654336000.0)
    """
    cast = (HALF + dtype_bytes(param_dtype)) if param_dtype != "fp16" else 0
    return float(gathered_numel * (1 + HALF + cast))


def qgz_quantized(numel: int, rows: int, world: int) -> bool:
    """Whether qgZ all-to-alls a gradient of ``numel`` elements and ``rows`` (dim 0; 0 or ``numel``:
    1-D) over ``world`` ranks, or reduce-scatters it alone (``all_to_all_quant_reduce``,
    ``coalesced_collectives.py:43-52``).

    >>> qgz_quantized(4096 * 4096, 4096, 16), qgz_quantized(4096, 4096, 16), qgz_quantized(100 * 3, 100, 16)
    (True, False, False)
    """
    two_d = 0 < rows < numel
    return two_d and numel % (2 * world) == 0


def qgz_scale_groups(numel: int, rows: int, world: int) -> int:
    """G, the int4 scales of the first hop: ``max(dim 0, dim 1, world)`` (``coalesced_collectives.py:54``).

    >>> qgz_scale_groups(4096 * 14336, 14336, 16)
    14336
    """
    return max(rows, numel // rows, world)


def qgz_sizes(numel: int, groups: int, per_node: int) -> dict[str, float]:
    """nccl-tests S (each rank's send buffer) of qgZ's four all-to-alls of one gradient of ``numel``
    elements with ``groups`` scales, ``per_node`` ranks a node: in the node the int4 data
    (numel / 2 B) and its scales (4 G B); across nodes the reduced int4 data (numel / 2d B) and
    its G / d scales.

    Llama 3 8B's w_down (4096 x 14336) on 2 nodes of 8: 29.4 MB and 57 kB in the node, 3.67 MB
    and 7 kB across:

    >>> qgz_sizes(4096 * 14336, 14336, 8)
    {'intra': 29360128.0, 'intra_scales': 57344.0, 'inter': 3670016.0, 'inter_scales': 7168.0}
    """
    data = numel * QGZ_BITS / 8
    return {"intra": data, "intra_scales": float(SCALE_BYTES * groups),
            "inter": data / per_node, "inter_scales": float(SCALE_BYTES * groups // per_node)}


def qgz_kernel_bytes(numel: int, groups: int, per_node: int, nodes: int, grad_bytes: int) -> float:
    """HBM bytes of qgZ's kernels for one gradient (module docstring), on the reduce stream:
    ``swizzle_quant`` (read the gradient, ``grad_bytes`` each; write int4 and G scales),
    ``quantized_reduction`` (read the node's int4 and scales; write 1/d of it), ``dequantize``
    (read that; write fp16 of numel / d elements), and the sum of the N nodes' chunks of
    numel / world elements with its division (``sum`` of N chunks from 0: N adds, each reading
    two chunks and writing one, then the divide: (3 N + 2) chunks of fp16).

    w_down of Llama 3 8B (58.7 M elements, bf16) on 2 x 8: 117.4 + 29.4 + 29.4 + 3.7 + 3.7 + 14.7 MB
    and the chunks' 8 x 7.3 MB, plus scales:

    >>> round(qgz_kernel_bytes(4096 * 14336, 14336, 8, 2, 2) / 1e6, 1)
    257.0
    """
    s = qgz_sizes(numel, groups, per_node)
    chunk = HALF * numel / (per_node * nodes)
    quant = grad_bytes * numel + s["intra"] + s["intra_scales"]
    reduce = s["intra"] + s["intra_scales"] + s["inter"] + s["inter_scales"]
    dequant = s["inter"] + s["inter_scales"] + HALF * numel / per_node
    return quant + reduce + dequant + (3 * nodes + 2) * chunk


def kernel_seconds(nbytes: float, kernels: int, data: Optional[KernelData], hbm_bytes_per_s: float) -> float:
    """Seconds of ``kernels`` memory-bound kernels moving ``nbytes`` together: the bytes at the
    catalog's Triad rate, never below ``kernels`` issue floors
    (:func:`~meshplan.compute.measured.memory_kernel_seconds`); 0 without bytes.

    >>> from meshplan.compute.measured import kernel_data
    >>> round(kernel_seconds(2.97e9, 3, kernel_data("h100-sxm5-80gb"), 3.35e12) * 1e3, 3)
    1.0
    """
    if nbytes <= 0 or kernels <= 0:
        return 0.0
    return max(memory_kernel_seconds(data, nbytes, hbm_bytes_per_s),
               kernels * memory_kernel_seconds(data, 0.0, hbm_bytes_per_s))
