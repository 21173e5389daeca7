"""Handed case C5: expert parallel re-factors the dense dp_shard x cp x tp block."""

import pytest

from meshplan.mesh.layout import check_partition
from meshplan.mesh.resolve import Infeasible, resolve_mesh
from meshplan.spec.mesh import MeshSpec

NAMES = ["dp_replicate", "dp_shard", "cp", "tp", "ep"]


def c5(ep):
    return resolve_mesh(MeshSpec(names=NAMES, shape=[1, 2, 2, 2, ep]), world=8)


def test_ep4_groups():
    m = c5(4)
    assert m.group_of(0, "ep") == [0, 1, 2, 3]
    assert m.group_of(5, "ep") == [4, 5, 6, 7]
    assert m.group_of(0, "efsdp") == [0, 4]
    assert m.degree("efsdp") == 2
    # dense groups on the same ranks
    assert m.group_of(0, "tp") == [0, 1]
    assert m.group_of(0, "cp") == [0, 2]
    assert m.group_of(0, "dp_shard") == [0, 4]
    assert m.group_of(0, "fsdp") == [0, 2, 4, 6]
    assert "efsdp = dp_shard(2) * cp(2) * tp(2) / (ep 4 * etp 1) = 2" in m.derivation


def test_ep8_one_group():
    m = c5(8)
    assert m.groups("ep").tolist() == [list(range(8))]


def test_ep3_rejected_with_rule():
    m = c5(3)
    assert isinstance(m, Infeasible)
    assert "(dp_shard * cp * tp) % (ep * etp) == 0" in m.reasons[0]
    assert "ep(3) * etp(1) = 3 does not divide dp_shard(2) * cp(2) * tp(2) = 8" in m.reasons[0]


@pytest.mark.parametrize("ep,etp", [(2, 1), (2, 2), (4, 2), (8, 1)])
def test_expert_axes_partition_ranks(ep, etp):
    m = resolve_mesh(MeshSpec(names=["pp", "dp_shard", "tp", "ep", "etp"], shape=[2, 4, 2, ep, etp]), world=16)
    for axis in ("ep", "etp", "efsdp"):
        assert check_partition(m.groups(axis), 16) == []
    if etp == 2:  # etp = tp: expert-tensor groups are the tp groups
        assert sorted(map(sorted, m.groups("etp").tolist())) == sorted(map(sorted, m.groups("tp").tolist()))


def test_expert_mesh_keeps_pp_outside():
    m = resolve_mesh(MeshSpec(names=["pp", "dp_shard", "tp", "ep"], shape=[2, 2, 2, 4]), world=8)
    assert m.group_of(0, "ep") == [0, 1, 2, 3]
    assert m.group_of(6, "ep") == [4, 5, 6, 7]
