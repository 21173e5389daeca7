"""What :data:`meshplan.pipeline.vshape.RESHARD_DEFECT` reads in torch's source, run on the installed
torch: pp 2 as two gloo processes, a V of 4 stages of one ``Linear`` each (rank 0 holds stages 0 and
3, rank 1 stages 1 and 2), each stage a ``fully_shard`` module with its layer a ``fully_shard`` unit
over a one-rank mesh of its own rank (FSDP2 swaps sharded and unsharded parameters as over a larger
data axis), 4 micro-batches; each stage's weight gradient against a plain backward of the same
micro-batches.

torch 2.13: with ``reshard_after_forward`` true, ``ScheduleZBVZeroBubble`` leaves rank 0's stage 3
gradient None (every ``I`` of it follows its forward, so ``stage_backward_input`` finds the sharded
weights, not the ones in the graph: no weight gradient, nothing to reduce-scatter, what ``validate``
measured) and rank 1's two stages short of some micro-batches; ``ScheduleDualPipeV`` gets rank 0's
stage 3 short too (its collectives are complete, so ``validate``'s comparison of them passes);
with ``reshard_after_forward`` false both are exact. Stage 0 (its ``I`` skipped, its ``W`` a full
backward) is right every time. A torch that fixes this fails the assertions: then the search's rule
``v-reshard``, the plan's warning and validate's refusal (one condition,
:func:`meshplan.pipeline.vshape.reshard_defect`) are to be re-measured."""

from __future__ import annotations

import pytest
from pp_fsdp_harness import case

pytestmark = pytest.mark.slow
TOL = 1e-6


def _right(g) -> bool:
    return g is not None and g < TOL


@pytest.mark.timeout(900)
def test_v_schedules_under_fsdp2_resharded_after_forward():
    zbv = case("zbv", True)
    assert _right(zbv[0]) and zbv[3] is None and not _right(zbv[1]) and not _right(zbv[2])
    dpv = case("dualpipev", True)
    assert _right(dpv[0]) and dpv[3] is not None and dpv[3] > TOL and _right(dpv[1]) and _right(dpv[2])
    for schedule in ("zbv", "dualpipev"):
        got = case(schedule, False)
        assert all(_right(g) for g in got.values()) and sorted(got) == [0, 1, 2, 3], (schedule, got)
