"""meshplan compare on the seed's tensor 8 against tensor 4 (issue 5 item 5)."""

import json

import pytest

from meshplan.compare import compare, table_rows, write_evidence
from meshplan.errors import ConfigError
from meshplan.plan import build_plan
from meshplan.config import load_config


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
    tp = [sum(r.sent_bytes_per_step for r in p.stage(0).collectives if r.axis == "tp") for p in seed_pair]
    assert tp[0] > 2 * tp[1]
    # tp8: dp_shard 8 has one rank per node (8 nodes): its ring sends everything through the NIC.
    # tp4: dp_shard 16 has 2 ranks per node: the hierarchical algorithm sends (g-1)/g S = S/2 inside
    # the node and (N-1)/N S/g = 7/8 x S/2 across nodes per call (S: the row's buffer)
    dp = [[r for r in p.stage(0).collectives if r.axis == "dp_shard"] for p in seed_pair]
    assert all(r.algorithm == "hierarchical" for r in dp[1])
    inside = sum(r.size_bytes / 2 * r.per_step for r in dp[1])
    across = sum(7 / 8 * r.size_bytes / 2 * r.per_step for r in dp[1])
    assert float(rows["nvlink GB/rank/step"][0]) == pytest.approx(tp[0] / 1e9, abs=0.05)
    assert float(rows["network GB/rank/step"][0]) == pytest.approx(sum(r.sent_bytes_per_step for r in dp[0]) / 1e9, abs=0.05)
    assert float(rows["nvlink GB/rank/step"][1]) == pytest.approx((tp[1] + inside) / 1e9, abs=0.05)
    assert float(rows["network GB/rank/step"][1]) == pytest.approx(across / 1e9, abs=0.05)


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
    from meshplan.config import config_from_dict
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
            "training": {"global_batch": 64, "seq_len": 4096, "param_dtype": "fp32"}}
    a = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [8, 2]}}))
    b = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 8]}}))
    c = compare(a, b)
    # tp 8 on Llama-3-8B makes 512-wide q shards and 8x the TP traffic: tp 2 wins by about half
    assert c.winner == "A" and c.a.step_s < 0.6 * c.b.step_s
    assert c.reasons[0] == (f"A predicts a {1 - c.a.step_s / c.b.step_s:.1%} shorter step "
                            f"({c.a.step_s:.3f} s vs {c.b.step_s:.3f} s)")


def test_reasons_list_only_differences(seed_pair):
    """wq, wo, w_up, w_down run at 78% on both meshes: no GEMM line explains the verdict."""
    c = compare(*seed_pair, names=("tp8", "tp4"))
    rows = dict((q, (x, y)) for q, x, y in table_rows(c))
    assert rows["wq (M,N,K) eff"][0].endswith(" 78%") and rows["wq (M,N,K) eff"][1].endswith(" 78%")
    assert not [r for r in c.reasons if r.startswith(("wq:", "wo:", "w_up:", "w_down:"))]
    # a GEMM whose efficiency differs is kept: llama3-8b at tp 2 against tp 8
    from meshplan.config import config_from_dict
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
            "training": {"global_batch": 64, "seq_len": 4096, "param_dtype": "fp32"}}
    a = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [8, 2]}}))
    b = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 8]}}))
    c = compare(a, b)
    eff = [dict((g[0], f"{g[4]:.0%}") for g in s.gemms) for s in (c.a, c.b)]
    assert (eff[0]["w_up"], eff[1]["w_up"]) == ("78%", "68%")
    kept = [r for r in c.reasons if r.split(":")[0] in ("wq", "wo", "w_up", "w_down")]
    assert all(eff[0][g] == eff[1][g] for g in ("wq", "wo", "w_down"))
    assert kept == ["w_up: A (4096,7168,4096) at 78% of peak, B (4096,1792,4096) at 68%"]


def test_same_mesh_is_identical_not_a_verdict(seed_pair, tmp_path):
    c = compare(seed_pair[0], seed_pair[0], names=("seed-64gpu", "seed-64gpu"))
    assert c.identical and (c.winner, c.rejected) == ("", "")
    assert c.reasons == ("both configs (seed-64gpu) are the same mesh (dp_shard 8 x tp 8): nothing to choose; "
                         "give two meshes of the workload",)
    assert write_evidence(c, tmp_path) == [] and not list(tmp_path.iterdir())


def test_summary_states_the_rule(seed_pair, tmp_path):
    c = compare(*seed_pair, names=("tp8", "tp4"))
    write_evidence(c, tmp_path)
    text = (tmp_path / "rejected-tp4" / "summary.md").read_text()
    assert ("Chosen: tp8. Rule: a mesh that does not fit (infeasible, or its memory peak above usable HBM) loses to "
            "one that fits; between two that fit, the shorter predicted step wins when it is shorter by more than "
            "2%; within 2%, the lower peak memory (more headroom) wins.") in text
    assert "see meshplan.compare" not in text


def test_cli_refuses_existing_out_before_the_report(tmp_path):
    import subprocess
    import sys

    from tests.conftest import EXAMPLES
    argv = [sys.executable, "-m", "meshplan.cli", "compare", str(EXAMPLES / "seed-64gpu.toml"),
            str(EXAMPLES / "seed-64gpu-tp4.toml"), "--out", str(tmp_path)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "verdict: seed-64gpu (rejected: seed-64gpu-tp4)" in first.stdout
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr == (f"error: --out: {tmp_path / 'rejected-seed-64gpu-tp4'} exists; choose another path or "
                            "pass --force to replace it\n")


def test_advice_for_the_faster_mesh_that_does_not_fit(seed_pair):
    """tp 4 would be faster but does not fit; tp 8, the larger tensor degree, fits: the advice
    names the larger tp as a way to fit (at tp 8's longer step), not as one that does not help."""
    c = compare(*seed_pair, names=("tp8", "tp4"))
    assert c.reasons[1] == (f"tp4 would predict a {1 - c.b.step_s / c.a.step_s:.0%} shorter step "
                            f"({c.b.step_s:.3f} s vs {c.a.step_s:.3f} s) if it fit: a larger tensor degree fits "
                            f"(tp8, tp 8 against tp 4) but gives up that step; to keep it, tp4 needs another axis "
                            f"(cp, pp) or more memory")
    assert c.b.step_s < c.a.step_s and not c.b.feasible and c.a.feasible
