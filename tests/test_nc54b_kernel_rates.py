"""Kernel inputs checked against the GPU's peak (newcomer trial 54 #2): a --kernels point or a
--gemm-table row faster than the GPU's GEMM ceiling (dense peak x max_gemm_fraction) is a one-line
error naming the row and the units; one under 1% of the shape model's rate at its shape, or a
row whose seconds and tflops disagree, a warning. The files are the trial's (tests/data/nc54b), on H100 SXM (bf16 dense peak
989.4 TFLOP/s, max_gemm_fraction 0.803: ceiling 794.5 TFLOP/s, gpus.toml)."""

from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.gemm import load_gemm_table
from meshplan.compute.kernel_fragment import with_kernel_files
from meshplan.compute.rate_check import kernel_file_rates, table_rates
from meshplan.errors import ConfigError
from tests.cli_run import run_captured

DATA = Path(__file__).resolve().parent / "data" / "nc54b"
JOB = DATA / "job70b.toml"  # Llama-3-70B, 32 x dgx-h100, dp_shard 32 x tp 8
H100 = catalog.gpu("h100-sxm5-80gb")


def test_gflops_kernels_file_is_refused_naming_its_first_point():
    """bad_kernels_gflops.toml's first bf16 point [8192, 1024, 8192, 620000.0] is GFLOP/s written
    as TFLOP/s: 620,000 TFLOP/s against the ceiling 989.4 x 0.803 = 794.5 (x 1.02 noise margin
    = 810.4). The error names the point, the ceiling and the column's unit; exit 2, no step."""
    r = run_captured("step", JOB, "--kernels", DATA / "bad_kernels_gflops.toml")
    assert r.returncode == 2 and "step " not in r.stdout
    err = r.stderr.strip()
    assert err.count("\n") == 0, err
    assert "bad_kernels_gflops.toml gemm.bf16[0] 8192x1024x8192: bf16 620,000.0 TFLOP/s is above" in err
    assert "ceiling 794.5 TFLOP/s (989.4 dense peak x 0.803 max_gemm_fraction)" in err
    assert "4th column is TFLOP/s" in err


def test_a_point_at_the_ceiling_passes_and_one_past_the_margin_is_refused(tmp_path):
    """800 TFLOP/s is under 794.5 x 1.02 = 810.4 (the catalog's own best H100 bf16 point is
    764.1): accepted, no warning; 820 is over: refused. 5 TFLOP/s at 4096x4096x8192 is under 1%
    of the shape model's rate there: 512 tiles of 128x256 on 132 SMs, 4 waves (wave quantization
    512 / 528 = 97.0%), compute-bound: 989.4 x 0.803 x 512 / 528 = 770.4 TFLOP/s; 5 / 770.4 =
    0.65%: accepted with a warning naming it."""
    def frag(rate):
        path = tmp_path / f"k{rate}.toml"
        path.write_text(f'[gpu.h100-sxm5-80gb]\nsource = "t"\n[gpu.h100-sxm5-80gb.gemm]\n'
                        f'bf16 = [[4096, 4096, 4096, 400.0, "a"], [4096, 4096, 8192, {rate}, "b"]]\n')
        return path
    def rates(rate):
        gpu, warns = with_kernel_files(H100, [frag(rate)])
        return warns + kernel_file_rates(gpu, gpu.kernels)
    assert rates(800.0) == []
    with pytest.raises(ConfigError, match=r"gemm.bf16\[1\] 4096x4096x8192: bf16 820.0 TFLOP/s is above"):
        rates(820.0)
    warns = rates(5.0)
    assert len(warns) == 1 and "1 of 2 rows below 1% of the shape model's rate on h100-sxm5-80gb" in warns[0]
    assert "gemm.bf16[1] 4096x4096x8192: bf16 5.0 TFLOP/s, 0.65% of the model's 770.4 at 4096x4096x8192" in warns[0]


def test_microsecond_gemm_table_is_refused_naming_row_1():
    """bad_gemm_fast.csv row 1: 8192x1024x8192 in 2.21676e-7 s = 2 x 8192 x 1024 x 8192 /
    2.21676e-7 = 1.37439e11 / 2.21676e-7 = 6.19999e17 FLOP/s = 619,999.2 TFLOP/s > 810.4."""
    r = run_captured("step", JOB, "--gemm-table", DATA / "bad_gemm_fast.csv")
    assert r.returncode == 2
    assert "bad_gemm_fast.csv row 1 8192x1024x8192: bf16 619,999.2 TFLOP/s is above" in r.stderr
    assert "seconds per call (not ms or us)" in r.stderr


def test_millisecond_table_warns_and_disagreeing_columns_are_named():
    """bad_gemm_ms_units.csv: row 1 1.37439e11 FLOP in 0.221676 s = 0.620 TFLOP/s, 0.08% of the
    shape model's 770.4 at 8192x1024x8192 (256 tiles of 128x256 in 2 waves of 132 SMs: 989.4 x 0.803
    x 256 / 264); every row is ~1000x under its model (all 12 under 1%). bad_gemm_disagree.csv holds the same seconds with
    tflops 620: 620 / 0.620 = 1000x apart, on all 12 rows; seconds are used."""
    slow = table_rates(load_gemm_table(DATA / "bad_gemm_ms_units.csv").entries.values(), H100, "t")
    assert len(slow) == 1 and "12 of 12 rows below 1%" in slow[0]
    assert "row 1 8192x1024x8192: bf16 0.6 TFLOP/s, 0.08% of the model's 770.4 at 8192x1024x8192" in slow[0]
    both = table_rates(load_gemm_table(DATA / "bad_gemm_disagree.csv").entries.values(), H100, "t")
    assert len(both) == 2 and "12 of 12 rows give seconds and tflops more than 5% apart" in both[1]
    assert "seconds 0.221676 is 0.620 TFLOP/s, tflops 620, 1e+03x" in both[1]
    r = run_captured("step", JOB, "--gemm-table", DATA / "bad_gemm_disagree.csv")
    assert r.returncode == 0 and r.stderr.count("warning: --gemm-table") == 2


def test_agreeing_columns_of_bench_gemm_are_quiet(tmp_path):
    """A row as bench gemm writes it: 4096^3 in 2.0e-4 s = 1.37439e11 / 2e-4 = 687.2 TFLOP/s,
    its tflops column 687.2 (4 significant digits): apart by 0.003%, under 5%; under the ceiling."""
    path = tmp_path / "ok.csv"
    path.write_text("m,n,k,dtype,seconds,tflops,device,torch\n4096,4096,4096,bf16,2.0e-4,687.2,NVIDIA H100,2.13\n")
    assert table_rates(load_gemm_table(path).entries.values(), H100, "t") == []


def test_one_point_file_says_it_times_the_plans_12_shapes():
    """nc54 #14: one_point_kernels.toml's single bf16 point replaces the catalog's 21 H100 bf16
    points (kernels.toml) for all 12 of the plan's GEMM shapes. Llama-3-70B (hidden 8192, 64 heads
    and 8 KV heads of 128, FFN 28672, vocabulary 128256) at tp 8 with SP, 8192 tokens a micro-batch:
    forward (M, N, K) wq 8192x1024x8192, wk = wv 8192x128x8192, wo 8192x8192x1024, w1 = w3
    8192x3584x8192, w2 8192x8192x3584, output 8192x16032x8192 (6); data gradients (M, K, N) add
    8192x8192x128 and 8192x8192x16032 (2, the others are forward shapes); weight gradients (N, K, M)
    add 1024x8192x8192, 128x8192x8192, 3584x8192x8192, 16032x8192x8192 (4; wo's and w2's are wq's and
    w1's forward shapes): 12. plan, without the step's shapes, counts the points alone."""
    r = run_captured("step", JOB, "--kernels", DATA / "one_point_kernels.toml")
    assert r.returncode == 0
    assert (f"kernels: {DATA / 'one_point_kernels.toml'} (one hand point; bf16: 1 point for the plan's 12 bf16 GEMM "
            "shapes, in place of the catalog's 21)") in r.stdout.splitlines()
    r = run_captured("plan", JOB, "--kernels", DATA / "one_point_kernels.toml")
    assert f"kernels: {DATA / 'one_point_kernels.toml'} (one hand point; bf16: 1 point, in place of the catalog's " \
           "21)" in r.stdout.splitlines()
