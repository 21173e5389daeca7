"""ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 6):
two chunks per rank in a V (:mod:`.vshape`: rank s holds virtual stages s and 2p - 1 - s),
backward split into input gradient (B) and weight gradient (W). torch:
``ScheduleZBVZeroBubble`` (its order, torch 2.13): with ``n = max(m, 2p - 1)`` micro-batch
slots (units of micro-batches >= m are dropped, so m < 2p - 1 leaves holes), rank s runs

1. ``2(p - s) - 1`` forwards of chunk 0;
2. s pairs F(chunk 1), F(chunk 0);
3. ``p - s`` triples F, B, W of chunk 1 (the V's turn: rank p - 1 feeds its own chunk 1);
4. steady state until every chunk-0 forward of the n slots is done and chunk 1 has caught
   up: F (chunk 0, while any is left), B, W of chunk 0, then F, B, W of chunk 1;
5. cool-down: s pairs B(chunk 0), B(chunk 1); ``p - s`` pairs B(chunk 0), W(chunk 0);
   the remaining W of chunk 1, then of chunk 0.

Memory: every rank holds ``2p`` chunk forwards (p micro-batches of the stage's layers) at its
peak, as 1F1B's first stage does (paper section 6: ZB-V keeps 1F1B's peak activation memory,
now on every rank); with m < 2p - 1, ``min(2m, m + s + 1)``.

Bubble, for uniform chunks (F, B, W a stage's times for one micro-batch, a chunk half of
them) and no p2p time: with F = B = W every rank idles ``(p - 1) F / 2`` (rank s's first
forward waits for s chunk forwards upstream; the cool-down is filled with W), bubble
``(p - 1) / (6 m)``, a sixth of 1F1B's ``(p - 1) / m``. Unequal times have no closed form
here: the simulation (``meshplan step``) of this order gives them.

Under FSDP2 over a data axis with ``reshard_after_forward`` true torch 2.13 gets this schedule's
gradients wrong, as DualPipeV's: :data:`meshplan.pipeline.vshape.RESHARD_DEFECT` (why and the
measurements), the rule ``v-reshard`` the search, the plan's warning and validate share.

>>> " ".join(u.label(2) for u in ZBV.order(2, 3, 2, 1))
'F0.c0 F0.c1 F1.c0 F1.c1 B0.c1 W0.c1 F2.c0 B0.c0 W0.c0 F2.c1 B1.c1 W1.c1 B1.c0 B2.c1 B2.c0 W1.c0 W2.c1 W2.c0'
>>> [int(ZBV.in_flight(4, 8, 2, s)) for s in range(4)], ZBV.last_stage(4, 2)
([8, 8, 8, 8], 0)
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import Unit
from meshplan.pipeline.vshape import VShaped
from meshplan.spec.mesh import Schedule


class ZBVZeroBubble(VShaped):
    name = Schedule.ZBV
    title = "ZB-V"
    torch_class = "ScheduleZBVZeroBubble"

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        n = max(m, 2 * p - 1)
        out: list[Unit] = []
        nf, nb, nw = [0, 0], [0, 0], [0, 0]  # per chunk: forwards, input grads, weight grads issued

        def run(kind: str, c: int) -> None:
            count = {"F": nf, "B": nb, "W": nw}[kind]
            out.append(Unit(kind, count[c], c))
            count[c] += 1

        for _ in range(2 * (p - s) - 1):
            run("F", 0)
        for _ in range(s):
            run("F", 1)
            run("F", 0)
        for _ in range(p - s):
            run("F", 1)
            run("B", 1)
            run("W", 1)
        while nf[1] < nf[0] or nf[0] < n:
            if nf[0] < n:
                run("F", 0)
            run("B", 0)
            run("W", 0)
            run("F", 1)
            run("B", 1)
            run("W", 1)
        for _ in range(s):
            run("B", 0)
            run("B", 1)
        for _ in range(p - s):
            run("B", 0)
            run("W", 0)
        for c in (1, 0):
            while nw[c] < nb[c]:
                run("W", c)
        return [u for u in out if u.mb < m]

    def warmup(self, p, m, v, s):
        """Chunk forwards held before the first backward: ``2p``; with fewer micro-batches
        than the order's ``2p - 1`` slots, ``min(2m, m + s + 1)`` (chunk 0's m forwards and
        the s + 1 of chunk 1 that precede its first B)."""
        return np.minimum(2 * p, np.minimum(2 * m, m + s + 1))

    def in_flight(self, p, m, v, s):
        """Chunk forwards held at the peak: the warm-up's (the steady state trades one F for
        one B), ``min(2p, 2m, m + s + 1)``, counted on the order in the tests."""
        return self.warmup(p, m, v, s)

    def bubble(self, p, m, v=2, forward_s=1.0, backward_s=2.0, weight_s=0.0) -> float:
        """``(p - 1) / (6 m)`` for F = B = W (see the module docstring); NaN otherwise (no
        closed form: the simulation gives it)."""
        if not forward_s == backward_s == weight_s:
            return float("nan")
        return (p - 1) / (6 * m)


ZBV = ZBVZeroBubble()
