"""Property tests of Layout's rank math, plus its input errors.

For random meshes (1-5 axes, degrees 1-8, random unique names): coordinates and ranks
round-trip; for every subset of axes the groups partition the world, have the product of
the chosen degrees as size, agree with ``group_of``/``group_index``, and their members differ
only in the chosen axes' coordinates (every combination once, ascending rank order).
"""

from __future__ import annotations

import itertools
from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import ConfigError
from meshplan.mesh.layout import Layout, check_partition

NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


@st.composite
def layouts(draw, max_axes=5, max_degree=8):
    n = draw(st.integers(1, max_axes))
    names = draw(st.lists(NAME, min_size=n, max_size=n, unique=True))
    shape = draw(st.lists(st.integers(1, max_degree), min_size=n, max_size=n))
    return Layout(tuple(names), tuple(shape))


def all_subsets(names):
    for k in range(len(names) + 1):
        yield from itertools.combinations(names, k)


def probe_ranks(lay: Layout, data, limit=256):
    """Every rank for a small world; else 0, the last and some drawn ranks."""
    if lay.world <= limit:
        return range(lay.world)
    drawn = data.draw(st.lists(st.integers(0, lay.world - 1), min_size=1, max_size=24), label="ranks")
    return sorted({0, lay.world - 1, *drawn})


# --------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(lay=layouts())
def test_coords_rank_round_trip_for_every_rank(lay):
    assert lay.world == prod(lay.shape)
    assert lay.strides[-1] == 1
    coords_all = []
    for r in range(lay.world):
        c = lay.coords_of(r)
        assert len(c) == len(lay.shape)
        assert all(0 <= ci < d for ci, d in zip(c, lay.shape))
        assert lay.rank_of(c) == r
        assert r == sum(ci * s for ci, s in zip(c, lay.strides))
        coords_all.append(c)
    # Row-major: ranks in order visit coordinates in lexicographic order (last axis fastest).
    assert coords_all == list(itertools.product(*(range(d) for d in lay.shape)))


@settings(max_examples=150, deadline=None)
@given(lay=layouts())
def test_groups_partition_world_for_every_axis_subset(lay):
    coords = np.stack(np.unravel_index(np.arange(lay.world), lay.shape), axis=-1)  # (world, n)
    for axes in all_subsets(lay.names):
        table = np.asarray(lay.groups(axes))
        size = prod(lay.degree(a) for a in axes)
        assert table.shape == (lay.world // size, size), axes
        assert check_partition(table, lay.world) == [], axes
        chosen = [lay.index(a) for a in axes]
        rest = [i for i in range(len(lay.names)) if i not in chosen]
        member_coords = coords[table]  # (groups, size, n)
        # Members differ only in the chosen axes ...
        assert (member_coords[:, :, rest] == member_coords[:, :1, rest]).all(), axes
        # ... and take every combination of the chosen coordinates exactly once.
        for g in member_coords:
            assert len({tuple(c) for c in g[:, chosen]}) == size
        # Members are listed in mesh order (last chosen axis fastest) -> ascending ranks;
        # rows are ordered by the other coordinates (outermost first) -> ascending first ranks.
        assert (np.diff(table, axis=1) > 0).all()
        assert (np.diff(table[:, 0]) > 0).all()


@settings(max_examples=150, deadline=None)
@given(lay=layouts(), data=st.data())
def test_group_of_is_the_groups_row_at_group_index(lay, data):
    subsets = list(all_subsets(lay.names))
    tables = {axes: np.asarray(lay.groups(axes)) for axes in subsets}
    for r in probe_ranks(lay, data):
        for axes in subsets:
            g = lay.group_of(r, axes)
            assert r in g
            assert g == tables[axes][lay.group_index(r, axes)].tolist(), (r, axes)
            # Membership is the chosen axes only: the same group from every member.
            assert lay.group_of(g[-1], axes) == g
            # The order in which the axes are given does not matter.
            assert lay.group_of(r, tuple(reversed(axes))) == g
        assert lay.group_of(r, ()) == [r]
        assert lay.group_of(r, lay.names) == list(range(lay.world))


@settings(max_examples=100, deadline=None)
@given(lay=layouts(max_axes=4), data=st.data())
def test_group_index_counts_groups_in_row_order(lay, data):
    for axes in all_subsets(lay.names):
        n_groups = lay.world // prod(lay.degree(a) for a in axes)
        idx = {lay.group_index(r, axes) for r in probe_ranks(lay, data)}
        assert idx <= set(range(n_groups))
        if lay.world <= 256:
            assert idx == set(range(n_groups))


# --------------------------------------------------------------------------- input errors


def check_config_error(excinfo, field, *words):
    """The ConfigError names ``field`` (as its field and message prefix), is one line, and
    mentions each of ``words``."""
    err = excinfo.value
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: ")
    assert "\n" not in str(err)
    for w in words:
        assert str(w) in str(err), (w, str(err))


def test_repeated_name_is_rejected():
    with pytest.raises(ConfigError) as ei:
        Layout(("dp", "tp", "tp"), (2, 2, 2))
    check_config_error(ei, "mesh.names", "'tp'", "twice")


@pytest.mark.parametrize("bad", [0, -1, -4])
def test_degree_below_one_is_rejected_naming_the_axis(bad):
    with pytest.raises(ConfigError) as ei:
        Layout(("dp", "tp"), (2, bad))
    check_config_error(ei, "mesh.tp", bad, ">= 1")


def test_non_integer_degree_is_rejected():
    with pytest.raises(ConfigError) as ei:
        Layout(("dp", "tp"), (2.5, 2))
    check_config_error(ei, "mesh.dp", "2.5")


@pytest.mark.parametrize("names,shape", [(("dp", "tp"), (2,)), (("dp",), (2, 4)), ((), (8,))])
def test_mismatched_lengths_are_rejected(names, shape):
    with pytest.raises(ConfigError) as ei:
        Layout(names, shape)
    check_config_error(ei, "mesh", f"{len(names)} names", f"{len(shape)} degrees")


@pytest.mark.parametrize("rank", [-1, 8, 9, 1000])
def test_rank_out_of_range_is_rejected(rank):
    lay = Layout(("dp", "tp"), (2, 4))
    with pytest.raises(ConfigError) as ei:
        lay.coords_of(rank)
    check_config_error(ei, "rank", rank, "0..7")
    with pytest.raises(ConfigError) as ei:
        lay.group_of(rank, ("tp",))
    check_config_error(ei, "rank", rank, "0..7")
    with pytest.raises(ConfigError) as ei:
        lay.group_index(rank, ("dp",))
    check_config_error(ei, "rank", rank, "0..7")


def test_unknown_axis_is_rejected():
    lay = Layout(("dp", "tp"), (2, 4))
    with pytest.raises(ConfigError) as ei:
        lay.group_of(0, ("cp",))
    check_config_error(ei, "mesh", "'cp'", "dp", "tp")
    with pytest.raises(ConfigError) as ei:
        lay.groups(("cp",))
    check_config_error(ei, "mesh", "'cp'")


@pytest.mark.parametrize("coords,words", [((0,), ["1 coordinates", "2 axes"]), ((2, 0), ["dp=2", "0..1"]),
                                          ((0, -1), ["tp=-1", "0..3"])])
def test_bad_coordinates_are_rejected(coords, words):
    with pytest.raises(ConfigError) as ei:
        Layout(("dp", "tp"), (2, 4)).rank_of(coords)
    check_config_error(ei, "coords", *words)


def test_axes_misuse_is_config_error():
    from meshplan.errors import ConfigError
    from meshplan.mesh.layout import Layout

    lay = Layout(("a", "b"), (2, 2))
    with pytest.raises(ConfigError, match="axes: axis 'a' appears twice"):
        lay.groups(("a", "a"))
    with pytest.raises(ConfigError, match="not a string"):
        lay.group_of(1, "ab")
    with pytest.raises(ConfigError, match=r"mesh\.a"):
        Layout(("a",), (True,))
    with pytest.raises(ConfigError, match="not an integer rank"):
        lay.coords_of(2.5)
