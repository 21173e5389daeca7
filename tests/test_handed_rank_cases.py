"""Handed cases C1, C2, C3 and C5 (shared/cases/handed-cases.md): their rank lists as Layout tests.

The rank math is checked on Layout (the node span with a local helper); C1's micro-batches
and C5's expert region are the tool's own values (resolve_mesh, mesh.validity.check) against
the case text. Elsewhere: C3's placement faults by meshplan.placement in test_placement.py
(test_c3_*), C5's derivation lines in test_expert_mesh.py, and every case through the CLI in
test_handed_cli.py.
"""

from __future__ import annotations

import pytest

from meshplan.mesh.axes import from_megatron_order, to_megatron_order
from meshplan.mesh.layout import Layout, check_partition
from meshplan.mesh.resolve import Infeasible, resolve_mesh
from meshplan.mesh.validity import check
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec

#: C1 gives no model: any whose layers and heads pass the rules at tp 1, pp 1
C1_MODEL = ModelSpec(layers=4, hidden=1024, ffn=4096, q_heads=16, vocab=32000)


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
    # the tool's mesh of the same order and degrees: the same groups, and its batch rule's value
    # (meshplan.spec.axes.dp: dp = replicate x shard, cp excluded): 16 / (1 * 2) = 8 micro-batches,
    # a global batch of 16 valid although no multiple of the world 32
    spec = MeshSpec(order=order, degrees={n: lay.degree(n) for n in lay.names})
    mesh = resolve_mesh(spec, world=32)
    assert mesh.groups("cp").tolist() == lay.groups(("cp",)).tolist() and mesh.group_of(17, "dp") == [1, 17]
    v = check(C1_MODEL, TrainingSpec(global_batch=16, micro_batch=1, seq_len=1024), mesh, spec)
    assert (v.reasons, v.micro_batches) == ((), 8)
    assert ("micro-batches per step = global_batch 16 / (micro_batch 1 * dp 2) = 8 (dp = replicate x shard, "
            "cp excluded)") in v.notes


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


def c5_expert_mesh(ep: int):
    """meshplan's mesh of C5 with ``ep``: resolve_mesh re-factors dp_shard x cp x tp into
    (efsdp, ep), or returns Infeasible."""
    return resolve_mesh(MeshSpec(names=list(C5_NAMES) + ["ep"], shape=list(C5_SHAPE) + [ep]), world=8)


@pytest.mark.parametrize("ep", [4, 8, 3])
def test_c5_expert_region_of_the_tool(ep):
    """C5's expected expert groups, every one of them, in meshplan's own expert mesh: ep 4 gives
    EP groups [0..3], [4..7] (EP(5) = [4,5,6,7]) and efsdp = 8 / 4 = 2 groups {r, r + 4}
    (efsdp(0) = [0, 4]); ep 8 one EP group [0..7] and efsdp 1; ep 3 rejected by the rule
    (dp_shard * cp * tp) % ep == 0 (8 % 3 = 2). The dense groups stay the ones above."""
    m = c5_expert_mesh(ep)
    if ep == 3:
        assert isinstance(m, Infeasible)
        assert m.reasons[0].startswith("ep(3) * etp(1) = 3 does not divide dp_shard(2) * cp(2) * tp(2) = 8")
        return
    want_ep = {4: [[0, 1, 2, 3], [4, 5, 6, 7]], 8: [list(range(8))]}[ep]
    want_efsdp = {4: [[0, 4], [1, 5], [2, 6], [3, 7]], 8: [[r] for r in range(8)]}[ep]
    assert sorted(m.groups("ep").tolist()) == want_ep and m.group_of(5, "ep") == want_ep[-1]
    assert sorted(m.groups("efsdp").tolist()) == want_efsdp and m.degree("efsdp") == 8 // ep
    dense = Layout(C5_NAMES, C5_SHAPE)
    for axes, name in ((("tp",), "tp"), (("cp",), "cp"), (("dp_shard",), "dp_shard"), (("dp_shard", "cp"), "fsdp")):
        assert m.groups(name).tolist() == dense.groups(axes).tolist(), name
