"""Newcomer trial 24, finding #3: ``compare`` of pp 4 vpp 2 against dp_shard 32 x tp 8 printed
``compute: A ..., B ... (+70.0 ms)`` and nothing under it: the kernel kinds it itemises leave out the
GEMMs and attention, and those outside were each under the 0.1% floor. The compute line now ends with
each side's compute by kernel kind (GEMMs, attention, copies on the compute stream, other) on its
critical stage (meshplan/compare/reasons.py). The test failed before the fix.
"""

from __future__ import annotations

import pytest

from meshplan.compare import compare
from meshplan.config import config_from_dict
from meshplan.plan import build_plan


def test_compare_prints_compute_by_kernel_kind():
    """Llama-3-8B, one dgx-h100, global batch 16 of 4096 tokens, micro-batch 1, no recompute:
    A = pp 2 x dp_shard 4 (16 layers a stage, 16 / 4 = 4 micro-batches), B = dp_shard 8 (32 layers,
    16 / 8 = 2 micro-batches). Both run 64 layer passes on their critical stage (A's stage 0:
    16 x 4, B: 32 x 2) at the same local shapes, one layer's GEMMs g = 7.517 ms and attention
    1.539 ms, so attention is 64 x 1.539 = 98.5 ms on both sides and the GEMMs differ only by B's
    head: A 64 g = 481.1 ms, B 64 g + 2 micro-batches x the head's GEMMs 18.86 ms = 518.8 ms. The
    four kinds add up to each side's compute line (681.6 and 849.8 ms, to rounding).
    (nicshare4: FSDP2's reduce-scatters on their own stream, one in flight: B's backward kernels run
    under fewer collective-holding intervals, SM contention 19.7118 -> 19.5719 ms a backward, x 2 =
    -0.28 ms: compute 850.1 -> 849.8 ms, and its copy-ins wait for the reduce-scatter before, exposed
    fsdp 0 -> 0.7697 ms a backward, 12.2 -> 13.7 ms; A's stage 0 runs its deferred reduction's 16
    copy-ins (0.4406 ms) between the reduce-scatters, +7.05 ms, 37.1 -> 44.2 ms, as
    tests/test_compare_settings.py's pp 2 x dp_shard 4 side.) (kvheads: no repeat_kv copies, ``[memory]
    kv_expanded`` false: 64 layer passes x 2 x 83,886,080 B at 2.97 TB/s (56.49 us) = 3.6 ms less on each side:
    compute 681.6 -> 678.0 and 849.8 -> 846.2 ms, in the memory-bound kind.)"""
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 16, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                         "recompute": "none"}}
    a = build_plan(config_from_dict({**base, "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4]}}))
    b = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard"], "shape": [8]}}))
    c = compare(a, b, names=("pp2", "dp8"))
    i = c.reasons.index("compute: pp2 678.0 ms, dp8 846.2 ms (+168.2 ms)")
    line = next(r for r in c.reasons[i + 1:] if r.startswith("of compute by kernel kind"))
    assert c.reasons.index(line) < c.reasons.index("exposed fsdp: pp2 44.2 ms, dp8 13.7 ms (-30.5 ms)")
    parts = dict(p.split(" pp2 ", 1) for p in line.split("per step): ", 1)[1].split("; "))
    assert parts["GEMMs"] == "481.1 ms, dp8 518.8 ms (+37.7 ms)"
    assert parts["attention"] == "98.5 ms, dp8 98.5 ms (+0.0 ms)"
    (sa, sb) = ([float(v.split(", dp8 ")[k].split(" ms")[0]) for v in parts.values()] for k in (0, 1))
    assert (sum(sa), sum(sb)) == (pytest.approx(678.0, abs=0.2), pytest.approx(846.2, abs=0.2))
    assert round(64 * 2 * 83_886_080 / 2.97e12 * 1e3, 1) == 3.6
    # by hand: 64 layer passes of one layer's GEMMs on both sides, plus B's two heads
    ga, gb = (s.step for s in (c.a, c.b))
    layer = [sum(o.seconds for o in ch.layers[0].ops if o.kind == "gemm") for ch in ga.units.chunks[0]][0]
    head = sum(o.seconds for ch in gb.units.chunks[0] if ch.head is not None for o in ch.head.ops if o.kind == "gemm")
    assert (round(layer * 1e3, 3), round(head * 1e3, 2)) == (7.517, 18.86)
    assert round((12.1657 + 2 * 0.7697) * 1e-3, 4) == round(gb.exposed_s["fsdp"], 4)  # 12.1657: before
    assert (round(64 * layer * 1e3, 1), round((64 * layer + 2 * head) * 1e3, 1)) == (481.1, 518.8)
