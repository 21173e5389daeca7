"""The axis registry (meshplan.spec.axes, issue 10 item 2): every :class:`Axis` member has
each part (foreign names, what it divides, its search column, its placement weight, its
rules in the plan's order), its rules give the same verdict on one mesh (Python ints, as the
exact plan runs them) as on the search's columns (numpy), and a toy axis registered here
shows up in the validity rules, the search space, the search's rejections and bounds, and
in a plan's local shapes, collective table, activation memory and, through the timeline it
declares, on its own stream of the step's rank timeline, without an edit to any other
module."""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.mesh.resolve import resolve_mesh
from meshplan.mesh.validity import check
from meshplan.placement.score import DEFAULT_WEIGHTS
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.search.estimate import estimate
from meshplan.search.memory import comm_axes
from meshplan.search.space import OK, REASONS, RECOMPUTE, SHARDING, candidate_config, enumerate_candidates, \
    first_reason, reason_table, world_of
from meshplan.spec.axes import KNOWN_AXES, MEGATRON_AXES, TORCHTITAN_AXES
from meshplan.schedule.comm_streams import simulated_groups, timeline_axes
from meshplan.spec.axes.base import At, AxisDef, AxisDegrees, Block, CollectiveKind, Dim, Rule, SearchColumn, Slot, \
    Timeline
from meshplan.spec.axes.registry import AXES, Axis, rules, search_axes
from meshplan.spec.mesh import MeshSpec
from meshplan.units import dtype_bytes

#: Axes without a part, and why (the test fails for any other gap).
NO_SEARCH_COLUMN = {Axis.DP: "the search names the data axes dp_replicate and dp_shard; dp is their one-axis form"}
NO_COLLECTIVES = {Axis.ETP: "no etp rows: at ep 1 under torch (etp = tp) an MoE layer's collectives are tp rows "
                           "(spec.axes.moe_tp.experts_over_tp_ops); otherwise etp > 1 is planned as expert shapes only"}


@pytest.mark.parametrize("axis", list(Axis))
def test_every_axis_has_each_part(axis):
    a = AXES[axis]
    assert isinstance(a, AxisDef) and a.doc
    assert a.torchtitan or a.megatron, f"{axis}: the names torchtitan or Megatron-LM give it"
    assert a.divides, f"{axis}: the tensor dimensions it divides"
    assert a.weights.get(str(axis), 0) > 0, f"{axis}: its placement weight"
    assert DEFAULT_WEIGHTS[str(axis)] == a.weights[str(axis)]
    assert (a.search is not None) or axis in NO_SEARCH_COLUMN, f"{axis}: its search column"
    assert a.collectives or axis in NO_COLLECTIVES, f"{axis}: its collective kinds"
    for name in a.torchtitan:
        assert TORCHTITAN_AXES[name] == axis
    for name in a.megatron:
        assert MEGATRON_AXES[name] == axis
    assert (str(axis) in KNOWN_AXES)
    assert a.timeline is None, f"{axis}: a built-in axis keeps its hand-written place in the rank timeline"


def test_registry_is_complete_and_rules_are_ordered():
    assert list(AXES) == list(Axis)
    keys = [r.key for r in rules()]
    orders = [r.order for r in rules()]
    assert len(set(keys)) == len(keys) and len(set(orders)) == len(orders) and orders == sorted(orders)
    for r in rules():  # every rule gives its exact reason or names where it is produced
        assert r.check is not None or r.where, r.key
    # the search's categories are the registered rules with a vectorised form, then the schedules'
    assert [k for k, _ in REASONS][:15] == ["expert_block", "heads", "torch_kv_heads", "ffn", "expert_ffn", "layers",
                                            "experts", "expert_dim1", "megatron_moe_sp", "torch_etp", "seq_cp",
                                            "megatron_cp_attention", "torch_cp_flex", "seq_tp", "batch"]
    assert [c.column for _, c in search_axes()] == ["pp", "dpr", "dps", "cp", "tp", "ep", "etp"]
    assert [c.column for _, c in search_axes() if c.remainder] == ["dps"]


MODELS = [SimpleNamespace(q_heads=q, n_kv_heads=kv, ffn=ffn, is_moe=moe, dense_layers=dl, moe_ffn=mf, experts=e,
                          layers=lay, hidden=h)
          for q, kv, ffn, moe, dl, mf, e, lay, h in [(32, 8, 14336, False, 0, 0, 0, 32, 4096),
                                                     (40, 10, 5000, True, 1, 1536, 6, 27, 5120),
                                                     (12, 12, 3072, False, 0, 0, 0, 12, 768)]]
TRAINING = [SimpleNamespace(global_batch=gb, micro_batch=1, seq_len=s, sharding=sh, zero3_engine="fsdp2", framework=f,
                            flash_attention=fa, op_sac_policy=rev, torchtitan_v022=v)
            for gb, s, sh, f, fa, rev, v in [(64, 4096, "zero3", "torch", True, "238fa99", False),
                                             (48, 1000, "zero1", "megatron", False, "238fa99", False),
                                             (64, 4096, "zero3", "torch", True, "b5bcd76", False),  # tt50: torch_cp_flex
                                             (64, 4096, "zero3", "torch", True, "238fa99", True)]]  # torchtitan <= v0.2.2: etp = tp


@pytest.mark.parametrize("m", MODELS)
@pytest.mark.parametrize("t", TRAINING)
def test_rules_give_one_verdict_on_ints_and_on_columns(m, t):
    """Every rule's predicate, run on one mesh's ints and on all meshes' numpy columns,
    agrees row by row (the exact plan and the search call the same formula)."""
    grid = list(itertools.product([1, 2, 4, 16], [1, 2], [1, 3, 4], [1, 2, 5], [1, 4, 8], [1, 2, 3], [1, 2], [1, 2],
                                  [1, 3]))
    cols = np.array(grid, dtype=np.int64).T
    pp, dpr, dps, cp, tp, ep, etp, mb, vpp = cols
    many = SimpleNamespace(pp=pp, dpr=dpr, dps=dps, dp=dpr * dps, cp=cp, tp=tp, ep=ep, etp=etp, mb=mb, vpp=vpp,
                           sp=(tp > 1) & (mb == 1))  # sp off on the mb 2 rows: the megatron_moe_sp rule breaks there
    for rule in (r for r in rules() if r.bad is not None):
        vec = np.broadcast_to(rule.bad(m, t, many), pp.shape)
        for i, g in enumerate(grid):
            one = AxisDegrees(pp=g[0], dpr=g[1], dps=g[2], dp=g[1] * g[2], cp=g[3], tp=g[4], ep=g[5], etp=g[6],
                              mb=g[7], vpp=g[8], sp=g[4] > 1 and g[7] == 1)
            assert bool(rule.bad(m, t, one)) == bool(vec[i]), (rule.key, g)


#: Exact reasons the search's predicate does not have (the plan of such a candidate rejects it):
#: the MoE token split over tp / etp (and ep on a dense model, never searched).
EXACT_ONLY = {"experts": ("tokens do not split evenly", "on a dense model")}


def test_a_rule_is_its_exact_reason():
    """A rule's exact text comes with its predicate: broken exactly where ``bad`` says,
    except for the exact-only reasons listed in :data:`EXACT_ONLY`."""
    t0 = SimpleNamespace(global_batch=64, micro_batch=2, seq_len=4096, vocab_pad_divisor=128, sharding="zero3",
                         zero3_engine="fsdp2", framework="megatron", flash_attention=False, op_sac_policy="238fa99",
                         torchtitan_v022=False)
    tt = SimpleNamespace(**{**vars(t0), "framework": "torch", "op_sac_policy": "b5bcd76"})  # tt50: torch_cp_flex
    for rule, t in itertools.product((r for r in rules() if r.bad is not None and r.check is not None), (t0, tt)):
        for m in MODELS:
            m = SimpleNamespace(**vars(m), name="m", d_head=128, vocab=32000)
            for tp, cp, dp in itertools.product([1, 3, 8], [1, 3, 4], [1, 3, 8]):
                d = AxisDegrees(pp=1, dpr=1, dps=dp, dp=dp, cp=cp, tp=tp, ep=1, etp=1, mb=2, vpp=1, sp=tp > 1)
                reasons, _ = rule.check(m, t, d)
                extra = [r for r in reasons if any(x in r for x in EXACT_ONLY.get(rule.key, ()))]
                assert bool(set(reasons) - set(extra)) == bool(rule.bad(m, t, d)), (rule.key, tp, cp, dp, reasons)


# --- a toy axis: a Ulysses-style sequence axis ``sq`` whose all-to-all splits the KV heads ----

def _sq_heads_bad(m, t, d):
    return m.n_kv_heads % (d.degree("sq") * d.tp) != 0


def _sq_heads(m, t, d):
    sq = d.degree("sq")
    if _sq_heads_bad(m, t, d):
        return (f"kv_heads {m.n_kv_heads} are not divisible by sq {sq} x tp {d.tp}",), ()
    return (), ()


def _sq_rows(add, c):
    """The toy's rows: two all-to-alls of the rank's b x s/sq x h activation per layer and
    micro-batch in the forward (q/k/v in, the context out), compute dtype, and their two
    gradients in the backward (an all-to-all's backward is the inverse all-to-all)."""
    t = c.training
    size = t.micro_batch * (t.seq_len // c.mesh.degree("sq")) * c.model.hidden * dtype_bytes(t.compute_dtype)
    add("sq", "forward", "all-to-all", size, t.compute_dtype, 2 * len(c.layers), "every layer (toy Ulysses)",
        "attention")
    add("sq", "backward", "all-to-all", size, t.compute_dtype, 2 * len(c.layers), "every layer (toy Ulysses grads)",
        "attention's backward")


#: The toy's place in a layer's timeline: its all-to-alls wrap the attention block, blocking,
#: in the forward and (around the attention's backward) in the backward.
SQ_TIMELINE = Timeline(tuple(Slot(phase, "all-to-all", at, Block.ATTN)
                             for phase in ("forward", "backward") for at in (At.BEFORE, At.AFTER)))

TOY = AxisDef(doc="Ulysses sequence axis (toy)", torchtitan=("sq",),
              rules=(Rule("sq_heads", 25, "kv_heads not divisible by sq * tp", _sq_heads_bad, _sq_heads),),
              divides=(Dim.SEQUENCE,), search=SearchColumn(column="sq", option="sq"),
              collectives=(CollectiveKind("all-to-all", "sq", "forward", "b x s/sq x h activation"),
                           CollectiveKind("all-to-all", "sq", "backward", "its gradient")),
              rows=_sq_rows, timeline=SQ_TIMELINE, weights={"sq": 1e4})

CFG = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
       "training": {"global_batch": 16, "seq_len": 1024}}


def test_a_toy_axis_registered_here_shows_up_in_validity_and_search(monkeypatch):
    monkeypatch.setitem(AXES, "sq", TOY)
    keys = [k for k, _ in reason_table()]
    assert keys.index("sq_heads") == keys.index("heads") + 1  # order 25: after the heads, before the widths

    # the exact plan's validity runs its rule (llama3-8b: 8 KV heads); torch's foreach AdamW, whose
    # state-sized temporary makes the optimizer step the peak checked below
    cfg = config_from_dict({**CFG, "training": {**CFG["training"], "optimizer_impl": "foreach"}}, require_mesh=False)
    mesh = resolve_mesh(MeshSpec(names=["sq", "tp"], shape=[2, 8]), 16)
    v = check(cfg.model, cfg.training, mesh, MeshSpec(names=["sq", "tp"], shape=[2, 8]))
    assert "kv_heads 8 are not divisible by sq 2 x tp 8" in v.reasons
    ok = check(cfg.model, cfg.training, resolve_mesh(MeshSpec(names=["sq", "tp"], shape=[2, 4]), 8),
               MeshSpec(names=["sq", "tp"], shape=[2, 4]))
    assert not any("sq" in r for r in ok.reasons)

    # the search has its column, factorizes the world over it, and rejects by its rule
    c = enumerate_candidates(cfg)
    sq = c.degree("sq")
    assert set(sq.tolist()) == {1, 2, 4, 8, 16}
    assert all(world_of(c, i) == 16 for i in range(0, len(c), 97))
    code = first_reason(cfg, c)
    own = keys.index("sq_heads")
    earlier = np.isin(code, [keys.index(k) for k in keys[:own]])
    assert ((code == own) == (~earlier & (8 % (sq * c.tp) != 0))).all()
    assert (code == own).any() and (code != own).any()
    i = int(np.flatnonzero((sq == 2) & (c.tp == 2))[0])
    assert candidate_config(cfg, c, i).mesh.names[-2:] == ["tp", "sq"]  # registered last: innermost
    assert "sq 2" in c.label(i)
    # the search's bounds split the sequence and count its rows' communicator as the plan does:
    # on the valid sq 2 candidate with the most activations (zero3, no recompute, the largest
    # micro-batch; its peak is foreach Adam's state-sized temporary in the optimizer step, above
    # its backward's since torchtitan's FSDP2 units reduce the head right after its backward
    # and reshard the embedding after forward) the exact peak lies between the memory bounds
    # (keyed on cp alone, the lower bound would pass it) and the step above its lower bound
    est = estimate(cfg, c, code)
    ok = np.flatnonzero((sq == 2) & (c.tp == 2) & (code == OK) & (c.pp == 1) & (c.sh == SHARDING.index("zero3"))
                        & (c.rc == RECOMPUTE.index("none")))
    j = int(ok[np.argmax(c.mb[ok])])
    exact = build_plan(candidate_config(cfg, c, j))
    peak = max(exact.timelines, key=lambda tl: tl.peak.total_bytes).peak
    assert peak.phase == "step" and est.peak_lo[j] <= peak.total_bytes <= est.peak_hi[j]
    # (the search's collective-time bound leaves the toy's all-to-alls out; the exact step has them on stream sq)
    st = step_time(exact)
    assert st.exposed_s["sq"] > 0 and est.step_lo[j] <= st.step_s
    assert comm_axes(cfg, c)[j] == len({r.axis for rows in exact.collectives.values() for r in rows})
    with_rows = comm_axes(cfg, c)
    monkeypatch.setitem(AXES, "sq", replace(TOY, rows=None))
    assert ((with_rows - comm_axes(cfg, c)) == (sq > 1)).all()


def _toy_plan(names, shape):
    return build_plan(config_from_dict({**CFG, "training": {"global_batch": 16, "seq_len": 4096, "recompute": "none"},
                                        "mesh": {"names": names, "shape": shape}}))


def test_a_toy_axis_registered_here_divides_shapes_adds_rows_and_divides_activations(monkeypatch):
    """The toy's descriptor alone (divides the sequence, builds its rows) changes a plan's
    shapes, collective table and activation memory: llama3-8b (h 4096, 32 layers, 32 q and 8
    KV heads), b 1, s 4096, bf16, on dp_shard 2 x sq 2 x tp 4 (16 ranks)."""
    plain = _toy_plan(["dp_shard", "sq", "tp"], [2, 2, 4])  # before: "sq" is a user-named axis (rank math only)
    assert [g.m for g in plain.gemms if g.name == "wq"] == [4096] and plain.attention.seq_q == 4096
    assert not any(r.axis == "sq" for rows in plain.collectives.values() for r in rows)

    monkeypatch.setitem(AXES, "sq", TOY)
    plan = _toy_plan(["dp_shard", "sq", "tp"], [2, 2, 4])
    assert plan.feasible, plan.reasons
    # shapes: each rank holds s / sq = 2048 tokens (GEMM rows, attention queries; keys whole)
    wq = [g for g in plan.gemms if g.name == "wq"][0]
    assert (wq.m, wq.n, wq.k) == (2048, 32 // 4 * 128, 4096)
    assert (plan.attention.seq_q, plan.attention.seq_kv, plan.attention.q_heads) == (2048, 4096, 8)
    # collective table: its rows, b * s/sq * h * 2 B = 16 MiB, 2 per layer = 64 per micro-batch, over ranks 0
    # and 4, in the forward and (their gradients) in the backward
    rows = [r for r in plan.stage(0).collectives if r.axis == "sq"]
    assert [(r.op, r.phase, r.size_bytes, r.per_microbatch, r.example_ranks) for r in rows] == \
        [("all-to-all", phase, 1 * 2048 * 4096 * 2, 64, (0, 4)) for phase in ("forward", "backward")]
    assert rows[0].per_step == 64 * plan.micro_batches and rows[0].time_s > 0
    # and the other axes' rows carry the rank's b x s/sq x h: tp's all-reduce 16 MiB (32 MiB without the toy)
    tp_ar = lambda p: [r.size_bytes for r in p.stage(0).collectives if (r.axis, r.op, r.phase) == ("tp", "all-reduce",
                                                                                                   "forward")]
    assert tp_ar(plan) == [1 * 2048 * 4096 * 2] and tp_ar(plain) == [1 * 4096 * 4096 * 2]
    # memory: every activation term is linear in the local tokens here (flash attention, no
    # recompute), so the sequence split halves the activations, as cp 2 does
    act = lambda p: p.timelines[0].max_by_kind["activations"]
    assert act(plan) * 2 == act(plain)
    assert act(plan) == act(_toy_plan(["dp_shard", "cp", "tp"], [2, 2, 4]))
    # the step: without its timeline the rank timeline has no stream for its rows, so it says so
    # (never files them under ep by op)
    monkeypatch.setitem(AXES, "sq", replace(TOY, timeline=None))
    notes = step_time(_toy_plan(["dp_shard", "sq", "tp"], [2, 2, 4])).notes
    assert "collective not simulated (kind unknown): sq forward all-to-all (every layer (toy Ulysses))" in notes
    assert "sq" not in simulated_groups() and "sq" not in step_time(plan).exposed_s


def test_a_toy_axis_with_a_timeline_has_its_own_stream_in_the_step(monkeypatch):
    """The toy's timeline alone puts its rows in the step: llama3-8b on dp_shard 2 x sq 2 x tp 4
    (one stage, recompute none, no tp overlap), 16 / (b 1 x dp 2) = 8 micro-batches. Each of
    its 4 all-to-alls per layer (2 forward, 2 backward) is blocking and the sq stream carries
    nothing else, so the compute waits for each call's whole time: exposed on stream sq =
    8 micro-batches x 32 layers x (2 x t_forward + 2 x t_backward), t the row's seconds per
    call (the comm model's pairwise all-to-all of 16 MiB over ranks 0 and 4, one node's
    NVLink), i.e. the rows' seconds times their calls per step."""
    monkeypatch.setitem(AXES, "sq", TOY)
    assert "sq" in simulated_groups() and timeline_axes()["sq"].stream == "sq"
    plan = _toy_plan(["dp_shard", "sq", "tp"], [2, 2, 4])
    assert plan.feasible and len(plan.stages) == 1 and plan.micro_batches == 8
    fwd, bwd = sorted((r for r in plan.stage(0).collectives if r.axis == "sq"), key=lambda r: r.phase != "forward")
    assert fwd.path.kind == bwd.path.kind == "nvlink" and fwd.time_s == bwd.time_s > 0
    st = step_time(plan)
    t = fwd.time_s
    expected = 8 * 32 * (2 * t + 2 * t)
    assert expected == pytest.approx(fwd.time_s * fwd.per_step + bwd.time_s * bwd.per_step, rel=1e-12)
    assert st.exposed_s["sq"] == pytest.approx(expected, rel=1e-9)
    assert not any("not simulated" in n for n in st.notes)
    # its calls are on the sq stream of the trace: 4 per layer and micro-batch, each t long
    calls = [e for e in st.trace_events(stage=0) if e.stream == "sq"]
    assert len(calls) == 8 * 32 * 4 and all(e.dur_s == pytest.approx(t, rel=1e-9) for e in calls)
    # and the step is no shorter than with the rows left out of the timeline, longer by at most
    # what the compute waited on sq: the FSDP gathers, exposed here, run during those waits (less
    # exposed fsdp). Here not longer at all: the FSDP stream bounds the step (its calls, with
    # torchtitan's units the embedding's re-gather in every backward, fill 1.350 of its 1.356 s)
    monkeypatch.setitem(AXES, "sq", replace(TOY, timeline=None))
    without = step_time(plan)
    assert without.step_s <= st.step_s <= without.step_s + expected
    # tp's exposure is unchanged (the same per-unit waits, summed over units in the step's order: to the last bits)
    assert st.exposed_s["fsdp"] < without.exposed_s["fsdp"]
    assert st.exposed_s["tp"] == pytest.approx(without.exposed_s["tp"], rel=1e-12)


def test_a_timeline_is_checked_when_the_timeline_reads_it(monkeypatch):
    """A stream that a built-in axis runs on is refused (its rows would mix with tp's), and a
    slot names a row phase the timeline passes have, with a block unless overlapped."""
    monkeypatch.setitem(AXES, "sq", replace(TOY, timeline=Timeline(SQ_TIMELINE.slots, stream="tp")))
    with pytest.raises(ValueError, match="stream 'tp'"):
        timeline_axes()
    with pytest.raises(ValueError, match="overlapped needs no block"):
        Slot("backward", "all-to-all", At.OVERLAPPED, Block.ATTN)
    with pytest.raises(ValueError, match="before needs a block"):
        Slot("forward", "all-to-all", At.BEFORE)


# --- the collective kinds each axis declares against the plan's collective table ----------

_DENSE = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2}}
_MOE = {"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4}}
PLANS = [  # (base, names, shape, mesh options, training options)
    (_DENSE, ["dp_shard", "cp", "tp"], [2, 2, 4], dict(sequence_parallel=True), {}),
    (_DENSE, ["dp_replicate", "dp_shard", "tp"], [2, 2, 4], {}, dict(sharding="hsdp")),
    (_DENSE, ["pp", "dp_shard", "tp"], [2, 2, 4], dict(sequence_parallel=True), dict(sharding="zero1")),
    (_DENSE, ["dp", "tp"], [4, 4], {}, dict(sharding="none")),
    (_DENSE, ["cp", "tp"], [2, 8], {}, {}),
    (_MOE, ["dp_shard", "tp", "ep"], [4, 8, 8], dict(sequence_parallel=True), {}),
]


def _axes(mesh, name):
    if name in ("efsdp", "ep", "etp"):
        return (name,)
    try:
        return tuple(mesh.axes_of(name))
    except ConfigError:  # an axis the mesh does not have
        return None


@pytest.mark.parametrize("base,names,shape,mesh_kw,train", PLANS)
def test_every_collective_row_is_declared_by_an_axis(base, names, shape, mesh_kw, train):
    """Each row of the plan's collective table (op, phase, group) is a kind some registered
    axis declares, its group naming the same mesh axes (``fsdp`` is shown as ``dp_shard``
    when the mesh has no cp)."""
    cfg = config_from_dict({**base, "mesh": {"names": names, "shape": shape, **mesh_kw},
                            "training": {"global_batch": 32, "seq_len": 4096, **train}})
    plan = build_plan(cfg)
    assert plan.feasible, getattr(plan, "reasons", None)
    kinds = [k for a in AXES.values() for k in a.collectives]
    rows = {(r.axis, r.op, r.phase) for table in plan.collectives.values() for r in table}
    assert rows
    for axis, op, phase in rows:
        owners = [k for k in kinds if (k.op, k.phase) == (op, phase) and _axes(plan.mesh, k.group) == _axes(plan.mesh,
                                                                                                               axis)]
        assert owners, f"no registered axis declares {op} ({phase}) over {axis}"


#: Axes whose torch apply is not in parallelize's APPLY, and where it is.
APPLIED_ELSEWHERE = {Axis.PP: "pipeline stages (runtime/execution/pipelined.py)",
                     Axis.DP: "DDP on the materialized model (parallelize.apply_ddp, by the worker)",
                     Axis.DP_REPLICATE: "HSDP's replica dimension, in the dp_shard apply (fsdp_mesh)",
                     Axis.ETP: "at ep 1 etp = tp in the tp apply (moe_parallel.apply_experts_over_tp, "
                               "torchtitan's); other etp > 1 refused (buildable.unsupported_mesh)"}


def test_every_axis_has_a_runtime_apply():
    pytest.importorskip("torch")
    from meshplan.runtime.execution.parallelize import APPLY  # torch: only the runtime imports it

    assert set(APPLY) | set(APPLIED_ELSEWHERE) == set(Axis) and not set(APPLY) & set(APPLIED_ELSEWHERE)
    assert list(APPLY) == [Axis.CP, Axis.TP, Axis.EP, Axis.DP_SHARD]  # torchtitan's order
