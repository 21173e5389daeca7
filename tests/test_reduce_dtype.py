"""One FSDP reduce dtype (``TrainingSpec.fsdp_reduce_dtype``) for the collective table, the
memory timeline's reduce-scatter input and the search's bound, where ``grad_reduce_dtype`` is
set apart from ``reduce_dtype`` (before, memory and the bound sized the input in
``reduce_dtype`` while the table reduced in ``grad_reduce_dtype``).

The tiny model of ``test_memory_timeline``: a layer's FSDP2 unit is 3,104 elements (4 x 16 x 16
attention, 2 x 16 x 64 MLP, 2 x 16 norms); bf16 compute, fp32 ``reduce_dtype`` (the default),
``grad_reduce_dtype = "bf16"``: the reduce-scatter input is 3,104 x 2 = 6,208 B (was 12,416 B
in memory, fp32).
"""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.search.bounds import units
from meshplan.search.memory import Tables, stage_layout
from meshplan.search.space import SHARDING, enumerate_candidates

TINY = dict(layers=2, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=128)
LAYER_UNIT = 4 * 16 * 16 + 2 * 16 * 64 + 2 * 16


def _tables(sharding: str, names: list[str], shape: list[int], **training) -> dict:
    return {"model": TINY, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 4, "seq_len": 8, "sharding": sharding, "param_dtype": "fp32",
                         "recompute": "none", "grad_reduce_dtype": "bf16"} | training,
            "mesh": {"names": names, "shape": shape, "world": int(np.prod(shape))}}


@pytest.mark.parametrize("sharding,names,shape", [("zero3", ["dp_shard"], [2]),
                                                   ("hsdp", ["dp_replicate", "dp_shard"], [2, 2])])
def test_memory_reduce_scatter_input_is_the_tables_bytes(sharding, names, shape):
    plan = build_plan(config_from_dict(_tables(sharding, names, shape)))
    assert LAYER_UNIT == 3104
    [rs] = {(r.size_bytes, r.dtype) for r in plan.stage(0).collectives
            if r.op == "reduce-scatter" and r.per_layer == 1.0}  # the layer units
    assert rs == (LAYER_UNIT * 2, "bf16")
    inputs = {e.delta_bytes for e in plan.timeline.events()
              if e.label == "layer 1: reduce-scatter input (reduce dtype)" and e.delta_bytes > 0}
    assert inputs == {rs[0]}  # 6,208 B, the table's size (12,416 B in fp32 before)


def test_search_bound_reduces_in_the_tables_dtype():
    """The bound's reduce/compute ratio ``r`` (unsharded gradient to reduce-scatter input) is
    bf16 / bf16 = 1 here (2 with fp32, as it was from ``reduce_dtype``)."""
    for grad_reduce, r in (("bf16", 1.0), ("fp32", 2.0), ("param", 2.0)):
        t = _tables("zero3", ["dp_shard"], [2], grad_reduce_dtype=grad_reduce)
        cfg = config_from_dict({k: v for k, v in t.items() if k != "mesh"}, require_mesh=False)
        c = enumerate_candidates(cfg)
        c = c.take(np.flatnonzero((c.pp == 1) & (c.sh == SHARDING.index("zero3")))[:1])
        u = units(cfg, Tables(cfg), c, stage_layout(cfg, c, 1))
        assert u["r"] == r


@pytest.mark.parametrize("grad_reduce,dtype", [("bf16", "bf16"), ("fp32", "fp32"), ("param", "fp32"), (None, "fp32")])
def test_search_zero1_reduce_scatter_is_the_tables(grad_reduce, dtype):
    """A zero1 candidate (pp 1, dp_shard 8): the bound's per-step gradient reduce-scatter
    (``search.step_end_bound.stage_end_bound``) is the table's zero1 row, in the dtype the zero1 plan reduces
    in (``TrainingSpec.zero12_reduce_dtype``: grad_reduce_dtype, else reduce_dtype fp32), over the
    stage's 2 x 3,104 + embedding 128 x 16 + output 16 x 128 + norm 16 = 10,320 elements (before,
    the bound took reduce_dtype: fp32 where the table reduced in bf16)."""
    from meshplan.search.memory import state
    from meshplan.search.space import candidate_config
    from meshplan.search.comm_bounds import comm_times
    from meshplan.search.step_end_bound import stage_end_bound
    from meshplan.search.time_tables import TimeTables

    t = _tables("zero1", ["dp_shard"], [8], grad_reduce_dtype=grad_reduce, framework="megatron", global_batch=8)
    if grad_reduce is None:
        del t["training"]["grad_reduce_dtype"]
    cfg = config_from_dict({k: v for k, v in t.items() if k != "mesh"}, require_mesh=False)
    c = enumerate_candidates(cfg)
    i = int(np.flatnonzero((c.pp == 1) & (c.dps == 8) & (c.sh == SHARDING.index("zero1")))[0])
    sub = c.take([i])
    tt = TimeTables(cfg, Tables(cfg))
    st = stage_layout(cfg, sub, 1)
    _, red = stage_end_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st), comm_times(cfg, tt, sub))
    [row] = [r for r in build_plan(candidate_config(cfg, c, i)).stage(0).collectives
             if r.op == "reduce-scatter" and r.cadence == "once per step"]
    assert (row.dtype, row.size_bytes) == (dtype, (2 * LAYER_UNIT + 128 * 16 * 2 + 16) * (2 if dtype == "bf16" else 4))
    assert float(red[0, 0]) == pytest.approx(row.time_s, rel=1e-12)
