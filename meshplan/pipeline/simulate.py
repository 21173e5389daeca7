"""Event simulation of one pipeline step: per-stage orders of forward (F), backward (B) and
weight-gradient (W) units, their dependencies, start and end times, critical path, bubble,
and a Chrome/Perfetto trace.

Schedules (p stages, m micro-batches, v virtual stages per rank), with the bubble each
gives for uniform stages and no p2p time (idle / ideal):

- ``gpipe``: all F, then all B (B includes W). ``(p-1)/m``.
- ``1f1b`` (Narayanan et al. SC'21, 2.2.1): ``min(p-s-1, m)`` warm-up F, then F/B pairs,
  then the remaining B. ``(p-1)/m``.
- ``interleaved_1f1b`` (Narayanan 2.2.2, Megatron-Core order): stage s holds chunks s,
  s+p, ...; warm-up ``min(m v, 2(p-s-1) + (v-1)p)`` chunk units, then 1F1B over chunks;
  m a multiple of p. ``(p-1)/(v m)``.
- ``zb_h1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241,
  section 3.1): 1F1B warm-up and F/B pairs with B split from W; stage s runs W of
  micro-batch j after B of j+s; the remaining W at the end. Per stage idle
  ``(p-1)(F+B-W)`` against 1F1B's ``(p-1)(F+B+W)``: ``(p-1)(F+B-W) / (m(F+B+W))``, which
  the simulation reproduces for m >= p and W <= min(F, B); ``(p-1)/(3m)`` when F = B = W.

``F``, ``B``, ``W`` are a stage's times for one micro-batch over all its layers; a chunk
takes ``1/v`` of them. Outside ``zb_h1`` a backward unit is B + W (the input gradient is
sent after the whole backward). ZB-H1 keeps 1F1B's peak over stages, not per stage: every
stage holds up to p micro-batches from F to W (``p-s-1`` warm-up + ``s+1`` lagged W), where
1F1B's stage s holds ``p-s`` (W keeps the inputs and output gradients, less than all of B's
activations).

Dependencies: F of virtual stage j needs F of j-1 (plus ``p2p_s`` across stages); B of j
needs B of j+1 (the last virtual stage needs its own F); W needs its B. Each stage runs its
order on one compute stream; a unit starts when the stream is free and its dependency is
done (list scheduling with fixed orders: exact earliest times).

Bubble (named): for the busiest stage, ``idle = step - busy``; ``bubble`` = idle / ideal
(ideal = busy), ``bubble_of_total`` = idle / step. Handed case C11, p 4, m 8:

>>> r = simulate(PipelineSpec("1f1b", p=4, m=8))
>>> round(r.bubble, 4), round(r.bubble_of_total, 4)
(0.375, 0.2727)
>>> r = simulate(PipelineSpec("interleaved_1f1b", p=4, m=8, v=2))
>>> round(r.bubble, 4), round(r.bubble_of_total, 4)
(0.1875, 0.1579)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from meshplan.errors import ConfigError
from meshplan.fileio import write_output

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True)
class Unit:
    """One pipeline unit: ``kind`` F, B or W of micro-batch ``mb`` on local ``chunk``."""

    kind: str
    mb: int
    chunk: int = 0

    def label(self, v: int = 1) -> str:
        return f"{self.kind}{self.mb}" + (f".c{self.chunk}" if v > 1 else "")


def gpipe_order(p: int, m: int, s: int) -> list[Unit]:
    """All forwards, then all backwards in micro-batch order."""
    return [Unit("F", i) for i in range(m)] + [Unit("B", i) for i in range(m)]


def one_f_one_b_order(p: int, m: int, s: int) -> list[Unit]:
    """1F1B: ``min(p-s-1, m)`` warm-up forwards, F/B pairs, remaining backwards.

    >>> " ".join(u.label() for u in one_f_one_b_order(4, 5, 1))
    'F0 F1 F2 B0 F3 B1 F4 B2 B3 B4'
    """
    w = min(p - s - 1, m)
    out = [Unit("F", i) for i in range(w)]
    for i in range(m - w):
        out += [Unit("F", w + i), Unit("B", i)]
    return out + [Unit("B", i) for i in range(m - w, m)]


def interleaved_order(p: int, m: int, v: int, s: int) -> list[Unit]:
    """Megatron-LM interleaved 1F1B (``forward_backward_pipelining_with_interleaving``):
    virtual unit k runs micro-batch ``(k // (p v)) p + k % p`` on chunk ``(k // p) % v``
    (backward: chunk ``v - 1 -`` that); warm-up ``min(m v, 2(p-s-1) + (v-1)p)`` units, as
    Megatron-Core (older Megatron-LM ran every unit as warm-up when m == p: same bubble,
    more activation memory).

    >>> " ".join(u.label(2) for u in interleaved_order(2, 2, 2, 1))
    'F0.c0 F1.c0 F0.c1 B0.c1 F1.c1 B1.c1 B0.c0 B1.c0'
    """
    total = m * v

    def unit(kind: str, k: int) -> Unit:
        chunk = (k % (p * v)) // p
        return Unit(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    warm = min(total, 2 * (p - s - 1) + (v - 1) * p)
    out = [unit("F", k) for k in range(warm)]
    for k in range(total - warm):
        out += [unit("F", warm + k), unit("B", k)]
    return out + [unit("B", k) for k in range(total - warm, total)]


def zb_h1_order(p: int, m: int, s: int) -> list[Unit]:
    """ZB-H1: 1F1B warm-up and F/B pairs; W of micro-batch j after B of j + s.

    >>> " ".join(u.label() for u in zb_h1_order(3, 4, 1))
    'F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3'
    """
    w = min(p - s - 1, m)
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


def stage_order(schedule: str, p: int, m: int, v: int, s: int) -> list[Unit]:
    """The order of ``schedule`` on stage ``s``."""
    if schedule == "gpipe":
        return gpipe_order(p, m, s)
    if schedule == "1f1b":
        return one_f_one_b_order(p, m, s)
    if schedule == "interleaved_1f1b":
        return interleaved_order(p, m, v, s)
    if schedule == "zb_h1":
        return zb_h1_order(p, m, s)
    raise ConfigError("mesh.pp_schedule", f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


@dataclass(frozen=True)
class PipelineSpec:
    """Abstract pipeline input: ``schedule``, ``p`` stages, ``m`` micro-batches, ``v``
    virtual stages; per stage and micro-batch ``forward_s`` (F), ``backward_s`` (B, input
    gradient) and ``weight_s`` (W); ``p2p_s`` per stage-to-stage send. ``duration``
    (optional) overrides: ``duration(stage, unit) -> seconds`` for the whole unit."""

    schedule: str
    p: int
    m: int
    v: int = 1
    forward_s: float = 1.0
    backward_s: float = 2.0
    weight_s: float = 0.0
    p2p_s: float = 0.0
    duration: Optional[Callable[[int, Unit], float]] = field(default=None, compare=False)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError("mesh.pp_schedule", f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        if self.p < 1 or self.m < 1 or self.v < 1:
            raise ConfigError("pipeline", f"p {self.p}, m {self.m}, v {self.v} must all be >= 1")
        if self.v > 1 and self.schedule != "interleaved_1f1b":
            raise ConfigError("mesh.virtual_stages", f"v {self.v} needs schedule interleaved_1f1b")
        if self.schedule == "interleaved_1f1b" and self.m % self.p:
            raise ConfigError("training.global_batch", f"interleaved 1F1B needs m ({self.m}) divisible by p ({self.p})")

    def unit_s(self, stage: int, u: Unit) -> float:
        if self.duration is not None:
            return self.duration(stage, u)
        if u.kind == "F":
            return self.forward_s / self.v
        if u.kind == "W":
            return self.weight_s / self.v
        split = self.schedule == "zb_h1"
        return (self.backward_s + (0.0 if split else self.weight_s)) / self.v


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


@dataclass(frozen=True)
class PipelineResult:
    """Simulated step: ``events`` (units on "compute", sends on "pp"), ``step_s``,
    ``busy_s`` per stage, ``critical_path`` (events from first to last, each with
    ``args['via']``: "stream" or "p2p"), and the bubble (module docstring)."""

    spec: PipelineSpec
    events: tuple[Event, ...]
    step_s: float
    busy_s: tuple[float, ...]
    critical_path: tuple[Event, ...]

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

    def stage_bubbles(self) -> list[float]:
        """idle / ideal of every stage."""
        return [(self.step_s - b) / b for b in self.busy_s]


def _dep(u: Unit, s: int, p: int, v: int) -> Optional[tuple[str, int, int]]:
    """(kind, mb, virtual stage) that ``u`` on stage ``s`` waits for, or None."""
    j = u.chunk * p + s
    if u.kind == "F":
        return ("F", u.mb, j - 1) if j > 0 else None
    if u.kind == "W":
        return ("B", u.mb, j)
    return ("B", u.mb, j + 1) if j < p * v - 1 else ("F", u.mb, j)


def simulate(spec: PipelineSpec) -> PipelineResult:
    """Run every stage's order (:func:`stage_order`) to completion; see the module docstring."""
    p, v = spec.p, spec.v
    orders = [stage_order(spec.schedule, p, spec.m, v, s) for s in range(p)]
    done: dict[tuple[str, int, int], Event] = {}
    events: list[Event] = []
    ptr, free = [0] * p, [0.0] * p
    last: list[Optional[Event]] = [None] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                u = orders[s][ptr[s]]
                key = _dep(u, s, p, v)
                if key is not None and key not in done:
                    break
                dep = done.get(key) if key is not None else None
                cross = dep is not None and dep.stage != s
                ready = (dep.end_s + (spec.p2p_s if cross else 0.0)) if dep else 0.0
                start = max(free[s], ready)
                via = "p2p" if dep is not None and ready > free[s] else "stream"
                pred = dep if via == "p2p" else last[s]
                if dep is not None and cross and spec.p2p_s > 0:
                    events.append(Event(dep.stage, "pp", f"send {dep.name}", dep.end_s, dep.end_s + spec.p2p_s))
                ev = Event(s, "compute", u.label(v), start, start + spec.unit_s(s, u),
                           {"kind": u.kind, "mb": u.mb, "chunk": u.chunk, "via": via, "wait_s": start - free[s],
                            "pred": pred})
                events.append(ev)
                done[(u.kind, u.mb, u.chunk * p + s)] = ev
                free[s], last[s] = ev.end_s, ev
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][ptr[s]].label(v) for s in range(p) if ptr[s] < len(orders[s])}
            raise RuntimeError(f"schedule {spec.schedule} deadlocks at {stuck}")
    step = max(free)
    busy = tuple(sum(e.dur_s for e in events if e.stage == s and e.stream == "compute") for s in range(p))
    return PipelineResult(spec, tuple(events), step, busy, _critical_path(last, free))


def _critical_path(last: list, free: list[float]) -> tuple[Event, ...]:
    ev = last[max(range(len(free)), key=lambda s: free[s])]
    path = []
    while ev is not None:
        path.append(ev)
        ev = ev.args.get("pred")
    return tuple(reversed(path))


def bubble_formula(schedule: str, p: int, m: int, v: int = 1, forward_s: float = 1.0,
                   backward_s: float = 2.0, weight_s: float = 0.0) -> float:
    """Closed-form bubble (idle / ideal) for uniform stages and no p2p time; idle / total
    is ``x / (1 + x)``. ZB-H1's form holds for m >= p and W <= min(F, B).

    >>> bubble_formula("1f1b", 4, 8), bubble_formula("interleaved_1f1b", 4, 8, 2)
    (0.375, 0.1875)
    >>> round(bubble_formula("zb_h1", 4, 8, forward_s=1, backward_s=1, weight_s=1), 4)  # (p-1)/(3m)
    0.125
    """
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)
    if schedule == "zb_h1":
        f, b, w = forward_s, backward_s, weight_s
        return (p - 1) * (f + b - w) / (m * (f + b + w))
    raise ConfigError("mesh.pp_schedule", f"unknown schedule {schedule!r}")


# Trace ----------------------------------------------------------------------------------

STREAM_ORDER = ("compute", "tp", "cp", "ep", "fsdp", "efsdp", "dp_replicate", "dp", "pp")


def trace_dict(events: list[Event] | tuple[Event, ...], meta: Optional[dict] = None) -> dict:
    """Chrome trace (``traceEvents``) of ``events``: ph "X", pid = stage, tid = stream
    index (named by thread_name metadata), ts and dur in microseconds."""
    streams = sorted({e.stream for e in events}, key=lambda x: (STREAM_ORDER.index(x) if x in STREAM_ORDER
                                                                 else len(STREAM_ORDER), x))
    tid = {name: i for i, name in enumerate(streams)}
    out = []
    for s in sorted({e.stage for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": f"stage {s}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}})
        for name in streams:
            out.append({"ph": "M", "name": "thread_name", "pid": s, "tid": tid[name], "args": {"name": name}})
    for e in events:
        args = {k: val for k, val in e.args.items() if isinstance(val, (int, float, str, bool))}
        out.append({"name": e.name, "cat": e.stream, "ph": "X", "pid": e.stage, "tid": tid[e.stream],
                    "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta or {}}


def write_trace(events, path: str | Path, meta: Optional[dict] = None, force: bool = False) -> Path:
    """Write :func:`trace_dict` atomically (temp file + rename); opens in Perfetto
    (ui.perfetto.dev) or chrome://tracing beside a PyTorch profiler trace. Refuses to
    replace an existing file unless ``force`` (ConfigError)."""
    return write_output(path, json.dumps(trace_dict(events, meta), separators=(",", ":")), force, "--trace")
