"""FSDP2's copies on the compute stream around its collectives (torch 2.13,
``torch/distributed/fsdp/_fully_shard``).

FSDP2 gathers and reduces each unit's parameters as one flat buffer, so every collective has a
copy between that buffer and the per-parameter tensors:

- **all-gather copy-out.** ``FSDPParamGroup.wait_for_unshard`` (record_function
  ``FSDP::all_gather_copy_out``) runs ``foreach_all_gather_copy_out`` on the *current* stream
  once the all-gather's event is waited: ``torch.ops.fsdp.split_with_sizes_copy`` reads the
  all-gather output (the unit's gathered bytes ``S``, nccl-tests' size) and writes each
  unsharded parameter (``S`` again): ``2 S`` bytes before the unit's first GEMM, in forward and
  in every backward that gathers again.
- **reduce-scatter copy-in.** ``FSDPParamGroup.post_backward`` (record_function
  ``FSDP::post_backward_reduce``) calls ``foreach_reduce``, which allocates the reduce-scatter
  input in the reduce dtype and fills it with ``foreach_reduce_scatter_copy_in``
  (``torch.ops.fsdp.chunk_cat``) on the current stream, *before* ``reduce_scatter_stream``
  waits on it: it reads every unsharded gradient (the parameter dtype) and writes the buffer
  (the reduce dtype), ``numel x (param bytes + reduce bytes)``.

The all-gather copy-in (the rank's shards into the send buffer) runs on FSDP2's own copy-in
stream and the reduce-scatter's pre- and post-divide on its reduce-scatter stream: beside the
compute, not on it, so they are not counted here.

Both copies are memory-bound kernels, timed by the rule of every other one
(:func:`meshplan.compute.measured.memory_kernel_seconds`: bytes at the catalog's BabelStream
Triad, never below the per-kernel issue floor; the datasheet bandwidth for a GPU without catalog
data).

**Megatron FSDP makes neither copy** (``training.framework = "megatron"``, which runs zero3 and
hsdp with ``--use-megatron-fsdp``; :func:`compute_stream_copies`). Read in NVIDIA/Megatron-LM at
d98e8a64ddf34856e74b24714e3bedb2f5a39553, ``megatron/core/distributed/fsdp/src/megatron_fsdp/``:

- all-gather: ``param_and_grad_buffer.py`` ``AllGatherPipeline.async_bucket_gather`` gathers
  ``wbuf.get_shard_from_local_buffer()`` (the rank's slice of the flat weight buffer, no copy-in)
  into ``wbuf.fetch_bucket(set_param_data=True)``, which points every parameter's ``.data`` at its
  slice of that bucket (``DataParallelBuffer.fetch_bucket``): the GEMMs read the all-gather output
  itself, no copy-out;
- reduce-scatter: the input is the unsharded gradient bucket (``GradReducePipeline.
  _bucket_group_gradient_reduce``: ``gbuf.fetch_bucket(dtype=grad_comm_dtype)``), and
  ``param.main_grad`` is a view of it (``main_grad_getter``). Megatron-LM's
  ``gradient_accumulation_fusion`` (on by default) has each weight-gradient GEMM write there
  (``grad_added_to_main_grad``; ``overwrite_main_grad`` under optim_grads / optim_grads_params),
  so ``megatron_fsdp.py`` ``_grad_acc`` copies nothing for the GEMM weights. It copies
  (``param.main_grad.copy_(param.grad)``) only the gradients no GEMM wrote: norm weights, biases,
  embeddings, the per-parameter hooks the compute model already times
  (:func:`meshplan.compute.megatron_cost.main_grad_hooks`). The pre-scale and the accumulation of the
  reduced shard into the sharded gradient buffer run on its side stream
  (``side_stream_for_buffer_copy_and_grad_accum``), beside the compute.
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.measured import KernelData, memory_kernel_seconds
from meshplan.units import dtype_bytes


def compute_stream_copies(training) -> bool:
    """Whether ``training``'s FSDP runtime copies between its flat buffers and the parameters
    and gradients on the compute stream (``training``: a
    :class:`~meshplan.spec.training.TrainingSpec`): FSDP2 (framework torch) does, Megatron FSDP
    (framework megatron) does not (module docstring), nor does DeepSpeed's ZeRO-3
    (``zero3_engine = "deepspeed"``, DeepSpeed >= v0.5.5; read at deepspeedai/DeepSpeed edaa722):
    ``AllGatherCoalescedHandle.wait`` splits a prefetched (coalesced) buffer into each parameter with
    one ``torch.cat`` of its ``world`` slices (``runtime/zero/partition_parameters.py:776-784``), a
    copy-out of the prefetched part only (the rest is gathered into views, no copy:
    :func:`meshplan.spec.deepspeed_memory.deepspeed_copied_bytes`), but ``fetch_sub_module`` calls it inside ``with
    stream(self.__allgather_stream)`` and only then makes the compute stream wait for that stream
    (``partitioned_param_coordinator.py:400-415``); stage 3's gradient hook copies each gradient into
    the bucket's flat buffer inside ``with stream(self.reduce_and_partition_stream)``
    (``stage3.py:1541-1560``), a side stream under ``overlap_comm``, true by default at stage 3
    (``zero/config.py:383-386``). The collective table adds those copies to the all-gather's and
    the reduce-scatter's time instead (:func:`meshplan.comm.dp_rows.dp_rows`). The one rule
    for the collective table's ``copy_s`` and the search's :func:`meshplan.search.comm_bounds.fsdp_copies`.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero3")
    >>> compute_stream_copies(t), compute_stream_copies(t.model_copy(update={"framework": "megatron"}))
    (True, False)
    >>> compute_stream_copies(t.model_copy(update={"zero3_engine": "deepspeed"}))
    False
    """
    return training.framework != "megatron" and training.zero3_engine != "deepspeed"


def _seconds(nbytes: float, data: Optional[KernelData], datasheet_bytes_per_s: float) -> float:
    """One copy kernel's seconds; none at all without bytes (no collective, no copy)."""
    return memory_kernel_seconds(data, nbytes, datasheet_bytes_per_s) if nbytes > 0 else 0.0


def copy_out_seconds(gathered_bytes: float, data: Optional[KernelData], datasheet_bytes_per_s: float) -> float:
    """Compute-stream seconds of one all-gather's copy-out: ``2 x gathered_bytes`` (read the
    all-gather output, write the unsharded parameters).

    Llama 3 8B's decoder layer in bf16 (218,112,000 parameters, 436.2 MB gathered) on an H100
    (Triad 2.97 TB/s): 872.4 MB, 293.8 us:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(copy_out_seconds(2 * 218_112_000, kernel_data("h100-sxm5-80gb"), 3.35e12) * 1e6, 1)
    293.8
    """
    return _seconds(2 * gathered_bytes, data, datasheet_bytes_per_s)


def copy_in_element_bytes(training) -> tuple[int, int]:
    """(bytes read, bytes written) per gradient element by FSDP2's reduce-scatter copy-in under
    ``training`` (a :class:`~meshplan.spec.training.TrainingSpec`): the unsharded gradient in
    the compute dtype (``MixedPrecisionPolicy.param_dtype``: autograd's gradients take the
    parameters' unsharded dtype), the send buffer in FSDP's reduce dtype
    (:attr:`~meshplan.spec.training.TrainingSpec.fsdp_reduce_dtype`: ``reduce_dtype`` unless
    ``grad_reduce_dtype`` says otherwise), whatever the sharding ``training`` itself names (the
    search asks for candidates of every sharding). The one rule for :func:`copy_in_seconds`'
    element bytes (the collective table, the search's timing).

    >>> from meshplan.spec.training import TrainingSpec
    >>> copy_in_element_bytes(TrainingSpec(global_batch=8, seq_len=16, sharding="none"))
    (2, 4)
    >>> copy_in_element_bytes(TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", grad_reduce_dtype="bf16"))
    (2, 2)
    """
    if training.searched_zero3_engine != "fsdp2":  # the copy-in is FSDP2's: its reduce dtype
        training = training.model_copy(update={"zero3_engine": "fsdp2", "zero12_engine": "megatron"})
    return dtype_bytes(training.compute_dtype), dtype_bytes(training.fsdp_reduce_dtype)


def copy_in_seconds(numel: int, grad_bytes: int, reduce_bytes: int, data: Optional[KernelData],
                    datasheet_bytes_per_s: float) -> float:
    """Compute-stream seconds of one reduce-scatter's copy-in: ``numel x (grad_bytes +
    reduce_bytes)`` (read the unsharded gradients in the parameter dtype, write the send buffer
    in the reduce dtype; :func:`copy_in_element_bytes`).

    The same layer, bf16 gradients reduced in fp32: 218,112,000 x 6 B = 1.309 GB, 440.6 us:

    >>> from meshplan.compute.measured import kernel_data
    >>> round(copy_in_seconds(218_112_000, 2, 4, kernel_data("h100-sxm5-80gb"), 3.35e12) * 1e6, 1)
    440.6
    """
    return _seconds(numel * (grad_bytes + reduce_bytes), data, datasheet_bytes_per_s)
