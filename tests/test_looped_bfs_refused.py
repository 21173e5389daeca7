"""torch's ``ScheduleLoopedBFS`` (newcomer trial nc56 #5) is refused with one line saying why, at every
entry point that reads a schedule name: ``mesh.pp_schedule``, ``step --schedule`` and a torchtitan job's
``parallelism.pipeline_parallel_schedule``. Why: its order, read from torch 2.13 itself below, is none of
meshplan's registered schedules' (tests/test_schedule_registry.py compares those with torch's classes)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as S

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.pipeline.registry import SCHEDULES
from meshplan.spec.mesh import LOOPED_BFS_REFUSAL, parse_schedule

from tests.test_schedule_registry import KIND, FakeStage, meshplan_order


def looped_bfs_order(p: int, m: int, v: int, rank: int) -> list[tuple]:
    """(kind, micro-batch, virtual stage) of ``rank``'s computations under torch's ScheduleLoopedBFS,
    its local stages looped (rank, rank + p, ...)."""
    stages = [FakeStage(rank + c * p, p * v, p, rank, []) for c in range(v)]
    run = S.ScheduleLoopedBFS(stages, m)
    return [(KIND[a.computation_type], a.microbatch_index, a.stage_index) for a in run.pipeline_order_with_comms[rank]
            if a is not None and a.computation_type in KIND]


def test_torchs_order_is_none_of_meshplans():
    """By hand from ScheduleLoopedBFS._calculate_single_rank_operations (torch 2.13): p 2, m 2, v 2, rank 0
    runs F0 F1 of stage 0, F0 F1 of stage 2, then B1 B0 of stage 2, B1 B0 of stage 0 (backwards in reverse
    micro-batch order). With one stage per rank, p 2, m 2: F0 F1 B1 B0, where GPipe runs F0 F1 B0 B1."""
    assert looped_bfs_order(2, 2, 2, 0) == [("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2),
                                            ("B", 1, 2), ("B", 0, 2), ("B", 1, 0), ("B", 0, 0)]
    assert looped_bfs_order(2, 2, 1, 0) == [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]
    for p, m, v in ((2, 2, 1), (2, 2, 2), (4, 8, 2)):
        torch_ranks = [looped_bfs_order(p, m, v, r) for r in range(p)]
        for sched in SCHEDULES.values():
            if v > 1 and not sched.virtual_stages or (v == 1 and sched.chunks == 2):
                continue
            ours = [meshplan_order(sched, p, m, v, r) for r in range(p)]
            assert ours != torch_ranks, (sched.name, p, m, v)


def test_refused_in_one_line_everywhere():
    with pytest.raises(ValueError, match="LoopedBFS"):
        parse_schedule("LoopedBFS")
    assert str(LOOPED_BFS_REFUSAL).count("\n") == 0 and "interleaved_1f1b" in LOOPED_BFS_REFUSAL
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                          "training": {"global_batch": 16, "seq_len": 4096},
                          "mesh": {"names": ["pp", "dp_shard"], "shape": [4, 2], "virtual_stages": 2,
                                   "pp_schedule": "ScheduleLoopedBFS"}})
    assert "mesh.pp_schedule" in str(err.value) and LOOPED_BFS_REFUSAL in str(err.value)


def test_torchtitan_job_names_its_key(tmp_path):
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any

    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 2\nglobal_batch_size = 16\n'
                   'seq_len = 4096\n[parallelism]\npipeline_parallel_degree = 4\n'
                   'pipeline_parallel_schedule = "LoopedBFS"\n')
    with pytest.raises(ConfigError) as err:
        load_any(str(job), None, ImportOptions(cluster="dgx-h100", nodes=1), require_mesh=False, foreign=True)
    assert str(err.value).startswith("parallelism.pipeline_parallel_schedule: LoopedBFS (torch ScheduleLoopedBFS)")
