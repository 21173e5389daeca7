"""The collective table: per pipeline stage, per group kind and phase, the collective each
rank issues, its payload, count per micro-batch, per layer and per step, dtype, what waits on
it, the NCCL algorithm (ring, tree, NVLS, hierarchical) and its alpha-beta time on the link
class the group crosses (:func:`collective_table`, rows of :class:`meshplan.comm.row.CollectiveRow`).

Each technique builds its own rows (:data:`~meshplan.spec.axes.base.RowBuilder`) from the
stage's context (:class:`meshplan.comm.stage_context.StageContext`), matched op by op against
what torch 2.13 issues for DTensor TP/SP and FSDP2 (``meshplan.runtime.validation.dryrun``;
torchtitan's Llama plan), each module's docstring giving its conventions and sources:

- tp: tensor and sequence parallelism, float8 TP, the loss (:mod:`meshplan.comm.tp_rows`) and
  the gradients of weights replicated over tp (:mod:`meshplan.comm.tp_grads`);
- cp: all-gather CP (:func:`meshplan.spec.axes.cp.cp_rows`, on the axis's descriptor);
- the data axes (fsdp, efsdp, dp_replicate, DDP over ``loss``): the engine's choice, ZeRO-1/2,
  DDP and Megatron-LM's buffers (:mod:`meshplan.comm.dp_rows`), FSDP2 and HSDP
  (:mod:`meshplan.comm.fsdp_rows`), DeepSpeed's ZeRO-3 of 2021 (:mod:`meshplan.comm.deepspeed_rows`)
  and its ZeRO-1/2 (:mod:`meshplan.comm.deepspeed_zero12`);
- pp: sends and receives (each stage's on its boundary pairs' path), scatter/gather, tied embeddings
  (:mod:`meshplan.comm.pp_rows`);
- ep: the MoE all-to-alls and the dropless count exchange (:mod:`meshplan.comm.ep_rows`).

``size_bytes`` is the full buffer S as nccl-tests prints it (all-gather output,
reduce-scatter input, all-reduce buffer); each row is timed on its group's path
(:func:`meshplan.comm.row.path_time`).
"""

from __future__ import annotations

from typing import Callable, Optional

from meshplan.comm import deepspeed
from meshplan.comm.dp_rows import dp_rows
from meshplan.comm.ep_rows import ep_rows
from meshplan.comm.pp_rows import pp_rows
from meshplan.comm.row import CollectiveRow, axis_path, groups_path, path_time
from meshplan.comm.stage_context import StageContext
from meshplan.comm.tp_rows import tp_rows
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.mesh.resolve import Mesh
from meshplan.spec.axes.registry import AXES, Axis
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.mesh import Schedule
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec

#: Row builders of the axis families whose rows need the FSDP units and gather flags, the
#: pipeline registry or the routing model (later layers than :mod:`meshplan.spec.axes`, so not
#: on their descriptors): tp (+SP, the loss, replicated weights' gradients), the data axes
#: (fsdp, efsdp, dp_replicate, DDP over ``loss``), pp and ep. Every other axis's rows come from
#: its descriptor (:attr:`~meshplan.spec.axes.base.AxisDef.rows`: cp's).
LAYER_ROWS = {Axis.TP: tp_rows, Axis.DP_SHARD: dp_rows, Axis.PP: pp_rows, Axis.EP: ep_rows}
#: The table lists these axes' rows first, in this order, then every other registered axis's
#: in the registry's order.
TABLE_ORDER = (Axis.TP, Axis.CP, Axis.DP_SHARD, Axis.PP, Axis.EP)


def collective_table(model: ModelSpec, training: TrainingSpec, mesh: Mesh, cluster: ClusterSpec,
                     placement, stage_layers: list[int], micro_batches: int,
                     first_stage: bool = True, last_stage: bool = True,
                     loss_parallel: bool = True, stage: int = 0, vpp: int = 1,
                     schedule: Schedule = Schedule.ONE_F_ONE_B,
                     chunks: Optional[list[list[int]]] = None,
                     grad_bucket_elements: Optional[int] = None,
                     deepspeed_prefetch: Optional[tuple[int, int]] = None,
                     deepspeed_reuse: Optional[int] = None,
                     paths: Optional[dict] = None, kv_expanded: bool = False) -> list[CollectiveRow]:
    """Rows for pipeline stage ``stage`` holding ``stage_layers`` (layer indices) in ``vpp``
    chunks (``chunks``: the layers of each; default ``vpp`` equal runs of ``stage_layers``),
    run under ``schedule`` with ``micro_batches`` micro-batches; ``grad_bucket_elements``: DDP's
    bucket cap (``[memory] grad_bucket_elements``; None: torch's default, :func:`meshplan.comm.dp_rows._ddp_rows`);
    ``deepspeed_prefetch``: DeepSpeed ZeRO-3's (prefetch, max live) bytes
    (:meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_prefetch_bytes`; None: DeepSpeed's defaults);
    ``deepspeed_reuse``: its ``stage3_max_reuse_distance``, elements (``[memory]
    deepspeed_max_reuse_elements``; None: DeepSpeed's 1e9);
    ``paths``: the axes' paths (:func:`~meshplan.comm.row.axis_path`) found so far for this
    ``mesh``, ``placement`` and ``cluster``, filled in place (the tables of one plan's stages
    share them; default: a new dict); ``kv_expanded``: ``[memory] kv_expanded``, the K/V heads
    torch's ring attention moves (:func:`meshplan.spec.axes.tp.sdpa_kv_heads`)."""
    rows: list[CollectiveRow] = []
    add = _row_adder(rows, mesh, placement, cluster, micro_batches, max(len(stage_layers), 1),
                     {} if paths is None else paths)
    if chunks is None:
        per = max(len(stage_layers) // vpp, 1)
        chunks = [stage_layers[k * per:(k + 1) * per] for k in range(vpp)]
    chunk_of = {i: k for k, ls in enumerate(chunks) for i in ls}
    ctx = StageContext(model=model, training=training, mesh=mesh, layers=stage_layers, first=first_stage,
                       last=last_stage, gpu=cluster.gpu, stage=stage, vpp=vpp, schedule=schedule,
                       micro=micro_batches, chunk_of=chunk_of, loss_parallel=loss_parallel,
                       bucket_elements=grad_bucket_elements,
                       deepspeed_prefetch=deepspeed_prefetch or MemoryOptions().deepspeed_prefetch_bytes(training),
                       deepspeed_reuse=deepspeed_reuse, domain=placement.domain, placement=placement,
                       cluster=cluster, kv_expanded=kv_expanded)
    for axis in TABLE_ORDER + tuple(a for a in AXES if a not in TABLE_ORDER):
        build = AXES[axis].rows or LAYER_ROWS.get(axis)
        if build is not None:
            build(add, ctx)
    return rows


def _row_adder(rows: list[CollectiveRow], mesh: Mesh, placement, cluster: ClusterSpec, micro_batches: int,
               layers: int, paths: dict) -> Callable[..., None]:
    """``add``, the row builders' one way to append a row to ``rows`` (its arguments:
    :data:`~meshplan.spec.axes.base.RowBuilder`): timed on the axis's path (:func:`~meshplan.comm.row.axis_path`,
    one per axis, or for a set of ``groups`` that is no mesh axis, :func:`~meshplan.comm.row.groups_path`)
    with NCCL of 2021 for DeepSpeed ZeRO-3 of 2021's list-based calls (``list_copies``, their
    ``n`` copies and host time, :mod:`meshplan.comm.deepspeed`) or its other calls
    (``ds_host_s``); ``per_layer`` is the per-micro-batch count over the stage's ``layers``;
    ``paths``: the paths found so far by axis (or axis and rank 0's group), filled in place."""

    def add(axis, phase, op, size, dtype, per_mb, cadence, waits="", depth=1, per_step=None, ranks=None,
            list_copies=False, groups=None, copy_s=0.0, ds_gpu_s=0.0, ds_host_s=None, timer=None):
        # ranks: rank 0's group, a subset of axis's; groups: every group of a named set that is
        # no mesh axis (KV replicas), rank 0's in ranks; ds_gpu_s / ds_host_s: DeepSpeed ZeRO-3's
        # GPU seconds added to the call and host seconds (instead of the list's) per call; timer: a
        # row timed by its own model, (path, cluster) -> (algorithm, seconds, (NVLink, network) bytes per
        # call, size, cadence) (deepep)
        n = mesh.degree(axis) if ranks is None else len(ranks)
        if n <= 1 or size <= 0 or (per_mb == 0 and not per_step):
            return
        key = axis if groups is None else (axis, tuple(ranks), tuple(groups[0].tolist()))  # (a pp boundary's pairs)
        if key not in paths:  # once per axis (or set of groups) and table: a path reads every group's ranks
            paths[key] = (axis_path(mesh, placement, cluster, axis) if groups is None
                          else groups_path(groups, placement, cluster))
        path = paths[key]
        ds = list_copies or ds_host_s is not None
        split = None
        if timer is not None:
            alg, t, split, size, cadence = timer(path, cluster)
        else:
            alg, t = path_time(op, n, size, path, cluster, nccl_era="2021" if ds else "current")
        host = 0.0
        if list_copies:  # torch 2021's list-based all_gather / reduce_scatter: n views and n copies
            data = kernel_data(cluster.gpu)
            t += deepspeed.list_copy_seconds(n, size, data)
            host = deepspeed.host_seconds(n, data)
        t += ds_gpu_s
        host = host if ds_host_s is None else ds_host_s
        rows.append(CollectiveRow(mesh.display_name(axis), phase, op, n, mesh.world // n,
                                  tuple(mesh.group_of(0, axis) if ranks is None else ranks), float(size), dtype, per_mb,
                                  per_step if per_step is not None else per_mb * micro_batches,
                                  cadence, path, t, waits, depth, alg, per_mb / layers, host,
                                  copy_s, split))

    return add
