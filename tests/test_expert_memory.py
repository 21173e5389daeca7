"""What the memory timeline holds of the routed experts' FSDP all-gathers (efsdp), in the windows
the rank timeline has them (:mod:`meshplan.schedule.rank_timeline`): an MoE layer's unit holds its
experts (under ep > 1 a second parameter group, all-gathered over efsdp), so the next layer's
experts are held whenever the next layer is; torchtitan under ep > 1 prefetches the next block in
forward (``apply_fsdp_to_decoder`` at b5bcd76), and torch 2.13's ``wait_for_unshard`` keeps the
last group's all-gather output (the experts') till the next copy-out. Bytes derived by hand.

The tiny MoE (tests/test_schedule_semantics.py's): 4 layers, hidden 64, ffn 256 (not gated),
4 heads, vocab 256, 4 experts (top 2) in layers 1-3; dp_shard 4 x ep 2 (efsdp 2), bf16, one rank:
- layer 0 (dense): attention 4 x 64 x 64 + MLP 2 x 64 x 256 + 2 norms x 64 = 49,280 elements, 98,560 B;
- an MoE layer: its dense group, attention + router 4 x 64 + norms = 16,768 elements, 33,536 B;
  its experts, 2 per rank x (256 x 64 + 64 x 256) = 65,536 elements, 131,072 B; the unit 164,608 B;
- the embedding 256 x 64: 32,768 B; [norm, output] 64 + 256 x 64: 32,896 B.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.memory.passes import KINDS
from meshplan.memory.timeline import memory_timeline
from meshplan.plan import build_plan

MOE = dict(layers=4, hidden=64, ffn=256, gated_mlp=False, q_heads=4, vocab=256, experts=4, top_k=2, dense_layers=1)
DENSE0, DENSE, EXPERTS, HEAD = 98_560, 33_536, 131_072, 32_896
UNIT = DENSE + EXPERTS  # 164,608
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"


def moe_plan(ep: int = 2, reshard: bool = True):
    t = {"global_batch": 16, "seq_len": 64, "micro_batch": 1, "sharding": "zero3", "param_dtype": "bf16",
         "recompute": "none", "reshard_after_forward": reshard}
    return build_plan(config_from_dict({"model": MOE, "cluster": {"system": "dgx-h100", "nodes": 1},
                                        "training": t, "mesh": {"names": ["dp_shard", "ep"], "shape": [4, ep], "world": 4}}))


def gathered_at(tl, phase: str, layer: int, kind: str) -> int:
    """gathered_params after micro-batch 0's first ``kind`` event of ``layer`` in ``phase``."""
    g = tl.running()[:, KINDS.index("gathered_params")]
    e = next(e for e in tl.events() if e.phase == phase and e.microbatch == 0 and e.layer == layer and e.kind == kind)
    return int(g[e.t_index])


def test_units_hold_the_experts_and_keep_their_output():
    units = {u.layer: (u.gathered, u.deferred) for u in _units(moe_plan()).values() if u.layer is not None}
    assert units == {0: (DENSE0, 0), 1: (UNIT, EXPERTS), 2: (UNIT, EXPERTS), 3: (UNIT, EXPERTS)}
    # ep 1: one group (the experts in the block's, 4 per rank: 262,144 B), the whole output kept
    assert {u.layer: u.deferred for u in _units(moe_plan(ep=1)).values() if u.layer is not None} == dict.fromkeys(range(4), 0)


def _units(plan):
    from meshplan.memory.sizes import stage_sizes
    c = plan.config
    return stage_sizes(c.model, c.training, plan.mesh, plan.stages, plan.state[0], c.memory, []).units


def test_forward_holds_the_next_layers_experts_from_the_layers_start():
    """At layer i's forward (its saved activations): its copy, its experts' all-gather output (kept
    till layer i+1's copy-out) and layer i+1's whole unit prefetched at its start, the timeline's
    ``fsdp AG L{i+1}`` and ``efsdp AG L{i+1}``. Layer 0: its copy and its output (one group) and
    layer 1's; layer 3: [norm, output] prefetched. Before (no forward prefetch, the whole output
    kept): layer 0 2 x 98,560, layer 1 2 x 164,608."""
    tl = memory_timeline(moe_plan(), 0)
    at = [gathered_at(tl, "forward", i, "activations") for i in range(4)]
    assert at == [2 * DENSE0 + UNIT, UNIT + EXPERTS + UNIT, UNIT + EXPERTS + UNIT, UNIT + EXPERTS + HEAD]
    assert at == [361_728, 460_288, 460_288, 328_576]


def test_backward_holds_the_previous_layers_experts_while_prefetched():
    """At layer i's backward (its first working set): its copy and layer i-1's unit prefetched
    (FSDP2 frees a backward all-gather output at its copy-out), the timeline's ``efsdp AG L{i-1}``
    among it: 131,072 B of the 164,608 B."""
    tl = memory_timeline(moe_plan(), 0)
    assert [gathered_at(tl, "backward", i, "temporaries") for i in (3, 2, 1)] == [2 * UNIT, 2 * UNIT, UNIT + DENSE0]


def test_reshard_after_forward_false():
    """Every unit stays gathered from its forward: at layer 1's forward the embedding's, layer 0's
    and layer 1's copies, layer 1's experts' output kept and layer 2's unit prefetched; backward
    gathers nothing again: at layer 3's backward every layer's and the embedding's copy (the
    head's resharded after its backward), nothing in flight."""
    tl = memory_timeline(moe_plan(reshard=False), 0)
    copies = 32_768 + DENSE0 + UNIT
    assert gathered_at(tl, "forward", 1, "activations") == copies + EXPERTS + UNIT
    assert gathered_at(tl, "backward", 3, "temporaries") == 32_768 + DENSE0 + 3 * UNIT


@pytest.mark.parametrize("reshard", [True, False])
def test_reference_agrees(reshard):
    plan = moe_plan(reshard=reshard)
    fast, ref = memory_timeline(plan, 0), memory_timeline(plan, 0, reference=True)
    assert fast.peak == ref.peak and np.array_equal(fast.running(), ref.running())


def test_mixtral_example_peak():
    """examples/mixtral-8x7b_32xh100_ep8-dp32.toml, stage 0: one layer's unit is its dense group,
    attention 2 x 4096 x 4096 + 2 x 4096 x 1024 + router 8 x 4096 + 2 norms x 4096 = 41,984,000
    elements (83,968,000 B bf16), and its one expert 3 x 4096 x 14336 = 176,160,768 elements
    (352,321,536 B): 436,289,536 B. The peak is 29,006,448,640 B at layer 30's backward
    (micro-batch 1), where the memory already held layer 29's unit, its experts with it, prefetched
    beside layer 30's copy: 2 x 436,289,536 B gathered, before and after. Its temporaries: the
    activation step's 3 gradients of the 8,192 received rows x 14,336 bf16, the layer's dY 4,096 x 4,096
    bf16, and the routing scores' fp32 gradient that waits in the router's backward node, 4,096 tokens x
    top 2 x 4 B = 32,768 B (routed_sizes.scores_grad; 29,006,415,872 B before it, measured at world 2
    and 4 of validate's Mixtral run as the temporaries' residual once the run's routing is taken). (valmoe3: 28,805,089,280
    B before, when the MoE backward step held dX 33,554,432 B + 2 gradients of the 8,192 received
    rows x 14,336 bf16 (234,881,024 B each); it holds 3 of them, the activation step's,
    704,643,072 B, as torch measured: +201,326,592 B.) The forward's largest
    gathered bytes move from 3 units (1,308,868,608 B: at layer i+1's copy-out layer i's whole
    output was still held) to 2 units + one layer's experts (1,224,900,608 B: the dense group's
    output freed at the experts' copy-out), 83,968,000 B (one dense group) less."""
    tl = memory_timeline(build_plan(load_config(EXAMPLE)), 0)
    unit = 83_968_000 + 352_321_536
    assert tl.peak.total_bytes == 29_006_448_640 and tl.peak.where() == "backward of layer 30 (micro-batch 1)"
    assert tl.peak.by_kind["temporaries"] == 3 * 8192 * 14336 * 2 + 4096 * 4096 * 2 + 4096 * 2 * 4  # dY, scores
    assert tl.peak.by_kind["gathered_params"] == 2 * unit
    assert tl.max_by_kind["gathered_params"] == 2 * unit + 352_321_536 == 1_224_900_608


def test_fsdp2_keeps_the_output_under_explicit_forward_prefetch():
    """The rule the forward follows, on torch's FSDP2 (fake process group, 4 ranks, three Linear
    units, ``set_modules_to_forward_prefetch([next])`` as torchtitan sets it under ep > 1): when each
    unit's forward starts (after its pre-forward) its own all-gather result is still held in
    ``comm_ctx.all_gather_state`` and the next unit's prefetched result is pending: two outputs
    beside the copy, not one."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from meshplan.runtime.validation.dryrun import fake_process_group

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with fake_process_group(4):  # destroyed on exit, DTensor's caches of its mesh cleared
        assert _held_at_forward(torch, fully_shard) == [(True, [1]), (True, [2]), (True, [])]


def _held_at_forward(torch, fully_shard) -> list:
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for a, b in zip(model[:-1], model[1:]):
        a.set_modules_to_forward_prefetch([b])
    seen = []

    def held(mod, _inp):
        pending = [i for i, x in enumerate(model) if x._get_fsdp_state()._fsdp_param_group._all_gather_result is not None]
        seen.append((mod._get_fsdp_state()._comm_ctx.all_gather_state is not None, pending))

    for layer in model:
        layer.register_forward_pre_hook(held)
    model(torch.randn(2, 8)).sum().backward()
    return seen
