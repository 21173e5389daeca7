"""Interleaved 1F1B (Narayanan et al. SC'21 2.2.2; Megatron-LM
``forward_backward_pipelining_with_interleaving``, Megatron-Core order): stage s holds the
looped chunks ``s, s + p, ...`` (virtual stage ``chunk p + s``); ``m v`` chunk units;
forward unit k runs micro-batch ``(k // (p v)) p + k mod p`` on chunk ``(k mod p v) // p``,
backward unit k the chunk ``v - 1 -`` that; warm-up ``min(m v, 2 (p - s - 1) + (v - 1) p)``
units (Megatron-Core; torch's ``_get_warmup_ops`` with micro-batches per round p), then
1F1B over units. Needs m a multiple of p and v > 1. Bubble ``(p - 1) / (v m)``. Older
Megatron-LM ran every unit as warm-up when m == p (same bubble, more activation memory):
not reproduced. torch: ``ScheduleInterleaved1F1B``.

>>> " ".join(u.label(2) for u in INTERLEAVED.order(2, 2, 2, 1))
'F0.c0 F1.c0 F0.c1 B0.c1 F1.c1 B1.c1 B0.c0 B1.c0'
>>> int(INTERLEAVED.in_flight(4, 8, 2, 0)), int(INTERLEAVED.in_flight(4, 8, 2, 3))
(11, 5)
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import PipelineSchedule, Unit
from meshplan.spec.mesh import Schedule


class Interleaved1F1B(PipelineSchedule):
    name = Schedule.INTERLEAVED_1F1B
    title = "interleaved 1F1B"
    torch_class = "ScheduleInterleaved1F1B"
    virtual_stages = True
    megatron_p2p = True

    def warmup(self, p, m, v, s):
        """``min(m v, 2 (p - s - 1) + (v - 1) p)`` chunk forwards (Megatron-Core)."""
        return np.minimum(m * v, 2 * (p - s - 1) + (v - 1) * p)

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        total = m * v

        def unit(kind: str, k: int) -> Unit:
            chunk = (k % (p * v)) // p
            return Unit(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

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

    def chunk_forwards(self, p, v, n, chunk: int = 0):
        """Forward units of local ``chunk`` among the first ``n`` of a stage (ints or arrays):
        each round of ``p v`` units runs p of each chunk, chunk 0 first.

        >>> int(INTERLEAVED.chunk_forwards(4, 2, 11)), int(INTERLEAVED.chunk_forwards(4, 2, 11, chunk=1))
        (7, 4)
        """
        return (n // (p * v)) * p + np.clip(n % (p * v) - chunk * p, 0, p)

    def bubble(self, p, m, v=1, forward_s=1.0, backward_s=2.0, weight_s=0.0) -> float:
        return (p - 1) / (v * m)

    def reasons(self, p: int, m: int, v: int) -> list[str]:
        out = []
        if m and m % p:
            out.append(f"interleaved 1F1B needs micro-batches ({m}) divisible by pp ({p})")
        if v == 1 and p > 1:
            out.append("interleaved 1F1B needs virtual_stages > 1")
        return out


INTERLEAVED = Interleaved1F1B()
