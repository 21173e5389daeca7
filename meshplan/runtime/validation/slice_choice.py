"""Which mesh of a ``meshplan validate-slice`` is chosen, and why each other one is rejected.

A slice runs every mesh scaled down to the testbed, where they all fit; the job runs at full
scale. So the choice weighs each mesh's full-scale plan (:func:`full_scale`: the config's own
:func:`meshplan.plan.build_plan` on its own cluster, the verdict ``meshplan plan`` prints) with its
measured step (newcomer trial: the slice kept tp2 as chosen while ``plan tp2.toml`` said it did not
fit; tests/test_slice.py's tp2, Llama-3-8B at dp 8 under zero1 on 8 H100, prints today "infeasible: peak
103.3 GiB at forward of the head (micro-batch 0) on stage 0 > 71.2 GiB usable"). :func:`choose`: the measured fastest of the meshes that
ran and fit at full scale. :func:`assign_roles`: ``chosen`` or ``rejected`` with the reason, in
this order: infeasible at full scale ("infeasible at full scale: peak X GiB > Y GiB usable"), the
run did not complete, measured slower than the chosen mesh. Each mesh's folder is named after
the mesh and its role (:func:`folder_name`: ``<config stem>-chosen``, ``<config stem>-rejected``).
The functions read and set fields of :class:`meshplan.runtime.validation.slice.MeshResult`.

A slice also places ranks its own way: node-major over the testbed's nodes (rank r on node
``r // (W / nodes)``, :mod:`meshplan.runtime.validation.slice`), so an axis whose groups sit
inside one node at full scale can span the testbed's nodes in the slice (newcomer trial 54 #3:
tp 8 on 2 testbed nodes of 4 ranks ran over the emulated NICs, while at full scale it is inside
one NVLink node). :func:`crossing_axes` finds the axes whose groups cross nodes for a placement;
:func:`slice_only_words` says which do so only in the slice: their measured time is not the
full-scale one, and a mesh rejected for it is rejected on the slice's placement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from meshplan.config import Config
from meshplan.plan import Infeasible, build_plan
from meshplan.units import GiB

if TYPE_CHECKING:
    from meshplan.runtime.validation.slice import MeshResult


def full_scale(cfg: Config) -> dict[str, Any]:
    """``cfg``'s own plan at full scale as MeshResult fields: ``full_feasible``, the most loaded
    stage's ``full_peak_bytes`` and ``full_usable_bytes`` (HBM less the reserve,
    :class:`meshplan.memory.timeline.Timeline`; None when the mesh does not resolve) and
    ``full_verdict``, one line: ``feasible at full scale: peak 40.6 GiB <= 71.2 GiB usable`` or
    ``infeasible at full scale: peak 103.3 GiB > 71.2 GiB usable`` (else the plan's reasons; tests/test_slice.py's
    Llama-3-8B at dp 2 x tp 4 and dp 8 on 8 H100: 79.11 GiB x 0.9 usable); ``full_crossing``: the mesh
    axes whose groups cross nodes in the plan's placement (:func:`crossing_axes`; None when no mesh)."""
    plan = build_plan(cfg)
    if isinstance(plan, Infeasible):
        return dict(full_feasible=False, full_peak_bytes=None, full_usable_bytes=None,
                    full_verdict="infeasible at full scale: " + "; ".join(plan.reasons), full_crossing=None)
    tl = plan.timeline
    peak, usable = tl.peak.total_bytes, tl.usable_bytes
    if plan.feasible:
        verdict = f"feasible at full scale: peak {peak / GiB:.1f} GiB <= {usable / GiB:.1f} GiB usable"
    elif peak > usable:
        verdict = f"infeasible at full scale: peak {peak / GiB:.1f} GiB > {usable / GiB:.1f} GiB usable"
    else:
        verdict = "infeasible at full scale: " + "; ".join(plan.reasons)
    return dict(full_feasible=plan.feasible, full_peak_bytes=peak, full_usable_bytes=usable, full_verdict=verdict,
                full_crossing=crossing_axes(plan.mesh, plan.placement.node))


def crossing_axes(mesh, node_of) -> list[str]:
    """The mesh axes (degree > 1) of which some group holds ranks of more than one node;
    ``node_of``: the node of each rank (a plan's ``placement.node``, or ``arange(W) // per_node``).

    >>> from meshplan.mesh.resolve import resolved_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> m = resolved_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[1, 8]), 8)
    >>> crossing_axes(m, np.arange(8) // 4), crossing_axes(m, np.arange(8) // 8)
    (['tp'], [])
    """
    node_of = np.asarray(node_of)
    out = []
    for axis in mesh.layout.names:
        if mesh.degree(axis) > 1:
            nodes = node_of[mesh.groups(axis)]
            if (nodes.min(axis=1) != nodes.max(axis=1)).any():
                out.append(axis)
    return out


def slice_only_words(axes: list[str]) -> str:
    """The warning for the axes that cross nodes in the slice and not at full scale; "" when none.

    >>> slice_only_words(["tp"])
    'tp crosses nodes in this slice (not at full scale): its measured time is not the full-scale one'
    """
    if not axes:
        return ""
    verb = "crosses" if len(axes) == 1 else "cross"
    return (f"{' and '.join(axes)} {verb} nodes in this slice (not at full scale): "
            f"{'its' if len(axes) == 1 else 'their'} measured time is not the full-scale one")


def choose(results: list[MeshResult]) -> Optional[MeshResult]:
    """The measured fastest mesh among those that ran and fit at full scale (ties: by name);
    None when there is none."""
    fit = [r for r in results if r.ran and r.measured_s is not None and r.full_feasible]
    return min(fit, key=lambda r: (r.measured_s, r.name)) if fit else None


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def assign_roles(results: list[MeshResult], best: Optional[MeshResult]) -> None:
    """Set each result's ``role`` (``chosen`` / ``rejected``) and ``why``, one clause (module
    docstring); a mesh both infeasible at full scale and failed gives the full-scale reason."""
    for r in results:
        if best is not None and r.name == best.name:
            r.role, r.why = "chosen", f"measured fastest ({_ms(r.measured_s)}) of the meshes that fit at full scale"
            continue
        r.role = "rejected"
        if not r.full_feasible:
            r.why = r.full_verdict
        elif not r.ran or r.measured_s is None:
            r.why = f"the run did not complete: {r.message}"
        elif best is None or best.measured_s is None:
            r.why = "no mesh was chosen"
        else:
            r.why = (f"measured {_ms(r.measured_s)}, {r.measured_s / best.measured_s:.2f}x the chosen "
                     f"{best.name}'s {_ms(best.measured_s)}")
            placed = [f"in {m.name}, {slice_only_words(m.slice_only_crossing)}" for m in (r, best)
                      if m.slice_only_crossing]
            if placed:  # the order on the slice's placement, which is not the job's (nc54 #3)
                r.why += f" (the slice's placement: {'; '.join(placed)})"


def folder_name(r: MeshResult) -> str:
    """The mesh's evidence folder: its name (the config's stem), then its role.

    >>> from types import SimpleNamespace as N
    >>> folder_name(N(name="tp2", role="rejected")), folder_name(N(name="chosen", role="chosen"))
    ('tp2-rejected', 'chosen-chosen')
    """
    return f"{r.name}-{r.role}"


def kept_line(results: list[MeshResult], out: str) -> str:
    """The one line saying which mesh was chosen and where each is kept, with why.

    >>> from types import SimpleNamespace as N
    >>> kept_line([N(name="tp2", role="rejected", why="infeasible at full scale: peak 108.4 GiB > 67.1 GiB usable"),
    ...            N(name="chosen", role="chosen", why="measured fastest (12.0 ms) of the meshes that fit at full "
    ...              "scale")], "out")
    'chosen: chosen (measured fastest (12.0 ms) of the meshes that fit at full scale) in out/chosen-chosen/; rejected: tp2 (infeasible at full scale: peak 108.4 GiB > 67.1 GiB usable) in out/tp2-rejected/'
    """
    best = [r for r in results if r.role == "chosen"]
    head = (f"chosen: {best[0].name} ({best[0].why}) in {out}/{folder_name(best[0])}/" if best else
            "chosen: none (no mesh ran and fits at full scale)")
    rest = [f"{r.name} ({r.why}) in {out}/{folder_name(r)}/" for r in results if r.role != "chosen"]
    return head + ("; rejected: " + "; ".join(rest) if rest else "")
