"""DualPipeV (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437, section
3.2.1, DualPipe; its V-shaped "cut-in-half" variant from github.com/deepseek-ai/DualPipe):
two chunks per rank in a V (:mod:`.vshape`), micro-batches fed from one end, the steady
state pairing a forward of one chunk with a backward of the other (DeepSeek overlaps the
pair's compute and communication; torch's runtime runs the pair's forward then its backward
unless a custom ``OVERLAP_F_B`` function is registered: :data:`PAIR_OVERLAP` for torchtitan's). torch:
``ScheduleDualPipeV`` (its order, torch 2.13), rank s of p, chunk 0 = virtual stage s,
chunk 1 = virtual stage 2p - 1 - s, m >= 2p micro-batches:

1. ``2(p - s - 1)`` forwards of chunk 0;
2. ``s + 1`` pairs F(chunk 0), F(chunk 1);
3. ``p - s - 1`` times: B(chunk 1) split (input gradient), its W, F(chunk 1);
4. ``m - 2p + s + 1`` times: F(chunk 0) with the full backward of chunk 1, then F(chunk 1)
   with the full backward of chunk 0;
5. ``p - s - 1`` times: the full backward of chunk 1, F(chunk 1) with that of chunk 0;
6. ``s + 1`` pairs of backwards, chunk 1 then chunk 0, full in the first half and split
   (input gradient only) from the middle on (chunk 1 first on odd ranks, chunk 0 on even);
7. ``p - s - 1`` times: a pending W, then a backward of chunk 0 (split once 6 switched);
8. the ``s + 1`` pending W, oldest first.

A full backward (torch ``FULL_BACKWARD``, input and weight gradients in one call, the input
gradient sent after both) is planned as B immediately followed by its W; a split one as B
with its W later (``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT``). Memory: every rank holds
``2p + 1`` chunk forwards at its peak (``in_flight``: p + 1/2 micro-batches of the stage's
layers, one chunk more than ZB-V). Bubble, run without overlap (torch's default) for uniform
chunks and F = B = W: ``(p - 1) / (6 m)``, as ZB-V (every rank idles (p - 1) F / 2); DeepSeek's
``(p/2 - 1)(F&B + B - 3W)`` assumes the pair's overlap, which the CPU runtime does not have.
Unequal times: the simulation.

torchtitan registers one (:data:`PAIR_OVERLAP`) where pp > 1 and ep > 1: this plan times the pairs
as torch's default runs them, forward then backward, and says so (:data:`PAIR_OVERLAP_NOT_TIMED`, the overlap itself not modelled yet).

>>> " ".join(u.label(2) for u in DUALPIPEV.order(2, 4, 2, 1))[:47]
'F0.c0 F0.c1 F1.c0 F1.c1 F2.c0 B0.c1 W0.c1 F2.c1'
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import Unit
from meshplan.pipeline.vshape import VShaped
from meshplan.spec.mesh import Schedule

#: What torchtitan runs for the pairs (pytorch/torchtitan e347b1e): ``distributed/pipeline_parallel.py``:216-219
#: registers ``overlap_callback`` for ``OVERLAP_F_B`` when ``parallelism.pipeline_parallel_expert_parallel_overlap``
#: (default true, ``config/job_config.py``:420; meshplan's ``training.pp_ep_overlap``) and the schedule is
#: ``ScheduleDualPipeV`` (torch 2.13 ``schedules.py`` ``add_overlap_f_b``: F of one chunk with the FULL_BACKWARD of
#: the other, steps 4 and 5 above). ``distributed/dual_pipe_v.py``:190-324 runs the backward in a second thread on
#: the same CUDA stream; ``DualPipeExpertParallel`` (:54-98) wraps each MoE layer's dispatch and combine in
#: ``SyncHook`` barriers (A -> dispatch -> B -> experts -> C -> combine -> D) that make the two threads alternate,
#: so one micro-batch's ep all-to-all runs on NCCL's stream while the other's compute runs, for the fewer of the two
#: chunks' MoE layers (``min_num_layers``). With activation checkpointing ``get_dual_pipe_v_flag`` (:32-53) raises
#: NotImplementedError (:func:`meshplan.plan_runtime.dualpipev_ep_ac_reasons`).
PAIR_OVERLAP = "torchtitan's OVERLAP_F_B callback (e347b1e distributed/dual_pipe_v.py:190-324)"
#: The note of a plan whose pairs torchtitan overlaps (:data:`PAIR_OVERLAP`) and this plan times one after the other.
PAIR_OVERLAP_NOT_TIMED = (f"DualPipeV with ep > 1 and training.pp_ep_overlap (torchtitan's "
                          f"pipeline_parallel_expert_parallel_overlap, default true): {PAIR_OVERLAP} runs each steady-"
                          f"state forward/backward pair in two threads, one micro-batch's ep all-to-alls beside the "
                          f"other's compute; meshplan times each pair forward then backward (torch's default), so the "
                          f"step's exposed ep is an upper bound there")


class DualPipeV(VShaped):
    name = Schedule.DUALPIPEV
    title = "DualPipeV"
    torch_class = "ScheduleDualPipeV"

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        out: list[Unit] = []
        nf, nb = [0, 0], [0, 0]  # per chunk: forwards, backwards issued
        pending: list[Unit] = []  # W of split backwards, oldest first

        def f(c: int) -> None:
            out.append(Unit("F", nf[c], c))
            nf[c] += 1

        def b(c: int, split: bool) -> None:
            out.append(Unit("B", nb[c], c))
            (pending if split else out).append(Unit("W", nb[c], c))
            nb[c] += 1

        def w() -> None:
            if pending:
                out.append(pending.pop(0))

        for _ in range(2 * (p - s - 1)):
            f(0)
        for _ in range(s + 1):
            f(0)
            f(1)
        for _ in range(p - s - 1):
            b(1, True)
            w()
            f(1)
        for i in range(m - 2 * p + s + 1):
            f(0)
            b(1, False)
            f(1)
            b(0, False)
        for _ in range(p - s - 1):
            b(1, False)
            f(1)
            b(0, False)
        split, half = False, (s + 1) // 2
        for i in range(s + 1):
            split = split or (i == half and s % 2 == 1)
            b(1, split)
            split = split or (i == half and s % 2 == 0)
            b(0, split)
        for _ in range(p - s - 1):
            w()
            b(0, split)
        for _ in range(s + 1):
            w()
        return out

    def warmup(self, p, m, v, s):
        """Chunk forwards before the first backward: ``2(p - s - 1) + 2(s + 1) = 2p``, and
        on the last rank (no step 3) the first F(chunk 0) of step 4 too."""
        return np.minimum(2 * p + (s == p - 1), 2 * m)

    def in_flight(self, p, m, v, s):
        """Chunk forwards held at the peak (F done, B not yet): ``2p + 1`` on every rank
        (step 4 runs F(chunk 0) before the backward of chunk 1), at most the ``2m``."""
        return np.minimum(2 * p + 1 + 0 * s, 2 * m)

    def bubble(self, p, m, v=2, forward_s=1.0, backward_s=2.0, weight_s=0.0) -> float:
        """``(p - 1) / (6 m)`` for F = B = W (see the module docstring); NaN otherwise (no
        closed form: the simulation gives it)."""
        if not forward_s == backward_s == weight_s:
            return float("nan")
        return (p - 1) / (6 * m)

    def refused(self, p, m, framework: str = "torch"):
        """``ScheduleDualPipeV.__init__`` (torch 2.13) raises when m < its 2p stages; ints or
        arrays.

        >>> bool(DUALPIPEV.refused(4, 7)), bool(DUALPIPEV.refused(4, 8))
        (True, False)
        """
        return m < 2 * p

    def reasons(self, p: int, m: int, v: int, framework: str = "torch") -> list[str]:
        out = super().reasons(p, m, v, framework)
        if m and self.refused(p, m, framework):
            out.append(f"DualPipeV needs micro-batches ({m}) >= 2 pp ({2 * p}) (torch ScheduleDualPipeV)")
        return out


DUALPIPEV = DualPipeV()
