"""The search weighs ``training.reshard_after_forward`` against its default at each mesh (searchraf):
:meth:`~meshplan.spec.training.TrainingSpec.reshard_default`, true at pp 1 and false under framework
torch with FSDP2 and pp > 1 (torchtitan's ``fsdp_reshard_after_forward = "default"`` is ``not
pp_enabled``). Before, the labels, the tie rule and compare took true as the default everywhere,
so under torch pp > 1 the rows kept gathered (what the plan of an unset config runs) were tagged
``keep gathered`` and lost near-ties to their resharded twins.

The space, by hand: the 8-layer model of tests/test_search.py on one dgx-h100 (8 GPUs), framework
torch, sharding zero3, recompute full, micro-batch 1, vpp 1, cp 1, pp 1 or 2, tp 1 or 4. Meshes
(world 8): dp_shard 8; dp_shard 2 x tp 4; pp 2 x dp_shard 4; pp 2 x tp 4 (dp_shard 1). The search
varies reshard_after_forward where FSDP2 shards over a data axis (dp_shard > 1): the first three
meshes twice (true first, ``space._flags``), pp 2 x tp 4 once with the neutral true, which gathers
nothing: 7 candidates.
"""

from __future__ import annotations

from meshplan.report.search import knobs
from meshplan.search.rank import decide, order_all
from meshplan.search.tie_key import simplicity
from meshplan.search.space import enumerate_candidates
from meshplan.units import GiB
from test_search import config

SPACE = dict(pp=[1, 2], tp=[1, 4], cp=[1], micro_batch=[1], recompute=["full"], sharding=["zero3"], vpp=[1],
             tp_comm_overlap=[False], uneven_stages=[False])


def _space():
    c = enumerate_candidates(config(1, 80.0, **SPACE))
    rows = {(int(c.pp[i]), int(c.dps[i]), int(c.tp[i]), int(c.rf[i])): i for i in range(len(c))}
    assert len(c) == len(rows) == 7
    return c, rows


def test_the_default_per_row_is_the_specs():
    """reshard_default per row from the spec's one rule: 1 at pp 1, 0 at pp 2 (torch, FSDP2); the
    rows without a data axis carry true and vary nothing."""
    c, rows = _space()
    assert sorted((k, int(c.reshard_default[i]), bool(c.reshard_varied[i])) for k, i in rows.items()) == [
        ((1, 2, 4, 0), 1, True), ((1, 2, 4, 1), 1, True), ((1, 8, 1, 0), 1, True), ((1, 8, 1, 1), 1, True),
        ((2, 1, 4, 1), 0, False), ((2, 4, 1, 0), 0, True), ((2, 4, 1, 1), 0, True)]


def test_the_row_off_its_default_is_tagged():
    """At pp 1 the row kept gathered is tagged, at pp 2 the resharded one; pp 2 x tp 4 (no data
    axis, true) is not tagged though true is off pp 2's default: it gathers nothing."""
    c, rows = _space()
    assert c.label(rows[1, 8, 1, 1]) == "dp_shard 8, mb 1, full, vpp 1, zero3"
    assert c.label(rows[1, 8, 1, 0]) == "dp_shard 8, mb 1, full, vpp 1, zero3, keep gathered"
    assert c.label(rows[2, 4, 1, 0]) == "pp 2 x dp_shard 4, mb 1, full, vpp 1, zero3"
    assert c.label(rows[2, 4, 1, 1]) == "pp 2 x dp_shard 4, mb 1, full, vpp 1, zero3, resharded"
    assert c.label(rows[2, 1, 4, 1]) == "pp 2 x tp 4, mb 1, full, vpp 1, zero3"
    # the knobs column of the top table, from the --json row's two fields
    row = {"tp_comm_overlap": False, "ends_short_stages": False}
    assert [knobs(row | {"reshard_after_forward": rf, "reshard_after_forward_default": d})
            for rf, d in ((True, False), (False, False), (False, True), (True, None))] == \
        ["resharded", "-", "keep gathered", "-"]


def test_near_ties_go_to_the_default_of_each_mesh():
    """Hand steps: each mesh's twin off its default is 0.5% faster (10.00 s against 10.05 s), peaks
    equal, so within the 1% band the count of settings off the default decides (recompute full is
    one of them on every row): pp 2 x dp_shard 4 kept gathered (1 setting) before resharded (2),
    dp_shard 8 resharded (1) before kept gathered (2). The meshes themselves are ordered by the mesh keys first: dp_shard 8 (1 axis) at 10.30 s
    is more than 1% behind 10.00 s and comes after the pp 2 pair."""
    c, rows = _space()
    pp2_kept, pp2_resh = rows[2, 4, 1, 0], rows[2, 4, 1, 1]
    pp1_kept, pp1_resh = rows[1, 8, 1, 0], rows[1, 8, 1, 1]
    steps = {pp2_resh: 10.00, pp2_kept: 10.05, pp1_kept: 10.30, pp1_resh: 10.35}
    assert order_all(c, steps) == [pp2_kept, pp2_resh, pp1_resh, pp1_kept]
    assert decide([10.00, 10.05], [simplicity(c, pp2_resh), simplicity(c, pp2_kept)], [GiB, GiB]) == (
        1, "fewer settings off their default (1 vs 2: full vs full, resharded)")
    assert decide([10.30, 10.35], [simplicity(c, pp1_kept), simplicity(c, pp1_resh)], [GiB, GiB]) == (
        1, "fewer settings off their default (1 vs 2: full vs full, kept gathered)")
    # the same step everywhere: the two defaults tie on the reshard position (kept gathered at pp 2,
    # resharded at pp 1), so only the mesh keys order them (dp_shard 8: 1 axis against 2)
    even = {i: 10.0 for i in (pp2_kept, pp1_resh)}
    assert order_all(c, even) == [pp1_resh, pp2_kept]
    # (1 setting off its default; recompute full's place in tie_key.RECOMPUTE_BY_COST, 5: none,
    # selective, op, layer, Megatron-LM's block, full; no tp overlap; vpp 1; ...)
    assert simplicity(c, pp2_kept)[3:] == simplicity(c, pp1_resh)[3:] == (1, 5, 0, 1, 0, 0, 0)
