"""compare's (M,N,K) eff rows are each GEMM's efficiency as the step times it (newcomer trial 17:
every row of the mini pair showed 78%, the shape model's tile and wave quantization at the 80.3%
ceiling, 97% wave quantization for each of these shapes, while the step timed them from the
catalog's H100 points at 53-74%)."""

from __future__ import annotations

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
