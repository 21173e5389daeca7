"""The fix of mesh degrees whose product is not the world size: one dense axis rescaled (a
data axis first), an expert axis moved with it where the caller's rules refuse the rescaled
mesh, or the cluster resized to the product. Used by :func:`meshplan.mesh.resolve.world_error`
and :func:`meshplan.mesh.resolve.resolve_mesh`; ``pairs`` are (axis, degree) outermost first.

>>> from meshplan.spec.mesh import MeshSpec
>>> print(world_fix(MeshSpec(names=["dp_shard", "tp"], shape=[8, 4]), [("dp_shard", 8), ("tp", 4)], 64, 32, 8))
fix: shape [16, 4] (dp_shard = 64 / tp 4 = 16; or -1 there to infer it), or cluster.nodes = 4 (32 GPUs)
"""

from __future__ import annotations

from math import gcd, prod
from typing import Callable, Optional

from meshplan.mesh.axes import EXPERT_AXES
from meshplan.spec.mesh import MeshSpec

#: Axes tried first when rescaling one axis to the world size: data axes, then the rest.
_RESCALE_FIRST = ("dp_shard", "dp", "dp_replicate")

#: ``check(spec, nodes)``: why the caller's validation refuses a candidate mesh ``spec`` (on
#: ``nodes`` nodes; None: the configured), None where it accepts it. The CLI's is the plan's own
#: rules (:func:`meshplan.plan_fix_rules.mesh_checker`), so a fix is never itself refused.
Checker = Callable[[MeshSpec, Optional[int]], Optional[str]]


def _spec_of(spec: MeshSpec, pairs) -> MeshSpec:
    """``spec`` with the degrees of ``pairs`` (names + shape, or Megatron degrees)."""
    if spec.names is not None:
        return spec.model_copy(update={"shape": [d for _, d in pairs]})
    given = spec.degrees or {}
    return spec.model_copy(update={"degrees": {n: d for n, d in pairs if n in given or d != 1}})


def _expert_move(spec: MeshSpec, pairs, world: int, check: Checker):
    """(pairs, (axis, old, new)) with one expert axis moved to the nearest degree dividing ``world`` that
    ``check`` accepts (at most 4 tried per axis), or None: the rescaled mesh's ep may not divide
    the model's experts or the new dense block, a rule :func:`world_error` cannot see itself."""
    for i, (n, d) in enumerate(pairs):
        if n not in EXPERT_AXES or d <= 1:
            continue
        near = sorted((k for k in range(1, min(world, 4 * d) + 1) if world % k == 0 and k != d),
                      key=lambda k: (abs(k - d), -k))
        for k in near[:4]:
            moved = pairs[:i] + [(n, k)] + pairs[i + 1:]
            if check(_spec_of(spec, moved), None) is None:
                return moved, (n, d, k)
    return None


def _shown(moved, pairs, filled: tuple[str, ...]) -> list[int]:
    """The degrees of ``moved`` in the user's own entries: an axis of ``filled`` (appended by the
    reader, ``Config.filled_axes``) left out unless the fix changes its degree.

    >>> _shown([("dp_shard", 16), ("tp", 2), ("etp", 2)], [("dp_shard", 21), ("tp", 2), ("etp", 2)], ("etp",))
    [16, 2]
    """
    return [d for (n, d), (_, d0) in zip(moved, pairs) if n not in filled or d != d0]


def _rescaled(spec: MeshSpec, pairs, world: int, total: int, check: Optional[Checker],
              filled: tuple[str, ...] = ()) -> tuple[str, str]:
    """(fix, why): the first dense axis (a data axis first) rescaled to make ``world`` that
    ``check`` accepts, an expert axis moved with it where needed, as the fix's words (the shape in
    the user's entries, :func:`_shown`); or ("", the reason the first rescaled shape is refused)."""
    dense = [(n, d) for n, d in pairs if n not in EXPERT_AXES]
    order = sorted(range(len(dense)), key=lambda i: (dense[i][0] not in _RESCALE_FIRST, i))
    why = ""
    for i in order:
        name = dense[i][0]
        rest = total // dense[i][1]
        if world % rest:
            continue
        new = world // rest
        moved = [(n, new if n == name else d) for n, d in pairs]
        refused = check(_spec_of(spec, moved), None) if check is not None else None
        note = ""
        if refused is not None and check is not None:
            alt = _expert_move(spec, moved, world, check)
            if alt is None:
                shown = f"shape {_shown(moved, pairs, filled)}" if spec.names is not None else f"{name} = {new}"
                why = why or f"{shown}: {refused}"
                continue
            moved, note = alt[0], f"; {alt[1][0]} {alt[1][1]} -> {alt[1][2]} (at {alt[1][0]} {alt[1][1]}: {refused})"
        factors = [f"{n} {d}" for n, d in dense if n != name]
        others = " * ".join(factors) if len(factors) == 1 else f"({' * '.join(factors)})" if factors else "1"
        if spec.names is not None:
            return (f"fix: shape {_shown(moved, pairs, filled)} ({name} = {world} / {others} = {new}{note}; or -1 there to "
                    f"infer it)"), ""
        extra = "".join(f", {n} = {d}" for (n, d), (_, d0) in zip(moved, pairs) if d != d0 and n != name)
        return f"fix: [mesh.degrees] {name} = {new}{extra} ({world} / {others}{note}; or -1 to infer it)", ""
    return "", why


def world_fix(spec: MeshSpec, pairs, world: int, total: int, gpus_per_node: int,
               check: Optional[Checker] = None, filled: tuple[str, ...] = ()) -> str:
    """The fix of a product that is not the world size: one dense axis rescaled (a data axis
    first) and where it helps, the number of nodes (or ``mesh.world``) that fits the product;
    with ``check``, only what it accepts (:data:`Checker`); ``filled``: :func:`_shown`'s."""
    fix, why = _rescaled(spec, pairs, world, total, check, filled)
    if fix:
        fixes = [fix]
    elif why:
        fixes = [f"fix: degrees whose product is {world} and that the rules accept ({why})"]
    else:
        fixes = [f"fix: degrees whose product is {world} (no single axis can be rescaled to it)"]

    def ok(s: MeshSpec, nodes: Optional[int] = None) -> bool:
        return check is None or check(s, nodes) is None
    if spec.world is not None:
        fixes += [f"or mesh.world = {total}"] if ok(spec.model_copy(update={"world": total})) else []
    elif gpus_per_node and total % gpus_per_node == 0:
        fixes += [f"or cluster.nodes = {total // gpus_per_node} ({total} GPUs)"] if ok(spec, total // gpus_per_node) \
            else []
    elif total < world:
        fixes += [f"or mesh.world = {total} (use {total} of the {world} GPUs)"] \
            if ok(spec.model_copy(update={"world": total})) else []
    return ", ".join(fixes)


def _alternatives(values: list[int]) -> str:
    """``1, 2 or 4`` (``values`` in order)."""
    return str(values[0]) if len(values) == 1 else f"{', '.join(map(str, values[:-1]))} or {values[-1]}"


def infer_fix(spec: MeshSpec, pairs, world: int, gpus_per_node: int, check: Optional[Checker] = None) -> str:
    """The ``fix:`` of a -1 that the other degrees leave nothing to infer (their product does not
    divide ``world``): for each given degree > 1, its values that with the others kept divide
    ``world``, then the node count whose GPUs the product fills; with ``check``
    (:data:`Checker`, the plan's own rules), only the values and the node count it accepts, so a
    fix is never itself refused (newcomer trial nc55 #2: tp 3 of Llama 3 70B on 512 GPUs was told
    tp 16 ... 512 and ``cluster.nodes = 3``, which the heads rule refuses); an axis none of whose
    values passes is named with the first refusal.

    >>> print(infer_fix(MeshSpec(names=["dp", "tp", "pp"], shape=[-1, 2, 3]), [("dp", -1), ("tp", 2), ("pp", 3)], 8, 8))
    fix: pp 1, 2 or 4 (a divisor of 8 / tp 2), or cluster.nodes = 3 (24 GPUs)
    >>> no_odd_tp = lambda s, nodes: "tp is odd" if s.shape[1] % 2 else None
    >>> print(infer_fix(MeshSpec(names=["dp", "tp"], shape=[-1, 3]), [("dp", -1), ("tp", 3)], 12, 4, no_odd_tp))
    fix: tp 2, 4, 6 or 12 (a divisor of 12 that the plan's rules accept)
    """
    given = [(n, d) for n, d in pairs if n not in EXPERT_AXES and d > 1]
    known = prod(d for _, d in given)
    fixes, why = [], ""
    for n, d in given:
        rest = known // d
        if world % rest:
            continue
        values = [k for k in range(1, world // rest + 1) if (world // rest) % k == 0]
        refused = {k: check(_spec_of(spec, [(m, k if m == n else e) for m, e in pairs]), None) if check else None
                   for k in values}
        ok = [k for k in values if refused[k] is None]
        others = "".join(f" x {m} {e}" for m, e in given if m != n)[3:]
        if ok:
            rule = " that the plan's rules accept" if len(ok) < len(values) else ""
            fixes.append(f"{n} {_alternatives(ok)} (a divisor of {world}{f' / {others}' if others else ''}{rule})")
        else:
            why = why or f"{n} {_alternatives(values)}: {refused[values[-1]]}"
    if gpus_per_node and not spec.world:
        lcm = known * gpus_per_node // gcd(known, gpus_per_node)
        refused_nodes = check(spec, lcm // gpus_per_node) if check else None
        if refused_nodes is None:
            fixes.append(f"cluster.nodes = {lcm // gpus_per_node} ({lcm} GPUs)")
        else:
            why = why or f"cluster.nodes = {lcm // gpus_per_node}: {refused_nodes}"
    if fixes:
        return "fix: " + ", or ".join(fixes)
    return "fix: degrees whose product divides the world" + (f" and that the rules accept ({why})" if why else "")
