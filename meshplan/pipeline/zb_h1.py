"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section
3.1): 1F1B's warm-up and F/B pairs with the backward split into input gradient (B) and
weight gradient (W); stage s runs W of micro-batch j after B of j + s, the remaining W at
the end. Per stage idle ``(p-1)(F+B-W)`` against 1F1B's ``(p-1)(F+B+W)``: bubble
``(p-1)(F+B-W) / (m(F+B+W))`` for m >= p and W <= min(F, B); ``(p-1)/(3m)`` when F = B = W.
Every stage holds ``min(m, p)`` micro-batches from F to W (``p-s-1`` warm-up + ``s+1`` lagged W;
:meth:`ZBH1.in_flight`), of which ``min(m, s + 1)`` have run B (:meth:`ZBH1.lagging_weights`); torch's
I frees no saved activation (:mod:`meshplan.memory.wlag`), so the memory timeline frees them at W. torch:
``ScheduleInterleavedZeroBubble`` with one stage per rank (torch calls it ZB1P); not built
by ``meshplan validate``. torch refuses m that is not a multiple of its rounds
``max(1, m // p)`` (:func:`~.base.torch_rounds`; with one chunk the rounds do not change
the order). With more than one stage per rank (what torchtitan builds for it: a multi-stage
schedule gets 2 stages per rank unless ``module_fqns_per_model_part`` says otherwise) it is
not planned: :func:`meshplan.spec.mesh.multi_stage_refusal` is the one message every entry point gives.
Under FSDP2 with ``reshard_after_forward`` true its split backward loses weight gradients, as the
V-shaped schedules' does (:data:`RESHARD_DEFECT`, :meth:`ZBH1.warnings`).

>>> " ".join(u.label() for u in ZB_H1.order(3, 4, 1, 1))
'F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3'
>>> round(ZB_H1.bubble(4, 8, forward_s=1, backward_s=1, weight_s=1), 4)  # (p-1)/(3m)
0.125
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import PipelineSchedule, Unit, torch_rounds
from meshplan.pipeline.vshape import RESHARD_FIX, reshard_defect
from meshplan.spec.mesh import Schedule

#: What torch 2.13's ``ScheduleInterleavedZeroBubble`` (one stage per rank) does with FSDP2 over a
#: data axis and ``reshard_after_forward`` true: the defect :data:`meshplan.pipeline.vshape.RESHARD_DEFECT`
#: reads in torch's source, on the same runtime. The class is a ``_PipelineScheduleRuntime``
#: (torch/distributed/pipelining/schedules.py, torch 2.13.0 as installed) whose order has an ``I``
#: (``BACKWARD_INPUT``: ``backward_one_chunk(full_backward=False)`` -> ``stage_backward_input``) and a
#: ``W`` for every stage but the first; the ``I`` collects the weights' gradient accumulators before
#: FSDP's pre-backward all-gather swaps the unsharded parameters in, so a layer unit resharded after
#: its forward gets no weight gradient from ``W``. Measured (torch 2.13, pp 2, one ``fully_shard``
#: ``Linear`` stage per rank, 4 micro-batches, against one process's plain backward:
#: tests/test_zbh1_fsdp_torch.py): with ``reshard_after_forward`` true stage 1's weight gradient is
#: None, stage 0's exact (its ``I`` is skipped, its ``W`` a full backward); with it false both exact.
RESHARD_DEFECT = ("torch 2.13's ScheduleInterleavedZeroBubble splits the backward of every stage but the first "
                  "into I and W, and its I (stage_backward_input) collects the weights before FSDP's all-gather, "
                  "so a layer unit resharded after its forward gets no weight gradient (measured at pp 2: stage 1's "
                  "weight gradient None; exact with reshard_after_forward false)")


class ZBH1(PipelineSchedule):
    name = Schedule.ZB_H1
    title = "ZB-H1"
    torch_class = "ScheduleInterleavedZeroBubble"
    runs_in_validate = False
    splits_backward = True
    frees_at_weight = True
    chunked = Schedule.INTERLEAVED_1F1B

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        w = int(self.warmup(p, m, 1, s))
        out = [Unit("F", i) for i in range(w)]
        nf, nw = w, 0
        for nb in range(m):
            if nf < m:
                out.append(Unit("F", nf))
                nf += 1
            out.append(Unit("B", nb))
            if nb + 1 - nw > s:
                out.append(Unit("W", nw))
                nw += 1
        return out + [Unit("W", j) for j in range(nw, m)]

    def refused(self, p, m, framework: str = "torch"):
        """``ScheduleInterleavedZeroBubble.__init__`` (torch 2.13) raises when its rounds
        ``max(1, m // p)`` do not divide m (p 2, m 5: 2 rounds); ints or arrays.

        >>> bool(ZB_H1.refused(2, 5)), bool(ZB_H1.refused(4, 6)), bool(ZB_H1.refused(4, 9))
        (True, False, True)
        """
        return m % torch_rounds(p, m) != 0

    def reasons(self, p: int, m: int, v: int, framework: str = "torch") -> list[str]:
        if v > 1 or not m or not self.refused(p, m, framework):  # v > 1: the interleaved order's own rule
            return []
        return [f"ZB-H1 needs micro-batches ({m}) a multiple of torch's rounds max(1, m // pp {p}) = "
                f"{int(torch_rounds(p, m))} (torch ScheduleInterleavedZeroBubble)"]

    def warnings(self, framework: str, p: int, fsdp2_over_data: bool, reshard_after_forward: bool) -> tuple[str, ...]:
        """:data:`RESHARD_DEFECT` where :func:`~meshplan.pipeline.vshape.reshard_defect` holds (framework
        torch, p > 1, FSDP2 over a data axis, ``reshard_after_forward`` true), one line with its fix;
        ``meshplan validate`` builds no zb_h1 and the search plans none, so no refusal is needed there.

        >>> len(ZB_H1.warnings("torch", 4, True, True)), ZB_H1.warnings("torch", 4, True, False)
        (1, ())
        >>> ZB_H1.warnings("megatron", 4, True, True), ZB_H1.warnings("torch", 4, False, True)
        ((), ())
        """
        if not reshard_defect(framework, p, fsdp2_over_data, reshard_after_forward):
            return ()
        return (f"{self.name} with FSDP2 over a data axis and reshard_after_forward true under framework torch: "
                f"{RESHARD_DEFECT}; fix: {RESHARD_FIX}",)

    def in_flight(self, p, m, v, s):
        """Micro-batches stage ``s`` holds from F to W at its peak: ``min(m, p)`` on every stage
        (``p - s - 1`` warm-up forwards, the steady state's F, and the ``s`` whose W lags; torch
        2.13's ``ScheduleInterleavedZeroBubble`` order, tests/test_zbh1_memory.py), against 1F1B's
        ``min(m, p - s)`` from F to B.

        >>> [int(ZB_H1.in_flight(4, 8, 1, s)) for s in range(4)], int(ZB_H1.in_flight(4, 2, 1, 3))
        ([4, 4, 4, 4], 2)
        """
        return np.minimum(m, p) + 0 * np.asarray(s)

    def lagging_weights(self, p, m, v, s):
        """Most micro-batches of stage ``s`` whose B is done and W not: ``min(m, s + 1)``, at each
        W of the steady state (W of j runs after B of j + s, :meth:`order`; torch's order the same).

        >>> [int(ZB_H1.lagging_weights(4, 8, 1, s)) for s in range(4)], int(ZB_H1.lagging_weights(4, 2, 1, 3))
        ([1, 2, 3, 4], 2)
        """
        return np.minimum(m, np.asarray(s) + 1)

    def bubble(self, p, m, v=1, forward_s=1.0, backward_s=2.0, weight_s=0.0) -> float:
        f, b, w = forward_s, backward_s, weight_s
        return (p - 1) * (f + b - w) / (m * (f + b + w))


ZB_H1 = ZBH1()

