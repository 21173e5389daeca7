"""te_ring._slowest_rank rates step by step only the ranks near the slowest (its docstring): each
rank's total from its kinds of steps times their counts (_rank_totals) equals the step-by-step sum
(_rated_rank) up to rounding, and the rank kept (and its every field) is the one rating every rank
keeps, at cp above NEAR_MAX where the selection applies: the brute force below is the rule
_slowest_rank ran before (every rank rated, the longest kept, the lowest within 1e-9)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest

from meshplan import catalog
from meshplan.compute import te_ring
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.kernel_time import issue_floor, memory_op_seconds
from meshplan.compute.ring_attention import rank_seconds, rated_calls
from meshplan.compute.shapes import Attention

H100 = catalog.gpu("h100-sxm5-80gb")


def _sizes(att):
    rows, kv_rows = att.batch * att.q_heads * att.seq_q, att.batch * att.kv_heads * att.seq_q
    return rows * att.d_v, rows, rows * att.head_dim, kv_rows * att.head_dim, kv_rows * att.d_v


def _floored(att, cp):
    rated = rated_calls(kernel_data(H100), att, cp, ("FA3",))
    return rated, {c: (issue_floor(H100, f), issue_floor(H100, b)) for c, (f, b, _) in rated.items()}


def _brute(att, cp, rated, floored, spread):
    seconds = lru_cache(maxsize=None)(lambda n: memory_op_seconds(H100, n))
    best = None
    for r in range(cp):
        t, one = te_ring._rated_rank(H100, cp, att.seq_q, r, _sizes(att), floored, spread, seconds)
        if best is None or t > best[0] * (1 + 1e-9):
            best = (t, one)
    return replace(best[1], how=rank_seconds(rated, cp, att.seq_q, best[1].rank)[2]) if rated else best[1]


# (batch, q heads, kv heads, L = s / cp, s, head dim): DeepSeek-V3-like 128 heads at tp 1..8 and a
# GQA Llama shape; tiny local sequences (2 tokens a rank at cp 2,048 of 4,096) to long ones
SHAPES = [(1, 128, 128, 2, 4096, 192), (1, 16, 16, 16, 4096, 192), (2, 8, 1, 64, 8192, 128),
          (1, 64, 64, 256, 32768, 128), (4, 32, 8, 1024, 131072, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cp", [2, 3, 7, 16])
@pytest.mark.parametrize("rated_on", [True, False])
def test_rank_totals_equal_the_step_sums(shape, cp, rated_on):
    b, hq, hk, L, s, d = shape
    att = Attention(b, hq, hk, L, s, d)
    rated, floored = _floored(att, cp) if rated_on else (None, None)
    seconds = lru_cache(maxsize=None)(lambda n: memory_op_seconds(H100, n))
    for r in range(cp):
        exact, _ = te_ring._rated_rank(H100, cp, L, r, _sizes(att), floored, 3e-4, seconds)
        fast = te_ring._rank_totals(H100, cp, L, r, _sizes(att), floored, 3e-4, seconds)
        assert fast == pytest.approx(exact, rel=1e-12, abs=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cp", [65, 128, 256])
@pytest.mark.parametrize("rated_on", [True, False])
def test_slowest_rank_is_the_brute_force_one(shape, cp, rated_on):
    b, hq, hk, L, s, d = shape
    att = Attention(b, hq, hk, max(2, L - L % 2), s, d)
    rated, floored = _floored(att, cp) if rated_on else (None, None)
    got = te_ring._slowest_rank(H100, att, cp, ("FA3",), kernel_data(H100) if rated_on else None, 3e-4)
    assert got == _brute(att, cp, rated, floored, 3e-4)
    seconds = lru_cache(maxsize=None)(lambda n: memory_op_seconds(H100, n))
    # the selection applied (one rank rated step by step: rank 0 or cp - 1 on these shapes), not the fallback
    assert te_ring._near_slowest(H100, cp, att.seq_q, _sizes(att), floored, 3e-4, seconds) in ([0], [cp - 1])
