"""Interleaved 1F1B (Narayanan et al. SC'21 2.2.2; Megatron-LM
``forward_backward_pipelining_with_interleaving``, Megatron-Core order; torch
``ScheduleInterleaved1F1B``): stage s holds the looped chunks ``s, s + p, ...`` (virtual
stage ``chunk p + s``); ``m v`` chunk units in rounds of ``g`` micro-batches per chunk
(:func:`~.base.per_round`: g = p when p divides m); forward unit k runs micro-batch
``(k // (g v)) g + k mod g`` on chunk ``(k mod g v) // g``, backward unit k the chunk
``v - 1 -`` that; warm-up ``min(m v, 2 (p - s - 1) + (v - 1) g)`` units (Megatron-Core;
torch's ``_get_warmup_ops`` with ``microbatches_per_round`` g), then 1F1B over units. Needs
v > 1 and, by framework (:meth:`Interleaved1F1B.reasons`): Megatron-LM m a multiple of p;
torch 2.13 m a multiple of its rounds ``max(1, m // p)`` (m 6 at p 4: one round of 6;
m 10: two of 5). Bubble ``(p - 1) / (v m)`` when p divides m. Older Megatron-LM ran every
unit as warm-up when m == p (same bubble, more activation memory): not reproduced.

>>> " ".join(u.label(2) for u in INTERLEAVED.order(2, 2, 2, 1))
'F0.c0 F1.c0 F0.c1 B0.c1 F1.c1 B1.c1 B0.c0 B1.c0'
>>> int(INTERLEAVED.in_flight(4, 8, 2, 0)), int(INTERLEAVED.in_flight(4, 8, 2, 3))
(11, 5)
>>> " ".join(u.label(2) for u in INTERLEAVED.order(4, 3, 2, 3))  # torch: one round of 3
'F0.c0 F1.c0 F2.c0 F0.c1 B0.c1 F1.c1 B1.c1 F2.c1 B2.c1 B0.c0 B1.c0 B2.c0'
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import PipelineSchedule, Unit, per_round, torch_rounds
from meshplan.spec.mesh import Schedule


class Interleaved1F1B(PipelineSchedule):
    name = Schedule.INTERLEAVED_1F1B
    title = "interleaved 1F1B"
    torch_class = "ScheduleInterleaved1F1B"
    virtual_stages = True
    megatron_p2p = True

    def warmup(self, p, m, v, s):
        """``min(m v, 2 (p - s - 1) + (v - 1) g)`` chunk forwards, g micro-batches per round
        (:func:`~.base.per_round`; Megatron-Core's with g = p; torch's ``_get_warmup_ops``,
        factor 2)."""
        return np.minimum(m * v, 2 * (p - s - 1) + (v - 1) * per_round(p, m))

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        total, g = m * v, int(per_round(p, m))

        def unit(kind: str, k: int) -> Unit:
            chunk = (k % (g * v)) // g
            return Unit(kind, (k // (g * v)) * g + k % g, chunk if kind == "F" else v - 1 - chunk)

        warm = int(self.warmup(p, m, v, s))
        out = [unit("F", k) for k in range(warm)]
        for k in range(total - warm):
            out += [unit("F", warm + k), unit("B", k)]
        return out + [unit("B", k) for k in range(total - warm, total)]

    def send_delay(self, p: int, m: int, v: int, s: int, length: int) -> np.ndarray:
        """Megatron-LM 2022 (``forward_backward_pipelining_with_interleaving``, e.g. commit
        2755bcb of NVIDIA/Megatron-LM, ``megatron/schedules.py``): each warm-up forward is
        followed by ``send_forward_recv_forward``; in the steady state a forward and the
        backward after it run first, then one ``send_forward_backward_recv_forward_backward``
        sends both outputs, so a steady-state forward's output leaves one unit later;
        cool-down backwards send right after.

        >>> INTERLEAVED.send_delay(2, 2, 2, 1, 8).tolist()
        [0, 0, 1, 0, 1, 0, 0, 0]
        """
        warm, total = int(self.warmup(p, m, v, s)), m * v
        out = np.zeros(length, dtype=np.int64)
        out[warm:warm + 2 * (total - warm):2] = 1
        return out

    def recv_lead(self, p: int, m: int, v: int, s: int, length: int) -> np.ndarray:
        """Megatron-LM 2022 (``forward_backward_pipelining_with_interleaving``, commit 2755bcb,
        ``megatron/schedules.py``): the last warm-up call and every steady-state
        ``send_forward_backward_recv_forward_backward`` (issued after the pair's backward) also
        receive the output gradient of the next backward, which runs after the next forward: a
        steady-state backward's receive is posted two units before it; every other receive in
        the call right before its unit.

        >>> INTERLEAVED.recv_lead(2, 2, 2, 1, 8).tolist()  # F0.c0 F1.c0 F0.c1 B0.c1 F1.c1 B1.c1 B0.c0 B1.c0
        [1, 1, 1, 2, 1, 2, 1, 1]
        """
        warm, total = int(self.warmup(p, m, v, s)), m * v
        out = np.ones(length, dtype=np.int64)
        out[warm + 1:warm + 2 * (total - warm):2] = 2
        return out

    def p2p_calls(self, p: int, m: int, v: int, s: int, length: int, overlap: bool = False):
        """:meth:`~.base.PipelineSchedule.p2p_calls`; with ``overlap`` Megatron-LM's
        ``overlap_p2p_comm`` (``forward_backward_pipelining_with_interleaving``,
        megatron/core/pipeline_parallel/schedules.py at NVIDIA/Megatron-LM d98e8a6): the warm-up
        forwards still send in a waited ``send_forward_recv_forward`` after each (lines 1633-1661:
        ``wait_on_reqs``), the last of them receiving the first steady-state forward's input, and
        the cool-down backwards in a waited ``send_backward_recv_backward`` (lines 2042-2048);
        the steady state issues each unit's send and the next same-direction unit's receive
        without waiting (``pp_post_forward`` / ``pp_post_backward``, lines 1771-1880,
        ``overlap_p2p_comm=True``: ``_communicate(wait_on_reqs=False)``, p2p_communication.py
        lines 607-626) and waits for a receive just before the unit that needs it
        (``pp_pre_forward`` / ``pp_pre_backward``; the first cool-down backward's receive, issued
        by the last steady-state backward, at line 1975); the first steady-state backward's
        receive is issued after the last warm-up call (lines 1697-1723). So a steady-state
        unit's receive is posted two units before it (after the previous unit of its direction),
        the first cool-down backward's one unit before. When every unit is warm-up (m v at most
        the warm-up) every call waits, as without overlap.

        >>> [x.astype(int).tolist() for x in INTERLEAVED.p2p_calls(2, 2, 2, 1, 8, overlap=True)]
        [[0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 2, 2, 2, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0]]
        """
        if not overlap:
            return super().p2p_calls(p, m, v, s, length)
        warm, total = int(self.warmup(p, m, v, s)), m * v
        delay, lead = np.zeros(length, dtype=np.int64), np.ones(length, dtype=np.int64)
        send_async, recv_async = np.zeros(length, dtype=bool), np.zeros(length, dtype=bool)
        steady = slice(warm, 2 * total - warm)
        if total > warm:
            send_async[steady] = True
            lead[warm + 1:2 * total - warm] = 2  # every steady-state unit after the first forward
            recv_async[warm + 1:2 * total - warm + 1] = True  # ... and the first cool-down backward
        return delay, lead, send_async, recv_async

    def chunk_forwards(self, g, v, n, chunk: int = 0):
        """Forward units of local ``chunk`` among the first ``n`` of a stage (ints or arrays):
        each round of ``g v`` units (g micro-batches per round, :func:`~.base.per_round`) runs
        g of each chunk, chunk 0 first.

        >>> int(INTERLEAVED.chunk_forwards(4, 2, 11)), int(INTERLEAVED.chunk_forwards(4, 2, 11, chunk=1))
        (7, 4)
        """
        return (n // (g * v)) * g + np.clip(n % (g * v) - chunk * g, 0, g)

    def bubble(self, p, m, v=1, forward_s=1.0, backward_s=2.0, weight_s=0.0) -> float:
        """``(p - 1) / (v m)`` (Narayanan et al. 2.2.2) when p divides m; NaN for torch's
        other rounds (no closed form here: the simulation gives it)."""
        return (p - 1) / (v * m) if m % p == 0 else float("nan")

    def refused(self, p, m, framework: str = "torch"):
        """Whether ``framework``'s runtime refuses ``m`` micro-batches at ``p`` stages (ints
        or arrays; the one formula :meth:`reasons` and the search's rule use): Megatron-LM
        when p does not divide m (2022's ``forward_backward_pipelining_with_interleaving``
        asserts it; Megatron-Core's with its default ``microbatch_group_size_per_vp_stage``
        = p refuses a last group of 0 < m mod p < p micro-batches,
        megatron/core/pipeline_parallel/schedules.py); torch 2.13 when its rounds
        (:func:`~.base.torch_rounds`) do not divide m (``ScheduleInterleaved1F1B.__init__``).

        >>> [bool(INTERLEAVED.refused(4, m)) for m in (3, 6, 9, 10)], bool(INTERLEAVED.refused(4, 6, "megatron"))
        ([False, False, True, False], True)
        """
        if framework == "megatron":
            return m % p != 0
        return m % torch_rounds(p, m) != 0

    def reasons(self, p: int, m: int, v: int, framework: str = "torch") -> list[str]:
        out = []
        if m and self.refused(p, m, framework):
            out.append(f"interleaved 1F1B needs micro-batches ({m}) divisible by pp ({p}) (Megatron-LM)"
                       if framework == "megatron" else
                       f"interleaved 1F1B needs micro-batches ({m}) a multiple of torch's rounds max(1, m // pp "
                       f"{p}) = {int(torch_rounds(p, m))} (torch ScheduleInterleaved1F1B)")
        if v == 1 and p > 1:
            out.append("interleaved 1F1B needs virtual_stages > 1")
        return out


INTERLEAVED = Interleaved1F1B()
