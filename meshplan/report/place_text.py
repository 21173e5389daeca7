"""Text for ``meshplan place``: per-axis placement summary, decisions, warnings, the chosen
permutation with its score, and the bindings of a few ranks. Pure: returns lines."""

from __future__ import annotations

from meshplan.placement.bindings import bindings
from meshplan.placement.assign import group_locality
from meshplan.placement.assign import same_rails
from meshplan.placement.choice import Choice
from meshplan.units import traffic_gb


def _num(x: float, in_bytes: bool) -> str:
    return traffic_gb(x) if in_bytes else f"{x:.6g}"


def axis_rows(c: Choice) -> list[str]:
    """One line per axis of degree > 1: size, groups, link class, nodes spanned, rails
    (most per group; "same" when every node of a group uses the same rails), sockets (1, or
    "cross" when a group holds members on both sockets of a node), weak-path traffic: the bytes
    per step all the axis's groups send over weak links (ring hops x bytes each rank sends; an all-to-all
    axis its off-domain share, :class:`~meshplan.placement.score.AxisCost`), GB;
    each axis named as the plan names it (``c.labels``: ``edp`` for the experts' data axis under
    DDP or ZeRO-1/2)."""
    b = c.weights_source != "default"
    head = f"{'axis':<13}{'size':>6}{'groups':>8}  {'link':<8}{'nodes':>6}{'rails':>7}{'':<6}{'sockets':>8}  weak-path GB/step, all ranks"
    out = [head]
    axes = [a for a in c.mesh.all_axes() if c.mesh.degree(a) > 1]
    for a in axes:
        loc = group_locality(c.placement, c.mesh.groups(a))
        same = "same" if same_rails(c.placement, loc.groups).all() else "mixed"
        cost = c.after.by_axis.get(a)
        weak = _num(cost.network_bytes + cost.spine_bytes + cost.socket_bytes, b) if cost else "-"
        out.append(f"{c.labels.get(a, a):<13}{loc.size:>6}{loc.n_groups:>8}  {loc.link:<8}{loc.max_nodes:>6}{loc.max_rails:>7} "
                   f"{same:<5}{'cross' if loc.crosses_sockets else '1':>8}  {weak}")
    return out


def _perm(r2g) -> str:
    vals = [int(x) for x in r2g]
    return "[" + ", ".join(map(str, vals)) + "]" if len(vals) <= 16 else (
        "[" + ", ".join(map(str, vals[:16])) + f", ...] ({len(vals)} ranks)")


def binding_line(b: dict) -> str:
    """One rank's binding as the command its process runs (``PROGRAM`` the training command), the
    taskset form (cores without the memory node) after ``or``: never two commands joined by ``|``,
    which reads as a shell pipe."""
    env = " ".join(f'{k}="{v}"' for k, v in b["env"].items())
    return (f"rank {b['rank']}: node {b['node']} LOCAL_RANK {b['local_rank']} RANK {b['process_rank']} "
            f"GPU {b['gpu']} ({b['device']}) socket {b['socket']} NIC {b['nic'] or '-'}; run as: {env} "
            f"{b['numactl']} PROGRAM (or, cores only: {b['taskset']} PROGRAM)")


def place_lines(c: Choice, ranks: list[int], **binding_opts) -> list[str]:
    """The whole ``meshplan place`` report for choice ``c``."""
    b = c.weights_source != "default"
    out = ["placement per axis:"] + ["  " + x for x in axis_rows(c)] + _chosen_lines(c)
    out += ["decisions:"] + [f"  - {d}" for d in c.decisions]
    out += ["warnings:"] + ([f"  ! {w}" for w in c.warnings] or ["  (none)"])
    out += ["bindings:"] + [f"  {binding_line(bindings(c.placement, r, **binding_opts))}" for r in ranks]
    return out


def _chosen_lines(c: Choice) -> list[str]:
    """The searched permutation and its weak-path bytes against the config's (none unsearched)."""
    if not c.searched:
        return []
    b, s0, s1 = c.weights_source != "default", c.before, c.after
    return [f"chosen rank_to_gpu: {_perm(c.rank_to_gpu)}" + ("" if c.changed else " (the config's, kept)"),
            f"weak-path bytes per step: config {_num(s0.total, b)} -> chosen {_num(s1.total, b)} "
            f"(network {_num(s0.network_bytes, b)} -> {_num(s1.network_bytes, b)}, spine "
            f"{_num(s0.spine_bytes, b)} -> {_num(s1.spine_bytes, b)}, socket {_num(s0.socket_bytes, b)} -> "
            f"{_num(s1.socket_bytes, b)})"]


def launch_lines(c: Choice) -> list[str]:
    """What ``meshplan launch`` prints of the placement it binds: the same choice and warnings
    as ``meshplan place`` (with ``--choose``, the chosen permutation and the step it changes),
    so a launch never binds a permuted or a weak placement silently. The choice's line is the
    last decision (:func:`meshplan.placement.explain.explain`'s result line)."""
    return (_chosen_lines(c) + [f"placement: {c.decisions[-1]}"] * bool(c.decisions)
            + [f"warning: {w}" for w in c.warnings])
