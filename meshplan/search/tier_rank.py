"""The headroom tiers (:mod:`meshplan.search.headroom`) as the best-first ranking applies them
(:func:`meshplan.search.best_first.best_first`): each candidate's tier from its planned peak or,
before that, from its memory bounds (:meth:`Tiers.tight`), the tiers' order and rows
(:func:`~meshplan.search.headroom.tier_order`), and the step time up to which every candidate must
be planned for the first ``[search] top`` rows to be exact (:meth:`Tiers.cut`).

Why the cut is exact: the tie rule (:mod:`meshplan.search.rank`) fixes the first k meshes of a set
of candidates from those within ``1 + TIE`` of the k-th shortest best step of a mesh of that set
(:func:`~meshplan.search.rank.needed`). The tiers apply the rule to the clear candidates alone,
then to the candidates of the meshes with none clear, so the first ``top`` rows need: every
candidate that could be clear up to ``needed`` of the clear meshes where ``top`` of them are known;
else every candidate that could be clear (the clear tier whole), then every candidate of the other
meshes up to ``needed`` of them for the rows left. A candidate's tier is known where its memory is
planned, or where its peak bounds (:class:`~meshplan.search.estimate.Estimates`, with the runner's
margin, which :meth:`meshplan.search.best_first.Runner._check` watches) lie on one side of the
threshold; otherwise the ranking plans its memory before it counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from meshplan.config import Config
from meshplan.memory.constraints import usable_bytes
from meshplan.search.columns import Candidates
from meshplan.memory.headroom import tight as tight_peak
from meshplan.search.headroom import tier_order
from meshplan.search.rank import best_of_meshes, distinct, mesh_of, needed, order_all

if TYPE_CHECKING:
    from meshplan.search.best_first import Runner


class Tiers:
    """The tiers of one search over ``c`` showing ``top`` rows, ``usable`` bytes a GPU, ``frac`` the
    plan's fragmentation allowance (``on`` False, ``[search] headroom_tier = false``: the rule's order
    over every candidate, the cut :func:`~meshplan.search.rank.needed` of every mesh). ``run``: the
    runner whose plans (``run.exact``) and bounds (``run.est``, ``run.margin``) decide each tier."""

    def __init__(self, c: Candidates, run: "Runner", top: int, usable: float, frac: float, on: bool = True):
        self.c, self.run, self.top, self.usable, self.frac = c, run, top, usable, frac
        self.on = on and bool(tight_peak(np.inf, usable, frac))  # off at [memory] fragmentation_fraction >= 15%
        if self.on:  # per candidate, from the memory bounds with the runner's margin
            self.sure_tight = tight_peak(run.est.peak_lo / (1 + run.margin), usable, frac)
            self.sure_clear = ~tight_peak(run.est.peak_hi * (1 + run.margin), usable, frac)

    @classmethod
    def of(cls, cfg: Config, c: Candidates, run: "Runner") -> "Tiers":
        """The tiers of ``cfg``'s search: ``[search] top`` and ``headroom_tier``, the usable memory and
        ``[memory] fragmentation_fraction``."""
        return cls(c, run, cfg.search.top, usable_bytes(cfg.cluster, cfg.training),
                   cfg.memory.fragmentation_fraction, cfg.search.headroom_tier)

    def tight(self, i: int) -> Optional[bool]:
        """Candidate ``i``'s tier: True (tight), False (clear), None (memory not planned, bounds
        on both sides of the threshold)."""
        e = self.run.exact.get(i)
        if e is not None and e.complete:
            return bool(tight_peak(e.peak_bytes, self.usable, self.frac))
        return True if self.sure_tight[i] else False if self.sure_clear[i] else None

    def known(self, i: int) -> bool:
        """Whether candidate ``i`` may be ranked without planning its memory first."""
        return not self.on or self.tight(i) is not None

    def peaks(self, steps: dict[int, float]) -> dict[int, float]:
        """Planned peak memory (bytes) of the candidates of ``steps`` whose memory is planned."""
        return {i: self.run.exact[i].peak_bytes for i in steps if self.run.exact[i].complete}

    def rule(self, steps: dict[int, float]) -> list[int]:
        """The tie rule's order of every candidate of ``steps``, tiers aside."""
        return order_all(self.c, steps, peaks=self.peaks(steps))

    def order(self, steps: dict[int, float]) -> list[int]:
        """The ranking's order of ``steps`` (:func:`~meshplan.search.headroom.tier_order`; off: :meth:`rule`)."""
        if not self.on:
            return self.rule(steps)
        peaks = self.peaks(steps)
        return tier_order(steps, self.tight, lambda i: mesh_of(self.c, i),
                          lambda part: order_all(self.c, part, peaks=peaks))

    def rows(self, order: list[int]) -> list[int]:
        """The rows of the top table from :meth:`order`: each mesh's first candidate, the first ``top``."""
        return distinct(self.c, order)[:self.top]

    def open(self, left: np.ndarray, pending) -> bool:
        """Whether a candidate that could be clear is not ranked yet: one of ``left`` (the queue's
        candidates) or of ``pending`` (memory not planned) whose peak lower bound is not surely tight."""
        return self.on and (not self.sure_tight[left].all() or any(not self.sure_tight[i] for i in pending))

    def cut(self, steps: dict[int, float], open_clear: bool) -> float:
        """Step time (seconds) up to which every candidate must be ranked for the first ``top`` rows
        (module docstring): inf while they are not fixed. ``open_clear``: :meth:`open`."""
        if not self.on:
            return needed(best_of_meshes(self.c, steps), self.top)
        clear = {i: s for i, s in steps.items() if not self.tight(i)}
        meshes = best_of_meshes(self.c, clear)
        if len(meshes) >= self.top:
            return needed(meshes, self.top)
        if open_clear:
            return float("inf")
        have = {mesh_of(self.c, i) for i in clear}
        rest = {i: s for i, s in steps.items() if mesh_of(self.c, i) not in have}
        return needed(best_of_meshes(self.c, rest), self.top - len(meshes))

    def moved(self, steps: dict[int, float], rows: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """What the tiers changed against the rule's order of every candidate (:meth:`rule`): the
        first candidates of the meshes with no clear candidate that it puts before row 1's mesh
        (shown lower or left out), and (row, its mesh's first candidate by the rule, tight) where a
        row is shown at a clear setting instead. Empty without tiers."""
        if not self.on or not rows:
            return [], []
        by_rule = distinct(self.c, self.rule(steps))
        first = {mesh_of(self.c, i): i for i in by_rule}
        clear = {mesh_of(self.c, i) for i in steps if self.tight(i) is False}
        meshes = [mesh_of(self.c, i) for i in by_rule]
        past = [i for i in by_rule[:meshes.index(mesh_of(self.c, rows[0]))] if mesh_of(self.c, i) not in clear]
        safer = [(r, first[m]) for r in rows if (m := mesh_of(self.c, r)) in clear and first[m] != r
                 and self.tight(first[m])]
        return past, safer
