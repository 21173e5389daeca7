"""Handed cases C1, C2, C3 and C5 (shared/cases/handed-cases.md): their rank lists as Layout tests.

Only the rank math is checked here (the node span with a local helper, C5's expert region as
a plain Layout built by hand). The tool's own verdicts are checked elsewhere: C3's placement
faults by meshplan.placement in test_placement.py (test_c3_*), C5's expert mesh as
resolve_mesh builds it and its "ep 3: reject" rule (dp_shard * cp * tp) % (ep * etp) == 0 in
test_expert_mesh.py, and every case through the CLI in test_handed_cli.py.
"""

from __future__ import annotations

from math import prod

import pytest

from meshplan.mesh.axes import from_megatron_order, to_megatron_order

BATCH_AXES = ("dp_replicate", "dp", "dp_shard")  # the axes whose product is the data-parallel degree
from meshplan.mesh.layout import Layout, check_partition


def layout_from_order(order: str, degrees: dict[str, int]) -> Layout:
    """Layout from a Megatron order string (fastest axis first) and degrees by name."""
    names = from_megatron_order(order)
    return Layout(names, tuple(degrees[n] for n in names))


def nodes_of(ranks, gpus_per_node=8) -> set[int]:
    """Nodes touched by a group when dense ranks are numbered node-major."""
    return {r // gpus_per_node for r in ranks}


# --------------------------------------------------------------------------- C1


@pytest.mark.parametrize("with_ep", [True, False], ids=["ep1-in-layout", "ep-left-out"])
def test_c1_context_parallel_is_its_own_coordinate(with_ep):
    """world 32, tp 1, pp 1, cp 16, dp 2, order tp-cp-ep-dp-pp."""
    order = "tp-cp-ep-dp-pp" if with_ep else "tp-cp-dp-pp"
    lay = layout_from_order(order, {"tp": 1, "cp": 16, "ep": 1, "dp": 2, "pp": 1})
    assert lay.names == (("pp", "dp", "ep", "cp", "tp") if with_ep else ("pp", "dp", "cp", "tp"))
    assert lay.world == 32
    assert lay.group_of(17, ("cp",)) == list(range(16, 32))
    assert lay.group_of(17, ("dp",)) == [1, 17]
    assert lay.groups(("cp",)).tolist() == [list(range(16)), list(range(16, 32))]
    assert lay.groups(("dp",)).shape == (16, 2)
    # Batch arithmetic uses the data-parallel degree only (cp excluded): 16 / (1 * 2) = 8.
    dp = prod(lay.degree(a) for a in BATCH_AXES)
    assert dp == 2
    global_batch, micro_batch = 16, 1
    assert global_batch % (micro_batch * dp) == 0
    assert global_batch // (micro_batch * dp) == 8


# --------------------------------------------------------------------------- C2

C2_DEGREES = {"tp": 1, "sp": 2, "pp": 2, "cfg": 2, "dp": 2}


def c2_layout() -> Layout:
    return layout_from_order("tp-sp-pp-cfg-dp", C2_DEGREES)


def test_c2_custom_order_strides():
    lay = c2_layout()
    assert lay.names == ("dp", "cfg", "pp", "sp", "tp")
    assert to_megatron_order(lay.names) == "tp-sp-pp-cfg-dp"
    assert lay.world == 16
    strides = dict(zip(lay.names, lay.strides))
    assert strides == {"tp": 1, "sp": 1, "pp": 2, "cfg": 4, "dp": 8}


def test_c2_group_lists():
    lay = c2_layout()
    assert lay.groups(("dp",)).shape == (8, 2)  # 8 groups of size 2
    assert lay.group_of(3, ("dp",)) == [3, 11]
    assert lay.group_of(9, ("cfg",)) == [9, 13]
    assert lay.group_of(1, ("pp",)) == [1, 3]
    assert lay.group_of(5, ("tp",)) == [5]


@pytest.mark.parametrize("axis", list(C2_DEGREES))
def test_c2_group_count_is_world_over_degree(axis):
    lay = c2_layout()
    table = lay.groups((axis,))
    assert table.shape == (lay.world // C2_DEGREES[axis], C2_DEGREES[axis])
    assert check_partition(table, lay.world) == []


def test_c2_flattened_groups_follow_the_same_order():
    """Every derived (flattened) group is spanned by the same strides as the single axes."""
    lay = c2_layout()
    strides = dict(zip(lay.names, lay.strides))
    assert lay.group_of(3, ("cfg", "dp")) == [3, 7, 11, 15]
    assert lay.group_of(0, ("pp", "sp")) == [0, 1, 2, 3]
    for a in lay.names:
        for b in lay.names:
            if a >= b:
                continue
            for r in range(lay.world):
                coords = dict(zip(lay.names, lay.coords_of(r)))
                base = r - coords[a] * strides[a] - coords[b] * strides[b]
                spanned = sorted(base + i * strides[a] + j * strides[b]
                                 for i in range(lay.degree(a)) for j in range(lay.degree(b)))
                assert lay.group_of(r, (a, b)) == spanned, (a, b, r)


# --------------------------------------------------------------------------- C3 (2 nodes x 8 GPUs)


def test_c3_tp_outside_pp_spans_both_nodes():
    """dp 1, tp 8, pp 2 with names (dp, tp, pp): TP(0) strides across nodes."""
    lay = Layout(("dp", "tp", "pp"), (1, 8, 2))
    tp0 = lay.group_of(0, ("tp",))
    assert tp0 == [0, 2, 4, 6, 8, 10, 12, 14]
    assert nodes_of(tp0) == {0, 1}  # the placement fault a checker must flag


def test_c3_pp_outermost_keeps_tp_in_a_node():
    lay = Layout(("pp", "dp", "tp"), (2, 1, 8))
    assert lay.group_of(0, ("tp",)) == list(range(8))
    assert nodes_of(lay.group_of(0, ("tp",))) == {0}
    assert lay.group_of(0, ("pp",)) == [0, 8]
    assert all(len(nodes_of(g)) == 1 for g in lay.groups(("tp",)).tolist())


def test_c3_dp2_tp4_pp2():
    lay = Layout(("pp", "dp", "tp"), (2, 2, 4))
    assert lay.group_of(0, ("tp",)) == [0, 1, 2, 3]
    assert lay.group_of(0, ("dp",)) == [0, 4]
    assert lay.group_of(0, ("pp",)) == [0, 8]


def test_c3_hsdp_shard_inside_a_node():
    lay = Layout(("dp_replicate", "dp_shard"), (2, 8))
    assert lay.group_of(9, ("dp_shard",)) == list(range(8, 16))
    assert nodes_of(lay.group_of(9, ("dp_shard",))) == {1}
    assert lay.group_of(9, ("dp_replicate",)) == [1, 9]


def test_c3_hsdp_swapped_names_shard_crosses_nodes():
    lay = Layout(("dp_shard", "dp_replicate"), (8, 2))
    shard = lay.group_of(9, ("dp_shard",))
    assert shard == [1, 3, 5, 7, 9, 11, 13, 15]
    assert nodes_of(shard) == {0, 1}  # every layer's all-gather crosses nodes: flag it
    assert all(nodes_of(g) == {0, 1} for g in lay.groups(("dp_shard",)).tolist())
    assert lay.group_of(9, ("dp_replicate",)) == [8, 9]


# --------------------------------------------------------------------------- C5

C5_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
C5_SHAPE = (1, 1, 2, 2, 2)


def test_c5_dense_groups():
    """world 8, dp_replicate 1, dp_shard 2, cp 2, tp 2, pp 1."""
    lay = Layout(C5_NAMES, C5_SHAPE)
    assert lay.world == 8
    assert lay.group_of(0, ("tp",)) == [0, 1]
    assert lay.group_of(0, ("cp",)) == [0, 2]
    assert lay.group_of(0, ("dp_shard",)) == [0, 4]
    assert lay.group_of(0, ("dp_shard", "cp")) == [0, 2, 4, 6]  # fsdp = dp_shard x cp
    assert lay.groups(("dp_shard", "cp")).tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("ep", [4, 8])
def test_c5_expert_region_as_a_layout(ep):
    """The expert region re-factors dp_shard * cp * tp = 8 as (efsdp, ep), ep fastest.
    Checked as plain rank math; validity of ep (8 % ep == 0) is not Layout's job."""
    dense = Layout(C5_NAMES, C5_SHAPE)
    region = prod(dense.degree(a) for a in ("dp_shard", "cp", "tp"))
    assert region % ep == 0
    expert = Layout(("pp", "dp_replicate", "efsdp", "ep"), (1, 1, region // ep, ep))
    assert expert.world == dense.world
    if ep == 4:
        assert expert.group_of(0, ("ep",)) == [0, 1, 2, 3]
        assert expert.group_of(5, ("ep",)) == [4, 5, 6, 7]
        assert expert.group_of(0, ("efsdp",)) == [0, 4]
    else:
        assert expert.groups(("ep",)).tolist() == [list(range(8))]
        assert expert.group_of(0, ("efsdp",)) == [0]
