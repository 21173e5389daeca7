"""meshplan compare on the seed's tensor 8 against tensor 4 (issue 5 item 5)."""

import json

import pytest

from meshplan.compare import compare, table_rows, write_evidence
from meshplan.errors import ConfigError
from meshplan.plan import build_plan
from meshplan.spec.config import load_config


@pytest.fixture(scope="module")
def seed_pair():
    from tests.conftest import EXAMPLES
    return (build_plan(load_config(EXAMPLES / "seed-64gpu.toml")),
            build_plan(load_config(EXAMPLES / "seed-64gpu-tp4.toml")))


def test_tp8_chosen_tp4_rejected_by_memory(seed_pair):
    c = compare(*seed_pair, names=("tp8", "tp4"))
    assert (c.winner, c.rejected) == ("tp8", "tp4")
    assert c.reasons[0].startswith("tp4 (dp_shard 16 x tp 4) is infeasible: peak 70.2 GiB")
    rows = dict((q, (x, y)) for q, x, y in table_rows(c))
    assert rows["wq (M,N,K) eff"][0].startswith("(8192,1024,8192)")
    assert rows["wq (M,N,K) eff"][1].startswith("(8192,2048,8192)")
    # tensor traffic on NVLink halves from tp 8 to tp 4: b*s*h per collective, 2(n-1)/n -> (n-1)/n factors
    assert float(rows["nvlink GB/rank/step"][0]) > 2 * float(rows["nvlink GB/rank/step"][1])


def test_evidence_folder(seed_pair, tmp_path):
    c = compare(*seed_pair, names=("tp8", "tp4"))
    paths = write_evidence(c, tmp_path)
    folder = tmp_path / "rejected-tp4"
    assert {p.name for p in paths} == {"plan.json", "predicted-trace.json", "summary.md", "comparison.json"}
    assert json.loads((folder / "comparison.json").read_text())["rejected"] == "tp4"
    assert "# Rejected: tp4 (dp_shard 16 x tp 4)" in (folder / "summary.md").read_text()
    assert json.loads((folder / "plan.json").read_text())["feasible"] is False
    with pytest.raises(ConfigError, match="exists"):
        write_evidence(c, tmp_path)


def test_both_feasible_faster_wins():
    from meshplan.spec.config import config_from_dict
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
            "training": {"global_batch": 64, "seq_len": 4096, "param_dtype": "fp32"}}
    a = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [8, 2]}}))
    b = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 8]}}))
    c = compare(a, b)
    # tp 8 on Llama-3-8B makes 512-wide q shards and 8x the TP traffic: tp 2 wins by about half
    assert c.winner == "A" and c.a.step_s < 0.6 * c.b.step_s
    assert c.reasons[0] == (f"A predicts a {1 - c.a.step_s / c.b.step_s:.1%} shorter step "
                            f"({c.a.step_s:.3f} s vs {c.b.step_s:.3f} s)")
