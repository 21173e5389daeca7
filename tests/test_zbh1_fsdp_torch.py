"""What :data:`meshplan.pipeline.zb_h1.RESHARD_DEFECT` reads in torch's source, run on the installed
torch: pp 2 as two gloo processes, ``ScheduleInterleavedZeroBubble`` (meshplan's zb_h1) with one stage
per rank, each stage one ``Linear`` + tanh, its layer a ``fully_shard`` unit inside a ``fully_shard``
stage module over a one-rank mesh of its own rank (FSDP2 swaps sharded and unsharded parameters as
over a larger data axis; tests/pp_fsdp_harness.py, shared with tests/test_zbv_fsdp_torch.py), 4 micro-batches; each stage's
weight gradient against one process's plain backward of the same micro-batches.

torch 2.13: with ``reshard_after_forward`` true stage 1 (the last; its backward split into I and W)
ends with no weight gradient (None), stage 0 (its I skipped, its W a full backward) is exact; with it
false both are exact. A torch that fixes this fails the assertions: then zb_h1's warning and the
bubble hint's ``training.reshard_after_forward = false`` on its knob are to be re-measured."""

from __future__ import annotations

import pytest
from pp_fsdp_harness import case

pytestmark = pytest.mark.slow
TOL = 1e-6


@pytest.mark.timeout(600)
def test_zb_h1_under_fsdp2_resharded_after_forward():
    got = case("zb_h1", True)
    assert got[0] is not None and got[0] < TOL and got[1] is None, got
    got = case("zb_h1", False)
    assert sorted(got) == [0, 1] and all(g is not None and g < TOL for g in got.values()), got
