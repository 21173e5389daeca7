"""Build torch's DeviceMesh from a meshplan :class:`~meshplan.mesh.resolve.Mesh`, check its groups,
and split a :class:`~meshplan.runtime.execution.model.Transformer` over it with torch's own APIs.

- :func:`init_mesh`: ``init_device_mesh(device, layout.shape, mesh_dim_names=layout.names)``
  plus one flattened dimension per derived axis (``dp``, ``fsdp``, ``loss``, ``batch``) that
  spans more than one mesh axis.
- :func:`check_groups`: this rank's group on every axis, DeviceMesh against meshplan.
- :func:`parallelize`: DTensor tensor (and sequence) parallelism with
  ``parallelize_module``, following torchtitan's Llama plan (models/llama3/infra/
  parallelize.py ``apply_tp``; the plan per module: :mod:`meshplan.runtime.execution.tensor_parallel`),
  then FSDP2 ``fully_shard`` on every layer and on the root over the ``fsdp`` axis, or HSDP over
  (dp_replicate, fsdp).
- :func:`apply_ddp` (``sharding = "none"``, tp = cp = 1, dense): ``DistributedDataParallel``
  over the ``dp`` axis, on the materialized model.
- Context parallelism (``cp > 1``, :mod:`meshplan.runtime.execution.cp`): K and V all-gathered over
  cp in every attention layer (Llama 3's all-gather CP); FSDP2 shards over ``fsdp`` =
  dp_shard x cp.
- MoE models (:mod:`meshplan.runtime.execution.moe`): experts split over ``ep`` of the expert mesh
  (all-to-all dispatch and combine); under ep > 1 the routed experts of each layer are a
  second parameter group of the layer's FSDP2 unit, over ``efsdp`` (or HSDP over (dp_replicate,
  efsdp)), ignored by FSDP when that is one rank (torchtitan's per-parameter mesh: one state,
  both groups reduced after the layer's backward); under ep 1 they stay in the layer's unit over
  its mesh (torchtitan); router and shared experts stay in the layer's unit. With fsdp 1 and
  efsdp > 1 the routed experts alone are a unit. With ``tp > 1`` and etp 1 the tp
  ranks split the tokens for the routed experts (:func:`meshplan.runtime.execution.moe_parallel.apply_moe_tp`:
  router replicated, shared experts colwise/rowwise); at ep 1 with etp = tp (torchtitan's) each
  expert is sharded over tp instead (:func:`~meshplan.runtime.execution.moe_parallel.apply_experts_over_tp`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshplan.mesh.tpsplit import experts_apart
from meshplan.compute.routing import RoutingOptions
from meshplan.errors import ConfigError
from meshplan.mesh.resolve import DERIVED, Mesh
from meshplan.runtime.execution.buildable import unsupported_mesh
from meshplan.runtime.execution.moe_parallel import per_param_mesh
from meshplan.runtime.execution.tensor_parallel import apply_tp
from meshplan.spec.axes.moe_tp import experts_over_tp
from meshplan.spec.axes.registry import Axis
from meshplan.spec.training import TrainingSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def derived_axes(mesh: Mesh) -> list[str]:
    """Derived axes that span more than one mesh axis (these get a flattened dimension)."""
    return [d for d in DERIVED if d not in mesh.layout.names and len(mesh.axes_of(d)) > 1]


def init_mesh(mesh: Mesh, device: str = "cpu") -> DeviceMesh:
    """DeviceMesh of ``mesh`` on the current process group, with flattened derived axes.

    On 8 ranks of ``names=(dp_shard, cp, tp), shape=(2, 2, 2)``, rank 5 gets
    ``dm["tp"]`` = [4, 5], ``dm["cp"]`` = [5, 7], ``dm["fsdp"]`` (dp_shard x cp) = [1, 3, 5, 7].
    """
    lay = mesh.layout
    dm = init_device_mesh(device, lay.shape, mesh_dim_names=lay.names)
    for name in derived_axes(mesh):
        dm[mesh.axes_of(name)]._flatten(name)
    return dm


def check_groups(device_mesh: DeviceMesh, mesh: Mesh) -> list[str]:
    """Differences between DeviceMesh's groups and meshplan's rank lists for this rank; an
    empty list when every mesh axis and every flattened derived axis agrees."""
    rank = dist.get_rank()
    out = []
    for axis in list(mesh.layout.names) + derived_axes(mesh):
        want = mesh.group_of(rank, axis)
        try:
            with warnings.catch_warnings():  # slicing a flattened dim from the root warns in 2.13; it works
                warnings.simplefilter("ignore", UserWarning)
                got = dist.get_process_group_ranks(device_mesh[axis].get_group())
        except (KeyError, RuntimeError, ValueError) as e:
            out.append(f"{axis}: DeviceMesh has no such dimension ({e})")
            continue
        if got != want:
            out.append(f"{axis}: DeviceMesh group of rank {rank} is {got}, meshplan says {want}")
    if device_mesh.mesh.flatten().tolist() != list(range(mesh.world)):
        out.append(f"DeviceMesh ranks {device_mesh.mesh.flatten().tolist()[:8]}... are not 0..{mesh.world - 1}")
    return out


def fsdp_mesh(device_mesh: DeviceMesh, mesh: Mesh, training: TrainingSpec) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``fsdp`` (1-D), or (dp_replicate, fsdp) for HSDP."""
    shard = mesh.axes_of("fsdp")
    shard_name = shard[0] if len(shard) == 1 else "fsdp"
    if training.sharding == "hsdp" or mesh.degree("dp_replicate") > 1:
        if "dp_replicate" not in mesh.layout.names:
            raise ConfigError("mesh", "sharding 'hsdp' needs a dp_replicate axis")
        return device_mesh["dp_replicate", shard_name]
    return device_mesh[shard_name]


def apply_ddp(model: nn.Module, device_mesh: DeviceMesh, mesh: Mesh) -> nn.Module:
    """``DistributedDataParallel`` over the data-parallel axis (``dp``: the mesh's dp,
    dp_shard or dp_replicate axis, or their flattened dimension), torch's defaults (no comm
    hook, ``find_unused_parameters=False``, 25 MiB buckets from the second step). Call it on
    the materialized model (DDP broadcasts rank 0's parameters when built); returns the
    wrapper, or ``model`` itself when dp is 1.

    What DDP sends (torch 2.13; source ``torch/nn/parallel/distributed.py``): with
    ``find_unused_parameters=False`` the first step's bucketing is one bucket of every
    parameter (per dtype; ``_BucketCapacityConfig.compute_bucket_size_limits`` gives
    ``[sys.maxsize]``), all-reduced once in the backward that syncs (the worker's Runner runs
    every micro-batch but the last under ``no_sync``); the step after rebuilds buckets in
    gradient-ready order, the first 1 MiB, then 25 MiB (two broadcasts of the bucket layout
    in that forward). The validate worker records the first step, which the plan's table
    models (:mod:`meshplan.comm.collectives`). Measured on 4 gloo ranks, 1,967,360 fp32
    parameters: step 0 one all-reduce of 7,869,440 B over [0, 1, 2, 3]; later steps two.

    Recording: the reducer issues its all-reduces from C++, but through the dispatcher
    (``c10d::allreduce_``) on the backward's thread, so
    :class:`~meshplan.runtime.execution.recorder.CollectiveRecorder` sees each bucket as sent, group,
    bytes and dtype included (measured, torch 2.13, gloo); no comm hook replaces DDP's own.
    """
    axes = mesh.axes_of("dp")
    if mesh.degree("dp") == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_mesh=device_mesh[axes[0] if len(axes) == 1 else "dp"])


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True,
               mp_policy: Optional[MixedPrecisionPolicy] = None, expert_mesh: Optional[DeviceMesh] = None,
               expert_placement: Optional[Callable] = None, reshard_head: bool = False,
               experts_apart: bool = True) -> None:
    """FSDP2 ``fully_shard`` as torchtitan wraps a decoder (``torchtitan/distributed/fsdp.py``
    ``apply_fsdp_to_decoder`` at b5bcd76, 2026-08-21; units since #1094, 83e6941), on the whole
    model or on a pipeline stage's module alike (torchtitan applies it to each stage's model part,
    whose missing ends are None): the embedding when the module holds it
    (``reshard_after_forward`` as the layers), ``[final_norm, output]`` when it holds them (never
    resharded after forward: FSDP2 would prefetch it at once for backward; torchtitan reshards it
    only under its policy "always": ``reshard_head``, ``training.reshard_head_after_forward``,
    which reshards the tied unit too), every layer, then the root (no
    parameters left; learned positions, which torchtitan's models lack, are in the embedding's
    unit). Tied embeddings (``spec.tied_embeddings``): on one
    module, embedding, final norm and output are one unit, never resharded after forward; split
    over pipeline stages (the last stage's output a copy, :mod:`meshplan.runtime.execution.pipelined_stage`)
    the first stage's embedding is its own unit, never resharded after forward either
    (torchtitan's tied branch wraps the ends the part holds as one unit). ``expert_mesh``: the
    mesh the routed experts of an MoE layer are sharded over, a second parameter group of their
    block's unit (torchtitan's per-parameter mesh under ep > 1,
    :func:`~meshplan.runtime.execution.moe_parallel.per_param_mesh`; FSDP ignores them when it is
    one rank); ``expert_placement``: their placement
    (:func:`meshplan.runtime.execution.moe_parallel.expert_placement_fn`: ``Shard(1)`` past efsdp x ep >
    experts, as torchtitan). ``experts_apart`` false (ep 1, :func:`meshplan.mesh.tpsplit.experts_apart`):
    the experts stay in their block's unit, over its mesh, ``expert_placement`` for their
    parameters only (torchtitan's ep-1 branch: one all-gather of the whole layer)."""
    kw = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for block in model.layers.values():
        experts = block.moe.experts if hasattr(block, "moe") else None
        if experts is not None and not experts_apart:
            fully_shard(block, **kw, shard_placement_fn=_placement_of(set(experts.parameters()), expert_placement))
            continue
        if experts is not None and expert_mesh is not None and expert_mesh.size() > 1:
            placement = per_param_mesh(set(experts.parameters()), expert_placement, dp_mesh, expert_mesh)
            fully_shard(block, **kw, shard_placement_fn=placement)
            continue
        if experts is not None:
            kw_block = {**kw, "ignored_params": set(experts.parameters())}
            fully_shard(block, **kw_block)
            continue
        fully_shard(block, **kw)
    kept = {**kw, "reshard_after_forward": reshard_after_forward and reshard_head}
    # learned positions (not in torchtitan) join the embedding's unit, as the plan counts them
    # (ModelSpec.embedding_tensors); left in the root they were a unit of their own
    emb = [getattr(model, k) for k in ("embedding", "position_embedding") if hasattr(model, k)]
    head = [getattr(model, k) for k in ("final_norm", "output") if hasattr(model, k)]
    tied = getattr(getattr(model, "spec", None), "tied_embeddings", False)
    if tied and emb and head:
        fully_shard(emb + head, **kept)
    else:
        if emb:
            fully_shard(emb if len(emb) > 1 else emb[0], **(kept if tied else kw))
        if head:
            fully_shard(head, **kept)
    kw.pop("reshard_after_forward")
    fully_shard(model, **kw)  # the root: no parameters of its own left


def set_forward_prefetch(model: nn.Module) -> None:
    """torchtitan's explicit forward prefetch under ep > 1 (``torchtitan/distributed/fsdp.py``
    ``apply_fsdp_to_decoder`` at b5bcd76, lines 386-406: the embedding prefetches block 0, each
    block the next one, the last block the head), on a model :func:`apply_fsdp` wrapped; what the
    memory timeline models (:func:`meshplan.memory.units.explicit_forward_prefetch`). A block's
    experts are a second parameter group of its unit
    (:func:`~meshplan.runtime.execution.moe_parallel.per_param_mesh`), gathered with it. In full
    recompute's replay the block is in pre-backward and torch 2.13 returns before its prefetch
    (``_fsdp_state.py`` 295-303), so nothing is gathered again, as the plan counts
    (``tests/test_forward_prefetch_recompute.py``)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = [b for b in model.layers.values() if isinstance(b, FSDPModule)]
    emb, head = getattr(model, "embedding", None), getattr(model, "output", None)
    for block, ahead in zip(blocks, blocks[1:] + [head]):
        if isinstance(ahead, FSDPModule):
            block.set_modules_to_forward_prefetch([ahead])
    if blocks and isinstance(emb, FSDPModule) and emb is not head:
        emb.set_modules_to_forward_prefetch([blocks[0]])


def _placement_of(params: set, placement: Optional[Callable]) -> Optional[Callable]:
    """A block's ``shard_placement_fn``: ``placement`` for ``params`` (its experts), FSDP2's
    default ``Shard(0)`` (None) for the rest; None where ``placement`` is."""
    return None if placement is None else (lambda p: placement(p) if p in params else None)


@dataclass
class _Apply:
    """What each axis's apply reads, and what it leaves for the next (``expert_dp``: the
    mesh the routed experts are sharded over, ``expert_placement`` their FSDP2
    ``shard_placement_fn``, both set by the ep apply for the data axes')."""

    model: nn.Module
    device_mesh: DeviceMesh
    mesh: Mesh
    training: TrainingSpec
    loss_parallel: bool = True
    mixed_precision: bool = False
    expert_dp: Optional[DeviceMesh] = None
    expert_placement: Optional[Callable] = None


def _apply_cp(run: _Apply) -> None:
    """cp > 1: all-gather K/V context parallelism (Llama 3): :mod:`meshplan.runtime.execution.cp`."""
    mesh, cp = run.mesh, run.mesh.degree("cp")
    if cp > 1:
        from meshplan.runtime.execution.cp import apply_cp

        apply_cp(run.model, run.device_mesh["cp"].get_group(), cp,
                 mesh.group_of(dist.get_rank(), "cp").index(dist.get_rank()))


def _apply_tp(run: _Apply) -> None:
    """tp > 1: DTensor TP (+SP), :func:`~meshplan.runtime.execution.tensor_parallel.apply_tp`."""
    if run.mesh.degree("tp") > 1:
        apply_tp(run.model, run.device_mesh["tp"], run.mesh.sequence_parallel, run.loss_parallel,
                 experts_over_tp("torch", run.mesh.etp, run.mesh.degree("tp")))


def _apply_ep(run: _Apply) -> None:
    """MoE layers: the expert mesh, experts over ep (all-to-all dispatch and combine), and
    the mesh their FSDP2 unit shards over (efsdp, or HSDP over (dp_replicate, efsdp))."""
    model, mesh, training = run.model, run.mesh, run.training
    if not model.spec.is_moe:
        return
    from meshplan.runtime.execution.moe import set_routing
    from meshplan.runtime.execution.moe_parallel import apply_ep, expert_placement_fn, init_expert_mesh

    set_routing(model, RoutingOptions.of(training))

    model.expert_mesh = edm = init_expert_mesh(mesh, run.device_mesh.device_type)
    if mesh.ep > 1:
        ranks = mesh.group_of(dist.get_rank(), "ep")
        apply_ep(model, edm["ep"].get_group(), mesh.ep, ranks.index(dist.get_rank()))
    hsdp = training.sharding == "hsdp" or mesh.degree("dp_replicate") > 1
    run.expert_dp = edm["dp_replicate", "efsdp"] if hsdp and "dp_replicate" in edm.mesh_dim_names else edm["efsdp"]
    run.expert_placement = expert_placement_fn(model.spec, mesh)


def _apply_fsdp(run: _Apply) -> None:
    """The data axes: FSDP2 over ``fsdp`` (HSDP over (dp_replicate, fsdp)), :func:`apply_fsdp`;
    with fsdp 1 and efsdp > 1 the routed experts alone. ``sharding = "none"``: nothing here
    (the worker wraps the materialized model with :func:`apply_ddp`)."""
    model, mesh, training, expert_dp = run.model, run.mesh, run.training, run.expert_dp
    if training.sharding != "none" and mesh.degree("fsdp") * mesh.degree("dp_replicate") > 1:
        mp = None
        if run.mixed_precision:
            for key in ("compute_dtype", "fsdp_reduce_dtype"):
                if getattr(training, key) not in TORCH_DTYPES:
                    field = "grad_reduce_dtype" if training.grad_reduce_dtype else key.removeprefix("fsdp_")
                    raise ConfigError(f"training.{field}", f"{getattr(training, key)} has no FSDP2 mixed-precision "
                                      f"dtype here; use one of {sorted(TORCH_DTYPES)}")
            mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[training.compute_dtype],
                                      reduce_dtype=TORCH_DTYPES[training.fsdp_reduce_dtype])  # the table's
        apply_fsdp(model, fsdp_mesh(run.device_mesh, mesh, training), training.reshard_after_forward, mp, expert_dp,
                   run.expert_placement, reshard_head=training.reshard_head_after_forward,
                   experts_apart=experts_apart(mesh))
        if mesh.ep > 1:
            set_forward_prefetch(model)
    elif expert_dp is not None and expert_dp.size() > 1:  # fsdp 1, efsdp = tp / ep > 1: experts alone
        for block in model.layers.values():
            if hasattr(block, "moe"):
                fully_shard(block.moe.experts, mesh=expert_dp, reshard_after_forward=training.reshard_after_forward,
                            shard_placement_fn=run.expert_placement)


#: Each axis's runtime apply, run by :func:`parallelize` in this order (torchtitan's: cp, tp,
#: ep, then FSDP2/HSDP over the data axes). Applied elsewhere: pp (pipeline stages,
#: :mod:`meshplan.runtime.execution.pipelined`), dp with ``sharding = "none"`` (:func:`apply_ddp`,
#: by the worker on the materialized model), dp_replicate (HSDP's replica dimension, in the
#: dp_shard apply); etp > 1 other than ep 1's etp = tp (in the tp apply) is refused (:func:`unsupported_mesh`).
APPLY: dict[Axis, Callable[[_Apply], None]] = {Axis.CP: _apply_cp, Axis.TP: _apply_tp, Axis.EP: _apply_ep,
                                               Axis.DP_SHARD: _apply_fsdp}


def parallelize(model: nn.Module, device_mesh: DeviceMesh, mesh: Mesh, training: TrainingSpec,
                loss_parallel: bool = True, mixed_precision: bool = False) -> nn.Module:
    """Split ``model`` over ``device_mesh`` as ``mesh`` and ``training`` say, in place.

    ``mixed_precision``: FSDP2 ``MixedPrecisionPolicy(param_dtype=compute_dtype,
    reduce_dtype=reduce_dtype)`` from ``training``; off by default (fp32 on CPU).
    ``cp > 1``: all-gather K/V context parallelism (:mod:`meshplan.runtime.execution.cp`); the model
    then takes this rank's ``seq / cp`` tokens (:func:`meshplan.runtime.execution.cp.shard_sequence`).
    MoE layers with ``tp > 1``: at etp 1 each tp rank routes its tp-th of the tokens
    (:func:`meshplan.runtime.execution.moe_parallel.apply_moe_tp`); at ep 1 with etp = tp each
    expert is sharded over tp, torchtitan's (:func:`~meshplan.runtime.execution.moe_parallel.apply_experts_over_tp`).
    ``sharding = "none"``: nothing here; the worker wraps the materialized model with
    :func:`apply_ddp`. Raises ConfigError for what this function does not build (pp, etp,
    cp with MoE layers, ZeRO-1/2, DDP with tp, cp or MoE layers).
    """
    why = unsupported_mesh(mesh, training, moe=model.spec.is_moe)
    if why:
        raise ConfigError("mesh", why)
    run = _Apply(model, device_mesh, mesh, training, loss_parallel, mixed_precision)
    for apply in APPLY.values():
        apply(run)
    return model
