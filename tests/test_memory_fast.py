"""The memory timeline on arrays (meshplan/memory/passtable.py, peakscan.py) against the pass-by-pass
model (meshplan/memory/reference.py): every event, the peak (when, its label, bytes per
kind, what dominates it), the maxima per kind, the reason, on a grid of small configs:
the four schedules (and 1F1B given vpp 2), pp 1-4, 1-8 micro-batches, reshard_after_forward
on and off, recompute none/selective/full, every sharding, and the [memory] knobs that
change the passes (fsdp_reduce, prefetch depths, fragmentation). Also the pieces: the op
arrays against the op lists, the prefix scan of the automaton against a loop; the
schedule grid both by the walk over the ops and by the automaton (``keys_path``).
Speed is printed by benchmarks/bench_step.py, not tested here.
"""

import itertools

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.memory.passes import KINDS
from meshplan.memory import passtable
from meshplan.memory.passtable import Pass, PassTable, backward_flags, first_use_order, states_before
from meshplan.memory.peakscan import init_only_at_first, peak, scan, scores, template_stats
from meshplan.memory.reference import scan as ref_scan
from meshplan.memory.schedule import stage_op_arrays, stage_ops
from meshplan.memory.timeline import memory_timeline
from meshplan.pipeline.registry import get
from meshplan.plan import build_plan

TINY = dict(layers=8, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=128)
MEM = dict(nccl_buffsize_bytes=1000, nccl_channels=2, nccl_peers=2, workspace_bytes=500)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("1f1b", 2), ("zbv", 2),
             ("dualpipev", 2)]
#: The schedules a plan runs: a one-chunk schedule with vpp > 1 is refused (mesh.virtual_stages);
#: its chunked order stays in SCHEDULES for the op arrays (memory.schedule walks it).
PLANNED = [s for s in SCHEDULES if s != ("1f1b", 2)]
#: More micro-batch counts not a multiple of pp: V-shaped any m (DualPipeV >= 2 pp); interleaved
#: 1F1B under torch's rounds max(1, m // pp) (m 3: one round of 3; m 6 at pp 4: one round of 6)
V_M = {"zbv": (9,), "dualpipev": (9,), "interleaved_1f1b": (3, 6)}


def plan_of(pp=2, schedule="1f1b", vpp=1, m=4, sharding="zero3", reshard=True, recompute="selective", memory=None,
            **training):
    hsdp = sharding == "hsdp"
    names, shape = (["pp", "dp_replicate", "dp_shard"], [pp, 2, 2]) if hsdp else (["pp", "dp_shard"], [pp, 2])
    world = pp * (4 if hsdp else 2)
    t = dict(global_batch=m * world // pp, seq_len=8, micro_batch=1, sharding=sharding, param_dtype="fp32",
             compute_dtype="bf16", recompute=recompute, reshard_after_forward=reshard, **training)
    mesh = dict(names=names, shape=shape, world=world, pp_schedule=schedule, virtual_stages=vpp)
    cfg = {"model": TINY, "cluster": {"system": "dgx-h100", "nodes": 2}, "training": t, "mesh": mesh,
           "memory": {**MEM, **(memory or {})}}
    plan = build_plan(config_from_dict(cfg))
    assert plan.timelines, plan.reasons  # every case of the grid has a plan
    return plan


def assert_same(plan):
    """Every stage: the array path (the plan's timelines) equals the reference path."""
    for k, fast in enumerate(plan.timelines):
        ref = memory_timeline(plan, k, reference=True)
        assert fast.passes == ref.passes and fast.templates == ref.templates
        assert list(fast.events()) == list(ref.events())
        assert fast.peak == ref.peak and fast.peak.where() == ref.peak.where()
        assert fast.peak.dominant() == ref.peak.dominant()
        assert fast.max_by_kind == ref.max_by_kind and fast.n_events == ref.n_events
        assert fast.reason() == ref.reason() and fast.summary() == ref.summary()
        r = ref.running()  # the peak is the first maximum of the running total
        assert fast.peak.total_bytes == r.sum(axis=1).max() and fast.peak.t_index == int(r.sum(axis=1).argmax())


@pytest.fixture(params=["walk", "automaton"])
def keys_path(request, monkeypatch):
    """Both ways of finding each pass's template (passtable.WALK_MAX_OPS): the walk over the
    ops (every stage of these small grids) and the automaton's prefix scan (forced)."""
    if request.param == "automaton":
        monkeypatch.setattr(passtable, "WALK_MAX_OPS", -1)
    return request.param


@pytest.mark.parametrize("schedule,vpp", PLANNED)
def test_fast_equals_reference_over_schedules(schedule, vpp, keys_path):
    cases = 0
    for pp, m, reshard, recompute in itertools.product((1, 2, 4), (1, 3, 8) if vpp == 1 else (4, 8) + V_M.get(schedule, ()),
                                                     (True, False),
                                                     ("none", "selective", "full")):
        if vpp > 1 and pp == 1 or get(schedule).reasons(pp, m, vpp):  # e.g. DualPipeV m < 2 pp, torch 1F1B m < pp
            continue
        assert_same(plan_of(pp=pp, schedule=schedule, vpp=vpp, m=m, reshard=reshard, recompute=recompute))
        cases += 1
    assert cases >= 24


MEMORY_KNOBS = ({}, {"prefetch_layers": 2, "forward_prefetch_layers": 1},
                {"prefetch_layers": 0}, {"fragmentation_fraction": 0.05})


@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3", "hsdp"])
def test_fast_equals_reference_over_shardings_and_knobs(sharding):
    for (schedule, vpp), memory in itertools.product(SCHEDULES[1:4], MEMORY_KNOBS):
        assert_same(plan_of(pp=4, schedule=schedule, vpp=vpp, m=8, sharding=sharding, reshard=False, memory=memory))
    for memory in MEMORY_KNOBS:
        assert_same(plan_of(pp=1, schedule="1f1b", m=3, sharding=sharding, memory=memory))
    for mode in ("no_sync", "no_sync_unsharded") if sharding in ("zero3", "hsdp") else ():  # pp 1, FSDP2 modes
        assert_same(plan_of(pp=1, schedule="1f1b", m=3, sharding=sharding, grad_accumulation=mode))


def test_unsharded_units_carry_over_passes(keys_path):
    """The case the automaton exists for: with reshard_after_forward off and FSDP reducing
    after the last micro-batch, a pass's template depends on what earlier passes left
    unsharded (micro-batch 0's forward all-gathers, later ones do not)."""
    plan = plan_of(pp=2, m=4, reshard=False, memory={"fsdp_reduce": "after_last"})
    tl = plan.timelines[1]
    forwards = [p.template for p in tl.passes if p.phase == "forward"]
    assert forwards[0] != forwards[1] == forwards[2] == forwards[3]
    assert_same(plan)


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
def test_op_arrays_equal_op_lists(schedule, vpp):
    for pp, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 5, 8, 16)):
        if vpp > 1 and (pp == 1 or m % pp):
            continue
        for s in range(pp):
            phase, chunk, mb = stage_op_arrays(schedule, s, pp, m, vpp)
            ops = [("backward" if p else "forward", c, b) for p, c, b in zip(phase.tolist(), chunk.tolist(), mb.tolist())]
            assert ops == stage_ops(schedule, s, pp, m, vpp)


def test_states_before_equals_a_loop():
    rng = np.random.default_rng(11)
    for n, states in ((1, 1), (2, 3), (7, 2), (100, 4), (513, 5)):
        maps = rng.integers(0, states, size=(n, states))
        s, want = 0, []
        for row in maps:
            want.append(s)
            s = int(row[s])
        assert states_before(maps).tolist() == want


def test_flags_and_first_use():
    phase, chunk = np.array([0, 0, 1, 0, 1, 1, 1]), np.array([0, 1, 1, 0, 0, 1, 0])
    first, last = backward_flags(phase, chunk)
    assert np.flatnonzero(first).tolist() == [2, 4] and np.flatnonzero(last).tolist() == [5, 6]
    assert first_use_order(np.array([5, 5, 1, 3, 1, 0])).tolist() == [5, 1, 3, 0]


def _hand_table(init):
    """init, two passes of one template (5 B of activations saved then freed), the step."""
    fwd = ((0, "activations", 5, "a"), (0, "activations", -5, "free a"))
    step = ((None, "temporaries", 3, "s"), (None, "temporaries", -3, "free s"))
    templates = [init, fwd, step]
    passes = [Pass("init", 0, None, 0, 0), Pass("forward", 0, 0, 1, len(init)),
              Pass("forward", 0, 1, 1, len(init) + 2), Pass("step", 0, None, 2, len(init) + 4)]
    return PassTable.of(passes), templates


@pytest.mark.parametrize("frag,want", [
    # init peaks at its 30 B spike (params 10 + temporaries 20); + 8 B allowance: the passes reach 10 + 8 + 5 = 23
    # < 30, so init keeps the peak (its first maximum, offset 1)
    (8, (0, 1, {"params": 10, "temporaries": 20})),
    # + 25 B: init's prefix ends at 35, the passes reach 10 + 25 + 5 = 40 > 35: pass 1 at its first event
    (25, (1, 0, {"params": 10, "fragmentation": 25, "activations": 5})),
])
def test_allowance_shift_equals_a_new_scan(frag, want):
    """Scores.with_init_event (the timeline's fragmentation allowance without a second scan)
    against a scan from scratch and the pass-by-pass reference, on a table derived by hand."""
    table, templates = _hand_table(((None, "params", 10, "p"), (None, "temporaries", 20, "t"),
                                    (None, "temporaries", -20, "free t")))
    stats = [template_stats(t) for t in templates]
    sc = scores(table, templates, stats)
    assert peak(table, templates, stats, sc)[:2] == (0, 1)  # 30 B in init before the allowance
    templates[0] = templates[0] + ((None, "fragmentation", frag, "allowance"),)
    table = table.shifted(1)
    stats[0] = template_stats(templates[0])
    assert init_only_at_first(table)
    n, off, at, kmax = peak(table, templates, stats, sc.with_init_event(stats[0][1], "fragmentation", frag))
    assert (n, off, {k: int(v) for k, v in zip(KINDS, at) if v}) == want
    assert kmax == {**dict.fromkeys(KINDS, 0), "params": 10, "temporaries": 20, "fragmentation": frag,
                    "activations": 5}
    for other in (scan(table, templates), ref_scan(table, templates)):
        assert (other[0], other[1], other[2].tolist(), other[3]) == (n, off, at.tolist(), kmax)


def test_fast_equals_reference_where_the_window_evicts(keys_path):
    """Interleaved 1F1B at vpp 4 (pp 2, 8 layers: one per virtual stage) under torch: the
    schedule's window of 3 local stages reshards chunks between their passes
    (meshplan.pipeline.unshard_window); both paths release the chunk's gathered layer at the end
    of the pass after which torch reshards it, and its next pass gathers it again, once per
    eviction (reshard_after_forward false: every eviction finds its chunk's layer gathered)."""
    from meshplan.memory.schedule import stage_op_arrays
    from meshplan.pipeline.unshard_window import evicted

    for m, reshard in itertools.product((4, 8), (True, False)):
        plan = plan_of(pp=2, schedule="interleaved_1f1b", vpp=4, m=m, reshard=reshard)
        assert_same(plan)
        for k, tl in enumerate(plan.timelines):
            released = [e for e in tl.events() if e.label.startswith("layer ") and "schedule's window" in e.label]
            n = int(evicted(stage_op_arrays("interleaved_1f1b", k, 2, m, 4)[1]).sum())
            assert n > 0 and (len(released) == n if not reshard else len(released) <= n)
