"""Forward prefetch under full recompute, torch 2.13 FSDP2 on the fake process group.

torchtitan (b5bcd76, ``torchtitan/distributed/fsdp.py`` 318-360 and 386-406) shards an MoE
block as ONE FSDP unit, its routed experts a second parameter group over efsdp (a per-parameter
mesh), wraps the block in ``checkpoint_wrapper`` before ``fully_shard``
(``activation_checkpoint.py`` 152-176) and, under ep > 1, has each block prefetch the next in
forward. In recompute the block's hooks do not run, so the replayed forward prefetches nothing;
the plan counts no such all-gather. Had the experts been a unit of their own that prefetched
(the validate worker's layout before valmoe2's gate; since valmoe3 the worker shards the block as
torchtitan does, ``moe_parallel.per_param_mesh``), their replayed pre-forward, not yet in backward
(``_fsdp_state.py`` 295-320), would re-gather every unit ahead.

Tiny model, world 4, rank 0: 2 blocks (a bias-free 8 x 8 dense weight over the 4 ranks: 256 B
gathered; 4 experts of 8 x 8 over efsdp = ranks {0, 2}: 1,024 B gathered) and a head (8 x 8,
256 B, not resharded after forward, as torchtitan's ``[norm, output]``).
"""

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from meshplan.runtime.execution.recorder import CollectiveRecorder  # noqa: E402
from meshplan.runtime.validation.dryrun import fake_process_group  # noqa: E402

H, E = 8, 4
DENSE_B, EXPERTS_B = H * H * 4, E * H * H * 4  # gathered bytes, fp32


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, H, H))

    def forward(self, x):
        return x @ self.w.sum(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(H, H, bias=False)
        self.experts = Experts()

    def forward(self, x):
        h = self.experts(self.dense(x))
        return x + h * h  # the product saves h: backward recomputes before h's gradient exists


class Model(nn.Module):
    """Two blocks and a head; ``outer``: each block checkpointed from outside its FSDP unit,
    as meshplan's runtime model does (``checkpoint(block, ...)``), else inside it (torchtitan's
    ``checkpoint_wrapper`` before ``fully_shard``)."""

    def __init__(self, outer: bool):
        super().__init__()
        self.outer = outer
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(H, H, bias=False)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.outer else block(x)
        return self.head(x)


def _build(layout: str):
    """``titan``: the experts a second group of their block's unit, the block prefetching;
    ``apart``: the experts a unit of their own that prefetches."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    dp, edp = DeviceMesh("cpu", [0, 1, 2, 3]), DeviceMesh("cpu", [0, 2])
    dp_info, edp_info = _get_mesh_info(dp), _get_mesh_info(edp)
    torch.manual_seed(0)
    model = Model(outer=layout != "titan")
    blocks, experts = model.blocks, [b.experts for b in model.blocks]
    for i, inner in enumerate(list(blocks)):
        if layout == "titan":
            blocks[i] = checkpoint_wrapper(inner)
            params = set(inner.experts.parameters())
            fully_shard(blocks[i], mesh=dp, shard_placement_fn=lambda p, s=params: ShardPlacementResult(
                Shard(0), edp_info if p in s else dp_info))
        else:
            fully_shard(inner.experts, mesh=edp)
            fully_shard(inner, mesh=dp)
    fully_shard(model.head, mesh=dp, reshard_after_forward=False)
    fully_shard(model, mesh=dp)
    if layout == "titan":
        blocks[0].set_modules_to_forward_prefetch([blocks[1]])
        blocks[1].set_modules_to_forward_prefetch([model.head])
    for i, ahead in enumerate([[blocks[1], experts[1]], [model.head]]):
        if layout == "apart":
            experts[i].set_modules_to_forward_prefetch(ahead)
    return model


def _backward_gathers(layout: str) -> Counter:
    with fake_process_group(4, rank=0):
        model = _build(layout)
        with CollectiveRecorder() as rec:
            rec.phase = "forward"
            loss = model(torch.randn(2, H)).sum()
            rec.phase = "backward"
            loss.backward()
    return Counter((r.group, r.size_bytes) for r in rec.records if r.phase == "backward" and r.op == "all-gather")


def test_torchtitan_layout_prefetches_nothing_in_recompute():
    """One all-gather per group per block in backward (its pre-backward unshard, which the
    recompute reuses), none for the head: 2 x 256 B over the 4 ranks, 2 x 1,024 B over {0, 2}."""
    assert _backward_gathers("titan") == {((0, 1, 2, 3), DENSE_B): 2, ((0, 2), EXPERTS_B): 2}


def test_experts_unit_prefetching_regathers_the_units_ahead():
    """The same model with the experts a unit that prefetches: block 0's replay re-gathers
    block 1 (256 B) and its experts (1,024 B), block 1's the head (256 B), all resharded after
    their backward: two dense and one experts' all-gather more than above, the mismatch
    (``tests/test_table_vs_torch.py``, MoE full recompute) torchtitan's layout avoids."""
    assert _backward_gathers("apart") == {((0, 1, 2, 3), DENSE_B): 4, ((0, 2), EXPERTS_B): 3}

