"""meshplan bench attention writes a table the compute model reads back (issue 11 item 1)."""

import json

import pytest

pytest.importorskip("torch")

from meshplan import catalog  # noqa: E402
from meshplan.compute.gemm import load_gemm_table  # noqa: E402
from meshplan.compute.layer import layer_cost  # noqa: E402
from meshplan.compute.ops import Workload  # noqa: E402
from meshplan.compute.shapes import Attention, attention_shape  # noqa: E402
from meshplan.errors import ConfigError  # noqa: E402
from meshplan.runtime.bench.attention import row, time_attention, write_table  # noqa: E402
from meshplan.spec.model import ModelSpec  # noqa: E402

TINY = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, head_dim=16, vocab=256)


def test_round_trip_replaces_the_catalog_rates(tmp_path):
    att = attention_shape(TINY, tp=2, cp=1, micro_batch=2, seq_len=64)
    assert att == Attention(2, 2, 1, 64, 64, 16)
    f, b = time_attention(att, "fp32", "cpu", warmup=1, repeats=3)
    assert f > 0 and b > 0
    path = write_table([row(att, f, b, "fp32", "cpu")], tmp_path / "att.json")
    table = load_gemm_table(path)
    key = (2, 2, 1, 64, 64, 16, "fp32")
    assert table.attention == {key: (f, b)} and len(table) == 0
    # the layer's attention ops take the measured times (recompute: the forward again)
    w = Workload(seq_len=64, micro_batch=2, tp=2, dtype="fp32", recompute="selective", flash=True)
    c = layer_cost(TINY, catalog.gpu("h100-sxm5-80gb"), w, table=table)
    times = sorted(o.seconds for o in c.ops if o.kind == "attention")
    assert times == sorted([f, b, f])
    with pytest.raises(ConfigError, match="exists"):
        write_table([], path)


def test_gemm_and_attention_rows_in_one_table_and_errors(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"device": "cpu", "torch": "2.13.0", "rows": [
        {"m": 8, "n": 8, "k": 8, "dtype": "fp32", "seconds": 1e-6},
        {"op": "attention", "batch": 1, "q_heads": 2, "kv_heads": 2, "seq_q": 8, "seq_kv": 8, "head_dim": 4,
         "dtype": "fp32", "forward_s": 2e-6, "backward_s": 5e-6}]}))
    t = load_gemm_table(p)
    assert len(t) == 1 and t.attention[(1, 2, 2, 8, 8, 4, "fp32")] == (2e-6, 5e-6)
    p.write_text(json.dumps([{"op": "attention", "batch": 1, "q_heads": 2, "dtype": "fp32"}]))
    with pytest.raises(ConfigError, match="attention column"):
        load_gemm_table(p)


def test_cli_bench_attention(tmp_path):
    from typer.testing import CliRunner

    from meshplan.cli import app

    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[model]\nlayers = 2\nhidden = 64\nffn = 128\nq_heads = 4\nkv_heads = 2\nhead_dim = 16\n'
                   'vocab = 256\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                   '[training]\nglobal_batch = 8\nseq_len = 64\nmicro_batch = 2\n'
                   '[mesh]\nnames = ["dp_shard", "tp"]\nshape = [4, 2]\n')
    out = tmp_path / "att.json"
    res = CliRunner().invoke(app, ["bench", "attention", str(cfg), "--out", str(out), "--device", "cpu",
                                   "--repeats", "2"])
    assert res.exit_code == 0, res.output
    assert "forward" in res.output and "backward" in res.output
    assert list(load_gemm_table(out).attention) == [(2, 2, 1, 64, 64, 16, "fp32")]
