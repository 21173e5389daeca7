"""The data axes' rows of the collective table (:func:`meshplan.comm.collectives.collective_table`):
which engine reduces the gradients (:func:`dp_rows`: FSDP2 and HSDP in
:mod:`meshplan.comm.fsdp_rows`, DeepSpeed's ZeRO-3 of 2021 in :mod:`meshplan.comm.deepspeed_rows`,
its ZeRO-1/2 in :mod:`meshplan.comm.deepspeed_zero12`), and the rows of the engines that keep
the parameters whole: ZeRO-1, ZeRO-2, DDP and Megatron-LM's DDP buffers.

- ZeRO-1 (Megatron distributed optimizer): one gradient reduce-scatter and one parameter
  all-gather per step, as one bucket per stage. ZeRO-2 (gradients sharded, so they cannot
  accumulate unreduced): every micro-batch's backward reduce-scatters its gradients one bucket
  at a time, as the buckets fill (DeepSpeed's ``allreduce_gradients``: "ZeRO stage >= 2
  communicates during non gradient accumulation boundaries as well", ``stage_1_and_2.py``
  ``reduce_independent_p_g_buckets_and_remove_grads`` / ``reduce_ipg_grads``), the bucket the
  memory model holds (:meth:`~meshplan.spec.memory.MemoryOptions.bucket_elements`: ``[memory]
  grad_bucket_elements``, DeepSpeed's ``reduce_bucket_size``), then one parameter all-gather
  per step (:func:`_zero2_rows`). DDP (none): one all-reduce per gradient bucket in
  the backward of the step's last micro-batch, the buckets of torch 2.13's reducer after its first
  step (25 MiB, the first 1 MiB, or ``[memory] grad_bucket_elements``; :func:`_ddp_rows`; the very
  first step sends one bucket of all, :func:`meshplan.runtime.execution.parallelize.apply_ddp`);
  Megatron-LM 2022 (``framework = "megatron"``): one all-reduce of its contiguous gradient buffer,
  or with ``--overlap-grad-reduce`` its buckets (:mod:`meshplan.comm.megatron_buckets`).
  DeepSpeed's own ZeRO-1/2 (``training.zero12_engine = "deepspeed"``): one all-reduce per
  bucket of whole parameters, every micro-batch (zero2) or once per step (zero1), then one
  all-gather of the padded flat parameters (:mod:`meshplan.comm.deepspeed_zero12`).
- ZeRO-1/2 with dp_replicate > 1 (Megatron-LM's partial distributed optimizer): each rank's reduced
  shard is also all-reduced across the replicas once per step (:func:`_replica_rows`).
- Every gradient reduction (FSDP reduce-scatter, HSDP all-reduce, ZeRO-1/2 reduce-scatter, DDP
  all-reduce) is in ``training.gradient_reduce_dtype``: ``training.grad_reduce_dtype = "fp32"``
  gives Megatron-LM's fp32 main-gradient reduction.
"""

from __future__ import annotations

from collections import Counter

from meshplan.comm import deepspeed_zero12
from meshplan.comm.deepspeed_rows import zero3_2021_rows
from meshplan.comm.fsdp_rows import fsdp_rows, fsdp_shards, fsdp_units
from meshplan.comm.megatron_buckets import bucket_cap, megatron_bucket_rows, split_buckets
from meshplan.comm.stage_context import StageContext, registered_tensors, registration_numels
from meshplan.memory import te_fp8
from meshplan.mesh.tpsplit import local_numel
from meshplan.spec.memory import MemoryOptions
from meshplan.units import dtype_bytes


def dp_rows(add, c: StageContext) -> None:
    """The stage's rows over the data axes (the table's builder for dp_shard), by the engine
    ``training`` names: DeepSpeed's ZeRO-3 of 2021 (:func:`~meshplan.comm.deepspeed_rows.zero3_2021_rows`),
    FSDP2 / HSDP (:func:`~meshplan.comm.fsdp_rows.fsdp_rows`), DeepSpeed's ZeRO-1/2
    (:func:`meshplan.comm.deepspeed_zero12.bucket_rows` on the parameters in registration
    order), else the whole-parameter engines (:func:`_unsharded_rows`)."""
    t = c.training
    if t.sharding == "zero3" and t.zero3_engine == "deepspeed-2021":
        zero3_2021_rows(add, c)
    elif t.sharding in ("zero3", "hsdp"):
        fsdp_rows(add, c)
    elif t.sharding in ("zero1", "zero2") and t.zero12_engine == "deepspeed":
        deepspeed_zero12.bucket_rows(add, t, "fsdp", registration_numels(c), c.mesh.degree("fsdp"),
                                     MemoryOptions(grad_bucket_elements=c.bucket_elements).deepspeed_bucket_elements())
    else:
        _unsharded_rows(add, c)


def _unsharded_rows(add, c: StageContext) -> None:
    """ZeRO-1, ZeRO-2, DDP and Megatron-LM's DDP (buffers bucketed under
    ``--overlap-grad-reduce``) over each FSDP unit axis (fsdp, efsdp) with gradients: the
    stage's elements summed over its units (:func:`~meshplan.comm.fsdp_rows.fsdp_units`); DDP's
    reductions over fsdp are named ``loss`` (the data-parallel group without sharding)."""
    t = c.training
    rs = t.gradient_reduce_dtype
    by_axis: Counter[str] = Counter()
    by_chunk: dict[str, Counter[int]] = {}
    for _, axis, numel, chunk, *_ in fsdp_units(c, fsdp_shards(c)):
        by_axis[axis] += numel
        by_chunk.setdefault(axis, Counter())[chunk] += numel
    f8 = te_fp8_by_chunk(c)
    for axis, numel in by_axis.items():
        # the buffers (elements by chunk, fp8): under --fp8-param-gather TE's fp8 parameters apart
        bufs = [(by_chunk[axis] - f8, False), (f8, True)] if f8 and axis == "fsdp" else [(by_chunk[axis], False)]
        if t.overlap_grad_reduce and t.sharding in ("none", "zero1"):  # Megatron-LM's DDP buffers: bucketed
            for chunks, fp8 in bufs:
                megatron_bucket_rows(add, c, axis, dict(chunks), fp8)
        elif t.sharding in ("zero1", "zero2"):
            if t.sharding == "zero2":
                _zero2_rows(add, c, axis, numel)
            for chunks, fp8 in bufs:
                n, gdt, what = sum(chunks.values()), "fp8" if fp8 else t.param_dtype, ", fp8 parameters" * fp8
                if t.sharding == "zero1":
                    add(axis, "step", "reduce-scatter", n * dtype_bytes(rs), rs, 0, f"once per step{what}",
                        "optimizer step", per_step=1)
                add(axis, "step", "all-gather", n * dtype_bytes(gdt), gdt, 0,
                    f"once per step (updated params{what})", "next step's forward", per_step=1)
        elif t.framework == "megatron":  # Megatron-LM 2022's local DDP: one all-reduce of its contiguous buffer
            add("loss" if axis == "fsdp" else axis, "backward", "all-reduce", numel * dtype_bytes(rs),
                rs, 0, "once per step (DDP, one bucket: Megatron-LM's contiguous buffer)", "optimizer step",
                per_step=1)
        else:
            _ddp_rows(add, c, axis)
        if t.sharding in ("zero1", "zero2"):
            _replica_rows(add, c, axis, numel)


#: Cadence of ZeRO-1/2's all-reduce of the reduced gradient shard across dp_replicate (:func:`_replica_rows`).
REPLICA_CADENCE = ("once per step (the reduced gradient shard across the replicas: Megatron-LM's partial "
                   "distributed optimizer, --num-distributed-optimizer-instances)")


def _replica_rows(add, c: StageContext, axis: str, numel: int) -> None:
    """ZeRO-1/2 on a mesh with dp_replicate > 1: the optimizer state sharded over ``axis``'s
    shards (fsdp or efsdp) within each replica, so each rank's reduced gradient shard,
    ``numel // shards`` elements in the reduce dtype, is all-reduced across the dp_replicate
    replicas once per step, after the reduce-scatter and before the optimizer step (Megatron-LM's
    partial distributed optimizer: ``param_and_grad_buffer.py`` ``start_grad_sync``, "With multiple
    DistOpt instances, we need to all-reduce across instances", an all-reduce of each bucket's
    local shard over the inter-instance group). Without it the replicas would never exchange
    gradients. E.g. Llama-3-8B at dp_replicate 16 x tp 4, dp_shard 1: 2,007,764,992 elements
    x 4 B (fp32) = 8,031,059,968 B over 16 ranks. ``add`` drops it where dp_replicate is 1."""
    rs = c.training.gradient_reduce_dtype
    add("dp_replicate", "step", "all-reduce", numel // max(fsdp_shards(c)[axis], 1) * dtype_bytes(rs), rs, 0,
        REPLICA_CADENCE, "optimizer step", per_step=1)


def te_fp8_by_chunk(c: StageContext) -> Counter[int]:
    """Elements of Transformer Engine's fp8 weights on the stage by local chunk
    (:func:`meshplan.memory.te_fp8.is_weight`, dense), which ``--fp8-param-gather`` keeps as uint8
    parameters in a DDP buffer of their own (:mod:`meshplan.memory.te_fp8`); empty without it."""
    m, t, out = c.model, c.training, Counter[int]()
    if not (t.fp8_param_gather and te_fp8.applies(t)):
        return out
    tp, ep, etp = c.mesh.degree("tp"), c.mesh.ep, c.mesh.etp
    per: dict[bool, int] = {}  # a layer's tensors depend on it only through is_moe_layer
    for i in c.layers:
        moe = m.is_moe_layer(i)
        if moe not in per:
            per[moe] = sum(local_numel(x, m, tp, ep, etp, t.framework) for x in m.layer_tensors(i)
                           if te_fp8.is_weight(t, x) and not x.expert)
        out[(c.chunk_of or {}).get(i, 0)] += per[moe]
    return +out


#: Cadence mark of ZeRO-2's per-micro-batch bucket reduce-scatters (:func:`_zero2_rows`).
ZERO2_CADENCE = "(ZeRO-2 bucket"


def _zero2_rows(add, c: StageContext, axis: str, numel: int) -> None:
    """ZeRO-2's gradient reduce-scatters of the stage's ``numel`` gradient elements over
    ``axis`` in one micro-batch: ``numel // B`` buckets of ``B`` elements and one of the rest
    (:func:`~meshplan.comm.megatron_buckets.split_buckets`), ``B`` =
    :func:`~meshplan.comm.megatron_buckets.bucket_cap`, the fsdp degree's (the bucket the memory
    model holds during every backward). Issued in every micro-batch's backward as each bucket
    fills; e.g. 8.03e9 elements, B 5e8: 16 of 5e8 and 1 of 3e7."""
    bucket = bucket_cap(c)
    full, rest = split_buckets(numel, bucket)
    rs = c.training.gradient_reduce_dtype
    for size, k in ((bucket, full), (rest, 1 if rest else 0)):
        add(axis, "backward", "reduce-scatter", size * dtype_bytes(rs), rs, k,
            f"every micro-batch, {k} of {full + (1 if rest else 0)} buckets {ZERO2_CADENCE} {bucket:,} elements, "
            f"issued as it fills)", "optimizer step")


#: torch DDP's bucket caps (torch 2.13 ``torch/nn/parallel/distributed.py``: ``bucket_cap_mb``
#: default 25 MiB, ``dist._DEFAULT_FIRST_BUCKET_BYTES`` 1 MiB for the first bucket when the cap
#: is the default).
DDP_BUCKET_BYTES = 25 * 2 ** 20
DDP_FIRST_BUCKET_BYTES = 2 ** 20


def ddp_buckets(sizes_bytes: list[int], cap_bytes: int, first_cap_bytes: int) -> list[int]:
    """Bytes of each gradient bucket when tensors of ``sizes_bytes`` (in gradient-ready order)
    fill buckets as torch's reducer does (``compute_bucket_assignment_by_size``): whole tensors
    are added to the open bucket, which closes once it holds at least its cap, the first bucket's
    ``first_cap_bytes``, every later one's ``cap_bytes``.

    >>> ddp_buckets([4, 600, 300, 300, 300, 10], 500, 100)
    [604, 600, 310]
    """
    out: list[int] = []
    cur = 0
    for b in sizes_bytes:
        cur += b
        if cur >= (first_cap_bytes if not out else cap_bytes):
            out.append(cur)
            cur = 0
    return out + ([cur] if cur else [])


def _ddp_rows(add, c: StageContext, axis: str) -> None:
    """DDP's gradient all-reduces of the stage in steady state: one per bucket, issued in the
    backward as each bucket fills (torch's reducer, after the first step's rebuild in
    gradient-ready order; the table takes that order as the reverse of the parameters'). The
    bucket cap is ``[memory] grad_bucket_elements`` x the reduce dtype's bytes, for the first
    bucket too; by default torch's 25 MiB, the first 1 MiB (:func:`ddp_buckets`). One row per
    bucket size, ``per_step`` buckets of that size (micro-batches before the last run under
    ``no_sync``). torch's very first step sends one bucket of every gradient (its initial
    bucketing with ``find_unused_parameters=False``); ``validate`` records that step and sets
    the bucket to the whole model to match it."""
    m, mesh, rs = c.model, c.mesh, c.training.gradient_reduce_dtype
    b, tp = dtype_bytes(rs), mesh.degree("tp")
    sizes = [local_numel(x, m, tp, mesh.ep, mesh.etp, c.training.framework) * b for x in reversed(registered_tensors(c))
             if x.expert == (axis == "efsdp")]
    if c.bucket_elements is None:
        cap, first = DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
    else:
        cap = first = c.bucket_elements * b
    buckets = ddp_buckets([x for x in sizes if x > 0], cap, first)
    how = (f"{c.bucket_elements:,} elements" if c.bucket_elements is not None else "torch's 25 MiB, the first 1 MiB")
    for size, k in sorted(Counter(buckets).items(), key=lambda kv: -kv[1]):
        add("loss" if axis == "fsdp" else axis, "backward", "all-reduce", size, rs, 0,
            f"per step, {k} of {len(buckets)} buckets (DDP, bucket cap {how})", "optimizer step", per_step=k)
