"""benchmarks/llmfoundry_a100.py: its rows are what the LLM Foundry README says (checked through
two identities of that table) and the script runs on one row.

Source of the rows: mosaicml/llm-foundry 8c8dd48 ``scripts/train/benchmarking/README.md`` (A100
80GB and 40GB tables, rows of b2a43a1)."""
from __future__ import annotations

import sys

import pytest

from meshplan.config import load_config
from bench_module import bench



def _bench():
    """benchmarks/llmfoundry_a100.py as a module (its ROWS, toml_of and main)."""
    return bench('llmfoundry_a100', 'llmfoundry_a100_rows')


def test_mpt_by_fields_has_the_readme_parameter_count(tmp_path):
    """Each row's model, as the script writes it, has exactly the README's NumParams: the check
    that biases, the learned position table (seq_len rows) and the tied output layer are as the
    runs had them. By hand for MPT-7B at seq 2048: 32 layers x (12 d^2 + 13 d: four weights of
    attention and MLP, their 9 d of biases, two LayerNorms' 4 d) + the final LayerNorm 2 d
    + vocab 50,368 x d + 2,048 x d, d = 4,096: 6,444,154,880 + 8,192 + 206,307,328 + 8,388,608
    = 6,658,859,008."""
    b = _bench()
    assert 32 * (12 * 4096**2 + 13 * 4096) + 2 * 4096 + 50368 * 4096 + 2048 * 4096 == 6_658_859_008
    for r in b.ROWS:
        f = tmp_path / "row.toml"
        f.write_text(b.toml_of(r))
        assert load_config(f).model.param_count() == r.params, r.id


def test_readme_mfu_formula_gives_each_rows_published_mfu():
    """The README's MFU, (6 N + 12 n_layers d_model s) x tokens/s per GPU / 312e12, from each
    row's own NumParams and tokens/s, is its MFU column: the rows' rates and MFUs were copied
    together. The T/s/GPU column is truncated to an integer (70B at 32 GPUs: 11,962 T/s / 32 =
    373.8, printed 373), so the MFU lies between the formula at tokens/s and at tokens/s + 1, to
    the MFU's own rounding (0.005 points). 7B at 2048: (6 x 6,658,859,008 + 12 x 32 x 4,096 x
    2,048) x 4,641 / 312e12 = 64.22% and x 4,642: 64.24%, the column's 64.23%."""
    b = _bench()
    for r in b.ROWS:
        layers, d, _ = b.MPT[r.size]
        per_tps = (6 * r.params + 12 * layers * d * r.seq_len) / 312e12 * 100
        assert per_tps * r.published_tps - 0.005 <= r.published_mfu <= per_tps * (r.published_tps + 1) + 0.005, r.id
        assert r.published_hfu == pytest.approx(r.published_mfu * (4 / 3 if r.ac else 1), abs=0.01), r.id


def test_script_runs_on_one_row(capsys):
    """One row end to end: the published step by hand is 8 GPUs x 6 x 2 sequences x 2,048
    tokens / (8 x 4,641 tokens/s) = 5,295 ms; the row's error is its predicted over published
    tokens/s per GPU, printed with the mean and max over the one row."""
    b = _bench()
    assert b.main(["--only", "7b s2048 8g"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 7b s2048 8g |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "4,641"
    predicted = float(cells[2].replace(",", ""))
    assert cells[3] == f"{predicted / 4641 - 1:+.1%}"
    assert f"mean |error| {abs(predicted / 4641 - 1):.1%}" in out
    assert "7b s2048 8g: published step 5295 ms" in out
    assert "FSDP1 (torch 2.1, FlatParameter per MPTBlock) planned as FSDP2" in out


def test_40gb_rows_are_planned_on_the_40gb_node():
    """The A100 40GB table's rows run on ``dgx-a100-40gb`` (8 A100-SXM 40GB), the 80GB table's on
    ``dgx-a100``; ``toml_of(row, node)`` plans a row on another node (the before/after lines)."""
    b = _bench()
    for r in b.ROWS:
        node = "dgx-a100" if r.gb == 80 else "dgx-a100-40gb"
        assert f'system = "{node}"' in b.toml_of(r), r.id
    r40 = next(r for r in b.ROWS if r.gb == 40)
    assert 'system = "dgx-a100"' in b.toml_of(r40, "dgx-a100")
