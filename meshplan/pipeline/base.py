"""What one pipeline schedule owns: :class:`Unit` (an F, B or W op of one micro-batch on one
model chunk) and :class:`PipelineSchedule`, the base of every schedule module
(:mod:`.gpipe`, :mod:`.one_f_one_b`, :mod:`.interleaved`, :mod:`.zb_h1`, :mod:`.zbv`,
:mod:`.dualpipev`).

Notation: ``p`` pipeline ranks (stages), ``m`` micro-batches per step, ``v`` model chunks
per rank (virtual stages per rank), ``s`` the rank's stage index. Counts are ints; the
warm-up and in-flight counts also take numpy arrays (broadcast), so the search's vectorised
memory bounds and the exact timeline call the same formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, wraps

import numpy as np

from meshplan.spec.mesh import Schedule


@dataclass(frozen=True)
class Unit:
    """One pipeline unit: ``kind`` F, B or W of micro-batch ``mb`` on local ``chunk``
    (B is the input gradient, or the whole backward when the schedule does not split it)."""

    kind: str
    mb: int
    chunk: int = 0

    def label(self, v: int = 1) -> str:
        return f"{self.kind}{self.mb}" + (f".c{self.chunk}" if v > 1 else "")


class PipelineSchedule:
    """A pipeline schedule; subclasses set the class attributes and :meth:`order`.

    - ``name``: its :class:`~meshplan.spec.mesh.Schedule`; ``title`` for messages.
    - ``torch_class``: the ``torch.distributed.pipelining.schedules`` class that runs it;
      ``runs_in_validate``: whether ``meshplan validate`` builds it (tested on gloo).
    - ``splits_backward``: B (input gradient) and W (weight gradient) are separate units.
    - ``frees_at_weight``: the memory timeline frees a micro-batch's activations at its W, not
      its B (torch's ``stage_backward_input`` keeps the graph: :mod:`meshplan.memory.wlag`),
      and holds the output gradients of its :meth:`lagging_weights` (ZB-H1).
    - ``virtual_stages``: runs ``v > 1`` model chunks per rank.
    - ``chunked``: the schedule whose order a stage with ``v > 1`` chunks runs when this
      one holds a single chunk (None: this order, which ignores v).
    - ``chunks``: the chunks per rank the schedule needs (2 for the V-shaped ones; None: any).
    - ``megatron_p2p``: a Megatron-LM schedule, the only ones ``training.framework =
      "megatron"`` accepts with pp > 1 (:func:`meshplan.pipeline.registry.check_framework`):
      1F1B and interleaved 1F1B, in 2022 (``megatron/schedules.py``) as at d98e8a6
      (``megatron/core/pipeline_parallel/schedules.py``, ``get_forward_backward_func``:
      without or with interleaving). Megatron-LM 2022 ran them with its blocking p2p calls,
      so ``framework = "megatron"`` simulates them (``PipelineSpec.blocking_p2p``; today's
      interleaved steady state asynchronous under its ``overlap_p2p_comm``,
      ``PipelineSpec.overlap_p2p``, :meth:`p2p_calls`); the others (the V-shaped ones
      deadlock under one combined call per unit) send asynchronously.
    - ``torch_waits``: torch 2.13 runs it as a single-stage schedule
      (``PipelineScheduleSingle``) whose ``_step_microbatches`` waits on its p2p in place
      (:meth:`torch_p2p_calls`), which ``framework = "torch"`` simulates with blocking calls;
      the multi-stage ones (``_PipelineScheduleRuntime``) post their SEND and RECV actions and
      wait a receive only at the compute that needs it: asynchronous, as meshplan models them.
    """

    name: Schedule
    title: str
    torch_class: str
    runs_in_validate: bool = True
    splits_backward: bool = False
    frees_at_weight: bool = False
    virtual_stages: bool = False
    chunked: Schedule | None = None
    chunks: int | None = None
    megatron_p2p: bool = False
    torch_waits: bool = False

    def __init_subclass__(cls, **kwargs):
        """A subclass's :meth:`order` is memoised per (p, m, v, s) for orders of at most
        :data:`CACHED_ORDER_UNITS` units (the search plans thousands of candidates over a few
        schedules; the FSDP gather flags, the memory schedule and the DAGs each walk the same
        orders); each call returns a new list of the same frozen units."""
        super().__init_subclass__(**kwargs)
        if "order" in cls.__dict__:
            cls.order = _memoised(cls.__dict__["order"])

    def order(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        """The units of stage ``s`` in execution order."""
        raise NotImplementedError

    def virtual_stage(self, chunk, s, p: int, v: int):
        """Virtual stage (model position, 0 .. p v - 1) of local ``chunk`` on stage ``s``:
        looped, ``chunk p + s`` (Megatron-LM's and torch's interleaved placement; chunk 0
        of every rank first). A V-shaped schedule overrides this.

        >>> PipelineSchedule().virtual_stage(1, 2, 4, 2)
        6
        """
        return chunk * p + s

    def stage_of(self, j: int, p: int, v: int) -> int:
        """The stage (rank of the pp group) holding virtual stage ``j``: the inverse of
        :meth:`virtual_stage`.

        >>> PipelineSchedule().stage_of(6, 4, 2)
        2
        """
        return next(s for s in range(p) for c in range(v) if self.virtual_stage(c, s, p, v) == j)

    def last_stage(self, p: int, v: int) -> int:
        """The stage holding the model's last virtual stage (final norm, output layer, loss):
        ``p - 1`` looped, 0 V-shaped."""
        return self.stage_of(p * v - 1, p, v)

    def p2p_per_microbatch(self, p: int, v: int, s: int) -> int:
        """Activation sends per micro-batch in one direction on stage ``s`` (receives are as
        many): one per chunk whose next virtual stage sits on another stage, one per chunk
        whose previous one does (a hand-off to a chunk of the same rank is a local copy, as
        torch's runtime does it: ``is_next_stage_on_this_rank``).

        >>> [PipelineSchedule().p2p_per_microbatch(4, 2, s) for s in range(4)]
        [3, 4, 4, 3]
        """
        out = 0
        for c in range(v):
            j = self.virtual_stage(c, s, p, v)
            out += (j > 0 and self.stage_of(j - 1, p, v) != s) + (j < p * v - 1 and self.stage_of(j + 1, p, v) != s)
        return out

    def crossings(self, p: int, v: int) -> int:
        """Times one micro-batch's activations cross the busiest pair of adjacent stages
        (its gradients cross as many back): the hops ``j -> j + 1`` of the chunk map between
        stages s and s + 1, either way; 1 with one chunk per rank, v looped (p 2: 2v - 1, the
        wrap from the last chunk of stage 1 to the next of stage 0 joins the same pair), 2 for
        a V.

        >>> PipelineSchedule().crossings(4, 1), PipelineSchedule().crossings(4, 2), PipelineSchedule().crossings(2, 2)
        (1, 2, 3)
        """
        hops = [frozenset((self.stage_of(j, p, v), self.stage_of(j + 1, p, v))) for j in range(p * v - 1)]
        return max((hops.count(frozenset((s, s + 1))) for s in range(p - 1)), default=0)

    def send_delay(self, p: int, m: int, v: int, s: int, length: int) -> np.ndarray:
        """For each of the ``length`` units of stage ``s``'s order: how many units later the
        blocking p2p call that sends its output is issued (Megatron-LM 2022,
        ``PipelineSpec.blocking_p2p``). 0 here: right after the unit (Megatron-LM 2022's
        non-interleaved 1F1B calls ``send_forward``/``send_forward_recv_backward`` after each
        forward and ``send_backward*`` after each backward, ``megatron/schedules.py``).

        >>> PipelineSchedule().send_delay(4, 8, 1, 0, 3).tolist()
        [0, 0, 0]
        """
        return np.zeros(length, dtype=np.int64)

    def recv_lead(self, p: int, m: int, v: int, s: int, length: int) -> np.ndarray:
        """For each of the ``length`` units of stage ``s``'s order: how many units earlier the
        blocking p2p call that posts the receive of its input is issued (Megatron-LM 2022,
        ``PipelineSpec.blocking_p2p``): 1 here, the call right before it (position -1: at the
        step's start). Megatron-LM 2022's non-interleaved 1F1B posts each forward's receive in
        ``recv_forward``/``send_backward_recv_forward`` and each backward's in
        ``send_forward_recv_backward``/``recv_backward``, the call before the unit
        (``megatron/schedules.py``).

        >>> PipelineSchedule().recv_lead(4, 8, 1, 0, 3).tolist()
        [1, 1, 1]
        """
        return np.ones(length, dtype=np.int64)

    def p2p_calls(self, p: int, m: int, v: int, s: int, length: int, overlap: bool = False):
        """Per unit of stage ``s``'s order (``length`` units): (:meth:`send_delay`,
        :meth:`recv_lead`, whether its output is sent asynchronously, whether its input is
        received asynchronously) of Megatron-LM's p2p calls; ``overlap``: its
        ``overlap_p2p_comm`` (``--no-overlap-p2p-communication`` absent), which only the
        interleaved schedule runs (:meth:`meshplan.pipeline.interleaved.Interleaved1F1B.p2p_calls`;
        without interleaving Megatron-LM turns it off, ``megatron/training/arguments.py:1010-1018``
        at NVIDIA/Megatron-LM d98e8a6): every call blocking here.

        >>> [x.tolist() for x in PipelineSchedule().p2p_calls(4, 8, 1, 0, 2, overlap=True)]
        [[0, 0], [1, 1], [False, False], [False, False]]
        """
        off = np.zeros(length, dtype=bool)
        return self.send_delay(p, m, v, s, length), self.recv_lead(p, m, v, s, length), off, off.copy()

    def torch_p2p_calls(self, p: int, m: int, v: int, s: int, length: int):
        """:meth:`p2p_calls` of torch 2.13's ``_step_microbatches`` for a schedule with
        ``torch_waits`` (:meth:`meshplan.pipeline.one_f_one_b.OneFOneB.torch_p2p_calls`,
        :meth:`meshplan.pipeline.gpipe.GPipe.torch_p2p_calls`): per unit of stage ``s``'s order,
        (send delay, receive lead, output sent without a wait in its call, input received
        without one). The others run under torch's multi-stage runtime, asynchronous: no call.

        >>> PipelineSchedule().torch_p2p_calls(4, 8, 1, 0, 2)
        Traceback (most recent call last):
        NotImplementedError: None runs under torch's multi-stage runtime: asynchronous sends, no blocking call
        """
        raise NotImplementedError(f"{getattr(self, 'name', None)} runs under torch's multi-stage runtime: "
                                  "asynchronous sends, no blocking call")

    def warmup(self, p, m, v, s):
        """Forward units stage ``s`` runs before its first backward (1F1B's
        ``min(p - s - 1, m)``, Narayanan et al. SC'21 2.2.1); ints or arrays."""
        return np.minimum(p - s - 1, m)

    def in_flight(self, p, m, v, s):
        """Chunk forwards stage ``s`` holds at its peak (F done, B not yet): the warm-up
        plus the first steady-state forward, at most ``m v``."""
        return np.minimum(m * v, self.warmup(p, m, v, s) + 1)

    def lagging_weights(self, p, m, v, s):
        """Most micro-batches whose B is done and W not yet at any point of stage ``s``'s
        order (counted at the W units); 0 where the backward is not split (ints or arrays)."""
        return 0 * np.asarray(s)

    def bubble(self, p: int, m: int, v: int = 1, forward_s: float = 1.0, backward_s: float = 2.0,
               weight_s: float = 0.0) -> float:
        """Closed-form bubble (idle / ideal) for uniform stages and no p2p time."""
        return (p - 1) / m

    def refused(self, p, m, framework: str = "torch"):
        """Whether ``framework``'s runtime refuses ``m`` micro-batches at ``p`` stages (ints
        or arrays): the micro-batch rule :meth:`reasons` words and the search evaluates on
        its columns (one formula); none here.

        >>> bool(PipelineSchedule().refused(4, 2))
        False
        """
        return np.zeros(np.shape(m), dtype=bool) if np.ndim(m) else False

    def warnings(self, framework: str, p: int, fsdp2_over_data: bool, reshard_after_forward: bool) -> tuple[str, ...]:
        """What ``framework``'s runtime is known to run differently from this plan with ``p``
        stages, ``fsdp2_over_data`` when FSDP2 shards or replicates over a data axis (zero3 or
        hsdp, fsdp x dp_replicate > 1), ``reshard_after_forward`` as ``training`` sets it: plan,
        step and compare print them, export writes them in its header; none here (the V-shaped
        schedules: :meth:`meshplan.pipeline.vshape.VShaped.warnings`).

        >>> PipelineSchedule().warnings("torch", 4, True, True)
        ()
        """
        return ()

    def reasons(self, p: int, m: int, v: int, framework: str = "torch") -> list[str]:
        """Why this schedule cannot run ``p`` stages, ``m`` micro-batches (0: unknown), ``v``
        chunks per rank under ``framework`` (``training.framework``: whose runtime refuses
        what; infeasibility reasons, empty when it can)."""
        return []

    def for_chunks(self, v: int) -> Schedule:
        """The schedule a stage with ``v`` chunks runs under this one (``chunked`` when this
        one holds one chunk and ``v > 1``)."""
        return self.chunked if v > 1 and not self.virtual_stages and self.chunked else self.name


def torch_rounds(p, m):
    """Rounds of torch 2.13's looped multi-chunk schedules (``ScheduleInterleaved1F1B``,
    ``ScheduleInterleavedZeroBubble``: ``number_of_rounds = max(1, n_microbatches //
    pp_group_size)``, torch/distributed/pipelining/schedules.py); ints or arrays. torch
    refuses m that is not a multiple of them.

    >>> [int(torch_rounds(4, m)) for m in (3, 6, 8, 10)]
    [1, 1, 2, 2]
    """
    return np.maximum(1, m // p)


def per_round(p, m):
    """Micro-batches per round of those schedules, ``m // torch_rounds(p, m)`` (torch's
    ``microbatches_per_round``): p when p divides m, m when m < 2p; ints or arrays.

    >>> [int(per_round(4, m)) for m in (3, 6, 8, 10)]
    [3, 6, 4, 5]
    """
    return m // torch_rounds(p, m)


#: Largest order (units: F, B and W of every micro-batch and chunk, ``3 m v``) kept by the
#: memo of :meth:`PipelineSchedule.order`; longer ones are rebuilt on each call.
CACHED_ORDER_UNITS = 4096


def _memoised(order):
    """``order`` with a memo of its result as a tuple per (schedule, p, m, v, s)."""
    cached = lru_cache(maxsize=512)(lambda self, p, m, v, s: tuple(order(self, p, m, v, s)))

    @wraps(order)
    def wrapper(self, p: int, m: int, v: int, s: int) -> list[Unit]:
        if 3 * m * v > CACHED_ORDER_UNITS:
            return order(self, p, m, v, s)
        return list(cached(self, int(p), int(m), int(v), int(s)))
    return wrapper
