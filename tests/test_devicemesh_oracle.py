"""torch DeviceMesh on the fake process group as the oracle for Layout's rank groups.

One process stands in for rank R of a W-rank job: ``init_process_group("fake", rank=R,
world_size=W)`` then ``init_device_mesh("cpu", shape, mesh_dim_names=names)``. For every axis
(and every flattened set of axes) the process group DeviceMesh gives rank R must be
``Layout(names, shape).group_of(R, axes)``, member for member and in the same order, and the
full group tables must be ``Layout.groups(axes)`` row for row.

Conventions checked against torch 2.13: DeviceMesh is row-major (last axis fastest), a
flattened axis lists its members with the innermost chosen axis fastest, and DeviceMesh only
slices axes given in mesh order (``mesh["tp", "dp"]`` raises) while Layout accepts any order
and canonicalises it.
"""

from __future__ import annotations

import itertools
import random

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the DeviceMesh oracle tests need torch.distributed")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not importable")
if not dist.is_available():  # pragma: no cover - builds without distributed support
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)
fake_pg = pytest.importorskip(
    "torch.testing._internal.distributed.fake_pg",
    reason="torch's fake process group (torch.testing._internal.distributed.fake_pg) is not importable",
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from meshplan.mesh.layout import Layout, check_partition  # noqa: E402

# torch 2.13 warns that slicing a flattened axis from the root mesh will be deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning")


# --------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture
def fake_mesh():
    """``make(names, shape, rank)`` -> DeviceMesh seen by ``rank`` on a fresh fake process group.

    Each call destroys the previous process group first; teardown destroys the last one."""

    def make(names, shape, rank):
        if dist.is_initialized():
            dist.destroy_process_group()
        world = 1
        for d in shape:
            world *= d
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
        return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def ranks_of(mesh) -> list[int]:
    """Rank list of a 1-D (sub)mesh's process group."""
    return [int(r) for r in dist.get_process_group_ranks(mesh.get_group())]


def subsets(names, min_size=1):
    """Every subset of ``names`` in mesh order (DeviceMesh requires ascending order)."""
    for k in range(min_size, len(names) + 1):
        yield from itertools.combinations(names, k)


def flat_name(axes) -> str:
    return "flat_" + "_".join(axes)


def all_groups(mesh_1d, name):
    """Every group of a 1-D (possibly flattened) DeviceMesh axis, as DeviceMesh enumerates them.

    Uses the private ``_get_all_submeshes`` (present in torch 2.13); skips if it is gone."""
    if not hasattr(mesh_1d, "_get_all_submeshes"):
        pytest.skip("DeviceMesh._get_all_submeshes is not in this torch version")
    return [s.mesh.tolist() for s in mesh_1d._get_all_submeshes(name)]


def probe_ranks(world: int, seed: int = 0) -> list[int]:
    """0, last, the middle pair and a few fixed pseudo-random ranks."""
    rng = random.Random(seed * 7919 + world)
    picks = {0, world - 1, world // 2 - 1, world // 2, 1 % world}
    picks.update(rng.randrange(world) for _ in range(3))
    return sorted(r for r in picks if 0 <= r < world)


def check_rank_view(mesh, lay: Layout, rank: int, flatten: bool = True) -> None:
    """Everything DeviceMesh says about ``rank``'s groups equals Layout's rank math."""
    names = lay.names
    assert mesh.mesh.tolist() == lay.grid().tolist()
    assert tuple(mesh.shape) == tuple(lay.shape)
    coords = lay.coords_of(rank)
    assert tuple(mesh.get_coordinate()) == coords
    for i, name in enumerate(names):
        expect = lay.group_of(rank, (name,))
        assert ranks_of(mesh[name]) == expect, f"axis {name} at rank {rank}"
        assert mesh[name].mesh.tolist() == expect
        assert mesh.get_local_rank(name) == coords[i]
        assert len(expect) == lay.shape[i]
    if not flatten:
        return
    for axes in subsets(names, min_size=2):
        expect = lay.group_of(rank, axes)
        sub = mesh[axes]
        # The sub-mesh view: the chosen axes' block that holds ``rank``, in mesh order.
        assert sub.mesh.reshape(-1).tolist() == expect, f"sub-mesh {axes} at rank {rank}"
        assert tuple(sub.mesh.shape) == tuple(lay.degree(a) for a in axes)
        flat = sub._flatten(flat_name(axes))
        assert ranks_of(flat) == expect, f"flattened {axes} at rank {rank}"
        assert flat.get_local_rank() == expect.index(rank)


def assert_group_index(lay: Layout, axes, rows) -> None:
    """Layout.group_index of every member of DeviceMesh's i-th group is i."""
    for i, row in enumerate(rows):
        assert {lay.group_index(r, axes) for r in row} == {i}, f"group_index of {axes}, row {i}"


def check_tables(mesh, lay: Layout, flatten: bool = True) -> None:
    """Full group tables (every group of every axis and flattened axis set) equal Layout.groups."""
    for name in lay.names:
        table = lay.groups((name,))
        rows = all_groups(mesh, name)
        assert rows == table.tolist(), f"groups of {name}"
        assert_group_index(lay, (name,), rows)
        assert not check_partition(table, lay.world)
    if not flatten:
        return
    for axes in subsets(lay.names, min_size=2):
        flat = mesh[axes]._flatten(flat_name(axes))
        table = lay.groups(axes)
        rows = all_groups(flat, flat_name(axes))
        assert rows == table.tolist(), f"groups of flattened {axes}"
        assert_group_index(lay, axes, rows)
        assert not check_partition(table, lay.world)


# --------------------------------------------------------------------------- meshes

MESHES_64 = [
    (("dp_shard", "tp"), (8, 8)),
    (("tp", "dp_shard"), (8, 8)),  # same degrees, swapped order
    (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 4, 2, 2)),
    (("tp", "cp", "dp_shard", "dp_replicate", "pp"), (2, 2, 4, 2, 2)),  # reversed order
    (("dp_replicate", "dp_shard", "cp", "tp"), (2, 4, 1, 8)),  # a 1-degree axis
    (("pp", "dp", "tp"), (1, 64, 1)),  # two 1-degree axes around the whole world
    (("dp_shard",), (64,)),  # one axis: its group is the default group
    (("dp", "cfg", "pp", "sp", "tp"), (2, 2, 2, 4, 2)),  # user-named axes (cfg, sp)
]

MESHES_128 = [
    (("pp", "dp_shard", "tp"), (2, 8, 8)),
    (("dp_replicate", "dp_shard", "cp", "tp"), (2, 4, 4, 4)),
    (("tp", "cp", "dp_shard"), (4, 2, 16)),
    (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 1, 8, 2, 4)),
]

MESHES_1024 = [
    (("pp", "dp_shard", "tp"), (4, 32, 8)),
    (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (4, 2, 8, 2, 8)),
    (("tp", "cp", "dp_shard", "dp_replicate", "pp"), (8, 2, 8, 2, 4)),
    (("pp", "dp_replicate", "dp_shard", "tp"), (8, 1, 16, 8)),
    (("dp_shard", "tp"), (1024, 1)),
]


def _mesh_id(m):
    names, shape = m
    return "x".join(f"{n}{d}" for n, d in zip(names, shape))


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("names,shape", MESHES_64, ids=[_mesh_id(m) for m in MESHES_64])
def test_every_rank_of_64_rank_meshes(fake_mesh, names, shape):
    """World 64: every rank's groups, sub-meshes and flattened groups equal Layout's."""
    lay = Layout(names, shape)
    for rank in range(lay.world):
        check_rank_view(fake_mesh(names, shape, rank), lay, rank)


@pytest.mark.parametrize("names,shape", MESHES_64, ids=[_mesh_id(m) for m in MESHES_64])
def test_group_tables_of_64_rank_meshes_from_public_api(fake_mesh, names, shape):
    """World 64, public API only: the distinct groups seen by all 64 ranks are Layout.groups."""
    lay = Layout(names, shape)
    seen: dict[tuple, set] = {}
    for rank in range(lay.world):
        mesh = fake_mesh(names, shape, rank)
        for axes in subsets(names):
            g = ranks_of(mesh[axes[0]] if len(axes) == 1 else mesh[axes]._flatten(flat_name(axes)))
            seen.setdefault(axes, set()).add(tuple(g))
    for axes, groups in seen.items():
        table = lay.groups(axes)
        assert sorted(groups) == sorted(tuple(row) for row in table.tolist()), f"groups of {axes}"
        assert len(groups) == lay.world // table.shape[1]


@pytest.mark.parametrize("names,shape", MESHES_64 + MESHES_128 + MESHES_1024,
                         ids=[_mesh_id(m) for m in MESHES_64 + MESHES_128 + MESHES_1024])
def test_full_group_tables(fake_mesh, names, shape):
    """Every group of every axis and flattened axis set, in DeviceMesh's row order."""
    lay = Layout(names, shape)
    check_tables(fake_mesh(names, shape, lay.world - 1), lay)


@pytest.mark.parametrize("names,shape", MESHES_128 + MESHES_1024, ids=[_mesh_id(m) for m in MESHES_128 + MESHES_1024])
def test_probe_ranks_of_large_meshes(fake_mesh, names, shape):
    """World 128 and 1024: rank 0, the last rank and some middle ranks."""
    lay = Layout(names, shape)
    for rank in probe_ranks(lay.world):
        check_rank_view(fake_mesh(names, shape, rank), lay, rank)


@pytest.mark.parametrize("rank", [0, 5, 17, 42, 63])
def test_named_flattened_axes(fake_mesh, rank):
    """The flattened axes torchtitan builds: fsdp = dp_shard x cp, dp = dp_replicate x dp_shard,
    dp_cp = dp_replicate x dp_shard x cp (cp fastest inside each)."""
    names, shape = ("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 4, 2, 2)
    lay = Layout(names, shape)
    mesh = fake_mesh(names, shape, rank)
    for fname, axes in [("fsdp", ("dp_shard", "cp")), ("dp", ("dp_replicate", "dp_shard")),
                        ("dp_cp", ("dp_replicate", "dp_shard", "cp"))]:
        flat = mesh[axes]._flatten(fname)
        assert ranks_of(flat) == lay.group_of(rank, axes)
        # The root mesh can be sliced by the flattened name as well.
        assert ranks_of(mesh[fname]) == lay.group_of(rank, axes)
        assert all_groups(flat, fname) == lay.groups(axes).tolist()


def test_seed_example_rank_29(fake_mesh):
    """layout.py's docstring example, checked against DeviceMesh."""
    mesh = fake_mesh(("dp_shard", "tp"), (8, 8), 29)
    assert ranks_of(mesh["tp"]) == [24, 25, 26, 27, 28, 29, 30, 31]
    assert ranks_of(mesh["dp_shard"]) == [5, 13, 21, 29, 37, 45, 53, 61]
    assert tuple(mesh.get_coordinate()) == (3, 5)


def test_layout_accepts_any_axis_order_devicemesh_requires_mesh_order(fake_mesh):
    """Layout canonicalises the order of ``axes``; DeviceMesh refuses a slice out of mesh order.
    The group is the same either way."""
    names, shape = ("dp_shard", "cp", "tp"), (4, 2, 8)
    lay = Layout(names, shape)
    mesh = fake_mesh(names, shape, 37)
    assert lay.group_of(37, ("cp", "dp_shard")) == lay.group_of(37, ("dp_shard", "cp"))
    assert lay.group_of(37, ("cp", "dp_shard")) == ranks_of(mesh["dp_shard", "cp"]._flatten("fsdp"))
    with pytest.raises(KeyError):
        mesh["cp", "dp_shard"]


def _compositions(n: int):
    """Ordered factorizations of ``n`` into factors >= 2 (all of them)."""
    if n == 1:
        yield ()
        return
    for d in range(2, n + 1):
        if n % d == 0:
            for rest in _compositions(n // d):
                yield (d,) + rest


@pytest.mark.parametrize("world", [64, 128])
def test_every_ordered_factorization(fake_mesh, world):
    """Every ordered factorization of the world into degrees >= 2 (up to 5 axes): per-axis
    groups at probe ranks and flattened tables of adjacent axis pairs equal Layout's."""
    shapes = [s for s in _compositions(world) if len(s) <= 5]
    assert len(shapes) > 30
    for shape in shapes:
        names = tuple(f"a{i}" for i in range(len(shape)))
        lay = Layout(names, shape)
        for rank in probe_ranks(world, seed=len(shape)):
            check_rank_view(fake_mesh(names, shape, rank), lay, rank, flatten=False)
        mesh = fake_mesh(names, shape, 0)
        check_tables(mesh, lay, flatten=False)
        for axes in zip(names, names[1:]):
            flat = mesh[axes]._flatten(flat_name(axes))
            assert all_groups(flat, flat_name(axes)) == lay.groups(axes).tolist()
