"""Newcomer trial 27 #C: ``search`` lists meshes that keep under 15% of the usable memory free after
the others (its headroom tiers), while ``compare`` chose such a mesh (64.5 of 67.1 GiB, 3.9% free)
with no word. compare now warns per tight side with the search's own rule
(:func:`meshplan.memory.headroom.tight`, one home)."""

from __future__ import annotations

from meshplan.compare import compare
from meshplan.config import config_from_dict
from meshplan.memory.headroom import headroom_words, tight
from meshplan.plan import build_plan
from meshplan.units import GiB


def _plan(recompute: str):
    return build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 16, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3", "recompute": recompute},
        "mesh": {"names": ["dp_shard"], "shape": [8]}}))


def test_the_rule_at_its_threshold():
    """usable 67.1 GiB: tight above 0.85 x 67.1 = 57.0 GiB of peak (15% free), whatever the search."""
    usable = 72e9  # 80e9 B of HBM less a 10% reserve, 67.06 GiB
    assert tight(0.85 * usable + 1, usable, 0.0) and not tight(0.85 * usable - 1, usable, 0.0)
    assert not tight(0.85 * usable + 1, usable, 0.15)  # the plan reserves the 15% itself
    assert headroom_words(usable + 1, usable, 0.0) == ""  # over usable: infeasible, the plan's verdict
    # 64.5 GiB of 67.1: (67.1 - 64.5) = 2.6 GiB free, 2.6 / 67.1 = 3.9%
    assert headroom_words(64.5 * GiB, 67.1 * GiB, 0.0) == "tight: 2.6 GiB = 3.9% of the usable 67.1 GiB free, under 15%"


def test_compare_warns_of_the_tight_side_only():
    """Llama-3-8B at seq 8192, micro-batch 1, dp_shard 8 on one dgx-h100 (usable: the H100's runtime
    total 79.11 GiB x 0.9 = 71.20 GiB): no recompute peaks at 63.12 GiB, 71.20 - 63.12 = 8.08 GiB =
    8.08 / 71.20 = 11.3% free, under 15% (tight, as the search tiers it; at the datasheet's 80e9 x 0.9 B
    = 67.06 GiB it was 3.94 GiB = 5.9%); full recompute keeps only each layer's input and is clear. The faster mesh (no recompute)
    wins by the step; the warning names it, not the other."""
    a, b = _plan("none"), _plan("full")
    usable = 79.11 * 2**30 * 0.9
    assert a.timeline.usable_bytes == usable
    assert round(a.timeline.peak.total_bytes / GiB, 2) == 63.12
    free = usable - a.timeline.peak.total_bytes
    assert (round(free / GiB, 2), round(free / usable, 3)) == (8.08, 0.113)
    assert not tight(b.timeline.peak.total_bytes, usable, 0.0)
    c = compare(a, b, names=("none", "full"))
    assert c.winner == "none"
    assert c.headroom_lines() == [
        "warning (none): tight: 8.1 GiB = 11.3% of the usable 71.2 GiB free, under 15% at [memory] "
        "fragmentation_fraction 0%; PyTorch's caching allocator was measured to lose about 15% to fragmentation in "
        "LLM training (GMLake, ASPLOS 2024), and search lists such a mesh after those that keep 15% free"]
