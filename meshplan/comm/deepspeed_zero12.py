"""DeepSpeed ZeRO stage 1 and 2 as DeepSpeed runs them (``training.zero12_engine = "deepspeed"``):
its gradient buckets and the collectives it issues per step.

Read in deepspeedai/DeepSpeed at edaa722 (2026-08-22), ``deepspeed/runtime/zero/stage_1_and_2.py``
(``DeepSpeedZeroOptimizer``), ``runtime/engine.py`` and ``runtime/zero/config.py``; the all-reduce
path since v0.12.4 (PR #4695, 2afa1c7, "Communication Optimization for Large-Scale Training"),
which replaced one ``dist.reduce`` per destination rank with all-reduces:

- Buckets (``reduce_independent_p_g_buckets_and_remove_grads``): each parameter's gradient, as
  its hook fires, joins the open "ipg" bucket; when the bucket's elements plus the parameter's
  would exceed ``reduce_bucket_size`` B (default 5e8, ``zero/config.py``), the bucket is reduced
  first (``reduce_ipg_grads``). Buckets hold whole parameters; a parameter of more than B
  elements is alone in its bucket (``extra_large_param_to_reduce``). The backward's last
  bucket is reduced by ``independent_gradient_partition_epilogue``. Parameters of 0 elements
  are skipped. :func:`ipg_buckets`.
- One all-reduce per bucket (``average_tensor`` with ``reduce_scatter`` true, the default): the
  bucket is cut at the data-parallel partition boundaries into per-rank slices (merged when
  consecutive slices go to the same rank), and with ``use_multi_rank_bucket_allreduce`` (default
  true) all slices go to one list that ``allreduce_and_scatter`` all-reduces whole, flushing when
  the running elements exceed B (``numel > numel_per_bucket``); each rank then copies back only
  its own slices. A bucket of at most B elements is one all-reduce of its elements; an
  extra-large parameter is all-reduced in runs of slices, each flushed once it passes B
  (:func:`allreduce_elements`). The partitions: the parameter group flattened in registration
  order, padded to a multiple of ``2 x dp`` (``nccl_start_alignment_factor`` 2), cut into dp
  equal parts (``get_data_parallel_partitions``). One parameter group is assumed (a
  weight-decay split flattens each group apart: only an extra-large parameter's runs move).
  ``use_multi_rank_bucket_allreduce: false`` is the older path (one ``dist.reduce`` per
  destination rank): not modelled (the DeepSpeed reader refuses it).
- Dtype (``allreduce_bucket``): the gradients (model dtype) cast to ``communication_data_type``
  when it differs; unset, the engine's ``communication_data_type`` is fp16 / bf16 when enabled,
  else fp32: the model's dtype (``training.gradient_reduce_dtype``).
- When (``engine.py`` ``allreduce_gradients``; the optimizer's ``process_gradients``): stage 2
  ("ZeRO stage >= 2 communicates during non gradient accumulation boundaries as well") reduces
  in the gradient hooks of every micro-batch's backward, in gradient-ready order (taken as the
  reverse of registration, as :func:`meshplan.comm.dp_rows._ddp_rows` takes it). Stage 1
  reduces once per step: with ``overlap_comm`` in the hooks of the last micro-batch's backward
  (``reduce_ready_partitions_and_remove_grads`` at the accumulation boundary), without it after
  that backward, walking the parameters in registration order (``reduce_gradients``).
- Streams: without ``overlap_comm`` (the default for stages 1 and 2, ``overlap_comm_valid``)
  ``average_tensor`` runs on the current (compute) stream: every all-reduce blocks the backward.
  With it, on ``reduction_stream``: the compute stream first waits for that stream
  (``current_stream().wait_stream(stream)``), so it waits for the previous bucket's all-reduce
  before issuing the next; two bucket buffers alternate (``bucket.index = 1 - bucket.index``), and
  the epilogue's ``synchronize()`` waits for the last one at the end of the backward
  (:mod:`meshplan.schedule.rank_timeline`, ``CommTimes.bucket_wait``). DeepSpeed's pipeline engine
  turns ``overlap_comm`` off and refuses stage 2 (``pipe/engine.py``).
- After the optimizer step each rank's updated partition is all-gathered: one
  ``all_gather_into_tensor`` of the whole flat group (``all_gather_dp_groups``), its padded
  elements in the model dtype (:func:`gather_elements`).
- Memory: :meth:`meshplan.spec.memory.MemoryOptions.deepspeed_bucket_bytes` (the B-element
  buffers, one or two, and the flattened bucket), kept in the spec layer because the memory model
  comes before this package in the flow.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate
from typing import Callable, Sequence

from meshplan.errors import ConfigError
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes

#: ``nccl_start_alignment_factor`` (``stage_1_and_2.py``: "4-byte alignment/sizeof(fp16) = 2"): the
#: flat parameter group is padded to a multiple of this x dp.
ALIGNMENT_FACTOR = 2
#: Marks the table rows of this module (the rank timeline reads them as bucketed reductions).
CADENCE = "(DeepSpeed ZeRO-1/2 bucket"


def ipg_buckets(ready: Sequence[int], bucket: int) -> list[list[int]]:
    """Indices into ``ready`` (parameter elements in the order their gradients reach the hook)
    of each ipg bucket, in reduction order, for ``reduce_bucket_size`` = ``bucket`` elements
    (module docstring): a bucket closes before a parameter that would take it past ``bucket``;
    empty parameters are skipped.

    >>> ipg_buckets([4, 3, 0, 3, 12, 1], 10)
    [[0, 1, 3], [4], [5]]
    >>> ipg_buckets([5, 5, 5], 10)
    [[0, 1], [2]]
    """
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i, k in enumerate(ready):
        if k <= 0:
            continue
        if cur and n + k > bucket:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += k
    return out + ([cur] if cur else [])


def gather_elements(params: Sequence[int], dp: int) -> int:
    """Elements of the flat parameter group: the sum padded to a multiple of
    ``ALIGNMENT_FACTOR x dp`` (``align_dense_tensors``); the per-step all-gather's output.

    >>> gather_elements([1000, 7], 8)
    1008
    """
    align = ALIGNMENT_FACTOR * dp
    return -(-sum(params) // align) * align


def _slices(offset: int, numel: int, part: int) -> list[int]:
    """Elements of ``[offset, offset + numel)`` in each partition of ``part`` elements it touches."""
    out, start = [], offset
    while start < offset + numel:
        end = min((start // part + 1) * part, offset + numel)
        out.append(end - start)
        start = end
    return out


def allreduce_elements(params: Sequence[int], dp: int, bucket: int, registration_order: bool = False) -> list[int]:
    """Elements of each all-reduce DeepSpeed issues for one reduction of gradients of
    ``params`` (elements per parameter in registration order) over ``dp`` ranks with
    ``reduce_bucket_size`` = ``bucket``, in issue order (module docstring): the buckets of
    :func:`ipg_buckets` over the gradient-ready order (the reverse of registration; stage 1
    without ``overlap_comm``: ``registration_order``), one all-reduce each, except an
    extra-large parameter's, cut at the partition boundaries into slices and all-reduced in
    runs that close once past ``bucket``.

    Three parameters of 6, 30 and 4 over dp 2 with bucket 10: partitions of 20 (40 elements);
    ready order 4, 30, 6: the 30 at offset 6 is sliced 14 + 16; 14 > 10 closes a run:

    >>> allreduce_elements([6, 30, 4], 2, 10)
    [4, 14, 16, 6]
    >>> allreduce_elements([6, 30, 4], 2, 10, registration_order=True)
    [6, 14, 16, 4]
    """
    part = gather_elements(params, dp) // dp
    offsets = [0, *accumulate(params)]
    order = list(range(len(params))) if registration_order else list(reversed(range(len(params))))
    out = []
    for b in ipg_buckets([params[i] for i in order], bucket):
        ids = [order[j] for j in b]
        if len(ids) > 1 or params[ids[0]] <= bucket:
            out.append(sum(params[i] for i in ids))
            continue
        run = 0
        for s in _slices(offsets[ids[0]], params[ids[0]], part):
            run += s
            if run > bucket:
                out.append(run)
                run = 0
        out += [run] if run else []
    return out


def check_mesh(training: TrainingSpec, degree: Callable[[str], int], schedule: str = "1f1b") -> None:
    """ConfigError when the engine cannot run ``training`` on a mesh of axis degrees
    ``degree(axis)`` under pipeline ``schedule`` (``mesh.pp_schedule``): DeepSpeed's pipeline
    engine refuses ZeRO-2 and turns ``overlap_comm`` off (``pipe/engine.py``) and runs one
    schedule (:func:`check_schedule`); expert, context and replicated data axes have groups this
    model does not build (DeepSpeed's expert-data-parallel param groups, Ulysses' sequence-data
    group, ZeRO++)."""
    if training.zero12_engine != "deepspeed":
        return
    pp = degree("pp")
    check_schedule(training, schedule, pp)
    if pp > 1 and training.sharding == "zero2":
        raise ConfigError("training.zero12_engine", f"'deepspeed' with zero2 and pp {pp}: DeepSpeed's pipeline engine "
                          "refuses ZeRO-2 (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\"); use "
                          "sharding zero1 or pp 1")
    if pp > 1 and training.overlap_comm:
        raise ConfigError("training.overlap_comm", f"with pp {pp} DeepSpeed's pipeline engine turns overlap_comm off "
                          "(\"Pipeline parallelism does not support overlapped communication\"): remove the key")
    for axis in ("ep", "cp", "dp_replicate"):
        if degree(axis) > 1:
            raise ConfigError("training.zero12_engine", f"'deepspeed' with {axis} {degree(axis)}: its groups are not "
                              f"modelled for DeepSpeed's ZeRO-1/2; use {axis} 1 or zero12_engine = \"megatron\"")


def check_schedule(training: TrainingSpec, schedule: str, pp: int, field: str = "mesh.pp_schedule") -> None:
    """ConfigError on ``field`` when DeepSpeed's ZeRO-1/2 engine runs ``training`` with pp > 1
    and a ``schedule`` other than 1F1B: ``PipelineEngine.train_batch`` always executes
    ``schedule.TrainSchedule`` (``runtime/pipe/engine.py``), 1F1B over one model chunk per
    stage (``runtime/pipe/schedule.py`` has no interleaved, zero-bubble or V-shaped schedule),
    so no virtual stages either.

    >>> from meshplan.spec.training import TrainingSpec
    >>> ds = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", zero12_engine="deepspeed")
    >>> check_schedule(ds, "1f1b", 4); check_schedule(ds, "interleaved_1f1b", 1)
    >>> check_schedule(ds, "interleaved_1f1b", 2)
    Traceback (most recent call last):
    meshplan.errors.ConfigError: mesh.pp_schedule: interleaved_1f1b with pp 2 under training.zero12_engine = "deepspeed": DeepSpeed's PipelineEngine runs TrainSchedule (1F1B, one chunk per stage) only; use pp_schedule "1f1b" without virtual stages, or zero12_engine = "megatron"
    """
    if training.zero12_engine != "deepspeed" or pp <= 1 or str(schedule) == "1f1b":
        return
    raise ConfigError(field, f"{schedule} with pp {pp} under training.zero12_engine = \"deepspeed\": DeepSpeed's "
                      "PipelineEngine runs TrainSchedule (1F1B, one chunk per stage) only; use pp_schedule \"1f1b\" "
                      "without virtual stages, or zero12_engine = \"megatron\"")


def bucket_rows(add, training: TrainingSpec, axis: str, params: Sequence[int], dp: int, bucket: int) -> None:
    """The table rows of one stage's rank over data axis ``axis`` of ``dp`` ranks (``add``: the
    collective table's row callback, :func:`meshplan.comm.collectives.collective_table`):
    the bucket all-reduces of :func:`allreduce_elements` in ``training.gradient_reduce_dtype``,
    one row per size, and the per-step parameter all-gather. zero2: per micro-batch, in the
    backward; zero1: per step, in the last backward with ``overlap_comm`` (phase backward),
    else after it (phase step)."""
    t = training
    stage1 = t.sharding == "zero1"
    sizes = allreduce_elements(params, dp, bucket, registration_order=stage1 and not t.overlap_comm)
    rs = t.gradient_reduce_dtype
    when = ("once per step, after the last backward" if not t.overlap_comm else
            "once per step, in the last backward") if stage1 else "every micro-batch, in the backward"
    stream = "side stream, overlap_comm" if t.overlap_comm else "compute stream"
    phase = "step" if stage1 and not t.overlap_comm else "backward"
    for size, k in sorted(Counter(sizes).items(), key=lambda kv: -kv[1]):
        add(axis, phase, "all-reduce", size * dtype_bytes(rs), rs, 0 if stage1 else k,
            f"{when}, {k} of {len(sizes)} buckets {CADENCE} {bucket:,} elements, {stream})", "optimizer step",
            per_step=k if stage1 else None)
    add(axis, "step", "all-gather", gather_elements(params, dp) * dtype_bytes(t.param_dtype), t.param_dtype, 0,
        "once per step (updated params, DeepSpeed all_gather_dp_groups)", "next step's forward", per_step=1)
