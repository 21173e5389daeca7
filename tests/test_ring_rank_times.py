"""torch's ring attention's per-rank times, taken for every cp rank at once in numpy
(meshplan.compute.ring_attention._rank_times, the search's estimate asks cp up to 4,096), are the scalar
loop's to the bit, with one value by hand."""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute import ring_attention as ra
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.kernel_time import issue_floor, memory_op_seconds
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import Attention

H100 = catalog.gpu("h100-sxm5-80gb")


def _scalar(gpu, rated, w, n, seq_local, rank):
    """One rank's time as slowest_rank's loop summed it before the numpy form (9ea292e0)."""
    fwd, bwd = ra.ring_bytes(n[0], n[1], w.cp, w.torch_eager, rank, n[2], w.cp_alltoall) if ra.applies(w) else (0, 0)
    t = memory_op_seconds(gpu, fwd) + memory_op_seconds(gpu, bwd)
    if rated is not None:
        f, b = ra._rank_sums(rated, w.cp, seq_local, rank)
        t += issue_floor(gpu, f) + issue_floor(gpu, b)
    return t


@pytest.mark.parametrize("cp", [2, 8, 64, 1024])
@pytest.mark.parametrize("eager,alltoall", [(False, False), (True, False), (False, True)])
def test_rank_times_are_the_scalar_loops(cp, eager, alltoall):
    seq = 1 << 20  # 1M tokens: L = seq / cp even at cp 1,024 (the 405B search asks cp up to 4,096 at 8k)
    att = Attention(2, 16, 8, seq // cp, seq, 128)
    w = Workload(seq_len=seq, cp=cp, micro_batch=2, torch_ring_attention=True, torch_eager=eager,
                 cp_alltoall=alltoall, attention_kernels=("FA2",))
    n = ra._elements(att, False)
    for rated in (ra.rated_calls(kernel_data(H100), att, cp, ("FA2",)), None):
        got = ra._rank_times(H100, rated, w, *n, seq // cp)
        assert got == [_scalar(H100, rated, w, n, seq // cp, r) for r in range(cp)]
        assert all(type(t) is float for t in got)


def test_rank_time_by_hand():
    # cp 4, one sequence of 4,096 tokens, 8 heads (K/V 8 too), d 64: L = 1,024 tokens a rank
    # n_q = 8 x 1,024 x 64 = 524,288 output elements; n_kv = 8 x 1,024 x (64 + 64) = 1,048,576 of K and V
    # eager, rank 3 (three whole-Q steps, test_ring_attention's per-element counts):
    #   forward n_q (12 + 38 x 3) + n_kv x 4 x 4 = 66,060,288 + 16,777,216 = 82,837,504 B
    #   backward n_q (20 + 10 x 3) + n_kv (24 + 13 x 3 + 4 x 3 + 8 x 4) = 26,214,400 + 112,197,632 = 138,412,032 B
    # no rated SDPA calls: the two kernels alone, each at BabelStream Triad (H100 catalog 2.97 TB/s) and above
    # the issue floor (a few microseconds): (82,837,504 + 138,412,032) / 2.97e12 = 74.49 us
    att = Attention(1, 8, 8, 1024, 4096, 64)
    w = Workload(seq_len=4096, cp=4, torch_ring_attention=True, torch_eager=True)
    n = ra._elements(att, False)
    assert n == (524_288, 1_048_576, 524_288)
    triad = kernel_data(H100).stream_bytes_per_s
    assert triad == pytest.approx(2.97e12, rel=0.01)
    t = ra._rank_times(H100, None, w, *n, 1024)
    assert t[3] == pytest.approx(221_249_536 / triad, rel=1e-12)
    assert t[3] == pytest.approx(74.49e-6, rel=0.01)
    # the bytes grow with the rank (forward 38 - 27 per Q element a step, backward 10 - 13 per Q and
    # 13 - 10 per K/V: + 8 n_q + 3 n_kv > 0): the slowest is rank 3, as slowest_rank says
    assert t == sorted(t) and ra.slowest_rank(H100, att, w).rank == 3
