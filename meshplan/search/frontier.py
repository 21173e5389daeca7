"""The exact ranking's queue (:func:`meshplan.search.driver.search`, step 6): the candidates
not planned yet, in increasing order of their step-time lower bound, each bound tightened
just before the candidate would be planned.

The vectorised bound (:func:`meshplan.search.timing.step_lower_bound`) is loose where the
pipeline schedule matters (interleaved stages, FSDP gathers per pass): on Llama-3-405B over
16,384 H100 it sits 15-20% under the simulated step of pp 2 HSDP candidates with vpp 3 or
7, so without tightening the ranking simulates some 130 of them that cannot enter the top.
The tighter bound (:func:`meshplan.search.estimate.refine`: the exact pipeline schedule on
unit bounds, :mod:`meshplan.search.pipeline`) costs about 1 ms a candidate against 0.1-0.3 s
for an exact plan, so the queue tightens each candidate when it reaches the front and
re-sorts: a candidate whose tighter bound exceeds the stopping threshold is then never
planned. Tightening only raises a bound that stays a lower bound, so the stopping rule
(every candidate left has a bound above the threshold) keeps the top exact.

>>> import numpy as np
>>> lo = np.array([1.0, 2.0, 3.0, 4.0])
>>> def tighten(idx):  # candidate 0's tighter bound is 3.5
...     lo[idx[idx == 0]] = 3.5
>>> q = Frontier(np.arange(4), lo, tighten, np.zeros(4, bool), block=2, most=10)
>>> q.next_bound(1), [int(i) for i in q.pop(2)], q.next_bound(1)
(2.0, [1, 2], 3.5)
"""

from __future__ import annotations

from typing import Callable

import numpy as np


class Frontier:
    """Candidates ``idx`` ordered by ``lo`` (seconds, indexed by candidate; tightened in
    place by ``tighten(indices)``); ``tight``: candidates whose bound is already tightened
    (indexed by candidate, updated in place); ``block``: candidates tightened at once (one
    call per pipeline depth group is the fixed cost); ``most``: the most candidates
    tightened in all (``[search] refine_max``, those already tight included)."""

    def __init__(self, idx: np.ndarray, lo: np.ndarray, tighten: Callable[[np.ndarray], None], tight: np.ndarray,
                 block: int, most: int):
        self.lo, self.tighten, self.tight = lo, tighten, tight
        self.block, self.left = max(1, block), max(0, most - int(tight.sum()))
        self.rest = np.asarray(idx)[np.argsort(lo[idx], kind="stable")]

    def __len__(self) -> int:
        return len(self.rest)

    def next_bound(self, k: int) -> float:
        """The smallest bound left (seconds; inf when none), after tightening until the
        first ``k`` candidates of the queue are tight (or ``most`` is spent)."""
        self._front(k)
        return float(self.lo[self.rest[0]]) if len(self.rest) else float("inf")

    def pop(self, k: int) -> np.ndarray:
        """The first ``k`` candidates of the queue, removed from it, after tightening them."""
        self._front(k)
        out, self.rest = self.rest[:k], self.rest[k:]
        return out

    def _front(self, k: int) -> None:
        while self.left > 0:
            head = self.rest[:max(k, 1)]
            if self.tight[head].all():
                return
            near = self.rest[:max(k, self.block)]
            todo = near[~self.tight[near]][:self.left]
            self.tighten(todo)
            self.tight[todo] = True
            self.left -= len(todo)
            self.rest = self.rest[np.argsort(self.lo[self.rest], kind="stable")]
