"""Resolve a :class:`~meshplan.spec.mesh.MeshSpec` against a world size into a :class:`Mesh`:
degrees (with -1 inferred), the dense layout, the expert mesh and the derived
(flattened) axes, each with the arithmetic that produced it.

Derived axes (torchtitan ``ParallelDims`` names):

======== ========================================= ===========================
dp       dp_replicate x dp_shard (x dp)            gradient reduction, batch
fsdp     dp_shard (or dp) x cp                     parameter/optimizer sharding
batch    same as dp                                data loading
loss     dp x cp                                   loss all-reduce
======== ========================================= ===========================

Expert mesh: the dense block ``B = (dp_shard or dp) x cp x tp`` (in mesh order) is
re-factored as ``(efsdp, ep, etp)`` with etp fastest; the rule is ``B % (ep*etp) == 0``
(torchtitan ParallelDims; Megatron-Core's expert decomposition ``tp-ep-dp-pp``).

>>> from meshplan.spec.mesh import MeshSpec
>>> m = resolve_mesh(MeshSpec(names=["dp_replicate", "dp_shard", "cp", "tp", "ep"],
...                           shape=[1, 2, 2, 2, 4]), world=8)
>>> m.group_of(0, "ep"), m.group_of(5, "ep"), m.group_of(0, "efsdp"), m.group_of(0, "fsdp")
([0, 1, 2, 3], [4, 5, 6, 7], [0, 4], [0, 2, 4, 6])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Optional, Union

import numpy as np

from meshplan.mesh.axes import EXPERT_AXES, from_megatron_order, to_megatron_order
from meshplan.errors import ConfigError
from meshplan.mesh.layout import Layout, grid_groups
from meshplan.mesh.world_fix import Checker, infer_fix, world_fix
from meshplan.spec.mesh import MeshSpec

#: Derived axis name -> constituent axes (those present in the mesh are used).
DERIVED = {
    "dp": ("dp_replicate", "dp", "dp_shard"),
    "fsdp": ("dp", "dp_shard", "cp"),
    "batch": ("dp_replicate", "dp", "dp_shard"),
    "loss": ("dp_replicate", "dp", "dp_shard", "cp"),
}
_BLOCK = ("dp", "dp_shard", "cp", "tp")
#: The dense block ep x etp re-factors (:attr:`Mesh.block_size`), public for the world-size fixes of validate.
BLOCK_AXES = _BLOCK


@dataclass(frozen=True)
class Infeasible:
    """A mesh that cannot be built, with one-line reasons naming the numbers."""

    reasons: tuple[str, ...]
    derivation: tuple[str, ...] = ()

    @property
    def feasible(self) -> bool:
        return False


@dataclass(frozen=True)
class Mesh:
    """A resolved mesh. ``layout``: dense axes (ep/etp removed); ``ep``, ``etp``: expert
    degrees; ``derivation``: how each degree was obtained, as printable lines; ``user_names``:
    :attr:`given_names`."""

    layout: Layout
    ep: int = 1
    etp: int = 1
    derivation: tuple[str, ...] = ()
    sequence_parallel: bool = False
    _expert: tuple = field(default=(), compare=False, repr=False)
    user_names: tuple[str, ...] = field(default=(), compare=False)

    feasible = True

    @property
    def world(self) -> int:
        return self.layout.world

    def degree(self, axis: str) -> int:
        """Degree of a mesh axis, a derived axis or an expert axis (1 if absent)."""
        if axis == "ep":
            return self.ep
        if axis == "etp":
            return self.etp
        if axis == "efsdp":
            return self.block_size // (self.ep * self.etp)
        if axis in DERIVED and axis not in self.layout.names:
            return prod(self.layout.degree(a) for a in self.axes_of(axis))
        return self.layout.degree(axis)

    @property
    def block_size(self) -> int:
        return prod(self.layout.degree(a) for a in _BLOCK)

    @property
    def block_expr(self) -> str:
        """The dense block ep * etp re-factors, as its axes: ``dp_shard(32) * tp(2)``."""
        return " * ".join(f"{a}({self.layout.degree(a)})" for a in self.layout.names if a in _BLOCK)

    @property
    def dp(self) -> int:
        """Data-parallel degree for batch arithmetic (replicate x shard, without cp)."""
        return self.degree("dp")

    def axes_of(self, name: str) -> tuple[str, ...]:
        """Mesh axes a (possibly derived) axis name stands for, in mesh order."""
        if name in self.layout.names:
            return (name,)
        if name in DERIVED:
            return tuple(a for a in self.layout.names if a in DERIVED[name])
        raise ConfigError("axis", f"no axis {name!r}; axes are {self.all_axes()}")

    def display_name(self, name: str) -> str:
        """A derived axis that stands for a single mesh axis is shown by that axis's name
        (``fsdp`` is ``dp_shard`` when the mesh has no cp)."""
        if name in DERIVED and name not in self.layout.names:
            axes = self.axes_of(name)
            return axes[0] if len(axes) == 1 else name
        return name

    def all_axes(self) -> list[str]:
        """Every axis with groups: mesh axes, derived axes present, expert axes."""
        out = list(self.layout.names)
        out += [d for d in DERIVED if d not in out and len(self.axes_of(d)) > 1]
        if self.ep > 1 or self.etp > 1:
            out += ["efsdp", "ep", "etp"]
        return out

    def groups(self, name: str) -> np.ndarray:
        """All groups of an axis as an array (n_groups, size)."""
        if name in ("efsdp", "ep", "etp"):
            names, grid = self.expert_grid()
            return grid_groups(grid, [names.index(name)])
        return self.layout.groups(self.axes_of(name))

    def group_of(self, rank: int, name: str) -> list[int]:
        """Rank list of the group of axis ``name`` that holds ``rank``."""
        if name in ("efsdp", "ep", "etp"):
            g = self.groups(name)
            row = np.flatnonzero((g == rank).any(axis=1))[0]
            return [int(r) for r in g[row]]
        return self.layout.group_of(rank, self.axes_of(name))

    def expert_grid(self) -> tuple[tuple[str, ...], np.ndarray]:
        """Expert mesh: outer dense axes kept, the dense block re-factored to (efsdp, ep, etp)."""
        lay = self.layout
        block = [i for i, n in enumerate(lay.names) if n in _BLOCK]
        rest = [i for i in range(len(lay.names)) if i not in block]
        grid = lay.grid().transpose(rest + block)
        outer = tuple(lay.shape[i] for i in rest)
        shape = outer + (self.degree("efsdp"), self.ep, self.etp)
        names = tuple(lay.names[i] for i in rest) + ("efsdp", "ep", "etp")
        return names, grid.reshape(shape)

    @property
    def given_names(self) -> tuple[str, ...]:
        """Every axis as the user named it, outermost first, ep/etp at degree 1 too (C1)."""
        return self.user_names or self.layout.names

    @property
    def megatron_order(self) -> str:
        return to_megatron_order(self.given_names)


def _pairs(spec: MeshSpec) -> list[tuple[str, int]]:
    """(axis, degree as given) of ``spec``, outermost first, from names + shape or order + degrees."""
    if spec.names is not None and spec.shape is not None:
        return list(zip(spec.names, spec.shape))
    if spec.order is not None and spec.degrees is not None:
        names = from_megatron_order(spec.order)
        unknown = set(spec.degrees) - set(names)
        if unknown:
            fix = "-".join(sorted(unknown)) + "-" + spec.order
            raise ConfigError("mesh.degrees", f"axes {sorted(unknown)} are not in order {spec.order!r}; add them to "
                                              f"mesh.order where they vary (fastest first), e.g. order = \"{fix}\", or "
                                              f"leave them out of mesh.degrees")
        return [(n, spec.degrees.get(n, 1)) for n in names]
    # MeshSpec's validator already refuses this; kept so the two forms are narrowed here
    raise ConfigError("mesh", "give either names + shape or order + degrees")


def given_pairs(spec: MeshSpec) -> list[tuple[str, int]]:
    """(axis, degree as given, -1 kept) of ``spec``, outermost first (names + shape, or order + degrees)."""
    return _pairs(spec)


def world_error(spec: MeshSpec, world: int, gpus_per_node: int = 0,
                check: Optional[Checker] = None, filled: tuple[str, ...] = ()) -> ConfigError | None:
    """The input error of degrees that cannot make ``world`` ranks (``mesh.world`` when set),
    None when they can: their product is another number, or a -1 cannot be inferred because
    the other degrees do not divide the world. One line naming the field, the degrees, the
    ranks and the fix (:func:`~meshplan.mesh.world_fix.world_fix`; for a -1, the values of one
    other axis that divide, and the node count that fits). The CLI refuses such a config as
    malformed (exit 2); the library's :func:`resolve_mesh` keeps returning :class:`Infeasible`,
    which the search and ``compare`` report as a result. Malformed degrees (0, two -1s) raise
    there first. ``check`` (:data:`~meshplan.mesh.world_fix.Checker`): the caller's validation
    of each fix, which leaves out a fix it refuses; ``filled``: the axes the reader appended to
    the user's shape (``Config.filled_axes``), which the fix's shape leaves out
    (:func:`meshplan.mesh.world_fix._shown`): the user's ``[21, 2]`` is told ``[16, 2]``.

    >>> print(world_error(MeshSpec(names=["dp_shard", "cp"], shape=[8, 8]), 8, 8))
    mesh.shape: dp_shard 8 x cp 8 = 64 ranks, but the cluster has 8 GPUs; fix: shape [1, 8] (dp_shard = 8 / cp 8 = 1; or -1 there to infer it), or cluster.nodes = 8 (64 GPUs)
    >>> print(world_error(MeshSpec(names=["dp", "tp", "pp"], shape=[-1, 2, 3]), 8, 8))
    mesh.shape: dp = -1 cannot be inferred: tp 2 x pp 3 = 6 does not divide the cluster's 8 GPUs; fix: pp 1, 2 or 4 (a divisor of 8 / tp 2), or cluster.nodes = 3 (24 GPUs)
    >>> print(world_error(MeshSpec(names=["dp", "pp", "tp"], shape=[-1, 1, 16]), 8, 8))
    mesh.shape: dp = -1 cannot be inferred: tp 16 does not divide the cluster's 8 GPUs; fix: tp 1, 2, 4 or 8 (a divisor of 8), or cluster.nodes = 2 (16 GPUs)
    >>> world_error(MeshSpec(names=["dp_shard", "tp"], shape=[-1, 2]), 8, 8) is None
    True
    """
    field = "mesh.shape" if spec.names is not None else "mesh.degrees"
    has = f"mesh.world is {spec.world}" if spec.world else f"the cluster has {world} GPUs"
    world = spec.world or world
    pairs = _pairs(spec)
    dense = [(n, d) for n, d in pairs if n not in EXPERT_AXES]
    given = [(n, d) for n, d in dense if d != -1]
    known = prod(d for _, d in given)
    expr = " x ".join(f"{n} {d}" for n, d in given) or "1"
    inferred = [n for n, d in dense if d == -1]
    if not inferred:
        return None if known == world else ConfigError(field, f"{expr} = {known} ranks, but {has}; "
                                                       + world_fix(spec, pairs, world, known, gpus_per_node, check,
                                                                    filled))
    if world % known == 0:
        return None
    given = [(n, d) for n, d in given if d > 1]  # "tp 16", not "pp 1 x tp 16 = 16" (a degree 1 divides anything)
    expr = " x ".join(f"{n} {d}" for n, d in given)
    where = f"mesh.world {world}" if spec.world else f"the cluster's {world} GPUs"
    ranks = expr if len(given) == 1 else f"{expr} = {known}"  # "tp 16", not "tp 16 = 16 ranks do not"
    return ConfigError(field, f"{inferred[0]} = -1 cannot be inferred: {ranks} does not divide {where}; "
                       + infer_fix(spec, pairs, world, gpus_per_node, check))


def resolve_mesh(spec: MeshSpec, world: int, gpus_per_node: int = 0,
                 filled: tuple[str, ...] = ()) -> Union[Mesh, Infeasible]:
    """Resolve degrees against ``world`` ranks; ``filled``: the axes the reader appended to the
    user's shape (``Config.filled_axes``), left out of a fix's shape
    (:func:`meshplan.mesh.world_fix._shown`).

    Raises ConfigError for malformed degrees (0, below -1, two -1s, repeated names).
    Returns :class:`Infeasible` when the degrees cannot make ``world`` ranks: product
    mismatch (with the fix: one axis rescaled, or the cluster resized when ``gpus_per_node``
    is given), -1 not dividing exactly, or an ep*etp that does not divide the dense block.

    >>> print(resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 4]), 64, gpus_per_node=8).reasons[0])
    ... # doctest: +NORMALIZE_WHITESPACE
    dp_shard(8) * tp(4) = 32 != world(64); fix: shape [16, 4] (dp_shard = 64 / tp 4 = 16;
    or -1 there to infer it), or cluster.nodes = 4 (32 GPUs)
    >>> print(resolve_mesh(MeshSpec(names=["pp", "dp_shard", "tp"], shape=[4, 4, 8]), 64).reasons[0])
    ... # doctest: +NORMALIZE_WHITESPACE
    pp(4) * dp_shard(4) * tp(8) = 128 != world(64); fix: shape [4, 2, 8] (dp_shard = 64 / (pp 4 * tp 8) = 2;
    or -1 there to infer it)
    """
    world = spec.world or world
    pairs = _pairs(spec)
    inferred = _checked_degrees(pairs)
    expert = {n: d for n, d in pairs if n in EXPERT_AXES}
    dense = [(n, d) for n, d in pairs if n not in EXPERT_AXES]
    derivation = []
    if inferred:
        n = inferred[0]
        known = prod(d for _, d in dense if d != -1)
        others = " * ".join(f"{m} {d}" for m, d in dense if m != n) or "1"
        if world % known:
            return Infeasible((f"{n} = -1 cannot be inferred: world {world} is not divisible by {others} = {known}",))
        dense = [(m, world // known if m == n else d) for m, d in dense]
        derivation.append(f"{n} = {world} / ({others}) = {world // known}")
    total = prod(d for _, d in dense)
    if total != world:
        expr = " * ".join(f"{m}({d})" for m, d in dense)
        return Infeasible((f"{expr} = {total} != world({world}); " + world_fix(spec, pairs, world, total,
                                                                                gpus_per_node, filled=filled),))
    layout = Layout(tuple(n for n, _ in dense), tuple(d for _, d in dense))
    ep, etp = expert.get("ep", 1), expert.get("etp", 1)
    mesh = Mesh(layout=layout, ep=ep, etp=etp, sequence_parallel=spec.sequence_parallel)
    if ep * etp > 1:
        block, expr = mesh.block_size, mesh.block_expr
        if block % (ep * etp):
            return Infeasible((f"ep({ep}) * etp({etp}) = {ep * etp} does not divide {expr} = {block}; "
                               f"rule: (dp_shard * cp * tp) % (ep * etp) == 0",))
        derivation.append(f"efsdp = {expr} / (ep {ep} * etp {etp}) = {block // (ep * etp)}")
    derivation += _derived_lines(mesh)
    return Mesh(layout=layout, ep=ep, etp=etp, derivation=tuple(derivation), sequence_parallel=spec.sequence_parallel,
                user_names=tuple(n for n, _ in pairs if n not in filled))


def _checked_degrees(pairs: list) -> list[str]:
    """The axes of ``pairs`` (name, degree) given as -1, to infer; ConfigError for a bad axis
    name (:class:`~meshplan.mesh.layout.Layout`'s checks), a degree of 0 or below -1, more than
    one -1, or an expert axis (ep, etp) at -1."""
    Layout(tuple(n for n, _ in pairs), tuple(1 for _ in pairs))  # name checks
    for n, d in pairs:
        if not isinstance(d, int) or d == 0 or d < -1:
            raise ConfigError(f"mesh.{n}", f"degree {d} is not allowed; use a positive integer or -1 to infer")
    inferred = [n for n, d in pairs if d == -1]
    if len(inferred) > 1:
        raise ConfigError("mesh", f"axes {inferred} are all -1; at most one degree can be inferred")
    if inferred and inferred[0] in EXPERT_AXES:
        raise ConfigError(f"mesh.{inferred[0]}", "expert degrees cannot be -1; give ep and etp explicitly")
    return inferred


def _derived_lines(mesh: Mesh) -> list[str]:
    """``fsdp = dp_shard 8 * cp 2 = 16``: each derived axis (:data:`DERIVED`) that spans more than one
    mesh axis, with its arithmetic."""
    out = []
    for derived in DERIVED:
        axes = mesh.axes_of(derived)
        if len(axes) > 1:
            out.append(f"{derived} = " + " * ".join(f"{a} {mesh.layout.degree(a)}" for a in axes)
                       + f" = {mesh.degree(derived)}")
    return out


def resolved_mesh(spec: MeshSpec, world: int) -> Mesh:
    """:func:`resolve_mesh` of a mesh whose degrees make ``world`` by construction (the
    search's probe meshes); ValueError with the reasons if they do not (a caller's bug).

    >>> resolved_mesh(MeshSpec(names=["outer", "axis", "inner"], shape=[2, 4, 1]), 8).layout.shape
    (2, 4, 1)
    """
    mesh = resolve_mesh(spec, world)
    if isinstance(mesh, Infeasible):
        raise ValueError("; ".join(mesh.reasons))
    return mesh
