"""Pipeline event simulation: handed case C11 exactly, the bubble formulas for uniform
stages, ZB-H1, orders against the activation memory module, critical path, traces, and
the rank timeline of units and whole plans."""

import json
from fractions import Fraction

import pytest

from meshplan.errors import ConfigError
from meshplan.memory.inflight import in_flight_chunks
from meshplan.pipeline.simulate import SCHEDULES, PipelineSpec, bubble_formula, simulate, stage_order
from meshplan.pipeline.trace import trace_dict, write_trace


def test_c11_exact():
    """Handed case C11 (DualPipe issue 8): p 4, m 8."""
    r = simulate(PipelineSpec("1f1b", p=4, m=8, forward_s=1, backward_s=2))
    assert r.bubble == pytest.approx(float(Fraction(3, 8)), abs=1e-12)  # 0.375 idle / ideal
    assert r.bubble_of_total == pytest.approx(float(Fraction(3, 11)), abs=1e-12)  # 0.2727 idle / total
    assert (round(r.bubble, 4), round(r.bubble_of_total, 4)) == (0.375, 0.2727)
    r = simulate(PipelineSpec("interleaved_1f1b", p=4, m=8, v=2, forward_s=1, backward_s=2))
    assert r.bubble == pytest.approx(float(Fraction(3, 16)), abs=1e-12)  # 0.1875
    assert r.bubble_of_total == pytest.approx(float(Fraction(3, 19)), abs=1e-12)  # 0.1579
    assert (round(r.bubble, 4), round(r.bubble_of_total, 4)) == (0.1875, 0.1579)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("f,b", [(1, 2), (1, 1), (0.3, 0.7)])
def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m(schedule, p, m, f, b):
    r = simulate(PipelineSpec(schedule, p=p, m=m, forward_s=f, backward_s=b))
    assert r.bubble == pytest.approx((p - 1) / m, rel=1e-12, abs=1e-12)
    assert r.bubble_of_total == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-12)
    assert r.step_s == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, v, k):
    m = k * p
    r = simulate(PipelineSpec("interleaved_1f1b", p=p, m=m, v=v, forward_s=1, backward_s=2))
    assert r.bubble == pytest.approx((p - 1) / (v * m), rel=1e-12)
    assert r.bubble == pytest.approx(bubble_formula("interleaved_1f1b", p, m, v))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 13), (8, 8), (8, 24)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 2, 1), (1, 3, 0.25), (1.5, 1, 0.5)])
def test_zb_h1_bubble_formula(p, m, f, b, w):
    """Qi et al. 2023 section 3.1: ZB-H1 bubble (p-1)(T_F + T_B - T_W) per stage against
    1F1B's (p-1)(T_F + T_B + T_W); idle / ideal = (p-1)(F+B-W) / (m(F+B+W)). Holds here
    for m >= p and W <= min(F, B)."""
    zb = simulate(PipelineSpec("zb_h1", p=p, m=m, forward_s=f, backward_s=b, weight_s=w))
    assert zb.step_s == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
    assert zb.bubble == pytest.approx((p - 1) * (f + b - w) / (m * (f + b + w)))
    one = simulate(PipelineSpec("1f1b", p=p, m=m, forward_s=f, backward_s=b, weight_s=w))
    assert one.bubble == pytest.approx((p - 1) / m)
    if p > 1:
        assert zb.bubble < one.bubble


def test_zb_h1_one_third_of_1f1b_when_f_b_w_equal():
    zb = simulate(PipelineSpec("zb_h1", p=4, m=8, forward_s=1, backward_s=1, weight_s=1))
    assert zb.bubble == pytest.approx((4 - 1) / (3 * 8))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 8), (3, 2), (4, 12)])
def test_zb_h1_keeps_1f1b_peak_memory(p, m):
    """A micro-batch is held from its F until its W: at most p on every stage (1F1B's
    first stage holds p)."""
    for s in range(p):
        held = peak = 0
        for u in stage_order("zb_h1", p, m, 1, s):
            held += {"F": 1, "B": 0, "W": -1}[u.kind]
            peak = max(peak, held)
        assert peak == min(p, m)


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (4, 8, 2), (2, 2, 3), (8, 16, 4), (4, 3, 1)])
def test_orders_hold_what_the_activation_module_counts(p, m, v):
    """Peak chunks in flight (F done, B not yet) per stage = memory.inflight.in_flight_chunks."""
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    for s in range(p):
        order = stage_order(schedule, p, m, v, s)
        assert sorted((u.kind, u.mb, u.chunk) for u in order) == sorted(
            (k, i, c) for k in "FB" for i in range(m) for c in range(v))
        held = peak = 0
        for u in order:
            held += 1 if u.kind == "F" else -1
            peak = max(peak, held)
        assert peak == in_flight_chunks(s, p, m, v)


def test_gpipe_with_p2p_matches_its_closed_form_and_1f1b_is_not_faster():
    c = 0.1
    g = simulate(PipelineSpec("gpipe", p=4, m=8, forward_s=1, backward_s=2, p2p_s=c))
    assert g.step_s == pytest.approx(8 * 3 + 3 * (3 + 2 * c))
    one = simulate(PipelineSpec("1f1b", p=4, m=8, forward_s=1, backward_s=2, p2p_s=c))
    assert one.step_s >= g.step_s - 1e-12
    assert {e.stream for e in one.events} == {"compute", "pp"}


def test_critical_path_is_a_chain_from_zero_to_the_step_end():
    r = simulate(PipelineSpec("1f1b", p=4, m=8, forward_s=1, backward_s=2, p2p_s=0.05))
    path = r.critical_path
    assert path[0].start_s == 0 and path[-1].end_s == pytest.approx(r.step_s)
    for a, b in zip(path, path[1:]):
        assert b.start_s >= a.end_s - 1e-12
    assert path[0].stage == 0 and path[-1].stage == 0 and path[-1].name == "B7"
    assert {e.stage for e in path} == {0, 1, 2, 3}


def test_bad_inputs():
    with pytest.raises(ConfigError, match="unknown schedule"):
        PipelineSpec("dualpipe", p=2, m=2)
    with pytest.raises(ConfigError, match="a multiple of torch's rounds"):  # 2 rounds do not divide 9
        PipelineSpec("interleaved_1f1b", p=4, m=9, v=2)
    assert PipelineSpec("interleaved_1f1b", p=4, m=6, v=2).m == 6  # one round of 6: torch's order
    with pytest.raises(ConfigError, match="interleaved"):
        PipelineSpec("1f1b", p=4, m=8, v=2)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"}


def test_trace_is_chrome_json_and_written_atomically(tmp_path):
    r = simulate(PipelineSpec("1f1b", p=2, m=2, forward_s=1e-3, backward_s=2e-3, p2p_s=1e-4))
    d = trace_dict(r.events, {"x": 1})
    xs = [e for e in d["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(r.events)
    first = min(xs, key=lambda e: (e["pid"], e["ts"]))
    assert first["pid"] == 0 and first["ts"] == 0 and first["dur"] == pytest.approx(1000.0)  # microseconds
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 0)] == "compute" and "pp" in names.values()
    out = write_trace(r.events, tmp_path / "t.json")
    assert json.loads(out.read_text())["traceEvents"]
    with pytest.raises(ConfigError, match="exists"):
        write_trace(r.events, out)
    write_trace(r.events, out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left


# Rank timeline ------------------------------------------------------------------------

from meshplan import catalog  # noqa: E402
from meshplan.compute.layer import layer_cost  # noqa: E402
from meshplan.compute.ops import Workload  # noqa: E402
from meshplan.schedule.backward_pass import backward_unit  # noqa: E402
from meshplan.schedule.rank_timeline import ChunkCosts, CommTimes, Overlap, forward_unit  # noqa: E402

GPU = catalog.gpu("h100-sxm5-80gb")
MODEL = catalog.model("llama3-8b")


def _chunk(n=4, **kw):
    w = Workload(seq_len=4096, micro_batch=1, **kw)
    c = layer_cost(MODEL, GPU, w)
    return ChunkCosts((c,) * n, (False,) * n), c, w


def test_unit_without_communication_is_the_sum_of_its_ops():
    ch, c, w = _chunk(tp=1)
    f = forward_unit(ch, CommTimes(), w, Overlap())
    assert f.duration_s == pytest.approx(4 * c.forward_s) and f.exposed_s == {} and f.tail_s == 0
    b = backward_unit("B", ch, CommTimes(), w, Overlap())
    assert b.duration_s == pytest.approx(4 * c.backward_s)
    bx = backward_unit("Bx", ch, CommTimes(), w, Overlap())
    ww = backward_unit("W", ch, CommTimes(), w, Overlap())
    assert bx.duration_s + ww.duration_s == pytest.approx(b.duration_s)


def test_zero_bubble_w_replays_a_checkpointed_layers_forward_per_parameter_group():
    """torch 2.13's stage_backward_weight runs one autograd.grad per parameter group and the
    non-reentrant checkpoint replays the layer's forward in each (tests/test_wlag_layers.py measured 18
    forwards in W for 2 Blocks of 9 groups): under eager full AC a W of 4 Llama-3-8B layers is
    4 x (weight-gradient GEMMs + 9 x the layer's forward), the replay being the whole forward (eager
    torch re-runs the layer to its end: compute.recompute.full_ac_replays_whole). Not where ChunkCosts
    carries no replays, nor compiled or under op-level AC (neither measured as replaying; op raised in W),
    and B and Bx are unchanged (the replay in Bx is the one the step always had)."""
    from meshplan.memory.wlag import weight_groups

    g = weight_groups(MODEL)
    assert g == 9  # attn norm, wq, wk, wv, wo, mlp norm, w_gate, w_up, w_down
    w = Workload(seq_len=4096, micro_batch=1, recompute="full", torch_eager=True)
    c = layer_cost(MODEL, GPU, w)
    assert c.seconds("backward_input", recompute=True) == pytest.approx(c.forward_s)
    with_r, without = ChunkCosts((c,) * 4, (False,) * 4, w_replays=(g,) * 4), ChunkCosts((c,) * 4, (False,) * 4)
    ww = backward_unit("W", with_r, CommTimes(), w, Overlap()).duration_s
    assert ww == pytest.approx(4 * (c.seconds("backward_weight") + 9 * c.forward_s))
    assert backward_unit("W", without, CommTimes(), w, Overlap()).duration_s == pytest.approx(4 * c.seconds("backward_weight"))
    for kind in ("B", "Bx"):
        assert backward_unit(kind, with_r, CommTimes(), w, Overlap()).duration_s == \
            backward_unit(kind, without, CommTimes(), w, Overlap()).duration_s
    for other in (Workload(seq_len=4096, micro_batch=1, recompute="full"),  # compiled
                  Workload(seq_len=4096, micro_batch=1, recompute="op", torch_eager=True)):
        co = layer_cost(MODEL, GPU, other)
        ch = ChunkCosts((co,) * 4, (False,) * 4, w_replays=(g,) * 4)
        assert backward_unit("W", ch, CommTimes(), other, Overlap()).duration_s == \
            pytest.approx(4 * co.seconds("backward_weight"))


def test_tp_collectives_block_unless_overlapped():
    ch, c, w = _chunk(tp=4, sp=True)
    t = 2e-5  # shorter than half of the attention block (0.18 ms)
    comm = CommTimes({("tp", "", ph, op): t for ph in ("forward", "backward")
                      for op in ("all-gather", "reduce-scatter")})
    f = forward_unit(ch, comm, w, Overlap())
    assert f.duration_s == pytest.approx(4 * c.forward_s + 4 * 4 * t)  # AG, RS per block, 2 blocks per layer
    assert f.exposed_s["tp"] == pytest.approx(16 * t)
    fo = forward_unit(ch, comm, w, Overlap(tp=True))
    assert fo.duration_s == pytest.approx(4 * c.forward_s)  # blocks are longer than 2 collectives
    # backward, torch (default): the AG before each block and the RS after its weight gradients block
    b = backward_unit("B", ch, comm, w, Overlap())
    assert b.exposed_s["tp"] == pytest.approx(16 * t)
    # Megatron (tp_grad): the RS runs during the weight-gradient GEMMs; the re-gather of the
    # column-parallel input (SP) runs during its input-gradient GEMM: only the 8 AGs block
    bm = backward_unit("B", ch, comm, w, Overlap(tp_grad=True))
    assert bm.exposed_s["tp"] == pytest.approx(8 * t)
    bx = backward_unit("Bx", ch, comm, w, Overlap())  # ZB: no W to hide the RS behind
    assert bx.exposed_s["tp"] == pytest.approx(16 * t)


def test_fsdp_prefetch_hides_all_but_the_first_all_gather():
    ch, c, w = _chunk(tp=1)
    ag = 0.5 * c.forward_s
    comm = CommTimes({("shard", "layer", "forward", "all-gather"): ag})
    pre = forward_unit(ch, comm, w, Overlap(fsdp_prefetch=True))
    assert pre.duration_s == pytest.approx(ag + 4 * c.forward_s)
    lazy = forward_unit(ch, comm, w, Overlap(fsdp_prefetch=False))
    assert lazy.duration_s == pytest.approx(4 * (ag + c.forward_s))
    assert lazy.exposed_s["fsdp"] == pytest.approx(4 * ag)


def test_gradient_reduce_scatter_overlaps_the_next_layer_backward():
    ch, c, w = _chunk(tp=1)
    rs = 0.25 * c.backward_s
    comm = CommTimes({("shard", "layer", "backward", "reduce-scatter"): rs})
    ov = backward_unit("B", ch, comm, w, Overlap(grad_reduce=True))
    assert ov.duration_s == pytest.approx(4 * c.backward_s) and ov.tail_s == pytest.approx(rs)
    assert ov.tail_stream == "fsdp"
    blocking = backward_unit("B", ch, comm, w, Overlap(grad_reduce=False))
    assert blocking.duration_s == pytest.approx(4 * (c.backward_s + rs))


# Whole plans ----------------------------------------------------------------------------

from meshplan.plan import build_plan  # noqa: E402
from meshplan.pipeline.split_backward_ac import split_backward_ac_warning  # noqa: E402
from meshplan.plan_runtime import ZERO1_WITHOUT_ENGINE  # noqa: E402
from meshplan.config import config_from_dict, load_config  # noqa: E402
from meshplan.schedule.steptime import step_time  # noqa: E402
from meshplan.schedule.comm_streams import comm_kind  # noqa: E402


def _plan(mesh, training=None, model="llama3-8b", nodes=2):
    t = {"global_batch": 32, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1", **(training or {})}
    return build_plan(config_from_dict({"model": {"catalog": model}, "cluster": {"system": "dgx-h100", "nodes": nodes},
                                        "training": t, "mesh": mesh}))


MESHES = [
    ({"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 4], "sequence_parallel": True}, {}),
    ({"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 4], "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}, {}),
    ({"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 4], "pp_schedule": "zb_h1"}, {"recompute": "full"}),
    ({"names": ["dp_replicate", "dp_shard", "cp", "tp"], "shape": [2, 2, 2, 2]}, {"sharding": "hsdp"}),
    ({"names": ["dp", "tp"], "shape": [4, 4]}, {"sharding": "none"}),
]


@pytest.mark.parametrize("mesh,training", MESHES)
@pytest.mark.parametrize("overlap", [Overlap(), Overlap(tp=True, fsdp_prefetch=False, grad_reduce=False,
                                                        param_gather=True)])
def test_step_time_of_plans(mesh, training, overlap):
    plan = _plan(mesh, training)
    for rows in plan.collectives.values():
        for r in rows:
            assert comm_kind(r) != "other", r  # every row of the table is understood
    st = step_time(plan, overlap)
    assert st.step_s >= st.pipeline.step_s > 0
    assert st.mfu == pytest.approx(st.model_flops / (st.step_s * plan.world * 989.4e12))
    assert 0 < st.mfu <= st.hfu < 1
    assert st.tokens_per_s == pytest.approx(32 * 4096 / st.step_s)
    # the bubble line (idle/ideal) only where there is a pipeline (pp > 1)
    assert st.critical_path() and any("idle/ideal" in line for line in st.lines()) == (plan.mesh.degree("pp") > 1)
    # zero1 under framework torch: the runtime warning that no torch engine runs it (plan_runtime.runtime_warnings)
    zero1 = [ZERO1_WITHOUT_ENGINE] if plan.config.training.sharding == "zero1" else []
    # and zb_h1 with full recompute under torch: split backward with AC (torchtitan issue #773)
    ac = list(split_backward_ac_warning(plan.config.training, plan.spec.pp_schedule, plan.pp))
    assert len(ac) == (plan.spec.pp_schedule == "zb_h1")
    assert [n for n in st.notes if not n.startswith("FSDP2 copies on the compute stream")] == zero1 + ac


def test_zb_h1_reduces_the_plan_bubble():
    mesh = {"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 4], "sequence_parallel": True}
    plan = _plan(mesh, {"global_batch": 8})
    assert step_time(plan, schedule="zb_h1").pipeline.bubble < step_time(plan, schedule="1f1b").pipeline.bubble


def test_seed_plan_timeline_and_trace(seed_path, tmp_path):
    plan = build_plan(load_config(seed_path))
    st = step_time(plan)
    assert set(st.exposed_s) >= {"tp", "fsdp"}
    out = st.write_trace(tmp_path / "seed.json", detail=False)
    d = json.loads(out.read_text())
    assert d["otherData"]["step_ms"] == pytest.approx(st.step_s * 1e3)
    assert sum(e["ph"] == "X" for e in d["traceEvents"]) == 2 * plan.micro_batches + len(st.post_events)
