"""DeepSpeed ZeRO++'s rows of the collective table (:mod:`meshplan.comm.zeropp`: its mechanisms,
groups, bytes and kernels), in place of one FSDP unit's rows of DeepSpeed's ZeRO-3
(:func:`meshplan.comm.fsdp_rows._unit_rows`, ``zero3_engine = "deepspeed"``) when a ZeRO++
switch is on:

- all-gathers: hpZ's forward passes over the whole group in micro-batch 0 (the row of
  :data:`HPZ_FIRST`, with the unit's secondary copy on the compute stream as its ``copy_s``,
  :func:`~meshplan.comm.zeropp.hpz_copy_seconds`) and over the secondary group of g consecutive
  ranks in the others, its backward passes over the secondary group; under qwZ each gather moves int8 and fp32 scales (two NCCL calls, one row: the scales'
  call timed into it, its bytes ~0.05% of the data's) with the quantize and dequantize kernels
  on the all-gather stream (``ds_gpu_s``), beside the engine's copy-out;
- the gradient reduction under qgZ across nodes: per 2-D gradient one row per hop (in the node,
  across nodes; the int4 data's and its scales' all-to-alls timed in one row, the kernels of the
  gradient in the in-node row), the other gradients reduce-scattered one by one over the group.

Every row's cadence carries :data:`~meshplan.comm.zeropp.MARK`: the rank timeline times
micro-batch 0's forward with the :data:`HPZ_FIRST` rows and every other pass with the others (their
mean where a phase has several), and sums a unit's reduction rows
(:meth:`meshplan.schedule.comm_times.CommTimes.from_rows`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from meshplan.comm import deepspeed_ipg, zeropp
from meshplan.comm.row import path_time
from meshplan.comm.stage_context import StageContext
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.units import dtype_bytes


#: The cadence words of hpZ's micro-batch 0 forward gathers (over the whole group).
HPZ_FIRST = f"{zeropp.MARK} hpZ: first micro-batch"


def applies(c: StageContext) -> bool:
    """Whether a ZeRO++ switch acts on the stage's FSDP rows: DeepSpeed's ZeRO-3 of today with hpZ
    (g > 1), qwZ, or qgZ across more than one node."""
    t = c.training
    if t.sharding != "zero3" or t.zero3_engine != "deepspeed":
        return False
    return t.zero_hpz_partition_size > 1 or t.zero_quantized_weights or _qgz_nodes(c) > 1


def _qgz_nodes(c: StageContext) -> int:
    """Nodes qgZ's hierarchy spans (world / the node's GPUs); 0 with qgZ off."""
    if not c.training.zero_quantized_gradients or c.cluster is None:
        return 0
    return c.mesh.world // _node_gpus(c)


def _node_gpus(c: StageContext) -> int:
    """GPUs of one node of the stage's cluster (DeepSpeed's ``device_count()``, qgZ's in-node group)."""
    return int(getattr(c.cluster, "node").gpus)


@dataclass(frozen=True)
class Unit:
    """One kind of FSDP unit as :func:`meshplan.comm.fsdp_rows._unit_rows` has it: ``label``,
    ``numel`` (gathered elements), ``gbytes`` and ``gdt`` (the unquantized gather), ``cadence``,
    ``n`` units of the kind, ``ds_out`` ((forward, backward) copy-out seconds), ``cast_s``,
    ``in_s`` (the gradient's copy into the reduce bucket, seconds)."""

    label: str
    numel: int
    gbytes: int
    gdt: str
    cadence: str
    n: int
    ds_out: tuple
    cast_s: float
    in_s: float


def unit_rows(add, c: StageContext, u: Unit, fwd: tuple, back: tuple, red: tuple, reuse, part_words: str) -> None:
    """The rows of ``u`` under ZeRO++ (module docstring); ``fwd``, ``back``, ``red``: the unit's
    (per micro-batch, per step) calls as :func:`meshplan.comm.fsdp_rows._call_counts` gives them;
    ``reuse``: :func:`meshplan.comm.fsdp_rows._deepspeed_reuse` (None: every backward pass gathers
    the whole unit); ``part_words``: the cadence words of a backward gather of less than the unit
    (:data:`meshplan.comm.fsdp_rows.REUSE_PART`, which the rank timeline reads as a share)."""
    t = c.training
    g = t.zero_hpz_partition_size
    if g > 1:
        full, sec = zeropp.hpz_gathers(fwd[0], c.micro)
        tensors = len(unit_tensors(c, u.label, u.numel)) or 1
        fill = zeropp.hpz_copy_seconds(u.numel, tensors, g, t.param_dtype, kernel_data(c.gpu),
                                       c.gpu.hbm_bandwidth_bytes_per_s)
        _gather(add, c, u, "forward", 0, full, False, u.ds_out[0], HPZ_FIRST, fill_s=fill)
        _gather(add, c, u, "forward", 0, sec, True, u.ds_out[0], f"{zeropp.MARK} hpZ: later micro-batches")
    else:
        _gather(add, c, u, "forward", fwd[0], fwd[1], False, u.ds_out[0], zeropp.MARK)
    shares = reuse.backward if reuse is not None and u.label == "layer" else None
    if shares is None:
        _gather(add, c, u, "backward", back[0], back[1], g > 1, u.ds_out[1], f"{zeropp.MARK}{' hpZ' if g > 1 else ''}")
    else:  # stage3_max_reuse_distance: each layer's calls as shares of the unit (fsdp_rows._reuse_gathers)
        from_fsdp = Counter(round(x, 9) for s in shares for x in s)
        for x, k in sorted(from_fsdp.items(), reverse=True):
            part = "" if x >= 1 - 1e-9 else f", {part_words} ({x:.2%})"
            _gather(add, c, u, "backward", k, None, g > 1, u.ds_out[1], f"{zeropp.MARK}{' hpZ' if g > 1 else ''}",
                    share=min(x, 1.0), part=part)
    if _qgz_nodes(c) > 1:
        _qgz_rows(add, c, u, red)
    elif u.label == "layer":  # one reduce-scatter per ipg bucket of reduce_bucket_size (deepspeed_ipg)
        deepspeed_ipg.bucket_rows(add, c, [x.numel for x in unit_tensors(c, u.label, u.numel)], u.n, u.cadence,
                                  red, u.in_s)
    else:
        rs = t.gradient_reduce_dtype
        add("fsdp", "backward", "reduce-scatter", u.numel * dtype_bytes(rs), rs, red[0], u.cadence,
            "optimizer step", per_step=red[1], ds_gpu_s=u.in_s)


def _gather(add, c: StageContext, u: Unit, phase: str, per_mb, per_step, secondary: bool, copy_s: float,
            what: str, share: float = 1.0, part: str = "", fill_s: float = 0.0) -> None:
    """One all-gather row of ``share`` of unit ``u`` in ``phase`` over the whole group or hpZ's
    ``secondary`` group; under qwZ int8 with its scales' call timed in and its kernels on the stream;
    ``fill_s``: compute-stream seconds after each call (hpZ's secondary copy, the row's ``copy_s``)."""
    t, mesh = c.training, c.mesh
    g = t.zero_hpz_partition_size if secondary else mesh.degree("fsdp")
    groups = zeropp.secondary_groups(mesh.world, g) if secondary else None
    where = f"secondary group of {g} ranks" if secondary else f"all {g} ranks"
    numel = round(u.numel * share)
    data, hbm = kernel_data(c.gpu), c.gpu.hbm_bandwidth_bytes_per_s
    extra = copy_s * share + u.cast_s
    if not t.zero_quantized_weights:
        add("fsdp", phase, "all-gather", round(u.gbytes * share), u.gdt, per_mb, f"{u.cadence}{part} ({what}, {where})",
            f"the {u.label}'s GEMMs", 7, per_step=per_step, ds_gpu_s=extra, copy_s=fill_s,
            ranks=None if groups is None else groups[0].tolist(), groups=groups)
        return
    pd = t.param_dtype
    scales = zeropp.qwz_scale_bytes(numel // g) * g
    extra += zeropp.kernel_seconds(zeropp.qwz_quantize_bytes(numel // g, pd), 3, data, hbm) \
        + zeropp.kernel_seconds(zeropp.qwz_dequantize_bytes(numel, pd), 2 if pd != "fp16" else 1, data, hbm)
    cadence = f"{u.cadence}{part} ({what}, qwZ int8 + {scales:,} B fp32 scales, {where})"

    def timer(path, cluster):
        alg, s = path_time("all-gather", g, numel, path, cluster)
        return alg, s + path_time("all-gather", g, scales, path, cluster)[1], None, float(numel), cadence

    add("fsdp", phase, "all-gather", numel, "int8", per_mb, cadence, f"the {u.label}'s GEMMs", 7,
        per_step=per_step, ds_gpu_s=extra, copy_s=fill_s, ranks=None if groups is None else groups[0].tolist(),
        groups=groups, timer=timer)


def unit_tensors(c: StageContext, label: str, numel: int) -> list:
    """The tensors of one unit ``label`` of ``numel`` gathered elements with ZeRO++'s mesh (every
    axis but the data axis 1: whole tensors): a layer's (of the stage's layer kind, dense or MoE,
    whose elements come nearest ``numel``), or the root's embedding and/or head tensors."""
    m = c.model
    if label == "layer":
        kinds = {m.is_moe_layer(i): i for i in reversed(c.layers)}
        return m.layer_tensors(min(kinds.values(), key=lambda i: abs(sum(x.numel for x in m.layer_tensors(i)) - numel)))
    v = padded_vocab(m.vocab, c.training.vocab_pad_divisor, 1)
    emb = m.embedding_tensors(v) if c.first else []
    head = [x for x in (m.head_tensors(v) if c.last else []) if not (x.tied and c.first)]
    return emb if label == "root (embedding)" else head if label == "root (norm/output)" else emb + head


def _qgz_rows(add, c: StageContext, u: Unit, red: tuple) -> None:
    """qgZ's rows of unit ``u``'s gradients (module docstring): per distinct quantized gradient the
    in-node and across-node all-to-all rows, per distinct other gradient a reduce-scatter over the
    group; ``red``: the unit's (per micro-batch, per step) reductions."""
    mesh, t = c.mesh, c.training
    world, d = mesh.world, _node_gpus(c)
    nodes, rs = world // d, t.gradient_reduce_dtype
    data, hbm = kernel_data(c.gpu), c.gpu.hbm_bandwidth_bytes_per_s
    local, across = zeropp.node_groups(world, d)
    tensors = unit_tensors(c, u.label, u.numel)
    total = sum(x.numel for x in tensors) or 1
    quant: Counter = Counter()
    plain: Counter = Counter()
    for x in tensors:
        key = (x.numel, x.rows)
        (quant if zeropp.qgz_quantized(x.numel, x.rows, world) else plain)[key] += 1
    for (numel, rows), k in sorted(quant.items()):
        groups = zeropp.qgz_scale_groups(numel, rows, world)
        sizes = zeropp.qgz_sizes(numel, groups, d)
        kern = zeropp.kernel_seconds(zeropp.qgz_kernel_bytes(numel, groups, d, nodes, dtype_bytes(rs)), nodes + 4,
                                     data, hbm)
        for hop, grp, n, extra in (("intra", local, d, kern + u.in_s * numel / total), ("inter", across, nodes, 0.0)):
            _a2a(add, u, red, k, hop, sizes, grp, n, extra, numel)
    for (numel, _), k in sorted(plain.items()):
        size = -(-numel // world) * world * dtype_bytes(rs)
        add("fsdp", "backward", "reduce-scatter", size, rs, red[0] * k,
            f"{u.cadence} ({zeropp.MARK} qgZ: a gradient of {numel:,} elements reduce-scattered alone)",
            "optimizer step", per_step=None if red[1] is None else red[1] * k, ds_gpu_s=u.in_s * numel / total)


def _a2a(add, u: Unit, red: tuple, k: int, hop: str, sizes: dict, groups, n: int, extra: float, numel: int) -> None:
    """One qgZ all-to-all row: ``k`` gradients of ``numel`` elements a unit, ``hop`` "intra" (in the
    node) or "inter" (across nodes), the int4 data's call and its scales' timed in one row."""
    data, scales = sizes[hop], sizes[hop + "_scales"]
    where = "inside the node" if hop == "intra" else "across nodes"
    cadence = (f"{u.cadence} ({zeropp.MARK} qgZ: int4 gradient of {numel:,} elements + {scales:,.0f} B fp32 scales, "
               f"{where}, {n} ranks)")

    def timer(path, cluster):
        alg, s = path_time("all-to-all", n, data, path, cluster)
        return alg, s + path_time("all-to-all", n, scales, path, cluster)[1], None, data, cadence

    add("fsdp", "backward", "all-to-all", data, "int4", red[0] * k, cadence, "optimizer step",
        per_step=None if red[1] is None else red[1] * k, ds_gpu_s=extra, ranks=groups[0].tolist(), groups=groups,
        timer=timer)
