"""Placement candidates scored by the step-time model (issue 11 item 5).

:func:`meshplan.placement.choice.choose_placement` builds rank -> GPU permutations and, by
itself, ranks them by weak-path ring-hop bytes. That proxy can prefer a permutation the step
model rates slower (2 DGX H100 nodes, dp_shard 2 x tp 8: splitting every tp group over both
nodes has fewer ring hops than the dp_shard groups across nodes, but puts every layer's tp
all-gather and reduce-scatter on the NICs). This module, at the schedule layer, gives the
chooser a score from :func:`meshplan.schedule.steptime.step_time`: the predicted step of the
plan with that permutation (:func:`meshplan.plan.with_rank_to_gpu`). Compute is the same
for every permutation of one mesh, so a shorter step is less communication exposed on the
critical path (and less p2p wait in the pipeline); placement/ never imports this module,
the caller (cli ``place``) passes the callable.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from meshplan.plan import Plan, with_rank_to_gpu
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.step_summary import StepTime
from meshplan.schedule.steptime import step_time


def placed_step(plan: Plan, rank_to_gpu, overlap: Overlap = Overlap()) -> StepTime:
    """The predicted step of ``plan`` with ranks placed by ``rank_to_gpu`` (global GPU of
    each rank)."""
    return step_time(with_rank_to_gpu(plan, rank_to_gpu), overlap)


def step_scorer(plan: Plan, overlap: Overlap = Overlap()) -> Callable[[np.ndarray], float]:
    """``score(rank_to_gpu) -> seconds``: the predicted step time of ``plan`` under that
    permutation (memoised per permutation), for ``choose_placement(..., step_s=...)``."""
    seen: dict[bytes, float] = {}

    def score(rank_to_gpu: np.ndarray) -> float:
        key = np.asarray(rank_to_gpu, dtype=np.int64).tobytes()
        if key not in seen:
            seen[key] = placed_step(plan, rank_to_gpu, overlap).step_s
        return seen[key]

    return score
