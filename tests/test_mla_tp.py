"""Multi-head latent attention under tensor parallelism (issue 12 item 7): the collectives of
torchtitan's DeepSeek-V3 TP plan (``torchtitan/models/deepseek_v3/infra/parallelize.py``:
``wq_a``, ``wkv_a``, ``q_norm``, ``kv_norm`` NoParallel, ``wq``/``wq_b``/``wkv_b`` Colwise with
DTensor outputs, ``wo`` Rowwise), checked against what torch 2.13 issues for the runtime model
(:mod:`meshplan.runtime.execution.mla`) on the fake process group, and the rows derived by hand.

What torch issues: the attention's intermediates stay DTensors, so the gradient reaching a
replicated down projection or latent norm is Partial over tp and stays so through its backward
(no latent all-reduce; the attention input's gradient is reduced once at the block boundary, as
for dense attention); the weight gradients of those four replicated tensors are Partial, and
FSDP2 all-reduces each over tp in its gradient reduction (without FSDP the optimizer does: once
per step with the fused AdamW, 3 times with the foreach one). So per layer one all-reduce of each replicated MLA weight, its numel in
compute dtype, with or without sequence parallelism.
"""

from math import ceil, prod

import pytest

from meshplan import catalog
from meshplan.comm.collectives import collective_table
from meshplan.mesh.resolve import resolve_mesh
from meshplan.placement.assign import place
from meshplan.schedule.comm_streams import comm_kind
from meshplan.schedule.comm_times import CommTimes
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec


def _table(model, training, names, shape, sp=True):
    mesh = resolve_mesh(MeshSpec(names=list(names), shape=list(shape), sequence_parallel=sp), world=prod(shape))
    cluster = catalog.system("dgx-h100", nodes=ceil(mesh.world / 8))
    return mesh, collective_table(model, training, mesh, cluster, place(cluster, mesh.world),
                                  list(range(model.layers)), micro_batches=1)


def _mla_rows(rows):
    return {r.cadence: r for r in rows if "MLA" in r.cadence}


def test_deepseek_v2_lite_tp2_rows_by_hand():
    """DeepSeek-V2-Lite (no query compression: only wkv_a and kv_a_norm are replicated), tp 2 +
    SP x dp_shard 4, micro-batch 1, seq 4096, bf16 compute (FSDP2 gathers bf16):
    wkv_a: hidden 2048 x (kv_lora_rank 512 + qk_rope_head_dim 64) = 1,179,648 elements
           x 2 B = 2,359,296 B, one all-reduce per layer: 27 per micro-batch;
    kv_a_norm: 512 x 2 B = 1,024 B, 27 per micro-batch.
    Neither depends on micro-batch or sequence (weights, not activations)."""
    m = catalog.model("deepseek-v2-lite")
    t = TrainingSpec(global_batch=8, seq_len=4096, micro_batch=1, param_dtype="fp32", compute_dtype="bf16")
    mesh, rows = _table(m, t, ("dp_shard", "tp"), (4, 2))
    mla = _mla_rows(rows)
    assert sorted(mla) == ["every layer (MLA kv_a_norm weight gradient)", "every layer (MLA wkv_a weight gradient)"]
    wkv_a, norm = mla["every layer (MLA wkv_a weight gradient)"], mla["every layer (MLA kv_a_norm weight gradient)"]
    assert wkv_a.size_bytes == 2048 * (512 + 64) * 2 == 2_359_296
    assert norm.size_bytes == 512 * 2 == 1_024
    for r in (wkv_a, norm):
        assert (r.axis, r.phase, r.op, r.dtype, r.group_size) == ("tp", "backward", "all-reduce", "bf16", 2)
        assert r.per_microbatch == r.per_step == 27 and r.example_ranks == (0, 1)
        assert comm_kind(r) == "tp_async"  # overlapped on the tp stream, after each layer's backward
    # the same at another sequence length and micro-batch, and without SP
    t2 = t.model_copy(update={"seq_len": 1024, "micro_batch": 2, "global_batch": 16})
    _, rows2 = _table(m, t2, ("dp_shard", "tp"), (4, 2), sp=False)
    assert {c: r.size_bytes for c, r in _mla_rows(rows2).items()} == {c: r.size_bytes for c, r in mla.items()}
    # tp 1: no such row; nor under framework megatron (Megatron-Core's MLA split is not modelled)
    _, rows1 = _table(m, t, ("dp_shard",), (8,))
    assert _mla_rows(rows1) == {}
    _, rows_mg = _table(m, t.model_copy(update={"framework": "megatron"}), ("dp_shard", "tp"), (4, 2))
    assert _mla_rows(rows_mg) == {}


def test_deepseek_v2_query_compression_adds_wq_a_and_its_norm():
    """DeepSeek-V2 (q_lora_rank 1536), tp 8: wq_a 5120 x 1536 x 2 B = 15,728,640 B,
    q_a_norm 1536 x 2 B = 3,072 B, wkv_a 5120 x 576 x 2 B = 5,898,240 B, kv_a_norm 1,024 B;
    on a 4-layer slice each appears 4 times per micro-batch."""
    m = catalog.model("deepseek-v2").model_copy(update={"layers": 4})
    t = TrainingSpec(global_batch=8, seq_len=4096, param_dtype="fp32", compute_dtype="bf16")
    _, rows = _table(m, t, ("dp_shard", "tp"), (2, 8))
    got = {c.split("MLA ")[1].split(" ")[0]: (r.size_bytes, r.per_microbatch) for c, r in _mla_rows(rows).items()}
    assert got == {"wq_a": (15_728_640, 4), "q_a_norm": (3_072, 4), "wkv_a": (5_898_240, 4), "kv_a_norm": (1_024, 4)}


@pytest.mark.parametrize("impl, per_step", [("fused", 2), ("foreach", 6)])
def test_without_fsdp_the_optimizer_reduces_them_at_each_read(impl, per_step):
    """tp 2 alone (no FSDP2 to reduce them in backward): the optimizer all-reduces each Partial
    gradient at each op that reads it (the SP norms' convention, comm.tp_grads.PARTIAL_GRAD_READS):
    the fused AdamW once, 2 layers x 1 = 2 per step; the foreach one 3 times, 2 x 3 = 6."""
    m = ModelSpec(name="tiny-mla", layers=2, hidden=64, ffn=128, q_heads=4, vocab=256, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    t = TrainingSpec(global_batch=1, seq_len=16, param_dtype="fp32", compute_dtype="fp32", optimizer_impl=impl)
    _, rows = _table(m, t, ("tp",), (2,))
    mla = _mla_rows(rows)
    assert {(r.phase, r.size_bytes, r.per_microbatch, r.per_step) for r in mla.values()} == {
        ("step", 64 * 20 * 4, 0, per_step), ("step", 16 * 4, 0, per_step)}


def test_the_rank_timeline_runs_them_on_the_tp_stream():
    """CommTimes puts each MLA row's seconds per layer into the overlapped tp collectives
    (async_s: per layer, the sum of the time of every replicated-weight all-reduce), so the
    step model schedules them after each layer's backward; none is left unsimulated."""
    m = catalog.model("deepseek-v2-lite")
    t = TrainingSpec(global_batch=8, seq_len=4096, param_dtype="fp32", compute_dtype="bf16")
    _, rows = _table(m, t, ("dp_shard", "tp"), (4, 2))
    comm = CommTimes.from_rows(rows, layers=m.layers)
    assert comm.other == ()
    per_layer = sum(r.time_s * r.per_microbatch for r in rows if comm_kind(r) == "tp_async") / m.layers
    mla = sum(r.time_s for r in _mla_rows(rows).values())
    assert comm.async_s == pytest.approx(per_layer) and mla > 0
    assert comm.async_s > mla  # plus the two SP norms' and the router's


def test_replicated_weight_gradients_do_not_take_the_blocking_tp_slot():
    """comm_kind sends every "weight gradient" row to the overlapped tp kind: without SP the
    blocking per-layer backward all-reduce keeps the b*s*h activation's time (before, the MoE
    router's gradient row, added after it, overwrote that key with its own, smaller time)."""
    m = catalog.model("deepseek-v2-lite")
    t = TrainingSpec(global_batch=8, seq_len=4096, param_dtype="fp32", compute_dtype="bf16")
    _, rows = _table(m, t, ("dp_shard", "tp"), (4, 2), sp=False)
    act = [r for r in rows if (r.axis, r.phase, r.op, r.size_bytes) == ("tp", "backward", "all-reduce", 4096 * 2048 * 2)]
    router = [r for r in rows if "router" in r.cadence]
    assert len(act) == 1 and len(router) == 1 and comm_kind(router[0]) == "tp_async"
    assert CommTimes.from_rows(rows, layers=m.layers).get("tp", "backward", "all-reduce") == act[0].time_s


def test_the_step_counts_the_mla_gradient_all_reduces(no_host_pace):
    """The step model of a DeepSeek-V2-Lite plan (tp 2 + SP x dp_shard 4, 2 micro-batches)
    against the same plan without the MLA rows: the all-reduces run on the tp stream right
    after each layer's backward, beside FSDP2's copy-in of that layer's reduce-scatter on the
    compute stream (comm/fsdp2.py), which is longer than both (the dense layer's and the MoE
    layer's, experts included at ep 1 under torch, against the two all-reduces): they
    are hidden there, so the tp stream's exposed time is unchanged, and the step still grows
    (their SM share slows the copy-ins and the compute beside them)."""
    import dataclasses

    from meshplan.config import config_from_dict
    from meshplan.plan import Plan, build_plan
    from meshplan.schedule.steptime import step_time

    cfg = config_from_dict({"model": {"catalog": "deepseek-v2-lite"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "recompute": "full"},
                            "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2], "sequence_parallel": True}})
    plan = build_plan(cfg)
    assert isinstance(plan, Plan) and plan.micro_batches == 2
    mla = [r for rs in plan.collectives.values() for r in rs if "MLA" in r.cadence]
    assert len(mla) == 2 and all(r.per_step == 27 * 2 for r in mla)
    without = dataclasses.replace(plan, collectives={k: [r for r in rs if "MLA" not in r.cadence]
                                                     for k, rs in plan.collectives.items()})
    st, st0 = step_time(plan), step_time(without)
    assert not [n for n in st.notes if "not simulated" in n]
    rows = plan.collectives[next(iter(plan.collectives))]
    layer = sorted(r.copy_s for r in rows if r.op == "reduce-scatter" and r.cadence == "every layer")
    # under torch at ep 1 the experts are split over tp (etp = tp, torchtitan b5bcd76
    # moe_sharding.py) and sharded with their block: no efsdp row, one copy-in per layer
    # (the dense layer's and the MoE layer's, experts included)
    assert not [r for r in rows if r.op == "reduce-scatter" and r.axis == "efsdp"]
    assert len(layer) == 2
    assert sum(r.time_s for r in mla) < layer[0]
    assert st.exposed_s["tp"] == pytest.approx(st0.exposed_s["tp"])
    assert st0.step_s < st.step_s


# Torch's own collectives: the runtime model's MLA with the tp plan, one step on the fake
# process group (one process stands in for `rank`), counted by (axis, phase, op, bytes, dtype)
# against the table.
TINY = dict(name="tiny-mla", layers=2, hidden=64, ffn=128, q_heads=4, vocab=256, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
# the dry run's runtime runs all-gather CP (meshplan.runtime.execution.cp): cp_attention = "allgather"
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", reduce_dtype="fp32", recompute="none", cp_attention="allgather")
CASES = {  # q_lora_rank, mesh names, shape, SP, training changes, rank
    "V2-Lite-like tp2+SP x dp_shard2": (None, ("dp_shard", "tp"), (2, 2), True, {}, 1),
    "V2/V3-like (q latent) tp2+SP x dp_shard2": (24, ("dp_shard", "tp"), (2, 2), True, {}, 3),
    "q latent tp2 no SP x dp_shard2": (24, ("dp_shard", "tp"), (2, 2), False, {}, 2),
    "q latent tp2 alone (optimizer reduces)": (24, ("tp",), (2,), True, {}, 1),
    "q latent tp2 alone, foreach AdamW": (24, ("tp",), (2,), True, {"optimizer_impl": "foreach"}, 1),
    "full recompute tp2+SP x dp_shard2": (24, ("dp_shard", "tp"), (2, 2), True, {"recompute": "full"}, 0),
    "bf16 gathers tp2+SP x dp_shard2": (24, ("dp_shard", "tp"), (2, 2), True, {"compute_dtype": "bf16"}, 1),
    "cp2 x tp2+SP": (24, ("cp", "tp"), (2, 2), True, {}, 1),
    "cp2 x dp_shard2, full recompute": (None, ("dp_shard", "cp"), (2, 2), False, {"recompute": "full"}, 2),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_table_matches_torch_for_mla(name):
    pytest.importorskip("torch")
    from meshplan.runtime.validation.compare import differences, tally_records, tally_table
    from meshplan.runtime.validation.dryrun import dry_run

    cq, names, shape, sp, extra, rank = CASES[name]
    model = ModelSpec(**TINY, q_lora_rank=cq)
    training = TrainingSpec(**{"global_batch": 8, "seq_len": 16, **FP32, **extra})
    mesh, rows = _table(model, training, names, shape, sp)
    run = dry_run(model, training, mesh, rank=rank, mixed_precision=training.compute_dtype != "fp32")
    assert run.group_differences == []
    recorded = tally_records(run.records, mesh, rank)
    assert differences(recorded, tally_table(rows, mesh, rank)) == []
    size = 2 if training.compute_dtype == "bf16" else 4
    cp = mesh.degree("cp")
    if cp > 1:  # K (d_qk 8 + 4) and V (d_v 8) of the local heads in one buffer, 16 tokens: b s a/tp (12 + 8),
        kv = 16 * (4 // mesh.degree("tp")) * 20 * size  # one per layer, replayed by full recompute
        assert recorded[("cp", "forward", "all-gather", kv, "fp32")] == 2
        assert recorded[("cp", "backward", "all-gather", kv, "fp32")] == (2 if training.recompute == "full" else 0)
        assert recorded[("cp", "backward", "reduce-scatter", kv, "fp32")] == 2
    if mesh.degree("tp") == 1:
        return
    # the MLA rows are really there: one all-reduce of each replicated weight per layer
    # (wkv_a: 64 x (16 + 4) elements), 2 layers; without FSDP in the step, once per layer by the
    # fused AdamW, 3 per layer by the foreach one (its lerp_ and addcmul_ reads)
    reads = 3 if training.optimizer_impl == "foreach" else 1
    phase, n = ("step", reads * 2) if mesh.degree("fsdp") == 1 else ("backward", 2)
    dt = training.compute_dtype
    assert recorded[("tp", phase, "all-reduce", 64 * 20 * size, dt)] == n
    assert recorded[("tp", phase, "all-reduce", 16 * size, dt)] == n  # kv_a_norm
    if cq:
        assert recorded[("tp", phase, "all-reduce", 64 * 24 * size, dt)] == n  # wq_a
        assert recorded[("tp", phase, "all-reduce", 24 * size, dt)] == n  # q_a_norm


MLA_TP2 = __import__("pathlib").Path(__file__).parent / "data" / "validate_deepseek_v2_lite_tp2sp.toml"
MLA_PP2 = MLA_TP2.parent / "validate_deepseek_v2_lite_pp2_tp2sp.toml"
MLA_CP2 = MLA_TP2.parent / "validate_dense_mla_cp2_tp2sp.toml"


def shared_validate_runs() -> dict:
    """This file's ``validate`` runs (2 layers, seq 32, vocab 512, 1 timed step, no probe), each in
    the shared launch of its world (tests/conftest.py ``world2_runs``/``world4_runs``/``world8_runs``,
    tests/validate_runs.py): DeepSeek-V2-Lite at tp 2 (world 2), at pp 2 x dp_shard 2 x tp 2
    with 2 micro-batches (world 8), the dense MLA model at cp 2 x tp 2 (world 4)."""
    pytest.importorskip("torch")
    from meshplan.runtime.validation.validate import Options

    def opt(world: int, timeout_s: float, **kw):
        return Options(worlds=(world,), layers=2, seq_len=32, vocab=512, steps=1, timeout_s=timeout_s, probe=False,
                       **kw)

    return {"mla_tp2": (MLA_TP2, opt(2, 200)), "mla_pp2": (MLA_PP2, opt(8, 280, micro_batches=2)),
            "mla_cp2": (MLA_CP2, opt(4, 200))}


@pytest.mark.slow
def test_validate_runs_deepseek_v2_lite_at_tp2_and_matches_the_plan(world2_runs):
    """`meshplan validate` of DeepSeek-V2-Lite (scaled: hidden 2048 / 8 = 256, kv_lora_rank
    512 / 8 = 64, qk_rope_head_dim 64 / 8 = 8, 2 layers: one dense, one MoE) at tp 2 + SP on
    2 gloo ranks (the shared 2-rank launch): every rank's collectives equal the plan's table, with the
    MLA rows: dp 1, so no FSDP2 reduces the Partial gradients of wkv_a (256 x (64 + 8) x 4 B =
    73,728 B) and kv_a_norm (64 x 4 B = 256 B) and the fused AdamW (the default optimizer_impl)
    all-reduces each once per step, 2 layers x 1 = 2 (6 with the foreach AdamW's 3 reads). The losses of both steps equal the unsplit model's (each tp rank
    routes its own half of the sequence through the experts)."""
    import json

    from tests.test_validate_moe import _reference_losses

    run = world2_runs["mla_tp2"]
    code, res, out = run.code, run.results, run.out
    assert code == 0, res[0]["message"]
    comp = res[0]["comparison"]
    assert comp["differences"] == [] and comp["group_differences"] == {}
    rows = comp["collectives"]
    assert all(row[f"rank{r}"] == row["meshplan"] for row in rows for r in range(2))
    tp = {(row["phase"], row["op"], row["size_bytes"]): row["meshplan"] for row in rows if row["axis"] == "tp"}
    assert tp[("step", "all-reduce", 256 * (64 + 8) * 4)] == 2  # wkv_a
    assert tp[("step", "all-reduce", 64 * 4)] == 2  # kv_a_norm
    ref = _reference_losses(out / "world2" / "plan.json", 2, token_split=2)
    for step, kind in enumerate(("recorded", "memory")):
        got = [next(s["loss"] for s in json.loads((out / "world2" / f"rank{r}" / "timings.json").read_text())["steps"]
                    if s["kind"] == kind) for r in range(2)]
        assert got == pytest.approx(ref[step], rel=1e-5), (kind, got, ref[step])


@pytest.mark.slow
def test_validate_runs_mla_on_two_pipeline_stages(world8_runs):
    """pp 2 x dp_shard 2 x tp 2 + SP, 2 micro-batches (8 gloo ranks, the shared 8-rank launch): the
    collectives of every rank equal the plan's table. Under pp the MLA weight gradients are
    reduced by FSDP2 once per step (PipelineStage turns gradient sync off for every backward
    but the last), one per layer of the stage: wkv_a 256 x 72 x 4 B = 73,728 B, once on
    each stage (one layer each)."""
    code, res = world8_runs["mla_pp2"].code, world8_runs["mla_pp2"].results
    assert code == 0, res[0]["message"]
    comp = res[0]["comparison"]
    assert comp["differences"] == [] and comp["group_differences"] == {}
    rows = comp["collectives"]
    assert all(row[f"rank{r}"] == row[f"meshplan_rank{r}"] for row in rows for r in range(8))
    wkv_a = [row for row in rows if row["axis"] == "tp" and row["size_bytes"] == 256 * 72 * 4]
    assert [(w["phase"], w["op"], [w[f"rank{r}"] for r in range(8)]) for w in wkv_a] == [
        ("backward", "all-reduce", [1] * 8)]


@pytest.mark.slow
def test_validate_runs_mla_with_cp2_tp2_and_matches_the_reference(world4_runs):
    """A dense MLA model (scaled: hidden 1024 / 4 = 256, q_lora_rank 96, kv_lora_rank 64,
    d_qk 16 + 8, d_v 16), cp 2 x tp 2 + SP on 4 gloo ranks (the shared launch): collectives equal the
    table, and each rank's losses of two steps equal the unsplit model's on its own chunks
    (``tests/test_validate_cp.py``'s reference): checks the K/V buffer of two head dims,
    the global rotary positions of the shared RoPE key and the causal mask across chunks.
    The K/V all-gather: 32 tokens x 4 local heads x (24 + 16) x 4 B = 20,480 B per layer."""
    from tests.test_validate_cp import _check, _run

    out, res = _run(world4_runs, "mla_cp2")
    # activations' maximum within 2% as the non-MLA cp runs (tests/test_validate_cp.py): the plan 525,648 B
    # against FSDPMemTracker's 526,508 (+0.16%). Per layer 238,080 B (tests/test_mla.py derives each term):
    # the 207,616 the plan counted before (464,720 B, 13.3% under) less v (32 x 4 x 16 x 4 = 8,192) and the
    # flash statistics (4 x 16 x 4 = 256), plus v's gathered buffer (32 x 4 x (24 + 16) x 4 = 20,480), the
    # math SDPA's softmax output (4 x 16 x 32 x 4 = 8,192: torch's CPU flash kernel needs d_qk == d_v) and
    # the latent norms' x * rstd (16 x 96 x 4 + 16 x 64 x 4 = 10,240): 2 x 238,080 + 128 + 49,360 = 525,648
    rows = _check(out, res, 4, {"cp", "tp"})
    kv = 32 * 4 * (24 + 16) * 4
    cp = sorted((row["phase"], row["op"], row["meshplan"]) for row in rows
                if row["axis"] == "cp" and row["size_bytes"] == kv)
    assert cp == [("backward", "reduce-scatter", 2), ("forward", "all-gather", 2)]
    tp = {(row["phase"], row["size_bytes"]): row["meshplan"] for row in rows
          if row["axis"] == "tp" and row["op"] == "all-reduce"}
    assert tp[("backward", 256 * 96 * 4)] == tp[("backward", 256 * (64 + 8) * 4)] == 2  # wq_a, wkv_a
