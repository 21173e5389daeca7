"""DeepSpeed ZeRO-3's gradient buffers on one rank: the 2021 engine's ipg buffers or flattened
bucket during each backward (:func:`deepspeed3_bucket_bytes`), current DeepSpeed's ipg buffer
kept from init (:func:`deepspeed3_ipg_bytes`), and their label in the memory timeline
(:func:`bucket_what`); and ZeRO++ hpZ's secondary parameter partition (:func:`hpz_secondary_bytes`). FSDP2's and ZeRO-1/2's buckets are
:meth:`~meshplan.spec.memory.MemoryOptions.grad_bucket_bytes`. DeepSpeed's ``BF16_Optimizer``: its bf16
gradients beside the fp32 ones (:func:`bf16_lp_grad_bytes`) and its step's flattened bucket
(:func:`bf16_step_bucket_bytes`).
"""

from __future__ import annotations

from meshplan.mesh.layers import last_stage
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import local_numel, padded_vocab
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.deepspeed_memory import DEEPSPEED_REDUCE_BUCKET_ELEMENTS
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


def bucket_buffer_bytes(contiguous: bool, cap: int, largest_bucket: int, grad_bytes: int) -> int:
    """Bytes of the gradient buffers DeepSpeed ZeRO-3 of 2021 holds during a backward beyond the
    gradients themselves (microsoft/DeepSpeed v0.3.13, 12a53b43833b7bea279a205e313f2bd3f0cdfd99,
    ``deepspeed/runtime/zero/stage3.py``); ``cap``: ``reduce_bucket_size`` (elements),
    ``largest_bucket``: the stage's largest gradient bucket (elements), ``grad_bytes``: the
    gradients' dtype bytes (``param.grad``, the parameter dtype).

    - ``contiguous_gradients`` true: ``backward`` (lines 2534-2547) allocates the ipg buffer,
      ``torch.empty(reduce_bucket_size, dtype=torch.half)``, and with ``overlap_comm`` (stage 3's
      default true, ``ZERO3_OPTIMIZATION_OVERLAP_COMM_DEFAULT``, zero/constants.py; meshplan's
      ZeRO-3 of 2021 always overlaps) a second one ("double buffers"), at every backward (each
      micro-batch); the hooks copy each gradient into it (``new_grad_tensor.copy_``, the gradient
      then a view of it) and ``_release_ipg_buffers`` drops both at the backward's end (the ipg
      epilogue, line 1313): ``2 x cap x 2 B`` whatever the dtypes (fp16 buffers).
    - ``contiguous_gradients`` false: no buffer kept; each flush's ``allreduce_bucket`` (line
      1796) flattens the bucket's gradients into a new tensor (``flatten(bucket)``) of their
      dtype, freed once ``allreduce_and_copy`` has copied it back; ``reduce_ipg_grads`` waits for
      the reduction stream before each flush, so one is alive at a time: the largest bucket,
      ``largest_bucket x grad_bytes``.

    GPT-3 175B in fp16, the default 5e8: 2 x 5e8 x 2 B = 2 GB with contiguous gradients; without,
    its largest bucket, the word embedding's 51,200 x 12,288 = 629,145,600 gradients alone (past the
    bucket: a bucket of its own), 1.258 GB:

    >>> bucket_buffer_bytes(True, 500_000_000, 629_145_600, 2), bucket_buffer_bytes(False, 500_000_000, 629_145_600, 2)
    (2000000000, 1258291200)
    """
    return 2 * cap * 2 if contiguous else largest_bucket * grad_bytes


def deepspeed3_bucket_bytes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, k: int,
                            opts: MemoryOptions, total: int) -> int:
    """Bytes of DeepSpeed ZeRO-3 of 2021's gradient buffers during each backward of stage ``k``
    (:func:`bucket_buffer_bytes`; ``total``: the stage's parameter
    elements on one rank), 0 under another engine. The largest bucket (``contiguous_gradients``
    false) is taken as ``min(max(reduce_bucket_size, the largest tensor), total)``: a tensor past
    the bucket is a bucket of its own, the others fill at most ``reduce_bucket_size``."""
    if training.sharding != "zero3" or training.zero3_engine != "deepspeed-2021":
        return 0
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, mesh.degree("tp"))
    kinds = {model.is_moe_layer(j): j for c in stages[k] for j in c}  # one layer of each kind
    ts = [*(model.embedding_tensors(pv) if k == 0 else ()), *(model.head_tensors(pv) if k == last_stage(stages) else ()),
          *(t for i in kinds.values() for t in model.layer_tensors(i))]
    largest = max((local_numel(t, model, mesh.degree("tp"), mesh.ep, mesh.etp) for t in ts), default=0)
    cap = opts.deepspeed_bucket_elements()
    return bucket_buffer_bytes(training.contiguous_grads, cap, min(max(cap, largest), total),
                                         dtype_bytes(training.param_dtype))


def deepspeed3_ipg_bytes(training: TrainingSpec, opts: MemoryOptions) -> int:
    """Bytes of DeepSpeed ZeRO-3's ipg buffer under ``training.zero3_engine = "deepspeed"``
    (deepspeedai/DeepSpeed edaa722 ``runtime/zero/stage3.py:731-735``): with
    ``contiguous_gradients`` (:attr:`~meshplan.spec.training.TrainingSpec.contiguous_grads`,
    DeepSpeed's default true) the optimizer's init allocates ``torch.empty(reduce_bucket_size)``
    in ``communication_data_type`` (one buffer per communication dtype, ``ipg_buckets``, 455-464;
    one here) and keeps it for the whole run (the backward hooks copy each gradient into it,
    ``__add_grad_to_ipg_bucket``, 1543-1568; nothing frees it): ``reduce_bucket_size x reduce
    bytes``, ``[memory] grad_bucket_elements`` or DeepSpeed's default 5e8 (``zero/config.py:113``),
    whatever the model's size and whether ``overlap_comm`` is on (stage 3 keeps one buffer, not
    ZeRO-1/2's two). 0 without ``contiguous_gradients`` or under another engine.

    bf16, the default 5e8: 5e8 x 2 B = 1 GB; fp32 reduce (``communication_data_type`` fp32): 2 GB.

    >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed")
    >>> deepspeed3_ipg_bytes(t, MemoryOptions()), deepspeed3_ipg_bytes(t.model_copy(update={"grad_reduce_dtype": "fp32"}),
    ...     MemoryOptions()), deepspeed3_ipg_bytes(t.model_copy(update={"contiguous_gradients": False}), MemoryOptions())
    (1000000000, 2000000000, 0)
    """
    if training.sharding != "zero3" or training.zero3_engine != "deepspeed" or not training.contiguous_grads:
        return 0
    return opts.deepspeed_bucket_elements() * dtype_bytes(training.gradient_reduce_dtype)


def hpz_secondary_bytes(training: TrainingSpec, params: int) -> int:
    """Bytes of DeepSpeed ZeRO++ hpZ's secondary partition on one rank holding ``params`` parameters
    (``training.zero_hpz_partition_size`` g > 1 under ``zero3_engine = "deepspeed"``, else 0):
    ``_partition_param_sec`` (deepspeedai/DeepSpeed edaa722 ``runtime/zero/partition_parameters.py``
    1872-1925) keeps ``aligned numel / g`` elements of every parameter in its dtype
    (``torch.empty(secondary_partition_size, dtype=param.dtype)``) from the first forward of a step
    to ``_post_step``'s ``invalidate_secondary_tensor`` (``stage3.py:2566-2577``): ``params / g x``
    the parameter bytes (the alignment to the world, under ``world`` elements a tensor, left out).
    The copy that fills it holds no other buffer (``param.contiguous().view(-1)``, 1908, is a view
    of the gathered parameter; ``zero_`` and ``copy_`` write the slice in place, 1916-1919). The
    memory timeline places it at init: each unit's slice appears as the unit is released in
    micro-batch 0's forward and all of it is freed after the optimizer step, so every later pass,
    the backward and the step hold it whole, and only micro-batch 0's forward is overstated, by the
    slices of the units it has not yet released (at its head, the [norm, output] unit's).

    Llama 3 8B (8,030,261,248 parameters, bf16) with g = 8: 2.01 GB a rank:

    >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed", zero_hpz_partition_size=8)
    >>> hpz_secondary_bytes(t, 8_030_261_248), hpz_secondary_bytes(t.model_copy(update={"zero_hpz_partition_size": 1}), 8)
    (2007565312, 0)
    """
    g = training.zero_hpz_partition_size
    if g <= 1 or training.sharding != "zero3" or training.zero3_engine != "deepspeed":
        return 0
    return -(-params // g) * dtype_bytes(training.param_dtype)


def hpz_secondary_words(training: TrainingSpec, params: int) -> str:
    """The hpZ secondary partition named with its formula and source (one home: the memory
    timeline's event, the plan's persistent-state section and first estimate read it), "" without
    it (:func:`hpz_secondary_bytes`).

    >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed", zero_hpz_partition_size=8)
    >>> hpz_secondary_words(t, 8_030_261_248).split(" (ds_")[0]
    'DeepSpeed ZeRO++ hpZ secondary partition: 8,030,261,248 params / zero_hpz_partition_size 8 x 2 B = 1.87 GiB per rank'
    """
    sec = hpz_secondary_bytes(training, params)
    if not sec:
        return ""
    return (f"DeepSpeed ZeRO++ hpZ secondary partition: {params:,} params / zero_hpz_partition_size "
            f"{training.zero_hpz_partition_size} x {dtype_bytes(training.param_dtype)} B = {sec / 2**30:.2f} GiB per rank "
            "(ds_secondary_tensor, DeepSpeed edaa722 partition_parameters.py:1872-1925), held from the step's first "
            "forward to the optimizer step")


def ipg_elements(training: TrainingSpec, opts: MemoryOptions) -> int:
    """Elements of DeepSpeed ZeRO-3's ipg buffer when its backward hooks move the gradients into
    it (:func:`deepspeed3_ipg_bytes` > 0), else 0. ``__add_grad_to_ipg_bucket`` (deepspeedai/DeepSpeed
    edaa722 ``runtime/zero/stage3.py:1543-1568``) copies a parameter's gradient into the buffer when
    it fits (``bucket.elements + param.grad.numel() <= reduce_bucket_size``; a fuller bucket is
    reduced first, 1537-1539, so every tensor of at most ``reduce_bucket_size`` elements fits) and
    points ``param.grad.data`` at that slice, so the memory autograd wrote it to is freed: a
    layer's gradients live in the buffer the timeline holds from init, not beside it; only a tensor
    of more elements keeps its own gradient (:func:`meshplan.memory.units.units`).

    >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed")
    >>> ipg_elements(t, MemoryOptions()), ipg_elements(t.model_copy(update={"contiguous_gradients": False}), MemoryOptions())
    (500000000, 0)
    """
    return opts.deepspeed_bucket_elements() if deepspeed3_ipg_bytes(training, opts) else 0


def bucket_what(training: TrainingSpec) -> str:
    """The gradient bucket's label in the memory timeline, in its engine's words."""
    if training.sharding == "zero3" and training.zero3_engine == "deepspeed-2021":
        return ("DeepSpeed ZeRO-3 ipg buffers (2 x reduce_bucket_size, fp16; contiguous_gradients)"
                if training.contiguous_grads else
                "DeepSpeed ZeRO-3 flattened gradient bucket being all-reduced (largest bucket)")
    if training.zero12_engine == "deepspeed":
        return ("DeepSpeed bucket buffer(s) (model dtype) and the bucket being reduced" if training.contiguous_grads
                else "DeepSpeed bucket being reduced, flattened (contiguous_gradients false: no ipg buffer)")
    return "gradient bucket (reduce dtype)"


def bf16_lp_grad_bytes(training: TrainingSpec, params_numel: int) -> int:
    """Bytes of the bf16 gradients (``param.grad``) DeepSpeed's ``BF16_Optimizer`` leaves allocated
    beside its fp32 gradients (:attr:`~meshplan.spec.training.TrainingSpec.bf16_optimizer`; 0 under
    any other training): ``params_numel`` (the rank's parameter elements, whole: not sharded) x 2 B.

    Autograd writes each ``param.grad`` in the parameter's dtype (bf16) during a backward; after it
    the engine calls ``update_hp_grads(clear_lp_grads=False)``, which adds each into its fp32
    gradient and keeps it, and only the next backward's ``clear_lp_grads`` sets them to None
    (microsoft/DeepSpeed v0.6.5 8164ea9 ``runtime/pipe/engine.py:766-780``,
    ``runtime/bf16_optimizer.py:374-407, 445-448``; at 38327e0 ``pipe/engine.py:852-866`` and
    ``bf16_optimizer.py:316-365``, where ``clear_lp_grads=True`` zeroes them in place but frees none).
    So from the first backward on the rank holds them to the step and through the next forwards:
    planned as persistent state from init. A step of two or more micro-batches reaches the same peak
    in a later micro-batch (whose forward or backward holds them all), though the peak's place may
    then name micro-batch 0; with one micro-batch a step this overstates the first forward only.

    A rank of 1,000 parameters: 1,000 x 2 B = 2,000 B; none under ZeRO-1's own optimizer:

    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed", grad_dtype="fp32")
    >>> bf16_lp_grad_bytes(t, 1000), bf16_lp_grad_bytes(t.model_copy(update={"grad_dtype": "bf16"}), 1000)
    (2000, 0)
    """
    return params_numel * dtype_bytes(training.param_dtype) if training.bf16_optimizer else 0


def bf16_step_bucket_bytes(training: TrainingSpec, params_numel: int) -> int:
    """Bytes of the flattened bucket ``BF16_Optimizer``'s step all-reduces, once a step after the
    last backward (0 under any other training). The pipeline engine's ``_bf16_reduce_grads``
    (v0.6.5 ``runtime/pipe/engine.py:270-274``) calls ``buffered_allreduce_fallback`` on the whole
    fp32 gradients with ``elements_per_buffer = MEMORY_OPT_ALLREDUCE_SIZE`` (5e8, ``engine.py:73``,
    whatever ``reduce_bucket_size`` says); each bucket's ``allreduce_bucket`` (``engine.py:2107-2131``)
    flattens it into a new fp32 tensor and casts that to ``communication_data_type`` when it differs
    (bf16 unset), one bucket at a time: ``k x (4 + reduce bytes)`` with ``k = min(5e8,
    params_numel)`` (reduce bytes 0 when the reduce dtype is fp32).

    BLOOM-176B's stage of 6 layers at tp 4 (3,700,042,752 elements): 5e8 x (4 + 2) B = 3 GB; a rank of
    1,000 parameters reducing in fp32: 1,000 x 4 B:

    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed", grad_dtype="fp32")
    >>> bf16_step_bucket_bytes(t, 3_700_042_752), bf16_step_bucket_bytes(t.model_copy(update={"grad_reduce_dtype": "fp32"}), 1000)
    (3000000000, 4000)
    """
    if not training.bf16_optimizer:
        return 0
    reduce = training.gradient_reduce_dtype
    cast = dtype_bytes(reduce) if reduce != training.grad_dtype else 0
    return min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, params_numel) * (dtype_bytes(training.grad_dtype) + cast)
