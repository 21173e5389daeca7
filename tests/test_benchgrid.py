"""bench gemm --grid / bench attention --grid write kernels.toml-form tables the catalog loader
reads back; attention rows carry a dtype (issue 11 item 1)."""

from dataclasses import replace

import pytest

from meshplan import catalog
from meshplan.compute.gemm import compute_efficiency
from meshplan.compute.kernel_fragment import load_fragment, parse_fragment, with_fragment
from meshplan.compute.gemm_points import gemm_tflops
from meshplan.compute.measured import attention_row, attention_seconds, kernel_data
from meshplan.compute.shapes import Attention
from meshplan.errors import ConfigError

ROW = dict(kernel="FA3", pass_="fwd", mask="causal", head_dim=128, seq=[1024], tflops=[500.0], source="x")


def _row(**kw):
    return {("pass" if k == "pass_" else k): v for k, v in {**ROW, **kw}.items()}


def test_attention_row_dtype_defaults_to_bf16_and_is_checked():
    assert attention_row(_row()).dtype == "bf16"
    assert attention_row(_row(dtype="fp8")).dtype == "fp8"
    with pytest.raises(ValueError, match="int4"):
        attention_row(_row(dtype="int4"))
    assert {r.dtype for r in kernel_data("h100-sxm5-80gb").attention} == {"bf16"}  # catalog rows: no dtype


def test_attention_seconds_takes_the_rows_of_its_dtype():
    d = kernel_data("h100-sxm5-80gb")
    fp8 = attention_row(_row(dtype="fp8", tflops=[1000.0]))
    fp8_bwd = attention_row(_row(dtype="fp8", pass_="bwd", mask="any", tflops=[800.0]))
    d = replace(d, attention=(fp8, fp8_bwd) + d.attention)
    a = Attention(batch=1, q_heads=32, kv_heads=8, seq_q=1024, seq_kv=1024, head_dim=128)
    flops = 4 * 1024 * 1024 * 32 * 128 / 2  # causal half
    f, b, how = attention_seconds(d, a, dtype="fp8")
    assert f == pytest.approx(flops / 1000e12) and b == pytest.approx(2.5 * flops / 800e12)
    assert "FA3 fp8 fwd causal d128 1000" in how
    f16, _, _ = attention_seconds(d, a)  # bf16: the catalog's S7c FA3 causal d128 row, 423 at S 1024
    assert f16 == pytest.approx(flops / 423e12)


def test_fragment_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"gpu.x.source"):
        parse_fragment({"gpu": {"x": {"gemm": {"bf16": [[1, 1, 1, 1.0, "k"]]}}}})
    with pytest.raises(ConfigError, match=r"gpu.x.gemm.bf16\[0\]"):
        parse_fragment({"gpu": {"x": {"source": "s", "gemm": {"bf16": [[1, 1, 1.5]]}}}})
    with pytest.raises(ConfigError, match=r"gpu.x.attention.rows\[0\].*int4"):
        parse_fragment({"gpu": {"x": {"source": "s", "attention": {"rows": [_row(dtype="int4")]}}}})
    (tmp_path / "bad.toml").write_text("[gpu\n")
    with pytest.raises(ConfigError, match="not TOML"):
        load_fragment(tmp_path / "bad.toml")


torch = pytest.importorskip("torch")


def test_cpu_grid_round_trips_through_the_loader(tmp_path):
    from meshplan.runtime.bench.grid import fragment_toml, source_line, sweep_attention, sweep_gemm, write_fragment

    pts = sweep_gemm([(64, 64, 64), (128, 64, 32)], "fp32", "cpu", warmup=1, repeats=2)
    rows = sweep_attention({16: [32, 64]}, "fp32", "cpu", warmup=1, repeats=2, tokens=128, model_dim=64)
    src = source_line("gemm", "cpu")
    assert src.startswith("meshplan bench gemm on cpu") and "CPU" in src and f"torch {torch.__version__}" in src
    path = write_fragment(fragment_toml("h200-sxm-141gb", src, gemm={"fp32": pts}, attention=rows),
                          tmp_path / "k.toml")
    assert "[gpu.h200-sxm-141gb.gemm]" in path.read_text()
    frag = load_fragment(path)
    assert frag.gpu == "h200-sxm-141gb" and frag.source == src and frag.prefer == ("SDPA",)
    d = with_fragment(kernel_data("h200-sxm-141gb"), frag)
    gpu = catalog.gpu("h200-sxm-141gb")
    rate, how = gemm_tflops(d, 128, 64, 32, "fp32", lambda m, n, k: compute_efficiency(gpu, m, n, k))
    assert rate == pts[1][3] and how.startswith("measured")
    assert d.gemm["fp8"] == kernel_data("h200-sxm-141gb").gemm["fp8"]  # other dtypes kept
    assert [(r.pass_, r.mask, r.dtype) for r in frag.attention] == [
        ("fwd", "causal", "fp32"), ("bwd", "causal", "fp32"), ("fwd", "none", "fp32"), ("bwd", "none", "fp32")]
    # batch 128 / 64 = 2, heads 64 / 16 = 4, causal forward FLOP 4 B S^2 H d / 2
    a = Attention(batch=2, q_heads=4, kv_heads=4, seq_q=64, seq_kv=64, head_dim=16)
    f, b, how = attention_seconds(d, a, dtype="fp32")
    flops = 4 * 2 * 64 * 64 * 4 * 16 / 2
    assert f == pytest.approx(flops / (rows[0]["tflops"][1] * 1e12))
    assert b == pytest.approx(2.5 * flops / (rows[1]["tflops"][1] * 1e12))
    assert "SDPA fp32 fwd causal d16" in how
    with pytest.raises(ConfigError, match="exists"):
        write_fragment("x", path)


def test_cli_bench_gemm_grid_on_cpu(tmp_path):
    from typer.testing import CliRunner

    from meshplan.cli import app
    from meshplan.runtime.bench.grid import CPU_GEMM

    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[model]\nlayers = 2\nhidden = 64\nffn = 128\nq_heads = 4\nkv_heads = 2\nhead_dim = 16\n'
                   'vocab = 256\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                   '[training]\nglobal_batch = 8\nseq_len = 64\nmicro_batch = 2\n'
                   '[mesh]\nnames = ["dp_shard", "tp"]\nshape = [4, 2]\n')
    out = tmp_path / "gemm.toml"
    res = CliRunner().invoke(app, ["bench", "gemm", str(cfg), "--grid", "--out", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    frag = load_fragment(out)
    # CPU rates keyed as the CPU, not as the config's h100-sxm5-80gb (issue 11)
    assert frag.gpu == "cpu" and [p[:3] for p in frag.gemm["fp32"]] == CPU_GEMM
    assert out.read_text().splitlines()[1] == "[gpu.cpu]" and "h100" not in out.read_text()
    assert "on cpu" in frag.source
    assert res.output.splitlines()[1].startswith("the CPU grid, keyed [gpu.cpu], not h100-sxm5-80gb (meshplan bench "
                                                 "gemm on cpu")
    res = CliRunner().invoke(app, ["bench", "gemm", str(cfg), "--grid", "--max-elements", "64", "--out",
                                   str(tmp_path / "g2.toml"), "--device", "cpu"])
    assert isinstance(res.exception, ConfigError) and res.exception.field == "--max-elements"  # main prints one line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: times the catalog's grid on it")
def test_gpu_grid_is_the_catalogs_points(tmp_path):
    from meshplan.runtime.bench.grid import gemm_grid, sweep_gemm

    grid = gemm_grid("h200-sxm-141gb", "bf16", "cuda")
    assert grid == [tuple(p[:3]) for p in kernel_data("h200-sxm-141gb").gemm["bf16"]]
    pts = sweep_gemm(grid[-3:], "bf16", "cuda", repeats=10)
    assert all(0 < p[3] < 989.4 for p in pts)  # below the H100/H200 dense bf16 datasheet peak


@pytest.mark.parametrize("kind", ["gemm", "attention"])
def test_grid_without_a_gpu_needs_device_cpu(tmp_path, monkeypatch, capsys, kind):
    """--device auto without a GPU resolves to the CPU: --grid is refused in one line naming
    --device cpu, and nothing is written (it wrote CPU rates under [gpu.h100-sxm5-80gb])."""
    from meshplan.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[model]\nlayers = 2\nhidden = 64\nffn = 128\nq_heads = 4\nkv_heads = 2\nhead_dim = 16\n'
                   'vocab = 256\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                   '[training]\nglobal_batch = 8\nseq_len = 64\nmicro_batch = 2\n'
                   '[mesh]\nnames = ["dp_shard", "tp"]\nshape = [4, 2]\n')
    with pytest.raises(SystemExit) as done:
        main(["bench", kind, str(cfg), "--grid", "--out", str(tmp_path / "k.toml")])
    out = capsys.readouterr()
    assert (done.value.code, out.out) == (2, "")
    assert out.err == ("error: --grid: no GPU here, so the sweep would time the CPU, not the plan's GPU; run it on "
                       "the GPU, or pass --device cpu for a CPU table keyed [gpu.cpu]\n")
    assert not (tmp_path / "k.toml").exists()
