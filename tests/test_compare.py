"""meshplan compare on the seed's tensor 8 against tensor 4 (issue 5 item 5)."""

import json

import pytest

from meshplan.compare import compare, table_rows, write_evidence
from meshplan.errors import ConfigError
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.config import load_config
from meshplan.memory.headroom import headroom_words
from tests.cli_run import run_cli
from tests.configs import TP4_MB2, seed_mb2_toml
from tests.nccl_published import ndr_ring_s


@pytest.fixture(scope="module")
def seed_pair():
    from tests.conftest import EXAMPLES
    return (build_plan(load_config(EXAMPLES / "seed-64gpu.toml")),
            build_plan(load_config(EXAMPLES / "seed-64gpu-tp4.toml")))


@pytest.fixture(scope="module")
def mb2_pair(tmp_path_factory):
    """The seed's mesh and its tensor-4 alternative at micro-batch 2 (tests/configs.py): tp 8 peaks
    at 69.1 GiB and fits 79.11 GiB x 0.9 = 71.2 GiB usable, tp 4 at 121.5 GiB does not (50.3 GiB
    short); the mesh is their only difference."""
    seed2 = tmp_path_factory.mktemp("mb2") / "seed-64gpu-mb2.toml"
    seed2.write_text(seed_mb2_toml())
    return build_plan(load_config(seed2)), build_plan(load_config(TP4_MB2))


def test_tp4_fits_tight_and_wins_at_micro_batch_1(seed_pair):
    """At micro-batch 1 the tensor-4 alternative fits (69.7 GiB of 79.11 x 0.9 = 71.2 GiB usable)
    and its step is shorter: it wins, with the headroom warning (1.5 GiB = 2.1% free, under 15%)."""
    c = compare(*seed_pair, names=("tp8", "tp4"))
    assert (c.winner, c.rejected) == ("tp4", "tp8") and c.b.step_s < 0.99 * c.a.step_s
    assert c.decided_by.startswith("shorter step by more than 1%")
    usable = 79.11 * 2**30 * 0.9
    assert c.b.headroom == headroom_words(c.b.peak_bytes, usable, 0.0) == \
        "tight: 1.5 GiB = 2.1% of the usable 71.2 GiB free, under 15%"
    assert c.a.headroom == ""  # tp 8: 43.3 GiB, 27.9 GiB = 39% free


def test_tp8_chosen_tp4_rejected_by_memory(seed_pair, mb2_pair):
    c = compare(*mb2_pair, names=("tp8", "tp4"))
    assert (c.winner, c.rejected) == ("tp8", "tp4")
    # tests/configs.py TP4_MB2: 121.5 GiB at the head's forward > 79.11 x 0.9 = 71.2 GiB usable
    assert c.reasons[0] == ("tp4 (dp_shard 16 x tp 4) is infeasible: peak 121.5 GiB at forward of the head "
                            "(micro-batch 1) on stage 0 > 71.2 GiB usable (79.1 GiB - 10% reserve)")
    c = compare(*seed_pair, names=("tp8", "tp4"))  # micro-batch 1: both fit; the shapes and traffic
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


def test_evidence_folder(mb2_pair, tmp_path):
    c = compare(*mb2_pair, names=("tp8", "tp4"))
    paths = write_evidence(c, tmp_path)
    folder = tmp_path / "rejected-tp4-vs-tp8"
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
    # tp 8 on Llama-3-8B makes 512-wide q shards and 8x the TP traffic: tp 2 wins by about 40%
    # (the uncompiled elementwise kernels, the same bytes per rank on either mesh's tp-split
    # activations, weigh on both)
    assert c.winner == "A" and c.a.step_s < 0.65 * c.b.step_s
    assert c.reasons[0] == (f"A predicts a {1 - c.a.step_s / c.b.step_s:.1%} shorter step "
                            f"({c.a.step_s:.3f} s vs {c.b.step_s:.3f} s)")


def test_reasons_list_only_differences(seed_pair):
    """wo, w_gate, w_up and output run within a point of each other on both meshes (the catalog's
    H100 bf16 points, interpolated, as the step times them): no GEMM line explains the verdict."""
    c = compare(*seed_pair, names=("tp8", "tp4"))
    rows = dict((q, (x, y)) for q, x, y in table_rows(c))
    assert rows["wo (M,N,K) eff"] == ("(8192,8192,1024) 68%", "(8192,8192,2048) 69%")  # 67.9% and 68.9%
    assert rows["w_up (M,N,K) eff"][0].endswith(" 73%") and rows["w_up (M,N,K) eff"][1].endswith(" 73%")
    assert not [r for r in c.reasons if r.startswith(("wo:", "w_gate:", "w_up:", "output:"))]
    assert [r.split(":")[0] for r in c.reasons if r.startswith(("wq:", "wk:", "wv:", "w_down:"))] == [
        "wk", "wv", "w_down", "wq"]
    # GEMMs whose efficiency differs are kept: llama3-8b at tp 2 against tp 8
    from meshplan.config import config_from_dict
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
            "training": {"global_batch": 64, "seq_len": 4096, "param_dtype": "fp32"}}
    a = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [8, 2]}}))
    b = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 8]}}))
    c = compare(a, b)
    eff = [dict((g[0], f"{g[4]:.0%}") for g in s.gemms) for s in (c.a, c.b)]
    # A's wq, 4096 tokens x 4096 / tp 2 x 4096, is a catalog point: 764.1 TFLOP/s (S4, XLA's sm_90
    # bf16 table) of the 989.4 TFLOP/s bf16 dense peak = 77.23% (the shape model alone says 77.87%)
    assert c.a.gemms[0][:4] == ("wq", 4096, 2048, 4096) and abs(c.a.gemms[0][4] - 764.1 / 989.4) < 1e-9
    assert (eff[0]["wq"], eff[1]["wq"]) == ("77%", "54%")
    kept = [r for r in c.reasons if r.split(":")[0] in ("wq", "wo", "w_up", "w_down")]
    assert kept == ["wq: A (4096,2048,4096) at 77% of peak, B (4096,512,4096) at 54%",
                    "w_up: A (4096,7168,4096) at 70% of peak, B (4096,1792,4096) at 77%",
                    "wo: A (4096,4096,2048) at 69% of peak, B (4096,4096,512) at 55%",
                    "w_down: A (4096,4096,7168) at 74% of peak, B (4096,4096,1792) at 69%"]


def test_same_mesh_is_identical_not_a_verdict(seed_pair, tmp_path):
    c = compare(seed_pair[0], seed_pair[0], names=("seed-64gpu", "seed-64gpu"))
    assert c.identical and (c.winner, c.rejected) == ("", "")
    assert c.reasons == ("both configs (seed-64gpu) are the same plan (mesh dp_shard 8 x tp 8, the same knobs) of "
                         "one workload: nothing to choose; give two meshes or plans of the workload",)
    assert write_evidence(c, tmp_path) == [] and not list(tmp_path.iterdir())


def test_summary_states_the_rule(mb2_pair, tmp_path):
    c = compare(*mb2_pair, names=("tp8", "tp4"))
    write_evidence(c, tmp_path)
    text = (tmp_path / "rejected-tp4-vs-tp8" / "summary.md").read_text()
    assert ("Chosen: tp8, decided by: fits where the other does not. Rule: a mesh that does not fit (infeasible, or "
            "its memory peak above usable HBM) loses to one that fits; between two that fit, the search's order: by "
            "predicted step time; within 1% toward fewer axes of degree > 1, then a lower tp*pp*cp*ep, then a lower "
            "tp, then fewer and cheaper settings off their default (no recompute before selective, op, layer, block, full; "
            "no tp overlap; vpp 1; reshard_after_forward at the mesh's default, resharded, kept gathered under "
            "torch's FSDP2 with pp > 1; the even layer split; 1F1B), then a lower peak memory (peaks "
            "within 1% count as equal), then the shorter step.") in text
    assert "see meshplan.compare" not in text


def test_cli_refuses_existing_out_before_the_report(tmp_path, capsys):
    from tests.conftest import EXAMPLES
    argv = ["compare", EXAMPLES / "seed-64gpu.toml", TP4_MB2, "--out", tmp_path]  # TP4_MB2 does not fit (121.5 > 71.2 GiB usable)
    rc, out, err = run_cli(argv, capsys)  # in-process: no interpreter start-up
    assert rc == 0, err
    assert "verdict: seed-64gpu (rejected: seed-64gpu-tp4-mb2)" in out
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == ""
    assert err == (f"error: --out: {tmp_path / 'rejected-seed-64gpu-tp4-mb2-vs-seed-64gpu'} exists; choose another "
                   "path or pass --force to replace it\n")


def test_advice_for_the_faster_mesh_that_does_not_fit(mb2_pair):
    """tp 4 would be faster but does not fit; tp 8, the larger tensor degree, fits: the advice
    names the larger tp as a way to fit (at tp 8's longer step), not as one that does not help.
    Both at micro-batch 2 (tp 4 fits at micro-batch 1), so the mesh is the only difference."""
    c = compare(*mb2_pair, names=("tp8", "tp4"))
    assert c.reasons[1] == (f"tp4 would predict a {1 - c.b.step_s / c.a.step_s:.0%} shorter step "
                            f"({c.b.step_s:.3f} s vs {c.a.step_s:.3f} s) if it fit: a larger tensor degree fits "
                            f"(tp8, tp 8 against tp 4) but gives up that step; to keep it, tp4 needs another axis "
                            f"(cp, pp) or more memory")
    assert c.b.step_s < c.a.step_s and not c.b.feasible and c.a.feasible


# --- compare weighs plans of one workload: the cluster and the workload must match, the knobs may differ ---

def _seed_text() -> str:
    from tests.conftest import EXAMPLES
    return (EXAMPLES / "seed-64gpu.toml").read_text()


# What `meshplan search examples/seed-64gpu.toml --export 1 --to meshplan -o top.toml` wrote (its [training]
# keeps the seed's workload and changes two knobs; its [mesh] adds pp and cp). Before FSDP under a pipeline
# schedule held unsharded gradients till the last micro-batch, the top was pp 2 x dp_shard 4 x cp 2 x tp 4
# with 8 virtual stages (now 89.2 GiB, over the 67.1 GiB usable); tp_comm_overlap is searched only with
# torch_compile (torchtitan's async TP).
TOP = '''[model]
catalog = "llama3-70b"

[cluster]
system = "seed-8x8-2nic"
nodes = 8

[training]
global_batch = 512
seq_len = 8192
param_dtype = "fp32"
reshard_after_forward = false
recompute = "none"

[mesh]
names = ["pp", "dp_shard", "cp", "tp"]
shape = [4, 2, 2, 4]
sequence_parallel = true
pp_schedule = "1f1b"
pp_layer_split = [20, 20, 20, 20]
'''


def test_another_cluster_is_refused_not_called_identical(tmp_path, capsys):
    """The seed on dgx-a100 nodes is the same mesh on another cluster: it was 'identical meshes'
    (exit 0) beside a step 34% shorter. A different cluster, node count or workload field is
    refused, naming the first field and both values. 19 more fields: the GPU's catalog fields that differ,
    device_memory_gib among them since stop 39 (79.11 vs 79.25 GiB), and since ZeRO-Offload the node's
    host_memory_gb (dgx-a100 2000 GB from its datasheet; the seed's node states none)."""
    from tests.conftest import EXAMPLES
    seed = EXAMPLES / "seed-64gpu.toml"
    a100 = tmp_path / "a100.toml"
    a100.write_text(_seed_text().replace('system = "seed-8x8-2nic"', 'system = "dgx-a100"'))
    rc, out, err = run_cli(["compare", seed, a100, "--out", tmp_path / "cmp"], capsys)
    assert (rc, out) == (2, "")
    assert err == ("error: compare: cluster.gpu.name differs: seed-64gpu h100-sxm5-80gb, a100 a100-sxm-80gb (and 19 "
                   "more workload fields); compare weighs two plans of one workload: give both the same [cluster] "
                   "(seed-64gpu is on 8x seed-8x8-2nic, a100 on 8x dgx-a100), or run meshplan step on each to "
                   "compare clusters\n")
    nodes = tmp_path / "n16.toml"
    nodes.write_text(_seed_text().replace("nodes = 8", "nodes = 16").replace("shape = [8, 8]", "shape = [16, 8]"))
    rc, out, err = run_cli(["compare", seed, nodes, "--out", tmp_path / "cmp"], capsys)
    assert rc == 2 and err.startswith("error: compare: cluster.nodes differs: seed-64gpu 8, n16 16; ")
    batch = tmp_path / "gb256.toml"
    batch.write_text(_seed_text().replace("global_batch = 512", "global_batch = 256"))
    rc, out, err = run_cli(["compare", seed, batch, "--out", tmp_path / "cmp"], capsys)
    assert (rc, err) == (2, "error: compare: training.global_batch differs: seed-64gpu 512, gb256 256; compare "
                            "weighs two plans of one workload: give both the same training.global_batch; only the "
                            "mesh and the plan's knobs (micro_batch, recompute, sharding ...) may differ; to weigh "
                            "two workloads (a before/after that changes the batch), run meshplan step on each "
                            "(tokens/s per GPU and MFU compare them), or meshplan search on one for its best mesh\n")


def test_knobs_differ_search_top_against_the_seed(tmp_path, capsys):
    """The seed against search's own top: each differing knob is a row and a --json entry, and
    each side's step and peak memory are what ``meshplan step`` and ``meshplan memory`` give."""
    import jsonschema
    from tests.conftest import EXAMPLES
    seed, top = EXAMPLES / "seed-64gpu.toml", tmp_path / "top.toml"
    top.write_text(TOP)
    doc_path = tmp_path / "c.json"
    rc, out, err = run_cli(["compare", seed, top, "--out", tmp_path / "cmp", "--json", doc_path], capsys)
    assert rc == 0, err
    doc = json.loads(doc_path.read_text())
    # the top's explicit pp_layer_split [20, 20, 20, 20] is the even split of 80 layers over pp 4: no knob
    knobs = [("training.reshard_after_forward", True, False), ("training.recompute", "selective", "none")]
    assert [(k["knob"], k["a"], k["b"]) for k in doc["knobs"]] == knobs
    assert [tuple(r) for r in doc["table"][1:3]] == knobs and doc["table"][3][0] == "feasible"
    printed = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert printed[1:4] == [["training.reshard_after_forward", "true", "false"], ["training.recompute", "selective",
                            "none"], ["feasible", "True", "True"]]
    assert (doc["identical"], doc["winner"], doc["rejected"]) == (False, "top", "seed-64gpu")
    assert doc["reasons"][1].startswith("the meshes differ (seed-64gpu dp_shard 8 x tp 8, top pp 4 x dp_shard 2 x "
                                        "cp 2 x tp 4) and so do training.reshard_after_forward true against false, ")
    assert doc["reasons"][1].endswith(": the difference is theirs together, not the mesh's alone")
    schema = json.loads((EXAMPLES.parent / "meshplan" / "schemas" / "compare.v1.schema.json").read_text())
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(doc)) == []
    for side, path in (("a", seed), ("b", top)):
        for cmd in ("step", "memory"):
            extra = ["--out", tmp_path / f"png-{side}"] if cmd == "memory" else []
            rc, _, err = run_cli([cmd, path, "--json", tmp_path / f"{cmd}-{side}.json", *extra], capsys)
            assert rc == 0, err
        step = json.loads((tmp_path / f"step-{side}.json").read_text())
        memory = json.loads((tmp_path / f"memory-{side}.json").read_text())
        assert doc[side]["step_s"] == step["step_s"] and doc[side]["mfu"] == step["mfu"]
        assert doc[side]["peak_bytes"] == max(s["peak_bytes"] for s in memory["stages"])
    rows = {r[0]: r[1:] for r in doc["table"]}
    assert rows["step time (s)"] == [doc["a"]["step_s"], doc["b"]["step_s"]]
    assert rows["peak memory (B)"] == [doc["a"]["peak_bytes"], doc["b"]["peak_bytes"]]


def test_json_table_holds_numbers_and_booleans(mb2_pair, tmp_path):
    """--json's table (and the evidence's comparison.json) in SI: numbers, booleans, a GEMM as
    its shape and efficiency, null where unresolved; not the printed strings."""
    from meshplan.compare import compare_to_dict
    from meshplan.units import GiB
    c = compare(*mb2_pair, names=("tp8", "tp4"))
    rows = {r[0]: r[1:] for r in compare_to_dict(c)["table"]}
    assert rows["feasible"] == [True, False]
    assert rows["step time (s)"] == [c.a.step_s, c.b.step_s] and isinstance(c.a.step_s, float)
    assert rows["MFU (fraction of peak)"] == [c.a.mfu, c.b.mfu]
    assert rows["peak memory (B)"] == [c.a.peak_bytes, c.b.peak_bytes]
    assert f"{rows['peak memory (B)'][1] / GiB:.1f}" == dict((q, y) for q, x, y in table_rows(c))["peak memory (GiB)"]
    # wq at micro-batch 2: M = 2 x 8192 tokens, N = 8192 / tp 8, K = hidden 8192
    assert rows["wq (M,N,K) efficiency"][0] == {"m": 16384, "n": 1024, "k": 8192, "efficiency": c.a.gemms[0][4]}
    assert rows["network bytes sent per rank per step"] == [c.a.link_bytes["network"], c.b.link_bytes["network"]]
    write_evidence(c, tmp_path)
    assert json.loads((tmp_path / "rejected-tp4-vs-tp8" / "comparison.json").read_text())["table"][1] == ["feasible", True,
                                                                                                  False]


def _seed_with(**training):
    import tomllib

    from meshplan.config import config_from_dict
    from tests.conftest import EXAMPLES
    d = tomllib.loads((EXAMPLES / "seed-64gpu.toml").read_text())
    return build_plan(config_from_dict({**d, "training": {**d["training"], **training}}))


def test_same_mesh_other_recompute_is_weighed_as_the_knob(seed_pair):
    """The seed mesh with selective and with full recompute: not identical; the step is the same
    (the seed's step is bound by exposed FSDP traffic, 324.728 s both), so the search's tie rule
    decides: one setting off its default each, then the cheaper recompute, selective, as the
    search lists them (searchknobs: one rule through the search's key; full won before for its
    lower peak, 19.5 against 43.3 GiB, a criterion the settings now come before). The reason
    names the knob, not the mesh.
    (nicshare4: 331.380 s before FSDP2's reduce-scatters ran on their own stream, sharing the NIC
    max-min (Overlap.fsdp_rs_queue, nic_fair.NicBook). A backward layer's reduce-scatter (31.824 ms
    alone, demand 0.9412 of the NIC) and the next layer's prefetched all-gather (15.925 ms, 0.9404)
    ran one after the other on one queue, 47.749 ms a layer; now the all-gather, issued 0.144 ms
    (the layer's copy-out) after the reduce-scatter, runs beside it, both over half the NIC so each
    at 0.5: the all-gather 15.925 x 0.9404 / 0.5 = 29.952 ms, the reduce-scatter 0.144 ms alone,
    29.952 ms at 0.5 / 0.9412 (15.912 ms of its work), its 15.768 ms left alone: 45.864 ms; the next
    layer's copy-in waits for it (one in flight), 0.216 ms: 46.080 ms a layer. Each micro-batch's
    backward unit 3847.321 -> 3743.881 ms (80 layers and the head's and embedding's units), the
    last one's tail 70.269 -> 39.066 ms: 331.3798 - 64 x 0.103440 - 0.031203 = 324.7284 s.)
    (nc52fixC: the FSDP all-gathers and reduce-scatters cross the 8 nodes and now hold 16 of the
    H100's 132 SMs while they run, row_shares.nccl_net_channels: each backward unit 3743.881 ->
    3743.936 ms, the step-bounding FSDP stream waiting on its slower kernels a little, x 64 units:
    324.7284 + 64 x 0.000055 = 324.7319 s, both sides.)"""
    full = _seed_with(recompute="full")
    c = compare(seed_pair[0], full, names=("selective", "full"))
    assert not c.identical and (c.winner, c.rejected) == ("selective", "full")
    assert c.knobs == (("training.recompute", "selective", "full"),)
    assert c.decided_by == "cheaper recompute (selective vs full)"
    assert c.reasons[:2] == (
        "step times within 1% (selective 324.732 s, full 324.732 s): selective is listed first by the "
        "search's tie rule: cheaper recompute (selective vs full)",
        "same mesh (dp_shard 8 x tp 8); the plans differ in training.recompute selective against full (selective "
        "against full): the difference comes from these knobs, not from the mesh")
    # recompute costs no time here: with torchtitan's FSDP2 units (the embedding re-gathered in
    # every backward) the FSDP stream alone bounds the seed's step, whatever the compute
    assert c.a.step_s <= c.b.step_s < 1.01 * c.a.step_s
    ag, rs = 15.925 * 0.9404 / 0.5, 0.144 + 29.952 + (31.824 - 0.144 - 29.952 * 0.5 / 0.9412)
    assert (round(ag, 2), round(rs, 2), round(rs + 0.216, 2)) == (29.95, 45.86, 46.08) and 15.925 + 31.824 == 47.749
    bw = c.a.step.units.get(0, 0, "B", 3)
    assert (round(bw.duration_s * 1e3, 3), round(bw.tail_s * 1e3, 3)) == (3743.936, 39.066)
    assert 331.3798 - 64 * (3847.321 - 3743.936) / 1e3 - (70.269 - 39.066) / 1e3 == pytest.approx(c.a.step_s, abs=1e-4)


def test_framework_and_its_vocabulary_padding_are_knobs(seed_pair):
    """The seed under Megatron-LM: its vocabulary padding (divisor 128: 128256 -> 129024 at tp 8)
    comes with the framework, a knob beside it, not a workload difference that refuses the
    comparison (torch keeps 128256)."""
    mg = _seed_with(framework="megatron")
    c = compare(seed_pair[0], mg, names=("torch", "megatron"))
    assert ("training.vocab_pad_divisor", 1, 128) in c.knobs and ("training.framework", "torch", "megatron") in c.knobs


def test_advice_does_not_credit_the_mesh_for_a_knob(mb2_pair):
    """tp 8 with full recompute fits where tp 4 with selective does not: the advice names the
    mesh and the recompute together; it said 'a larger tensor degree fits' as if tp alone did.
    Both at micro-batch 2 (tp 4 with selective fits at micro-batch 1: 69.7 of 71.2 GiB)."""
    c = compare(_seed_with(recompute="full", micro_batch=2), mb2_pair[1], names=("tp8-full", "tp4"))
    assert (c.winner, c.rejected) == ("tp8-full", "tp4")
    assert c.reasons[1] == (f"tp4 would predict a {1 - c.b.step_s / c.a.step_s:.0%} shorter step ({c.b.step_s:.3f} "
                            f"s vs {c.a.step_s:.3f} s) if it fit: tp8-full fits with dp_shard 8 x tp 8 against "
                            f"dp_shard 16 x tp 4 and training.recompute full against selective, but gives up that "
                            f"step; to keep it, tp4 needs another axis (cp, pp), a larger tensor degree, more "
                            f"recompute, or more memory")


def test_memory_prefetch_is_a_knob_fragmentation_an_assumption(seed_pair):
    """[memory] prefetch_layers is FSDP2's backward prefetch (a runtime choice): a knob row.
    fragmentation_fraction is an assumption about the allocator: both sides must state the same."""
    import tomllib

    from meshplan.config import config_from_dict
    from tests.conftest import EXAMPLES
    d = tomllib.loads((EXAMPLES / "seed-64gpu.toml").read_text())
    two = build_plan(config_from_dict({**d, "memory": {"prefetch_layers": 2}}))
    c = compare(seed_pair[0], two, names=("seed", "prefetch2"))
    assert c.knobs == (("memory.prefetch_layers", 1, 2),) and not c.identical
    frag = build_plan(config_from_dict({**d, "memory": {"fragmentation_fraction": 0.1}}))
    with pytest.raises(ConfigError, match=r"^compare: memory.fragmentation_fraction differs: seed 0.0, frag 0.1; "):
        compare(seed_pair[0], frag, names=("seed", "frag"))


def test_ep_degree_is_a_mesh_difference():
    """Newcomer finding (issue 11 item 1): Mixtral at dp_shard 32 with ep 8 against ep 4 was
    printed as `dp_shard 32 | dp_shard 32` and, with a knob differing, called the same mesh."""
    from meshplan.compare import compare_to_dict
    from meshplan.config import config_from_dict
    base = {"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
            "training": {"global_batch": 256, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                         "recompute": "full"}}
    a = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "ep"], "shape": [32, 8]}}))
    nb = {**base, "training": {**base["training"], "recompute": "none"}}
    b = build_plan(config_from_dict({**nb, "mesh": {"names": ["dp_shard", "ep"], "shape": [32, 4]}}))
    c = compare(a, b, names=("ep8", "ep4"))
    assert dict((q, (x, y)) for q, x, y in table_rows(c))["mesh"] == ("dp_shard 32 x ep 8", "dp_shard 32 x ep 4")
    assert not any(r.startswith("same mesh") for r in c.reasons)
    assert any(r.startswith("the meshes differ (ep8 dp_shard 32 x ep 8, ep4 dp_shard 32 x ep 4)") for r in c.reasons)
    doc = compare_to_dict(c)
    assert (doc["a"]["mesh"], doc["b"]["mesh"]) == ("dp_shard 32 x ep 8", "dp_shard 32 x ep 4")


def test_reasons_ordered_by_seconds_of_effect():
    """Newcomer finding (issue 11 item 9): Llama-3-70B at 128k tokens, dp_shard 2 x cp 8 x tp 8
    with SP against dp_shard 2 x cp 16 x tp 4: the verdict listed GEMMs 1 point apart before the
    decisive exposed tp (then 10175 ms vs 4493 ms; 9331 ms vs 4120 ms since torch's full AC
    replays no MLP reduce-scatter). Now the step's parts come by their seconds,
    largest first, the GEMMs under the compute part they set, and a part that differs by less
    than 0.1% of the longer step (exposed fsdp: 171.0 ms vs 178.1 ms of 132.0 s) is left out.
    Since torch's CP ring merges are counted (meshplan.compute.ring_attention: eager, cp steps of
    fp32 merges and gradient sums per layer), cp 16's compute is 8.4 s longer, the largest part,
    and cp 8 wins by 2.8% (cp 16 won by 4.2% before, on exposed tp: 114.587 s against 119.669 s).
    Since torch's ring traffic is the table's (issue 11, cp_attention "ring": spec.axes.cp.ring_rows;
    cp crosses nodes at both) each layer gathers K/V at the q heads three times (forward, the
    backward's own, full recompute's replay: 537 MB over 8 ranks, 10.0 ms, at cp 8; 1.07 GB over 16,
    10.7 ms, at cp 16), beside one SDPA step each, and shifts the fp32 dK/dV cp times (134 MB each,
    2.86 ms at cp 8 and 1.43 ms at cp 16): exposed cp 31.7 s against 37.3 s, a larger difference
    (5.6 s) than exposed tp's (5.2 s), so it came second; cp 8 won by 5.7%. Since a shift moves at
    one NIC's rate (meshplan.comm.nccl_algorithms: cp 16 beside tp 4 has 2 cp ranks a node, whose
    group path is 2 NICs, 100 GB/s, but each shift is one message through its sender's NIC), cp 16's
    134 MB shift takes 2.86 ms as cp 8's does: exposed cp 31.7 s against 45.8 s (+14.2 s), now the
    largest difference, ahead of compute (+8.9 s) and exposed tp (-5.2 s); cp 8 wins by 10.4%.
    Since the ring moves K/V at the heads its SDPA reads (kvheads: ``[memory] kv_expanded`` false, the
    default: 8 / tp KV heads, enable_gqa, a quarter of the q heads at both), every gather and shift is 4x
    smaller (cp 8: 67 MB gathered, 1.27 ms; cp 16: 134 MB, 1.38 ms; a shift 16.8 MB, 0.366 ms at both),
    exposed cp 1.9 s against 5.2 s (+3.3 s); the ring kernels' K/V terms shrink so the slowest cp rank is
    rank 0 (its backward SDPA calls loop over L/2 queries) at both, and the repeat_kv copies are gone:
    exposed tp first (-5.7 s), then compute (+4.4 s), exposed cp (+3.3 s); cp 8 wins by 1.6%."""
    from meshplan.compare.reasons import PART_FLOOR
    from meshplan.config import config_from_dict
    base = {"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 16},
            "training": {"global_batch": 32, "seq_len": 131072, "micro_batch": 1, "sharding": "zero3",
                         "recompute": "full"}}
    mesh = {"names": ["dp_shard", "cp", "tp"], "sequence_parallel": True}
    a = build_plan(config_from_dict({**base, "mesh": {**mesh, "shape": [2, 8, 8]}}))
    b = build_plan(config_from_dict({**base, "mesh": {**mesh, "shape": [2, 16, 4]}}))
    c = compare(a, b, names=("cp8", "cp16"))
    pa, pb = c.a.step.parts_s(), c.b.step.parts_s()
    assert c.winner == "cp8" and c.reasons[0].startswith(f"cp8 predicts a {1 - c.a.step_s / c.b.step_s:.1%} shorter")
    # the parts that differ by 0.1% of the longer step or more, largest difference first
    big = sorted((k for k in pa if abs(pb[k] - pa[k]) >= PART_FLOOR * c.b.step_s), key=lambda k: -abs(pb[k] - pa[k]))
    assert big == ["exposed tp", "compute", "exposed cp"]
    assert [r.split(":")[0] for r in (c.reasons[1], c.reasons[2], c.reasons[10])] == big
    assert c.reasons[9].startswith("of compute by kernel kind (each side's critical stage, per step): ")  # trial 24 #3
    # each fp32 dK/dV shift, 131072 / cp x 8 / tp KV heads x 256 x 4 B = 16,777,216 B at both, is one message
    # through its sender's one NIC, whether its cp group has 1 rank a node (cp 8) or 2 (cp 16): 6.6 + 2.7 us + S /
    # 47.10 GB/s = 0.366 ms (tests/nccl_published.py ndr_ring_s: a pair's ring moves S of 2 S at LL's one step;
    # 134,217,728 B and 2.859 ms at the 64 / tp q heads, kv_expanded)
    shift = ndr_ring_s(2, 1, 2 * 16_777_216)
    assert round(shift * 1e3, 3) == 0.366
    for p, cp, tp, per_node in ((a, 8, 8, 1), (b, 16, 4, 2)):
        rows = [r for r in p.stage(0).collectives if r.axis == "cp" and r.op == "send/recv"]
        assert 131072 // cp * 8 // tp * 256 * 4 == 16_777_216 and {r.size_bytes for r in rows} == {16_777_216}
        assert {r.path.ranks_per_node for r in rows} == {per_node}
        assert [r.time_s for r in rows] == pytest.approx([shift] * len(rows), rel=1e-9) and rows
    # under compute, by seconds: the kernel kinds that differ most (meshplan.schedule.kernel_kinds), the ring's
    # merges first: per layer and micro-batch on cp rank 0 (its half-Q steps), eager (ring_attention.ring_bytes),
    # n_q = 1 x 64 / tp heads x 131072 / cp tokens x 128 = 16,777,216 at both and n_kv = 8 / tp KV heads x 131072 /
    # cp x 256 = n_q / 4 (K and V at the KV heads, no repeat_kv), n_q (12 + 27 (cp - 1)) + 4 cp n_kv bytes, run in
    # the forward and again in full recompute's replay, 80 layers x 16 micro-batches, at Triad 2.97 TB/s (at the q
    # heads, n_kv = 2 n_q, rank cp - 1 and 38 B a whole-Q merge: 4.9457 and 10.2674 s)
    merge = lambda tp, cp: (lambda n: 2 * 80 * 16 * (n * (12 + 27 * (cp - 1)) + 4 * cp * n // 4) / 2.97e12)(
        64 // tp * 131072 // cp * 128)
    assert abs(merge(8, 8) - 3.0224) < 1e-3 and abs(merge(4, 16) - 6.2617) < 1e-3
    assert c.reasons[3] == (f"of compute, cp ring merge: cp8 {merge(8, 8) * 1e3:.1f} ms, cp16 "
                            f"{merge(4, 16) * 1e3:.1f} ms ({(merge(4, 16) - merge(8, 8)) * 1e3:+.1f} ms)")
    # the backward's on rank 0: n_q (20 + 13 (cp - 1)) + n_kv (24 + 10 (cp - 1) + 4 (cp - 1) + 8 cp), once, 80 x 16:
    # cp 8 (111 + 186 / 4) n_q = 157.5 n_q, 1138.8 ms; cp 16 (215 + 362 / 4) n_q = 305.5 n_q, 2208.9 ms
    assert round(157.5 * 16_777_216 * 1280 / 2.97e12 * 1e3, 1) == 1138.8
    assert round(305.5 * 16_777_216 * 1280 / 2.97e12 * 1e3, 1) == 2208.9
    assert c.reasons[4].startswith("of compute, cp ring gradient accumulation: cp8 1138.8 ms, cp16 2208.9 ms")
    assert c.reasons[1] == (f"exposed tp: cp8 {pa['exposed tp'] * 1e3:.1f} ms, cp16 {pb['exposed tp'] * 1e3:.1f} ms "
                            f"({(pb['exposed tp'] - pa['exposed tp']) * 1e3:+.1f} ms)")
    # every GEMM of the layer whose efficiency differs by a point or more (issue 11 nits 2: wk and
    # wv were never listed), under the compute part, by the seconds of their effect: the forward's
    # 2 M N K FLOP x 80 layers x 16 micro-batches over 989.4 TFLOP/s x efficiency (the catalog's H100
    # bf16 points, interpolated, as the step times them); w_down at tp 8: 9.620e11 x 1280 / (989.4e12 x
    # 0.6938) = 1794.0 ms against 1714.9 ms at tp 4 (79 ms), wk 3.436e10 x 1280 / (989.4e12 x 0.3754) =
    # 118.4 against 83.9 ms (34.5 ms), wq 533.2 against 502.6 ms (30.6 ms); wo 67.9% against 68.9%,
    # under GEMM_FLOOR's point, w_gate and w_up 73% on both
    assert c.reasons[5:9] == (
        "w_down: cp8 (16384,8192,3584) at 69% of peak, cp16 (8192,8192,7168) at 73%",
        "wk: cp8 (16384,128,8192) at 38% of peak, cp16 (8192,256,8192) at 53%",
        "wv: cp8 (16384,128,8192) at 38% of peak, cp16 (8192,256,8192) at 53%",
        "wq: cp8 (16384,1024,8192) at 67% of peak, cp16 (8192,2048,8192) at 71%")
    assert c.reasons[11].startswith("peak memory: ")
    wk = 2 * 16384 * 128 * 8192 * 80 * 16 / (c.a.plan.config.cluster.gpu.peak_flops("bf16") * c.a.gemms[1][4])
    assert c.a.gemms[1][0] == "wk" and abs(wk - 0.1184) < 5e-4
    assert abs(pa["exposed fsdp"] - pb["exposed fsdp"]) < PART_FLOOR * c.b.step_s
    assert not any(r.startswith(("exposed fsdp", "bubble")) for r in c.reasons)


def test_framework_kernel_choices_itemise_compute():
    """Newcomer trial 3 finding 4 (issue 11): Llama-3-70B at 128k tokens on dp_shard 2 x cp 8 x
    tp 8 under torch (119.7 s; 128.3 s since torch's CP ring merges are counted; 126.0 s since its
    SDPA calls are rated one by one, below) against Megatron-LM
    (85.0 s): 33.9 s (42.5 s; 40.2 s) of the compute part moved with nothing to say why. The reasons now name the attention kernel, FlashAttention-2 under
    torch's SDPA against FlashAttention-3 under Transformer
    Engine (616 TFLOP/s forward), by its seconds: the attention ops of the critical stage per step, 80 layers x
    16 micro-batches x (forward, recompute, backward), 75.02 s against 43.36 s. torch's ring
    (meshplan.compute.ring_attention, L = 131072 / cp 8 = 16,384, 8 heads at tp 8, every call
    8 x 16384^2 x 256 FLOP): cp rank 0 forward one causal L x L call at FA2's 335 TFLOP/s (S 16384)
    and 7 unmasked L/2 x L at 370, backward 322 (the causal call's 16,384 queries) and 7 x 318
    (8,192 queries): 2 x 12.042 + 34.522 = 58.606 ms a layer, 75.02 s (77.32 s when the whole
    was one causal call at S 131072, 335 and 322 held from 16k); the kernel's line -32.36 s, its
    counterfactual with the ring's calls on (the ring's line takes FA3's 0.71 s per-call gain,
    derived below); then torch's eager
    elementwise ops (-6.3 s: -0.8 s before the ring merges, whose eager pass count they switch to
    the compiled one first, telescoped), torch's ring compiled (-2.4 s: its merges, -3.1 s before its
    calls were rated one by one, which the choice switches off with it), Megatron-LM's own
    kernels (+1.6 s) and the fused QKV GEMM (-0.6 s: torch's own wk and wv GEMMs, 128 wide at tp 8,
    are below H100's smallest measured M and N, 256), each choice's counterfactual seconds adding
    up to the compute they move. Since the block is one cp rank's (meshplan.compute.ring_attention.
    slowest_rank) 125.5 s: eager, cp rank 7's ring kernels move 14 n_q more a later step than rank 0's
    (forward merge 38 - 27, dQ 10 - 13, dK/dV 2 x (13 - 10)), 7 x 14 x 16,777,216 B / 2.97 TB/s =
    553.6 us a layer, above rank 0's 375.8 us of slower SDPA (7 x 2.5 x pair x (1/318 - 1/322)), so
    rank 7's calls, with the rank 7 bytes counted before: forward 335 and 7 x 370 (its 8,192 keys),
    backward 8 x 322 (16,384 queries): 74.53 s of attention, compute -39.7 s; under FA3 rank 7 again
    (7 x 2.5 x pair x (1/559 - 1/561) = 43 us of slower SDPA on rank 0), its forward at 646 (8,192 keys)
    against the causal 616 and its backward at 561 (no gain): the ring's line -0.743 s; torch's eager
    elementwise ops -6.4 s, its ring compiled -2.3 s. Since torch's ring traffic is the table's (issue 11,
    cp_attention "ring"; Megatron-LM keeps all-gather CP's rows) torch's side exposes 31.7 s of cp
    (3.3 s before: test_reasons_ordered_by_seconds_of_effect derives it), its compute unchanged: 153.9 s.
    (tep2p: Megatron-LM's side runs its default cp, Transformer Engine's p2p ring: 85.047 s = compute
    73.009 + exposed cp 3.192 + fsdp 0.335 + tp 8.511 under all-gather CP's rows; now 81.930 s = compute
    73.038 + fsdp 0.335 + tp 8.557, no exposed cp: each send of the local K/V, 16,384 tokens x 1 KV head x
    256 x 2 B = 8 MiB, 0.19 ms across nodes, runs beside an attention step of about 1 ms; compute
    +0.029 s, all of it SM contention (0.5755 -> 0.6045 s: NVLink tp collectives now beside other
    kernels), so the compute difference is -39.6 s, -39.7 s before. ringshape: Transformer Engine's
    ring's calls rated one by one as torch's are (meshplan.compute.ring_attention.te_ring, its cp rank
    0 by its calls alone, no merge kernels: forward the causal L x L at 616 and 7 upper-triangle L/2 x
    L at 648 (16,384 keys), backward 561 and 7 x 559 (8,192 queries), where the whole causal call was
    rated at 616 and 561 held from 16k): 43.36 -> 42.65 s of attention, the step 81.9 -> 81.2 s, the
    compute difference -40.4 s; the choice lines the same (TE's ring, switched on while torch's is
    still on, moves nothing), torch's ring's line -3.0 s: its merges, and its rank 7's FA3 calls
    against TE's rank 0's, +0.03 s.)
    (nicshare: the rank timeline shares NICs: cp 8 and fsdp 16 each have one rank a node, so every cp
    transfer crosses the NIC the layer's prefetched FSDP all-gather holds 0.9316 of (200,570,880 B /
    50 GB/s over its 4.3058 ms); one issued beside it runs at its fair half of the NIC: Megatron-LM's 8 MiB
    sends (0.8952) at 0.5 / 0.8952 = 0.559 of their speed, 0.336 ms, still inside the attention step beside
    them: no exposed cp; torch's ring K/V all-gathers (0.9395, 10 ms) at 0.532, beside steps they already
    outlasted: exposed cp 31.7 -> 40.2 s, 153.9 -> 162.3 s; compute unchanged.)
    (te_ring: TE's ring step by step with its correction kernels, meshplan.compute.te_ring. Rank 7 is
    now Megatron-LM's block: by its calls 7 x 3.5 us a layer shorter than rank 0 (forward twice 2 pair
    (1/646 - 1/648) = 5.25 us more a rank, backward 2.5 pair (1/561 - 1/559) = 8.77 us less), but its
    corrections 51 us a rank longer (the whole output and dQ corrected where rank 0 corrects halves:
    2 x (3 n_o + 4 rows) + 3 n_dq over 2.97 TB/s, n_o = n_dq = 8 x 16,384 x 128). Its calls are torch's
    rank 7's under FA3, fa3_rank7 below: 33.299 ms a layer, 42.62 s of attention (42.65 before). Its
    kernels a layer (rows = 131,072; n_k = n_v = 16,384 x 1 KV head x 128; each at least the 4.7 us
    issue floor): forward 8 floored lse kernels (37.6 us), the output's init (4 n_o + 8 rows, 22.95 us)
    and 7 whole corrections (6 n_o + 8 rows, 34.25 us): 300.3 us, again in the full-AC replay; backward
    dQ 4 n_dq (22.60 us) + 7 x 6 n_dq (33.89 us) and 16 floored dK/dV kernels: 335.0 us; three K/V
    buffer copies of 4 (n_k + n_v) = 16.8 MB (5.65 us): 952.5 us, x 80 x 16 = 1.219 s; with the calls'
    -0.031 s the step 81.2 -> 82.4 s, the compute difference -40.4 -> -39.2 s. torch's ring's line
    (TE's ring moves nothing while torch's is on) -3.0 -> -1.8 s: its merges off, TE's kernels on.)
    (testreams: TE runs the forward's lse corrections of steps 0-6 on its other flash stream beside
    calls 1-7 of about 1 ms, meshplan.compute.te_ring.side_stream: 7 floored kernels hidden, twice
    with the full-AC replay, 2 x 7 x 4.7 = 65.8 us a layer: 886.7 us, x 80 x 16 = 1.135 s; the step
    82.4 -> 82.3 s, the compute difference still -39.2 s.)
    (nic49: the units played in time order, every running collective at its max-min share of the NIC
    from each event on (schedule.unit_events), where main's rule left the collective issued first at its
    full speed and gave the later one the rest. Torch's side 162.350 -> 170.005 s, compute unchanged,
    all of it exposed cp. Forward, a layer: the FSDP all-gather (4.3058 ms alone, demand 0.9316)
    runs alone 1.443 ms, then beside the cp K/V all-gather (10.000 ms, 0.9395) at half the NIC each:
    its 2.8628 ms left at 0.5 / 0.9316 take 5.334 ms, it ends at 6.777 ms (4.306 before); the cp
    gather's 2.8387 ms of work done meanwhile, its 7.1613 ms left alone: 12.495 ms (11.339 before, at
    its half beside a gather at full speed), +1.156 ms x 79 layers and +1.554 ms on the first
    (13.347 against 11.793): each forward unit +92.87 ms. Backward, a layer (the recompute's cp K/V
    gather, which its attention waits for): the layer's reduce-scatter (8.5646 ms, demand 0.9367), the
    all-gather two layers on (4.3058 ms, 0.9316) issued 0.144 ms later on FSDP2's other stream, and
    the cp gather (10.000 ms, 0.9395) 1.587 ms after the reduce-scatter: the reduce-scatter alone 0.144
    ms; both FSDP collectives at half 1.443 ms (0.7703 and 0.7745 ms of work); the three at a third
    until the all-gather ends at 11.456 ms (9.869 ms: 3.512 ms of the reduce-scatter's work, 3.502 of
    the cp gather's); the reduce-scatter and the cp gather at half until the reduce-scatter ends at
    19.209 ms (7.753 ms, 4.126 ms of the cp gather's); the cp gather's 2.372 ms left alone: it ends
    19.994 ms after its start, where main ran the reduce-scatter at full speed, then the all-gather
    after it on the same stream, the cp gather at its half beside each (6.977 + 4.306 ms, 6.005 ms of
    work) and its 3.995 ms left alone: 15.278 ms. +4.716 ms a layer x 78, +5.176 and +5.519 ms on the
    two first layers (20.908 and 21.705 against 15.732 and 16.186), and the embedding's all-gather,
    now beside the last reduce-scatter, 14.053 ms (5.276 alone): exposed fsdp +7.46 ms; each backward
    unit +386.02 ms, the last tail 17.698 -> 10.504 ms. 16 x (92.872 + 386.018) - 7.194 = 7655.05 ms.)
    (nc52fixC: NCCL's network collectives now hold their channels' SMs, 16 of the H100's 132
    (row_shares.nccl_net_channels), and both sides' FSDP and cp collectives cross the 16 nodes beside
    the compute: on the branch without es50 torch's SM contention 0.014 -> 4.094 s, compute 112.679 ->
    116.759 s, and the longer compute hides more of the cp gathers, exposed cp 47.711 -> 44.448 s: the
    step 170.005 + 4.080 - 3.263 = 170.82 s; Megatron-LM's contention 0.605 -> 3.249 s, compute 73.430 ->
    76.075 s, the step 82.32 -> 84.97 s; the compute difference -39.25 + (2.645 - 4.080) = -40.68 s. The
    kernels' lines below are per-kernel seconds, unchanged.)
    (es50: torchtitan's full AC runs ``early_stop=False``, so the eager replay re-runs each layer's
    closing TP reduce-scatter too (meshplan.compute.recompute.full_ac_replays_whole): the table's
    backward tp reduce-scatters 241 -> 321 a micro-batch, each 256 MiB (8 x 16,384 tokens x 8192 x 2 B
    over tp 8) at 0.65957 ms, on the compute stream: exposed tp and the step + 80 layers x 16
    micro-batches x 0.65957 ms = 0.8443 s (on int without nc52fixC 170.005 -> 170.849 s); Megatron-LM's
    side already replayed it.)
    (Both, the merge: the two add, each in its own part: torch's contention 4.094 s and exposed cp
    44.448 s as on the branch (the replays lie in exposed tp, not beside the network collectives' kernels),
    its step 170.005 + 0.8443 + 4.080 - 3.263 = 171.66 s; Megatron-LM's 84.97 s, the branch's.)
    (kvheads: torch's side is planned with ``[memory] kv_expanded`` true, K and V repeated to the 8 local q
    heads before SDPA (torchtitan before ff0829c), the sizes every by-hand step above takes (the 537 MB K/V
    gathers sharing the NIC with FSDP). By default the ring moves the 1 local KV head (enable_gqa): 8x
    smaller gathers and shifts, no repeat_kv copies, torch's step 171.66 -> 125.75 s (test_reasons_ordered_by_seconds_of_effect's
    cp8 side), still behind Megatron-LM's 85.0 s.)"""
    from meshplan.compare.kernels import choice_seconds
    from meshplan.config import config_from_dict
    from meshplan.schedule.workload import chunk_costs, workload_of
    base = {"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 16},
            "training": {"global_batch": 32, "seq_len": 131072, "micro_batch": 1, "sharding": "zero3",
                         "recompute": "full"}}
    mesh = {"names": ["dp_shard", "cp", "tp"], "sequence_parallel": True, "shape": [2, 8, 8]}
    a = build_plan(config_from_dict({**base, "mesh": mesh, "memory": {"kv_expanded": True}}))
    b = build_plan(config_from_dict({**base, "training": {**base["training"], "framework": "megatron"}, "mesh": mesh,
                                     "memory": {"kv_expanded": True}}))  # compare weighs one workload; TE's ring reads the KV heads either way
    assert round(step_time(build_plan(config_from_dict({**base, "mesh": mesh}))).step_s, 2) == 125.75  # the default
    c = compare(a, b, names=("torch", "megatron"))
    pa, pb = c.a.step.parts_s(), c.b.step.parts_s()
    slow = [c.a.step.contention_s(), c.b.step.contention_s()]
    tp_rs = next(r for r in a.stage(0).collectives if r.axis == "tp" and (r.phase, r.op) == ("backward", "reduce-scatter"))
    assert tp_rs.per_microbatch == 321 and round(tp_rs.time_s * 1e3, 5) == 0.65957
    assert [round(x, 3) for x in slow] == [4.094, 3.249]
    assert c.a.step_s == pytest.approx(170.005 + 80 * 16 * tp_rs.time_s + (slow[0] - 0.014) + (pa["exposed cp"] - 47.711), abs=2e-3)
    assert (round(c.a.step_s, 1), round(c.b.step_s, 1)) == (171.7, 85.0)  # 170.0 before es50 and nc52fixC; 153.9 before NIC sharing; 162.3 before nic49; 81.2 before te_ring; 82.4 before testreams
    assert "exposed cp" not in pb and 16384 * 1 * 256 * 2 == 8 * 2 ** 20
    assert round(pa["exposed cp"], 1) == 44.4  # 47.7 before nc52fixC, 3.3 s under all-gather CP's rows, 31.7 before NIC sharing, 40.2 before nic49
    # nic49 (docstring): the forward's FSDP all-gather and cp K/V gather, the backward's three, by hand
    ag, kv, rs = 0.5 / 0.9316, 0.5 / 0.9395, 0.5 / 0.9367   # rates at half the NIC
    ag_end = 1.443 + (4.3058 - 1.443) / ag
    assert (round(ag_end, 3), round(ag_end + 10.0 - (ag_end - 1.443) * kv - 1.443, 3)) == (6.777, 12.495)
    assert round(4.3058 + 10.0 - (4.3058 - 1.443) * kv - 1.443, 3) == 11.339   # main: the gather at full speed
    rs_w, ag_w = 0.144 + 1.443 * rs, 1.443 * ag
    third = (4.3058 - ag_w) / ((1 / 3) / 0.9316)
    rs_w, kv_w = rs_w + third * (1 / 3) / 0.9367, third * (1 / 3) / 0.9395
    half = (8.5646 - rs_w) / rs
    assert (round(1.587 + third, 3), round(1.587 + third + half, 3)) == (11.456, 19.209)
    assert round(third + half + 10.0 - kv_w - half * kv, 3) == 19.994
    main_bwd = 6.977 + 4.306 + 10.0 - (6.977 + 4.306) * kv
    assert round(main_bwd, 3) == 15.278 and round(8.5646 - 1.587, 2) == 6.98   # the cp gather 1.587 ms after the RS start
    assert round(16 * (79 * 1.156 + 1.554 + 78 * 4.716 + 5.176 + 5.519 + 7.46) - (17.698 - 10.504), 0) \
        == round((170.005 - 162.350) * 1e3, 0) == 7655   # torch's step before es50 and nc52fixC
    assert round(1 - 200_570_880 / 50e9 / 4.3058e-3, 4) == 0.0684 < 0.5  # the NIC leaves a send less than its half
    assert round(0.1874 / (0.5 / (8 * 2 ** 20 / 50e9 / 0.1874e-3)), 3) == 0.336
    assert round(pb["compute"] - pa["compute"], 1) == -40.7  # -39.25 + (2.645 - 4.080): nc52fixC's contention
    pair = 8 * 16384 ** 2 * 256   # one ring call's FLOP (docstring)
    rank0 = 2 * pair * (1 / 335e12 + 7 / 370e12) + 2.5 * pair * (1 / 322e12 + 7 / 318e12)
    assert round(80 * 16 * rank0, 2) == 75.02
    assert 7 * 14 * 8 * 16384 * 128 / 2.97e12 > 7 * 2.5 * pair * (1 / 318e12 - 1 / 322e12)   # rank 7 is the block
    ring = 2 * pair * (1 / 335e12 + 7 / 370e12) + 2.5 * pair * 8 / 322e12
    assert round(80 * 16 * ring, 2) == 74.53

    def attention_s(s):  # the attention ops of the critical stage's layers, every micro-batch
        chunks = chunk_costs(s.plan, workload_of(s.plan))[s.step.critical_stage]
        return s.plan.micro_batches * sum(o.seconds for ch in chunks for x in ch.layers for o in x.ops
                                          if o.kind == "attention")

    att = attention_s(c.b) - attention_s(c.a)
    # Megatron-LM's: Transformer Engine's ring, cp rank 0 (its 7 upper-triangle backward calls loop
    # over 8,192 queries, 559 against the lower triangle's 561, and outweigh the forward's 646 against
    # 648), forward twice (full AC): 80 x 16 x 33.32 ms = 42.65 s (43.36 s when one causal call at 616 / 561)
    te_rank0 = 2 * pair * (1 / 616e12 + 7 / 648e12) + 2.5 * pair * (1 / 561e12 + 7 / 559e12)
    assert round(80 * 16 * te_rank0, 2) == 42.65
    assert round(80 * 16 * (2 * pair * 8 / 616e12 + 2.5 * pair * 8 / 561e12), 2) == 43.36
    fa3_rank7 = 2 * pair * (1 / 616e12 + 7 / 646e12) + 2.5 * pair * 8 / 561e12
    assert round(80 * 16 * fa3_rank7, 2) == 42.62   # te_ring: Megatron-LM's block is TE's rank 7 (docstring)
    assert (round(attention_s(c.a), 2), round(attention_s(c.b), 2)) == (74.53, 42.62)
    i = c.reasons.index(f"compute: torch {pa['compute'] * 1e3:.1f} ms, megatron {pb['compute'] * 1e3:.1f} ms "
                        f"({(pb['compute'] - pa['compute']) * 1e3:+.1f} ms)")
    kernel_s = dict(choice_seconds(c.a, c.b))["attention_kernels"]
    assert c.reasons[i + 1] == (f"attention kernel: torch FA2 (torch's scaled_dot_product_attention), megatron FA3 "
                                f"(Transformer Engine's fused attention) ({kernel_s * 1e3:+.1f} ms of compute)")
    # the kernel is switched first, with torch's ring still on: the ring's calls at FA3's rows; the ring
    # choice after it takes FA3's per-call gain (fwd 7 unmasked calls at 648 against the causal 616,
    # bwd 7 x 559 at 8,192 queries against 561), twice forward (full AC) and once backward, 80 x 16 times
    # (rank 0's, before the block was one rank's); rank 7's: fwd 7 x 646 (8,192 keys), bwd 7 x 561 as the causal
    assert round(80 * 16 * (2 * 7 * pair * (1 / 648e12 - 1 / 616e12) + 2.5 * 7 * pair * (1 / 559e12 - 1 / 561e12)), 3) == -0.711
    fa3_ring = 2 * 7 * pair * (1 / 646e12 - 1 / 616e12) + 2.5 * 7 * pair * (1 / 561e12 - 1 / 561e12)
    assert round(80 * 16 * fa3_ring, 3) == -0.743
    # the kernel's line ends at torch's ring's rank 7 under FA3; Megatron-LM's attention is TE's rank 7's
    # calls, the same (rank 0's 0.031 s more before te_ring)
    assert att == pytest.approx(kernel_s, abs=2e-3)
    assert round(80 * 16 * (te_rank0 - fa3_rank7), 3) == 0.031
    rows, n, nk = 131_072, 8 * 16384 * 128, 16384 * 128
    k = lambda b: max(b / 2.97e12, 4.7e-6)
    te = (2 * (k(12 * rows) + k(4 * n + 8 * rows) + 7 * k(6 * n + 8 * rows))
          + k(4 * n) + 7 * k(6 * n) + 16 * k(6 * nk) + 3 * k(4 * 2 * nk))
    assert round(te * 1e6, 1) == 886.7 and round(80 * 16 * te, 3) == 1.135   # 952.5, 1.219 before testreams
    assert round(80 * 16 * (te + fa3_rank7 - te_rank0) + 81.2, 1) == 82.3
    assert [r.split(":")[0] for r in c.reasons[i + 2:i + 6]] == [
        "elementwise ops one kernel each (torch without torch_compile)",
        "torch's context-parallel ring attention (fp32 merges and gradient sums)",
        "Megatron-LM's own kernels around the GEMMs", "Q, K and V projected by one GEMM (Megatron-LM; torchtitan b5bcd76's wqkv)"]  # tt50: label
    # the choices' seconds add up to the kernels' compute they move: 40.06 s of the 40.15 s (the rest: the
    # vocabulary padding, 128256 -> 129024, and the dtypes that come with the framework). nc52fixC: the
    # compute part also holds each side's SM contention (a time of the collectives beside it, no kernel
    # choice's), so the choices are weighed against the compute less it: -39.839 s, the same as before
    # nc52fixC to the ms (73.430 - 0.605 - 112.679 + 0.014); against it the choices' -39.18 s leave the
    # 0.66 s rest (1.7%), which the NVLink contention's +0.59 s hid before under the old 0.3% bound
    moved = sum(s for _, s in choice_seconds(c.a, c.b))
    kernels = (pb["compute"] - slow[1]) - (pa["compute"] - slow[0])
    assert round(kernels, 3) == round(73.430 - 0.605 - 112.679 + 0.014, 3) == -39.84
    assert abs(moved - kernels) < 0.017 * abs(kernels)
    # the same mesh and framework: no choice to itemise
    assert choice_seconds(c.a, c.a) == []


def test_a_plan_against_its_megatron_export_imported_back(tmp_path):
    """Trial 3 finding 4's other path: export a torch plan --to megatron, import it back, compare.
    The comparison was refused (training.grad_reduce_dtype unset against the "fp32" Megatron-LM's
    arguments spell, the same reduction) and then called the meshes different (dp_shard 4 x tp 2
    against Megatron-LM's dp 4 x tp 2). Now: the same mesh, the framework and param_dtype knobs,
    and the compute line itemised, the attention kernel first (FA2 against FA3). Since mcore48 the
    import plans today's Megatron-LM (training.megatron_runtime "core", unset on the torch side), which
    was a third knob printed "None" against "core"; since review rv48 a knob counts only where it
    acts on both sides (TrainingKnobs.knob_acts): Megatron-LM's generation does not act on a torch
    plan, and the framework knob already says the runtimes differ."""
    from meshplan.interop.export import export, reimport_options
    from meshplan.interop.foreign import load_any
    from tests.conftest import EXAMPLES
    cfg = load_config(EXAMPLES / "mini_2x4_tp2-dp4.toml")
    text, _ = export(cfg, "megatron", "mini")
    (tmp_path / "mini.args").write_text(text)
    again = load_any(tmp_path / "mini.args", "megatron", reimport_options(cfg, "megatron"))
    assert (cfg.training.grad_reduce_dtype, again.training.grad_reduce_dtype) == (None, "fp32")
    c = compare(build_plan(cfg), build_plan(again), names=("torch", "megatron"))
    # the config's dp_shard and Megatron-LM's dp, both zero3: one name (mesh_words.mesh_text's rule)
    # (the import names Megatron FSDP's sharded data axis dp_shard itself since issue 11)
    assert (c.a.plan.mesh.layout.names, c.b.plan.mesh.layout.names) == (("dp_shard", "tp"), ("dp_shard", "tp"))
    assert (c.a.mesh_text, c.b.mesh_text) == ("dp_shard 4 x tp 2", "dp_shard 4 x tp 2")
    assert c.knobs == (("training.framework", "torch", "megatron"), ("training.param_dtype", "fp32", "bf16"))
    assert c.reasons[1].startswith("same mesh (dp_shard 4 x tp 2); the plans differ in training.framework torch "
                                   "against megatron, training.param_dtype fp32 against bf16")
    assert c.reasons[2].startswith("compute: ") and c.reasons[3].startswith(
        "attention kernel: torch FA2 (torch's scaled_dot_product_attention), megatron FA3 (Transformer Engine's "
        "fused attention) (-")


TOP1 = TOP.replace('names = ["pp", "dp_shard", "cp", "tp"]\nshape = [4, 2, 2, 4]',
                   'names = ["pp", "cp", "tp"]\nshape = [8, 4, 2]').replace("pp_layer_split = [20, 20, 20, 20]\n", "")


def test_compare_decides_as_the_search_orders(tmp_path, capsys):
    """Issue 11 (newcomer trial 4): ``search examples/seed-64gpu.toml --top 6`` listed pp 8 x cp 4
    x tp 2 (59.638 s, 64.4 GiB) as #1 and pp 4 x dp_shard 2 x cp 2 x tp 4 (TOP: 60.084 s, 64.1
    GiB) as #4; ``compare top1.toml row4.toml`` of the two exported rows said ``verdict: row4``
    (within its own 2%, the lower peak). One rule now: within 1% the mesh with fewer axes of
    degree > 1 (3 against 4) comes first, as in the search, and the output names the criterion
    in the search's words. Both under torch.compile, as ``search`` of the seed with
    ``training.torch_compile = true`` ranks them #1 and #2 (both keep parameters gathered, even
    layer split): top1 61.038 s and 66.1 GiB, row4 60.486 s and 64.1 GiB, 0.91% apart (60.305 and
    60.120 s, 0.31%, the ranks #1 and #2 above, before torch's Schedule1F1B calls were modelled
    waited: each adds (m - 1) transfers of 1.434 ms to stage 0's bubble, 511 on top1, 255 on row4,
    0.733 and 0.366 s: every backward's send goes with the next forward's receive in one call
    waited at once, tests/test_golden_steptime.py test_pp2_1f1b). So top1
    is first though both the plain step and the lower peak (the old rule) pick row4. What brought
    them this close is torch's CP ring (meshplan.compute.ring_attention), compiled: per layer
    and micro-batch each rank's local Q is n_q = 8,388,608 elements on both (top1: 64 / tp 2 =
    32 heads x 8192 / cp 4 x 128; row4: 16 heads x 4096 x 128), K and V 2 n_q (repeat_kv), no
    recompute; cp 4 reads and writes n_q (2 + 40) + 2 n_q x 4 = 50 n_q forward and n_q (2 + 40) +
    2 n_q (6 + 40) = 134 n_q backward, cp 2 30 n_q and 74 n_q. On the critical stage, top1's 10
    layers x 512 micro-batches x 184 n_q against row4's 20 x 256 x 104 n_q, at the H100's Triad
    2.97 TB/s (kernels.toml): 2.661 s against 1.504 s, 1.157 s more on top1. Eager the rule is
    not reached: the host's pace under DTensor TP (kernels.toml [host]) holds top1's smaller
    blocks more and its ring runs more passes (69.296 against 66.755 s, the eager search's #8
    and #2).

    Since torch's ring SDPA calls are rated one by one (meshplan.compute.ring_attention.ring_seconds)
    the pair is no longer within 1%: top1 62.040 s, row4 60.764 s, row4 2.1% shorter, and compare
    picks it by the step in either order, as the search's rule does. By hand, FA2 rows (kernels.toml
    S7c, S8) at each call's loop length, cp rank 0 (the slower): top1 at L = 2,048 (32 heads, every
    call 32 x 2048^2 x 256 FLOP) runs one causal 2048 x 2048 call (fwd 298, bwd 291 TFLOP/s) and 3
    unmasked 1024 x 2048 (fwd 362 at 2,048 keys, bwd 260 at 1,024 queries): 1.686 ms a layer, where
    one causal 2048 x 8192 call at S 8192 (333, 318) was 1.493 ms; row4 at L = 4,096 (16 heads) one
    causal (319, 310) and one 2048 x 4096 (368, 291): 1.547 ms against 1.493 ms. Stage 0: top1 10
    layers x 512 micro-batches, +0.989 s; row4 20 x 256, +0.274 s.

    Since the block is one cp rank's (meshplan.compute.ring_attention.slowest_rank): compiled, the
    ring bytes of every rank tie (n_kv = 2 n_q) and rank 0's SDPA is the slower, so both take rank
    0's bytes, its half-Q steps 9 B (a merge, a dQ half) and its dK/dV steps 10 B, where rank
    cp - 1's were counted with 10 B half dK/dV adds: cp 4 forward n_q (12 + 3 x 9) + 2 n_q x 4 = 47,
    backward n_q 39 + 2 n_q (16 + 3 x 10) = 131, 178 n_q; cp 2 29 and 73, 102 n_q: top1 -6 n_q x 10 x
    512, -0.087 s, 61.952 s; row4 -2 n_q x 20 x 256, -0.029 s, 60.735 s; row4 2.0% shorter.

    Since torch's ring traffic is the table's (issue 11, cp_attention "ring": spec.axes.cp.ring_rows),
    each layer's last fp32 dK/dV shift is exposed: row4 (cp 2 on NVLink, 67,108,864 B, 202.1 us) adds
    256 x 20 x 202.1 us = 1.035 s exposed cp and 0.012 s bubble, 61.782 s; top1 (cp 4: 3 of its 4 shifts
    also outlast the SDPA step they run beside) 1.844 s and 0.025 s, 63.821 s; row4 3.2% shorter
    (tests/test_search_explain.py test_no_row_is_faster_than_the_line_says_llama3_70b, the same meshes).

    Under FSDP2's one reduce-scatter in flight (Overlap.fsdp_rs_queue, torch 2.13
    _fsdp_param_group.py 639-658; FSDP over dp_shard x cp, torchtitan's, so top1's cp 4 too) stage 0's
    deferred reduction after its last backward runs each layer's copy-in between the reduce-scatters,
    no longer all ahead of them: top1's 10 layers x 0.8643 ms (tp 2), row4's 20 x 0.4322 ms (tp 4),
    the same bytes a stage: 8.64 ms more of exposed fsdp each, the tail 40.383 -> 49.026 and 411.362
    -> 420.005 ms: top1 63.830 s, row4 61.790 s, still 3.2% shorter.

    Since torch.compile's ring backward waits its K/V all-gather and every dK/dV shift at once
    (schedule.ring_timeline.compiled_ring_backward) a layer and micro-batch exposes the forward's
    max(A - c_f, 0) and the backward's A + cp X, with A the gather's and X a shift's seconds and c_f
    one forward ring step (the SDPA calls and merges / cp): row4 (A 104.6 us, X 202.1 us, c_f 242.0
    us) 0 + 508.8 us, 256 x 20 x 508.8 us = 2.605 s exposed cp (1.035 s before) and 0.018 s more
    bubble, 63.370 s; top1 (A 291.2 us, X 202.1 us, c_f 133.2 us; its backward step, 414.1 us, hid
    the gather and the first 3 shifts before: 1.844 s was 5120 x (158.0 + 202.1) us) 158.0 + 1099.6
    us, 512 x 10 x 1257.6 us = 6.439 s exposed cp and 0.063 s more bubble, 68.479 s; row4 7.5%
    shorter. Both together (the merge of nic50 and cp50): the deferred copy-ins sit in the tail after
    the last backward, the ring's collectives inside each layer's backward, so the two add: row4
    63.3705 + 20 x 0.4322 ms = 63.379 s, top1 68.4786 + 10 x 0.8643 ms = 68.487 s, row4 7.5% shorter.

    (kvheads: the two files are planned with ``[memory] kv_expanded`` true, K and V repeated to the q heads
    before SDPA (torchtitan before ff0829c), the n_kv = 2 n_q every by-hand count above takes. By default the
    ring moves the KV heads (enable_gqa: 4 at top1's tp 2, 2 at row4's tp 4, n_kv = n_q / 4), a quarter of
    the gathers and shifts, and no repeat_kv copies: top1 61.702 s, row4 60.417 s, row4 still first, 2.1%
    shorter.)"""
    import tomllib

    from meshplan.compute.kernel_fragment import kernel_data
    from meshplan.config import config_from_dict
    from meshplan.schedule.workload import chunk_costs, workload_of
    compiled = lambda text: text.replace('recompute = "none"', 'recompute = "none"\ntorch_compile = true') \
        + "\n[memory]\nkv_expanded = true\n"
    default = {n: build_plan(config_from_dict(tomllib.loads(compiled(t).rsplit("[memory]", 1)[0])))
               for n, t in (("top1", TOP1), ("row4", TOP))}
    at_kv = compare(default["row4"], default["top1"], names=("row4", "top1"))
    assert (at_kv.winner, round(at_kv.a.step_s, 3), round(at_kv.b.step_s, 3)) == ("row4", 60.417, 61.702)
    top1, row4 = tmp_path / "top1.toml", tmp_path / "row4.toml"
    top1.write_text(compiled(TOP1))
    row4.write_text(compiled(TOP))
    rc, out, err = run_cli(["compare", top1, row4, "--out", tmp_path / "cmp", "--json", tmp_path / "c.json"], capsys)
    assert rc == 0, err
    doc = json.loads((tmp_path / "c.json").read_text())
    assert (doc["winner"], doc["rejected"], doc["decided_by"]) == (
        "row4", "top1", "shorter step by more than 1% (63.379 s vs 68.487 s, 7.5% shorter)")
    assert (round(doc["a"]["step_s"], 3), round(doc["b"]["step_s"], 3)) == (68.487, 63.379)
    assert doc["reasons"][0] == "row4 predicts a 7.5% shorter step (63.379 s vs 68.487 s)"
    # FSDP2's one reduce-scatter in flight adds the deferred copy-ins to the tail (first paragraph), apart from
    # the ring collectives inside each layer's backward (second): the two add
    assert (round(63.3705 + 20 * 0.4322e-3, 3), round(68.4786 + 10 * 0.8643e-3, 3)) == (63.379, 68.487)
    assert 8192 // 2 * 16 * 256 * 4 == 67_108_864  # row4's shift: 8,192 / cp 2 tokens x 16 heads x (128 + 128) x 4 B
    assert round(60.735 + 256 * 20 * 202.1e-6 + 0.012, 3) == 61.782
    # compiled, every backward collective waited at once (docstring): exposed cp by hand
    assert [round(256 * 20 * (104.6 + 2 * 202.1) * 1e-6, 3), round(512 * 10 * (291.2 - 133.2 + 291.2 + 4 * 202.1) * 1e-6, 3),
            round(5120 * (291.2 - 133.2 + 202.1) * 1e-6, 3)] == [2.605, 6.439, 1.844]
    assert [round(62.040 - 6 * 8_388_608 * 10 * 512 / 2.97e12, 3), round(60.764 - 2 * 8_388_608 * 20 * 256 / 2.97e12, 3)
            ] == [61.953, 60.735]   # 61.952 unrounded: 62.0395
    # the attention of one layer on stage 0, cp rank 0's calls (docstring), and what it adds a step
    ring = lambda pair, calls: sum(pair * (1 / f + 2.5 / b) for f, b in calls) / 1e12
    top1_layer = ring(32 * 2048 ** 2 * 256, [(298, 291)] + [(362, 260)] * 3)
    row4_layer = ring(16 * 4096 ** 2 * 256, [(319, 310), (368, 291)])
    one_call = ring(4 * 32 * 2048 ** 2 * 256, [(333, 318)])   # both: 4 x top1's pairs = 2 x row4's
    assert [round(x * 1e3, 3) for x in (top1_layer, row4_layer, one_call)] == [1.686, 1.547, 1.493]
    assert [round(x, 3) for x in (10 * 512 * (top1_layer - one_call), 20 * 256 * (row4_layer - one_call))] == [0.989, 0.274]
    for path, layer_s, layers in ((top1, top1_layer, 10), (row4, row4_layer, 20)):
        plan = build_plan(config_from_dict(tomllib.loads(path.read_text())))
        att = [o.seconds for chunk in chunk_costs(plan, workload_of(plan))[0] for layer in chunk.layers
               for o in layer.ops if o.kind == "attention"]
        assert sum(att) == pytest.approx(layers * layer_s, rel=1e-3)  # the issue floor aside
    # the ring's bytes on each critical stage (stage 0 of both), derived in the docstring
    n_q, ring_s = 8_388_608, []
    for path, per_layer, layers, micro_batches in ((top1, 178, 10, 512), (row4, 102, 20, 256)):
        plan = build_plan(config_from_dict(tomllib.loads(path.read_text())))
        ops = [o for chunk in chunk_costs(plan, workload_of(plan))[0] for layer in chunk.layers
               for o in layer.ops if o.name.startswith("cp ring")]
        assert sum(o.size_bytes for o in ops) == layers * per_layer * n_q
        triad = kernel_data(plan.config.cluster.gpu).stream_bytes_per_s
        ring_s.append(micro_batches * sum(o.seconds for o in ops))
        assert ring_s[-1] == pytest.approx(micro_batches * layers * per_layer * n_q / triad)
    assert [round(t, 3) for t in ring_s] == [2.574, 1.475]
    # the other order of the files gives the same verdict: compare's own verdict, which the CLI prints as
    # "verdict: ..." (in this order as in the first, where the CLI is run above); the library, not a second
    # CLI run, which would write top1's predicted trace (1,126,302 events) a second time (most of this test's time)
    assert "verdict: row4 (rejected: top1)" in out
    plans = {p.stem: build_plan(config_from_dict(tomllib.loads(p.read_text()))) for p in (row4, top1)}
    again = compare(plans["row4"], plans["top1"], names=("row4", "top1"))
    assert (again.winner, again.rejected, again.none_fit) == ("row4", "top1", False)
    assert again.verdict.startswith("row4 (rejected: top1)") and again.verdict in " ".join(out.split())


NO_FIT = """[model]
catalog = "llama3-405b"
[cluster]
system = "dgx-h100"
nodes = 1
[training]
global_batch = 8
seq_len = 1024
[mesh]
names = ["dp_shard"]
shape = [8]
"""


def test_identical_plans_that_do_not_fit_exit_1(tmp_path, capsys):
    """Issue 11 (newcomer trial 5) item 1: ``compare A.toml A.toml`` of a mesh ``plan`` calls
    infeasible (Llama-3-405B on one 8-GPU node: peak 782.6 GiB against 71.2 GiB usable) printed
    ``verdict: identical plans`` and exited 0; --help says 1 when neither fits."""
    a = tmp_path / "A.toml"
    a.write_text(NO_FIT)
    rc, out, err = run_cli(["compare", a, a, "--out", tmp_path / "cmp", "--json", tmp_path / "c.json"], capsys)
    assert rc == 1
    assert "verdict: identical plans; neither fits\n" in out
    # usable: the H100's runtime total 79.11 GiB (catalog device_memory_gib) x (1 - 0.10) = 71.2 GiB
    reason = "peak 782.6 GiB at backward of layer 1 (micro-batch 0) on stage 0 > 71.2 GiB usable (79.1 GiB - 10% reserve)"
    assert f"  - A (dp_shard 8) is infeasible: {reason}\n" in out
    assert err.splitlines() == [f"infeasible: A: {reason}"]  # one file given twice: its reasons once
    doc = json.loads((tmp_path / "c.json").read_text())
    assert (doc["identical"], doc["none_fit"], doc["winner"], doc["rejected"]) == (True, True, "", "")
    assert not (tmp_path / "cmp").exists() or not list((tmp_path / "cmp").iterdir())
    b = tmp_path / "B.toml"  # two files of the plan: both reasons
    b.write_text(NO_FIT)
    rc, out, err = run_cli(["compare", a, b, "--out", tmp_path / "cmp"], capsys)
    assert rc == 1 and err.splitlines() == [f"infeasible: A: {reason}", f"infeasible: B: {reason}"]


def test_plans_equal_on_every_criterion_choose_neither(tmp_path, capsys):
    """Issue 11 (newcomer trial 5) item 2: a Megatron-LM plan against its own export imported back
    (the mesh spelled dp_shard 4 x tp 2 against dp 4 x tp 2, no knob differs) is equal on every
    number: keys (2, 2, 2), 38.2 GiB, 6.185 s (the peak, at the head's forward, holds the data loader's
    b x s x s mask on the GPU since core49: 40,911,046,656 + 1 x 8192 x 8192 = 40,978,155,520 B, 38.10 ->
    38.16 GiB; r1 plans Megatron Core since mcore48, the generation its
    export runs on and the import plans; under 2022 6.172 s: compute 5789.27 -> 5799.72 ms, 16 micro-batches
    x (1097.36 - 437.87) us, get_batch's five copies over PCIe 5.0 with the loader's 64 MiB mask against
    2022's copy, mask kernels and syncs, less the 22 step-timer syncs x 4.7 us; exposed tp 329.40 -> 331.96
    ms, the three broadcasts (288.15 us a micro-batch against 30.16) less the embedding's reduce-scatter in
    place of its all-reduce). It printed ``verdict: r1 (rejected: r1_mg_back)``,
    ``decided by: listed first (equal on every key)`` and wrote rejected evidence."""
    from tests.conftest import EXAMPLES
    r1 = tmp_path / "r1.toml"
    r1.write_text((EXAMPLES / "mini_2x4_tp2-dp4.toml").read_text().replace(
        "[training]\n", '[training]\nframework = "megatron"\nmegatron_runtime = "core"\nparam_dtype = "bf16"\n'))
    rc, _, err = run_cli(["export", r1, "--to", "megatron", "-o", tmp_path / "r1.args"], capsys)
    assert rc == 0, err
    rc, _, err = run_cli(["import", "megatron", tmp_path / "r1.args", "--cluster", "dgx-h100", "--nodes", "1", "-o",
                       tmp_path / "r1_mg_back.toml"], capsys)
    assert rc == 0, err
    # the import names the zero3 data axis dp_shard (issue 11); spelt dp, as Megatron-LM's own word,
    # the plan is the same on every number
    back = (tmp_path / "r1_mg_back.toml").read_text()
    assert 'names = ["dp_shard", "tp"]' in back
    (tmp_path / "r1_mg_back.toml").write_text(back.replace('names = ["dp_shard", "tp"]', 'names = ["dp", "tp"]'))
    rc, out, err = run_cli(["compare", r1, tmp_path / "r1_mg_back.toml", "--out", tmp_path / "cmp", "--json",
                         tmp_path / "c.json"], capsys)
    assert rc == 0, err
    doc = json.loads((tmp_path / "c.json").read_text())
    assert (doc["a"]["mesh"], doc["b"]["mesh"], doc["knobs"]) == ("dp_shard 4 x tp 2", "dp_shard 4 x tp 2", [])
    assert (doc["equal"], doc["winner"], doc["rejected"], doc["decided_by"]) == (True, "", "", "")
    assert "verdict: equal (no criterion separates them)\n" in out and "decided by" not in out
    assert round(5789.27 + (16 * (1097.36 - 437.87) - 22 * 4.7) / 1e3, 2) == 5799.72
    assert doc["reasons"][0] == ("r1 and r1_mg_back are equal on every criterion of the search's rule (step 6.185 s, "
                                 "2 axes of degree > 1, tp*pp*cp*ep 2, tp 2, settings none, peak memory 38.2 GiB): "
                                 "nothing to choose")
    assert not (tmp_path / "cmp").exists() or not list((tmp_path / "cmp").iterdir())


def test_equal_line_says_axis_for_one_axis():
    """Issue 11 (newcomer trial 6) item 3: an equal verdict of two dp-only meshes printed
    "1 axes of degree > 1"; one axis is singular, two stay plural."""
    from types import SimpleNamespace
    from meshplan.compare.verdict import _equal_line
    from meshplan.units import GiB
    a, b = (SimpleNamespace(name=n, step_s=1.5, peak_bytes=20 * GiB, simplicity=(1, 1, 1)) for n in ("a", "b"))
    assert _equal_line(a, b) == ("a and b are equal on every criterion of the search's rule (step 1.500 s, 1 axis of "
                                 "degree > 1, tp*pp*cp*ep 1, tp 1, peak memory 20.0 GiB): nothing to choose")
    a.simplicity = (2, 2, 2)
    assert "2 axes of degree > 1" in _equal_line(a, b)


def test_compute_line_names_the_kernel_kinds_that_differ():
    """The newcomer trial's pair (tests/test_search_explain.py::_trial_pair: dp_shard 16 x tp 4 at
    micro-batch 1 against dp_shard 8 x cp 2 x tp 4 at 2, torchtitan, compiled): compare said only
    'compute +91.4 ms'. The same frameworks' kernels on both sides, so under the compute line the three
    kernel kinds that differ most, by hand there: SP layout copies 43.38 ms, the CP ring's backward
    accumulation 33.44 ms and forward merges 13.56 ms (90.4 of the 91.4 ms). Since torch's ring
    SDPA calls are rated one by one (meshplan.compute.ring_attention.ring_seconds) the compute is
    +100.0 ms: cp2's attention is 8.6 ms longer, below the three. By hand: per layer cp rank 0 runs a
    causal 4096 x 4096 call (FA2 fwd 319, bwd 310 TFLOP/s at S 4096) and an unmasked 2048 x 4096
    (fwd 368 at its 4,096 keys, bwd 291 at its 2,048 queries), each 2 x 16 x 4096^2 x 256 =
    137,438,953,472 FLOP, where tp4 runs one causal 8192 x 8192 call, twice that, at 333 and 318:
    (1/319 + 1/368 - 2/333 + 2.5 (1/310 + 1/291 - 2/318)) x 1.374e11 / 1e12 = 0.107 ms, 80 layers
    8.56 ms. Since the block is one cp rank's (meshplan.compute.ring_attention.slowest_rank) +99.1 ms:
    compiled, every rank's ring bytes tie and rank 0's SDPA is the slower, so rank 0's bytes, its
    half-Q merge and dQ steps 9 B where rank 1 was counted with a 10 B half dK/dV add: forward n_q
    (12 + 9) + 2 n_q x 4 = 29 n_q (30 before), backward n_q 21 + 2 n_q (16 + 10) = 73 n_q (74):
    13.56 x 29 / 30 = 13.1 ms and 33.44 x 73 / 74 = 33.0 ms. Since torch's ring traffic is the table's
    (issue 11, cp_attention "ring") +109.3 ms: cp2's compute is slowed while NCCL holds 24 of the 132
    SMs (schedule.comm_times.nccl_sm_share) over the overlapped ring collectives, per layer 2 K/V
    gathers of 195.7 us and the first dK/dV shift of 384.3 us instead of 2 x 36.3 us:
    80 x (775.7 - 72.6) us x 24 / 132 = 10.2 ms. Since torch.compile's ring backward waits its gather and
    shifts at once (schedule.ring_timeline.compiled_ring_backward) +100.9 ms: only the forward's gather
    runs beside compute, 80 x (195.7 - 72.6) us x 24 / 132 = 1.79 ms over the 99.1 ms. Since NCCL's
    network collectives hold their channels' SMs (nc52fixC: 16 of 132 on a DGX H100,
    row_shares.nccl_net_channels), each side's cross-node FSDP gathers and reduce-scatters slow the
    compute beside them: SM contention tp4 0.66 -> 237.98 ms, cp2 3.51 -> 232.36 ms, so +100.9 +
    (232.36 - 3.51) - (237.98 - 0.66) = +92.4 ms."""
    from test_search_explain import _trial_pair
    (p1, _), (p2, _) = _trial_pair()
    c = compare(p1, p2, names=("tp4", "cp2"))
    i = next(k for k, r in enumerate(c.reasons) if r.startswith("compute: "))
    assert c.reasons[i].endswith("(+92.4 ms)")
    slow = [round(s.step.contention_s() * 1e3, 2) for s in (c.a, c.b)]
    assert slow == [237.98, 232.36] and round(100.9 + (slow[1] - 3.51) - (slow[0] - 0.66), 1) == 92.4
    assert round(99.1 + 80 * (2 * 195.7 + 384.3 - 2 * 36.3) * 24 / 132 / 1e3, 1) == 109.3
    assert (round(13.56 * 29 / 30, 1), round(33.44 * 73 / 74, 1)) == (13.1, 33.0)
    assert c.reasons[i + 1:i + 4] == ("of compute, SP layout copy: tp4 0.0 ms, cp2 43.4 ms (+43.4 ms)",
                                      "of compute, cp ring gradient accumulation: tp4 0.0 ms, cp2 33.0 ms (+33.0 ms)",
                                      "of compute, cp ring merge: tp4 0.0 ms, cp2 13.1 ms (+13.1 ms)")


def test_no_kernel_kind_lines_where_a_framework_choice_differs():
    """torch against Megatron-LM on one mesh: the choice lines itemise the kernels (attention kernel,
    fused QKV ...); no 'of compute, <kind>' line repeats what they moved."""
    from meshplan.config import config_from_dict
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1",
                         "recompute": "none"},
            "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2], "sequence_parallel": True}}
    mega = build_plan(config_from_dict({**base, "training": {**base["training"], "framework": "megatron"}}))
    torch = build_plan(config_from_dict({**base, "training": {**base["training"], "sharding": "zero3"}}))
    c = compare(torch, mega, names=("torch", "megatron"))
    assert any(r.startswith("attention kernel: ") for r in c.reasons)
    assert not any(r.startswith("of compute, ") and "waiting for the host" not in r for r in c.reasons)


def test_compute_line_names_the_recompute_difference():
    """Newcomer finding (Llama-3-70B at 32k tokens on 1,024 H200, the plans differing in recompute):
    the compute line was explained by cp ring and silu lines only, though ``step``'s recompute line
    differed by more than the gap. Here (128 dgx-h200, dp_shard 64 x cp 2 x tp 8, 4 micro-batches)
    the mesh and kernels are one, so the whole compute difference is the replay: ``step`` prints
    full recompute 619.772 ms per micro-batch (2479.09 ms per step) and selective 171.415 ms
    (685.66 ms), 2479.09 - 685.66 = 1793.43 ms, the compute line's -1793.4 ms. (628.136 and 179.779
    ms before torch's ring calls were rated one by one, meshplan.compute.ring_attention.ring_seconds:
    both replay the attention's forward, cp 2 at 32k, L 16,384, 8 heads, whose second call is
    unmasked, H200's SDPA fwd 620.73 TFLOP/s against the causal 555.19 at S 16384 (kernels.toml
    M1): (1/620.73 - 1/555.19) x 8 x 16384^2 x 256 / 1e12 x 80 layers = -8.364 ms on each.)
    Since the block is one cp rank's (meshplan.compute.ring_attention.slowest_rank): 620.438 and
    172.081 ms (2481.75 and 688.32 ms a step), compute 10575.5 and 8782.1 ms. Eager, cp rank 1's ring
    kernels move 14 n_q more than rank 0's (forward merge 38 - 27, dQ 10 - 13, dK/dV 2 x (13 - 10)),
    14 x 16,777,216 B / 4.15 TB/s = 56.6 us, above rank 0's 52.7 us of slower SDPA (M1: fwd 1/620.73
    - 1/614.95, bwd 2.5 (1/508.08 - 1/519.8) at rank 0's 8,192 queries), so rank 1's calls: its
    unmasked forward at 8,192 keys, 614.95 TFLOP/s, replayed by both: (1/614.95 - 1/620.73) x pair x 80
    = +0.666 ms on each. Since NCCL's network collectives hold their channels' SMs (nc52fixC: 16 of 132,
    row_shares.nccl_net_channels) the FSDP gathers and reduce-scatters over 128 nodes slow the compute
    beside them, and not by the same on both sides: A 965.62 ms, B 1039.88 ms of SM contention (3.52 ms
    each before; the same collectives overlap the two sides' compute differently), so
    compute A 11537.6 ms, B 9818.5 ms, -1793.4 + (1039.88 - 965.62) = -1719.2 ms; the recompute line
    is still the replay's -1793.4 ms. Merged with es50 (A's full AC replays each layer's closing tp
    reduce-scatter on the compute stream, where the network collectives beside it slow no kernel): A's
    contention 965.62 -> 963.12 ms, read from the model, its compute 11535.1 ms; B (selective) unchanged:
    -1793.4 + (1039.88 - 963.12) = -1716.7 ms. (kvheads: planned with ``[memory] kv_expanded`` true, K and V
    repeated to the q heads (torchtitan before ff0829c), the n_kv = 2 n_q the rank choice above takes; at the
    KV heads, the default, the ring's K/V terms are a quarter.)"""
    from meshplan.config import config_from_dict
    base = {"model": {"catalog": "llama3-70b", "max_position": 32768},
            "cluster": {"system": "dgx-h200", "nodes": 128},
            "training": {"global_batch": 256, "seq_len": 32768, "micro_batch": 1, "sharding": "zero3"},
            "mesh": {"names": ["dp_shard", "cp", "tp"], "shape": [64, 2, 8], "sequence_parallel": True},
            "memory": {"kv_expanded": True}}
    a, b = (build_plan(config_from_dict({**base, "training": {**base["training"], "recompute": r}}))
            for r in ("full", "selective"))
    c = compare(a, b, names=("A", "B"))
    i = c.reasons.index("compute: A 11535.1 ms, B 9818.5 ms (-1716.7 ms)")
    slow = [round(s.step.contention_s() * 1e3, 2) for s in (c.a, c.b)]
    assert slow == [963.12, 1039.88] and round(-1793.4 + slow[1] - slow[0], 1) == -1716.6  # to the rounding
    assert c.reasons[i + 1] == "of compute, recompute (forward replayed in backward): A 2481.8 ms, B 688.3 ms (-1793.4 ms)"
    assert [round(s.step.recompute_s() * 1e3, 3) for s in (c.a, c.b)] == [620.438, 172.081]
    pair = 8 * 16384 ** 2 * 256
    assert 14 * 16_777_216 / 4.15e12 > pair * (1 / 620.73e12 - 1 / 614.95e12 + 2.5 * (1 / 508.08e12 - 1 / 519.8e12))
    assert round(620.438 - 619.772, 3) == round(172.081 - 171.415, 3) == round(
        (1 / 614.95e12 - 1 / 620.73e12) * pair * 80 * 1e3, 3) == 0.666
    assert round((1 / 620.73e12 - 1 / 555.19e12) * 8 * 16384 ** 2 * 256 * 80 * 1e3, 3) == -8.364
    assert round(619.772 - 628.136, 3) == round(171.415 - 179.779, 3) == -8.364
    # the same policy on both sides gets no such line: the cp8/cp16 pair's reasons[2:4] above


def test_megatron_generation_and_recompute_modules_are_knobs_as_they_act():
    """Review rv48: the keys the session added are design choices, weighed as knobs as they act.
    ``megatron_runtime`` unset plans Megatron-LM 2022 (TrainingFields.megatron_core), so unset and
    ``"2022"`` are the same plan (before: a knob row 'unset' against '2022'); ``"core"`` is a knob
    (2022 against core). ``recompute_modules`` refines Megatron-LM's ``selective`` as the float8
    knobs refine linear_dtype (before: refused as a workload difference, "give both the same
    training.recompute_modules"); under ``recompute = "full"`` Megatron-LM does not read it, so it
    is no difference there. ``pp_engine`` (who runs the pipeline) is a knob as zero3_engine is
    (before: a workload difference)."""
    from meshplan.compare.differences import config_differences
    from meshplan.config import config_from_dict

    base = {"model": {"catalog": "megatron-22b"}, "cluster": {"system": "dgx-a100", "nodes": 1},
            "mesh": {"names": ["tp"], "shape": [8]}}
    tr = {"global_batch": 4, "seq_len": 2048, "micro_batch": 4, "framework": "megatron", "sharding": "none"}

    def cfg(**kw):
        return config_from_dict({**base, "training": {**tr, **kw}})

    def diff(a, b):
        d = config_differences(a, b)
        return d.workload, d.knobs

    assert diff(cfg(), cfg(megatron_runtime="2022")) == ((), ())
    assert diff(cfg(), cfg(megatron_runtime="core")) == ((), (("training.megatron_runtime", "2022", "core"),))
    # the data loader's mask only under core, unset on
    assert diff(cfg(megatron_runtime="core"), cfg(megatron_runtime="core", dataloader_attention_mask=True)) == ((), ())
    assert diff(cfg(), cfg(recompute_modules=["core_attn", "mlp"])) == (
        (), (("training.recompute_modules", ("core_attn",), ("core_attn", "mlp")),))
    assert diff(cfg(recompute="full"), cfg(recompute="full", recompute_modules=["core_attn", "mlp"])) == ((), ())
    ds = {"sharding": "zero1", "zero12_engine": "deepspeed"}
    assert diff(cfg(**ds), cfg(**ds, pp_engine="deepspeed")) == (
        (), (("training.pp_engine", "framework", "deepspeed"),))
