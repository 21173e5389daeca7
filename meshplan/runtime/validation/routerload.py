"""The router's measured load against the planned one, for ``meshplan validate`` of a dropless
MoE plan: max / mean token copies per expert and per ep rank.

Each rank writes, with its recorded step (``rank<r>/collectives.json`` ``expert_counts``,
:func:`meshplan.runtime.execution.moe.take_expert_counts`), the copies its router sent to each
of the ``E`` experts in every MoE layer. The experts of one ep group receive what its members
route, so per layer and ep group the load of expert ``e`` is the sum of the members' counts,
and of ep rank ``j`` the sum over its experts ``j E/ep .. (j+1) E/ep - 1``
(:func:`meshplan.runtime.execution.moe_parallel.apply_ep`). The measured value is the worst layer and
group's max / mean; the predicted one the plan's
(:func:`meshplan.compute.routing.planned_imbalance`: 1 when balanced, the step time's
assumption, or the stated ``moe_hottest_expert_share``). Reported, not gated: the router's
counts are the data's and the weights', which the plan does not know.

Two ranks route 8 copies each over 4 experts, 2 per rank: the experts receive 6, 2, 5, 3
(mean 4: 1.5), the ep ranks 8 and 8 (1.0):

>>> load_ratios({"layers.1.moe": [[3, 1, 2, 2], [3, 1, 3, 1]]}, 2)
(1.5, 1.0, 'layers.1.moe')
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshplan.compute.routing import RoutingOptions, planned_imbalance


def load_ratios(layers: dict[str, list[list[int]]], ep: int) -> tuple[float, float, str]:
    """(max / mean per expert, max / mean per ep rank, the layer of the larger expert ratio)
    over ``layers``: MoE layer name -> the counts (E,) each member of one ep group routed."""
    worst = (0.0, 0.0, "")
    for name, counts in layers.items():
        load = np.asarray(counts, dtype=np.float64).sum(axis=0)  # (E,) received by the group's experts
        if load.mean() <= 0:
            continue
        per_rank = load.reshape(ep, -1).sum(axis=1)
        e, r = float(load.max() / load.mean()), float(per_rank.max() / per_rank.mean())
        worst = (max(worst[0], e), max(worst[1], r), name if e > worst[0] else worst[2])
    return worst


def router_rows(plan, folder: Path) -> list[dict]:
    """Rows of ``predicted_vs_measured`` (unit ``x``, a ratio): the router's max / mean token
    copies per expert and per ep rank in the recorded step, worst MoE layer and ep group, against
    the plan's (module docstring); none for a plan without dropless MoE layers."""
    m, mesh = plan.config.model, plan.mesh
    ro = RoutingOptions.of(plan.config.training)
    if not m.is_moe or not ro.dropless:
        return []
    by_group: dict[tuple, dict[str, list]] = {}
    for r in range(plan.world):
        counts = json.loads((folder / f"rank{r}" / "collectives.json").read_text()).get("expert_counts") or {}
        layers = by_group.setdefault(tuple(mesh.group_of(r, "ep")), {})
        for name, c in counts.items():
            layers.setdefault(name, []).append(c)
    if not any(by_group.values()):
        return []
    found = [(load_ratios(ls, mesh.ep), g) for g, ls in by_group.items() if ls]
    (e, _, layer), group = max(found, key=lambda x: x[0][0])
    (_, rank_r, _), rank_group = max(found, key=lambda x: x[0][1])
    pe, pr = planned_imbalance(ro, m.experts, mesh.ep)
    plan_words = ("balanced routing (1 / experts), the step time's" if ro.hottest_share is None
                  else f"moe_hottest_expert_share {ro.hottest_share:g}")
    note = (f"router's token copies in the recorded step, worst MoE layer and ep group ({layer}); "
            f"predicted: {plan_words}; reported, not gated")
    rows = [dict(quantity="router: tokens per expert, max/mean", unit="x", predicted=pe, measured=e,
                 measured_min=None, rank=",".join(map(str, group)), error=e / pe - 1, note=note)]
    if mesh.ep > 1:
        rows.append(dict(quantity="router: tokens per ep rank, max/mean", unit="x", predicted=pr, measured=rank_r,
                         measured_min=None, rank=",".join(map(str, rank_group)), error=rank_r / pr - 1,
                         note="each ep rank's experts' copies summed; worst MoE layer and ep group"))
    return rows
