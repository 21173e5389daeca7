"""The search's step-time lower bound counts the pipeline calls that block a stage (torch 2.13's
single-stage 1F1B and GPipe since torchp2p, Megatron-LM's 1F1B): each call a stage waits on
holds it at least ``k x p2p_s`` after the unit before it (:func:`meshplan.pipeline.rounds.run_rounds`'
``max(post, peer posts) + k p2p_s``), counted from the simulator's own calls
(:func:`meshplan.search.pipeline.schedule_call_loads`). ``tests/test_search.py`` checks that the
bounds stay below every simulated step of its small worlds; here the term's value.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec
from meshplan.plan import build_plan
from meshplan.schedule.overlap_policy import P2PMode
from meshplan.schedule.pipeline_exposure import call_loads
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.driver import search
from meshplan.search.estimate import estimate
from meshplan.search.layer_bounds import unit_bounds
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.pipeline import pipeline_bound, schedule_call_loads
from meshplan.search.space import candidate_config
from meshplan.search.time_tables import TimeTables
from test_search import config

TORCH = P2PMode(blocking_p2p=True, overlap_p2p=False, torch_p2p=True)


def test_gpipe_calls_by_hand():
    """torch 2.13's GPipe at p 4, m 4 (``ScheduleGPipe._step_microbatches``: each receive posted
    and waited right before its unit, the sends unwaited but the last forward's and the last
    backward's). Stage 0 (F0-F3 B0-B3): its F0-F2 leave unwaited and it receives no
    activation, so its calls hold after F3 (F3's waited send and B0's receive), B0, B1 and B2
    (the next gradient's receive). Stage 1 receives every unit's input right before it (F0's in
    its leading call) and waits B3's send at the end: every call holds."""
    loads = schedule_call_loads("gpipe", 4, 4, 1, TORCH)
    assert loads[0].astype(int).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0]
    assert loads[1].astype(int).tolist() == [1] * 9


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_call_loads_are_the_simulations(schedule):
    """The bound's calls are the ones step_time's simulation holds (pipeline_exposure.call_loads of
    the simulated pipeline, torch's blocking calls), at p 4, m 8."""
    res = simulate_arrays(PipelineSpec(schedule, 4, 8, forward_s=1.0, backward_s=2.0, p2p_s=0.5, **TORCH._asdict()))
    np.testing.assert_array_equal(schedule_call_loads(schedule, 4, 8, 1, TORCH), call_loads(res))


def _units(p: int) -> dict:
    """Unit bounds of a uniform pipeline: F 1 s, B 2 s, sends 0.5 s, nothing else."""
    z = np.zeros((1, p))
    return {"f_core": np.ones((1, p)), "b_core": 2 * np.ones((1, p)), "emb_f": z, "emb_b": z, "head_f": z,
            "head_b": z, "p2p": np.array([[0.5]]), "tail": z, "end": z}


def test_pipeline_bound_holds_torch_calls_by_hand():
    """p 2, m 2, F 1 s, B 2 s, sends 0.5 s. Asynchronous sends: stage 1 runs F0 1.5-2.5, B0
    2.5-4.5, F1 4.5-5.5 (F1's input arrived at 2.5), B1 5.5-7.5; stage 0's B1 starts at 7.5 + 0.5
    and ends at 10. torch's 1F1B: stage 1's call after B0 sends B0's gradient and receives F1's
    input, waited at once, so F1 starts at 4.5 + 0.5 = 5; B1 runs 6-8, its send reaches stage 0 at
    8.5, and stage 0's B1 ends at 10.5. The bound with the calls' holds is that step, 0.5 s more
    than without; at p 4, m 8 it is the simulated step too (uniform units: no wait for a late
    partner beyond the transfers)."""
    u = _units(2)
    assert float(pipeline_bound(u, 1, 2)[0]) == 10.0
    assert float(pipeline_bound(u, 1, 2, loads=schedule_call_loads("1f1b", 2, 2, 1, TORCH))[0]) == 10.5
    sim = simulate_arrays(PipelineSpec("1f1b", 2, 2, forward_s=1.0, backward_s=2.0, p2p_s=0.5, **TORCH._asdict()))
    assert sim.step_s == 10.5
    sim4 = simulate_arrays(PipelineSpec("1f1b", 4, 8, forward_s=1.0, backward_s=2.0, p2p_s=0.5, **TORCH._asdict()))
    held = pipeline_bound(_units(4), 1, 8, loads=schedule_call_loads("1f1b", 4, 8, 1, TORCH))
    assert (float(pipeline_bound(_units(4), 1, 8)[0]), float(held[0]), sim4.step_s) == (41.0, 42.5, 42.5)


def test_torch_pp4_bound_tighter_by_the_last_stages_calls(monkeypatch):
    """pp 4 x dp_shard 2 (torch 1F1B, 8 GPUs, the small Llama of test_search, global batch 64,
    micro-batch 1: m = 32). The vectorised bound's binding stage is the last (the head's): its
    forwards feed its own backwards, so its calls hold after each backward but the last (the next
    forward's input received, waited right before it): m - 1 = 31 calls, 31 x p2p_s more than the
    bound without them (0.162366 s -> 0.163688 s, p2p_s 42.65 us: 8 MiB of activations over
    NVLink), still below the planned step (0.164541 s). Both were 221.76 us lower (0.162144,
    0.163466 s) before the last unit's tail counted its 2 layers' reductions
    (step_end_bound.final_reduce_tail): stage 0's tail, which the drain ends with, is rs + (rs -
    ci) = 258.38 + (258.38 - 80.76) = 436.00 us (reduce-scatter 258.38 us, copy-in 80.76 us, no
    HSDP all-reduce), was one layer's rs less the embedding's gradient beside it, 214.25 us. Under
    FSDP2's one reduce-scatter in flight (step_end_bound.reduce_flow_shop_s rs_wait, torch 2.13
    _fsdp_param_group.py 639-658) the second copy-in waits for the first reduce-scatter: the tail is
    (ci + rs) x 2 - 2 ci = 2 rs = 516.76 us, ci = 80.76 us more: 0.162366 -> 0.162447 s and 0.163688 ->
    0.163769 s, still below the step. (kvheads: no repeat_kv copies, [memory] kv_expanded false, 192 ops
    on the path, 3 a layer under full x 2 layers x 32 micro-batches, each 2 x 2048 x (16 + 4) x 128 x 2 B
    = 20,971,520 B: the bound 0.162447 -> 0.161132 s and 0.163769 -> 0.162454 s, the planned step
    0.164703 -> 0.163388 s, each 1.3146 ms shorter (6.85 us an op, read from the model); kv_expanded
    true gives the values before.)"""
    cfg = config(1, 6.0, micro_batch=[1], recompute=["full"], pp=[4], top=3)
    r = search(cfg, workers=1)
    c = r.candidates
    i = next(j for j in range(len(c)) if c.label(j) == "pp 4 x dp_shard 2, mb 1, full, vpp 1, zero3")
    tt = TimeTables(cfg, Tables(cfg))
    g = c.take(np.array([i]))
    st = stage_layout(cfg, g, 4)
    p2p = float(unit_bounds(cfg, tt, g, st, state(cfg, tt.tables, g, st))["p2p"][0, 0])
    monkeypatch.setattr("meshplan.search.timing.call_holds",
                        lambda cfg, c, m, apart=False: (np.zeros((len(c), 4)), np.zeros((len(c), 4))))
    before = estimate(cfg, c, r.code).step_lo[i]
    new = r.est.step_lo[i]
    assert new - before == pytest.approx(31 * p2p, rel=1e-9)
    assert (round(before, 6), round(new, 6), round(p2p * 1e6, 2)) == (0.161132, 0.162454, 42.65)
    step = step_time(build_plan(candidate_config(cfg, c, i)), Overlap()).step_s
    assert new <= step and round(0.164703 - step, 6) == round(0.162447 - before, 6) == 0.001315   # kvheads
