"""A model's parameter count as printed: billions, millions, or the exact count
(:func:`meshplan.units.param_number`), in ``plan``'s header and the HTML report's model row."""

from __future__ import annotations

from meshplan.report.html_pages import summary_rows
from meshplan.spec.model import ModelSpec
from meshplan.units import param_number

from cli_run import plan_file, run_cli
from configs import job_toml

#: Four layers of hidden 16, ffn 64, plain MLP, LayerNorm, 4 heads of dim 4, vocab 32, tied output.
TINY = {"layers": 4, "hidden": 16, "ffn": 64, "gated_mlp": False, "q_heads": 4, "vocab": 32,
        "tied_embeddings": True, "norm": "layernorm"}


def test_three_ranges():
    """Mixtral 8x22B's 140,630,071,296 (tests/test_newcomer28.py derives it) / 1e9 = 140.630 -> 140.63 B;
    7,500,000 / 1e6 = 7.50 M; below a million the count itself, with separators."""
    assert f"{param_number(140_630_071_296)} params" == "140.63 B params"
    assert f"{param_number(7_500_000)} params" == "7.50 M params"
    assert f"{param_number(13_088)} params" == "13,088 params"
    # the edges: 1e9 is billions, one below it millions; 1e6 is millions, one below it the count
    assert (param_number(10**9), param_number(10**9 - 1)) == ("1.00 B", "1000.00 M")
    assert (param_number(10**6), param_number(10**6 - 1)) == ("1.00 M", "999,999")


def test_tiny_model_header(tmp_path, capsys):
    """The tiny model by hand: a layer has attention 4 x 16 x 16 = 1,024, MLP 2 x 16 x 64 = 2,048 and
    two LayerNorms 2 x 2 x 16 = 64: 3,136, x 4 = 12,544; embedding 32 x 16 = 512 (output tied); final
    norm 2 x 16 = 32: 13,088, which printed as 0.00 B."""
    assert ModelSpec(**TINY).param_count() == 4 * (4 * 16 * 16 + 2 * 16 * 64 + 2 * 2 * 16) + 32 * 16 + 2 * 16 == 13_088
    job = tmp_path / "tiny.toml"
    job.write_text(job_toml(TINY, training={"global_batch": 8, "seq_len": 128}, mesh={"names": ["dp"], "shape": [8]}))
    _, out, _ = run_cli(["plan", job], capsys)
    assert ", vocab 32, 13,088 params" in out
    assert "B params" not in out
    model_row = dict(summary_rows(plan_file(job)))["model"]
    assert model_row.endswith(", vocab 32, 13,088 params")
