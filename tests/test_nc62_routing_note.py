"""Newcomer trial nc62 #5: the dropless MoE note under ``training.moe_hottest_expert_share`` read
"all-to-alls sized by the busiest ep rank receives 11703 rows (hottest expert 8192)", a broken
sentence; it now says what sizes them. The rows are derived by hand for
examples/mixtral-8x7b_32xh100_ep8-dp32.toml at ep 4 (dp_shard 32 x ep 4, 2 experts per ep rank) and
a hottest-expert share of 0.25."""

from __future__ import annotations

from pathlib import Path

from tests.cli_run import run_main

MIXTRAL = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"


def test_hottest_share_note_says_what_sizes_the_all_to_alls(tmp_path, capsys, monkeypatch):
    """T = 4096 tokens per rank (micro-batch 1 x seq 4096), T x top_k 2 = 8192 copies per rank. The
    hottest expert takes 0.25 of every rank's copies, the other 7 experts 0.75 / 7 each; the ep rank
    holding it holds one more expert (8 / ep 4 = 2 per rank). From each of the 4 ep ranks it receives
    (0.25 + 0.75 / 7) x 8192 = 2925.7 copies, 11,702.9 in all, 11,703 rows whole; its hottest expert
    0.25 x 8192 x 4 = 8192 rows."""
    monkeypatch.setenv("COLUMNS", "400")  # each note on one line
    text = MIXTRAL.read_text().replace("shape = [32, 8]", "shape = [32, 4]")
    text = text.replace('recompute = "full"', 'recompute = "full"\nmoe_hottest_expert_share = 0.25')
    path = tmp_path / "mixtral_ep4_hot.toml"
    path.write_text(text)
    assert run_main("plan", path) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("note MoE dropless (hottest expert 0.25 of the copies): tokens per rank T = 4096, copies T x top_k 2 = "
            "8192; all-to-alls sized by what the busiest ep rank receives, 11703 rows (its hottest expert 8192); "
            "per-expert counts exchanged before each dispatch (8 int64 per rank, timed before it)") in out
    # the table's all-to-all buffer: those rows x hidden 4096 x 2 B (bf16) = 95,870,976 B
    assert "all-to-all │ 4 │ 95,870,976 │ bf16" in out
