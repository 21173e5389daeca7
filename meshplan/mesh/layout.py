"""Rank math: coordinates, ranks and process groups of a named mesh.

A :class:`Layout` is a frozen (names, shape) pair in canonical order (outermost first, as
torch DeviceMesh); strides are row-major. Every group follows from it: the ranks that differ
only along the chosen axes. This is the algorithm of Megatron-Core's
``generate_masked_orthogonal_rank_groups`` and picotron's ``arange(world).view(...)``.

Worked example (the seed's mesh, data 8 x tensor 8):

>>> lay = Layout(names=("dp_shard", "tp"), shape=(8, 8))
>>> lay.coords_of(29)
(3, 5)
>>> lay.group_of(29, ("tp",))
[24, 25, 26, 27, 28, 29, 30, 31]
>>> lay.group_of(29, ("dp_shard",))
[5, 13, 21, 29, 37, 45, 53, 61]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod

import numpy as np

from meshplan.mesh.axes import check_unique_axes
from meshplan.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """Named mesh shape, outermost axis first.

    ``names``: axis names, unique. ``shape``: degrees, each >= 1.
    Raises ConfigError if lengths differ, a name repeats or a degree is < 1.
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self):
        if len(self.names) != len(self.shape):
            raise ConfigError("mesh", f"{len(self.names)} names but {len(self.shape)} degrees; give one degree per axis")
        check_unique_axes(self.names, "mesh.names")
        for n, d in zip(self.names, self.shape):
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
                raise ConfigError(f"mesh.{n}", f"degree {d} must be an integer >= 1")

    @property
    def world(self) -> int:
        """Number of ranks: the product of the degrees."""
        return prod(self.shape)

    @cached_property
    def strides(self) -> tuple[int, ...]:
        """Row-major strides: the last axis has stride 1.

        >>> Layout(("pp", "cfg", "dp", "sp", "tp"), (2, 2, 2, 2, 1)).strides
        (8, 4, 2, 1, 1)
        """
        out, s = [], 1
        for d in reversed(self.shape):
            out.append(s)
            s *= d
        return tuple(reversed(out))

    def degree(self, name: str, default: int = 1) -> int:
        """Degree of axis ``name``, or ``default`` if the mesh has no such axis."""
        return self.shape[self.names.index(name)] if name in self.names else default

    def axis_indices(self, axes) -> list[int]:
        """Sorted mesh positions of ``axes`` (an iterable of names, not a bare string).
        Raises ConfigError on an unknown or repeated name."""
        if isinstance(axes, str):
            raise ConfigError("axes", f"give a tuple of axis names, e.g. ({axes!r},), not a string")
        axes = tuple(axes)
        check_unique_axes(axes, "axes")
        return sorted(self.index(a) for a in axes)

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ConfigError("mesh", f"no axis {name!r}; axes are {list(self.names)}") from None

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank``, one per axis. Raises ConfigError if out of range."""
        self._check_rank(rank)
        return tuple(int(c) for c in np.unravel_index(rank, self.shape))

    def rank_of(self, coords) -> int:
        """Rank at ``coords`` (one index per axis, each in range)."""
        if len(coords) != len(self.shape):
            raise ConfigError("coords", f"{len(coords)} coordinates for {len(self.shape)} axes")
        for n, c, d in zip(self.names, coords, self.shape):
            if not 0 <= c < d:
                raise ConfigError("coords", f"{n}={c} outside 0..{d - 1}")
        return int(sum(c * s for c, s in zip(coords, self.strides)))

    def grid(self) -> np.ndarray:
        """``arange(world)`` viewed as the mesh shape."""
        return np.arange(self.world, dtype=np.int64).reshape(self.shape)

    def groups(self, axes) -> np.ndarray:
        """All groups of the (flattened) axes ``axes``: array (world // size, size).

        Members vary along ``axes``, ordered as the axes are ordered in the mesh (outermost
        first), so a flattened group ``fsdp = dp_shard x cp`` has cp fastest. Row i is the
        group whose other coordinates have linear index i (outermost first).

        >>> Layout(("dp", "cp", "tp"), (2, 2, 2)).groups(("dp", "cp")).tolist()
        [[0, 2, 4, 6], [1, 3, 5, 7]]
        """
        return grid_groups(self.grid(), self.axis_indices(axes))

    def group_of(self, rank: int, axes) -> list[int]:
        """The group of ``axes`` that contains ``rank``, as a rank list."""
        coords = list(self.coords_of(rank))
        idx = self.axis_indices(axes)
        sub = self.grid()[tuple(slice(None) if i in idx else coords[i] for i in range(len(coords)))]
        return [int(r) for r in sub.reshape(-1)]

    def group_index(self, rank: int, axes) -> int:
        """Row of :meth:`groups` that holds ``rank``."""
        coords = self.coords_of(rank)
        idx = set(self.axis_indices(axes))
        lin = 0
        for i, (c, d) in enumerate(zip(coords, self.shape)):
            if i not in idx:
                lin = lin * d + c
        return lin

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise ConfigError("rank", f"{rank!r} is not an integer rank")
        if not 0 <= rank < self.world:
            raise ConfigError("rank", f"{rank} outside 0..{self.world - 1}")


def grid_groups(grid: np.ndarray, idx) -> np.ndarray:
    """Groups of a rank ``grid`` (any n-d array of ranks) along its dimensions ``idx``
    (sorted positions): array (grid.size // size, size), members ordered as the dimensions
    (outermost first), rows by the other dimensions' linear index. The one group rule of
    :meth:`Layout.groups` and of the expert mesh (:meth:`meshplan.mesh.resolve.Mesh.groups`).

    >>> grid_groups(np.arange(8).reshape(2, 2, 2), [0, 2]).tolist()
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    idx = sorted(idx)
    rest = [i for i in range(grid.ndim) if i not in idx]
    size = prod(grid.shape[i] for i in idx)
    return grid.transpose(rest + idx).reshape(-1, size)


def check_partition(groups: np.ndarray, world: int) -> list[str]:
    """Problems with ``groups`` as a partition of ``range(world)``: empty list if every rank
    appears in exactly one group. Used to check each axis and each flattened axis."""
    flat = np.asarray(groups).reshape(-1)
    problems = []
    if flat.size != world:
        problems.append(f"groups cover {flat.size} slots for {world} ranks")
    counts = np.bincount(flat, minlength=world)
    if (counts > 1).any():
        problems.append(f"ranks in more than one group: {np.flatnonzero(counts > 1)[:8].tolist()}")
    if (counts == 0).any():
        problems.append(f"ranks in no group: {np.flatnonzero(counts == 0)[:8].tolist()}")
    return problems
