"""The Perfetto trace of ``step --trace``: one track per stream (and lane) per rank, on which
slices nest or are disjoint, never partly overlap (Perfetto's rule for a thread track)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from meshplan.config import load_config
from meshplan.pipeline.simulate import Event
from meshplan.pipeline.trace import trace_dict, tracks
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

ROOT = Path(__file__).resolve().parents[1]


def partial_overlaps(slices: list[tuple[int, int]]) -> int:
    """Pairs (a, b) on one track with a.start <= b.start < a.end < b.end (integer ns)."""
    n = 0
    slices = sorted(slices, key=lambda x: (x[0], -x[1]))
    for i, (s0, e0) in enumerate(slices):
        for s1, e1 in slices[i + 1:]:
            if s1 >= e0:
                break
            n += e1 > e0
    return n


def by_track(doc: dict, key) -> dict:
    out = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            # rounding is monotone: nesting and disjointness in seconds survive it
            out[key(e)].append((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)))
    return out


def test_lanes_by_hand():
    # RS 0-2 and AG 1-3 on one stream partly overlap: AG takes lane 1; "in" nests in RS (lane 0);
    # "next" starts where RS ends: lane 0 again.
    ev = [Event(0, "fsdp", "RS", 0.0, 2.0), Event(0, "fsdp", "AG", 1.0, 3.0), Event(0, "fsdp", "in", 1.5, 1.8),
          Event(0, "fsdp", "next", 2.0, 2.5), Event(1, "fsdp", "other stage", 1.0, 3.0)]
    assert tracks(ev) == [0, 1, 0, 0, 0]
    d = trace_dict(ev, ranks={0: 0, 1: 4})
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 0)] == "fsdp" and names[(0, 1)] == "fsdp overlap 1"
    procs = [e["args"]["name"] for e in d["traceEvents"] if e["name"] == "process_name"]
    assert procs == ["rank 0, stage 0", "rank 4, stage 1"]


def test_step_trace_slices_nest_on_every_track(tmp_path):
    # the mini example's Llama 3 8B on dp_shard 8 x tp 1: with torchtitan's FSDP2 units the
    # embedding's fp32 reduce-scatter (the backward's tail) outlasts the next forward's embedding
    # all-gather and embedding, so layer 0's all-gather starts under it (at tp 4 it nests instead)
    text = (ROOT / "examples" / "mini_2x4_tp4-dp2.toml").read_text().replace("shape = [2, 4]", "shape = [8, 1]")
    (tmp_path / "dp8.toml").write_text(text)
    plan = build_plan(load_config(tmp_path / "dp8.toml"))
    st = step_time(plan)
    doc = json.loads(st.write_trace(tmp_path / "trace.json").read_text())
    per_stream = by_track(doc, lambda e: (e["pid"], e["cat"]))
    # the model lets a backward unit's reduce-scatter tail run under the next unit's all-gathers on
    # the fsdp stream: on one track per stream those slices would partly overlap
    assert sum(partial_overlaps(s) for s in per_stream.values()) > 0
    tracks_ = by_track(doc, lambda e: (e["pid"], e["tid"]))
    assert {k: partial_overlaps(s) for k, s in tracks_.items()} == {k: 0 for k in tracks_}
    assert sum(len(s) for s in tracks_.values()) == len(st.trace_events())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"rank {st.example_ranks[0]}, stage 0"}
