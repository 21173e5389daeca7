"""torch 2.13 as the oracle for the tp collectives of a checkpointed Llama block under sequence
parallelism (meshplan.comm.tp_rows._tp_layer_ops): one block with torchtitan's TP plan
(SequenceParallel norms, PrepareModuleInput Shard(1) -> Replicate before the attention and the
MLP, Colwise wq/wk/wv/w1/w3, Rowwise wo/w2 to Shard(1)) on a fake process group of 2 ranks,
checkpointed (non-reentrant) three ways, and the functional collectives counted by
``CommDebugMode`` in forward and in backward:

- no checkpoint: 2 all-gathers + 2 reduce-scatters each way;
- full (a plain checkpoint): the replay repeats all but the last: 2 all-gathers, 1 reduce-scatter;
- torchtitan's op-level SAC: a policy written here from the rule of torchtitan's
  ``_save_list`` (llama3 ``parallelize_llama.py`` at 820504e: mm outputs saved but every second
  mm of the block, SDPA outputs and reduce_scatter_tensor outputs saved, the rest recomputed;
  on CPU SDPA runs as ``_scaled_dot_product_flash_attention_for_cpu``, saved here as the GPU
  kernels are there): the replay repeats the 2 all-gathers, no reduce-scatter.

The table's per-layer counts must match: backward all-gathers 2 + 2 (op) or 2 + 2 (full), backward
reduce-scatters 2 (op) or 2 + 1 (full). The same block also shows the layout copies of
meshplan.compute.dtensor_sp: the ``aten.cat`` of a whole activation around each dim-1 collective.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from functools import partial

import pytest

pytestmark = pytest.mark.slow

DIM, HEADS, FFN, SEQ, BATCH = 32, 4, 64, 8, 2


def _block_cls():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
            self.wo = nn.Linear(DIM, DIM, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
            self.w2 = nn.Linear(FFN, DIM, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
            self.attention, self.feed_forward = Attention(), FeedForward()

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x))
            return h + self.feed_forward(self.ffn_norm(h))

    return Block, torch


def _op_policy(meta, ctx, func, *args, **kwargs):
    """torchtitan's op-level rule (module docstring), written from its description."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    saved = {aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
             c10d.reduce_scatter_tensor.default, aten.max.default}
    key = "recompute" if ctx.is_recompute else "forward"
    if func == aten.mm.default:
        meta[key] += 1
        if meta[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _tp2_mesh():
    """A 1-D "tp" DeviceMesh of 2 ranks on a fake process group (rank 0), made and left by
    :func:`~meshplan.runtime.validation.dryrun.fake_process_group`: on exit it destroys the group
    and clears DTensor's sharding caches, whose entries keep the mesh they were made on (an equal
    mesh of a later process group, or of a rank forked from this process, would be handed this
    one, its collectives those of the destroyed fake group: tests/gloo_grads.py's ranks then
    computed wrong gradients)."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.runtime.validation.dryrun import fake_process_group

    with fake_process_group(2):
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


@pytest.fixture
def tp2():
    with _tp2_mesh() as mesh:
        yield mesh


def _parallel_block(mesh):
    """One block with torchtitan's TP plan over ``mesh`` (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    Block, torch = _block_cls()
    torch.manual_seed(0)
    block = Block()
    parallelize_module(block, mesh, {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    return block


def _counts(mesh, mode: str) -> dict:
    import torch
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    block = _parallel_block(mesh)
    x = torch.randn(BATCH, SEQ // 2, DIM, requires_grad=True)  # this rank's sequence shard, as torchtitan's
    if mode == "none":
        run = block
    elif mode == "full":
        run = partial(checkpoint, block, use_reentrant=False)
    else:
        meta = defaultdict(int)
        context = partial(create_selective_checkpoint_contexts, partial(_op_policy, meta))
        run = partial(checkpoint, block, use_reentrant=False, context_fn=context)

    def tally(counts) -> tuple[int, int]:
        by = defaultdict(int)
        for op, n in counts.items():
            by[str(op)] += n
        named = lambda what: sum(n for k, n in by.items() if what in k)
        return named("all_gather_into_tensor"), named("reduce_scatter_tensor")

    with CommDebugMode() as m:  # one mode: its module tracker needs the forward's modules in backward
        y = run(x)
        fwd = tally(m.get_comm_counts())
        y.sum().backward()
        total = tally(m.get_comm_counts())
    out = {"forward": fwd, "backward": (total[0] - fwd[0], total[1] - fwd[1])}
    return out


@pytest.mark.timeout(300)
def test_checkpoint_replays_as_the_table_counts(tp2):
    """(all-gathers, reduce-scatters) per phase of one block, torch against the table's rule."""
    from meshplan.comm.stage_context import StageContext
    from meshplan.comm.tp_rows import _tp_layer_ops
    from tests.test_op_sac_tp import _plan

    got = {mode: _counts(tp2, mode) for mode in ("none", "full", "op")}
    assert got["none"] == {"forward": (2, 2), "backward": (2, 2)}
    assert got["full"] == {"forward": (2, 2), "backward": (4, 3)}
    assert got["op"] == {"forward": (2, 2), "backward": (4, 2)}
    for mode in ("none", "full", "op"):
        p = _plan(mode)
        ctx = StageContext(model=p.config.model, training=p.config.training, mesh=p.mesh, layers=list(range(32)),
                           first=True, last=True, gpu=p.config.cluster.gpu)
        fwd, bwd = _tp_layer_ops(ctx, 0)
        assert (fwd.count("all-gather"), fwd.count("reduce-scatter")) == got[mode]["forward"]
        assert (bwd.count("all-gather"), bwd.count("reduce-scatter")) == got[mode]["backward"]


def _cats(mesh, batch: int) -> dict:
    """aten.cat calls whose output is a whole [batch, seq, dim] activation, per phase, for one
    block without checkpointing (meshplan.compute.dtensor_sp's layout copies)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    full = (batch, SEQ, DIM)
    seen = {"forward": 0, "backward": 0}

    class Cats(TorchDispatchMode):
        phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and isinstance(out, torch.Tensor) and tuple(out.shape) in (
                    full, (2 * batch, SEQ // 2, DIM)):
                seen[self.phase] += 1
            return out

    block = _parallel_block(mesh)
    x = torch.randn(batch, SEQ // 2, DIM, requires_grad=True)
    mode = Cats()
    with mode:
        y = block(x)
        mode.phase = "backward"
        y.sum().backward()
    return seen


@pytest.mark.timeout(300)
def test_layout_copies_as_torch_makes_them(tp2):
    """Batch 2: a cat of the whole activation after each dim-1 all-gather and before each dim-1
    reduce-scatter, 4 per block each way, as dtensor_sp counts; batch 1: the gathers' are views,
    the scatters' cats still run in eager torch (2 each way; dtensor_sp counts none there: its
    docstring's possible under-count)."""
    from meshplan.compute import dtensor_sp

    assert _cats(tp2, 2) == {"forward": 4, "backward": 4}
    assert len(dtensor_sp.copies(("attn", "mlp"), False)) == 8
    assert _cats(tp2, 1) == {"forward": 2, "backward": 2}


@pytest.mark.timeout(120)
def test_a_block_made_after_the_fixture_is_on_its_own_mesh():
    """The fixture leaves no mesh behind (the order-dependent failure of the gloo gradient tests
    after this file in ``-m slow``). DTensor's sharding cache is keyed on the tensors' specs, and a
    DeviceMesh compares equal to any mesh of the same ranks, names and device whatever its process
    group: without the clearing, the second block's wq weight (a 32 x 32 Shard(0) parameter, the
    first block's spec) came back on the first, destroyed group's mesh."""
    with _tp2_mesh() as first:
        _parallel_block(first)
    with _tp2_mesh() as second:
        block = _parallel_block(second)
        assert second == first  # equal: what a cache entry of the first mesh would match
        assert block.attention.wq.weight.device_mesh is second
        assert block.feed_forward.w2.weight.device_mesh is second
