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


#: What torch 2.13's ``ScheduleZBVZeroBubble`` does with FSDP2 over a data axis, measured by
#: ``meshplan validate`` (pp 2 x dp_shard 2, 4 layers; its refusal and the plan's warning,
#: :meth:`ZBVZeroBubble.warnings`, quote it; the search rejects such rows, rule ``zbv-fsdp``,
#: :meth:`ZBVZeroBubble.fsdp2_defect`).
#:
#: Why, read in torch's source (torch 2.13.0 as installed, torch/distributed/pipelining/, the same
#: code as pytorch/pytorch's schedules.py at 00722e648b74 for what is cited here; re-checked
#: 2026-12-05): the schedule itself issues both reductions. ``ScheduleZBVZeroBubble`` and
#: ``ScheduleDualPipeV`` both run on ``_PipelineScheduleRuntime``, whose lowering ``_add_reduce_grad``
#: puts one ``REDUCE_GRAD`` per stage index after that stage's m-th ``W`` or ``B``, and
#: ``REDUCE_GRAD`` is ``stage.perform_reduce_grad``: ``set_requires_gradient_sync(True)``, then
#: ``post_backward()`` on every FSDP param group of the stage module, which reduce-scatters the
#: groups that hold a gradient and skips those without (every ``I``/``W``/``B`` before it ran under
#: ``backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)``). The gradients are what
#: is missing: ZB-V runs every chunk's backward as ``I`` (``backward_one_chunk(full_backward=False)``
#: -> ``stage_backward_input(..., self.submod.parameters())``) then ``W``
#: (``stage_backward_weight``), and ``stage_backward_input`` looks the weights' gradient
#: accumulators up in the autograd graph *before* its backward runs, i.e. before FSDP's
#: pre-backward all-gather swaps the unsharded parameters back in. A layer unit resharded after
#: its forward (``reshard_after_forward`` true) is then a sharded DTensor whose accumulator is not
#: in the graph, so its param group is empty and ``W`` computes no weight gradient. In ZB-V's
#: order every ``I`` of chunk 1 on pp rank 0 follows a forward of that chunk (the warm-up and
#: steady-state triples F, I, W), so its layer units never get one and are never reduce-scattered;
#: rank 0's chunk 0 is stage 0, whose ``I`` is skipped (``if not self.is_first``) and whose ``W`` is a
#: full backward, so it is reduced once: the measurement. A run on torch 2.13
#: (tests/test_zbv_fsdp_torch.py: pp 2 as two gloo processes, a V of four one-layer ``fully_shard``
#: stages, 4 micro-batches, against a plain backward) agrees: with ``reshard_after_forward`` true
#: ZB-V leaves rank 0's stage 3 gradient None and rank 1's two stages short of some micro-batches,
#: and is exact with it false; DualPipeV, whose reduce-scatters all run (what ``validate``
#: compares), gets rank 0's stage 3 short too with it true, and is exact with it false. The rule and
#: the warning keep the condition ``validate`` measured (ZB-V, FSDP2 over a data axis, any
#: ``reshard_after_forward``); that run says the defect follows ``reshard_after_forward`` true and
#: reaches DualPipeV, which neither covers yet.
FSDP2_DEFECT = ("torch 2.13's ScheduleZBVZeroBubble reduce-scattered one of pp rank 0's two layer units once per "
                "step and the other never (measured: pp 2 x dp_shard 2, 4 layers), unlike the plan's table; "
                "dualpipev reduces both")


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

    def fsdp2_defect(self, framework: str, p, fsdp2_over_data):
        """Whether :data:`FSDP2_DEFECT` applies: framework torch, ``p`` > 1 stages and FSDP2 over
        a data axis (zero3 or hsdp with fsdp x dp_replicate > 1; ``p`` and ``fsdp2_over_data`` ints
        and bools, or arrays of them: the search's rule ``zbv-fsdp`` over its columns and
        :meth:`warnings` over one plan are this one formula).

        >>> ZBV.fsdp2_defect("torch", np.array([1, 2, 2]), np.array([True, True, False])).tolist()
        [False, True, False]
        """
        return (framework == "torch") & (np.asarray(p) > 1) & np.asarray(fsdp2_over_data, dtype=bool)

    def warnings(self, framework: str, p: int, fsdp2_over_data: bool) -> tuple[str, ...]:
        """Under framework torch with pp > 1 and FSDP2 over a data axis (:meth:`fsdp2_defect`):
        :data:`FSDP2_DEFECT` (``meshplan validate`` refuses the mesh for it, ``meshplan search``
        rejects such rows, rule ``zbv-fsdp``).

        >>> ZBV.warnings("torch", 4, False), len(ZBV.warnings("torch", 4, True))
        ((), 1)
        """
        if not self.fsdp2_defect(framework, p, fsdp2_over_data):
            return ()
        return (f"zbv with FSDP2 over a data axis under framework torch: {FSDP2_DEFECT}; meshplan validate refuses "
                "this mesh, and the predicted gradients, collectives and step are not what torch runs",)

    def bubble(self, p, m, v=2, forward_s=1.0, backward_s=2.0, weight_s=0.0) -> float:
        """``(p - 1) / (6 m)`` for F = B = W (see the module docstring); NaN otherwise (no
        closed form: the simulation gives it)."""
        if not forward_s == backward_s == weight_s:
            return float("nan")
        return (p - 1) / (6 * m)


ZBV = ZBVZeroBubble()
