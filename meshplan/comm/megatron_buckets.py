"""Megatron-LM's DDP gradient buffers under ``--overlap-grad-reduce`` (``training.overlap_grad_reduce``,
sharding none or zero1): which model chunks are split into buckets (:func:`megatron_bucketed`) and
the collective table's rows of their reductions and, under the distributed optimizer, their
parameter all-gathers (:func:`megatron_bucket_rows`).
"""

from __future__ import annotations

from collections import Counter

from meshplan.comm.stage_context import StageContext
from meshplan.spec.memory import MemoryOptions
from meshplan.units import dtype_bytes

#: Cadence mark of the bucketed reductions of Megatron-LM's DDP buffers under
#: ``training.overlap_grad_reduce`` (:func:`megatron_bucket_rows`); "(DDP" places them as DDP's
#: buckets in the rank timeline (:func:`meshplan.schedule.grad_reduce.reduce_pieces`).
MEGATRON_BUCKET_CADENCE = "(DDP buffer bucket"

#: Cadence mark of the rows of a stage's first model chunk (virtual stage 0 of the rank), whose
#: parameter all-gather Megatron-LM's interleaved schedule makes the next forward wait for
#: (:func:`meshplan.schedule.step_end.first_chunk_shares`).
CHUNK0_MARK = "model chunk 0"


def megatron_bucketed(stage: int, chunk: int) -> bool:
    """Whether Megatron-LM splits the gradient buffers of pipeline rank ``stage``'s local model
    chunk ``chunk`` into buckets of ``--ddp-bucket-size``: only pipeline rank 0's first chunk.
    ``DistributedDataParallel.__init__`` sets ``bucket_size = None`` (one bucket per buffer) on
    pipeline ranks > 0 ("data-parallel communication on these stages is not on the critical
    path") or under ``disable_bucketing``, which ``get_model`` sets for every local chunk after the
    first (NVIDIA/Megatron-LM d98e8a6, megatron/core/distributed/distributed_data_parallel.py lines
    159-171; megatron/training/training.py lines 2503-2510: also under
    ``--overlap-param-gather-with-optimizer-step``, which meshplan does not plan).

    >>> [megatron_bucketed(s, k) for s, k in ((0, 0), (0, 1), (1, 0), (3, 2))]
    [True, False, False, False]
    """
    return stage == 0 and chunk == 0


def split_buckets(numel, bucket):
    """(full buckets, elements of the last) of a bucketed buffer of ``numel`` elements in buckets of
    ``bucket`` (:func:`bucket_sizes`): ``numel // bucket`` of ``bucket`` and one of the rest when
    there is a rest. Ints, or numpy arrays (the search's bound,
    :func:`meshplan.search.step_end_bound.per_step_gather`).

    >>> split_buckets(73_671_552, 4 * 10**7), split_buckets(8 * 10**7, 4 * 10**7)
    ((1, 33671552), (2, 0))
    """
    return divmod(numel, bucket)


def bucket_sizes(c: StageContext, numel_by_chunk: dict[int, int]) -> list[tuple[int, int, int]]:
    """(elements, calls, chunk) of one buffer's buckets over the stage's local chunks
    (``numel_by_chunk``: chunk -> the buffer's gradient elements in it), chunk by chunk: a bucketed
    chunk (:func:`megatron_bucketed`) in buckets of ``B`` = :func:`bucket_cap`, ``numel // B`` of
    ``B`` and one of the rest (Megatron closes a bucket at the first whole parameter that reaches
    ``B``: ``_compute_default_per_buffer_param_layout``, so each holds up to one parameter more);
    any other chunk in one bucket of all its elements.

    2.2e9 elements at dp 8 (B = 4e7) in stage 0's one chunk: 55 buckets of 4e7; the same on stage 1:
    one of 2.2e9.
    """
    out = []
    for chunk, numel in sorted(numel_by_chunk.items()):
        if numel and megatron_bucketed(c.stage, chunk):
            full, rest = split_buckets(numel, bucket_cap(c))
            out += [(bucket_cap(c), full, chunk)] * bool(full) + [(rest, 1, chunk)] * bool(rest)
        elif numel:
            out.append((numel, 1, chunk))
    return out


def bucket_cap(c: StageContext) -> int:
    """``B``, the bucket cap in elements: :meth:`~meshplan.spec.memory.MemoryOptions.bucket_elements`
    of the fsdp degree, dp x cp (``max(40e6, 1e6 x dp x cp)``: ``get_model`` sets ``bucket_size``
    by ``resolve_ddp_bucket_size`` over the ``dp_cp`` group before ``DistributedDataParallel`` is built,
    d98e8a6 megatron/training/training.py lines 2179-2193 and 2497-2502, so DDP's own default over
    the dp group without cp, distributed_data_parallel.py lines 131-134, does not apply; or
    ``--ddp-bucket-size``). dp_shard 8 x cp 8: 64,000,000."""
    return MemoryOptions(grad_bucket_elements=c.bucket_elements).bucket_elements(c.mesh.degree("fsdp"))


def megatron_bucket_rows(add, c: StageContext, axis: str, numel_by_chunk: dict[int, int],
                         fp8_buffer: bool = False) -> None:
    """The rows of one buffer kind's (``axis``: fsdp dense, efsdp routed experts) buckets
    (:func:`bucket_sizes`; one row per size and chunk kind). Each is reduced once per step, in
    the last micro-batch's backward, when its gradients are all ready (``register_grad_ready``):
    an all-reduce (none) or a reduce-scatter (zero1, the distributed optimizer), then zero1
    all-gathers the updated parameters bucket by bucket. Rows of the stage's first chunk carry
    :data:`CHUNK0_MARK`. E.g. 2.2e9 elements at dp 8 on stage 0: 55 buckets of 4e7.
    ``fp8_buffer``: the buffer of Transformer Engine's fp8 parameters under ``--fp8-param-gather``
    (uint8 parameters, a buffer apart: d98e8a6 ``param_and_grad_buffer.py:921-923``; its own
    buckets, its gradients in the reduce dtype), whose all-gather moves 1 B a value
    (:mod:`meshplan.memory.te_fp8`)."""
    t, rs = c.training, c.training.gradient_reduce_dtype
    gdt = "fp8" if fp8_buffer else t.param_dtype
    rows: Counter[tuple[int, int, bool]] = Counter()
    for size, k, chunk in bucket_sizes(c, numel_by_chunk):
        rows[(size, chunk == 0, megatron_bucketed(c.stage, chunk))] += k
    total = sum(rows.values())
    word = {True: f"{bucket_cap(c):,} elements", False: "one per chunk: pipeline rank > 0 or chunk > 0"}
    hows = {key: f"{k} of {total} buckets {MEGATRON_BUCKET_CADENCE} {word[key[2]]}" + ", fp8 parameters" * fp8_buffer
                 + (f", {CHUNK0_MARK}" if key[1] else "") + ", --overlap-grad-reduce)" for key, k in rows.items()}
    for key, k in rows.items():
        size, how = key[0], hows[key]
        if t.sharding == "zero1":
            add(axis, "step", "reduce-scatter", size * dtype_bytes(rs), rs, 0, f"once per step, {how}",
                "optimizer step", per_step=k)
        else:
            add("loss" if axis == "fsdp" else axis, "backward", "all-reduce", size * dtype_bytes(rs), rs, 0,
                f"once per step, {how}", "optimizer step", per_step=k)
    for key, k in rows.items() if t.sharding == "zero1" else ():
        add(axis, "step", "all-gather", key[0] * dtype_bytes(gdt), gdt, 0,
            f"once per step (updated params), {hows[key]}", "next step's forward", per_step=k)
