"""``meshplan search`` with ``training.fp8_all_gather`` and ``training.grad_accumulation``
(issue 11, items 1 and 7: the search used to refuse both).

fp8 all-gather shrinks the FSDP all-gather of the dense Linear weights to 1 byte per element
(norms stay in the compute dtype in the same buffer); ``no_sync`` reduce-scatters once per step
(pp 1) and ``no_sync_unsharded`` also gathers in forward only in micro-batch 0. The search's
step-time bound must stay below the exact step with either, and its memory bounds around the
planned peak: checked on every candidate of a small world, with the same top as planning and
simulating every candidate (the slow lane), and term by term against the collective table and
the gather flags (hand-derived values, fast).
"""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.comm.fsdp_rows import fsdp_gather_flags
from meshplan.config import config_from_dict
from meshplan.plan import build_plan, table_key
from meshplan.search.driver import search
from meshplan.search.memory import Tables, stage_layout
from meshplan.search.space import FSDP_SHARDINGS, OK, RECOMPUTE, SHARDING, accumulates, candidate_config, enumerate_candidates
from meshplan.schedule.steptime import step_time
from meshplan.search.memory import state
from meshplan.search import float8_bounds
from meshplan.search.comm_bounds import comm_times, fsdp_copies, _padded_unit
from meshplan.search.gather_passes import gathering_passes
from meshplan.search.time_tables import TimeTables
from meshplan.search.timing import step_lower_bound
from meshplan.spec.training import TrainingSpec
from test_search import MOE, SMALL, exhaustive_rows, gpu, plan_all, refused

SETTINGS = {
    "fp8": ("small", {"linear_dtype": "fp8", "fp8_all_gather": True, "fp8_output_layer": True}),
    # torch's plain TP under float8 tensorwise (fp8_tp false): the tp amax all-reduces in the bound
    "fp8-plain-tp": ("small", {"linear_dtype": "fp8", "fp8_all_gather": True, "fp8_output_layer": True, "fp8_tp": False}),
    # rowwise float8 under torch's plain TP: the tp all-reduces of the token and weight scales in the bound
    "fp8-rowwise": ("small", {"linear_dtype": "fp8", "fp8_recipe": "rowwise", "fp8_output_layer": True}),
    "no_sync": ("small", {"grad_accumulation": "no_sync"}),
    "no_sync_unsharded": ("small", {"grad_accumulation": "no_sync_unsharded"}),
    "moe-no_sync_unsharded": ("moe", {"grad_accumulation": "no_sync_unsharded"}),
    # torchtitan's "always": [norm, output] gathered again before each backward
    "reshard_head": ("small", {"reshard_head_after_forward": True}),
}


def config(training: dict, model=None, hbm_gb: float = 6.0, **search_opts):
    g = gpu(hbm_gb)
    if "linear_dtype" in training:  # float8 GEMMs: the H100 SXM's dense fp8 peak (catalog)
        g["peak_tflops"] = g["peak_tflops"] | {"fp8": 1978.9}
    return config_from_dict({"model": model or SMALL, "cluster": {"system": "dgx-h100", "nodes": 1, "gpu": g},
                             "training": {"global_batch": 64, "seq_len": 2048, **training},
                             "search": {"settle_max": 1_000_000, **search_opts}}, require_mesh=False)


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def case(request):
    """8 GPUs, every pp, sharding and reshard choice; one recompute policy (the settings change
    no compute op) and micro-batches 1 and 2 (micro-batches per step 4..64)."""
    model, training = SETTINGS[request.param]
    cfg = config(training, MOE if model == "moe" else None, 2.0 if model == "moe" else 6.0,
                 micro_batch=[1, 2], recompute=["selective"], top=5)
    result = search(cfg, workers=1)
    return cfg, result, plan_all(cfg, result), request.param


@pytest.mark.slow
def test_top_equals_exhaustive_exact_ranking(case):
    cfg, r, plans, _ = case
    steps = {int(i): plans[i][3] for i in np.flatnonzero(r.code == OK)}
    want = exhaustive_rows(r, steps, cfg.search.top, {i: plans[i][2] for i in steps})
    assert [e.index for e in r.top] == want and [e.step_s for e in r.top] == [steps[i] for i in want]
    assert r.proven and not [n for n in r.notes if "bound" in n]
    # the setting reaches the candidates it applies to: some of them are planned with it
    on = np.isin(r.candidates.sh, FSDP_SHARDINGS) & (r.candidates.dps * r.candidates.cp > 1)
    if cfg.training.grad_accumulation != "sync":
        on &= accumulates(cfg, r.candidates.pp, r.candidates.sh)
    assert on[np.flatnonzero(r.code == OK)].any()


@pytest.mark.slow
def test_bounds_hold_for_every_candidate(case):
    cfg, r, plans, _ = case
    m = cfg.search.memory_margin
    for i, (feasible, _, peak, step) in enumerate(plans):
        if feasible and not refused(r, i):
            assert r.est.step_lo[i] <= step * (1 + 1e-9), r.candidates.label(i)
        if peak is not None and np.isfinite(r.est.peak_lo[i]):
            assert r.est.peak_lo[i] / (1 + m) <= peak <= r.est.peak_hi[i] * (1 + m), r.candidates.label(i)


#: (largest, median) bound / exact step on the candidates each setting changes, a little below
#: the measured values: fp8 0.984, 0.936; no_sync 0.926, 0.861; no_sync_unsharded 0.984, 0.917;
#: MoE no_sync_unsharded 0.976, 0.773 (for scale, the FSDP candidates of SMALL under sync:
#: 0.989, 0.949), measured with the bound counting FSDP2's copies on the compute stream
#: (search.comm_bounds.fsdp_copies). Without them: fp8 0.979, 0.925; no_sync 0.899, 0.803;
#: no_sync_unsharded 0.980, 0.882; MoE 0.973, 0.771; sync 0.983, 0.924. Since the [norm, output]
#: unit's pre-backward prefetches the last layer at every pp and the bound takes the head's
#: backward off that gather (search.layer_bounds.unit_bounds ``hb``): fp8 0.991, 0.920 (pp > 1: the
#: simulation and the bound both lose up to min(gather, head backward) per gathering backward of
#: the last stage, so the ratio falls), no_sync_unsharded 0.985, 0.908 (pp 1: its gathering
#: backwards already ran the prefetch; the bound counted the whole gather, within slack; without
#: the ``hb`` term the bound exceeds the simulated step on pp 4 x dp_shard 2 and pp 2 x cp 4
#: candidates of these workloads: tests above).
#: reshard_head (torchtitan's "always"): 0.9936, 0.8945 over every FSDP candidate (0.8938 median
#: before the bound counted the head's gather and copy-out again before each backward at pp 1; on
#: those pp 1 candidates with reshard_after_forward the median rose from 0.842 to 0.865:
#: test_bound_counts_the_heads_regather pins the term exactly).
#: fp8-plain-tp (fp8_tp false): 0.9955, 0.957 measured with the bound counting plain TP's amax
#: all-reduces (search.float8_bounds.plain_tp_counts; without them 0.991, 0.942; on the tp > 1
#: candidates 0.976, 0.857 -> 0.995, 0.899).
#: fp8-rowwise (torch's plain TP, one fp64 scale a token or a hidden unit all-reduced per cast of tp-sharded
#: rows): 0.9970, 0.9656 measured with the bound counting those all-reduces (search.float8_bounds.rowwise_times;
#: on the tp > 1 candidates 0.913, 0.811 without them, 0.99989, 0.981 with them).
TIGHT = {"fp8": (0.98, 0.91), "fp8-plain-tp": (0.99, 0.95), "fp8-rowwise": (0.99, 0.96), "no_sync": (0.92, 0.85), "no_sync_unsharded": (0.975, 0.90),
         "moe-no_sync_unsharded": (0.97, 0.76), "reshard_head": (0.99, 0.89)}


@pytest.mark.slow
def test_bound_stays_tight_where_the_setting_applies(case):
    """Tightness: on the candidates the setting changes (pp 1 FSDP under accumulation, FSDP
    with fp8) the bounds stay as close to the exact steps as measured (:data:`TIGHT`): a bound
    that dropped their FSDP gathers would fall further. fp8_all_gather changes only dp_shard > 1
    candidates since newcomer trial 53 (torchtitan's dp_shard_enabled rule, TrainingSpec.at_dp_shard):
    at dp_shard 1 FSDP gathers over cp in bf16, as a bf16 config's candidates, whose exposed gathers
    the bound does not see (their ratios 0.57-0.72 here)."""
    cfg, r, plans, name = case
    c = r.candidates
    on = np.isin(c.sh, FSDP_SHARDINGS) & (c.dps * c.cp > 1)
    if cfg.training.fp8_all_gather:
        on &= c.dps > 1
    if cfg.training.grad_accumulation != "sync":
        on &= accumulates(cfg, c.pp, c.sh)
    ratio = np.array([r.est.step_lo[i] / plans[i][3] for i in np.flatnonzero(on) if plans[i][0]])
    best, median = TIGHT[name]
    assert ratio.size > 20 and ratio.max() >= best and np.median(ratio) >= median, (ratio.max(), np.median(ratio))


def _one(cfg, **cols):
    """The index of the first candidate of ``cfg`` whose columns equal ``cols``."""
    c = enumerate_candidates(cfg)
    sel = np.ones(len(c), bool)
    for k, v in cols.items():
        sel &= c.degree(k) == v if k in ("pp", "dps", "tp", "cp", "dpr") else getattr(c, k) == v
    return c, int(np.flatnonzero(sel)[0])


def test_fp8_gather_bytes_equal_the_collective_table():
    """SMALL at tp 1: Linear weights wq, wo 2048 x 2048, wk, wv 512 x 2048, w1, w3 5632 x 2048,
    w2 2048 x 5632 = 45,088,768 elements, 1 byte each in float8; two norms of 2048 in bf16
    (8,192 B); dp_shard 8 divides every dim 0 (no padding): 45,096,960 B per layer unit, the
    plan table's all-gather, against 90,185,728 B in bf16."""
    cfg = config({"linear_dtype": "fp8", "fp8_all_gather": True})
    c, i = _one(cfg, pp=1, dps=8, tp=1, sh=SHARDING.index("zero3"), mb=1)
    sub = c.take([i])
    assert int(_padded_unit(Tables(cfg), sub, gather=True)[0]) == 45_096_960
    assert int(_padded_unit(Tables(cfg), sub)[0]) * 2 == 90_185_728
    plan = build_plan(candidate_config(cfg, c, i))
    rows = [x for x in plan.collectives[table_key(0)] if x.op == "all-gather" and "every layer" in x.cadence]
    assert rows and {x.size_bytes for x in rows} == {45_096_960}


@pytest.mark.parametrize("mode,reshard,want", [
    ("no_sync", True, (4, 4)), ("no_sync", False, (4, 0)),
    ("no_sync_unsharded", True, (1, 4)), ("no_sync_unsharded", False, (1, 0)),
])
def test_accumulation_gathering_passes(mode, reshard, want):
    """pp 1, m = 64 / (mb 2 x dp_shard 8) = 4 micro-batches: ``no_sync`` reshards after every
    backward, so every forward gathers, and every backward too when reshard_after_forward;
    ``no_sync_unsharded`` keeps the units gathered after a backward: only micro-batch 0's
    forward gathers (hand count, torch FSDP2's behaviour per spec/training.py), the same as
    the flags rule and the plan table's per-step all-gathers of one layer unit."""
    cfg = config({"grad_accumulation": mode})
    c, i = _one(cfg, pp=1, dps=8, tp=1, sh=SHARDING.index("zero3"), mb=2, rf=int(reshard))
    sub = c.take([i])
    g_f, g_b = gathering_passes(cfg, sub, stage_layout(cfg, sub, 1))
    assert (int(g_f[0, 0]), int(g_b[0, 0])) == want
    flags = fsdp_gather_flags("1f1b", 1, 4, 1, 0, reshard, reshard_after_backward=mode == "no_sync")
    assert tuple(sum(g for (_, k, _), g in flags.items() if k == kind) for kind in "FB") == want
    plan = build_plan(candidate_config(cfg, c, i))
    gathers = {x.phase: x.per_step for x in plan.collectives[table_key(0)]
               if x.op == "all-gather" and "every layer" in x.cadence}
    layers = cfg.model.layers
    assert (gathers.get("forward", 0) // layers, gathers.get("backward", 0) // layers) == want
    # sync: no gathering pass counted (every micro-batch gathers inside the unit bound)
    s = config({})
    cs, j = _one(s, pp=1, dps=8, tp=1, sh=SHARDING.index("zero3"), mb=2, rf=int(reshard))
    sub = cs.take([j])
    assert not np.any(gathering_passes(s, sub, stage_layout(s, sub, 1)))


def test_candidates_get_the_setting_where_it_applies():
    """grad_accumulation runs on pp 1 FSDP candidates and is 'sync' elsewhere (pipelining does it
    itself; ZeRO-1 reduces once per step); fp8_all_gather on FSDP candidates with dp_shard > 1 only
    (torchtitan turns it off at dp_shard 1: TrainingSpec.at_dp_shard), the float8
    GEMMs (linear_dtype, fp8_output_layer: the workload) on every candidate. Every candidate's
    training contract is a valid config (the validators' rules)."""
    cfg = config({"grad_accumulation": "no_sync", "linear_dtype": "fp8", "fp8_all_gather": True,
                  "fp8_output_layer": True})
    c = enumerate_candidates(cfg)
    seen = set()
    for i in range(len(c)):
        t = candidate_config(cfg, c, i).training
        TrainingSpec.model_validate(t.model_dump())
        fsdp = SHARDING[c.sh[i]] in ("zero3", "hsdp")
        assert t.grad_accumulation == ("no_sync" if fsdp and c.pp[i] == 1 else "sync")
        assert t.fp8_all_gather == (fsdp and c.dps[i] > 1) and (t.linear_dtype, t.fp8_output_layer) == ("fp8", True)
        seen.add((fsdp, int(c.pp[i]) == 1))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}


def test_search_notes_how_other_candidates_are_planned():
    cfg = config({"grad_accumulation": "no_sync", "linear_dtype": "fp8", "fp8_all_gather": True}, micro_batch=[2],
                 recompute=["selective"], pp=[1, 2], top=2)
    r = search(cfg, workers=1)
    assert r.top and r.proven
    assert any("grad_accumulation 'no_sync' applies to candidates with pp 1" in n for n in r.notes)
    assert any("fp8_all_gather applies to FSDP candidates" in n for n in r.notes)


def test_bound_copies_are_the_tables():
    """SMALL at pp 1, dp_shard 8, tp 1, zero3: the bound's FSDP2 copies are the plan table's
    ``copy_s``. The test GPU has no catalog kernel data: the datasheet's 3.35 TB/s. A layer unit
    (wq, wo 2048 x 2048, wk, wv 512 x 2048, w1, w3 5632 x 2048, w2 2048 x 5632, two norms of 2048:
    45,092,864 elements, no padding at 8): copy-out 2 x 2 B x 45,092,864 / 3.35e12 = 53.842 us,
    copy-in (2 + 4) B x 45,092,864 / 3.35e12 = 80.763 us; the root (embedding and output 32,000 x
    2,048, final norm 2,048: 131,074,048 elements, torchtitan's embedding and [norm, output]
    units together) 156.506 us and 234.759 us; each end unit apart: the embedding (65,536,000
    elements) 2 x 2 B x 65,536,000 / 3.35e12 = 78.252 us and 6 B x 65,536,000 / 3.35e12 = 117.378
    us, [norm, output] (65,538,048) 78.254 us and 117.382 us; no experts; under fp8_all_gather
    the Linear weights gather in 1 B: (45,088,768 + 2 x 4,096) x 2 / 3.35e12 = 26.924 us. At pp 2
    (dp_shard 4) stage 0's embedding unit and stage 1's [norm, output] unit carry those copies in
    the plan's table."""
    ends = {"emb_out": 78.252, "emb_in": 117.378, "head_out": 78.254, "head_in": 117.382, "e_out": 0.0, "e_in": 0.0}
    for training, out in (({}, 53.842), ({"linear_dtype": "fp8", "fp8_all_gather": True}, 26.924)):
        cfg = config(training)
        c, i = _one(cfg, pp=1, dps=8, tp=1, sh=SHARDING.index("zero3"), mb=2)
        got = {k: round(float(v[0]) * 1e6, 3) for k, v in fsdp_copies(cfg, Tables(cfg), c.take([i])).items()}
        assert got == {"out": out, "in": 80.763, "root_out": 156.506, "root_in": 234.759, **ends}
        c2, i2 = _one(cfg, pp=2, dps=4, tp=1, sh=SHARDING.index("zero3"), mb=2)
        plan2 = build_plan(candidate_config(cfg, c2, i2))
        for stage, unit, key in ((0, "per root (embedding)", "emb"), (1, "per root (norm/output)", "head")):
            rows = {r.op: round(r.copy_s * 1e6, 3) for r in plan2.collectives[table_key(stage)]
                    if r.cadence == unit and r.phase == ("forward" if r.op == "all-gather" else "backward")}
            assert rows == pytest.approx({"all-gather": ends[f"{key}_out"], "reduce-scatter": ends[f"{key}_in"]},
                                         abs=0.002)
        rows = build_plan(candidate_config(cfg, c, i)).collectives[table_key(0)]
        table: dict = {}
        for r in rows:  # torchtitan's two end units (embedding; norm and output) sum to the bound's root
            if r.copy_s and r.phase == ("forward" if r.op == "all-gather" else "backward"):
                key = (r.op, r.cadence.startswith("per root"))
                table[key] = table.get(key, 0.0) + r.copy_s * 1e6
        assert {k: round(v, 3) for k, v in table.items()} == pytest.approx({
            ("all-gather", False): out, ("reduce-scatter", False): 80.763,
            ("all-gather", True): 156.506, ("reduce-scatter", True): 234.759}, abs=0.002)
    # none without an FSDP2 unit: ZeRO-1, dp_shard 1, DeepSpeed's 2021 engine (its list copies are
    # in its collectives' time)
    cfg = config({})
    c = enumerate_candidates(cfg)
    cp = fsdp_copies(cfg, Tables(cfg), c)
    fsdp = np.isin(c.sh, FSDP_SHARDINGS) & (c.fsdp > 1)
    assert (cp["out"][~fsdp] == 0).all() and (cp["out"][fsdp] > 0).all()
    ds = config({"sharding": "zero3", "zero3_engine": "deepspeed-2021"})
    c = enumerate_candidates(ds)
    cp = fsdp_copies(ds, Tables(ds), c)
    assert (cp["in"][c.sh == SHARDING.index("zero3")] == 0).all()


@pytest.mark.parametrize("training,pp,reshard,floor", [
    ({}, 1, 1, 0.90), ({}, 1, 0, 0.90), ({}, 2, 1, 0.96), ({}, 2, 0, 0.97),
    ({"grad_accumulation": "no_sync"}, 1, 1, 0.925), ({"grad_accumulation": "no_sync"}, 1, 0, 0.935),
    ({"grad_accumulation": "no_sync_unsharded"}, 1, 1, 0.95), ({"grad_accumulation": "no_sync_unsharded"}, 1, 0, 0.965),
    ({"linear_dtype": "fp8", "fp8_all_gather": True}, 1, 1, 0.89),
])
def test_bound_counts_fsdp2_copies(training, pp, reshard, floor):
    """SMALL, dp_shard 8 / pp, zero3, mb 2: the step bound stays below the simulated step and
    within ``floor`` of it, measured with FSDP2's copies in the bound (bound / step: sync 0.914,
    0.907 at pp 1 with and without reshard_after_forward, 0.967, 0.974 at pp 2 (0.978 before torch's
    1F1B calls were simulated waited, which the bound's asynchronous sends leave out); no_sync 0.930,
    0.940; no_sync_unsharded 0.957, 0.968; fp8 0.897). Without the copies every ratio is below
    its floor (0.842, 0.851, 0.945, 0.971; 0.881, 0.908; 0.924, 0.954; 0.821). (nicshare: at pp 1 with
    reshard_after_forward the step's backward runs each layer's re-gather beside the previous layer's
    reduce-scatter on FSDP2's two streams, each slowed by the other's share of the NIC, which the bound
    leaves out by design (Overlap.nic_sharing False: collectives at their table times): 0.914 -> 0.909,
    still below the step, the floor 0.91 -> 0.90.)"""
    cfg = config(training)
    c, i = _one(cfg, pp=pp, dps=8 // pp, tp=1, sh=SHARDING.index("zero3"), mb=2, rf=reshard)
    sub = c.take([i])
    tt = TimeTables(cfg, Tables(cfg))
    st = stage_layout(cfg, sub, pp)
    bound = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
    step = step_time(build_plan(candidate_config(cfg, c, i))).step_s
    assert floor * step <= bound <= step


def test_bound_counts_the_heads_regather():
    """SMALL at pp 1, dp_shard 8, zero3, mb 2 (64 / (2 x 8) = 4 micro-batches) with
    ``training.reshard_head_after_forward`` (torchtitan's "always"): every backward all-gathers
    the [norm, output] unit again (65,538,048 elements, 131,076,096 B in bf16: the table's
    backward row of 0.33327 ms) and copies it out (78.254 us) before the head's backward, both
    exposed (test_reshard_policy's backward by hand). The step grows by 4 x (0.33327 + 0.07825)
    = 1.6461 ms, and the search's bound by exactly as much (it left them out before: its gap
    to the step grew from 8.315 to 9.961 ms)."""
    out = {}
    for head in (False, True):
        cfg = config({"reshard_head_after_forward": head})
        c, i = _one(cfg, pp=1, dps=8, tp=1, sh=SHARDING.index("zero3"), mb=2, rf=1)
        sub = c.take([i])
        tt = TimeTables(cfg, Tables(cfg))
        st = stage_layout(cfg, sub, 1)
        bound = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
        plan = build_plan(candidate_config(cfg, c, i))
        rows = [r for r in plan.collectives[table_key(0)]
                if r.op == "all-gather" and r.phase == "backward" and r.cadence == "per root (norm/output)"]
        assert len(rows) == head  # kept gathered from its forward without the setting
        out[head] = bound, step_time(plan).step_s, rows[0] if rows else None
    (b0, s0, _), (b1, s1, row) = out[False], out[True]
    assert row.per_step == 4 and row.size_bytes == 65_538_048 * 2
    assert (round(row.time_s * 1e6, 2), round(row.copy_s * 1e6, 3)) == (333.27, 78.254)
    assert s1 - s0 == pytest.approx(4 * (row.time_s + row.copy_s), rel=1e-6)
    assert b1 - b0 == pytest.approx(s1 - s0, rel=1e-6) and b1 <= s1


@pytest.mark.parametrize("tp,mb,pp,was", [(4, 2, 1, 0.865), (2, 1, 2, 0.877)])
def test_bound_counts_the_float8_amax_all_reduces(tp, mb, pp, was):
    """SMALL in float8 tensorwise with the float8 all-gather, zero3, tp > 1 with SP (torchao's
    float8 TP): each cast of a tp shard waits for the tp all-reduce of its amax, 4 forward and
    7 backward per layer (compute.float8_tp_reduces.tp_amax_per_layer), one 8 B all-reduce each, the
    table's fp64 rows. The bound chains them with the layer (search.layer_bounds.chains); it left them
    out before, still below the step (bound / step 0.865 and 0.877: what ``was`` pins), now
    within the amax all-reduces' total of it (0.960, 0.974 measured)."""
    cfg = config({"linear_dtype": "fp8", "fp8_all_gather": True, "torch_compile": True})
    c, i = _one(cfg, pp=pp, dps=8 // tp // pp, tp=tp, sh=SHARDING.index("zero3"), mb=mb)
    sub = c.take([i])
    tt = TimeTables(cfg, Tables(cfg))
    cm = comm_times(cfg, tt, sub)
    plan = build_plan(candidate_config(cfg, c, i))
    rows = [r for r in plan.stage(0).collectives if r.dtype == "fp64"]
    t = rows[0].time_s
    assert {(r.op, r.axis, r.size_bytes) for r in rows} == {("all-reduce", "tp", 8.0)}
    assert (cm["amax_f"][0], cm["amax_b"][0]) == pytest.approx((4 * t, 7 * t), rel=1e-12)
    amax = sum(r.time_s * r.per_step for r in rows)  # 8 / pp layers x 64 / (mb x 8 / tp / pp) micro-batches
    assert amax == pytest.approx(8 // pp * 64 // (mb * 8 // tp // pp) * 11 * t, rel=1e-9)
    st = stage_layout(cfg, sub, pp)
    bound = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
    step = step_time(plan).step_s
    assert was * step < bound <= step and step - bound < amax


@pytest.mark.parametrize("gather,pp,tp,mb,rc,n_f,n_b", [
    (True, 1, 4, 2, "none", 2, 5),   # dp_shard 2: FSDP gathers the weights in float8, no weight amax
    (False, 2, 2, 1, "full", 9, 5),  # the config's fp8_all_gather off: the 7 weights' amaxes too
    (True, 2, 4, 1, "full", 9, 5),   # dp_shard 1: the row's float8 all-gather off (TrainingSpec.at_dp_shard)
])
def test_bound_counts_plain_tp_amax_all_reduces(monkeypatch, gather, pp, tp, mb, rc, n_f, n_b):
    """SMALL in float8 tensorwise under torch's plain TP (``fp8_tp = false``, torchtitan v0.2.x's converter
    name: tests/test_float8_tp.py): each cast of a tp-sharded DTensor all-reduces its amax over tp, per
    layer forward wo's and w_down's inputs and, unless the row's FSDP gathers in float8, the 7 weights (2 or
    9), backward the 5 column-parallel output gradients (compute.float8_tp_reduces.plain_tp_amax_per_layer), and a
    fully recomputed layer's forward's again. The bound now counts them at each row's own
    ``fp8_all_gather`` (search.float8_bounds.plain_tp_counts), exactly the plan's calls: per micro-batch of a
    stage's 8 / pp layers. Each pass of the bound's chain carries the layer's n_f + n_b (+ n_f replayed) x
    t, so the bound rises by passes x 8 / pp x that, the passes being the m micro-batches at pp 1 (64 / (2 x
    2) = 16: 16 x 8 x 7 t, the plan's whole amax time) and m + pp - 1 at pp 2 (1F1B's fill: 33 and 65 of
    them), and stays below the step (it was 0.903, 0.852, 0.761 of it; now 0.960, 0.992, 0.968)."""
    cfg = config({"linear_dtype": "fp8", "fp8_all_gather": gather, "fp8_tp": False, "torch_compile": True})
    c, i = _one(cfg, pp=pp, dps=8 // tp // pp, tp=tp, sh=SHARDING.index("zero3"), mb=mb, rc=RECOMPUTE.index(rc))
    sub = c.take([i])
    tt = TimeTables(cfg, Tables(cfg))
    cm = comm_times(cfg, tt, sub)
    plan = build_plan(candidate_config(cfg, c, i))
    rows = {r.phase: r for r in plan.stage(0).collectives if r.dtype == "fp64"}
    t, m, layers = rows["forward"].time_s, 64 // (mb * 8 // tp // pp), 8 // pp
    replay = n_f if rc == "full" else 0
    assert (rows["forward"].per_step, rows["backward"].per_step) == (layers * m * n_f, layers * m * (n_b + replay))
    assert (cm["amax_f"][0], cm["amax_b"][0]) == pytest.approx((n_f * t, n_b * t), rel=1e-12)
    st = stage_layout(cfg, sub, pp)
    bound = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
    monkeypatch.setattr(float8_bounds, "plain_tp_counts", lambda cfg, c, f, b: (f, b))  # the bound before: none
    before = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
    passes = m + pp - 1
    assert bound - before == pytest.approx(passes * layers * (n_f + n_b + replay) * t, rel=1e-9)
    assert bound <= step_time(plan).step_s


@pytest.mark.parametrize("pp,tp,mb,rc", [(1, 4, 2, "none"), (2, 2, 1, "full")])
def test_bound_counts_rowwise_scale_all_reduces(monkeypatch, pp, tp, mb, rc):
    """SMALL in rowwise float8 (``fp8_recipe = "rowwise"``: torch's plain TP, compute.float8.rowwise_tp):
    each cast of tp-sharded rows all-reduces its scales over tp, fp64, per layer 2 forward (wo's, w_down's
    inputs and weights) and 5 backward (the column-parallel output gradients and weights' transposed
    casts) of each kind (compute.float8_tp_reduces.rowwise_tp_per_layer), and a fully recomputed layer's forward's
    again: token scales of mb x 2048 tokens x 8 B (32,768 B at mb 2, 16,384 B at mb 1), weight scales of
    2048 hidden units x 8 B = 16,384 B (comm.tp_rows._rowwise_scale_rows). The bound now chains them
    (search.float8_bounds.rowwise_times): each pass of a stage's 8 / pp layers carries (2 + 5 (+ 2
    replayed)) x (t_token + t_weight), so it rises by passes x that, the passes m at pp 1 (64 / (2 x 2) =
    16: the plan's whole scale time) and m + pp - 1 = 33 at pp 2, and stays below the step (it was 0.757,
    0.794 of it; now 0.969, 0.993)."""
    cfg = config({"linear_dtype": "fp8", "fp8_recipe": "rowwise", "torch_compile": True})
    c, i = _one(cfg, pp=pp, dps=8 // tp // pp, tp=tp, sh=SHARDING.index("zero3"), mb=mb, rc=RECOMPUTE.index(rc))
    sub = c.take([i])
    tt = TimeTables(cfg, Tables(cfg))
    cm = comm_times(cfg, tt, sub)
    plan = build_plan(candidate_config(cfg, c, i))
    rows = {("token" if "one scale a token" in r.cadence else "weight", r.phase): r
            for r in plan.stage(0).collectives if r.dtype == "fp64"}
    assert {k: r.size_bytes for k, r in rows.items()} == {("token", p): mb * 2048 * 8 for p in ("forward", "backward")} \
        | {("weight", p): 2048 * 8 for p in ("forward", "backward")}
    m, layers, replay = 64 // (mb * 8 // tp // pp), 8 // pp, 2 if rc == "full" else 0
    assert {k: r.per_step for k, r in rows.items()} == {(w, "forward"): layers * m * 2 for w in ("token", "weight")} \
        | {(w, "backward"): layers * m * (5 + replay) for w in ("token", "weight")}
    both = rows["token", "forward"].time_s + rows["weight", "forward"].time_s
    assert (cm["amax_f"][0], cm["amax_b"][0]) == pytest.approx((2 * both, 5 * both), rel=1e-12)
    st = stage_layout(cfg, sub, pp)
    bound = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
    monkeypatch.setattr(float8_bounds, "rowwise_times", lambda *a: (0.0, 0.0))  # the bound before: none
    before = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
    assert bound - before == pytest.approx((m + pp - 1) * layers * (2 + 5 + replay) * both, rel=1e-9)
    assert bound <= step_time(plan).step_s


@pytest.mark.parametrize("mb,rc", [(1, "selective"), (2, "full")])
def test_bound_counts_megatrons_qkv_gathers(mb, rc):
    """SMALL (16 q / 4 KV heads of 128) at tp 8 under framework megatron (SP): past the KV
    heads (8 GPUs: no data axis) Megatron-LM all-gathers the fused QKV output over tp each layer and reduce-scatters its
    gradient (spec/axes/tp_kv.py), b x 2048 x (16 + 8) x 128 x 2 B = 12,582,912 B per micro-batch
    row; under full recompute a layer gathers again in its backward. The bound's vectorised seconds
    (search.comm_bounds ``tp_qkv_ag``/``tp_qkv_rs``) are the table rows' own, and the bound, which
    chains them with each layer as the timeline blocks on them, stays at or below the step and
    within their total of it."""
    cfg = config({"framework": "megatron"}, recompute=[rc])
    c, i = _one(cfg, pp=1, tp=8, mb=mb, ov=0)  # tp 8 fills the node: no data axis
    sub = c.take([i])
    tt = TimeTables(cfg, Tables(cfg))
    cm = comm_times(cfg, tt, sub)
    plan = build_plan(candidate_config(cfg, c, i))
    rows = {(r.phase, r.op): r for r in plan.stage(0).collectives if "QKV sub-sharding" in r.cadence}
    ag, rs = rows[("forward", "all-gather")], rows[("backward", "reduce-scatter")]
    assert ag.size_bytes == rs.size_bytes == mb * 2048 * 24 * 128 * 2
    assert (cm["tp_qkv_ag"][0], cm["tp_qkv_rs"][0]) == pytest.approx((ag.time_s, rs.time_s), rel=1e-12)
    assert (("backward", "all-gather") in rows) == (rc == "full")
    qkv = sum(r.time_s * r.per_step for r in rows.values())
    st = stage_layout(cfg, sub, 1)
    bound = float(step_lower_bound(cfg, tt, sub, st, state(cfg, tt.tables, sub, st))[0])
    step = step_time(plan).step_s
    assert bound <= step and step - bound < qkv
