"""The pipeline simulation on arrays (meshplan.pipeline.fast, issue 11 item 4) against the
reference event loop (meshplan.pipeline.simulate.simulate): the same orders, and every time,
wait, busy sum and critical path equal to the bit, on every schedule over small p, m, v with
uneven per-stage durations and p2p time; and step_time (which runs the fast path) against the
reference loop on real plans where both run."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.pipeline.fast import KINDS, flat_units, order_arrays, rendezvous, simulate_arrays
from meshplan.pipeline.rounds import run_rounds, run_rounds_general
from meshplan.pipeline.simulate import PipelineSpec, simulate, stage_order
from meshplan.plan import build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.pipeline_exposure import unit_exposure
from meshplan.schedule.steptime import step_time

CASES = [(sch, p, m, v) for sch in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b") for p in (1, 2, 3, 4)
         for m in (1, 2, 3, 4, 8) for v in ((1, 2, 3) if sch == "interleaved_1f1b" else (1,))
         if sch != "interleaved_1f1b" or m % max(1, m // p) == 0]  # torch's rounds (m 3 at p 2: one of 3)
CASES += [("zbv", p, m, 2) for p in (2, 3, 4) for m in (1, 2, 3, 5, 8)]  # V-shaped: the schedule's chunk map
CASES += [("dualpipev", p, m, 2) for p in (2, 3, 4) for m in (2 * p, 2 * p + 1, 3 * p)]


@pytest.mark.parametrize("sch,p,m,v", CASES)
def test_orders_equal_the_reference(sch, p, m, v):
    for s in range(p):
        k, mb, c = order_arrays(sch, p, m, v, s)
        assert [(KINDS[a], int(b), int(x)) for a, b, x in zip(k, mb, c)] == \
            [(u.kind, u.mb, u.chunk) for u in stage_order(sch, p, m, v, s)]


def _key_of_event(e):
    return (e.stage, e.stream, e.name, e.start_s, e.end_s, e.args.get("via"), e.args.get("wait_s"))


V_SHAPED = ("zbv", "dualpipev")  # one combined blocking call per unit deadlocks them (Megatron 2022 had neither)


def blocking_runs(sch: str, p: int, m: int) -> bool:
    """Whether blocking p2p (Megatron-LM 2022) can run the case: interleaved 1F1B only with
    p | m, Megatron-LM's rule (torch's other rounds run with its asynchronous sends)."""
    return sch != "interleaved_1f1b" or m % p == 0


@pytest.mark.parametrize("blocking", [False, True, "torch"])
@pytest.mark.parametrize("sch,p,m,v", CASES)
def test_simulation_equals_the_reference_to_the_bit(sch, p, m, v, blocking):
    """``blocking``: Megatron-LM 2022's blocking calls, both stages of every transfer
    rendezvous (interleaved: a steady-state forward's output sent with the next backward's,
    the backward after next's gradient received there), always with p2p time; "torch": torch
    2.13's single-stage GPipe and 1F1B calls (``torch_p2p``: some sends without a wait)."""
    if blocking == "torch" and sch not in ("gpipe", "1f1b"):
        return
    if blocking and not blocking_runs(sch, p, m):
        return
    if blocking and sch in V_SHAPED and m > 1:  # both simulators find the deadlock
        for run in (simulate, simulate_arrays):
            with pytest.raises(RuntimeError, match="deadlock"):
                run(PipelineSpec(sch, p, m, v, p2p_s=0.1, blocking_p2p=True))
        return
    rng = np.random.default_rng(1000 * p + 10 * m + v)
    table: dict = {}

    def dur(s, u):  # uneven stages, chunks and kinds; the last micro-batch's unit differs
        return table.setdefault((s, u.kind, u.chunk, u.mb == m - 1), float(rng.uniform(0.5, 2.0)))

    spec = PipelineSpec(sch, p, m, v, weight_s=0.3, p2p_s=0.1 if m % 2 or blocking else 0.0, duration=dur,
                        blocking_p2p=bool(blocking), torch_p2p=blocking == "torch")
    ref, new = simulate(spec), simulate_arrays(spec)
    assert (new.step_s, new.busy_s, new.bubble) == (ref.step_s, ref.busy_s, ref.bubble)
    assert sorted(map(_key_of_event, new.events)) == sorted(map(_key_of_event, ref.events))
    assert [_key_of_event(e) for e in new.critical_path] == [_key_of_event(e) for e in ref.critical_path]
    for s in range(p):
        assert sorted(map(_key_of_event, new.stage_events(s))) == \
            sorted(_key_of_event(e) for e in ref.events if e.stage == s)


def _plan(schedule: str, vpp: int = 1):
    mesh = {"names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 4], "sequence_parallel": True,
            "pp_schedule": schedule}
    if vpp > 1:
        mesh["virtual_stages"] = vpp
    return build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
        "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                     "param_dtype": "bf16", "compute_dtype": "bf16", "recompute": "selective"},
        "mesh": mesh}))


@pytest.mark.parametrize("schedule,vpp", [("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)])
def test_step_time_equals_the_reference_loop(schedule, vpp):
    """Llama-3-8B, pp 4 x dp_shard 2 x tp 4 on 4 DGX H100, 32 micro-batches: the step model's
    pipeline (fast path) against the reference simulation of the same spec, and the critical
    stage's unit exposure against the reference per-event loop that step_time ran before (the
    schedules torch runs with asynchronous sends; its GPipe and 1F1B wait in their calls:
    test_blocking_step_time_equals_the_reference)."""
    st = step_time(_plan(schedule, vpp), Overlap())
    res, spec = st.pipeline, st.pipeline.spec
    assert not spec.blocking_p2p
    ref = simulate(spec)
    assert (res.step_s, res.busy_s) == (ref.step_s, ref.busy_s)
    assert [_key_of_event(e) for e in res.critical_path] == [_key_of_event(e) for e in ref.critical_path]
    crit = st.critical_stage
    loop: dict = {}
    for e in ref.events:
        if e.stage != crit or e.stream != "compute":
            continue
        for k, val in st.units.of_event(e).exposed_s.items():
            loop[k] = loop.get(k, 0.0) + val
        if e.args["via"] == "p2p":
            loop["pp"] = loop.get("pp", 0.0) + min(spec.p2p_s, e.args["wait_s"])
    keys, key_idx = st.units.index(res.flat)
    assert unit_exposure(res, crit, st.units, keys, key_idx, {}) == loop
    assert loop  # this mesh exposes tp and pp time: the comparison is not empty


@pytest.mark.parametrize("framework,schedule,vpp", [("megatron", "1f1b", 1), ("megatron", "interleaved_1f1b", 2),
                                                    ("torch", "1f1b", 1), ("torch", "gpipe", 1)])
def test_blocking_step_time_equals_the_reference(framework, schedule, vpp):
    """The same mesh with blocking calls (Megatron-LM 2022's rendezvous; torch 2.13's GPipe and
    1F1B ``_step_microbatches``): the step model's array pipeline against the reference simulation
    of its spec, to the bit, and the rendezvous is not empty (some call waits for a late peer)."""
    cfg = _plan(schedule, vpp).config
    cfg = replace(cfg, training=cfg.training.model_copy(update={"framework": framework}))
    st = step_time(build_plan(cfg), Overlap())
    res, spec = st.pipeline, st.pipeline.spec
    assert spec.blocking_p2p and spec.torch_p2p == (framework == "torch")
    ref = simulate(spec)
    assert (res.step_s, res.busy_s) == (ref.step_s, ref.busy_s)
    assert sorted(map(_key_of_event, res.events)) == sorted(map(_key_of_event, ref.events))
    assert [_key_of_event(e) for e in res.critical_path] == [_key_of_event(e) for e in ref.critical_path]
    assert (res.hold > spec.p2p_s * (1 + 1e-9)).any()


def test_blocking_sends_by_hand():
    """1F1B, p 2, m 2, F 1 s, B 2 s, p2p 0.5 s. Asynchronous sends (the receiver waits p2p):
    stage 1 F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5, B1 5.5-7.5; stage 0 B0 at 4.5 + 0.5 = 5-7, B1
    at 7.5 + 0.5 = 8-10: step 10. Blocking (Megatron-LM 2022, each call ends at max(own post,
    peer's post) + 0.5): stage 0 F0 0-1, its send_forward meets stage 1's first recv (posted at
    0) 1.5; F1 1.5-2.5, then send_forward_recv_backward waits for stage 1's
    send_backward_recv_forward posted after B0: stage 1 F0 1.5-2.5 (recv 1 + 0.5), B0
    2.5-4.5, the call max(4.5, 2.5) + 0.5 = 5, F1 5-6, B1 6-8, its send_backward meets stage
    0's recv posted after B0; stage 0: B0 5-7 (held 2.5 s after F1), the call receiving B1
    max(7, 8) + 0.5 = 8.5, B1 8.5-10.5: step 10.5."""
    for blocking, step in ((False, 10.0), (True, 10.5)):
        spec = PipelineSpec("1f1b", 2, 2, forward_s=1.0, backward_s=2.0, p2p_s=0.5, blocking_p2p=blocking)
        for res in (simulate(spec), simulate_arrays(spec)):
            assert res.step_s == step
    res = simulate_arrays(PipelineSpec("1f1b", 2, 2, forward_s=1.0, backward_s=2.0, p2p_s=0.5, blocking_p2p=True))
    assert res.start.tolist() == [0.0, 1.5, 5.0, 8.5, 1.5, 2.5, 5.0, 6.0]
    assert res.hold.tolist() == [0.5, 2.5, 1.5, 0.0, 0.0, 0.5, 0.0, 0.5]


@pytest.mark.parametrize("blocking", [False, True, "torch"])
@pytest.mark.parametrize("sch,p,m,v", [c for c in CASES if c[1] > 1 and c[2] in (3, 8)])
def test_lean_rounds_equal_the_general_loop(sch, p, m, v, blocking):
    """The round loops the simulation runs on finite times (NaN for not done, the blocking one
    without a ready time: its inputs come in the calls) against the general loop with a done
    table, kept for other times: every output array equal to the bit, on uneven times."""
    if blocking and (sch in V_SHAPED or not blocking_runs(sch, p, m)):
        return  # they deadlock (test_simulation_equals_the_reference_to_the_bit), or Megatron-LM refuses them
    if blocking == "torch" and sch not in ("gpipe", "1f1b"):
        return  # torch's multi-stage runtime: asynchronous
    f = flat_units(sch, p, m, v)
    rng = np.random.default_rng(7 * p + m)
    dur = rng.uniform(0.5, 2.0, len(f.kind)).round(3)
    spec = PipelineSpec(sch, p, m, v, p2p_s=0.1, blocking_p2p=bool(blocking), torch_p2p=blocking == "torch")
    pairs = rendezvous(spec, f) if blocking else None
    add = np.zeros(len(dur)) if blocking else np.where(f.cross, 0.1, 0.0)
    g = replace(f, dep=np.where(f.cross, len(dur), f.dep)) if blocking else f
    lean, general = run_rounds(g, dur, add, pairs, 0.1), run_rounds_general(g, dur, add, pairs, 0.1)
    for a, b in zip(lean[:4], general[:4]):
        assert a.tolist() == b.tolist()
    bind = general[4].all()  # the binding peers: every unit's, and any units' asked for (the lean loop's on demand)
    assert lean[4].all().tolist() == bind.tolist()
    some = rng.permutation(len(dur))[:5]
    assert lean[4].at(some).tolist() == bind[some].tolist()


@pytest.mark.parametrize("sch,p,m,v", [c for c in CASES if c[1] > 1][::3])
def test_rounds_replayed_equal_a_new_simulation(sch, p, m, v):
    """``simulate_arrays(..., like=r)`` (r's units and, with asynchronous sends, r's rounds
    replayed: meshplan.pipeline.rounds.replay) gives every time, wait, busy sum and critical
    path of a new simulation to the bit, with other durations (r's less random waits, as
    pipeline_exposure.pipeline_without runs it)."""
    rng = np.random.default_rng(11 * p + m)
    spec = PipelineSpec(sch, p, m, v, p2p_s=0.1)
    r = simulate_arrays(spec, lambda f: rng.uniform(0.5, 2.0, len(f.kind)).round(3))
    assert r.rounds is not None and len(r.rounds.order) == len(r.end)
    dur = (r.end - r.start) - rng.uniform(0.0, 0.4, len(r.end))
    again, new = simulate_arrays(spec, lambda f: dur, like=r), simulate_arrays(spec, lambda f: dur)
    assert again.flat is r.flat and again.step_s == new.step_s and again.busy_s == new.busy_s
    for a, b in ((again.start, new.start), (again.end, new.end), (again.wait, new.wait), (again.via_p2p, new.via_p2p),
                 (again.critical_units, new.critical_units)):
        assert a.tolist() == b.tolist()
    assert new.step_s != r.step_s  # the durations changed the step: a replay of r's times would fail above
