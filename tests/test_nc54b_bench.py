"""bench gemm's CSV (newcomer trial 54 #11): the tflops column is written (it was empty on the
CPU), and a row scaled down by --max-elements records the M it ran at (run_m)."""

import csv
import io

import pytest

pytest.importorskip("torch")

from meshplan.compute.gemm import load_gemm_table  # noqa: E402
from meshplan.compute.shapes import Gemm  # noqa: E402
from meshplan.runtime.bench.gemm import bench, table_csv, write_table  # noqa: E402


def test_cpu_rows_carry_tflops_and_the_m_they_ran_at(tmp_path):
    """4096x64x64 with max_elements 64 x 256 runs at M = 16384 // max(K 64, N 64) = 256 and its
    time is scaled back x 4096 / 256 = 16 (bench); 64x32x48 runs whole (no run_m). tflops is
    2 M N K / seconds / 1e12 of the row's own seconds (M the table's, 4096), to 4 digits."""
    rows = bench([Gemm("big", 4096, 64, 64)], max_elements=64 * 256, backward=False, warmup=1, repeats=3)
    rows += bench([Gemm("small", 64, 32, 48)], backward=False, warmup=1, repeats=3)
    got = list(csv.DictReader(io.StringIO(table_csv(rows))))
    assert [r["run_m"] for r in got] == ["256", ""]
    for r in got:
        flop = 2 * int(r["m"]) * int(r["n"]) * int(r["k"])
        assert float(r["tflops"]) == pytest.approx(flop / float(r["seconds"]) / 1e12, rel=5e-4)
    table = load_gemm_table(write_table(rows, tmp_path / "g.csv"))  # read back: run_m is a known column
    assert table.lookup(4096, 64, 64, "fp32").tflops == float(got[0]["tflops"])


def test_device_cuda_without_a_gpu_is_one_line(tmp_path):
    """docs/commands.md's bench table (nc54 #13): --device cuda where torch sees no GPU is refused in
    one line (it was torch's 'Torch not compiled with CUDA enabled' traceback)."""
    import torch

    from tests.cli_run import run_captured
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = run_captured("bench", "gemm", "examples/mini_2x4_tp2-dp4.toml", "--device", "cuda", "--out",
                     tmp_path / "x.csv")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("error: --device: cuda, but torch") and "--device cpu" in r.stderr
