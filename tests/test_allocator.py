"""The simulated CUDA caching allocator (meshplan.memory.allocator) and its run over a memory
timeline (meshplan.memory.reserved).

torch 2.13 on this CPU has no CUDA caching allocator to compare with (``torch.cuda`` is absent from
the +cpu build), so every expected value here is derived by hand from the allocator's rules as
read in pytorch ``c10/cuda/CUDACachingAllocator.cpp`` and torch 2.13.0's ``c10/core/AllocatorConfig.h``
(the module docstring of meshplan.memory.allocator cites them): sizes round to 512 B; <= 1 MiB
goes to the small pool (2 MiB segments); larger requests under 10 MiB get a 20 MiB segment, from
10 MiB on the request rounded to 2 MiB; a large block is split when more than 1 MiB remains; the
best fit is the smallest free block of the same pool and stream; freed blocks stay reserved and
merge with free neighbours; expandable segments map 20 MiB pages at the segment's end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import config_from_dict
from meshplan.memory.allocator import AllocatorConfig, simulate
from meshplan.memory.reserved import Reserved, allocator_ops, bounded_passes, reserved_of, step_events
from meshplan.plan import build_plan
from meshplan.report.memory import reserved_line
from meshplan.units import GiB

MiB = 2**20
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def test_three_five_free_four_reuses_the_twenty_mib_segment():
    """3 MiB (< 10 MiB): no block cached, cudaMalloc 20 MiB; 17 MiB remain (> 1 MiB): split, cached.
    5 MiB: the 17 MiB block is the only fit, split into 5 + 12 MiB. Free the 3 MiB: a 3 MiB hole
    (its neighbour, the 5 MiB block, is allocated: no merge). 4 MiB: the hole is too small, the best
    fit is the 12 MiB block (split 4 + 8). One segment, 20 MiB reserved; allocated peak 5 + 4 = 9 MiB."""
    r = simulate([(0, 3 * MiB, 0), (1, 5 * MiB, 0), (0, -1, 0), (2, 4 * MiB, 0)])
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes, r.segments) == (20 * MiB, 9 * MiB, 1)
    # a 3 MiB request then takes the 3 MiB hole, the smallest fit, and nothing more is reserved
    r = simulate([(0, 3 * MiB, 0), (1, 5 * MiB, 0), (0, -1, 0), (2, 4 * MiB, 0), (3, 3 * MiB, 0), (4, 8 * MiB, 0)])
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes, r.segments) == (20 * MiB, 20 * MiB, 1)
    # and a 9 MiB one after that: no free block is left, a second 20 MiB segment
    r = simulate([(0, 3 * MiB, 0), (1, 5 * MiB, 0), (0, -1, 0), (2, 4 * MiB, 0), (3, 3 * MiB, 0), (4, 8 * MiB, 0),
                  (5, 9 * MiB, 0)])
    assert (r.reserved_peak_bytes, r.segments) == (40 * MiB, 2)


def test_small_pool_packs_512_b_blocks_into_2_mib_segments():
    """100 B rounds to 512 B (small pool); a 2 MiB segment holds 2 MiB / 512 B = 4,096 of them (each
    split leaves >= 512 B until the last), the 4,097th opens a second segment."""
    ops = [(i, 100, 0) for i in range(4096)]
    r = simulate(ops)
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes, r.requested_peak_bytes) == (2 * MiB, 2 * MiB, 409_600)
    assert simulate(ops + [(4096, 100, 0)]).reserved_peak_bytes == 4 * MiB


def test_large_request_rounds_to_2_mib_and_a_remainder_under_1_mib_stays_in_the_block():
    """11 MiB + 1 B rounds to 11 MiB + 512 B (>= 10 MiB: its own segment, rounded up to 2 MiB = 12 MiB);
    the 1 MiB - 512 B left is not over 1 MiB, so not split: the block, and the allocated bytes, are
    12 MiB. A 0.5 MiB request then goes to the small pool: one 2 MiB segment more."""
    r = simulate([(0, 11 * MiB + 1, 0)])
    assert (r.reserved_peak_bytes, r.allocated_peak_bytes, r.requested_peak_bytes) == (12 * MiB, 12 * MiB, 11 * MiB + 1)
    assert simulate([(0, 11 * MiB + 1, 0), (1, MiB // 2, 0)]).reserved_peak_bytes == 14 * MiB


def test_freed_blocks_stay_reserved_and_serve_only_their_stream():
    """A freed 30 MiB block is cached: a second 30 MiB request reuses it (30 MiB reserved), a 40 MiB one
    does not fit it (30 + 40 = 70 MiB), nor does a 30 MiB request of another stream (60 MiB)."""
    assert simulate([(0, 30 * MiB, 0), (0, -1, 0), (1, 30 * MiB, 0)]).reserved_peak_bytes == 30 * MiB
    assert simulate([(0, 30 * MiB, 0), (0, -1, 0), (1, 40 * MiB, 0)]).reserved_peak_bytes == 70 * MiB
    assert simulate([(0, 30 * MiB, 0), (0, -1, 0), (1, 30 * MiB, 1)]).reserved_peak_bytes == 60 * MiB


def test_free_neighbours_merge():
    """4 MiB and 4 MiB share a 20 MiB segment (0-4, 4-8, 12 MiB free at 8). Freed, the three blocks merge
    into the whole 20 MiB, which holds an 18 MiB request (>= 10 MiB, rounded to 18 MiB): nothing more
    reserved. Without the merge the largest free block is 12 MiB and an 18 MiB segment would follow."""
    ops = [(0, 4 * MiB, 0), (1, 4 * MiB, 0), (0, -1, 0), (1, -1, 0), (2, 18 * MiB, 0)]
    assert (simulate(ops).reserved_peak_bytes, simulate(ops).segments) == (20 * MiB, 1)
    # only the first freed: the 4 MiB hole and the 12 MiB block are not adjacent, 18 MiB opens a segment
    assert simulate([(0, 4 * MiB, 0), (1, 4 * MiB, 0), (0, -1, 0), (2, 18 * MiB, 0)]).reserved_peak_bytes == 38 * MiB


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    """max_split_size 40 MiB: a cached 50 MiB block (>= 40) serves no request under 40 MiB, so 20 MiB
    opens a 20 MiB segment (70 MiB); unlimited (the default), 20 MiB splits the 50 MiB block (50 MiB)."""
    ops = [(0, 50 * MiB, 0), (0, -1, 0), (1, 20 * MiB, 0)]
    assert simulate(ops, AllocatorConfig(max_split_size_bytes=40 * MiB)).reserved_peak_bytes == 70 * MiB
    assert simulate(ops).reserved_peak_bytes == 50 * MiB


def test_expandable_segments_map_20_mib_pages_at_the_end():
    """expandable_segments: 3 MiB maps one 20 MiB page (3 used, 17 free at the end); 5 MiB fits in those
    17 (no mapping); freeing 3 MiB leaves a hole; 4 MiB fits neither the hole nor needs a page (12 MiB
    at the end): 20 MiB. Then 30 MiB: 8 MiB free at the end, 22 MiB more needed: 2 pages, 60 MiB
    (the classic allocator: a 30 MiB segment, 50 MiB)."""
    ops = [(0, 3 * MiB, 0), (1, 5 * MiB, 0), (0, -1, 0), (2, 4 * MiB, 0)]
    assert simulate(ops, EXPANDABLE).reserved_peak_bytes == 20 * MiB
    assert simulate(ops + [(3, 30 * MiB, 0)], EXPANDABLE).reserved_peak_bytes == 60 * MiB
    assert simulate(ops + [(3, 30 * MiB, 0)]).reserved_peak_bytes == 50 * MiB
    # 30 MiB freed then 40 MiB: the freed 30 MiB joins the 10 MiB left at the end of the 2 pages
    # mapped (40 MiB), which hold the 40 MiB request; the classic allocator needs 30 + 40
    grow = [(0, 30 * MiB, 0), (0, -1, 0), (1, 40 * MiB, 0)]
    assert simulate(grow, EXPANDABLE).reserved_peak_bytes == 40 * MiB
    assert simulate(grow).reserved_peak_bytes == 70 * MiB


def test_timeline_events_become_tensors_on_their_streams():
    """A 30 MiB working set freed, then FSDP2's all-gather output of 30 MiB: allocated on the all-gather
    copy-in stream (torch 2.13 _fsdp_collectives.py line 336), it cannot take the compute stream's cached
    30 MiB block: 60 MiB reserved for a 30 MiB allocated peak. The unsharded parameters copied out of it
    (compute stream) reuse the cached block: still 60 MiB, allocated peak 60 MiB."""
    events = [(0, "temporaries", 30 * MiB, "layer 0 forward: working set"),
              (0, "temporaries", -30 * MiB, "layer 0 forward: working set freed"),
              (1, "gathered_params", 30 * MiB, "layer 1: all-gather output (compute dtype)")]
    ops, lost = allocator_ops(events)
    assert (simulate(ops).reserved_peak_bytes, simulate(ops).allocated_peak_bytes, lost) == (60 * MiB, 30 * MiB, 0)
    ops, lost = allocator_ops(events + [(1, "gathered_params", 30 * MiB, "layer 1: copy-out to unsharded parameters")])
    assert (simulate(ops).reserved_peak_bytes, simulate(ops).allocated_peak_bytes) == (60 * MiB, 60 * MiB)


def test_a_free_in_parts_splits_its_allocation():
    """Saved activations of 24 MiB freed as 9 then 15 MiB are two tensors allocated back to back: 9 MiB
    (< 10 MiB) in a 20 MiB segment, split 9 + 11; 15 MiB does not fit the 11 MiB block, so its own segment,
    rounded to 16 MiB (the 1 MiB left is not over 1 MiB: not split): 36 MiB, where one 24 MiB tensor would
    reserve 24 MiB. Freeing the 9 MiB merges it with the 11 MiB: a 9 MiB request after it reuses that."""
    events = [(0, "activations", 24 * MiB, "saved"), (0, "activations", -9 * MiB, "a"),
              (0, "temporaries", 9 * MiB, "w"), (0, "activations", -15 * MiB, "b")]
    ops, lost = allocator_ops(events)
    assert ops == [(0, 9 * MiB, 0), (1, 15 * MiB, 0), (0, -1, 0), (2, 9 * MiB, 0), (1, -1, 0)]
    assert simulate(ops).reserved_peak_bytes == 36 * MiB
    assert simulate([(0, 24 * MiB, 0)]).reserved_peak_bytes == 24 * MiB


def _plan(**memory):
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                      "param_dtype": "bf16", "recompute": "none"},
         "mesh": {"names": ["dp", "tp"], "shape": [4, 2]}, "memory": memory}
    return build_plan(config_from_dict(d))


def test_the_allocator_allocates_what_the_timeline_peaks_at():
    """Over a real timeline (llama3-8b, FSDP over 4 x tp 2), every free finds its allocation (no bytes
    unmatched), and the allocator's allocated peak is the timeline's peak less the kinds it never sees
    (NCCL buffers), up to the rounding of each live block (512 B, or < 1 MiB a large block not split):
    within 0.1 GiB. Its reserved peak is at least that."""
    tl = _plan().timeline
    r = reserved_of(tl)
    untracked = tl.peak.by_kind["comm_buffers"]
    assert r.unmatched_bytes == 0 and r.untracked_bytes == untracked > 0
    assert 0 <= r.stats.allocated_peak_bytes - (tl.peak.total_bytes - untracked) < 0.1 * GiB
    assert r.stats.reserved_peak_bytes >= r.stats.allocated_peak_bytes
    # the bound on repeated passes changes nothing here (module docstring: measured on every example)
    full = simulate(allocator_ops(step_events(tl, keep=0))[0])
    assert full == r.stats


def test_bounded_passes_cut_only_groups_that_change_nothing():
    """[1, 2] nets 0 (4 - 4): 4 repeats cut to 2; [1] nets +4 (activations building up): kept whole."""
    assert bounded_passes([0, 1, 2, 1, 2, 1, 2, 1, 2, 3], [5, 4, -4, -5], 2) == [0, 1, 2, 1, 2, 3]
    assert bounded_passes([0, 1, 1, 1, 1, 3], [5, 4, -4, -5], 2) == [0, 1, 1, 1, 1, 3]


def test_reserved_verdict_holds_the_reserved_peak_against_usable_memory():
    """memory.reserved_verdict: the verdict's bytes are the reserved peak + the communication buffers.
    A reserved peak 1 GiB over usable memory makes a stage that fits by its allocated peak not fit."""
    p = _plan(reserved_verdict=True, expandable_segments=True)
    tl = p.timeline
    assert tl.reserved is not None and tl.reserved.config.expandable_segments
    assert tl.verdict_bytes == tl.reserved.reserved_bytes + tl.reserved.untracked_bytes
    assert _plan().timeline.reserved is None and _plan().timeline.verdict_bytes == tl.peak.total_bytes
    over = replace(tl.reserved.stats, reserved_peak_bytes=int(tl.usable_bytes) + GiB)
    bad = replace(tl, reserved=Reserved(tl.stage, over, tl.reserved.untracked_bytes, 0, tl.reserved.config))
    assert tl.fits and not bad.fits
    assert bad.reason().startswith(f"caching allocator reserves {(tl.usable_bytes + GiB) / GiB:.1f} GiB on stage 0")


@pytest.mark.parametrize("flag", [True, False])
def test_memory_options_read_the_allocator_flags(flag):
    """[memory] expandable_segments reaches the timeline's allocator."""
    assert _plan(expandable_segments=flag).timeline.allocator.expandable_segments is flag


def test_memory_prints_the_reserved_peak_beside_the_allocated_one():
    """meshplan memory's allocator line carries the simulated reserved and allocated peaks (GiB, 2
    decimals), their difference and which peak the verdict holds: the timeline's peak incl.
    communication buffers (Timeline.verdict_bytes), named apart from the allocator's allocated peak
    (torch.cuda.max_memory_allocated, without the buffers; "the allocated peak" named both before)."""
    tl = _plan().timeline
    r = tl.reserved_memory()
    line = reserved_line(tl)
    assert f"reserved peak {r.reserved_bytes / GiB:.2f} GiB" in line
    assert f"beside the allocated peak {r.stats.allocated_peak_bytes / GiB:.2f} GiB (torch.cuda.max_memory_allocated)" \
        in line
    assert tl.verdict_bytes == tl.peak.total_bytes and tl.peak.by_kind["comm_buffers"] > 0
    assert f"{(r.reserved_bytes - r.stats.allocated_peak_bytes) / GiB:.2f} GiB ({r.fragmentation:.1%})" in line
    assert line.endswith("the verdict holds the peak incl. communication buffers; [memory] reserved_verdict = true "
                         "holds this")


def test_the_fix_line_prints_what_decides_the_fit():
    """Llama-3-8B at seq 16384, FSDP over 4 x tp 2 on one dgx-h100 (usable 71.2 GiB, 79.11 GiB x 0.9):
    peak incl. communication buffers 72.75 GiB, over usable either way. Under memory.reserved_verdict the fix line's
    numbers are each variant's reserved peak + communication buffers (Timeline.verdict_bytes), which
    decide its fit, never its peak incl. communication buffers: recompute full prints its reserved 29.3 GiB,
    not its 27.7 GiB peak (re-planned here with and without the flag), and no "-> peak" is left; pp x2
    (66.2 GiB peak, 5.0 GiB free) fits by the peak incl. communication buffers only, so only that line offers it."""
    from meshplan.plan_fix import _variants, memory_fix
    from meshplan.plan_variant import planned

    held, alloc = _plan16(reserved_verdict=True), _plan16()
    assert not held.feasible and not alloc.feasible
    line = memory_fix(held)
    full = _plan16(recompute="full", reserved_verdict=True).timeline
    assert f"recompute full -> reserved peak {full.verdict_bytes / GiB:.1f} GiB (fits" in line
    assert f"{full.verdict_bytes / GiB:.1f}" != f"{full.peak.total_bytes / GiB:.1f}" and "-> peak" not in line
    assert "recompute full -> peak " in memory_fix(alloc) and "reserved peak" not in memory_fix(alloc)
    # pp x2 fits by its allocated peak, not by its reserved one: offered only where the allocated peak decides
    pp = next(cfg for words, cfg in _variants(held) if words.startswith("pp x2"))
    assert not planned(pp).feasible
    assert planned(replace(pp, memory=pp.memory.model_copy(update={"reserved_verdict": False}))).feasible
    assert "pp x2 (pp 2 x dp 2 x tp 2) -> peak" in memory_fix(alloc) and "pp x2" not in line


def _plan16(recompute="none", **memory):
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 16384, "micro_batch": 1, "sharding": "zero3",
                      "param_dtype": "bf16", "recompute": recompute},
         "mesh": {"names": ["dp", "tp"], "shape": [4, 2]}, "memory": memory}
    return build_plan(config_from_dict(d))
