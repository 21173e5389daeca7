"""compare's (M,N,K) eff rows are each GEMM's efficiency as the step times it (newcomer trial 17:
every row of the mini pair showed 78%, the shape model's tile and wave quantization at the 80.3%
ceiling, 97% wave quantization for each of these shapes, while the step timed them from the
catalog's H100 points at 53-74%)."""

from __future__ import annotations

import pytest

from cli_run import plan_file, run_main
from meshplan.compare import compare, gemm_basis, table_rows
from meshplan.compute.gemm import gemm_model, gemm_time

A, B = "examples/mini_2x4_tp4-dp2.toml", "examples/mini_2x4_tp2-dp4.toml"


def test_rows_are_the_steps_efficiencies():
    c = compare(plan_file(A), plan_file(B))
    gpu = c.a.plan.config.cluster.gpu
    for side in (c.a, c.b):
        for name, m, n, k, eff in side.gemms:
            assert eff == gemm_time(gpu, m, n, k, "bf16").efficiency  # the step's source, not the shape model's
    rows = dict((q, (x, y)) for q, x, y in table_rows(c))
    # wk's N = 8 KV heads x 128 / tp 4 = 256: Shepard-interpolated (log2 M, N, K) from S4's 2048x512x4096
    # 455.7, 2048x1024x4096 659.1, 4096x2048x4096 764.1 and 1024x512x1024 141.9 TFLOP/s: 523.9 = 53.0% of 989.4
    assert rows["wk (M,N,K) eff"] == ("(8192,256,4096) 53%", "(8192,512,4096) 61%")
    assert rows["wq (M,N,K) eff"] == ("(8192,1024,4096) 66%", "(8192,2048,4096) 74%")
    # the shape model alone (the old rows): 64 x 2 = 128 tiles of 128x128 in one wave of 132 SMs, 97.0% wave
    # quantization x the 80.3% ceiling = 77.9%
    assert round(gemm_model(gpu, 8192, 256, 4096).efficiency, 3) == 0.779
    assert len({x for pair in rows.values() for x in pair if x.endswith("%")}) > 2
    assert gemm_basis(c) == ("(M,N,K) eff: forward GEMM FLOP/s over the 989 TFLOP/s bf16 dense peak, as the step "
                             "times it: the catalog's h100-sxm5-80gb bf16 points, interpolated")


def test_compare_prints_the_basis(tmp_path, capsys):
    assert run_main("compare", A, B, "--out", tmp_path / "cmp") == 0
    out = capsys.readouterr().out
    assert "(M,N,K) eff: forward GEMM FLOP/s over the 989 TFLOP/s bf16 dense peak" in out
    assert "(8192,256,4096) 53%" in out


def test_fused_qkv_lines_up_with_q_k_v_apart():
    """torch runs wq, wk, wv as three GEMMs, Megatron-LM as one fused qkv: no row named alike, so
    the table had no Q/K/V row. Now one row holds the projection on both sides. Llama-3-8B (h 4096,
    8 KV heads of 128) at tp 2, 4,096 tokens per micro-batch (SP gathers the sequence before the
    projection): 2 x tokens x h x (h + 2 x kv_heads x head_dim) / tp = 2 x 4096 x 4096 x (4096 +
    2048) / 2 = 103.1 GFLOP on each side; torch's efficiency is the three GEMMs' FLOP over their
    summed FLOP / efficiency (the time they take, at one peak)."""
    import jsonschema

    from meshplan.compare.output import compare_to_dict
    from meshplan.config import config_from_dict
    from meshplan.plan import build_plan
    from meshplan.report.json_docs import schema_of
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                         "recompute": "none"},
            "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2], "sequence_parallel": True}}
    torch = build_plan(config_from_dict(base))
    mega = build_plan(config_from_dict({**base, "training": {**base["training"], "framework": "megatron"}}))
    c = compare(torch, mega, names=("torch", "megatron"))
    hand = 2 * 4096 * 4096 * (4096 + 2 * 8 * 128) / 2
    assert hand == 103_079_215_104
    row = {r[0]: r[1:] for r in compare_to_dict(c)["table"]}
    a, b = row["Q, K, V projection (one fused qkv GEMM, or wq + wk + wv summed): FLOP, efficiency"]
    assert (a["gemms"], a["flop"]) == ("wq+wk+wv", hand) and (b["gemms"], b["flop"]) == ("qkv", hand)
    # torch's three: wq (4096, 2048, 4096), wk and wv (4096, 512, 4096), 4 : 1 : 1 of the FLOP
    eff = {g[0]: g[4] for g in c.a.gemms}
    assert [g[1:4] for g in c.a.gemms if g[0] in ("wq", "wk", "wv")] == [(4096, 2048, 4096), (4096, 512, 4096),
                                                                          (4096, 512, 4096)]
    assert a["efficiency"] == pytest.approx(6 / (4 / eff["wq"] + 1 / eff["wk"] + 1 / eff["wv"]), rel=1e-12)
    assert b["efficiency"] == {g[0]: g[4] for g in c.b.gemms}["qkv"]  # one GEMM: its own row's
    text = dict((q, (x, y)) for q, x, y in table_rows(c))["Q,K,V projection GFLOP eff"]
    assert text == (f"wq+wk+wv: 103.1 GFLOP at {a['efficiency']:.0%}", f"qkv: 103.1 GFLOP at {b['efficiency']:.0%}")
    assert list(jsonschema.Draft202012Validator(schema_of("compare")).iter_errors(compare_to_dict(c))) == []
    # the same framework on both sides: the GEMMs share their names, no projection row
    same = {r[0] for r in compare_to_dict(compare(torch, torch))["table"]}
    assert not any(q.startswith("Q, K, V projection") for q in same)
