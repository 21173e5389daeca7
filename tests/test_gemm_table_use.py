"""step --gemm-table says what the table timed: how many of the plan's GEMM shapes, the others'
source, and a warning when it times none (another dtype, another mesh's shapes) or was measured
on the CPU (meshplan.compute.table_use)."""

from __future__ import annotations

import json

from cli_run import plan_file, run_main
from meshplan.compute.gemm import load_gemm_table
from meshplan.compute.table_use import table_use, use_warnings
from meshplan.schedule.workload import plan_ops

MINI = "examples/mini_2x4_tp4-dp2.toml"

# Llama-3-8B (hidden 4096, 32 heads of 128, 8 KV heads, FFN 14336, vocabulary 128256) at tp 4,
# micro-batch 1, seq 8192 (SP: each GEMM sees all 8192 tokens): forward (M tokens, N out / tp, K in)
# wq 8192x1024x4096, wk = wv 8192x256x4096, wo 8192x4096x1024, w1 = w3 8192x3584x4096,
# w2 8192x4096x3584, output 8192x32064x4096; data gradient (M, K, N), weight gradient (N, K, M).
FORWARD = [(8192, 1024, 4096), (8192, 256, 4096), (8192, 4096, 1024), (8192, 3584, 4096), (8192, 4096, 3584),
           (8192, 32064, 4096)]
SHAPES = sorted({s for m, n, k in FORWARD for s in ((m, n, k), (m, k, n), (n, k, m))})


def _csv(path, shapes, dtype, device="cpu (1 thread)", seconds=0.01):
    rows = "".join(f"{m},{n},{k},{dtype},{seconds},,{device},2.13.0+cpu\n" for m, n, k in shapes)
    path.write_text("m,n,k,dtype,seconds,tflops,device,torch\n" + rows)
    return path


def test_hand_derived_shapes_are_the_steps_lookups(tmp_path):
    assert len(SHAPES) == 14  # 6 forward + 2 new data-gradient + 6 weight-gradient shapes
    p = plan_file(MINI)
    gpu = p.config.cluster.gpu
    full = load_gemm_table(_csv(tmp_path / "bf16.csv", SHAPES, "bf16"))
    u = table_use(plan_ops(p, full), full, gpu)
    assert [g[:3] for g in u.gemm_shapes] == SHAPES and {g[3] for g in u.gemm_shapes} == {"bf16"}
    assert (u.matched, u.sources) == (14, ())
    assert use_warnings(u, gpu) == [f"--gemm-table {full.path} was measured on the CPU, not on the plan's "
                                    "h100-sxm5-80gb: its 14 GEMM shapes time that CPU's compute in this step; run "
                                    "`meshplan bench gemm CONFIG` on the GPU"]
    # 0.1 ms a call: wq 2 x 8192 x 1024 x 4096 / 1e-4 = 687.2 TFLOP/s, wk 171.8, under the ceiling
    # (989.4 x 0.803 = 794.5) and above 1% of the shape model's rate (770.4 and 385.2 TFLOP/s:
    # meshplan.compute.rate_check); 10 ms would be 100x under the model's: a warning since nc54 #2
    two = load_gemm_table(_csv(tmp_path / "two.csv", FORWARD[:2], "bf16", device="NVIDIA H100 80GB HBM3",
                               seconds=1e-4))
    u = table_use(plan_ops(p, two), two, gpu)
    assert (u.matched, u.sources) == (2, (("catalog", 12),)) and use_warnings(u, gpu) == []
    a100 = load_gemm_table(_csv(tmp_path / "a100.csv", FORWARD[:2], "bf16", device="NVIDIA A100-SXM4-80GB",
                                seconds=1e-4))
    assert use_warnings(table_use(plan_ops(p, a100), a100, gpu), gpu) == [
        f"--gemm-table {a100.path} was measured on NVIDIA A100-SXM4-80GB, torch 2.13.0+cpu, which is not named as "
        "the plan's h100-sxm5-80gb (h100): its 2 GEMM shapes time that device in this step; run `meshplan bench "
        "gemm CONFIG` on the plan's GPU"]


def test_a_table_that_times_none_says_why(tmp_path):
    p = plan_file(MINI)
    gpu = p.config.cluster.gpu
    fp32 = load_gemm_table(_csv(tmp_path / "fp32.csv", SHAPES, "fp32"))
    u = table_use(plan_ops(p, fp32), fp32, gpu)
    assert (u.matched, u.sources) == (0, (("catalog", 14),))
    [w] = use_warnings(u, gpu)
    assert "times none of the plan's 14 GEMM shapes (it holds fp32 rows and the plan's GEMMs run in bf16)" in w
    assert "--dtype bf16" in w and "--kernels" in w
    other = load_gemm_table(_csv(tmp_path / "other.csv", [(16384, 1024, 4096)], "bf16"))
    [w] = use_warnings(table_use(plan_ops(p, other), other, gpu), gpu)
    assert "(its shapes are not this mesh's)" in w


def test_step_names_the_table(tmp_path, capsys):
    assert run_main("step", MINI) == 0
    plain = capsys.readouterr().out.splitlines()
    assert "kernels: catalog" in plain
    fp32 = _csv(tmp_path / "fp32.csv", SHAPES, "fp32")
    assert run_main("step", MINI, "--gemm-table", fp32, "--json", tmp_path / "a.json") == 0
    got = capsys.readouterr()
    out = got.out.splitlines()
    assert out[0] == plain[0]  # the step is the catalog's
    assert f"kernels: catalog; GEMMs first from --gemm-table {fp32} (0 of 14 shapes)" in out
    assert (f"gemm table: {fp32} (14 GEMM rows, fp32, measured on cpu (1 thread), torch 2.13.0+cpu): 0 of the plan's "
            "14 GEMM shapes (bf16) timed from it (exact shape and dtype; a table is not interpolated), 14 from the "
            "catalog's h100-sxm5-80gb points, interpolated") in out
    assert got.err.startswith(f"warning: --gemm-table {fp32} times none of the plan's 14 GEMM shapes")
    doc = json.loads((tmp_path / "a.json").read_text())["kernels"]["gemm_table"]
    assert (doc["matched"], doc["plan_gemm_shapes"], doc["others"]) == (0, 14, {"catalog": 14})
    bf16 = _csv(tmp_path / "bf16.csv", SHAPES, "bf16")
    assert run_main("step", MINI, "--gemm-table", bf16) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"kernels: catalog; GEMMs first from --gemm-table {bf16} (14 of 14 shapes)" in out
    assert out[0] != plain[0]  # 10 ms a GEMM: the table's times are the step's


def test_attention_rows_are_counted(tmp_path):
    """A bench attention row of the mini plan's call: batch 1, 32 / tp 4 = 8 q heads, 8 / 4 = 2 KV
    heads, seq 8192, head_dim 128, bf16; the same row at seq 4096 matches none."""
    p = plan_file(MINI)
    gpu = p.config.cluster.gpu
    row = {"op": "attention", "batch": 1, "q_heads": 8, "kv_heads": 2, "seq_q": 8192, "seq_kv": 8192,
           "head_dim": 128, "dtype": "bf16", "forward_s": 0.001, "backward_s": 0.0025}
    for seq, matched in ((8192, 1), (4096, 0)):
        path = tmp_path / f"att{seq}.json"
        path.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0",
                                    "rows": [{**row, "seq_q": seq, "seq_kv": seq}]}))
        t = load_gemm_table(path)
        u = table_use(plan_ops(p, t), t, gpu)
        assert (u.rows, u.attention_rows, u.attention_calls, u.attention_matched) == (0, 1, 1, matched)
        warned = [w for w in use_warnings(u, gpu) if "attention row" in w]
        assert warned == ([] if matched else [
            f"--gemm-table {path}: its 1 attention row matches none of the plan's 1 attention call (batch, heads, "
            "sequence, head_dim and dtype must all match), so attention is the catalog's; write it with `meshplan "
            "bench attention CONFIG`"])
