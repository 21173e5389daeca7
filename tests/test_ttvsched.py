"""torchtitan's pipeline splits (branch ttvsched): the module-name lists meshplan writes for the V-shaped
schedules (ZBVZeroBubble, DualPipeV) placed as torch and torchtitan place them (nc59), and torchtitan's
default cut among the splits ``meshplan search`` plans for a torchtitan config (nc57 #7a).

torch's V placement (torch 2.13, torch/distributed/pipelining/_utils.py ``generate_stage_to_rank_mapping``
with ``style="v"``, the map ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` build in their constructors):
stage index i goes to rank i on the way down (i < pp), the rank stays put at the turn, and comes back
up, so rank s holds stages s and 2 pp - 1 - s. torchtitan b5bcd76 ``distributed/pipeline_parallel.py``
``_get_pp_rank_to_stage_indices_mapping``: ``zip(range(pp), range(num_stages - 1, pp - 1, -1))[rank]``,
the same pairs, and its ``module_fqns_per_model_part[i]`` is stage index i's module list (model order)."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.mesh.chunk_maps import v_shaped, virtual_counts


def test_v_map_is_torchs_stage_to_rank_mapping():
    """meshplan's V map (mesh.chunk_maps.v_shaped, and the pipeline's VShaped over arrays) against
    torch's own ``generate_stage_to_rank_mapping(pp, 2 pp, style="v")`` at pp 1..8, and torchtitan's
    pairs written out by hand at pp 4: (0, 7), (1, 6), (2, 5), (3, 4)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from meshplan.pipeline.vshape import VShaped
    for pp in range(1, 9):
        torch_map = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        ours = {v_shaped(c, s, pp, 2): s for s in range(pp) for c in range(2)}
        assert ours == torch_map, pp
        assert all(VShaped().virtual_stage(c, s, pp, 2) == v_shaped(c, s, pp, 2) for s in range(pp) for c in range(2))
    assert [tuple(v_shaped(c, s, 4, 2) for c in range(2)) for s in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.heavy
def test_v_map_is_what_torchs_v_schedules_build():
    """The two V schedule objects themselves, built on CPU over a fake process group of 4 ranks (rank 1's
    stages 1 and 6, 8 micro-batches): their ``stage_index_to_group_rank`` is the V map."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble
    from torch.testing._internal.distributed.fake_pg import FakeStore
    pp, rank = 4, 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    try:
        for cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
            stages = [PipelineStage(torch.nn.Linear(4, 4), i, 2 * pp, torch.device("cpu"))
                      for i in (v_shaped(0, rank, pp, 2), v_shaped(1, rank, pp, 2))]
            sched = cls(stages, n_microbatches=2 * pp, loss_fn=lambda out, target: out.sum())
            assert sched.stage_index_to_group_rank == {v_shaped(c, s, pp, 2): s for s in range(pp) for c in range(2)}
    finally:
        dist.destroy_process_group()


def _zbv_8b(split, schedule="zbv"):
    """Llama-3-8B (32 layers) at pp 2 x dp_shard 4 on one dgx-h100, 2 chunks a stage, ``split`` per stage
    (reshard_after_forward false: the V schedules' FSDP2 defect, pipeline.vshape.RESHARD_DEFECT)."""
    return config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 32, "seq_len": 4096, "micro_batch": 1, "reshard_after_forward": False},
        "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4], "pp_schedule": schedule, "virtual_stages": 2,
                 "pp_layer_split": split}})


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedule_export_lists_the_parts_as_a_v(schedule):
    """[14, 18] at pp 2 with 2 chunks a stage: stage 0's 14 layers as 7 + 7, stage 1's 18 as 9 + 9
    (mesh.layers.stage_layers spreads a stage's layers evenly over its chunks). Under a V stage 0 holds
    model parts 0 and 3, stage 1 parts 1 and 2, so the parts in model order are [7, 9, 9, 7]: torchtitan
    then gives rank 0 parts 0 and 3 (7 + 7 = 14) and rank 1 parts 1 and 2 (9 + 9 = 18), the plan's split.
    Before this branch the export listed them looped, [7, 9, 7, 9], which torchtitan's V runs as 16 + 16.
    The fix line's own cut (first/last less tried in torchtitan_split.LESS's order 1, 0, 2, 3, the first
    before the last): first 2, last 1 give 32 + 2 + 1 = 35 slots in 4 parts, 8 each and the 3 over on
    the first three parts (torchtitan's ``stage_idx < extra_layers``): [9 - 2, 9, 9, 8 - 1] = [7, 9, 9, 7]."""
    from meshplan.interop.torchtitan_split import split_setting
    from meshplan.interop.torchtitan_write import write
    from meshplan.interop.tomlout import meshplan_tables
    cfg = _zbv_8b([14, 18], schedule)
    parts = write(cfg)["parallelism"]["module_fqns_per_model_part"]
    assert [sum(m.startswith("layers.") for m in p) for p in parts] == [7, 9, 9, 7]
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[1][0] == "layers.7"
    assert parts[3] == [f"layers.{j}" for j in range(25, 32)] + ["norm", "output"]
    ranks = {s: [v_shaped(c, s, 2, 2) for c in range(2)] for s in range(2)}
    assert [sum(len(parts[j]) - (j == 0) - 2 * (j == 3) for j in ranks[s]) for s in range(2)] == [14, 18]
    assert meshplan_tables(cfg)["mesh"]["pp_layer_split"] == [14, 18]  # meshplan's own export: per stage kept
    assert split_setting(32, [14, 18], 2, False, v_shape=True) == (
        "parallelism.pipeline_parallel_first_stage_less_layers = 2, "
        "parallelism.pipeline_parallel_last_stage_less_layers = 1")
    assert split_setting(32, [14, 18], 2, False).startswith("parallelism.module_fqns_per_model_part")  # looped


def test_v_counts_of_a_per_virtual_stage_split_are_as_given():
    """A split per virtual stage is in model order under either map (mesh.layers.stage_layers): the parts
    are the split as written; its per-stage sums under a V pair the ends: [3, 4, 4, 5] gives stage 0
    3 + 5 = 8, stage 1 4 + 4 = 8."""
    assert virtual_counts(16, 2, 2, [3, 4, 4, 5], v_shaped) == [3, 4, 4, 5]
    from meshplan.interop.tomlout import meshplan_tables
    cfg = config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 32, "seq_len": 4096, "micro_batch": 1, "reshard_after_forward": False},
        "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4], "pp_schedule": "zbv", "virtual_stages": 2,
                 "pp_layer_split": [7, 9, 9, 7]}})
    # the per-stage [14, 18] spreads back to [7, 9, 9, 7] under the V: written per stage
    assert meshplan_tables(cfg)["mesh"]["pp_layer_split"] == [14, 18]
