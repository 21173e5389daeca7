"""Newcomer trial 24 (branch nc24a), finding #2: a config whose own mesh no search candidate runs
(torchtitan's own uneven vpp split) was planned as given but placed only by step time among every
feasible candidate, ``would rank between #66 and #4,341 of 8,822``. Its step and planned peak now
also give the row of the top table it would take (meshplan/search/configured_row.py: the headroom
tiers as the table applies them, after every row of its tier with a step no longer than its own;
only within a proven top), ``--json``'s ``configured.would_row``. The first test failed at main
dbb1e9ce (no row clause, no ``would_row``).
"""

from __future__ import annotations

from dataclasses import replace

import jsonschema

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from meshplan.report.search import search_to_dict
from meshplan.search.driver import search
from test_newcomer16 import MINI


def _search(recompute: str, searched: list[str]):
    """examples/mini_2x4_tp2-dp4.toml (one dgx-h100, dp_shard 4 x tp 2) at ``recompute``, the search
    over tp 2, pp 1, cp 1, micro-batch 1 and the recompute policies ``searched``."""
    cfg = load_config(MINI)
    cfg = replace(cfg, training=cfg.training.model_copy(update={"recompute": recompute}),
                  search=cfg.search.model_copy(update={"tp": [2], "pp": [1], "cp": [1], "micro_batch": [1],
                                                       "recompute": searched}))
    return cfg, search(cfg, workers=1)


def test_a_mesh_the_search_does_not_run_gets_its_row():
    """Searched at full recompute only, the two rows are dp_shard 4 x tp 2 (9.438 s, 26.7 GiB) and
    dp_replicate 2 x dp_shard 2 x tp 2 (9.482 s, 41.8 GiB), both clear (under 0.85 x 72e9 B = 57.0 GiB).
    The config's selective recompute, not searched, plans to 7.847 s with a clear peak: ahead of both,
    row 1 (and rank #1 of the 4 feasible). The JSON carries it and meets its schema.
    (nicshare4, under FSDP2's reduce-scatters on their own stream, one in flight: kept gathered the
    backward issues no all-gathers and each copy-in waits for the reduce-scatter before, a backward
    unit +0.4338 ms (dp_shard 4: exposed fsdp 0 -> 0.530 ms, SM contention -0.096 ms) and +0.2231 ms
    (HSDP: 0 -> 0.230 ms, -0.0065 ms), x 16 micro-batches: 9.438 -> 9.445 s and 9.482 -> 9.486 s;
    the selective config 7.847 -> 7.839 s, 66,886 tokens/s, as tests/test_search_configured.py's
    test_configured_names_its_mesh_at_its_fastest_searched_setting has it.)
    (es50: torchtitan's full AC runs ``early_stop=False``, so each of the 32 layers' eager replay
    re-runs its closing tp reduce-scatter, 64 MiB (8192 tokens x 4096 x 2 B), 0.104635 ms, on the
    compute stream, in each of 16 micro-batches: + 32 x 16 x 0.104635 ms = 53.57 ms on both rows,
    9.445 -> 9.498 s and 9.486 -> 9.540 s; the selective config replays no closing collective: unchanged.)
    (kvheads: torchtitan's SDPA reads the KV heads, ``enable_gqa``, no repeat_kv copies (``[memory]
    kv_expanded`` false): at tp 2 each copy op moves K and V at the 4 KV heads in and the 16 local q heads
    out, 2 x 8192 x (16 + 4) x 128 x 2 B = 83,886,080 B, 28.24 us at 2.97 TB/s; full recompute runs it
    three times a layer (forward, replay, backward's sum), 16 micro-batches x 32 layers x 3 x 28.24 us =
    43.38 ms, the DTensor host pace taking part back (tests/test_words.py's mini): the rows' compute 28.9 ms
    less (read from the model, dp_shard 4 x tp 2's resharded plan 8.9314 -> 8.9024 s at kv_expanded true
    and false), 9.498 -> 9.469 s and 9.540 -> 9.511 s; the selective config runs it twice a layer, 28.92 ms,
    half of it taken back: 7.8386 -> 7.8241 s (7.839 -> 7.824 s), 524,288 tokens / 7.8241 s = 67,009
    tokens/s.)"""
    cfg, r = _search("selective", ["full"])
    assert [(r.candidates.label(e.index), round(e.step_s, 3), round(e.peak_bytes / 2**30, 1)) for e in r.top] == [
        ("dp_shard 4 x tp 2, mb 1, full, vpp 1, zero3, keep gathered", 9.469, 26.7),
        ("dp_replicate 2 x dp_shard 2 x tp 2, mb 1, full, vpp 1, hsdp, keep gathered", 9.511, 41.8)]
    copy = 2 * 8192 * (16 + 4) * 128 * 2 / 2.97e12   # kvheads: one repeat_kv copy op (docstring), 28.24 us
    assert round(copy * 1e6, 2) == 28.24 and round(16 * 32 * 3 * copy * 1e3, 2) == 43.38 > 28.9   # the host pace's share
    assert [round(x - 0.0289, 3) for x in (9.498, 9.540)] == [9.469, 9.511]
    replay = 32 * 16 * 0.104635e-3  # es50: the replayed closing tp reduce-scatters
    assert [round(e.step_s - replay + 0.0289, 3) for e in r.top] == [9.445, 9.486]   # before kvheads
    assert (round(9.4379 + 16 * 0.4338e-3, 3), round(9.4824 + 16 * 0.2231e-3, 3)) == (9.445, 9.486)  # steps before
    assert build_plan(cfg).timeline.peak.total_bytes < 0.85 * r.usable_bytes
    assert r.configured.would_row == 1
    assert r.configured.line().endswith(
        "planned as given (not searched): 7.824 s, 67,009 tokens/s, would be row #1 of the top table (its step and "
        "peak against the rows', tiers applied), rank #1 of 4 feasible by step time")
    doc = search_to_dict(r)
    assert doc["configured"]["would_row"] == 1
    assert list(jsonschema.Draft202012Validator(schema_of("search")).iter_errors(doc)) == []


def test_a_mesh_slower_than_every_row_keeps_the_rank_alone():
    """Searched at no recompute or full (tests/test_newcomer16.py's case): the rows are dp_shard 4 x tp
    2 at none (7.297 s) and dp_replicate 2 x dp_shard 2 x tp 2 at none (7.455 s); the selective plan
    (7.847 s, clear) follows both, so no row: the line keeps the rank by step alone. (nicshare4: the rows
    7.297 -> 7.304 s (kept gathered: test_search_configured's derivation) and 7.455 -> 7.445 s (HSDP,
    resharded: each layer's all-gather beside the previous layer's reduce-scatter, the backward's kernels
    under fewer collective-holding intervals, SM contention 9.0955 -> 8.4867 ms a backward unit, x 16:
    7.4546 - 0.0097 = 7.4449 s); the selective plan 7.839 s.) (kvheads: no repeat_kv copies, one a layer at no
    recompute, 16 x 32 x 56.49 us = 28.92 ms, half taken back by the DTensor host pace, as the selective plan's
    (test above): 7.304 -> 7.290 s, 7.4449 -> 7.430 s; the selective plan 7.824 s, still 5th.)"""
    _, r = _search("selective", ["none", "full"])
    assert [round(e.step_s, 3) for e in r.top] == [7.290, 7.430]
    assert round(7.4546 - 16 * (9.0955 - 8.4867) / 1e3, 3) == 7.445
    assert round(7.4449 - 16 * 32 * 2 * 28.24e-6 / 2, 3) == 7.430
    assert r.configured.would_row is None
    assert r.configured.line().endswith("planned as given (not searched): 7.824 s, 67,009 tokens/s, would rank #5 of "
                                        "8 feasible by step time")
