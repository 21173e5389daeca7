"""Chrome/Perfetto trace of a simulated step: the :class:`~meshplan.pipeline.simulate.Event`
intervals of every stage and stream as ``traceEvents`` (ph "X", microseconds), one track per
stream and overlap lane (:func:`tracks`), written atomically (:func:`write_trace`) in one pass
(:func:`trace_json`: the bytes of ``json.dumps`` of :func:`trace_dict`)."""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Optional

from meshplan.fileio import write_output
from meshplan.pipeline.simulate import Event


INF = float("inf")
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


def _track_ids(events, lane: list[int]) -> tuple[list[tuple[str, int]], dict[tuple[str, int], int]]:
    """The (stream, lane) tracks in display order (:data:`STREAM_ORDER`, then by name and lane)
    and each one's tid."""
    keys = sorted({(e.stream, k) for e, k in zip(events, lane)},
                  key=lambda x: (STREAM_ORDER.index(x[0]) if x[0] in STREAM_ORDER else len(STREAM_ORDER), x))
    return keys, {key: i for i, key in enumerate(keys)}


def _names(events, keys, tid, ranks: Optional[dict[int, int]]) -> list[dict]:
    """The metadata entries (ph "M"): each stage's process name and sort index, each track's name."""
    out: list[dict] = []
    for s in sorted({e.stage for e in events}):
        name = f"rank {ranks[s]}, stage {s}" if ranks and s in ranks else f"stage {s}"
        out.append({"ph": "M", "name": "process_name", "pid": s, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}})
        for stream, k in keys:
            out.append({"ph": "M", "name": "thread_name", "pid": s, "tid": tid[(stream, k)],
                        "args": {"name": stream if k == 0 else f"{stream} overlap {k}"}})
    return out


def _kept_args(e: Event) -> dict:
    """The event's args a trace carries: its numbers, strings and booleans."""
    return {key: val for key, val in e.args.items() if isinstance(val, (int, float, str, bool))}


def trace_dict(events: list[Event] | tuple[Event, ...], meta: Optional[dict] = None,
               ranks: Optional[dict[int, int]] = None) -> dict:
    """Chrome trace (``traceEvents``) of ``events``: ph "X", pid = stage (named ``rank R,
    stage s`` when ``ranks`` maps stage -> example rank), one track (tid) per stream and lane
    (:func:`tracks`; named by thread_name metadata, lanes past the first ``<stream> overlap
    k``), ts and dur in microseconds. On every track the slices nest."""
    lane = tracks(events)
    keys, tid = _track_ids(events, lane)
    out = _names(events, keys, tid, ranks)
    for e, k in zip(events, lane):
        out.append({"name": e.name, "cat": e.stream, "ph": "X", "pid": e.stage, "tid": tid[(e.stream, k)],
                    "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6, "args": _kept_args(e)})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta or {}}


def _scalar(x) -> str:
    """``x`` (a string, bool, int or float; anything else through json) as ``json.dumps`` writes it:
    ASCII-escaped strings, ``float.__repr__`` (NaN, Infinity, -Infinity), ``int.__repr__``."""
    if isinstance(x, str):
        return encode_basestring_ascii(x)
    if x is True or x is False:
        return "true" if x else "false"
    if isinstance(x, int):
        return int.__repr__(x)
    if isinstance(x, float):
        return float.__repr__(x) if x == x and x not in (INF, -INF) else ("NaN" if x != x else "Infinity" if x > 0 else "-Infinity")
    return json.dumps(x, separators=(",", ":"))


def _args_json(args: dict) -> str:
    """``json.dumps(args, separators=(",", ":"))`` of a dict of string keys (others through json)."""
    if not args:
        return "{}"
    if not all(isinstance(k, str) for k in args):
        return json.dumps(args, separators=(",", ":"))
    return "{" + ",".join(encode_basestring_ascii(k) + ":" + _scalar(v) for k, v in args.items()) + "}"


def _cached(text: dict, x) -> str:
    """:func:`_scalar` of ``x``, a string's kept in ``text``."""
    if type(x) is not str:
        return _scalar(x)
    out = text.get(x)
    if out is None:
        out = text[x] = encode_basestring_ascii(x)
    return out


def trace_json(events: list[Event] | tuple[Event, ...], meta: Optional[dict] = None,
               ranks: Optional[dict[int, int]] = None) -> str:
    """``json.dumps(trace_dict(events, meta, ranks), separators=(",", ":"))``, the same bytes,
    written in one pass: each slice's text formatted from its fields, every string's JSON once
    (names, streams and the ``unit`` arg repeat), no dict per event nor the encoder's walk over a
    list of 10^6 of them (``benchmarks/bench_trace.py`` prints events/s of both)."""
    lane = tracks(events)
    keys, tid = _track_ids(events, lane)
    parts = [json.dumps(m, separators=(",", ":")) for m in _names(events, keys, tid, ranks)]
    text: dict = {}  # a string -> its JSON; (key, value) of a one-string args -> the args' JSON
    ids = {key: str(i) for key, i in tid.items()}
    frepr = float.__repr__
    for e, k in zip(events, lane):
        name, stream, a = e.name, e.stream, e.args
        nm, cat = _cached(text, name), _cached(text, stream)
        ts, dur = e.start_s * 1e6, e.dur_s * 1e6
        tsr = frepr(ts) if type(ts) is float and ts - ts == 0.0 else _scalar(ts)
        dr = frepr(dur) if type(dur) is float and dur - dur == 0.0 else _scalar(dur)
        pid = str(e.stage) if type(e.stage) is int else _scalar(e.stage)
        item = next(iter(a.items())) if len(a) == 1 else None
        if item is not None and type(item[0]) is str and type(item[1]) is str:
            aj = text.get(item)
            if aj is None:
                aj = text[item] = "{" + encode_basestring_ascii(item[0]) + ":" + encode_basestring_ascii(item[1]) + "}"
        else:
            aj = _args_json(_kept_args(e))
        parts.append(f'{{"name":{nm},"cat":{cat},"ph":"X","pid":{pid},"tid":{ids[(stream, k)]},"ts":{tsr},'
                     f'"dur":{dr},"args":{aj}}}')
    return ('{"traceEvents":[' + ",".join(parts) + '],"displayTimeUnit":"ms","otherData":'
            + json.dumps(meta or {}, separators=(",", ":")) + "}")


def write_trace(events, path: str | Path, meta: Optional[dict] = None, force: bool = False,
                ranks: Optional[dict[int, int]] = None) -> Path:
    """Write :func:`trace_dict` atomically (temp file + rename); opens in Perfetto
    (ui.perfetto.dev) or chrome://tracing beside a PyTorch profiler trace. Refuses to
    replace an existing file unless ``force`` (ConfigError)."""
    return write_output(path, trace_json(events, meta, ranks), force, "--trace")
