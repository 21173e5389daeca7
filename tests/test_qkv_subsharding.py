"""Framework megatron at tp past the KV heads: Megatron-LM's QKV sub-sharding (f7dfb99, read at
d98e8a6 ``megatron/core/transformer/attention.py``:353-366, :1851-1871; meshplan/spec/axes/tp_kv.py)
in memory, on a small model by hand: 4 q / 2 KV heads of 16 (h 64, GeLU MLP of 256), tp 4, seq 64,
micro-batch 1, bf16. The collective table and the timeline: tests/test_schedule_semantics.py
(``test_timeline_issues_megatrons_qkv_gathers``); the search bound: tests/test_search_settings.py."""

from __future__ import annotations

from meshplan.config import config_from_dict
from meshplan.memory.activations import layer_options, layer_terms
from meshplan.memory.layer_dims import LayerDims
from meshplan.memory.state import stage_params
from meshplan.mesh.layers import stage_layers
from meshplan.plan import build_plan

MODEL = {"layers": 4, "hidden": 64, "ffn": 256, "gated_mlp": False, "q_heads": 4, "kv_heads": 2, "vocab": 256}


def _plan(recompute: str = "none"):
    return build_plan(config_from_dict({
        "model": MODEL, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 2, "seq_len": 64, "micro_batch": 1, "sharding": "zero1", "param_dtype": "bf16",
                     "recompute": recompute, "framework": "megatron"},
        "mesh": {"names": ["dp", "tp"], "shape": [2, 4]}}))


def test_weights_hold_one_tp_th_of_wk_and_wv():
    """Per layer and rank: wq 64 x 64 / 4 = 1024, wk and wv 32 x 64 / 4 = 512 each (1/tp of the
    fused QKV's K and V rows; the copies' model held one whole head, 16 x 64 = 1024 each), wo
    1024, w_up and w_down 256 x 64 / 4 = 4096 each: 11,264; the two norms 128 (and the final norm
    64 on this one stage)."""
    plan = _plan()
    p = stage_params(plan.config.model, plan.mesh, plan.config.training, stage_layers(4, 1))[0]
    assert (p.layer_params, p.norm_params) == (4 * 11264, 4 * 128 + 64)  # and the final norm (last stage)
    torch = plan.config.training.model_copy(update={"framework": "torch"})  # the runtime's copies
    assert stage_params(plan.config.model, plan.mesh, torch, stage_layers(4, 1))[0].layer_params == 4 * 12288


def test_the_gathered_qkv_is_kept_per_layer():
    """The all-gathered fused QKV output, s 64 x b 1 x (4 + 2 x 2) x 16 x 2 B = 16,384 B, is kept
    in v's place (v, 64 x 1 x 16 x 2 = 2,048 B, is a view of it): the layer's saved bytes grow by
    14,336 B over the same layer planned without the sub-sharding."""
    plan = _plan()
    opts = layer_options(plan.mesh, plan.config.training)
    dims = LayerDims.from_model(plan.config.model, 64, 1)
    mega = {t.name: t.size_bytes for t in layer_terms(dims, **opts)}
    plain = {t.name: t.size_bytes for t in layer_terms(dims, **{**opts, "framework": "torch"})}
    assert mega["fused QKV output (all-gathered over tp; v is a view of it)"] == 64 * 8 * 16 * 2 == 16384
    assert plain["v"] == 2048 and "v" not in mega
    assert sum(mega.values()) - sum(plain.values()) == 16384 - 2048


def test_no_kv_replica_group_or_row():
    """No KV head is copied: no kv_replica group in the plan's groups, no kv_replica row."""
    plan = _plan()
    assert not [r for rows in plan.collectives.values() for r in rows if r.axis == "kv_replica"]
    assert [(r.phase, r.op, r.size_bytes) for r in plan.stage(0).collectives if "QKV sub-sharding" in r.cadence] == \
        [("forward", "all-gather", 16384), ("backward", "reduce-scatter", 16384)]


C6 = {"layers": 2, "hidden": 4096, "ffn": 16384, "q_heads": 32, "kv_heads": 4, "head_dim": 128, "vocab": 32000}


def test_c6_qkv_gemm_is_megatrons_fused_n_640():
    """Handed case C6 (32 q / 4 KV heads of 128, h 4096, tp 8, s 1024, b 1) under framework
    megatron: Megatron-LM's ``linear_qkv`` is one ColumnParallelLinear of output size (q + 2 kv) d
    (d98e8a6 attention.py:1689-1704), each rank ``divide(output_size, tp)`` of it
    (tensor_parallel/layers.py:1038): N = (32 + 2 x 4) x 128 / 8 = 640 per rank, not the 768 of
    whole local heads (wq 4 x 128 = 512 + wk 128 + wv 128, each of 4 KV heads computed on 2 ranks).
    wq 32 x 128 / 8 = 512, wk = wv = 4 x 128 / 8 = 64. Forward FLOP of the fused GEMM: 2 x M 1024
    x N 640 x K 4096 = 5,368,709,120 (768 would give 6,442,450,944, 20% more); data and weight
    gradients the same each. The step model times that one GEMM (1024 x 640 x 4096) and counts
    its FLOP once as model FLOP (no copy). The QKV bias add (a qkv_bias model) reads and writes
    tokens 1024 x 640 x 2 B: 2 x 2 x 1024 x 640 = 2,621,440 B."""
    from meshplan import catalog
    from meshplan.compute.elementwise import bias_ops
    from meshplan.compute.layer import layer_cost
    from meshplan.compute.ops import Workload
    from meshplan.compute.shapes import layer_gemms
    from meshplan.spec.model import ModelSpec

    m = ModelSpec(**C6)
    g = {x.name: x for x in layer_gemms(m, 8, 1024, framework="megatron")}
    assert [(g[n].m, g[n].n, g[n].k) for n in ("wq", "wk", "wv")] == [(1024, 512, 4096), (1024, 64, 4096), (1024, 64, 4096)]
    assert g["wq"].n + g["wk"].n + g["wv"].n == (32 + 2 * 4) * 128 // 8 == 640
    assert sum(g[n].flops for n in ("wq", "wk", "wv")) == 2 * 1024 * 640 * 4096 == 5_368_709_120
    assert [x.n for x in layer_gemms(m, 8, 1024) if x.name in ("wk", "wv")] == [128, 128]  # torch's layout: whole heads
    h100 = catalog.gpu("h100-sxm5-80gb")
    w = Workload(seq_len=1024, tp=8, fused_qkv=True, framework="megatron", recompute="none")
    qkv = [o for o in layer_cost(m, h100, w).ops if o.name.split(".")[0] in ("wq", "wk", "wv")]
    assert {o.table_key for o in qkv} == {(1024, 640, 4096, "bf16"), (1024, 4096, 640, "bf16"), (640, 4096, 1024, "bf16")}
    assert sum(o.hardware_flops for o in qkv) == sum(o.model_flops for o in qkv) == 3 * 5_368_709_120
    biased = ModelSpec(**C6, qkv_bias=True)
    add = [o for o in bias_ops(biased, h100, w, False) if o.name == "qkv bias add"]
    assert [o.size_bytes for o in add] == [2 * 2 * 1024 * 640] == [2_621_440]


def _c6_job(tmp_path, tp: int):
    """C6's model under framework megatron on one dgx-h100: dp 8 / tp x tp, s 1024, b 1."""
    from configs import job_toml
    path = tmp_path / f"c6_tp{tp}.toml"
    path.write_text(job_toml(dict(C6), training={"global_batch": 8, "seq_len": 1024, "micro_batch": 1,
                                                  "framework": "megatron"},
                             mesh={"names": ["dp", "tp"], "shape": [8 // tp, tp]}))
    return path


def test_c6_compare_rows_time_the_fused_qkv(tmp_path, capsys):
    """compare's (M,N,K) eff rows give framework megatron's Q, K and V as the step times them: one
    fused linear_qkv GEMM per rank (issue 11: they listed wq 512, wk 64 and wv 64 apart, each at its
    own, lower, efficiency). C6 at tp 8 (past the 4 KV heads, Megatron-LM's sub-sharding): M = b 1 x
    s 1024 = 1024 tokens, N = (32 + 2 x 4) x 128 / 8 = 640, K = h 4096; at tp 4 (= kv_heads, plain
    column split) N = (32 + 2 x 4) x 128 / 4 = 1280. The row's efficiency is the step's for that
    shape (gemm_time of 1024 x 640 x 4096 in bf16, the op the step model times)."""
    from cli_run import plan_file, run_cli
    from meshplan.compare import compare, table_rows
    from meshplan.compute.gemm import gemm_time

    a, b = _c6_job(tmp_path, 8), _c6_job(tmp_path, 4)
    c = compare(plan_file(a), plan_file(b))
    gpu = c.a.plan.config.cluster.gpu
    n8, n4 = (32 + 2 * 4) * 128 // 8, (32 + 2 * 4) * 128 // 4
    assert (n8, n4) == (640, 1280)
    qa, qb = (next(g for g in s.gemms if g[0] == "qkv") for s in (c.a, c.b))
    assert qa == ("qkv", 1024, n8, 4096, gemm_time(gpu, 1024, n8, 4096, "bf16").efficiency)
    assert qb[:4] == ("qkv", 1024, n4, 4096)
    assert not [g for s in (c.a, c.b) for g in s.gemms if g[0] in ("wq", "wk", "wv")]
    rows = {q: (x, y) for q, x, y in table_rows(c)}
    assert rows["qkv (M,N,K) eff"][0].startswith("(1024,640,4096) ")
    assert rows["qkv (M,N,K) eff"][1].startswith("(1024,1280,4096) ")
    assert "wk (M,N,K) eff" not in rows
    rc, out, _ = run_cli(["compare", a, b, "--out", tmp_path / "cmp"], capsys)
    assert "(1024,640,4096)" in out and "(1024,64,4096)" not in out


def test_c6_bench_gemm_times_the_fused_qkv(tmp_path, capsys):
    """bench gemm times the shapes the step model looks up in its table: C6 at tp 8 under framework
    megatron gives the fused QKV forward (M 1024, N (32 + 2 x 4) x 128 / 8 = 640, K 4096), its data
    gradient (1024, 4096, 640) and weight gradient (640, 4096, 1024) (backward_gemms: (M, K, N) and
    (N, K, M)); not wk's and wv's (1024, 64, 4096) nor their gradients (1024, 4096, 64) and (64, 4096,
    1024), which no step op looks up (wq's (1024, 512, 4096) is also wo's data gradient: wo is (1024,
    4096, 512), so it stays)."""
    import json

    import pytest
    pytest.importorskip("torch")
    from cli_run import run_cli

    rc, _, _ = run_cli(["bench", "gemm", _c6_job(tmp_path, 8), "--device", "cpu", "--max-elements", "65536",
                        "--out", tmp_path / "gemm.csv", "--json", tmp_path / "gemm.json"], capsys)
    shapes = {(r["m"], r["n"], r["k"]) for r in json.loads((tmp_path / "gemm.json").read_text())["rows"]}
    assert rc == 0 and {(1024, 640, 4096), (1024, 4096, 640), (640, 4096, 1024)} <= shapes
    assert not shapes & {(1024, 64, 4096), (1024, 4096, 64), (64, 4096, 1024)}
