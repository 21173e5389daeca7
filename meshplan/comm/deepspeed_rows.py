"""DeepSpeed ZeRO-3 of 2021's rows of the collective table (``zero3_engine = "deepspeed-2021"``;
its mechanisms, counts and host costs: :mod:`meshplan.comm.deepspeed`): per micro-batch one
list-based all-gather per gathered parameter tensor, one all-reduce (or, with
``contiguous_gradients``, one reduce-scatter per gradient) per gradient bucket, and once per
step the persistent parameters' all-gather, all over the data-parallel group (fsdp).
"""

from __future__ import annotations

from collections import Counter

from meshplan.comm import deepspeed
from meshplan.comm.stage_context import StageContext, model_code_params
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.spec.memory import MemoryOptions
from meshplan.units import dtype_bytes


def zero3_2021_rows(add, c: StageContext) -> None:
    """DeepSpeed ZeRO-3 of 2021 (:mod:`meshplan.comm.deepspeed`): per micro-batch one
    all-gather per gathered parameter tensor in forward, its re-gathers in backward (each timed
    with the ``n`` list copies; its host time with the loop's ``get_rank`` calls and the zero fill
    the host waits for), and one
    all-reduce per gradient bucket, over the data-parallel group; one row per (phase, op,
    size), ``per_microbatch`` its calls. The root (embedding, positions, final norm, an untied
    output layer) is gathered once in forward and once in backward; a tied output layer
    reuses the embedding's weight (one more forward gather at the logits, kept for their
    backward). Once per step the optimizer step gathers the persistent parameters again."""
    t, mesh = c.training, c.mesh
    n, data = mesh.degree("fsdp"), kernel_data(c.gpu)
    later = 0
    calls: Counter = Counter()
    for k, i in reversed(list(enumerate(c.layers))):
        params = model_code_params(c, [i], False, False)
        for name, numel in params:
            fwd, bwd, _ = deepspeed.layer_calls(params, c.layer_recomputed(k), 2 * later)[name]
            size = deepspeed.padded(numel, n)
            calls[("layer", "forward", "all-gather", size)] += fwd
            calls[("layer", "backward", "all-gather", size)] += bwd
        later += sum(x for _, x in params)
    tied = c.model.tied_embeddings and c.first and c.last
    root = model_code_params(c, [], c.first, c.last)
    for name, numel in root:
        size, gathered = deepspeed.padded(numel, n), numel >= deepspeed.PERSISTENCE_THRESHOLD
        extra = 1 if tied and name in ("embedding", "word_embedding") else 0
        calls[("root", "forward", "all-gather", size)] += gathered * (1 + extra)
        calls[("root", "backward", "all-gather", size)] += gathered
    ag = t.compute_dtype
    for (unit, phase, op, size), count in sorted(calls.items(), key=lambda kv: (kv[0][0] != "layer", kv[0][1:])):
        label = "root (embedding/norm/output)" if unit == "root" else "layer"
        add("fsdp", phase, op, size * dtype_bytes(ag), ag, count,
            f"{deepspeed.CADENCE}, every {label}, list of {n} outputs/inputs)", f"the {label}'s GEMMs", 7,
            list_copies=True, ds_host_s=deepspeed.host_seconds(n, data, get_rank=True)
            + deepspeed.zero_fill_seconds(size * dtype_bytes(ag), data))
    _deepspeed_grad_rows(add, c, root, data)
    persistent = [k for i in c.layers for _, k in model_code_params(c, [i], False, False)
                  if k < deepspeed.PERSISTENCE_THRESHOLD]
    persistent += [k for _, k in root if k < deepspeed.PERSISTENCE_THRESHOLD]
    if persistent:  # _post_step: all of them at once, synchronously, their n x p copies issued one by one
        p = t.param_dtype
        add("fsdp", "step", "all-gather", sum(deepspeed.padded(k, n) for k in persistent) * dtype_bytes(p), p, 0,
            f"once per step (DeepSpeed ZeRO-3 persistent parameters, {len(persistent)} tensors gathered in the "
            f"optimizer step, list of {n} outputs)", "the next step's forward", 1, per_step=1, list_copies=True,
            ds_host_s=deepspeed.persistent_gather_host_seconds(persistent, n, data))


def _deepspeed_grad_rows(add, c: StageContext, root: list[tuple[str, int]], data) -> None:
    """DeepSpeed ZeRO-3 of 2021's gradient all-reduces per micro-batch
    (:func:`meshplan.comm.deepspeed.grad_buckets`): the stage's gradients in the order the
    backward produces them (the final norm's and an untied output layer's, the layers' from
    the last, each layer's parameters from its last, then the embeddings': a tied word
    embedding's gradient is complete only there), bucketed by ``reduce_bucket_size`` (``[memory]
    grad_bucket_elements``, default 5e8); a bucket is the layer's when most of its elements are
    a layer's, else the root's. One row per (unit, bucket elements, tensors, the module whose
    gradient flushes it: :func:`meshplan.comm.deepspeed.flush_modules`, where the rank timeline
    places it). With
    ``training.contiguous_gradients`` the same buckets, each gradient reduce-scattered
    (:func:`_deepspeed_scatter_rows`)."""
    t = c.training
    tag = lambda unit, name: (unit, deepspeed.module_of(name))
    head = [(tag("root", name), k) for name, k in root if "embedding" not in name]
    embed = [(tag("root", name), k) for name, k in root if "embedding" in name]
    order = head[::-1] + [(tag("layer", name), k) for i in reversed(c.layers)
                          for name, k in reversed(model_code_params(c, [i], False, False))] + embed[::-1]
    cap = MemoryOptions(grad_bucket_elements=c.bucket_elements).deepspeed_bucket_elements()  # reduce_bucket_size
    buckets = deepspeed.grad_buckets(order, cap)
    if t.contiguous_grads:
        _deepspeed_scatter_rows(add, c, buckets, cap, data)
        return
    rows: Counter = Counter()
    for bucket, flush in zip(buckets, deepspeed.flush_modules(buckets)):
        layer = sum(k for (unit, _), k in bucket if unit == "layer")
        total = sum(k for _, k in bucket)
        rows[("layer" if 2 * layer > total else "root", total, len(bucket), flush)] += 1
    g, n = t.gradient_reduce_dtype, c.mesh.degree("fsdp")
    for (unit, total, tensors, flush), count in sorted(rows.items()):
        label = "root (embedding/norm/output)" if unit == "root" else "layer"
        size = total * dtype_bytes(g)
        add("fsdp", "backward", "all-reduce", size, g, count,
            f"{deepspeed.CADENCE}, every {label}, gradient bucket of {tensors} flattened, reduce_bucket_size "
            f"{cap:,}, {deepspeed.FLUSHED}{flush})", "optimizer step", 1,
            ds_gpu_s=deepspeed.bucket_copy_seconds(size, data), ds_host_s=deepspeed.bucket_host_seconds(tensors, data))


def _deepspeed_scatter_rows(add, c: StageContext, buckets: list, cap: int, data) -> None:
    """DeepSpeed ZeRO-3 of 2021's gradient reduce-scatters per micro-batch under
    ``contiguous_gradients`` (:mod:`meshplan.comm.deepspeed`): ``buckets`` (lists of (unit,
    module), elements), :func:`meshplan.comm.deepspeed.grad_buckets`) of ``cap`` elements, each
    gradient one list-based reduce-scatter of its padded size (the ``n`` list copies and
    views), the bucket's first one after the ipg buffer's ``div_``
    (:func:`~meshplan.comm.deepspeed.contiguous_gpu_seconds`), each one's copy into the buffer
    and slice kept on the compute stream (:func:`~meshplan.comm.deepspeed.contiguous_host_seconds`).
    One row per (unit, gradient elements, past the bucket, first of its bucket, flushing module)."""
    g, n = c.training.gradient_reduce_dtype, c.mesh.degree("fsdp")
    rows: Counter = Counter()
    for bucket, flush in zip(buckets, deepspeed.flush_modules(buckets)):
        for j, ((unit, _), k) in enumerate(bucket):
            rows[(unit, k, k > cap, j == 0, flush)] += 1
    for (unit, k, large, first, flush), count in sorted(rows.items()):
        label = "root (embedding/norm/output)" if unit == "root" else "layer"
        size, grad = deepspeed.padded(k, n) * dtype_bytes(g), k * dtype_bytes(g)
        how = "past the bucket, divided alone" if large else "copied into the bucket's buffer"
        add("fsdp", "backward", "reduce-scatter", size, g, count,
            f"{deepspeed.CADENCE}, every {label}, contiguous_gradients: {how}"
            f"{', first of its bucket' if first else ''}, reduce_bucket_size {cap:,}, list of {n} inputs, "
            f"{deepspeed.FLUSHED}{flush})",
            "optimizer step", 1, list_copies=True,
            ds_gpu_s=deepspeed.contiguous_gpu_seconds(grad, cap * dtype_bytes(g), large, first, data),
            ds_host_s=deepspeed.host_seconds(n, data) + deepspeed.contiguous_host_seconds(grad, large, first, data))
