"""Expert parallelism (EP) and tensor parallelism of the runtime's MoE layers
(:class:`meshplan.runtime.execution.moe.MoE`, whose module docstring says how each runs):
:func:`apply_ep` keeps this rank's experts and routes through the ep group, :func:`apply_moe_tp`
splits the tokens over tp (etp 1), :func:`apply_experts_over_tp` the experts (ep 1, etp = tp), and the expert mesh they run on: its DeviceMesh
(:func:`init_expert_mesh`), its groups checked against meshplan's (:func:`check_expert_groups`)
and the experts' FSDP2 shard placement (:func:`expert_placement_fn`) on their own mesh, a second
parameter group of their block's unit under ep > 1 (:func:`per_param_mesh`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from meshplan.runtime.execution.moe import MoE, moe_layers
from meshplan.spec.axes.ep import expert_shard_dim
from meshplan.spec.model import ModelSpec

if TYPE_CHECKING:  # annotations only
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def apply_ep(model: nn.Module, ep_group, ep: int, ep_index: int) -> None:
    """Keep experts ``ep_index * E/ep ..`` of every MoE layer (parameters replaced by
    ``E/ep``-row ones on the same device, so call it on a meta-device model before
    ``to_empty``) and route through ``ep_group``. Raises ValueError when ``ep`` does not
    divide the experts (the planner refuses such meshes first).

    Gradient scale: the backward all-to-all sums each expert's gradient over the tokens of
    the ``ep`` ranks, and FSDP2 averages it over the expert data axis (efsdp, times
    dp_replicate), that is over ``dp / ep`` ranks; the experts' weights therefore scale
    their gradient by ``1/ep`` so it is the mean over all ``dp`` ranks, as for the dense
    weights (no extra collective). Under TP (:func:`apply_moe_tp`) each token is routed by
    one of the ``tp`` ranks that hold it and efsdp is ``fsdp * tp / ep``, so the scale is
    ``tp / ep`` (``efsdp / fsdp`` in both cases)."""
    for moe in moe_layers(model):
        if moe.n_experts % ep:
            raise ValueError(f"experts {moe.n_experts} is not divisible by ep {ep}")
        ex, local = moe.experts, moe.n_experts // ep
        for name, p in list(ex.named_parameters(recurse=False)):
            setattr(ex, name, nn.Parameter(torch.empty((local,) + tuple(p.shape[1:]), device=p.device,
                                                       dtype=p.dtype)))
        moe.ep_group, moe.ep = ep_group, ep
        ex.offset, ex.grad_scale = ep_index * local, _grad_scale(moe)


def _grad_scale(moe: "MoE") -> float:
    """Gradient scale of the routed experts: ``token_split / ep`` (see :func:`apply_ep`)."""
    return moe.token_split / moe.ep


def apply_moe_tp(moe: "MoE", tp_mesh, sequence_parallel: bool) -> None:
    """TP of one MoE layer with experts whole on each ep rank (etp = 1), in place: the
    router replicated over ``tp_mesh`` as a ``SequenceParallel`` module on the token dim
    (input this rank's own tokens, Shard(0); weight gradient Partial, all-reduced over tp by
    FSDP2), the shared experts colwise/rowwise as the dense MLP, and :meth:`MoE.forward`
    routing this rank's tp-th of the tokens (module docstring). The routed experts' gradient
    scale becomes ``tp / ep`` (:func:`apply_ep`). Call on the meta-device model, before or
    after :func:`apply_ep`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {"router": SequenceParallel(sequence_dim=0, use_local_output=True)}
    if hasattr(moe, "shared"):
        plan.update({"shared": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
                     "shared.w_up": ColwiseParallel(), "shared.w_down": RowwiseParallel(output_layouts=act)})
        if moe.shared.gated:
            plan["shared.w_gate"] = ColwiseParallel()
    parallelize_module(moe, tp_mesh, plan)
    moe.tp_mesh, moe.sp, moe.token_split = tp_mesh, sequence_parallel, tp_mesh.size()
    moe.experts.grad_scale = _grad_scale(moe)


def apply_experts_over_tp(moe: "MoE", tp_mesh, sequence_parallel: bool) -> None:
    """TP of one MoE layer at ep 1 as torchtitan b5bcd76 builds it (etp = tp,
    :data:`meshplan.spec.axes.moe_tp.TORCH_ETP`), in place: routed experts' w_gate/w_up (E, f, h)
    ``Shard(1)`` and w_down (E, h, f) ``Shard(2)`` on ``tp_mesh`` (``expert_param_placement_dense``,
    torchtitan/models/common/moe_sharding.py:50-68), shared experts' w_gate/w_up ``Shard(0)`` and
    w_down ``Shard(1)`` (colwise, rowwise), the router ``Replicate`` with a ``Partial`` gradient
    (:219-226: the scores' gradient is a sum over the tp ranks' expert slices); every tp rank
    routes all the tokens (:func:`meshplan.runtime.execution.moe_etp.experts_over_tp_forward`), so the experts' gradient scale stays
    1. Call on the meta-device model; :meth:`Transformer.init_weights` draws the full tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def shard(mod, name, placement):
        p = getattr(mod, name)
        setattr(mod, name, nn.Parameter(distribute_tensor(p.data, tp_mesh, [placement], src_data_rank=None)))

    ex = moe.experts
    for name, dim in (("w_gate", 1), ("w_up", 1), ("w_down", 2)):
        if hasattr(ex, name):
            shard(ex, name, Shard(dim))
    if hasattr(moe, "shared"):
        for name, dim in (("w_gate", 0), ("w_up", 0), ("w_down", 1)):
            if hasattr(moe.shared, name):
                shard(getattr(moe.shared, name), "weight", Shard(dim))
    shard(moe.router, "weight", Replicate())
    moe.tp_mesh, moe.sp, moe.token_split, moe.experts_over_tp = tp_mesh, sequence_parallel, 1, True
    ex.grad_scale = _grad_scale(moe)


def expert_placement_fn(spec: ModelSpec, mesh):
    """``shard_placement_fn`` of the routed experts' FSDP2 unit: ``Shard(1)`` for every
    parameter when efsdp x ep > experts, else None (FSDP2's default ``Shard(0)``): torchtitan's
    rule, :func:`meshplan.spec.axes.ep.expert_shard_dim`, which meshplan's collective table
    sizes the expert all-gathers by. ``mesh``: the resolved meshplan
    :class:`~meshplan.mesh.resolve.Mesh`.

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> spec = ModelSpec(layers=1, hidden=16, ffn=32, q_heads=2, vocab=10, experts=4, top_k=2, expert_ffn=8)
    >>> fn = expert_placement_fn(spec, resolve_mesh(MeshSpec(names=["dp_shard", "ep"], shape=[8, 4]), world=8))
    >>> fn(None), expert_placement_fn(spec, resolve_mesh(MeshSpec(names=["dp_shard", "ep"], shape=[4, 2]), world=4))
    (Shard(dim=1), None)
    """
    from torch.distributed.tensor import Shard

    if expert_shard_dim(spec.experts, mesh.degree("efsdp"), mesh.ep) == 0:
        return None
    return lambda _param: Shard(1)


def per_param_mesh(experts: set, placement: Optional[Callable], dp_mesh: DeviceMesh,
                    expert_mesh: DeviceMesh) -> Callable:
    """torchtitan's ``shard_placement_fn`` of an MoE block under ep > 1 (``torchtitan/distributed/
    fsdp.py`` ``apply_fsdp_to_decoder``, its "ep_degree > 1: per-param mesh" branch): ``experts``
    over ``expert_mesh`` at ``placement`` (``Shard(0)`` where it says None), the rest ``Shard(0)``
    over ``dp_mesh``. One FSDP state with two parameter groups (torch 2.13 ``_fsdp_init.py``
    437-530, one per process group): both reduced in the block's post-backward, after its whole
    backward, as the memory timeline counts them (the experts a unit of their own reduced alone,
    before the block's dense gradients: grad_buffers 22,020,096 B against the plan's 23,351,296 B
    at world 4 of ``tests/data/validate_mixtral_ep2_fsdp.toml``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    dense, sparse = _get_mesh_info(dp_mesh), _get_mesh_info(expert_mesh)

    def fn(p):
        if p in experts:
            return ShardPlacementResult(placement=(placement(p) if placement else None) or Shard(0), mesh_info=sparse)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dense)

    return fn


def init_expert_mesh(mesh, device: str = "cpu"):
    """DeviceMesh of the plan's expert mesh (outer dense axes, then efsdp, ep, etp:
    :meth:`meshplan.mesh.resolve.Mesh.expert_grid`) on the current process group.

    On 4 ranks of dp_shard 4 with ep 2: ``["ep"]`` is [0, 1] or [2, 3], ``["efsdp"]`` is
    [0, 2] or [1, 3]."""
    from torch.distributed.device_mesh import DeviceMesh

    names, grid = mesh.expert_grid()
    return DeviceMesh(device, torch.as_tensor(grid), mesh_dim_names=names)


def check_expert_groups(expert_mesh, mesh) -> list[str]:
    """Differences between the expert DeviceMesh's groups and meshplan's for this rank."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    for axis in ("efsdp", "ep", "etp"):
        got = dist.get_process_group_ranks(expert_mesh[axis].get_group())
        if got != mesh.group_of(rank, axis):
            out.append(f"{axis}: DeviceMesh group of rank {rank} is {got}, meshplan says {mesh.group_of(rank, axis)}")
    return out
