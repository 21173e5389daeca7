"""The FSDP rows of the collective table (:func:`meshplan.comm.collectives.collective_table`):
FSDP2 and HSDP (``sharding`` zero3 or hsdp; DeepSpeed's ZeRO-3 engine of today beside them,
DeepSpeed's of 2021 in :mod:`meshplan.comm.deepspeed_rows`), the stage's FSDP units
(:func:`fsdp_units`) and which passes find a unit sharded (:func:`fsdp_gather_flags`).

- FSDP2 (zero3, hsdp): one unit per transformer layer and the ends as torchtitan wraps them
  (``TrainingSpec.torchtitan_units``: the embedding on the stage holding it, chunk 0 of stage
  0, and [final norm, output] on the stage holding the last chunk, at every pp and vpp; tied
  embeddings at pp 1, Megatron and DeepSpeed: one root unit of both ends; tied under pp: the
  embedding's unit kept gathered, the last stage's [norm, output] with its output copy). Each unit is
  all-gathered in forward, again in backward when ``reshard_after_forward`` (not the
  unit holding the output layer, which torchtitan keeps gathered unless
  ``training.reshard_head_after_forward``, its policy ``"always"``: :func:`kept_gathered`), and its gradients
  reduce-scattered in backward, every micro-batch. FSDP2 pads dim 0 of each
  parameter to a multiple of the shard degree (:func:`~meshplan.mesh.tpsplit.fsdp_padded_numel`).
  HSDP all-reduces each unit's gradient shard over dp_replicate. Under ep > 1 expert weights
  are all-gathered apart over efsdp (torchtitan; under ep 1 with the layer:
  :func:`~meshplan.mesh.tpsplit.experts_apart`),
  sharded on dim 1 when efsdp x ep > experts (torchtitan's
  ``shard_placement_fn``, :func:`~meshplan.spec.axes.ep.expert_shard_dim`), so a rank's one
  expert over efsdp 4 is gathered unpadded, not as 4 experts' rows. Gradient accumulation with pp 1
  (``training.grad_accumulation``): ``no_sync`` reduce-scatters (and HSDP all-reduces) once
  per step, in the last micro-batch; ``no_sync_unsharded`` also gathers in forward only in
  micro-batch 0 (:func:`_accumulation_gathers`); measured with torch 2.13's FSDP2 on the
  fake process group (``tests/test_grad_accumulation.py``).
- With pp > 1, FSDP2 inside ``torch.distributed.pipelining`` reduce-scatters each unit once
  per step and gathers it when the schedule finds it sharded (:func:`_pipelined_gathers`): under
  torch also after its window of 3 local stages evicted it (vpp > 3,
  :mod:`meshplan.pipeline.unshard_window`).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Callable, Optional

from meshplan.comm import deepspeed_ipg, fsdp2, zeropp_rows
from meshplan.comm.stage_context import StageContext
from meshplan.compute import float8_fsdp
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.mesh.tpsplit import experts_apart, fsdp_padded_numel, local_numel, padded_vocab
from meshplan.pipeline.simulate import stage_order
from meshplan.memory.deepspeed_fetch import deepspeed_reuse, layer_param_bytes
from meshplan.pipeline.unshard_window import evicted, pipeline_window
from meshplan.spec.deepspeed_memory import deepspeed_copied_bytes
from meshplan.spec.mesh import Schedule
from meshplan.units import dtype_bytes

#: Cadence of the per-step all-reduce of the float8 weights' amaxes (``fp8_all_gather``), which
#: torchao's ``precompute_float8_dynamic_scale_for_fsdp`` issues after the optimizer step, over
#: fsdp and, under TP, again over tp (:func:`meshplan.compute.float8_fsdp.precompute_all_reduces`).
FLOAT8_PRECOMPUTE_CADENCE = "once per step (float8 amax of every float8 weight, precompute_float8_dynamic_scale_for_fsdp)"


def fsdp_rows(add, c: StageContext) -> None:
    """The stage's FSDP2 / HSDP rows (sharding zero3 with ``zero3_engine`` fsdp2 or deepspeed,
    or hsdp): per kind of unit (:func:`fsdp_units`) its all-gathers, reduce-scatters and HSDP
    all-reduces (:func:`_unit_rows`), then the float8 weights' amax all-reduces of
    ``fp8_all_gather`` (:data:`FLOAT8_PRECOMPUTE_CADENCE`)."""
    units = fsdp_units(c, fsdp_shards(c))
    copies = _copy_seconds(c)
    for key, n in Counter(u[:3] + u[4:] for u in units).items():
        _unit_rows(add, c, units, key, n, copies)
    amax = sum(u[5] for u in units if u[1] == "fsdp")
    for dim in float8_fsdp.precompute_all_reduces(c.mesh.degree("tp")):  # Partial over fsdp, and over tp under TP
        add(dim, "step", "all-reduce", amax * 4, "fp32", 0, FLOAT8_PRECOMPUTE_CADENCE, "next step's forward",
            depth=0, per_step=1)


def fsdp_shards(c: StageContext) -> dict[str, int]:
    """Shard degree of each FSDP unit axis: ``fsdp`` (dense weights) and ``efsdp`` (experts)."""
    return {"fsdp": c.mesh.degree("fsdp"), "efsdp": c.mesh.degree("efsdp")}


def _deepspeed_engine(c: StageContext) -> bool:
    """DeepSpeed's ZeRO-3 engine of today (``zero3_engine = "deepspeed"``): its copies run on
    its collectives' streams, not on the compute stream."""
    return c.training.sharding == "zero3" and c.training.zero3_engine == "deepspeed"


def _copy_seconds(c: StageContext) -> Callable[[int, int], tuple[float, float]]:
    """``copies(gathered bytes, numel)``: (copy-out, copy-in) seconds of one unit: FSDP2's
    copy-out after each all-gather and copy-in before each reduce-scatter, on the compute
    stream (:mod:`meshplan.comm.fsdp2`); Megatron FSDP's GEMMs use its buckets in place (0, 0);
    DeepSpeed's ZeRO-3 copies the gradient into its bucket in the reduce dtype, on its reduce
    stream (its copy-out: :func:`_deepspeed_copied`)."""
    t, ds = c.training, _deepspeed_engine(c)
    data, hbm = kernel_data(c.gpu), c.gpu.hbm_bandwidth_bytes_per_s
    grad_b, red_b = fsdp2.copy_in_element_bytes(t)  # unsharded gradients, reduce-scatter input
    if ds:  # the gradient into DeepSpeed's bucket, in the reduce dtype
        grad_b, red_b = dtype_bytes(t.compute_dtype), dtype_bytes(t.gradient_reduce_dtype)

    def copies(gathered: int, numel: int) -> tuple[float, float]:
        if not (fsdp2.compute_stream_copies(t) or ds):
            return 0.0, 0.0
        return (fsdp2.copy_out_seconds(gathered, data, hbm),
                fsdp2.copy_in_seconds(numel, grad_b, red_b, data, hbm))

    return copies


def _unit_rows(add, c: StageContext, units: list, key: tuple, n: int,
               copies: Callable[[int, int], tuple[float, float]]) -> None:
    """The rows of ``n`` FSDP units of one kind, ``key`` = (label, axis, unsharded elements,
    all-gather bytes, float8 weights, cast seconds) of :func:`fsdp_units`: forward and backward
    all-gathers (FSDP2 gathers float8 weights beside compute-dtype ones in one byte buffer,
    ``uint8``), the gradient reduce-scatter and, under HSDP, the all-reduce of the gradient
    shard over dp_replicate, counted by :func:`_call_counts`. FSDP2's copies (``copies``,
    :func:`_copy_seconds`) run on the compute stream (``copy_s``), DeepSpeed's on its
    collectives' streams (added to their time, with its copy-out :func:`_deepspeed_copied`);
    the float8 weights' pre-all-gather casts on FSDP2's copy-in stream delay each all-gather.
    DeepSpeed's layers reduce-scatter once per ipg bucket of ``reduce_bucket_size``
    (:func:`meshplan.comm.deepspeed_ipg.bucket_rows`), not once per layer."""
    label, axis, numel, gbytes, fp8, cast_s = key
    t, ds = c.training, _deepspeed_engine(c)
    rs = t.gradient_reduce_dtype
    cadence = f"per {label}" if label.startswith("root") else "every MoE layer's experts" if label == "experts" \
        else f"every {label}"  # the routed experts' own unit (efsdp) of each MoE layer
    gdt = t.compute_dtype if not fp8 else "uint8" if gbytes != numel else "fp8"  # FSDP2: mixed dtypes in a byte buffer
    fwd, back, red = _call_counts(c, units, (label, axis, numel), n)
    out_s, in_s = copies(gbytes, numel)
    on_compute = (0.0, 0.0) if ds else (out_s, in_s)  # copy_s: the compute stream's
    on_stream = (0.0, in_s) if ds else (0.0, 0.0)  # ds_gpu_s: added to the collective's time
    data, hbm = kernel_data(c.gpu), c.gpu.hbm_bandwidth_bytes_per_s
    ds_out = [fsdp2.copy_out_seconds(b, data, hbm) for b in _deepspeed_copied(c, units, label, gbytes)] \
        if ds else [0.0, 0.0]  # (forward, backward)
    if ds and zeropp_rows.applies(c):  # DeepSpeed ZeRO++: hpZ, qwZ, qgZ in place of the rows below
        u = zeropp_rows.Unit(label, numel, gbytes, gdt, cadence, n, tuple(ds_out), cast_s, in_s)
        reuse = _deepspeed_reuse(c) if label == "layer" and n == len(c.layers) else None
        zeropp_rows.unit_rows(add, c, u, fwd, back, red, reuse, REUSE_PART)
        return
    add(axis, "forward", "all-gather", gbytes, gdt, fwd[0], cadence, f"the {label}'s GEMMs", 7,
        per_step=fwd[1], copy_s=on_compute[0], ds_gpu_s=ds_out[0] + cast_s)
    reuse = _deepspeed_reuse(c) if ds and label == "layer" and n == len(c.layers) else None
    if reuse is not None:  # the calls stage3_max_reuse_distance leaves, per layer
        _reuse_gathers(add, axis, gbytes, gdt, reuse.backward, per_step=back[1], ds_gpu_s=(ds_out[1], cast_s))
    else:
        add(axis, "backward", "all-gather", gbytes, gdt, back[0], cadence,
            f"the {label}'s backward", 7, per_step=back[1], copy_s=on_compute[0], ds_gpu_s=ds_out[1] + cast_s)
    if ds and label == "layer":  # one reduce-scatter per ipg bucket of reduce_bucket_size (deepspeed_ipg)
        layer = [x.numel for x in zeropp_rows.unit_tensors(c, label, numel)]
        deepspeed_ipg.bucket_rows(add, c, layer, n, cadence, red, in_s)
    else:
        add(axis, "backward", "reduce-scatter", numel * dtype_bytes(rs), rs, red[0], cadence, "optimizer step",
            per_step=red[1], copy_s=on_compute[1], ds_gpu_s=on_stream[1])
    if "dp_replicate" in c.mesh.layout.names:
        add("dp_replicate", "backward", "all-reduce", numel // fsdp_shards(c)[axis] * dtype_bytes(rs), rs, red[0],
            cadence + " (HSDP replicas)", "optimizer step", per_step=red[1])


#: Cadence words of a layer's backward all-gather of less than its unit: the parameters DeepSpeed's
#: ``stage3_max_reuse_distance`` kept gathered are not gathered again (:func:`_reuse_gathers`).
REUSE_PART = "the part stage3_max_reuse_distance did not keep"


def _deepspeed_reuse(c: StageContext):
    """:func:`meshplan.memory.deepspeed_fetch.deepspeed_reuse` of the stage (None: not DeepSpeed's
    ZeRO-3 on one stage)."""
    return deepspeed_reuse(c.model, c.training, c.mesh, c.deepspeed_reuse) if c.first and c.last else None


def _reuse_gathers(add, axis: str, gbytes: int, gdt: str, backward: tuple, per_step, ds_gpu_s: tuple) -> None:
    """DeepSpeed ZeRO-3's layer all-gathers in backward under ``stage3_max_reuse_distance``
    (``backward``: :attr:`~meshplan.memory.deepspeed_fetch.ReuseBytes.backward`, each layer's
    calls as shares of its unit of ``gbytes``): one row per share, a whole unit ``every layer`` as
    before, a part (:data:`REUSE_PART`) its share of the bytes and of the copy-out
    (``ds_gpu_s``: the whole unit's copy-out and cast seconds). Under full recompute at a distance
    below a layer's own, every layer twice (the replay's and the backward's); none for a layer
    kept whole."""
    calls = Counter(round(x, 9) for shares in backward for x in shares)
    for x, k in sorted(calls.items(), reverse=True):
        whole = x >= 1 - 1e-9
        add(axis, "backward", "all-gather", gbytes if whole else round(gbytes * x), gdt, k,
            "every layer" if whole else f"every layer, {REUSE_PART} ({x:.2%})", "the layer's backward", 7,
            per_step=per_step, ds_gpu_s=ds_gpu_s[0] * x + ds_gpu_s[1])


def _call_counts(c: StageContext, units: list, key: tuple, n: int) -> tuple[tuple, tuple, tuple]:
    """``add``'s (per_mb, per_step) of the forward all-gathers, the backward all-gathers and the
    gradient reductions of ``n`` units of one kind, ``key`` = (label, axis, unsharded elements):
    ``n`` every micro-batch by default; with pp > 1 the gathers per step as the schedule finds
    the units sharded (:func:`_pipelined_gathers`) and one reduce-scatter per unit per schedule
    run (``PipelineStage.perform_reduce_grad``); with pp 1 as ``training.grad_accumulation``
    says (:func:`_accumulation_gathers`)."""
    t, pipelined = c.training, c.mesh.degree("pp") > 1
    root = kept_gathered(key[0], t, c.model.tied_embeddings)
    if root and key[0] == "root (norm/output)" and _deepspeed_engine(c):  # DeepSpeed: stage3_max_reuse_distance 0
        root = getattr(_deepspeed_reuse(c), "head_kept", True)  # releases the output layer after its forward
    per_step = _pipelined_gathers(c, root, [u[3] for u in units if u[:3] == key]) \
        if pipelined else _accumulation_gathers(c, root, n)
    fwd = _per_microbatch(per_step[0], n, c.micro, pipelined) if per_step is not None else (n, None)
    back = _per_microbatch(per_step[1], n, c.micro, pipelined) if per_step is not None \
        else (0 if root or not t.reshard_after_forward else n, None)
    red = (0, n * c.runs) if pipelined or t.grad_accumulation != "sync" else (n, None)
    return fwd, back, red


def fsdp_units(c: StageContext, shards: dict[str, int]) -> list[tuple[str, str, int, int, int, int, float]]:
    """FSDP units of the stage as (label, axis, unsharded elements per rank incl. padding,
    local chunk, all-gather bytes, float8 weights, seconds of their pre-all-gather casts); the
    root's chunk is the first (embedding) or the last (output layer); under a V-shaped schedule
    stage 0 holds both, each chunk module its own FSDP root. All-gather bytes: each weight in
    ``training.gather_dtype`` (float8 Linear weights beside compute-dtype norms and
    embeddings in one buffer under ``fp8_all_gather``); the casts: torchao's
    ``fsdp_pre_all_gather`` of each float8 weight's local shard
    (:func:`meshplan.compute.float8_fsdp.pre_all_gather_seconds`)."""
    m, mesh, t = c.model, c.mesh, c.training
    tp, ep, etp = mesh.degree("tp"), mesh.ep, mesh.etp
    pad = t.sharding in ("zero3", "hsdp")
    data, pb = kernel_data(c.gpu), dtype_bytes(t.param_dtype)

    def numel(x, axis):
        return fsdp_padded_numel(x, m, shards[axis], tp, ep, etp) if pad else local_numel(x, m, tp, ep, etp)

    def unit(label, axis, tensors, chunk):
        n = [numel(x, axis) for x in tensors]
        f8 = [k // shards[axis] for k, x in zip(n, tensors) if t.gather_dtype(x) == "fp8"]
        cast = float8_fsdp.pre_all_gather_seconds(f8, pb, data, c.gpu.hbm_bandwidth_bytes_per_s) if f8 else 0.0
        return (label, axis, sum(n), chunk, sum(k * dtype_bytes(t.gather_dtype(x)) for k, x in zip(n, tensors)),
                len(f8), cast)

    out = []
    kinds: dict[bool, list] = {}  # a layer's tensors depend on it only through is_moe_layer (layer_tensors)
    for i in c.layers:
        moe = m.is_moe_layer(i)
        if moe not in kinds:
            ts = m.layer_tensors(i)
            apart = experts_apart(mesh) and any(x.expert for x in ts)
            kinds[moe] = [unit("layer", "fsdp", [x for x in ts if not (apart and x.expert)], 0)]
            if apart:
                kinds[moe].append(unit("experts", "efsdp", [x for x in ts if x.expert], 0))
        k = (c.chunk_of or {}).get(i, 0)
        out += [u[:3] + (k,) + u[4:] for u in kinds[moe]]
    v = padded_vocab(m.vocab, t.vocab_pad_divisor, tp)
    emb = m.embedding_tensors(v) if c.first else []
    head = [x for x in (m.head_tensors(v) if c.last else []) if not (x.tied and c.first)]
    one_module = c.first and c.last and c.vpp == 1  # pp 1: both ends in one chunk module
    if one_module and (m.tied_embeddings or not t.torchtitan_units):
        # tied (torchtitan: one unit of the three), or Megatron and DeepSpeed: one root unit
        out.append(unit("root (embedding/norm/output)", "fsdp", emb + head, 0))
    elif t.torchtitan_units or c.first and c.last:
        # torchtitan's units at every pp (TrainingSpec.torchtitan_units): the embedding on the
        # stage holding it (chunk 0), [norm, output] on the stage holding them (its last chunk);
        # otherwise a V, whose stage 0 holds both in two chunk modules (two FSDP roots)
        out += [unit("root (embedding)", "fsdp", emb, 0), unit("root (norm/output)", "fsdp", head, c.vpp - 1)]
    else:
        out.append(unit("root (embedding/norm/output)", "fsdp", emb + head, 0 if c.first else c.vpp - 1))
    return [u for u in out if u[2] > 0]


def kept_gathered(label: str, t, tied: bool = False) -> bool:
    """Whether the FSDP unit ``label`` stays gathered from its forward to its backward
    whatever ``reshard_after_forward`` says: the root, or under torchtitan's units
    (:attr:`~meshplan.spec.training.TrainingSpec.torchtitan_units`) the unit holding the
    output layer; the embedding's own unit reshards as a layer unless ``tied`` (torchtitan's
    tied branch reshards the ends after forward only under ``"always"``, on the first pipeline
    stage too). With ``training.reshard_head_after_forward`` (torchtitan's ``"always"``) no unit
    is kept: each reshards as a layer.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16)
    >>> [kept_gathered(u, t) for u in ("layer", "root (embedding)", "root (norm/output)")]
    [False, False, True]
    >>> kept_gathered("root (norm/output)", t.model_copy(update={"reshard_head_after_forward": True}))
    False
    """
    if not label.startswith("root") or t.reshard_head_after_forward:
        return False
    return not t.torchtitan_units or label != "root (embedding)" or tied


def _deepspeed_copied(c: StageContext, units: list, label: str, gathered: int) -> tuple[int, int]:
    """(forward, backward) bytes DeepSpeed ZeRO-3 (``zero3_engine = "deepspeed"``, edaa722) copies
    out of one all-gather of the unit ``label`` of ``gathered`` bytes, on its all-gather stream
    (:func:`meshplan.comm.fsdp2.compute_stream_copies`): only the part its coordinator prefetched,
    ``torch.cat`` in ``AllGatherCoalescedHandle.wait`` (``partition_parameters.py:750-784``); the
    rest is gathered parameter by parameter (``_all_gather_sequential``, :1339-1376), the
    parameters views of the buffer, no copy. The copied part is
    :func:`~meshplan.spec.deepspeed_memory.deepspeed_copied_bytes` after a layer's fetch (a layer precedes
    every layer, the head in forward and the embedding in backward: ``held`` the largest
    ``"layer"`` unit), one bucket at most, as the memory model copies it; none for the embedding's unit in forward,
    the step's first fetch, which nothing before it prefetched (the memory model's too)."""
    held = max((u[4] for u in units if u[0] == "layer"), default=0)
    copied = deepspeed_copied_bytes(gathered, c.deepspeed_prefetch, held, layer_param_bytes(c.model, c.training, c.mesh)) \
        if c.deepspeed_prefetch else gathered
    return (0 if label.startswith("root (embedding") else copied), copied



def _pipelined_gathers(c: StageContext, root: bool, chunks: list[int]) -> tuple[int, int]:
    """(forward, backward) all-gathers per step of FSDP units of a pipeline stage, one unit in
    each local chunk of ``chunks``, as torch ``PipelineStage`` runs FSDP2
    (:func:`fsdp_gather_flags`). Counted per chunk: under interleaved 1F1B with
    ``reshard_after_forward`` the chunks' orders differ (pp 2, vpp 2, m 4, stage 0: chunk 0
    gathers 4 F + 1 B, chunk 1 3 F + 2 B). With ``training.pp_schedule_runs`` r, each of the r
    runs of ``micro / r`` micro-batches starts from sharded parameters (the previous run's
    ``perform_reduce_grad`` resharded them): r times one run's gathers."""
    flags = fsdp_gather_flags(c.schedule, c.mesh.degree("pp"), c.micro // c.runs, c.vpp, c.stage,
                              c.training.reshard_after_forward and not root,
                              window=pipeline_window(c.training.framework, c.mesh.degree("pp")))
    per = Counter((ch, k) for (ch, k, _), g in flags.items() if g)
    return c.runs * sum(per[(ch, "F")] for ch in chunks), c.runs * sum(per[(ch, "B")] for ch in chunks)


def _per_microbatch(count: int, n: int, micro: int, pipelined: bool) -> tuple[int, Optional[int]]:
    """``add``'s (per_mb, per_step) of a row of ``count`` calls per step of ``n`` units: (n,
    None) when it is ``n`` calls in every one of ``micro`` micro-batches (no_sync gathers as
    sync does), else (0, count): a row not issued alike in every micro-batch (no_sync_unsharded's
    forward, pipelined stages' gathers), which the table shows per step only."""
    return (n, None) if not pipelined and count == n * micro else (0, count)


def _accumulation_gathers(c: StageContext, root: bool, n: int) -> Optional[tuple[int, int]]:
    """(forward, backward) all-gathers per step of ``n`` FSDP units of one kind with pp 1
    under ``training.grad_accumulation`` (None for ``sync``: ``n`` per micro-batch, the
    table's per-micro-batch rows). ``no_sync`` gathers as ``sync`` does (parameters are
    resharded after every backward); ``no_sync_unsharded`` keeps them gathered from a
    backward to the next forward, so only micro-batch 0's forward gathers, and backward
    gathers every micro-batch only when ``reshard_after_forward`` (never the root, which
    FSDP2 does not reshard after forward). The walk is :func:`fsdp_gather_flags` on pp 1.

    With m = 4 micro-batches, reshard_after_forward true, 3 layer units: ``no_sync``
    gathers (12, 12), ``no_sync_unsharded`` (3, 12), its root (1, 0).
    """
    mode = c.training.grad_accumulation
    if mode == "sync":
        return None
    flags = fsdp_gather_flags(c.schedule, 1, c.micro, 1, 0, c.training.reshard_after_forward and not root,
                              reshard_after_backward=mode == "no_sync")
    per = Counter(k for (_, k, _), g in flags.items() if g)
    return n * per["F"], n * per["B"]


def fsdp_gather_flags(schedule: Schedule, pp: int, micro: int, vpp: int, stage: int,
                      reshard: bool, reshard_after_backward: bool = False,
                      window: int = 0) -> dict[tuple[int, str, int], bool]:
    """Whether each F or B pass ``(chunk, kind, micro-batch)`` of stage ``stage`` all-gathers
    its chunk's FSDP units, as torch ``PipelineStage`` runs FSDP2 with pp > 1: gradient sync
    and reshard-after-backward are off for every backward but the last, so a unit stays
    gathered after a backward, is resharded after a forward when ``reshard`` (FSDP2's
    ``reshard_after_forward``; never the root), and is gathered whenever a pass finds it
    sharded. Walks :func:`meshplan.pipeline.simulate.stage_order`. ``reshard_after_backward``
    (pp 1, ``training.grad_accumulation = "no_sync"``): every backward but the last reshards.
    ``window`` (:func:`~meshplan.pipeline.unshard_window.pipeline_window`; 0: none): torch's
    multi-stage schedules keep that many local stages unsharded and reshard the others, so at
    vpp > ``window`` a pass also gathers when its chunk was evicted since its previous op
    (:func:`meshplan.pipeline.unshard_window.evicted`, torch 2.13 ``_add_unshard_reshard``).

    >>> f = fsdp_gather_flags("1f1b", 2, 3, 1, 0, reshard=False)
    >>> [k for k, g in f.items() if g]
    [(0, 'F', 0)]
    >>> f = fsdp_gather_flags("1f1b", 2, 3, 1, 0, reshard=True)  # F0 F1 B0 F2 B1 B2
    >>> [k for k, g in f.items() if g]  # F2 follows B0 (gathered); B1 follows F2 (resharded)
    [(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'B', 1)]
    """
    window = window if vpp > window > 0 else 0  # nothing evicted with vpp <= window
    if micro * vpp <= _CACHED_PASSES:  # the search asks for the same few orders thousands of times
        return dict(_cached_gather_flags(schedule, pp, micro, vpp, stage, reshard, reshard_after_backward, window))
    return _gather_flags(schedule, pp, micro, vpp, stage, reshard, reshard_after_backward, window)


#: Largest ``micro x vpp`` whose gather flags :func:`fsdp_gather_flags` keeps (a copy is returned).
_CACHED_PASSES = 1024


def _gather_flags(schedule, pp, micro, vpp, stage, reshard, reshard_after_backward, window=0) -> dict:
    sharded = [True] * vpp
    out = {}
    order = stage_order(schedule, pp, micro, vpp, stage)
    again = evicted([u.chunk for u in order], window) if window else [False] * len(order)
    for u, ev in zip(order, again):
        if ev:  # the schedule's window resharded the chunk (RESHARD) since its previous op
            sharded[u.chunk] = True
        if u.kind not in ("F", "B"):
            continue
        out[(u.chunk, u.kind, u.mb)] = sharded[u.chunk]
        sharded[u.chunk] = reshard if u.kind == "F" else reshard_after_backward
    return out


_cached_gather_flags = lru_cache(maxsize=512)(_gather_flags)
