"""What DeepSpeed's ``PipelineEngine`` and its ``BF16_Optimizer`` run around each micro-batch of a
pipeline stage beyond the model's own kernels (``training.pp_engine = "deepspeed"``: Megatron-DeepSpeed's
``GPTModelPipe`` under ``deepspeed.initialize``), as timed ops per micro-batch (:func:`engine_cost`).

Read in microsoft/DeepSpeed v0.6.5 (8164ea9e6d35dfbbe62b0f15448daf05268b9e81, 2022-05-24: the release
after "bf16+pipeline parallelism", PR #1801, that BigScience's BLOOM-176B ran from a branch of,
bigscience-workshop/bigscience 9e64ede ``train/tr11-176B-ml/README.md`` "Software"):

- Activations and their gradients cross stages partitioned over the tensor-parallel group
  (``runtime/pipe/engine.py:133-134``: ``is_pipe_partitioned = is_grad_partitioned =
  is_model_parallel``) as a ``PartitionedTensor`` (``runtime/utils.py:660-760``): the sender
  copies its ``1/tp`` slice (``_partition_tensor``: ``narrow(...).clone()``) and builds a LongTensor
  of metadata on the GPU (``to_meta``: a host-to-device copy); the receiver rebuilds the whole
  tensor with ``full()``: ``meta.tolist()`` (a device-to-host sync, ``from_meta``), a zero-filled
  flat buffer of the whole tensor (``torch.zeros``), its own slice copied in (``buf.copy_``), a
  blocking ``dist.all_gather`` over the tp group, and a ``clone()`` of the whole tensor.
- Per micro-batch on a stage with a previous stage (``_exec_recv_activations``, engine.py:1050-1093,
  and ``_exec_forward_pass``, 639-660): each received tensor is cloned (``buffer.clone().detach()``),
  the input tuple cloned again (``inputs.clone()``, meta and slice), then ``full()``; on a stage with
  a next stage the forward's output is partitioned (670-686). In backward (719-760) a stage with a
  next stage calls ``full()`` twice: to restore its own output, whose data it dropped after sending
  (``first_output.data = torch.zeros(1)``: a second all-gather of the activation the next stage
  gathered already, which Megatron-LM's scatter-gather p2p does not run), and to rebuild the
  received gradient; a stage with a previous stage partitions its input gradient to send it
  (``_exec_send_grads``, 991-1031). The activation gather and the gradient gather are the
  collective table's tp all-gathers (Megatron-LM's scatter-gather p2p has the same two); the
  output's re-gather is timed here, on the compute stream (the call waits for it).
- ``BF16_Optimizer`` (``runtime/bf16_optimizer.py``; the engine runs it for bf16 without ZeRO,
  ``runtime/engine.py:1111-1146``, and BigScience ran ZeRO stage 0 with bf16, tr11-176B-ml.slurm:
  "bf16 must use z0! it implements its own zero stage 1 equivalent") keeps an fp32 gradient of
  every parameter of the stage (``fp32_groups_gradients_flat``, 170-176) and after every
  micro-batch's backward the pipeline engine calls ``update_hp_grads`` (engine.py:774-776), which
  per parameter runs ``hp_grad.add_(lp.grad.to(fp32))`` (bf16_optimizer.py:390-407): a cast kernel
  (reads 2 B, writes 4 B an element) and an add (reads 4 + 4 B, writes 4 B): 18 B an element, two
  kernels per parameter tensor, every micro-batch, on every stage. (``clear_lp_grads`` sets the
  bf16 gradients to None before each backward, so the backward writes them fresh: no bf16
  accumulation.)

- Every forward starts its ``ThroughputTimer`` (engine.py:640, ``self.tput_timer.start()``), whose
  ``start`` calls ``torch.cuda.synchronize()`` from the third step on (``utils/timer.py:173-178``):
  one host sync a micro-batch on every stage.

Each memory-bound kernel is timed at the GPU's measured streaming rate, never below the issue
floor (:func:`~meshplan.compute.kernel_time.memory_op`); each host sync (``tolist``, the metadata's
host-to-device copy) at one issue floor (as :mod:`meshplan.compute.megatron_cost` times Megatron-LM's
syncs). Not timed: the metadata's own small p2p sends (two more send/recv a transfer, each a few
tens of bytes), torch 1.11's copy-out of a list ``all_gather`` (Megatron-LM's gathers have it too
and the model does not time it there either).
"""

from __future__ import annotations

from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.kernel_time import memory_op
from meshplan.compute.ops import Cost, Op
from meshplan.spec.cluster import GPUSpec

#: Bytes an element that ``update_hp_grads`` moves: the cast reads bf16 (2) and writes fp32 (4), the add
#: reads the fp32 gradient and the cast (4 + 4) and writes the fp32 gradient (4) (module docstring).
HP_GRAD_CAST_BYTES = 6
HP_GRAD_ADD_BYTES = 12


def hp_grad_ops(gpu: GPUSpec, tensors: list[tuple[str, int, bool]]) -> list[Op]:
    """``BF16_Optimizer.update_hp_grads`` after one micro-batch's backward on a rank holding
    ``tensors`` (``(name, local elements, _)``, :func:`meshplan.compute.megatron.stage_param_tensors`):
    per tensor the cast (6 B an element) and the add (12 B), each one kernel (module docstring).

    BLOOM-176B's stage of 6 layers at tp 4 holds ``query_key_value`` 14336 x 3 x 14336 / 4 =
    154,140,672 elements: the cast moves 924.8 MB, the add 1,849.7 MB; at the A100's measured
    streaming rate (the catalog's BabelStream Triad, 1.70 TB/s) they take 0.5440 and 1.0881 ms:

    >>> from meshplan import catalog
    >>> a100 = catalog.gpu("a100-sxm-80gb")
    >>> ops = hp_grad_ops(a100, [("query_key_value", 154140672, False), ("query_key_value_bias", 10752, False)])
    >>> [(o.name, round(o.size_bytes / 1e6, 2), round(o.seconds * 1e3, 4)) for o in ops]  # doctest: +NORMALIZE_WHITESPACE
    [('query_key_value hp_grad cast', 924.84, 0.544), ('query_key_value hp_grad add', 1849.69, 1.0881),
     ('query_key_value_bias hp_grad cast', 0.06, 0.0047), ('query_key_value_bias hp_grad add', 0.13, 0.0047)]
    """
    return [memory_op(gpu, f"{name} hp_grad {kind}", "pipe", "backward_input", nbytes * n)
            for name, n, _ in tensors for kind, nbytes in (("cast", HP_GRAD_CAST_BYTES), ("add", HP_GRAD_ADD_BYTES))]


def full_ops(gpu: GPUSpec, what: str, phase: str, nbytes: float, tp: int) -> list[Op]:
    """``PartitionedTensor.full()`` of a tensor of ``nbytes`` over ``tp`` ranks, less its all-gather:
    the metadata's ``tolist()`` (one issue floor), the zero-filled buffer (writes ``nbytes``), the
    own slice copied in (reads and writes ``nbytes / tp``) and the ``clone()`` (reads and writes
    ``nbytes``) (module docstring).

    >>> from meshplan import catalog
    >>> [(o.name, o.size_bytes) for o in full_ops(catalog.gpu("a100-sxm-80gb"), "input", "forward", 400.0, 4)]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('input full: meta tolist', 0.0), ('input full: zeros', 400.0), ('input full: slice copy', 200.0),
     ('input full: clone', 800.0)]
    """
    data = kernel_data(gpu)
    floor = 0.0 if data is None else data.kernel_issue_s
    return [Op(f"{what} full: meta tolist", "pipe", phase, "overhead", floor, note="device-to-host sync, one issue floor"),
            memory_op(gpu, f"{what} full: zeros", "pipe", phase, nbytes),
            memory_op(gpu, f"{what} full: slice copy", "pipe", phase, 2 * nbytes / tp),
            memory_op(gpu, f"{what} full: clone", "pipe", phase, 2 * nbytes)]


def partition_ops(gpu: GPUSpec, what: str, phase: str, nbytes: float, tp: int) -> list[Op]:
    """A ``PartitionedTensor`` made of a tensor of ``nbytes`` (the ``1/tp`` slice cloned: reads and
    writes ``nbytes / tp``) and its metadata sent to the GPU (``to_meta``: one issue floor)."""
    data = kernel_data(gpu)
    floor = 0.0 if data is None else data.kernel_issue_s
    return [memory_op(gpu, f"{what} partition: slice clone", "pipe", phase, 2 * nbytes / tp),
            Op(f"{what} partition: to_meta", "pipe", phase, "overhead", floor, note="host-to-device copy, one issue floor")]


def engine_cost(gpu: GPUSpec, tensors: list[tuple[str, int, bool]], act_bytes: float, tp: int, first: bool,
                last: bool, regather_s: float, hp_grads: bool) -> Cost:
    """The ops of one micro-batch on one stage's rank (module docstring): ``tensors`` its parameters,
    ``act_bytes`` the activation a stage sends (micro-batch x sequence x hidden x 2 B), ``first`` /
    ``last`` whether it has no previous / next stage, ``regather_s`` the seconds of one all-gather
    of ``act_bytes`` over the tp group (the output's re-gather in backward, a stage with a next
    stage), ``hp_grads``: ``BF16_Optimizer``'s per-micro-batch fp32 accumulation. Forward ops in
    phase ``forward``, backward ones in ``backward_input``. At tp 1 without ``hp_grads`` (no
    partitioning) the timer's sync alone.

    A middle stage at tp 4 with an activation of 400 B (a slice of 100 B): forward, the received
    slice cloned twice (2 x 200 B read + written), ``full()`` (400 + 200 + 800 B) and the output's
    slice (200 B): 2,000 B; backward, two ``full()`` (2 x 1,400 B) and the gradient's slice (200 B):
    3,000 B, beside the re-gather:

    >>> from meshplan import catalog
    >>> c = engine_cost(catalog.gpu("a100-sxm-80gb"), [], 400.0, 4, False, False, 1e-3, False)
    >>> sum(o.size_bytes for o in c.ops if o.phase == "forward"), sum(o.size_bytes for o in c.ops if o.phase != "forward")
    (2000.0, 3000.0)
    """
    data = kernel_data(gpu)
    ops = [Op("ThroughputTimer.start synchronize", "pipe", "forward", "overhead",
              0.0 if data is None else data.kernel_issue_s, note="torch.cuda.synchronize, one issue floor")]
    if tp > 1:
        part = act_bytes / tp
        if not first:
            ops += [memory_op(gpu, "received slice clone", "pipe", "forward", 2 * part),
                    memory_op(gpu, "input tuple clone", "pipe", "forward", 2 * part)]
            ops += full_ops(gpu, "input", "forward", act_bytes, tp)
            ops += partition_ops(gpu, "input grad", "backward_input", act_bytes, tp)
        if not last:
            ops += partition_ops(gpu, "output", "forward", act_bytes, tp)
            ops += full_ops(gpu, "output", "backward_input", act_bytes, tp)
            ops.append(Op("output re-gather (tp all-gather)", "pipe", "backward_input", "overhead", regather_s,
                          note="blocking dist.all_gather of the stage's own output, timed as the tp axis's row"))
            ops += full_ops(gpu, "output grad", "backward_input", act_bytes, tp)
    if hp_grads:
        ops += hp_grad_ops(gpu, tensors)
    return Cost(tuple(ops))
