"""torchtitan's DeepEPMoE runs the shared experts while DeepEP's combine is in flight (issue 11,
torchtitan breadth; meshplan.comm.deepep.shared_forward_s): pytorch/torchtitan e347b1e
``models/moe/moe_deepep.py`` 39-81 (the routed experts' hook issues the combine with
``async_finish=True`` and returns, ``self.shared_experts(x)`` runs, then ``sync_combine()``;
``distributed/deepep/deepep.py`` 171-202, 247-285). The dispatch and the backward's calls wait at
once. Megatron-LM's flex dispatcher and torch's all-to-all path are not changed.

DeepSeek-V2-Lite cut to 2 layers (one dense, one MoE with 2 shared experts of 1408), dp_shard 8 x ep 8 (experts: efsdp 1 x ep 8)
on one DGX H100 (DeepEP's intranode kernels), seq 4096, micro-batch 1, recompute none.
"""

from __future__ import annotations

import pytest

from meshplan.comm.deepep import shared_forward_s
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

SHARED = "mlp shared experts (beside the combine)"


def _step(framework: str = "torch", dispatcher: str = "deepep"):
    cfg = config_from_dict({"model": {"catalog": "deepseek-v2-lite", "layers": 2},
                            "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "recompute": "none",
                                         "framework": framework, "moe_dispatcher": dispatcher,
                                         "sharding": "zero1" if framework == "megatron" else "zero3"},
                            "mesh": {"names": ["dp_shard", "ep"], "shape": [8, 8]} if framework == "torch" else
                            {"names": ["dp", "ep"], "shape": [8, 8]}})
    return step_time(build_plan(cfg))


def _forward_events(st):
    fwd = [e for e in st.pipeline.events if e.stage == 0 and e.name[0] == "F"][0]
    return st.units.of_event(fwd).events


def test_shared_experts_run_beside_the_combine():
    """The MoE layer's forward: after the routed experts' compute the combine is issued and the shared
    experts (shared_w_up 2 x 1408 wide, shared_w_down: their two forward GEMMs, shared_forward_s) start at
    the same instant on the compute stream; the wait for the combine ends when the later of the two
    does, so the combine's exposed time is max(combine - shared, 0) where it was the whole combine."""
    st = _step()
    ev = _forward_events(st)
    (shared,) = [e for e in ev if e.name == SHARED]
    (combine,) = [e for e in ev if e.name == "ep combine"]
    (wait,) = [e for e in ev if e.name == "mlp combine wait"]
    assert shared.start_s == pytest.approx(combine.start_s, abs=1e-12)
    assert wait.start_s == pytest.approx(max(shared.end_s, combine.end_s), abs=1e-12)
    moe = [c for c in st.units.chunks[0][0].layers if any(o.name.startswith("expert_") for o in c.ops)][0]
    gemms = {o.name: o.seconds for o in moe.ops if o.phase == "forward" and o.kind == "gemm"}
    assert shared_forward_s(moe, "forward") == gemms["shared_w_up"] + gemms["shared_w_down"] > 0
    # the shared GEMMs' time, stretched only by DeepEP's SMs beside them (never shortened)
    assert shared.end_s - shared.start_s >= shared_forward_s(moe, "forward") * (1 - 1e-12)


@pytest.mark.parametrize("framework, dispatcher", [("torch", "alltoall"), ("megatron", "deepep")])
def test_no_overlap_elsewhere(framework, dispatcher):
    """torch's all-to-all (its combine waits inside the routed experts' hook) and Megatron-LM's flex
    dispatcher (token_dispatcher.py 824-833 at d98e8a6: the combine before the shared experts' output is
    added, waited for) run the shared experts before the combine, as before."""
    assert not [e for e in _forward_events(_step(framework, dispatcher)) if e.name == SHARED]
