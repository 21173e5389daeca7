"""The pipeline simulation's input and result types (:mod:`meshplan.pipeline.simulate`,
:mod:`meshplan.pipeline.rendezvous`, the array path :mod:`meshplan.pipeline.fast`): the abstract
step (:class:`PipelineSpec`), one interval on a stream (:class:`Event`), the simulated step
(:class:`PipelineResult`) with its bubble (:class:`BubbleStats`), and what both event loops
share: a unit's dependency (:func:`dependency`), each stage's busy time (:func:`busy_times`) and
the critical path (:func:`critical_path_of`). Seconds throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np

from meshplan.errors import ConfigError
from meshplan.pipeline.base import PipelineSchedule, Unit
from meshplan.pipeline.registry import check_chunks, get
from meshplan.spec.mesh import Schedule

__all__ = ["Unit", "PipelineSpec", "Event", "BubbleStats", "PipelineResult", "dependency", "busy_times",
           "critical_path_of", "boundary_of"]


def boundary_of(a, c, p: int):
    """The stage boundary a transfer from stage ``a`` to stage ``c`` crosses (ints or arrays): ``b``
    for the pair (b, b + 1), either way (a forward to the next stage, a gradient to the previous
    one, a V-shaped chunk's way back); ``p - 1`` for the looped schedules' wrap, the last stage's
    chunk k handing chunk k + 1 to stage 0 (its gradients back).

    >>> [int(boundary_of(a, c, 4)) for a, c in ((0, 1), (2, 1), (3, 0), (0, 3))]
    [0, 1, 3, 3]
    """
    return np.where(c == a + 1, a, np.where(a == c + 1, c, p - 1))


@dataclass(frozen=True)
class PipelineSpec:
    """Abstract pipeline input: ``schedule`` (a :class:`Schedule` or its name, stored as the
    enum; :attr:`sched` is its registered object), ``p`` stages, ``m`` micro-batches, ``v``
    virtual stages per rank; per stage and micro-batch ``forward_s`` (F), ``backward_s`` (B, input
    gradient) and ``weight_s`` (W); ``p2p_s``: seconds of one stage-to-stage send, one value for
    every boundary, or one per boundary (a tuple of ``p``: entry b the pair of stages (b, b + 1)
    either way, entry p - 1 the looped schedules' wrap (p - 1, 0), :func:`boundary_of`; each
    boundary on its own pair's link); ``p2p_link`` (with ``p2p_s`` per boundary; empty: one link
    for all): per boundary, which of a rank's links its transfers take (0: NVLink, where both
    stages share an NVLink domain; 1: the rank's NIC), so that a blocking call's transfers on the
    same link share it and those on different links run at once
    (:func:`~meshplan.pipeline.rendezvous.call_seconds`); ``p2p_pair_s`` (optional, shaped as
    ``p2p_s``): seconds of two transfers of a boundary's size through its link at once, one NCCL
    group (their fixed part once, their bytes shared), which a blocking call's transfers sharing a
    link take (:func:`~meshplan.pipeline.rendezvous.link_load`); None: twice ``p2p_s``; ``blocking_p2p``: sends
    block their stage (:mod:`~meshplan.pipeline.rendezvous`); ``overlap_p2p`` (with
    ``blocking_p2p``): Megatron-LM's ``overlap_p2p_comm``, the steady state's transfers
    asynchronous (:mod:`~meshplan.pipeline.rendezvous`); ``torch_p2p`` (with ``blocking_p2p``):
    the calls are torch 2.13's single-stage ``_step_microbatches``' instead of Megatron-LM's
    (:meth:`p2p_calls`); ``serial_p2p`` (with ``blocking_p2p``): every send and receive is a blocking
    call of its own, one after the other (DeepSpeed's PipelineEngine, ``runtime/pipe/p2p.py``
    ``send``/``recv``: one ``dist.send``/``dist.recv`` per tensor, its TrainSchedule issuing a step's
    receive and send, or send and receive, in turn), so a call's transfers add whatever their
    direction or link (:func:`~meshplan.pipeline.rendezvous.call_loads`). ``duration`` (optional) overrides: ``duration(stage, unit) -> seconds``
    for the whole unit."""

    schedule: Schedule
    p: int
    m: int
    v: int = 1
    forward_s: float = 1.0
    backward_s: float = 2.0
    weight_s: float = 0.0
    p2p_s: Union[float, tuple] = 0.0
    blocking_p2p: bool = False
    overlap_p2p: bool = False
    torch_p2p: bool = False
    p2p_link: tuple = ()
    serial_p2p: bool = False
    p2p_pair_s: Union[None, float, tuple] = None
    duration: Optional[Callable[[int, Unit], float]] = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "schedule", get(self.schedule).name)  # a name parses to the enum
        if not isinstance(self.p2p_s, (int, float)):  # per boundary: a tuple of p floats (hashable, comparable)
            object.__setattr__(self, "p2p_s", tuple(float(x) for x in self.p2p_s))
            if len(self.p2p_s) != self.p:
                raise ConfigError("pipeline", f"p2p_s has {len(self.p2p_s)} boundary times; give one per "
                                  f"boundary, p = {self.p} (the last: the wrap from stage p - 1 to 0)")
        if isinstance(self.p2p_pair_s, (list, tuple)):
            object.__setattr__(self, "p2p_pair_s", tuple(float(x) for x in self.p2p_pair_s))
        if self.p2p_pair_s is not None and isinstance(self.p2p_pair_s, tuple) != self.per_boundary:
            raise ConfigError("pipeline", "p2p_pair_s must be shaped as p2p_s: one value, or one per boundary")
        object.__setattr__(self, "p2p_link", tuple(int(x) for x in self.p2p_link))
        if self.p2p_link and (not self.per_boundary or len(self.p2p_link) != self.p):
            raise ConfigError("pipeline", f"p2p_link has {len(self.p2p_link)} links; give one per boundary, "
                              f"p = {self.p}, with a p2p_s per boundary (or none: one link for all)")
        if self.p < 1 or self.m < 1 or self.v < 1:
            raise ConfigError("pipeline", f"p {self.p}, m {self.m}, v {self.v} must all be >= 1")
        check_chunks(self.schedule, self.v)
        fixed = self.sched.chunks is not None
        bad = self.sched.reasons(self.p, self.m, self.v) if self.sched.virtual_stages and (self.v > 1 or fixed) else []
        if bad:  # the rule its order needs (interleaved: torch's rounds divide m; V-shaped: v 2, DualPipeV m >= 2p)
            raise ConfigError("mesh.pp_schedule", bad[0])
        if self.torch_p2p and not (self.blocking_p2p and not self.overlap_p2p and self.sched.torch_waits):
            raise ConfigError("pipeline", f"torch_p2p needs blocking_p2p, no overlap_p2p and a schedule torch runs "
                              f"single-stage (gpipe, 1f1b), not {self.schedule} with blocking_p2p {self.blocking_p2p}, "
                              f"overlap_p2p {self.overlap_p2p}")

    @property
    def sched(self) -> PipelineSchedule:
        """The registered schedule object."""
        return get(self.schedule)

    @property
    def per_boundary(self) -> bool:
        """Whether ``p2p_s`` gives each boundary its own time (a tuple), not one for all."""
        return isinstance(self.p2p_s, tuple)

    @property
    def max_p2p_s(self) -> float:
        """The slowest boundary's transfer, seconds (``p2p_s`` itself when one value)."""
        return max(self.p2p_s, default=0.0) if isinstance(self.p2p_s, tuple) else float(self.p2p_s)

    def transfer_s(self, a, c):
        """Seconds of a transfer from stage ``a`` to stage ``c`` (ints or arrays: its boundary's,
        :func:`boundary_of`); ``p2p_s`` itself when one value for all.

        >>> spec = PipelineSpec("1f1b", p=3, m=3, p2p_s=(0.1, 0.7, 0.0))
        >>> spec.transfer_s(0, 1), spec.transfer_s(2, 1), spec.transfer_s(np.array([1, 1]), np.array([0, 2])).tolist()
        (0.1, 0.7, [0.1, 0.7])
        """
        if not isinstance(self.p2p_s, tuple):
            return self.p2p_s
        b = boundary_of(a, c, self.p)
        return np.asarray(self.p2p_s)[b] if np.ndim(b) else self.p2p_s[int(b)]

    def pair_s(self, a, c):
        """Seconds of two transfers at once across the boundary of a transfer from stage ``a`` to
        ``c`` (``p2p_pair_s``; twice :meth:`transfer_s` without it), ints or arrays.

        >>> spec = PipelineSpec("1f1b", p=3, m=3, p2p_s=(0.1, 0.7, 0.0), p2p_pair_s=(0.15, 1.3, 0.0))
        >>> spec.pair_s(1, 0), PipelineSpec("1f1b", p=3, m=3, p2p_s=0.5).pair_s(0, 1)
        (0.15, 1.0)
        """
        if self.p2p_pair_s is None:
            return 2 * self.transfer_s(a, c)
        if not isinstance(self.p2p_pair_s, tuple):
            return self.p2p_pair_s
        b = boundary_of(a, c, self.p)
        return np.asarray(self.p2p_pair_s)[b] if np.ndim(b) else self.p2p_pair_s[int(b)]

    def link_of(self, a, c):
        """The link (``p2p_link``) a transfer from stage ``a`` to stage ``c`` takes (ints or arrays:
        its boundary's); 0 for all without ``p2p_link``.

        >>> spec = PipelineSpec("1f1b", p=3, m=3, p2p_s=(0.1, 0.7, 0.7), p2p_link=(0, 1, 1))
        >>> spec.link_of(np.array([1, 1]), np.array([0, 2])).tolist()
        [0, 1]
        """
        if not self.p2p_link:
            return np.zeros(np.shape(a), dtype=np.int64) if np.ndim(a) else 0
        b = boundary_of(a, c, self.p)
        return np.asarray(self.p2p_link)[b] if np.ndim(b) else self.p2p_link[int(b)]

    def p2p_calls(self, s: int, length: int):
        """Stage ``s``'s blocking calls per unit of its order (``length`` units), for
        :func:`~meshplan.pipeline.rendezvous.calls` and :func:`meshplan.pipeline.calls.rendezvous`:
        torch's under ``torch_p2p`` (:meth:`~.base.PipelineSchedule.torch_p2p_calls`), else
        Megatron-LM's (``p2p_calls``)."""
        if self.torch_p2p:
            return self.sched.torch_p2p_calls(self.p, self.m, self.v, s, length)
        return self.sched.p2p_calls(self.p, self.m, self.v, s, length, self.overlap_p2p)

    def unit_s(self, stage: int, u: Unit) -> float:
        if self.duration is not None:
            return self.duration(stage, u)
        if u.kind == "F":
            return self.forward_s / self.v
        if u.kind == "W":
            return self.weight_s / self.v
        return (self.backward_s + (0.0 if self.sched.splits_backward else self.weight_s)) / self.v



@dataclass(frozen=True)
class Event:
    """One interval on one stream of one stage (seconds)."""

    stage: int
    stream: str
    name: str
    start_s: float
    end_s: float
    args: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s


class BubbleStats:
    """Bubble of a simulated step from ``step_s`` and each stage's ``busy_s`` (named: idle /
    ideal and idle / total of the busiest stage). Shared by :class:`PipelineResult` and the
    array result of :mod:`meshplan.pipeline.fast`."""

    step_s: float
    busy_s: tuple[float, ...]

    @property
    def busiest_stage(self) -> int:
        return max(range(len(self.busy_s)), key=lambda s: self.busy_s[s])

    @property
    def idle_s(self) -> float:
        return self.step_s - self.busy_s[self.busiest_stage]

    @property
    def bubble(self) -> float:
        """idle / ideal of the busiest stage."""
        return self.idle_s / self.busy_s[self.busiest_stage]

    @property
    def bubble_of_total(self) -> float:
        """idle / step time of the busiest stage."""
        return self.idle_s / self.step_s


@dataclass(frozen=True)
class PipelineResult(BubbleStats):
    """Simulated step: ``events`` (units on "compute", sends on "pp"), ``step_s``,
    ``busy_s`` per stage, ``critical_path`` (events from first to last, each with
    ``args['via']``: "stream" or "p2p"), and the bubble (:mod:`~meshplan.pipeline.simulate`)."""

    spec: PipelineSpec
    events: tuple[Event, ...]
    step_s: float
    busy_s: tuple[float, ...]
    critical_path: tuple[Event, ...]



def dependency(sched: PipelineSchedule, u: Unit, s: int, p: int, v: int) -> Optional[tuple[str, int, int]]:
    """(kind, mb, virtual stage) that ``u`` on stage ``s`` waits for, or None; the virtual
    stage of a chunk is the schedule's (:meth:`~.base.PipelineSchedule.virtual_stage`)."""
    j = sched.virtual_stage(u.chunk, s, p, v)
    if u.kind == "F":
        return ("F", u.mb, j - 1) if j > 0 else None
    if u.kind == "W":
        return ("B", u.mb, j)
    return ("B", u.mb, j + 1) if j < p * v - 1 else ("F", u.mb, j)



def busy_times(events, p: int) -> tuple[float, ...]:
    """Each stage's compute time: its units' durations added one after another in event order
    (a plain running sum, as Python's ``sum`` of floats before 3.12 and the array path's
    ``cumsum``: the same to the bit on every Python)."""
    busy = [0.0] * p
    for e in events:
        if e.stream == "compute":
            busy[e.stage] += e.dur_s
    return tuple(busy)


def critical_path_of(last: list, free: list[float]) -> tuple[Event, ...]:
    """The events from the first to ``last`` of the stage that ends latest (``free``: each stage's
    end, seconds), following each event's ``args['pred']``."""
    ev = last[max(range(len(free)), key=lambda s: free[s])]
    path = []
    while ev is not None:
        path.append(ev)
        ev = ev.args.get("pred")
    return tuple(reversed(path))

