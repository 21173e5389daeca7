"""The last part of a memory ``fix:`` line (:func:`meshplan.plan_fix.memory_fix`) when no knob
fits: the fewest nodes that would, the same mesh with its data axis grown with the nodes.
At most :data:`MAX_NODE_PLANS` node counts are tried upwards with the configured global batch,
then at most :data:`MAX_GROWN_PLANS` doubled and bisected (memory falls as the data axis
grows). A global batch caps dp at global_batch / micro_batch (:mod:`meshplan.spec.axes.dp`);
past that cap the node counts are planned with the smallest global batch dp splits, and the
line names ``training.global_batch`` and the batch the nodes found need.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import gcd
from typing import Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.keymap import OWN, KeyMap
from meshplan.plan import Plan
from meshplan.plan_variant import DATA_AXES, mesh_words, planned, variant_mesh
from meshplan.units import counted

#: Node counts tried at most when nothing fits on the configured nodes, with the configured
#: global batch; then at most :data:`MAX_GROWN_PLANS` more, doubled and bisected, the global
#: batch raised past its cap on dp where needed.
MAX_NODE_PLANS = 8
MAX_GROWN_PLANS = 12


@dataclass(frozen=True)
class Grown:
    """Where the node search ended: ``plan`` the fewest nodes found to fit (None: none within
    the bounds; its own ``training.global_batch`` the batch it needs), ``last`` the most nodes
    tried, ``capped`` whether ``training.global_batch``'s cap on dp (global_batch /
    micro_batch) stopped the search with the configured batch."""

    plan: Optional[Plan]
    last: int
    capped: bool = False


def _grown(p0: Plan, cfg: Config, data: str, n: int, raise_batch: bool) -> Optional[Config]:
    """``cfg`` on ``n`` nodes, its data axis grown with them (None where its degree is not
    whole, the batch does not split and ``raise_batch`` is off, or it does not resolve); with
    ``raise_batch``, the global batch raised to the smallest multiple of micro_batch x dp at or
    above the configured one (dp = replicate x shard, the batch rule of
    :mod:`meshplan.spec.axes.dp`)."""
    nodes, deg, t = cfg.cluster.nodes, p0.axis_degrees(), cfg.training
    if (deg[data] * n) % nodes:
        return None
    grown = dict(deg) | {data: deg[data] * n // nodes}
    q = t.micro_batch * p0.mesh.dp // deg[data] * grown[data]
    gb = -(-t.global_batch // q) * q
    if gb != t.global_batch and not raise_batch:
        return None
    try:
        return replace(cfg, cluster=cfg.cluster.model_copy(update={"nodes": n}), mesh=variant_mesh(p0, grown),
                       training=t.model_copy(update={"global_batch": gb}))
    except (ConfigError, ValueError):
        return None


def fewest_nodes(plan: Plan, cfg: Config) -> Grown:
    """The fewest nodes (above the configured) on which ``cfg``'s mesh, its data axis grown with
    the nodes, fits. First with the configured global batch, node counts upwards (at most
    :data:`MAX_NODE_PLANS` planned; counts whose dp does not split the batch skipped); then,
    when those ran out (the batch's cap on dp reached) or none fit, with the global batch raised
    where needed (:func:`_grown`), node counts doubled from the last tried until one fits and
    then bisected (memory falls as the data axis grows; at most :data:`MAX_GROWN_PLANS` planned)."""
    p0, nodes, t = planned(cfg), cfg.cluster.nodes, cfg.training
    data = next((n for n in DATA_AXES if n in p0.axis_degrees()), None) if p0 is not None else None
    if p0 is None or data is None:
        return Grown(None, nodes)
    top, last, tried = nodes * 1024, nodes, 0
    for n in range(nodes + 1, top):
        if tried == MAX_NODE_PLANS or t.micro_batch * p0.mesh.dp * n > t.global_batch * nodes:
            break  # (the second: dp past global_batch / micro_batch, the batch's cap)
        c = _grown(p0, cfg, data, n, raise_batch=False)
        if c is None:
            continue
        tried, last = tried + 1, n
        p = planned(c)
        if p is not None and p.feasible:
            return Grown(p, n)
    return _doubled(p0, cfg, data, last, top, capped=tried < MAX_NODE_PLANS)


def _doubled(p0: Plan, cfg: Config, data: str, last: int, top: int, capped: bool) -> Grown:
    """:func:`fewest_nodes`' second phase: node counts above ``last`` (the most known not to fit),
    doubled, then bisected between the last that did not fit and the first that did."""
    budget, fit = MAX_GROWN_PLANS, None

    def fits(n: int) -> Optional[Plan]:
        nonlocal budget, capped
        c = _grown(p0, cfg, data, n, raise_batch=True)
        budget -= 1
        if c is None:
            return None
        capped |= c.training.global_batch != cfg.training.global_batch
        p = planned(c)
        return p if p is not None and p.feasible else None

    lo, hi = last, last
    while fit is None and budget > 0 and hi < top:
        lo, hi = hi, min(hi * 2, top)
        fit = fits(hi)
    if fit is None:
        return Grown(None, hi, capped)
    step = cfg.cluster.nodes // gcd(p0.axis_degrees()[data], cfg.cluster.nodes)  # the counts with a whole degree
    while budget > 0:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        p = fits(mid)
        lo, hi, fit = (lo, mid, p) if p is not None else (mid, hi, fit)
    return Grown(fit, fit.config.cluster.nodes, capped)


def nodes_words(plan: Plan, g: Grown, words: str, keys: KeyMap = OWN) -> str:
    """The last part of the fix: the fewest nodes found (and the global batch they need where
    ``training.global_batch`` caps dp), or how far the search went; in ``keys``' names."""
    saving = "at the most memory-saving settings" if words else "as configured"
    t, mb = plan.config.training, keys.bare("micro_batch")
    cap = (f"{keys.amount('training.global_batch', t.global_batch)} caps dp at {t.global_batch // t.micro_batch} "
           f"({keys.bare('global_batch')} / {keys.amount('micro_batch', t.micro_batch)})")
    p = g.plan
    if p is None:
        past = f"; {cap}: past it the global batch raised to a multiple of {mb} x dp" if g.capped else ""
        return f"does not fit {saving} on up to {counted(g.last, 'node')} either (data axis grown with the nodes{past})"
    mesh = mesh_words(p.axis_degrees(), keys)
    gb = p.config.training.global_batch
    nodes = counted(plan.config.cluster.nodes, "node")
    batch = f" with {keys.amount('training.global_batch', gb)}"
    where, batch = (f", and {cap}", batch) if gb != t.global_batch else ("", "")
    return (f"does not fit even {saving} on {nodes}{where}: {p.config.cluster.nodes} nodes would{batch} "
            f"({words + ', ' if words else ''}{mesh}: {p.timeline.verdict_words()})")
