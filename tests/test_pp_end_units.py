"""torchtitan's FSDP2 units at every pp: the embedding its own unit on the stage that holds it,
each layer a unit, [final norm, output] one unit on the stage that holds them
(``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder``, applied to each pipeline model
part, whose missing ends are None); with vpp the first stage's chunk 0 holds the embedding and
the last stage's last chunk the head. The collective table (:func:`meshplan.comm.fsdp_rows.fsdp_units`)
and the runtime wrapper (:func:`meshplan.runtime.execution.parallelize.apply_fsdp` through
:func:`meshplan.runtime.execution.pipelined_stage.parallelize_stage`) list the same units.

Model: 8 layers, h 64, vocab 256 (a multiple of every divisor: no padding), untied, bf16
gathers, fp32 reduce; dp_shard 2. By hand: the embedding unit gathers 256 x 64 x 2 B = 32,768 B
(nccl-tests' size, the all-gather output; each rank holds 256 x 64 / 2 = 8,192 elements, 16,384 B
of it), and reduce-scatters 256 x 64 x 4 B = 65,536 B; [norm, output] gathers (64 + 256 x 64)
x 2 B = 32,896 B and reduce-scatters (64 + 256 x 64) x 4 B = 65,792 B.
"""

from collections import Counter

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.comm_streams import comm_kind
from meshplan.schedule.row_groups import shard_group

MODEL = dict(layers=8, hidden=64, ffn=128, gated_mlp=False, q_heads=4, vocab=256)
EMB_AG, EMB_RS = 256 * 64 * 2, 256 * 64 * 4
HEAD_AG, HEAD_RS = (64 + 256 * 64) * 2, (64 + 256 * 64) * 4


def _plan(pp: int, vpp: int = 1, schedule: str = "1f1b", reshard: bool = True, tied: bool = False):
    mesh = {"names": ["pp", "dp_shard"], "shape": [pp, 2], "world": 2 * pp, "pp_schedule": schedule,
            "virtual_stages": vpp}
    training = {"global_batch": 16, "seq_len": 64, "micro_batch": 1, "sharding": "zero3", "param_dtype": "bf16",
                "reduce_dtype": "fp32", "recompute": "none", "reshard_after_forward": reshard}
    return build_plan(config_from_dict({"model": dict(MODEL, tied_embeddings=tied),
                                        "cluster": {"system": "dgx-h100", "nodes": 1},
                                        "training": training, "mesh": mesh}))


def _end_rows(plan, s: int) -> dict:
    """(group, phase, op) -> (size_bytes, per_step) of stage s's end units' FSDP rows."""
    return {(shard_group(r.cadence), r.phase, r.op): (r.size_bytes, r.per_step)
            for r in plan.stage(s).collectives if comm_kind(r) == "shard" and "root" in r.cadence}


@pytest.mark.parametrize("pp,vpp,schedule", [(2, 1, "1f1b"), (4, 1, "1f1b"), (2, 2, "interleaved_1f1b")])
def test_table_lists_the_embedding_on_the_first_stage_and_the_head_on_the_last(pp, vpp, schedule):
    """m = 16 / 2 = 8 micro-batches. reshard_after_forward: the embedding's unit is gathered
    in every forward of chunk 0 that finds it sharded and in every backward after a forward
    (the layers' rule, fsdp_gather_flags); [norm, output] once per step (never resharded:
    micro-batch 0's forward gathers it, perform_reduce_grad reshards it at the end); each
    reduce-scattered once per step. The middle stages hold neither."""
    from meshplan.comm.fsdp_rows import fsdp_gather_flags

    plan = _plan(pp, vpp, schedule)
    flags = fsdp_gather_flags(schedule, pp, 8, vpp, 0, reshard=True)
    f0 = sum(g for (c, k, _), g in flags.items() if c == 0 and k == "F")
    b0 = sum(g for (c, k, _), g in flags.items() if c == 0 and k == "B")
    assert f0 > 1 and b0 > 0  # resharded after forward: gathered again
    first = _end_rows(plan, 0)
    assert first == {("root_embed", "forward", "all-gather"): (EMB_AG, f0),
                     ("root_embed", "backward", "all-gather"): (EMB_AG, b0),
                     ("root_embed", "backward", "reduce-scatter"): (EMB_RS, 1)}
    assert _end_rows(plan, pp - 1) == {("root_head", "forward", "all-gather"): (HEAD_AG, 1),
                                       ("root_head", "backward", "reduce-scatter"): (HEAD_RS, 1)}
    for s in range(1, pp - 1):
        assert _end_rows(plan, s) == {}
    # each rank's shard of the embedding: vocab x hidden x 2 B / dp_shard
    assert EMB_AG / plan.stage(0).collectives[0].group_size == 256 * 64 * 2 / 2


@pytest.mark.parametrize("reshard,tied", [(False, False), (True, True)], ids=["no-reshard", "tied"])
def test_end_units_gathered_once_per_step(reshard, tied):
    """pp 2, each end unit gathered and reduce-scattered once per step: without
    reshard_after_forward nothing is resharded; tied, the first stage's embedding is its own
    unit, never resharded after forward (torchtitan's tied branch), so gathered once per step
    even with reshard_after_forward, and the last stage's [norm, output] holds the output copy
    (the same sizes as untied)."""
    plan = _plan(2, reshard=reshard, tied=tied)
    assert _end_rows(plan, 0) == {("root_embed", "forward", "all-gather"): (EMB_AG, 1),
                                  ("root_embed", "backward", "reduce-scatter"): (EMB_RS, 1)}
    assert _end_rows(plan, 1) == {("root_head", "forward", "all-gather"): (HEAD_AG, 1),
                                  ("root_head", "backward", "reduce-scatter"): (HEAD_RS, 1)}


def test_memory_timeline_reshards_the_embedding_under_pp():
    """The memory passes hold the same units: with reshard_after_forward the embedding's unit
    on stage 0 is resharded after each forward and all-gathered (its all-gather output
    allocated) as often per phase as the table counts; stage 1 has no embedding unit and
    gathers [norm, output] once."""
    plan = _plan(2)
    tl0, tl1 = (plan.timeline_of(s) if hasattr(plan, "timeline_of") else plan.timelines[s] for s in (0, 1))
    gathers = lambda tl, unit: Counter(e.phase for e in tl.events()
                                       if e.label == f"{unit}: all-gather output (compute dtype)")
    rows = _end_rows(plan, 0)
    assert gathers(tl0, "embedding") == {"forward": rows[("root_embed", "forward", "all-gather")][1],
                                         "backward": rows[("root_embed", "backward", "all-gather")][1]}
    assert any(e.label == "embedding: resharded after forward" for e in tl0.events())
    assert gathers(tl1, "embedding") == {} and gathers(tl1, "head") == {"forward": 1}


torch = pytest.importorskip("torch")


def _runtime_units(pp: int, vpp: int, rank: int, tied: bool = False, reshard: bool = True) -> list:
    """The FSDP2 units of ``rank``'s stage modules as parallelize_stage wraps them, on the fake
    process group: per chunk module, [(module names, reshard_after_forward)] in module order."""
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.execution.memtracker import fsdp_units
    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.parallelize import init_mesh
    from meshplan.runtime.execution.pipelined_stage import StageModule, parallelize_stage
    from meshplan.runtime.validation.dryrun import fake_process_group
    from meshplan.spec.mesh import MeshSpec
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.training import TrainingSpec

    spec = ModelSpec(**MODEL, tied_embeddings=tied)
    training = TrainingSpec(global_batch=16, seq_len=64, micro_batch=1, param_dtype="fp32",
                            reshard_after_forward=reshard)
    mesh = resolve_mesh(MeshSpec(names=["pp", "dp_shard"], shape=[pp, 2]), world=2 * pp)
    k = mesh.layout.coords_of(rank)[0]
    per = 8 // (pp * vpp)
    with fake_process_group(2 * pp, rank=rank):
        dm = init_mesh(mesh)
        with torch.device("meta"):
            full = Transformer(spec, vocab=256)
        modules = []
        for c in range(vpp):
            v = c * pp + k  # looped chunk map
            modules.append(StageModule(full, list(range(v * per, (v + 1) * per)), first=v == 0,
                                       last=v == pp * vpp - 1))
        parallelize_stage(modules, mesh, training, dm, False, "meta")
        names = {id(mod): n for n, mod in full.named_modules()}
        return [[(tuple(names[id(x)] for x in state._modules),
                  state._fsdp_param_group.post_forward_mesh_info is not None)
                 for _, state in fsdp_units(m)] for m in modules]


def _titan(layers, emb: bool, head: bool, reshard: bool, tied: bool = False) -> list:
    """What torchtitan's apply_fsdp_to_decoder wraps on a model part (its reshard value for the
    blocks and the embedding: ``reshard``, [norm, output] and a tied embedding never), in module
    order: embedding, layers, [norm, output]."""
    out = [(("embedding",), reshard and not tied)] if emb else []
    out += [((f"layers.{i}",), reshard) for i in layers]
    return out + ([(("final_norm", "output"), False)] if head else [])


@pytest.mark.parametrize("reshard", [True, False])
def test_runtime_wraps_each_pipeline_stage_as_torchtitan(reshard):
    # pp outermost: ranks 0, 1 are stage 0, ranks 2, 3 stage 1
    assert _runtime_units(2, 1, 0, reshard=reshard) == [_titan(range(4), True, False, reshard)]
    assert _runtime_units(2, 1, 2, reshard=reshard) == [_titan(range(4, 8), False, True, reshard)]


def test_runtime_units_at_pp4_and_vpp2():
    # pp 4: ranks 0, 2, 4, 6 are stages 0..3 (pp outermost)
    assert _runtime_units(4, 1, 0) == [_titan([0, 1], True, False, True)]
    assert _runtime_units(4, 1, 2) == [_titan([2, 3], False, False, True)]
    assert _runtime_units(4, 1, 6) == [_titan([6, 7], False, True, True)]
    # pp 2 x vpp 2, looped: stage 0 holds virtual stages 0 and 2, stage 1 holds 1 and 3
    assert _runtime_units(2, 2, 0) == [_titan([0, 1], True, False, True), _titan([4, 5], False, False, True)]
    assert _runtime_units(2, 2, 2) == [_titan([2, 3], False, False, True), _titan([6, 7], False, True, True)]


def test_runtime_tied_embedding_under_pp_is_its_own_unit_kept_gathered():
    assert _runtime_units(2, 1, 0, tied=True) == [_titan(range(4), True, False, True, tied=True)]
    assert _runtime_units(2, 1, 2, tied=True) == [_titan(range(4, 8), False, True, True)]
