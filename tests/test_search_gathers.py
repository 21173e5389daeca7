"""The search's step-time bound with pp > 1 counts the FSDP all-gathers of the passes that
find their chunk sharded (comm.fsdp_rows.fsdp_gather_flags), as the collective table and the
timeline do: before, it counted none, and the 405B example's bound fell to half of the exact
step (4.2 s against 7.1 s) so the best-first ranking planned thousands of candidates."""

import numpy as np

from meshplan.search.gather_passes import _gathers
from meshplan.spec.mesh import Schedule


def test_gathering_passes_of_1f1b_derived_by_hand():
    # p 2, m 3, reshard after forward. Stage 0 runs F0 F1 B0 F2 B1 B2: F0 gathers (starts
    # sharded), F1 gathers (F0 resharded), B0 gathers (F1 resharded), F2 does not (a backward
    # leaves the unit gathered), B1 gathers (F2 resharded), B2 does not: F 2, B 2.
    # Stage 1 runs F0 B0 F1 B1 F2 B2: F0, B0, B1, B2 gather: F 1, B 3.
    got = _gathers(Schedule.ONE_F_ONE_B, 2, 3, 1, True)
    assert got.tolist() == [[2, 1], [2, 3]]
    # without resharding only the first pass of the step gathers
    assert _gathers(Schedule.ONE_F_ONE_B, 2, 3, 1, False).tolist() == [[1, 1], [0, 0]]


def test_interleaved_counts_every_chunk():
    # p 2, m 2, v 2, no reshard: each of the 2 chunks gathers once, at its first forward
    got = _gathers(Schedule.INTERLEAVED_1F1B, 2, 2, 2, False)
    assert np.array_equal(got, [[2, 2], [0, 0]])
