"""Typed plan results (issue 10 item 4): build_plan returns a Plan (every field set) or an
Infeasible (why there is no plan); plan.stage(k) is the one rule for which collective table a
pipeline stage uses."""

import ast
import dataclasses
import types
import typing
from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import Infeasible, Plan, Stage, build_plan, table_stage

ROOT = Path(__file__).resolve().parents[1]


def plan_of(shape, names=("pp", "dp_shard", "tp"), nodes=2, **training):
    t = {"global_batch": 8, "seq_len": 1024, **training}
    return build_plan(config_from_dict({"model": {"catalog": "llama3-8b"},
                                        "cluster": {"system": "dgx-h100", "nodes": nodes},
                                        "training": t, "mesh": {"names": list(names), "shape": list(shape)}}))


def test_plan_has_no_optional_field():
    hints = typing.get_type_hints(Plan)
    optional = [f.name for f in dataclasses.fields(Plan)
                if type(None) in typing.get_args(hints[f.name])
                or (isinstance(hints[f.name], types.UnionType) and type(None) in hints[f.name].__args__)]
    assert optional == []
    assert type(None) in typing.get_args(typing.get_type_hints(Infeasible)["mesh"])  # the other type has them


def test_unresolved_mesh_is_infeasible_without_a_mesh():
    # 2 nodes x 8 = 16 GPUs; pp 4 x dp_shard 3 x tp 2 = 24 ranks
    p = plan_of((4, 3, 2))
    assert isinstance(p, Infeasible) and not p.feasible and p.mesh is None and p.placement is None
    assert p.reasons[0].startswith("pp(4) * dp_shard(3) * tp(2) = 24 != world(16)")


def test_invalid_mesh_is_infeasible_with_its_mesh_and_placement():
    # global batch 6 over dp = dp_shard 4: 6 / (micro_batch 1 * 4) is not whole
    p = plan_of((4, 2), names=("dp_shard", "tp"), nodes=1, global_batch=6)
    assert isinstance(p, Infeasible) and p.mesh is not None and p.placement is not None
    assert p.mesh.layout.shape == (4, 2)
    assert p.reasons == ("global_batch 6 is not divisible by micro_batch 1 * dp 4 = 4",)


def test_table_stage_rule():
    # first and last stage have their own table; every middle stage shares stage 1's
    assert [table_stage(k, 1) for k in range(1)] == [0]
    assert [table_stage(k, 2) for k in range(2)] == [0, 1]
    assert [table_stage(k, 5) for k in range(5)] == [0, 1, 1, 1, 4]


def test_stage_of_pp4():
    # llama3-8b, 32 layers over pp 4: 8 consecutive layers per stage. Ranks in [pp, dp_shard, tp]
    # = [4, 2, 2] row-major: pp coordinate = rank // (2 * 2).
    p = plan_of((4, 2, 2))
    assert isinstance(p, Plan), p.reasons
    assert sorted(p.collectives) == ["stage 0", "stage 1", "stage 3"]
    for k in range(4):
        s = p.stage(k)
        assert isinstance(s, Stage) and s.index == k and s.layers == list(range(8 * k, 8 * k + 8))
        assert s.table_stage == [0, 1, 1, 3][k]
        assert s.collectives is p.collectives[f"stage {s.table_stage}"]
        assert s.timeline is p.timelines[k] and s.state is p.state[k]
        assert (s.first, s.last) == (k == 0, k == 3)
    assert [p.stage_of(r).index for r in (0, 3, 4, 9, 15)] == [0, 0, 1, 2, 3]
    with pytest.raises(IndexError):
        p.stage(4)


def test_stage_without_pp_axis():
    p = plan_of((2, 8), names=("dp_shard", "tp"))
    assert isinstance(p, Plan), p.reasons
    assert p.stage_of(13).index == 0 and p.stage(0).layers == list(range(32))


def test_schedule_imports_plan_at_top_level():
    # plan.py is an earlier layer than schedule/: no function-level import of it there
    for path in (ROOT / "meshplan" / "schedule").glob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(fn) if isinstance(n, ast.ImportFrom) and n.module == "meshplan.plan"]
                assert not inner, f"{path.name}: {fn.name} imports meshplan.plan inside the function"
