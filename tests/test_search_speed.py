"""The search's fast path gives the exhaustive exact answer (issue 11 item 7, issue 13's fuzz
"hang"): the MoE expert all-gather and the CP exchange in the step-time bound, the step-only
exact evaluation (build_plan without memory timelines) of candidates the memory bound proves to
fit, and the memory verdict planned only for candidates near the memory limit whose step could
enter the top.

The workload: the small MoE of ``test_search`` (one dense layer, then 4 routed experts) on 2
DGX H100 nodes, so that efsdp groups cross nodes (ep 4 x efsdp 4: ranks 0, 4, 8, 12 of one
expert shard sit on nodes 0, 0, 1, 1) and cp 2 runs beside tp; HBM reduced so that memory binds.
Every feasible candidate is planned and simulated one by one (``build_plan`` + ``step_time``,
what ``meshplan plan`` and ``meshplan step`` run): the search's top 3 must be the exhaustive
ranking's, with the same step times to the bit and the same peaks.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from meshplan.comm.fsdp_rows import fsdp_gather_flags
from meshplan.memory import constraints as cons
from meshplan.pipeline.registry import get
from meshplan.pipeline.simulate import PipelineSpec, simulate
from meshplan.plan import build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.search.best_first import BOUND
from meshplan.search.driver import search
from meshplan.search.exact import SIMULATE, STEP_ONLY, Planner
from meshplan.search.pipeline import build_dag, gathering_units, stage_ends
from meshplan.schedule.window_unshard import unshard_leads
from meshplan.search.space import OK, SHARDING, candidate_config
from meshplan.search.gather_passes import _gathers
from test_search import MOE, config, exhaustive_rows

TOP = 3


def small_moe():
    return config(2, hbm_gb=2.5, model=MOE, micro_batch=[1, 2], recompute=["none", "full"], cp=[1, 2],
                  pp=[1, 2], top=TOP)


@pytest.fixture(scope="module")
def case():
    cfg = small_moe()
    r = search(cfg, workers=1)
    cache, plans = {}, {}
    for i in np.flatnonzero(np.isfinite(r.est.step_lo)):
        cc = candidate_config(cfg, r.candidates, int(i))
        if cc.training not in cache:
            cache[cc.training] = cons.constraints(cc.model, cc.training, cc.cluster, cc.cluster.world)
        plan = build_plan(cc, cache[cc.training])
        if plan.feasible:
            plans[int(i)] = (step_time(plan, Overlap()).step_s, plan.timeline.peak.total_bytes)
    return cfg, r, plans


def test_top3_is_the_exhaustive_exact_ranking(case):
    cfg, r, plans = case
    steps = {i: s for i, (s, _) in plans.items() if r.code[i] == OK}
    want = exhaustive_rows(r, steps, TOP, {i: plans[i][1] for i in steps})
    assert [e.index for e in r.top] == want
    assert [e.step_s for e in r.top] == [plans[i][0] for i in want]
    assert [e.peak_bytes for e in r.top] == [plans[i][1] for i in want]
    assert all(e.complete and e.breakdown is not None and e.goodput is not None for e in r.top)
    assert r.proven and not [n for n in r.notes if "bound" in n]


def test_the_workload_exercises_the_new_terms(case):
    """Candidates with efsdp across nodes and with cp 2 are feasible, and the ranking took
    some steps without a memory plan."""
    cfg, r, plans = case
    c = r.candidates
    assert any(c.efsdp[i] > 1 and c.ep[i] * c.etp[i] * c.efsdp[i] > cfg.cluster.node.gpus for i in plans)
    assert any(c.cp[i] > 1 for i in plans)
    assert any(not e.complete for e in r.exact.values())


def test_step_lower_bound_holds_on_every_feasible_candidate(case):
    _, r, plans = case
    for i, (step, _) in plans.items():
        assert r.est.step_lo[i] <= step * (1 + 1e-9), r.candidates.label(i)


def test_bound_counts_the_expert_all_gather(case):
    """pp 1 with zero3, ep > 1 and efsdp > 1: every forward of every MoE layer waits for the experts'
    all-gather, so the bound is at least micro-batches x MoE layers x that row's time (the
    plan's own collective table); without the term it fell below on these candidates."""
    cfg, r, plans = case
    c, checked = r.candidates, 0
    for i in plans:
        if c.pp[i] != 1 or c.efsdp[i] == 1 or c.ep[i] == 1 or SHARDING[c.sh[i]] == "zero1":
            continue  # ep 1: the experts are gathered with their block (mesh.tpsplit.experts_apart), no efsdp row
        plan = build_plan(candidate_config(cfg, c, i))
        row = next(x for x in plan.stage(0).collectives if x.axis == "efsdp" and x.op == "all-gather"
                   and x.phase == "forward")
        moe = cfg.model.layers - cfg.model.dense_layers
        assert r.est.step_lo[i] >= plan.micro_batches * moe * row.time_s, c.label(i)
        checked += 1
        if checked == 3:
            break
    assert checked


def test_step_only_equals_the_complete_evaluation(case):
    """build_plan without memory timelines gives the same step to the bit."""
    cfg, r, plans = case
    planner = Planner(cfg, r.candidates)
    fits = [i for i in plans if r.decided[i] == BOUND][:4]
    assert fits
    for i in fits:
        light, full = planner((i, STEP_ONLY)), planner((i, SIMULATE))
        assert not light.complete and full.complete
        assert light.step_s == full.step_s == plans[i][0]
        assert light.mfu == full.mfu and light.tokens_per_s == full.tokens_per_s


@pytest.mark.parametrize("schedule,vs", [("1f1b", [1]), ("interleaved_1f1b", [2, 4, 5]), ("zbv", [2]),
                                         ("dualpipev", [2])])
def test_gathering_passes_on_arrays_equal_the_gather_flags(schedule, vs):
    """The search's per-stage count of gathering passes (on the order arrays) equals the
    count of :func:`fsdp_gather_flags`, the rule the collective table and the timeline use,
    without and with torch's window of 3 local stages (which evicts at vpp 4 and 5), less the
    passes the timeline gathers from torch's UNSHARD ops before them (schedule.window_unshard.
    unshard_leads: the window's re-gathers and, under the multi-stage schedules, each chunk's first
    pass but stage 0's op 0, which waits for all its gathers from the step's start): the step
    bound counts only the gathers in the pass."""
    checked = 0
    for p in (2, 3, 4):
        for m in (2, 4, 8, 12):
            for v in vs:
                if get(schedule).reasons(p, m, v):
                    continue
                for reshard, window in itertools.product((False, True), (0, 3)):
                    want = np.zeros((2, p))
                    for s in range(p):
                        ahead = {k for k, _, b in unshard_leads(schedule, p, m, v, s, window) if s or b}
                        for key, g in fsdp_gather_flags(schedule, p, m, v, s, reshard, window=window).items():
                            want[int(key[1] != "F"), s] += g and key not in ahead
                    assert _gathers.__wrapped__(schedule, p, m, v, reshard, window).tolist() == want.tolist()
                    checked += 1
    assert checked >= 8



@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("interleaved_1f1b", 2, 4, 2),
                                            ("interleaved_1f1b", 4, 8, 3)])
def test_dag_on_arrays_gives_the_reference_simulation_stage_ends(schedule, p, m, v):
    """The refined bound's DAG (built on arrays) run with arbitrary unit durations ends each
    stage where the reference event simulation does (meshplan.pipeline.simulate)."""
    rng = np.random.default_rng(p * 100 + m * 10 + v)
    f, b = rng.uniform(1, 2, (1, p, v)), rng.uniform(2, 4, (1, p, v))
    p2p = np.array([[0.3]])
    ends = stage_ends(build_dag(schedule, p, m, v), f, b, p2p)[0]
    spec = PipelineSpec(schedule, p, m, v, p2p_s=0.3,
                        duration=lambda s, u: float((b if u.kind == "B" else f)[0, s, u.chunk]))
    ref = simulate(spec)
    want = [max(e.end_s for e in ref.events if e.stage == s and e.stream == "compute") for s in range(p)]
    assert ends.tolist() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2),
                                            ("interleaved_1f1b", 4, 8, 3), ("interleaved_1f1b", 2, 8, 4),
                                            ("interleaved_1f1b", 4, 8, 5)])
def test_gathering_units_of_the_dag_equal_the_gather_flags(schedule, p, m, v):
    dag = build_dag(schedule, p, m, v)
    for reshard, window in itertools.product((False, True), (0, 3)):
        flags = [fsdp_gather_flags(schedule, p, m, v, s, reshard, window=window) for s in range(p)]
        ahead = [{k for k, _, b in unshard_leads(schedule, p, m, v, s, window) if s or b}  # less these
                 for s in range(p)]
        want = np.zeros((2, dag.stage.size))
        for i in range(dag.stage.size):
            key = (int(dag.chunk[i]), "B" if dag.backward[i] else "F", int(dag.mb[i]))
            want[int(dag.backward[i]), i] = flags[dag.stage[i]][key] and key not in ahead[dag.stage[i]]
        assert gathering_units(schedule, p, m, v, reshard, window).tolist() == want.tolist()
