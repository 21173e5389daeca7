"""Chrome/Perfetto trace of a simulated step: the :class:`~meshplan.pipeline.simulate.Event`
intervals of every stage and stream as ``traceEvents`` (ph "X", microseconds), one track per
stream and overlap lane (:func:`tracks`), written atomically (:func:`write_trace`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from meshplan.fileio import write_output
from meshplan.pipeline.simulate import Event


STREAM_ORDER = ("compute", "tp", "cp", "ep", "fsdp", "efsdp", "dp_replicate", "dp", "pp")


def tracks(events: list[Event] | tuple[Event, ...]) -> list[int]:
    """Lane of each event within its (stage, stream) track, so that slices on one track nest
    or are disjoint, never partly overlap (Perfetto draws a track as a stack of nested slices).
    Lane 0 is the stream itself; an event that would cross the end of an open slice on every
    lane so far goes to a new lane: the model lets a unit's communication tail overlap the next
    unit's collectives on one stream (:mod:`meshplan.schedule.rank_timeline`, contention
    between units ignored), and those become lanes 1, 2, ...

    >>> e = [Event(0, "fsdp", "RS", 0.0, 2.0), Event(0, "fsdp", "AG", 1.0, 3.0), Event(0, "fsdp", "in", 1.5, 1.8)]
    >>> tracks(e)
    [0, 1, 0]
    """
    lanes: dict[tuple[int, str], list[list[float]]] = {}  # per track, per lane: stack of open slice ends
    out = [0] * len(events)
    for i in sorted(range(len(events)), key=lambda i: (events[i].start_s, -events[i].end_s)):
        e = events[i]
        stacks = lanes.setdefault((e.stage, e.stream), [])
        for k, stack in enumerate(stacks + [[]]):
            while stack and stack[-1] <= e.start_s:
                stack.pop()
            if not stack or e.end_s <= stack[-1]:
                break
        if k == len(stacks):
            stacks.append(stack)
        stack.append(e.end_s)
        out[i] = k
    return out


def trace_dict(events: list[Event] | tuple[Event, ...], meta: Optional[dict] = None,
               ranks: Optional[dict[int, int]] = None) -> dict:
    """Chrome trace (``traceEvents``) of ``events``: ph "X", pid = stage (named ``rank R,
    stage s`` when ``ranks`` maps stage -> example rank), one track (tid) per stream and lane
    (:func:`tracks`; named by thread_name metadata, lanes past the first ``<stream> overlap
    k``), ts and dur in microseconds. On every track the slices nest."""
    lane = tracks(events)
    keys = sorted({(e.stream, k) for e, k in zip(events, lane)},
                  key=lambda x: (STREAM_ORDER.index(x[0]) if x[0] in STREAM_ORDER else len(STREAM_ORDER), x))
    tid = {key: i for i, key in enumerate(keys)}
    out = []
    for s in sorted({e.stage for e in events}):
        name = f"rank {ranks[s]}, stage {s}" if ranks and s in ranks else f"stage {s}"
        out.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}})
        for stream, k in keys:
            out.append({"ph": "M", "name": "thread_name", "pid": s, "tid": tid[(stream, k)],
                        "args": {"name": stream if k == 0 else f"{stream} overlap {k}"}})
    for e, k in zip(events, lane):
        args = {key: val for key, val in e.args.items() if isinstance(val, (int, float, str, bool))}
        out.append({"name": e.name, "cat": e.stream, "ph": "X", "pid": e.stage, "tid": tid[(e.stream, k)],
                    "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta or {}}


def write_trace(events, path: str | Path, meta: Optional[dict] = None, force: bool = False,
                ranks: Optional[dict[int, int]] = None) -> Path:
    """Write :func:`trace_dict` atomically (temp file + rename); opens in Perfetto
    (ui.perfetto.dev) or chrome://tracing beside a PyTorch profiler trace. Refuses to
    replace an existing file unless ``force`` (ConfigError)."""
    return write_output(path, json.dumps(trace_dict(events, meta, ranks), separators=(",", ":")), force, "--trace")
