"""Forward of a runtime MoE layer whose routed experts are sharded over tp (ep 1, etp = tp), as
torchtitan at b5bcd76 runs an MoE layer at ep 1 (:data:`meshplan.spec.axes.moe_tp.TORCH_ETP`); the
layer is split by :func:`meshplan.runtime.execution.moe_parallel.apply_experts_over_tp`. A module of
its own so that :mod:`~meshplan.runtime.execution.moe` (which calls it) and ``moe_parallel`` (which
imports ``moe``) form no import cycle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _local(w):
    """Local value of a DTensor parameter (its gradient: ``Partial`` where ``Replicate``, the
    router's; the shard's own otherwise)."""
    from torch.distributed.tensor import Partial

    if w.placements[0].is_replicate():
        return w.to_local(grad_placements=[Partial()])
    return w.to_local()


def experts_over_tp_forward(moe: Any, x: torch.Tensor) -> torch.Tensor:
    """Forward of an MoE layer ``moe`` (:class:`~meshplan.runtime.execution.moe.MoE`) under
    :func:`~meshplan.runtime.execution.moe_parallel.apply_experts_over_tp`, ``x`` this rank's (b, s/tp, h)
    under SP, else the replicated (b, s, h): the input made ``Replicate`` (SP: all-gather; its
    ``Partial`` gradient reduce-scattered, else all-reduced: moe_sharding.py:286-288, 219-226),
    every tp rank routing all the tokens through its f/tp slice of each expert, and the
    ``Partial`` outputs reduced to the block's layout: under SP the routed and the shared
    experts' each reduce-scattered (:230-239, :184-196), else their sum all-reduced (:289-302)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if isinstance(x, DTensor):
        x = x.to_local()
    mesh, act = moe.tp_mesh, [Shard(1)] if moe.sp else [Replicate()]
    gathered = DTensor.from_local(x, mesh, act, run_check=False).redistribute(mesh, [Replicate()])
    full = gathered.to_local(grad_placements=[Partial()])
    b, s, h = full.shape
    t = full.reshape(b * s, h)
    outs: list[torch.Tensor] = [moe._routed(t)]
    if hasattr(moe, "shared"):
        sh = moe.shared
        up = F.linear(t, _local(sh.w_up.weight))
        act_ = F.silu(F.linear(t, _local(sh.w_gate.weight))) * up if sh.gated else F.gelu(up)
        outs.append(F.linear(act_, _local(sh.w_down.weight)))
    if not moe.sp:  # one all-reduce of the summed Partial outputs
        outs = [torch.stack(outs).sum(0)]
    reduced = [DTensor.from_local(o.view(b, s, h), mesh, [Partial()], run_check=False).redistribute(mesh, act)
               .to_local() for o in outs]
    return reduced[0] if len(reduced) == 1 else reduced[0] + reduced[1]
